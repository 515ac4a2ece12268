"""Child interpreters: start one with inherited pipe ends, say how one ended, stop one, and the
`Status` a child reports over its pipe (vLLM's `vllm/v1/utils.py` process helpers).

The engine core (`engine/core.py`), the tensor-parallel workers (`engine/worker.py`) and the server's
exchange-log writer (`serve/exchange_log.py`) all run in plain child interpreters (`python -c ...` /
`python -m ...`) rather than multiprocessing's spawn, which re-imports the caller's `__main__`: a
user's script needs no `if __name__ == "__main__"` guard. Every child ignores SIGINT (Ctrl-C reaches
the whole process group; the parent decides when its children stop) and answers its parent with
`Status` values. A leaf, cheap to import (no torch: the exchange-log writer imports it). It knows
nothing about what the children do or about the rest of what crosses their pipes
(`engine/messages.py`).
"""

from __future__ import annotations

import enum
import gc
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class StatusKind(enum.Enum):
    JOINING = "joining"  # a tensor-parallel worker is about to join the process group
    READY = "ready"  # loaded (detail: what the parent needs to know, e.g. an engine core's EngineInfo)
    OK = "ok"  # a batch is done (detail: how many items)
    ERROR = "error"  # failed (detail: the exception, or its text)
    CLOSED = "closed"  # stopped on request
    EXITED = "exited"  # made by the parent, not sent: the child is gone (detail: why)


@dataclass(frozen=True)
class Status:
    """A child process's state change or acknowledgement."""
    kind: StatusKind
    detail: Any = None


def pythonpath() -> str:
    """The child imports this very package, wherever it was imported from."""
    root = str(Path(__file__).resolve().parents[2])
    rest = os.environ.get("PYTHONPATH")
    return root + (os.pathsep + rest if rest else "")


def start_child(args: list[str], fds: tuple[int, ...]) -> subprocess.Popen:
    """`python ARGS...` with the pipe ends `fds` inherited, no stdin, and this package importable."""
    return subprocess.Popen([sys.executable, *args], pass_fds=fds, stdin=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": pythonpath()})


def start_python(code: str, fds: tuple[int, ...]) -> subprocess.Popen:
    """`python -c CODE` (the entry point of an engine child), with `fds` inherited."""
    return start_child(["-c", code], fds)


def exit_cause(returncode: int | None) -> str:
    """'exit code 3' or 'killed by SIGKILL' (a negative return code is the signal's number)."""
    if returncode is not None and returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def kill(proc: subprocess.Popen, timeout: float = 10) -> None:
    """Kill `proc` unless it has exited, and reap it."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=timeout)


def stop(proc: subprocess.Popen, grace_s: float, timeout: float = 10) -> None:
    """Wait up to `grace_s` for `proc` to exit on its own, then kill it."""
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


def ignore_sigint() -> None:
    """In a child: Ctrl-C reaches the whole group; the parent decides when this child stops."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def exit_now(code: int) -> None:
    """Exit at once without tearing the interpreter down (a worker has nothing to save, and torch's
    teardown takes a second of its parent's shutdown)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# `python -c` prefix for a child that starts with the cyclic collector off (`startup_done` turns it back on)
QUIET_START = "import gc; gc.disable(); "


def startup_done() -> None:
    """The cyclic collector back on after a start that ran with it off (`lmforge serve`'s two processes:
    `lmforge.launch`, `QUIET_START`), what the start made moved out of its view (`gc.freeze`, as vLLM's engine
    core does after loading). Importing torch, transformers and the server runs ~3 full collections over ~200k
    objects, and every later full collection would walk them again: `lmforge bench load` of the 300M folder, before
    and after, alternating, 2.94 / 4.27 -> 2.73 / 2.69 s. A no-op where it is already on."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()
