"""`ServingEngine`: `AsyncLLMEngine` with a first-come-first-served lock, for the HTTP server.

Why: `AsyncLLMEngine` serializes its step loop against `generate`/`abort`/`stats` with a
`threading.Lock`, which is not fair: the engine thread releases it after a step and takes it
again a few bytecodes later, long before the waiting thread is scheduled. Under load the event
loop (which takes the lock inside `generate` to add a request) then waits many steps per new
request, and every stream of the server stalls with it (measured: 11 s client TTFT at 32
concurrent requests against 0.46 s in the engine's own timestamps). A ticket lock bounds that
wait to the step in progress. This is a stop-gap until the engine takes submissions and aborts
through a queue applied between steps (see the serving report); it changes nothing else.

The lock is installed through a property, because `AsyncLLMEngine.__init__` creates its lock
and starts its thread in one go: the setter swaps the plain lock for a fair one before the
thread can ever see it. This module knows nothing about HTTP.
"""

from __future__ import annotations

import asyncio
import threading

from lmforge.engine import AsyncLLMEngine


class FairLock:
    """A ticket lock: threads get the lock in the order they asked for it. `acquire(for_thread=T)`
    takes it in a worker on behalf of thread T, for one use: T's next `with lock:` enters at once
    and leaves it released (how `ServingEngine.generate` waits for a step off the event loop)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._next_ticket = 0
        self._serving = 0
        self._held_for: int | None = None

    def acquire(self, for_thread: int | None = None) -> bool:
        me = threading.get_ident()
        with self._cond:
            if for_thread is None and self._held_for == me:  # the one-shot hold taken for us
                return True
            ticket = self._next_ticket
            self._next_ticket += 1
            while ticket != self._serving:
                self._cond.wait()
            self._held_for = for_thread
        return True

    def release(self) -> None:
        with self._cond:
            self._held_for = None
            self._serving += 1
            self._cond.notify_all()

    def __enter__(self) -> FairLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class ServingEngine(AsyncLLMEngine):
    @property
    def _lock(self) -> FairLock:
        return self.__dict__["_fair_lock"]

    @_lock.setter
    def _lock(self, _plain_lock) -> None:  # AsyncLLMEngine.__init__ assigns a threading.Lock here
        self.__dict__["_fair_lock"] = FairLock()

    async def generate(self, prompt, sampling_params, request_id: str):
        """`AsyncLLMEngine.generate`, but the wait for the step in progress happens in a worker
        thread, so the event loop keeps streaming (and accepting) meanwhile."""
        lock = self._lock
        hold = asyncio.ensure_future(asyncio.to_thread(lock.acquire, threading.get_ident()))
        try:
            await asyncio.shield(hold)
        except BaseException:  # cancelled while waiting: give the hold back once it is granted
            hold.add_done_callback(lambda f: f.exception() is None and lock.release())
            raise
        try:
            gen = super().generate(prompt, sampling_params, request_id)
            first = await gen.__anext__()  # adds the request inside `with self._lock`, using our hold
        except BaseException:
            if lock._held_for == threading.get_ident():  # add_request never ran (it raised before)
                lock.release()
            raise
        try:
            yield first
            async for out in gen:
                yield out
        finally:
            await gen.aclose()  # a consumer that leaves early aborts the request (generate's finally)
