"""The OpenAI-compatible HTTP server: a FastAPI app over `AsyncLLMEngine`.

`build_app(engine, served_model_name)` returns the app; `lmforge serve` runs it under uvicorn.
Endpoints: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, `GET /health`,
`GET /metrics`, `GET /version`. Streams are SSE (`data: {json}\\n\\n` ... `data: [DONE]\\n\\n`).

What the HTTP layer does, and why it is here rather than in the engine:
* it tokenizes (and renders chat templates) and checks prompt + max_tokens against the context
  before anything reaches the engine, so a bad request is a 400 and never a broken stream;
* it turns each request's engine timestamps into Prometheus histograms when outputs arrive,
  outside the step loop (`metrics.py`);
* it aborts a request whose client went away: Starlette cancels a stream's body iterator on
  disconnect, and leaving `AsyncLLMEngine.generate` early aborts the request and frees its KV
  blocks; non-streamed requests are watched for a disconnect the same way (`_unless_disconnected`);
* admission control: with `max_waiting`, a request is refused with 429 while that many sequences
  (prompts x n) are admitted but have not produced a token yet, and with 400 when it alone needs
  more (counted here, checked and reserved in one synchronous step: `guard.Admission`);
* limits before work (`guard.py`): the API key from the headers before the body is read, a body
  size limit and a read timeout, a length check that refuses an oversized prompt without
  tokenizing it; tokenization and chat rendering run on a worker thread, never on the event loop;
* failure: an engine that dies is restarted (up to `max_engine_restarts`, counted in /metrics),
  then the server stops with a non-zero exit; `/health/live` and `/health/ready` answer the two
  probes a supervisor asks; at shutdown every request still running is aborted before the
  listener's grace period ends, so each stream ends with `finish_reason: "abort"` and `[DONE]`.

It knows nothing about scheduling, sampling or KV paging. Run: `lmforge serve MODEL_DIR`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lmforge.engine import AsyncLLMEngine, EngineDeadError, EngineStepError, RequestOutput, SamplingParams

from .errors import OpenAIError, bad_request, document_errors, from_value_error, install_error_handlers
from .console import mount_console
from .exchange_log import ExchangeLog
from .guard import Admission, GuardMiddleware, ServerLimits, Ticket, check_text, min_tokens_for
from .metrics import LoadLogger, ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, FeedbackRequest
from .versions import CanaryGuard, Router, Served

log = logging.getLogger("lmforge.serve")
EngineOrLoader = AsyncLLMEngine | Callable[[], AsyncLLMEngine]


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _sse(obj: Any) -> str:
    return f"data: {_dumps(obj)}\n\n"


class ServerState:
    """The versions served (a `Router`; None while the first loads) and the server-wide parts."""

    def __init__(self, served_model_name: str, api_key: str | None, limits: ServerLimits):
        self.served_model_name, self.api_key, self.limits = served_model_name, api_key, limits
        self.router: Router | None = None
        self.canary: CanaryGuard | None = None
        self.load_error: BaseException | None = None
        self.closing = False  # shutdown began: no restarts
        self.metrics: ServerMetrics | None = None
        self.admission = Admission(limits.max_waiting)
        self.created = int(time.time())
        self.exchange_log = None  # ExchangeLog when --log-requests
        self.feedback = None  # FeedbackStore when feedback is on
        self.reloader: Callable[[], dict] | None = None  # role -> (label, loader, path), for /admin/reload
        # one worker: tokenization and template rendering leave the event loop, and a burst of them
        # queues here instead of multiplying memory
        self.tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="lmforge-tokenize")

    def attach(self, champion: Served, challenger: Served | None = None, canary_percent: float = 0.0,
               on_rollback=None) -> None:
        if self.metrics is None:
            self.metrics = ServerMetrics(self.served_model_name, champion.max_model_len, self.version_stats)

        def rolled_back(kind: str, details: dict) -> None:
            self.metrics.auto_rollbacks.inc()
            if on_rollback is not None:
                on_rollback(kind, details)

        self.router = Router(champion, challenger, canary_percent)
        self.canary = CanaryGuard(self.router, on_rollback=rolled_back)

    @property
    def max_model_len(self) -> int:
        return self.router.champion.max_model_len if self.router else 0

    def stats(self) -> dict | None:
        """The champion engine's statistics (the load log line)."""
        return self.router.champion.stats() if self.router else None

    def version_stats(self) -> dict[str, dict]:
        return {v.label: s for v in (self.router.versions() if self.router else []) if (s := v.stats()) is not None}

    @property
    def ready(self) -> bool:
        return self.router is not None and self.router.champion.ready

    @property
    def fatal(self) -> str | None:
        return next((v.fatal for v in self.router.versions() if v.fatal), None) if self.router else None

    def not_ready_reason(self) -> str:
        if self.load_error is not None:
            return f"the model failed to load: {type(self.load_error).__name__}: {self.load_error}"
        if self.router is None:
            return "the model is still loading"
        return _not_ready(self.router.champion)

    async def abort_all(self) -> None:
        """Abort every engine request being served: each stream then ends with finish_reason "abort"."""
        work = [(v.engine, rid) for v in (self.router.versions() if self.router else []) for rid in list(v.inflight)]
        if not work:
            return
        log.warning("aborting %d requests still running at shutdown", len(work))
        with contextlib.suppress(Exception):
            await asyncio.gather(*(eng.abort(rid) for eng, rid in work), return_exceptions=True)


