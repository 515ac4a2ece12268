"""The one interface between the OpenAI endpoints and the engines behind them (vLLM's `EngineClient`).

An endpoint asks `route(user)` for the version its request runs on (a `Served`: tokenizer, context,
vocabulary) and then `generate(served, EngineRequest)` for that version's `RequestOutput`s; it ends
with `outcome(label, failed)`. It never learns how many engines there are: `VersionRouterClient`,
the implementation, keeps the champion and the challenger (`versions.Router`'s policy: weights,
sticky users), the automatic-rollback guard, and the lifecycle of every engine: the first load
(503 until it is ready), the watchdog that restarts a dead engine, the hot reload (new engine up,
then the switch, then the old one drained) and the shutdown.

Typed messages: `EngineRequest` in, the engine's `RequestOutput` out, `ReloadResult` from a reload,
`VersionInfo` for `/version`. Knows nothing about HTTP, the registry or the engine's internals.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from lmforge.engine import AsyncLLMEngine, LoRARequest, RequestOutput, SamplingParams
from lmforge.tools.procs import startup_done

from .versions import CanaryGuard, Router, Served

log = logging.getLogger("lmforge.serve")
Loader = Callable[[], AsyncLLMEngine]  # in-process or ProcessAsyncLLMEngine: one front, two transports


@dataclass(frozen=True)
class EngineRequest:
    """One engine request: a prompt's token ids, how to sample it, and the LoRA adapter it runs with."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lora_request: LoRARequest | None = None


@dataclass(frozen=True)
class ReloadResult:
    changed: dict[str, str | None]  # role -> new label (None: the role is now empty)
    models: dict[str, str]  # role -> label served after the reload
    canary_percent: float


@dataclass(frozen=True)
class VersionInfo:
    models: dict[str, str]
    canary_percent: float
    rolled_back: str | None


