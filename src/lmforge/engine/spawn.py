"""Engine child processes started before they are needed (`core_client.MPClient` takes them).

An engine child is a fresh interpreter (`core.child_main`) that imports torch and the engine (~1.5 s), then
waits on its command pipe for a `CoreStart` (what to load), loads, and says READY. `lmforge serve` starts one
at its very first step (`lmforge.launch`, before the CLI imports torch), and sends it the `CoreStart` as soon as
its flags are read (`serve.commands.run_server`), so the child imports and loads the model while this process
still imports and builds the server; the MPClient built later adopts it, its start already sent. A child
nobody took is killed at exit.

Imports nothing heavy (no torch): `lmforge.launch` imports it before anything else.
"""

from __future__ import annotations

import atexit
import subprocess
from multiprocessing.connection import Pipe
from typing import Any

from lmforge.tools.procs import kill, start_python

Child = tuple[subprocess.Popen, Any, Any]  # the process, its command pipe's sending end, its outputs' receiving end
_waiting: list[list[Any]] = []  # [child, the CoreStart already sent to it or None]: at most one


def spawn() -> Child:
    """An engine child interpreter (`core.child_main`), importing its modules while it waits for its CoreStart."""
    child_cmd_recv, cmd_send = Pipe(duplex=False)
    out_recv, child_out_send = Pipe(duplex=False)
    fds = (child_cmd_recv.fileno(), child_out_send.fileno())
    proc = start_python(f"from lmforge.engine.core import child_main; child_main({fds[0]}, {fds[1]})", fds)
    child_cmd_recv.close()
    child_out_send.close()
    return proc, cmd_send, out_recv


def prespawn(start: Any = None) -> None:
    """Start the next MPClient's child now, if none waits; with `start` (a `messages.CoreStart`), send it
    now too, so the model loads before the MPClient exists (it must then be built with an equal config)."""
    if not _waiting:
        _waiting.append([spawn(), None])
        atexit.register(_reap)
    entry = _waiting[0]
    if start is not None and entry[1] is None:
        try:
            entry[0][1].send(start)
            entry[1] = start
        except OSError:  # the child died at start: the MPClient that takes it says so
            pass


def take(config: Any) -> tuple[Child, bool]:
    """The waiting child for an MPClient of `config`, and whether its CoreStart was already sent (for an
    equal config); a child started for another config is stopped and a fresh one spawned."""
    if not _waiting:
        return spawn(), False
    child, sent = _waiting.pop()
    if sent is None:
        return child, False
    if sent.config == config:
        return child, True
    kill(child[0])
    return spawn(), False


def _reap() -> None:
    while _waiting:
        kill(_waiting.pop()[0][0])
