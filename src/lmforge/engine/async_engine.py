"""`AsyncLLMEngine`: `LLMEngine` behind asyncio, for the HTTP server.

A background thread owns the `LLMEngine`: nothing else touches it. Submissions and aborts are
commands on a thread-safe queue that the thread applies between steps, so the event loop never
waits for a step (it used to take a lock the stepping thread re-took right after every step, and
a burst of requests stalled every stream). The thread sleeps on an event while there is no work.
Outputs reach each request's `asyncio.Queue` through `loop.call_soon_threadsafe`; `stats()` is a
snapshot the thread replaces after every step and command (a dict swap: no lock). If a step
raises, every request that was in flight gets an `EngineStepError` (and is aborted, freeing its
blocks; the traceback goes to the log, not to the clients); the loop keeps serving new ones. Knows nothing about HTTP.

    engine = AsyncLLMEngine(EngineConfig(model=...))
    async for out in engine.generate("Hello", SamplingParams(max_tokens=16), request_id="r1"):
        print(out.outputs[0].text)   # cumulative text; the delta is text[len(previous):]
    await engine.abort("r1"); engine.shutdown()
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from .config import EngineConfig
from .llm_engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams

Sink = tuple[asyncio.AbstractEventLoop, asyncio.Queue]
log = logging.getLogger("lmforge.engine")


class EngineDeadError(RuntimeError):
    """The engine is gone (shut down, or its process exited): the message names the cause."""


class EngineStepError(RuntimeError):
    """A step raised. Requests are validated at admission, so this is a bug, not the client's fault:
    every request in that step is aborted with this error, which says nothing about its internals
    (the traceback goes to the log)."""

    def __init__(self, message: str = "internal error: the engine step failed and this request was aborted; "
                                      "the server log has the details"):
        super().__init__(message)


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None):
        self.engine = engine or LLMEngine(config)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # (kind, request_id, payload, done future or None)
        self._wake = threading.Event()
        self._sinks: dict[str, Sink] = {}  # the engine thread's alone
        self._stats = self.engine.stats()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="lmforge-engine", daemon=True)
        self._thread.start()

    # ---- what the server reads (fixed after construction, or snapshots) ------------------------------

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def model_path(self) -> str:
        return self.engine.model_path

    @property
    def is_running(self) -> bool:
        """True while the stepping thread serves requests (False after `shutdown()`)."""
        return not self._stopped and self._thread.is_alive()

    @property
    def dead_reason(self) -> str | None:
        """Why the engine is gone (None while it runs)."""
        if self.is_running:
            return None
        return "AsyncLLMEngine shut down" if self._stopped else "the engine thread stopped"

    def stats(self) -> dict:
        """`LLMEngine.stats()` as of the last step or command; never waits."""
        return self._stats

    # ---- requests ------------------------------------------------------------------------------------

    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams | None,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Yield outputs as tokens arrive (cumulative unless `output_kind` says otherwise); the last has
        `finished=True`. Invalid requests raise ValueError before the first yield. Leaving the loop
        early aborts the request."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        accepted = loop.create_future()
        # arrival is now, on the caller's clock, so TTFT counts the wait for the step in progress
        self._submit("add", request_id, (prompt, sampling_params, time.time(), (loop, outputs)), accepted)
        try:
            await accepted  # ValueError -> caller; waits for the step in progress, never blocks the loop
        except asyncio.CancelledError:
            if not self._stopped:
                self._submit("abort", request_id, None, None)  # applied after the add, in order
            raise
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished and not self._stopped:  # the consumer went away or an error: free the blocks
                self._submit("abort", request_id, None, None)

    async def abort(self, request_id: str) -> None:
        """End a request; its blocks are free when this returns. Its stream ends with `abort`."""
        done = asyncio.get_running_loop().create_future()
        self._submit("abort", request_id, None, done)
        await done

    def shutdown(self) -> None:
        """Stop the loop; requests still in flight (or submitted) get a RuntimeError."""
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)
        error = EngineDeadError("AsyncLLMEngine shut down")
        for rid in list(self._sinks):
            self.engine.abort_request(rid)
        self._fail(list(self._sinks), error)
        while not self._inbox.empty():
            _, _, _, done = self._inbox.get_nowait()
            _resolve(done, error)

    def _submit(self, kind: str, request_id: str, payload: Any, done: asyncio.Future | None) -> None:
        if self._stopped:
            raise EngineDeadError("AsyncLLMEngine is shut down")
        self._inbox.put((kind, request_id, payload, done))
        self._wake.set()

    # ---- the engine thread ---------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopped:
            self._wake.clear()  # before draining: a command put after the drain sets it again
            self._apply_commands()
            if self.engine.has_unfinished_requests():
                self._step()
            else:
                self._wake.wait(timeout=0.5)

    def _apply_commands(self) -> None:
        applied = False
        while not self._inbox.empty():
            kind, rid, payload, done = self._inbox.get_nowait()
            applied = True
            if kind == "add":
                prompt, params, arrival_time, sink = payload
                try:
                    self.engine.add_request(rid, prompt, params, arrival_time)
                except Exception as e:  # a bad request: its caller raises it
                    _resolve(done, e)
                    continue
                self._sinks[rid] = sink
                _resolve(done, None)
            else:
                out = self.engine.abort_request(rid)
                self._stats = self.engine.stats()
                sink = self._sinks.pop(rid, None)
                if sink is not None and out is not None:
                    sink[0].call_soon_threadsafe(sink[1].put_nowait, out)
                _resolve(done, None)
        if applied:
            self._stats = self.engine.stats()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:  # never wedge: fail the requests in flight, free their blocks
            log.exception("engine step failed; aborting the %d requests in flight", len(self.engine.requests))
            ids = list(self.engine.requests)
            for rid in ids:
                self.engine.abort_request(rid)
            self._stats = self.engine.stats()
            self._fail(ids, EngineStepError())
            return
        self._stats = self.engine.stats()  # before delivering: a finished request sees its blocks freed
        batches: Batches = {}  # one wake-up per loop per step, not per request
        route_outputs(self._sinks, outputs, batches)
        post_batches(batches)

    def _fail(self, ids: list[str], error: BaseException) -> None:
        for rid in ids:
            sink = self._sinks.pop(rid, None)
            if sink is not None:
                sink[0].call_soon_threadsafe(sink[1].put_nowait, error)


Batches = dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]]


def route_outputs(sinks: dict[str, Sink], outputs: list[RequestOutput], batches: Batches) -> None:
    """Add each output to its request's loop's batch; a finished request leaves `sinks`."""
    for out in outputs:
        sink = sinks.get(out.request_id)
        if sink is not None:
            batches.setdefault(sink[0], []).append((sink[1], out))
            if out.finished:
                del sinks[out.request_id]


def post_batches(batches: Batches) -> None:
    """One `call_soon_threadsafe` per event loop, delivering its whole batch in order."""
    for loop, items in batches.items():
        try:
            loop.call_soon_threadsafe(_deliver, items)
        except RuntimeError:  # that loop is closed: nobody is listening
            pass


def _deliver(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)


def _resolve(done: asyncio.Future | None, error: BaseException | None) -> None:
    """Complete a caller's future from the engine thread (on the caller's loop)."""
    if done is None:
        return

    def settle() -> None:
        if not done.done():  # the caller may have been cancelled meanwhile
            done.set_exception(error) if error is not None else done.set_result(None)

    try:
        done.get_loop().call_soon_threadsafe(settle)
    except RuntimeError:  # that loop is closed: nobody is waiting
        pass
