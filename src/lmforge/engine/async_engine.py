"""`AsyncLLMEngine`: `LLMEngine` behind asyncio, for the HTTP server.

A background thread steps the engine while requests exist and sleeps on an event otherwise;
a lock serializes it against `add_request`/`abort_request`, so requests arrive while others
decode and an abort frees blocks as soon as the current step ends. Outputs reach each request's
`asyncio.Queue` through `loop.call_soon_threadsafe`. If a step raises, every request that was in
flight gets the exception (and is aborted, freeing its blocks); the loop keeps serving new ones.
Knows nothing about HTTP.

    engine = AsyncLLMEngine(EngineConfig(model=...))
    async for out in engine.generate("Hello", SamplingParams(max_tokens=16), request_id="r1"):
        print(out.outputs[0].text)   # cumulative text; the delta is text[len(previous):]
    await engine.abort("r1"); engine.shutdown()
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

from .config import EngineConfig
from .llm_engine import LLMEngine, RequestOutput
from .sampling_params import SamplingParams


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None):
        self.engine = engine or LLMEngine(config)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="lmforge-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams | None,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs as tokens arrive; the last has `finished=True`. Invalid requests
        raise ValueError before the first yield. Leaving the loop early aborts the request."""
        if self._stopped:
            raise RuntimeError("AsyncLLMEngine is shut down")
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self.engine.add_request(request_id, prompt, sampling_params)  # ValueError -> caller
            self._queues[request_id] = (asyncio.get_running_loop(), queue)
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:  # the consumer went away (client disconnect) or an error: free the blocks
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        """End a request now; its blocks are free when this returns. Its stream ends with `abort`."""
        with self._lock:
            out = self.engine.abort_request(request_id)
            entry = self._queues.pop(request_id, None)
        if entry is not None and out is not None:
            entry[0].call_soon_threadsafe(entry[1].put_nowait, out)

    def stats(self) -> dict:
        with self._lock:
            return self.engine.stats()

    def shutdown(self) -> None:
        """Stop the loop; requests still in flight get a RuntimeError."""
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)
        with self._lock:
            for rid in list(self._queues):
                self.engine.abort_request(rid)
            self._fail(list(self._queues), RuntimeError("AsyncLLMEngine shut down"))

    def _loop(self) -> None:
        while not self._stopped:
            with self._lock:
                busy = self.engine.has_unfinished_requests()
                if busy:
                    self._step()
            if not busy:
                self._wake.wait(timeout=0.5)
                self._wake.clear()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # never wedge: fail the requests in flight, free their blocks
            ids = list(self.engine.requests)
            for rid in ids:
                self.engine.abort_request(rid)
            self._fail(ids, e)
            return
        for out in outputs:
            entry = self._queues.get(out.request_id)
            if entry is not None:
                entry[0].call_soon_threadsafe(entry[1].put_nowait, out)
                if out.finished:
                    del self._queues[out.request_id]

    def _fail(self, ids: list[str], error: BaseException) -> None:
        for rid in ids:
            entry = self._queues.pop(rid, None)
            if entry is not None:
                entry[0].call_soon_threadsafe(entry[1].put_nowait, error)
