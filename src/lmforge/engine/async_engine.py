"""`AsyncLLMEngine`: the engine behind asyncio, for the HTTP server; `ProcessAsyncLLMEngine`: the same
front with the engine core in a child process.

The front keeps, per request, where its outputs go (its event loop's `asyncio.Queue`) and, per
command, the future its caller awaits; everything else goes through an `EngineCoreClient`
(`core_client.py`): `InprocClient` (a stepping thread in this process) or `MPClient` (a child
process). Both deliver the same `EngineCoreOutputs`, from a thread of their own, and the front routes
them with one `loop.call_soon_threadsafe` per event loop per delivery, so the event loop never waits
for a step. `stats()` is the snapshot the last delivery carried (a dict swap: no lock). If a step
raises, every request in flight gets an `EngineStepError` (the traceback goes to the log, not to the
clients); if the core is lost (its process exited), every request gets an `EngineDeadError` naming
the cause. Knows nothing about HTTP.

    engine = AsyncLLMEngine(EngineConfig(model=...))     # or ProcessAsyncLLMEngine(...): same surface
    async for out in engine.generate("Hello", SamplingParams(max_tokens=16), request_id="r1"):
        print(out.outputs[0].text)   # cumulative text; the delta is text[len(previous):]
    await engine.abort("r1"); engine.shutdown()
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from .config import EngineConfig
from .core_client import EngineCoreClient, InprocClient, MPClient
from .llm_engine import LLMEngine
from .lora import LoRARequest
from .messages import EngineCoreOutputs, EngineCoreRequest, EngineDeadError, RequestType
from .outputs import RequestOutput
from .sampling_params import SamplingParams

Sink = tuple[asyncio.AbstractEventLoop, asyncio.Queue]


class AsyncLLMEngine:
    """`config` or an already built `engine` run in this process; `client` runs the core elsewhere."""

    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None,
                 client: EngineCoreClient | None = None):
        self.client = client or InprocClient(engine or LLMEngine(config))
        self.engine: LLMEngine | None = getattr(self.client, "engine", None)  # in-process only
        self._lock = threading.Lock()  # guards _sinks and _pending: the event loop and the client's thread
        self._sinks: dict[str, Sink] = {}
        self._pending: dict[int, asyncio.Future | None] = {}  # command id -> its caller's future
        self._ids = itertools.count()
        self._stats = self.client.info.stats
        self._stopped = False
        self._dead: EngineDeadError | None = None
        self.client.start(self._on_outputs, self._on_dead)

    # ---- what the server reads (fixed after construction, or snapshots) ------------------------------

    @property
    def tokenizer(self):
        return self.client.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.client.info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.client.info.vocab_size

    @property
    def model_path(self) -> str:
        return self.client.info.model_path

    @property
    def is_running(self) -> bool:
        """True while the core serves requests (False after `shutdown()` or once it died)."""
        return not self._stopped and self.client.is_alive()

    @property
    def dead_reason(self) -> str | None:
        """Why the engine is gone (None while it runs)."""
        return "AsyncLLMEngine shut down" if self._stopped else self.client.dead_reason()

    def stats(self) -> dict:
        """`LLMEngine.stats()` as of the last step or command; never waits."""
        return self._stats

    # ---- requests ------------------------------------------------------------------------------------

    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams | None,
                       request_id: str, lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Yield outputs as tokens arrive (cumulative unless `output_kind` says otherwise); the last has
        `finished=True`. Invalid requests raise ValueError before the first yield. Leaving the loop
        early aborts the request. `lora_request`: the LoRA adapter to run it with (engine/lora.py)."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        accepted = loop.create_future()
        # arrival is now, on the caller's clock, so TTFT counts the wait for the step in progress
        self._submit(EngineCoreRequest(RequestType.ADD, 0, request_id, prompt, sampling_params, time.time(),
                                       lora_request), accepted, (loop, outputs))
        try:
            await accepted  # ValueError -> caller; waits for the step in progress, never blocks the loop
        except asyncio.CancelledError:
            self._abort_later(request_id)  # applied after the add, in order
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
            if not finished:  # the consumer went away or an error: free the blocks
                self._abort_later(request_id)

    async def abort(self, request_id: str) -> None:
        """End a request; its blocks are free when this returns. Its stream ends with `abort`."""
        done = asyncio.get_running_loop().create_future()
        self._submit(EngineCoreRequest(RequestType.ABORT, 0, request_id), done)
        await done

    def shutdown(self) -> None:
        """Stop the core; requests still in flight (or submitted) get an `EngineDeadError`."""
        if self._stopped:
            return
        self._stopped = True
        self.client.shutdown()
        self._on_dead(EngineDeadError("AsyncLLMEngine shut down"))

    def _abort_later(self, request_id: str) -> None:
        """Abort without waiting (a stream that ends early); after a shutdown there is nothing to free."""
        if not self._stopped:
            self._submit(EngineCoreRequest(RequestType.ABORT, 0, request_id), None)

    def _submit(self, request: EngineCoreRequest, done: asyncio.Future | None, sink: Sink | None = None) -> None:
        if self._stopped:
            raise EngineDeadError("AsyncLLMEngine is shut down")
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        with self._lock:
            cid = next(self._ids)
            self._pending[cid] = done
            if sink is not None:
                self._sinks[request.request_id] = sink
        self.client.send(dataclasses.replace(request, cid=cid))

    # ---- the client's thread -------------------------------------------------------------------------

    def _on_outputs(self, out: EngineCoreOutputs) -> None:
        self._stats = out.stats  # first: a finished or aborted request sees its blocks freed
        batches: Batches = {}  # one wake-up per loop per delivery, not per request
        with self._lock:
            for reply in out.replies:
                done = self._pending.pop(reply.cid, None)
                if reply.type is RequestType.ABORT:
                    sink = self._sinks.pop(reply.request_id, None)
                    if sink is not None and reply.output is not None:  # its last output ends its stream
                        batches.setdefault(sink[0], []).append((sink[1], reply.output))
                elif reply.error is not None:  # a refused add: its caller raises the error
                    self._sinks.pop(reply.request_id, None)
                _resolve(done, reply.error)
            if out.failure is not None:  # a step raised: every request in flight gets the error
                for rid in out.failure.request_ids:
                    if (sink := self._sinks.pop(rid, None)) is not None:
                        batches.setdefault(sink[0], []).append((sink[1], out.failure.error))
            route_outputs(self._sinks, out.outputs, batches)
        post_batches(batches)

    def _on_dead(self, error: EngineDeadError) -> None:
        """The core is gone: every request in flight and every command waiting gets `error`."""
        self._dead = self._dead or error
        with self._lock:
            sinks, pending = list(self._sinks.values()), list(self._pending.values())
            self._sinks.clear()
            self._pending.clear()
        batches: Batches = {}
        for loop, q in sinks:
            batches.setdefault(loop, []).append((q, error))
        post_batches(batches)
        for done in pending:
            _resolve(done, error)


class ProcessAsyncLLMEngine(AsyncLLMEngine):
    """`AsyncLLMEngine` with the engine core in a child process (`core_client.MPClient`): the server's
    default. With tensor parallelism the child starts the worker ranks; one that dies ends the child
    with exit code 1, so the server can restart the engine instead of failing every later step."""

    def __init__(self, config: EngineConfig):
        super().__init__(client=MPClient(config))

    @property
    def pid(self) -> int:
        return self.client.pid


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
