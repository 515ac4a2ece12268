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

from lmforge.tools.procs import QUIET_START, kill, start_python

Child = tuple[subprocess.Popen, Any, Any]  # the process, its command pipe's sending end, its outputs' receiving end
_waiting: Child | None = None  # the one child started ahead of its MPClient
_sent: Any = None  # the CoreStart already sent to it, or None


def spawn() -> Child:
    """An engine child interpreter (`core.child_main`), importing its modules while it waits for its CoreStart."""
    child_cmd_recv, cmd_send = Pipe(duplex=False)
    out_recv, child_out_send = Pipe(duplex=False)
    fds = (child_cmd_recv.fileno(), child_out_send.fileno())
    proc = start_python(f"{QUIET_START}from lmforge.engine.core import child_main; child_main({fds[0]}, {fds[1]})",
                        fds)
    child_cmd_recv.close()
    child_out_send.close()
    return proc, cmd_send, out_recv


def prespawn(start: Any = None) -> None:
    """Start the next MPClient's child now, if none waits; with `start` (a `messages.CoreStart`), send it
    now too, so the model loads before the MPClient exists (it must then be built with an equal config)."""
    global _waiting, _sent
    if _waiting is None:
        _waiting, _sent = spawn(), None
        atexit.register(_reap)
    if start is not None and _sent is None:
        try:
            _waiting[1].send(start)
            _sent = start
        except OSError:  # the child died at start: the MPClient that takes it says so
            pass


def take(config: Any) -> tuple[Child, bool]:
    """The waiting child for an MPClient of `config`, and whether its CoreStart was already sent (for an
    equal config); a child started for another config is stopped and a fresh one spawned."""
    global _waiting, _sent
    child, sent, _waiting, _sent = _waiting, _sent, None, None
    if child is None:
        return spawn(), False
    if sent is None:
        return child, False
    if sent.config == config:
        return child, True
    kill(child[0])
    return spawn(), False


def _reap() -> None:
    global _waiting
    if _waiting is not None:
        kill(_waiting[0])
        _waiting = None
