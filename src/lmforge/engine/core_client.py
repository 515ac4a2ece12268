"""How the async front reaches the engine core: one interface, two transports (vLLM's
`vllm/v1/engine/core_client.py`: InprocClient and the multi-process clients behind `EngineCoreClient`).

Both run the same `EngineCore` (`core.py`) and speak the same typed messages (`messages.py`): the
front `send`s `EngineCoreRequest`s, which never block it, and the client calls the front's
`on_outputs(EngineCoreOutputs)` from a thread of its own, and `on_dead(error)` once if the core is
lost.

* `InprocClient`: a background thread owns the `LLMEngine`. Commands wait on a thread-safe queue that
  the thread applies between steps, so the event loop never waits for a step; the thread sleeps on
  an event while there is no work.
* `MPClient`: the engine core runs in a child process (vLLM V1's "engine core" split). In one process
  the step loop and the server's event loop share the GIL: every torch op releases it, and when the
  loop holds it (turning outputs into SSE chunks) the stepping thread waits at each re-acquisition.
  In its own process the forward runs beside the loop on another core; only pickled messages cross:

      front (event loop)        MPClient threads                    child process (core.py)
      send(request) --queue-->  sender:   conn.send(request)  -->   apply commands, step()
      on_outputs(...)      <--  receiver: conn.recv(outputs)  <--   (replies, outputs, stats)

  Commands and their replies keep their order (one pipe each way). If the child dies, `on_dead`
  gets an `EngineDeadError` naming the cause (exit code or signal).

Knows nothing about asyncio or HTTP.
"""

from __future__ import annotations

import os
import queue
import subprocess
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lmforge.tokenizer.load import load_tokenizer
from lmforge.tools.procs import Status, StatusKind, exit_cause, kill, stop

from .config import EngineConfig
from .core import EngineCore
from .llm_engine import LLMEngine
from .messages import CoreStart, EngineCoreOutputs, EngineCoreRequest, EngineDeadError, EngineInfo, RequestType
from .spawn import take

LOAD_TIMEOUT_S = 600.0
OnOutputs = Callable[[EngineCoreOutputs], None]
OnDead = Callable[[EngineDeadError], None]


class EngineCoreClient(ABC):
    """What the front needs of an engine core, wherever it runs."""

    info: EngineInfo  # fixed after construction (its `stats` is the first snapshot)
    tokenizer: Any  # the model's tokenizer, or None (token-id prompts only)

    @abstractmethod
    def start(self, on_outputs: OnOutputs, on_dead: OnDead) -> None:
        """Start delivering: `on_outputs` and `on_dead` run on the client's own thread."""

    @abstractmethod
    def send(self, request: EngineCoreRequest) -> None:
        """Queue a command; never waits for a step."""

    @abstractmethod
    def is_alive(self) -> bool: ...

    @abstractmethod
    def dead_reason(self) -> str | None:
        """Why the core is gone (None while it runs)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the core: requests in flight are aborted, and no output follows."""