class EngineClient(Protocol):
    """What the endpoints use. One version per request, chosen by `route`, kept to the end."""

    @property
    def ready(self) -> bool: ...

    def not_ready_reason(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    def route(self, user: str | None) -> Served: ...

    def generate(self, served: Served, request: EngineRequest) -> AsyncIterator[RequestOutput]: ...

    def outcome(self, label: str, failed: bool) -> None: ...

    def score(self, label: str, low: bool, exchange_id: str | None = None) -> None: ...

    def info(self) -> VersionInfo: ...


def not_ready(v: Served) -> str:
    """Why version `v` does not serve, in words a person can act on."""
    if v.fatal is not None:
        return f"the engine failed and is not restarted any more: {v.fatal}"
    if v.down is not None:
        return f"the engine is restarting after: {v.down}"
    if v.engine is not None and not v.engine.is_running:
        return f"the engine stopped: {v.engine.dead_reason or 'its thread is gone'}"
    return "the engine is not running"


class VersionRouterClient:
    """`EngineClient` over one or two versions (champion, challenger), with their lifecycle.

    `on_attach(champion)` runs once the first versions are attached (the app builds its metrics
    then); `on_rollback(kind, details)` when the guard rolls the challenger back; `on_restart()` when
    a dead engine is restarted."""

    def __init__(self, max_engine_restarts: int, on_attach: Callable[[Served], None] = lambda sv: None,
                 on_rollback: Callable[[str, dict], None] | None = None, on_restart: Callable[[], None] = lambda: None):
        self.max_engine_restarts = max_engine_restarts
        self.on_attach, self.on_rollback, self.on_restart = on_attach, on_rollback, on_restart
        self.router: Router | None = None  # None while the first version loads
        self.canary: CanaryGuard | None = None
        self.load_error: BaseException | None = None
        self.closing = False  # shutdown began: no restarts

    # ---- the endpoints' side ----------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.router is not None and self.router.champion.ready

    def not_ready_reason(self) -> str:
        if self.load_error is not None:
            return f"the model failed to load: {type(self.load_error).__name__}: {self.load_error}"
        if self.router is None:
            return "the model is still loading"
        return not_ready(self.router.champion)

    @property
    def max_model_len(self) -> int:
        return self.router.champion.max_model_len if self.router else 0

    def route(self, user: str | None) -> Served:
        return self.router.route(user)

    async def generate(self, served: Served, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for `request` on `served`. Leaving early (the consumer stops or is
        cancelled) aborts the engine request, as `AsyncLLMEngine.generate` does."""
        served.inflight.add(request.request_id)
        lora = {"lora_request": request.lora_request} if request.lora_request is not None else {}
        try:
            async for out in served.engine.generate(request.prompt_token_ids, request.params, request.request_id,
                                                    **lora):
                yield out
        finally:
            served.inflight.discard(request.request_id)

    def outcome(self, label: str, failed: bool) -> None:
        if self.canary is not None:
            self.canary.outcome(label, failed)

    def score(self, label: str, low: bool, exchange_id: str | None = None) -> None:
        """A feedback score for the version `label` answered with; with `exchange_id` the guard keeps
        that exchange's latest score only."""
        if self.canary is not None:
            self.canary.score(label, low, exchange_id)

    def info(self) -> VersionInfo:
        r = self.router
        return VersionInfo({v.role: v.label for v in r.versions()} if r else {},
                           r.canary_percent if r else 0.0, r.rolled_back if r else None)

    # ---- what the server reads ----------------------------------------------------------------------------

    def versions(self) -> list[Served]:
        return self.router.versions() if self.router else []

    @property
    def fatal(self) -> str | None:
        return next((v.fatal for v in self.versions() if v.fatal), None)

    def stats(self) -> dict | None:
        """The champion engine's statistics (the load log line)."""
        return self.router.champion.stats() if self.router else None

    def version_stats(self) -> dict[str, dict]:
        return {v.label: s for v in self.versions() if (s := v.stats()) is not None}

    # ---- lifecycle --------------------------------------------------------------------------------------------

    def attach(self, champion: Served, challenger: Served | None = None, canary_percent: float = 0.0) -> None:
        self.on_attach(champion)
        self.router = Router(champion, challenger, canary_percent)
        self.canary = CanaryGuard(self.router, on_rollback=self.on_rollback)

    async def load(self, label: str, loader: Loader, challenger: tuple[str, Loader] | None,
                   canary_percent: float) -> None:
        """Load the first versions off the event loop; a failure is kept (503 with the reason). Either way the
        process's start is over: its cyclic collector comes back on (`startup_done`)."""
        try:
            champ = Served("champion", label, await asyncio.to_thread(loader), loader)
            chal = None
            if challenger is not None:
                chal = Served("challenger", challenger[0], await asyncio.to_thread(challenger[1]), challenger[1])
        except BaseException as e:  # keep serving 503 with the reason; the log says what broke
            self.load_error = e
            log.exception("engine failed to load")
            return
        finally:
            startup_done()
        self.attach(champ, chal, canary_percent)
        st = champ.stats() or {}
        kernels = ", ".join(f"{k} {st[k]}" for k in ("dtype", "dtype_choice", "linear_backend", "attention_backend")
                            if st.get(k))
        log.info("engine ready: %s %s (max_model_len %d%s)%s", label, champ.model_dir, champ.max_model_len,
                 f"; {kernels}" if kernels else "", f"; challenger {chal.label} at {canary_percent:g}%" if chal else "")

    async def watch(self, interval_s: float = 0.2) -> None:
        """Restart an engine that died (its in-flight requests already failed with the cause), at most
        `max_engine_restarts` times per version; after that mark it fatal, which stops the server with
        a non-zero exit."""
        while True:
            await asyncio.sleep(interval_s)
            for v in self.versions():
                if v.engine is None or v.engine.is_running or v.fatal or self.closing or v.loader is None:
                    continue
                await self._restart(v)
                if v.fatal:
                    return

    async def _restart(self, v: Served) -> None:
        cause = v.engine.dead_reason or "the engine stopped"
        v.down = cause
        log.error("engine of %s stopped: %s", v.label, cause)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(v.engine.shutdown)
        if v.restarts >= self.max_engine_restarts:
            v.fatal = f"{cause} (after {v.restarts} restarts; --max-engine-restarts {self.max_engine_restarts})"
            log.error("not restarting the engine: %s", v.fatal)
            return
        v.restarts += 1
        self.on_restart()
        log.warning("restarting the engine of %s (%d of at most %d)", v.label, v.restarts, self.max_engine_restarts)
        try:
            new = await asyncio.to_thread(v.loader)
        except BaseException as e:
            v.fatal = f"the engine could not be restarted: {type(e).__name__}: {e}"
            log.exception("engine restart failed")
            return
        if self.closing:
            await asyncio.to_thread(new.shutdown)
            return
        v.attach(new)
        log.info("engine of %s restarted", v.label)

    async def reload(self, wanted: dict) -> ReloadResult:
        """`wanted`: {role: (label, loader, path)} (+ optional "canary_percent"). New engines up first,
        then the switch, then the old ones drained (in-flight requests keep the `Served` they started
        on) and shut down: no request fails because of a reload."""
        r, changed, old = self.router, {}, []
        for role in ("champion", "challenger"):
            cur, want = getattr(r, role), wanted.get(role)
            if (cur.label if cur else None) == (want[0] if want else None):
                continue
            new = Served(role, want[0], await asyncio.to_thread(want[1]), want[1], want[2]) if want else None
            old.append(r.replace(role, new))
            changed[role] = want[0] if want else None
        if "canary_percent" in wanted:
            r.canary_percent = wanted["canary_percent"] if r.challenger is not None else 0.0
        for v in old:
            if v is not None:
                asyncio.create_task(_drain(v))
        log.info("reload: %s", changed or "nothing changed")
        return ReloadResult(changed, {v.role: v.label for v in r.versions()}, r.canary_percent)

    async def abort_all(self) -> None:
        """Abort every engine request being served: each stream then ends with finish_reason "abort"."""
        work = [(v.engine, rid) for v in self.versions() for rid in list(v.inflight)]
        if not work:
            return
        log.warning("aborting %d requests still running at shutdown", len(work))
        with contextlib.suppress(Exception):
            await asyncio.gather(*(eng.abort(rid) for eng, rid in work), return_exceptions=True)

    async def shutdown(self) -> None:
        for v in self.versions():
            await asyncio.to_thread(v.engine.shutdown)


async def _drain(v: Served, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while v.inflight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    v.loader = None  # the watchdog must not restart an engine we stop on purpose
    await asyncio.to_thread(v.engine.shutdown)
    log.info("drained and stopped %s", v.label)