def _not_ready(v: Served) -> str:
    if v.fatal is not None:
        return f"the engine failed and is not restarted any more: {v.fatal}"
    if v.down is not None:
        return f"the engine is restarting after: {v.down}"
    if v.engine is not None and not v.engine.is_running:
        return f"the engine stopped: {getattr(v.engine, 'dead_reason', None) or 'its thread is gone'}"
    return "the engine is not running"


# ---- the app -----------------------------------------------------------------------------------------


def build_app(engine: EngineOrLoader, served_model_name: str, api_key: str | None = None,
              max_waiting: int | None = None, log_interval_s: float = 5.0,
              limits: ServerLimits | None = None, *, version: str = "local",
              challenger: tuple[str, Callable[[], AsyncLLMEngine]] | None = None, canary_percent: float = 0.0,
              reloader: Callable[[], dict] | None = None, on_rollback=None,
              feedback=None, log_requests: bool = False) -> FastAPI:
    """An app over `engine`. Pass a loader (a callable returning the engine) to answer 503 while the
    model loads; the app then owns the engine, restarts it if it dies (`limits.max_engine_restarts`
    times) and shuts it down on exit. A ready engine passed in stays the caller's.

    Versions: `version` labels the champion; `challenger=(label, loader)` serves a second version to
    `canary_percent` of requests (sticky per `user`), rolled back automatically when it does worse;
    `reloader()` returns `{role: (label, loader, path)}` for `POST /admin/reload`; `on_rollback(kind,
    details)` records rollbacks (the registry). `feedback` (a FeedbackStore) enables `POST
    /v1/feedback`, and with `log_requests` every exchange is stored (PII masked by the store)."""
    limits = limits or ServerLimits()
    if max_waiting is not None:
        limits.max_waiting = max_waiting
    state = ServerState(served_model_name, api_key, limits)
    state.reloader, state.feedback = reloader, feedback

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        tasks = [asyncio.create_task(_log_load(state, log_interval_s))]
        loading = None
        if feedback is not None and log_requests:
            state.exchange_log = ExchangeLog(feedback)
        if isinstance(engine, AsyncLLMEngine):
            state.attach(Served("champion", version, engine), on_rollback=on_rollback)
        else:
            loading = asyncio.create_task(_load(state, version, engine, challenger, canary_percent, on_rollback))
            tasks.append(asyncio.create_task(_watch(state)))
        try:
            yield
        finally:
            state.closing = True
            for t in tasks:
                t.cancel()
            if loading is not None:
                await loading  # a load in progress cannot be interrupted; wait for it, then free it
                for v in state.router.versions() if state.router else []:
                    await asyncio.to_thread(v.engine.shutdown)
            if state.exchange_log is not None:
                await asyncio.to_thread(state.exchange_log.close)
            state.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="lmforge", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state
    count_error = lambda status: state.metrics and state.metrics.count_error(status)  # noqa: E731
    install_error_handlers(app, on_error=count_error)
    app.add_middleware(GuardMiddleware, api_key=api_key, limits=limits,
                       max_model_len_fn=lambda: state.max_model_len or 2048, on_error=count_error)

    async def ready(request: Request) -> ServerState:
        if not state.ready:
            raise OpenAIError(503, state.not_ready_reason(), None, "engine_not_ready")
        return state

    @app.get("/health", summary="Readiness (as /health/ready): 200 when the engine serves requests")
    async def health() -> dict:
        return await health_ready()

    @app.get("/health/live", summary="Liveness: 200 while the process serves HTTP and is not stopping for good")
    async def health_live() -> dict:
        if state.fatal is not None or state.load_error is not None:
            raise OpenAIError(503, state.not_ready_reason(), None, "engine_failed")
        return {"status": "alive"}

    @app.get("/health/ready", summary="Readiness: 200 when the engine serves requests, 503 with the reason")
    async def health_ready() -> dict:
        if not state.ready:
            raise OpenAIError(503, state.not_ready_reason(), None, "engine_not_ready")
        return {"status": "ready"}

    @app.get("/version")
    async def version_info() -> dict:
        from lmforge import __version__

        r = state.router
        return {"version": __version__,
                "models": {v.role: v.label for v in r.versions()} if r else {},
                "canary_percent": r.canary_percent if r else 0.0, "rolled_back": r.rolled_back if r else None}

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.metrics is None:
            return Response(b"", media_type="text/plain; version=0.0.4")
        body = state.metrics.exposition()  # the engine's stats are a snapshot: nothing here waits for a step
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(st: ServerState = Depends(ready)) -> dict:
        # `root` is the served name, not the weights' path on this machine
        return {"object": "list", "data": [{"id": st.served_model_name, "object": "model", "created": st.created,
                                            "owned_by": "lmforge", "root": st.served_model_name, "parent": None,
                                            "max_model_len": st.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request, st: ServerState = Depends(ready)):
        sv = st.router.route(req.user)
        _precheck_completion(st, sv, req)
        return await _serve(st, raw, await _off_loop(st, _completion_job, st, sv, req))

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request, st: ServerState = Depends(ready)):
        sv = st.router.route(req.user)
        _precheck_chat(st, sv, req)
        return await _serve(st, raw, await _off_loop(st, _chat_job, st, sv, req))

    @app.post("/v1/feedback", summary="A user's score for a completion (thumbs -1/+1 or 1-5), optional comment "
                                      "and corrected answer")
    async def post_feedback(fb: FeedbackRequest) -> dict:
        return await _feedback(state, fb)

    @app.post("/admin/reload", summary="Load the registry's current champion/challenger; in-flight requests "
                                       "finish on the versions they started on")
    async def admin_reload() -> dict:
        return await _reload(state)

    mount_console(app)
    document_errors(app, auth=api_key is not None)
    return app


async def _off_loop(st: ServerState, fn, *args):
    return await asyncio.get_running_loop().run_in_executor(st.tokenize_pool, fn, *args)


async def _load(state: ServerState, label: str, loader, challenger, canary_percent: float, on_rollback) -> None:
    try:
        champ = Served("champion", label, await asyncio.to_thread(loader), loader)
        chal = None
        if challenger is not None:
            chal = Served("challenger", challenger[0], await asyncio.to_thread(challenger[1]), challenger[1])
    except BaseException as e:  # keep serving 503 with the reason; the log says what broke
        state.load_error = e
        log.exception("engine failed to load")
        return
    state.attach(champ, chal, canary_percent, on_rollback)
    log.info("engine ready: %s %s (max_model_len %d)%s", label, champ.model_dir, champ.max_model_len,
             f"; challenger {chal.label} at {canary_percent:g}%" if chal else "")


async def _log_load(state: ServerState, interval: float) -> None:
    logger = None
    while True:
        await asyncio.sleep(interval)
        if state.metrics is None:
            continue
        logger = logger or LoadLogger(state.metrics, interval)
        with contextlib.suppress(Exception):
            logger.tick(state.stats())


async def _watch(state: ServerState, interval_s: float = 0.2) -> None:
    """Restart an engine that died (its in-flight requests already failed with the cause), at most
    `max_engine_restarts` times per version; after that mark it fatal, which stops the server with a
    non-zero exit."""
    while True:
        await asyncio.sleep(interval_s)
        for v in state.router.versions() if state.router else []:
            if v.engine is None or v.engine.is_running or v.fatal or state.closing or v.loader is None:
                continue
            await _restart(state, v)
            if v.fatal:
                return


async def _restart(state: ServerState, v: Served) -> None:
    cause = getattr(v.engine, "dead_reason", None) or "the engine stopped"
    v.down = cause
    log.error("engine of %s stopped: %s", v.label, cause)
    with contextlib.suppress(Exception):
        await asyncio.to_thread(v.engine.shutdown)
    if v.restarts >= state.limits.max_engine_restarts:
        v.fatal = f"{cause} (after {v.restarts} restarts; --max-engine-restarts {state.limits.max_engine_restarts})"
        log.error("not restarting the engine: %s", v.fatal)
        return
    v.restarts += 1
    state.metrics.engine_restarts.inc()
    log.warning("restarting the engine of %s (%d of at most %d)", v.label, v.restarts,
                state.limits.max_engine_restarts)
    try:
        new = await asyncio.to_thread(v.loader)
    except BaseException as e:
        v.fatal = f"the engine could not be restarted: {type(e).__name__}: {e}"
        log.exception("engine restart failed")
        return
    if state.closing:
        await asyncio.to_thread(new.shutdown)
        return
    v.attach(new)
    log.info("engine of %s restarted", v.label)


async def _reload(state: ServerState) -> dict:
    """New engines up first, then the switch, then the old ones drained (in-flight requests keep the
    `Served` they started on) and shut down: no request fails because of a reload."""
    if state.api_key is None:  # the guard checked the key when there is one; without one, no admin at all
        raise OpenAIError(403, "admin endpoints need the server to run with --api-key", None, "forbidden")
    if state.reloader is None:
        raise OpenAIError(404, "this server serves one model folder; reload needs --registry", None, "not_found")
    if not state.ready:
        raise OpenAIError(503, state.not_ready_reason(), None, "engine_not_ready")
    wanted = await asyncio.to_thread(state.reloader)
    r, changed, old = state.router, {}, []
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
    return {"changed": changed, "models": {v.role: v.label for v in r.versions()}, "canary_percent": r.canary_percent}


async def _drain(v: Served, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while v.inflight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    v.loader = None  # the watchdog must not restart an engine we stop on purpose
    await asyncio.to_thread(v.engine.shutdown)
    log.info("drained and stopped %s", v.label)


async def _feedback(state: ServerState, fb: FeedbackRequest) -> dict:
    if state.feedback is None:
        raise OpenAIError(404, "feedback is not enabled on this server (start it with --log-requests)", None,
                          "not_found")
    if state.exchange_log is not None:
        await asyncio.to_thread(state.exchange_log.flush)  # the exchange may still be in the writer's queue
    for text, field_name in ((fb.comment, "comment"), (fb.correction, "correction")):
        if text:
            check_text(text, field_name)
    known = await asyncio.to_thread(state.feedback.add_feedback, fb.id, fb.score, fb.comment, fb.correction)
    if not known:
        raise OpenAIError(404, f"no completion with id {fb.id!r} is known to this server", "id", "not_found")
    label = state.exchange_log.version_of(fb.id) if state.exchange_log else None
    low = fb.score < 0 or 1 <= fb.score <= 2
    state.metrics.observe_feedback(label or "unknown", fb.score, low)
    if label and state.canary:
        state.canary.score(label, low)
    return {"id": fb.id, "status": "recorded"}


# ---- jobs: a validated request, ready to run ---------------------------------------------------------


class Job:
    """One HTTP request: its engine prompts (token ids), sampling params, and how to render outputs."""

    kind: str  # "text_completion" | "chat.completion"
    ticket: Ticket  # its sequences' share of the admission count

    def __init__(self, st: ServerState, sv: Served, req: CompletionRequest | ChatCompletionRequest,
                 prompts: list[list[int]], params: SamplingParams, prefix: str):
        self.st, self.sv, self.req, self.prompts, self.params = st, sv, req, prompts, params
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.n = params.n


def _check_model(st: ServerState, model: str | None) -> None:
    if model is not None and model != st.served_model_name:
        raise OpenAIError(404, f"the model {model!r} does not exist; this server serves {st.served_model_name!r}",
                          "model", "model_not_found")


def _check_prompt(sv: Served, ids: list[int], max_tokens: int | None, param: str) -> None:
    if not ids:
        raise bad_request("the prompt is empty: at least one token is needed", param)
    bad = [t for t in ids if not 0 <= t < sv.vocab_size]
    if bad:
        raise bad_request(f"prompt token ids must be in [0, {sv.vocab_size}): got {bad[:5]}", param)
    need = len(ids) + (max_tokens or 1)
    if need > sv.max_model_len:
        raise bad_request(f"this model's maximum context length is {sv.max_model_len} tokens; the request has "
                          f"{len(ids)} prompt tokens and asks for {max_tokens or 1} more ({need})",
                          "max_tokens" if max_tokens else param, "context_length_exceeded")


def _check_params(req, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    try:
        return req.sampling_params(max_tokens, logprobs)
    except ValueError as e:
        raise from_value_error(e) from None


def _precheck_completion(st: ServerState, sv: Served, req: CompletionRequest) -> None:
    """On the event loop, before any work: valid text, and no prompt too long to tokenize."""
    _check_stop(st, req)
    for p in req.prompts():
        if isinstance(p, str):
            check_text(p, "prompt")
            _check_length(sv, min_tokens_for(p, sv.chars_per_token) if sv.tokenizer else 0, req.max_tokens, "prompt",
                          f"{len(p)} characters")


def _precheck_chat(st: ServerState, sv: Served, req: ChatCompletionRequest) -> None:
    _check_stop(st, req)
    chars = 0
    for m in req.messages:
        text = m.text()
        check_text(text, "messages")
        chars += len(text)
    if sv.tokenizer is not None:
        _check_length(sv, -(-chars // sv.chars_per_token), req.resolved_max_tokens(), "messages",
                      f"{chars} characters of content")


def _check_stop(st: ServerState, req) -> None:
    lim = st.limits
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > lim.max_stop_strings:
        raise bad_request(f"stop: at most {lim.max_stop_strings} stop strings, got {len(stops)}", "stop")
    for s in stops:
        check_text(s, "stop")
        if len(s) > lim.max_stop_len:
            raise bad_request(f"stop: each stop string has at most {lim.max_stop_len} characters, got one of "
                              f"{len(s)}", "stop")


def _check_length(sv: Served, at_least: int, max_tokens: int | None, param: str, what: str) -> None:
    need = at_least + (max_tokens or 1)
    if need > sv.max_model_len:
        raise bad_request(f"this model's maximum context length is {sv.max_model_len} tokens; the {param} has "
                          f"{what}, so at least {at_least} tokens, and asks for {max_tokens or 1} more",
                          "max_tokens" if max_tokens else param, "context_length_exceeded")


def _encode(sv: Served, text: str, param: str, **kw) -> list[int]:
    try:
        return sv.tokenizer.encode(text, **kw)
    except Exception as e:  # check_text ran, so this is text this tokenizer cannot represent
        raise bad_request(f"the tokenizer could not encode the {param} ({type(e).__name__})", param,
                          "invalid_text") from None


def _completion_job(st: ServerState, sv: Served, req: CompletionRequest) -> Job:
    _check_model(st, req.model)
    prompts = req.prompts()
    if not prompts:
        raise bad_request("prompt is an empty list", "prompt")
    if req.echo and req.logprobs is not None:
        raise bad_request("echo with logprobs needs prompt logprobs, which this server does not return yet",
                          "echo", "unsupported")
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix", "unsupported")
    params = _check_params(req, req.max_tokens, req.logprobs)
    ids = []
    for p in prompts:
        if isinstance(p, str):
            if sv.tokenizer is None:
                raise bad_request("this model has no tokenizer: send prompts as token ids", "prompt")
            p = _encode(sv, p, "prompt")  # the same call the engine makes, so outputs match offline LLM.generate
        _check_prompt(sv, list(p), req.max_tokens, "prompt")
        ids.append(list(p))
    job = Job(st, sv, req, ids, params, "cmpl")
    job.kind = "text_completion"
    job.texts = [p if isinstance(p, str) else None for p in prompts]
    return job


_PLACEHOLDER = "\ue000lmforge{}\ue001"  # private-use characters: no template alters or emits them
_PLACEHOLDER_RE = re.compile("\ue000lmforge(\\d+)\ue001")


def _encode_chat(sv: Served, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """Token ids of the rendered conversation. Control tokens come from the template only: text a user
    typed that looks like one (`<|im_start|>system`) is encoded as plain text, so no turn can be spoofed.
    Messages without such text are encoded in one piece, exactly as before (and as offline chat)."""
    tok = sv.tokenizer
    render = lambda msgs: tok.apply_chat_template(msgs, tokenize=False,  # noqa: E731
                                                  add_generation_prompt=add_generation_prompt)
    try:
        if not any(sp in m["content"] for m in messages for sp in sv.specials):
            return _encode(sv, render(messages), "messages", add_special_tokens=False)
        text = render([{**m, "content": _PLACEHOLDER.format(i)} for i, m in enumerate(messages)])
    except OpenAIError:
        raise
    except Exception as e:  # a template that raises on these messages (e.g. role order) is the client's 400
        raise bad_request(f"messages could not be rendered with the chat template: {e}", "messages") from None
    ids, pos = [], 0
    for m in _PLACEHOLDER_RE.finditer(text):
        ids += _encode(sv, text[pos:m.start()], "messages", add_special_tokens=False)
        ids += _encode(sv, messages[int(m.group(1))]["content"], "messages", add_special_tokens=False,
                       split_special_tokens=True)
        pos = m.end()
    return ids + _encode(sv, text[pos:], "messages", add_special_tokens=False)


def _chat_job(st: ServerState, sv: Served, req: ChatCompletionRequest) -> Job:
    _check_model(st, req.model)
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    tok = sv.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", "messages", "unsupported")
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    # The template writes every special token itself; do not let the tokenizer add a BOS on top.
    ids = _encode_chat(sv, messages, req.add_generation_prompt)
    max_tokens = req.resolved_max_tokens()
    params = _check_params(req, max_tokens, req.resolved_logprobs())
    _check_prompt(sv, ids, max_tokens, "messages")
    job = Job(st, sv, req, [ids], params, "chatcmpl")
    job.messages = messages
    job.kind = "chat.completion"
    return job


# ---- running a job -----------------------------------------------------------------------------------


VERSION_HEADER = "x-lmforge-model-version"


async def _serve(st: ServerState, raw: Request, job: Job):
    if not job.sv.ready:  # the engine may have died while the request was tokenized
        raise OpenAIError(503, _not_ready(job.sv), None, "engine_not_ready")
    job.ticket = st.admission.reserve(len(job.prompts) * job.n)  # no await since the check: atomic
    headers = {VERSION_HEADER: job.sv.label}
    if job.req.stream:
        body = _stream(job)
        weakref.finalize(body, job.ticket.release)  # a stream that never started still gives its share back
        return StreamingResponse(body, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
    try:
        return JSONResponse(await _unless_disconnected(raw, _complete(job)), headers=headers)
    finally:
        job.ticket.release()


async def _unless_disconnected(raw: Request, coro):
    """Run `coro`; cancel it (which aborts its engine requests) if the client disconnects first."""
    work = asyncio.ensure_future(coro)

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([work, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(BaseException):
                await work
            raise OpenAIError(499, "client disconnected", None, "client_disconnected")
    return work.result()


class _Tracker:
    """Per engine request: what was already sent (text, tokens) and the timing bookkeeping."""

    __slots__ = ("sent_text", "sent_tokens", "done", "last", "last_token_time", "started")

    def __init__(self, n: int):
        self.sent_text, self.sent_tokens, self.done = [0] * n, [0] * n, [False] * n
        self.last: RequestOutput | None = None
        self.last_token_time: float | None = None
        self.started = 0  # samples with a first token (or finished): no longer waiting


async def _outputs(job: Job, trackers: list[_Tracker]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, cumulative output) from every engine request of the job, as they come.

    Leaving early (a disconnect cancels us, or an error) aborts every engine request still running:
    `AsyncLLMEngine.generate` aborts when its consumer goes away, and pumps are cancelled."""
    st, engine = job.st, job.sv.engine
    rids = [f"{job.id}-{i}" for i in range(len(job.prompts))]
    gens = [engine.generate(ids, job.params, rid) for rid, ids in zip(rids, job.prompts)]
    job.sv.inflight.update(rids)
    try:
        if len(gens) == 1:
            async for out in gens[0]:
                _on_output(job, trackers[0], out)
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, gen) -> None:
            try:
                async for out in gen:
                    queue.put_nowait((i, out))
            except Exception as e:
                queue.put_nowait((i, e))
                return
            queue.put_nowait((i, None))

        tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
        try:
            ended = 0
            while ended < len(tasks):
                i, item = await queue.get()
                if item is None:
                    ended += 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    _on_output(job, trackers[i], item)
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        job.sv.inflight.difference_update(rids)
        job.ticket.release()
        for t in trackers:
            if t.last is not None and not t.last.finished:  # aborted: count it, as vLLM does
                st.metrics.observe_finished(job.sv.label, t.last, "abort")


def _on_output(job: Job, t: _Tracker, out: RequestOutput) -> None:
    st = job.st
    started = sum(1 for c in out.outputs if c.token_ids or c.finish_reason is not None)
    if started > t.started:
        job.ticket.release(started - t.started)
        t.started = started
    ltt = out.metrics.last_token_time
    if t.last_token_time is not None and ltt is not None and ltt > t.last_token_time:
        st.metrics.observe_itl(job.sv.label, ltt - t.last_token_time)
    t.last_token_time = ltt
    t.last = out
    if out.finished:
        st.metrics.observe_finished(job.sv.label, out)


def _usage(job: Job, trackers: list[_Tracker]) -> dict:
    outs = [t.last for t in trackers if t.last is not None]
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _engine_error(e: Exception) -> OpenAIError:
    """ValueErrors are the engine's admission checks (the client's 400); a failed step or a dead engine
    say so without internals; anything else is a bug: logged with its traceback, 500 to the client."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, ValueError):
        return from_value_error(e)
    if isinstance(e, EngineStepError):
        return OpenAIError(500, str(e), None, "engine_error")
    if isinstance(e, EngineDeadError):
        return OpenAIError(503, f"the engine stopped while serving this request: {e}", None, "engine_not_ready")
    log.error("request failed", exc_info=e)
    return OpenAIError(500, "internal error; the server log has the details", None, "internal_error")


async def _complete(job: Job) -> dict:
    trackers = [_Tracker(job.n) for _ in job.prompts]
    try:
        async for _ in _outputs(job, trackers):
            pass
    except Exception as e:
        err = _engine_error(e)
        _ended(job, trackers, err.status)
        raise err from None
    choices = []
    for i, t in enumerate(trackers):
        for c in t.last.outputs:
            choices.append(_final_choice(job, i, c))
    _ended(job, trackers, 200)
    return {"id": job.id, "object": job.kind, "created": job.created, "model": job.st.served_model_name,
            "system_fingerprint": _fingerprint(job), "choices": choices, "usage": _usage(job, trackers)}


def _fingerprint(job: Job) -> str:
    return f"lmforge-{job.sv.label}"


def _ended(job: Job, trackers: list[_Tracker], status: int) -> None:
    """A request is over: its outcome feeds the canary guard, its exchange the request log."""
    st = job.st
    if st.canary is not None:
        st.canary.outcome(job.sv.label, status >= 500)
    if status == 200:
        st.metrics.observe_repetition(job.sv.label, [c.text for t in trackers if t.last is not None
                                                     for c in t.last.outputs])
    if st.exchange_log is None or status != 200:
        return
    if job.kind == "chat.completion":
        prompt = "\n".join(f"{m['role']}: {m['content']}" for m in job.messages)
    else:
        prompt = "\n".join(t if t is not None else job.sv.tokenizer.decode(ids) if job.sv.tokenizer else str(ids)
                           for t, ids in zip(job.texts, job.prompts))
    response = "\n".join(c.text for t in trackers if t.last is not None for c in t.last.outputs)
    st.exchange_log.add({"id": job.id, "created": job.created, "model": st.served_model_name,
                         "model_version": job.sv.label, "user": job.req.user,
                         "kind": "chat" if job.kind == "chat.completion" else "completion",
                         "prompt": prompt, "response": response})


def _final_choice(job: Job, prompt_index: int, c) -> dict:
    index = prompt_index * job.n + c.index
    if job.kind == "chat.completion":
        lp = {"content": _chat_logprobs(job, c.token_ids, c.logprobs, 0)} if c.logprobs is not None else None
        return {"index": index, "message": {"role": "assistant", "content": c.text}, "logprobs": lp,
                "finish_reason": c.finish_reason}
    text = c.text
    if job.req.echo:
        text = (job.texts[prompt_index] or job.sv.tokenizer.decode(job.prompts[prompt_index])) + text
    lp = _completion_logprobs(job, c.token_ids, c.logprobs, 0, 0) if c.logprobs is not None else None
    return {"index": index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}


def _completion_logprobs(job: Job, token_ids: list[int], logprobs: list[dict], start: int, offset: int) -> dict:
    """OpenAI's legacy shape for tokens[start:]; `offset` = characters of text before them."""
    st, tokens, token_lps, tops, offsets = job.sv, [], [], [], []
    for tid, lps in zip(token_ids[start:], logprobs[start:]):
        s = st.token_text(tid)
        tokens.append(s)
        token_lps.append(lps.get(tid))
        tops.append({st.token_text(k): v for k, v in lps.items()})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(job: Job, token_ids: list[int], logprobs: list[dict], start: int) -> list[dict]:
    st, k, out = job.sv, job.params.logprobs or 0, []

    def entry(tid: int, lp: float) -> dict:
        s = st.token_text(tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    for tid, lps in zip(token_ids[start:], logprobs[start:]):
        top = sorted(lps.items(), key=lambda kv: -kv[1])[:k]
        out.append({**entry(tid, lps.get(tid)), "top_logprobs": [entry(t, v) for t, v in top]})
    return out


async def _stream(job: Job) -> AsyncIterator[str]:
    """SSE chunks; one per sample per engine step. A cancelled stream (client gone) aborts."""
    trackers = [_Tracker(job.n) for _ in job.prompts]
    base = {"id": job.id, "object": job.kind + ".chunk", "created": job.created, "model": job.st.served_model_name,
            "system_fingerprint": _fingerprint(job)}
    status = 200
    chat = job.kind == "chat.completion"
    try:
        if chat:
            for i in range(job.n):
                yield _sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}]})
        elif job.req.echo:
            for p, (ids, text) in enumerate(zip(job.prompts, job.texts)):
                echo = text if text is not None else job.sv.tokenizer.decode(ids)
                for i in range(job.n):
                    yield _sse({**base, "choices": [{"index": p * job.n + i, "text": echo, "logprobs": None,
                                                     "finish_reason": None}]})
        async for p, out in _outputs(job, trackers):
            t = trackers[p]
            for c in out.outputs:
                if t.done[c.index] or (len(c.token_ids) == t.sent_tokens[c.index] and c.finish_reason is None):
                    continue
                yield _sse({**base, "choices": [_delta_choice(job, t, p, c)]})
        if job.req.include_usage:
            yield _sse({**base, "choices": [], "usage": _usage(job, trackers)})
    except Exception as e:  # headers are gone: report in-band, as vLLM does
        err = _engine_error(e)
        status = err.status
        job.st.metrics.count_error(err.status)
        yield _sse(err.body())
    _ended(job, trackers, status)
    yield "data: [DONE]\n\n"


def _delta_choice(job: Job, t: _Tracker, p: int, c) -> dict:
    i, start, text_start = c.index, t.sent_tokens[c.index], t.sent_text[c.index]
    delta = c.text[text_start:]
    t.sent_text[i], t.sent_tokens[i] = len(c.text), len(c.token_ids)
    t.done[i] = c.finish_reason is not None
    if job.kind == "chat.completion":
        lp = {"content": _chat_logprobs(job, c.token_ids, c.logprobs, start)} if c.logprobs is not None else None
        return {"index": i, "delta": {"content": delta}, "logprobs": lp, "finish_reason": c.finish_reason}
    lp = _completion_logprobs(job, c.token_ids, c.logprobs, start, text_start) if c.logprobs is not None else None
    return {"index": p * job.n + i, "text": delta, "logprobs": lp, "finish_reason": c.finish_reason}