class InprocClient(EngineCoreClient):
    """The engine core on a background thread of this process."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine  # the thread's alone once started
        self.core = EngineCore(engine)
        self.info, self.tokenizer = self.core.info(), engine.tokenizer
        self._inbox: queue.SimpleQueue[EngineCoreRequest] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="lmforge-engine", daemon=True)

    def start(self, on_outputs: OnOutputs, on_dead: OnDead) -> None:
        self._on_outputs = on_outputs  # the thread never dies on its own: on_dead is not needed
        self._thread.start()

    def send(self, request: EngineCoreRequest) -> None:
        self._inbox.put(request)
        self._wake.set()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def dead_reason(self) -> str | None:
        return None if self.is_alive() else "the engine thread stopped"

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)
        self.core.abort_all()

    def _loop(self) -> None:
        while not self._stopped:
            self._wake.clear()  # before draining: a command put after the drain sets it again
            requests = []
            while not self._inbox.empty():
                requests.append(self._inbox.get_nowait())
            if requests:  # replies first: an add is accepted before the step in progress ends
                replies = [self.core.apply(r) for r in requests]
                self._on_outputs(EngineCoreOutputs(replies=replies, stats=self.engine.stats()))
            if self.engine.has_unfinished_requests():
                self._on_outputs(self.core.step())
            else:
                self._wake.wait(timeout=0.5)


class MPClient(EngineCoreClient):
    """The engine core in a child interpreter (`core.child_main`), reached over two pipes."""

    def __init__(self, config: EngineConfig):
        (self._proc, self._cmd_send, self._out_recv), started = take(config)  # a prespawned child, if one waits
        self._stopped = False
        self._dead: EngineDeadError | None = None
        try:  # the child computes with the threads this process was given
            if not started:
                self._cmd_send.send(CoreStart(config, os.getpid(), torch.get_num_threads()))
        except OSError:
            pass  # the child died at start: _wait_ready says so
        # the tokenizer here while the child loads the model (for a GGUF file each parses the file, in parallel)
        tokenizer = load_tokenizer(Path(config.model), optional=True)
        status = self._wait_ready()
        if status.kind is not StatusKind.READY:
            kill(self._proc)
            raise status.detail
        self.info = status.detail
        self.tokenizer = tokenizer
        self._outbox: queue.SimpleQueue[EngineCoreRequest | None] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="lmforge-engine-send", daemon=True)
        self._receiver = threading.Thread(target=self._recv_loop, name="lmforge-engine-recv", daemon=True)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _wait_ready(self) -> Status:
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._out_recv.poll(0.2):
                try:
                    return self._out_recv.recv()
                except EOFError:
                    break
            if self._proc.poll() is not None:
                break
        kill(self._proc)
        return Status(StatusKind.ERROR, EngineDeadError(
            f"the engine process exited while loading ({exit_cause(self._proc.returncode)})"))

    def start(self, on_outputs: OnOutputs, on_dead: OnDead) -> None:
        self._on_outputs, self._on_dead = on_outputs, on_dead
        self._sender.start()
        self._receiver.start()

    def send(self, request: EngineCoreRequest) -> None:
        self._outbox.put(request)

    def is_alive(self) -> bool:
        return self._dead is None and self._proc.poll() is None

    def dead_reason(self) -> str | None:
        """Readable as soon as the process has exited, before the receiver has failed the requests."""
        if self._dead is not None:
            return str(self._dead)
        code = self._proc.poll()
        return None if code is None else f"the engine process exited ({exit_cause(code)})"

    def shutdown(self) -> None:
        """Stop the child and wait for it to exit (the receiver then reports it dead)."""
        if self._stopped:
            return
        self._stopped = True
        self._outbox.put(EngineCoreRequest(RequestType.SHUTDOWN, -1))
        self._outbox.put(None)
        stop(self._proc, grace_s=30)
        self._receiver.join(timeout=10)
        # the sender may hold the pipe's fd number mid-`send`: closing it under the sender would let the
        # number be reused by the next engine's pipe (a restart) and the old SHUTDOWN land there before
        # its CoreStart. With the child gone, its send fails at once and it exits on the None.
        if self._sender.ident is not None:
            self._sender.join(timeout=10)
        if not self._sender.is_alive():
            self._cmd_send.close()

    def _send_loop(self) -> None:
        """Sends never block the event loop: a full pipe (the child mid-step) waits here instead."""
        while (request := self._outbox.get()) is not None:
            try:
                self._cmd_send.send(request)
            except (OSError, ValueError):  # the child is gone; the receiver reports it
                return

    def _recv_loop(self) -> None:
        while True:
            try:
                msg = self._out_recv.recv()
            except (EOFError, OSError):
                break
            if isinstance(msg, Status):  # CLOSED: the child stopped on request
                break
            self._on_outputs(msg)
        self._on_exit()

    def _on_exit(self) -> None:
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self._dead = EngineDeadError("AsyncLLMEngine shut down" if self._stopped else
                                     f"the engine process exited ({exit_cause(self._proc.returncode)})")
        self._on_dead(self._dead)
