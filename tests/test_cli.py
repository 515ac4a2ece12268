"""The `lmforge` command as users run it: a subprocess of this environment's console script."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

LMFORGE = str(Path(sys.executable).with_name("lmforge"))


def run(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([LMFORGE, *args], capture_output=True, text=True, timeout=timeout)


def test_help_lists_the_verbs():
    proc = run("--help")
    assert proc.returncode == 0, proc.stderr
    for verb in ("doctor", "quickstart", "data", "tokenizer", "train", "export", "runs", "eval", "serve", "bench"):
        assert verb in proc.stdout


def test_each_verb_help_says_what_it_reads_and_writes():
    proc = run("tokenizer", "train", "--help")
    assert proc.returncode == 0 and "tokenizer.json" in proc.stdout
    proc = run("doctor", "--help")
    assert proc.returncode == 0 and "profile" in proc.stdout


def test_unknown_verb_fails():
    assert run("no-such-verb").returncode != 0
