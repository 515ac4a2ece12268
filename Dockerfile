# lmforge serve in a container, CPU build. A CUDA variant is in docs/deploy.md.
#
#   docker build -t lmforge .
#   docker run --rm -p 8000:8000 -v "$PWD/runs/quickstart/model:/models/model:ro" lmforge
#
# The model folder is mounted read-only at /models/model (a Hugging Face layout folder with its
# tokenizer files, as `lmforge export` writes it). The server runs as an unprivileged user, answers
# the container health check on /health/ready, and stops cleanly on SIGTERM (docs/deploy.md).
FROM python:3.11-slim

# gcc builds the engine's CPU kernels at first use (without it the torch fallback runs, slower)
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev libgomp1 \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/lmforge
COPY requirements.lock pyproject.toml README.md ./
# torch's CPU wheel from PyTorch's CPU index (PyPI's Linux wheel is the multi-GB CUDA build);
# then every other pin, exactly as `make install` does.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX_URL" torch==2.13.0 \
    && pip install --no-cache-dir -r requirements.lock
COPY src ./src
RUN pip install --no-cache-dir --no-deps --no-build-isolation -e .

RUN useradd --create-home --uid 10001 lmforge
USER lmforge
ENV LMFORGE_HOME=/home/lmforge/.lmforge PYTHONUNBUFFERED=1
EXPOSE 8000

# readiness: 200 once the engine serves; 503 while it loads or restarts (the message says why)
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health/ready', timeout=2).status != 200)"

# exec form: lmforge is PID 1 and receives SIGTERM itself, so `docker stop` is a clean shutdown
# (run with --init when something else in the container may leave zombies)
ENTRYPOINT ["lmforge", "serve", "/models/model", "--host", "0.0.0.0", "--port", "8000"]
CMD ["--shutdown-timeout", "20"]
