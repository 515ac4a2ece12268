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
* admission control: with `max_waiting`, a request is refused with 429 while that many engine
  requests are submitted but have not produced a token yet (counted here).

It knows nothing about scheduling, sampling or KV paging. Run: `lmforge serve MODEL_DIR`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lmforge.engine import AsyncLLMEngine, RequestOutput, SamplingParams

from .errors import OpenAIError, bad_request, from_value_error, install_error_handlers
from .metrics import LoadLogger, ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("lmforge.serve")
EngineOrLoader = AsyncLLMEngine | Callable[[], AsyncLLMEngine]


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _sse(obj: Any) -> str:
    return f"data: {_dumps(obj)}\n\n"


class ServerState:
    """The engine (None while loading) and what the handlers derive from it once."""

    def __init__(self, served_model_name: str, api_key: str | None, max_waiting: int | None):
        self.served_model_name, self.api_key, self.max_waiting = served_model_name, api_key, max_waiting
        self.engine: AsyncLLMEngine | None = None
        self.load_error: BaseException | None = None
        self.metrics: ServerMetrics | None = None
        self.num_waiting = 0  # submitted engine requests without a first token yet
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}

    def attach(self, engine: AsyncLLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.max_model_len
        self.vocab_size: int = engine.vocab_size
        self.model_dir = engine.model_path
        self.metrics = ServerMetrics(self.served_model_name, self.max_model_len, self.stats)

    def stats(self) -> dict | None:
        return self.engine.stats() if self.engine is not None else None

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.is_running

    def token_text(self, token_id: int) -> str:
        """Decoded text of one token, for logprobs (cached: the same ids recur constantly)."""
        s = self._token_text.get(token_id)
        if s is None:
            s = self._token_text[token_id] = self.tokenizer.decode([token_id]) if self.tokenizer else str(token_id)
        return s


# ---- the app -----------------------------------------------------------------------------------------


def build_app(engine: EngineOrLoader, served_model_name: str, api_key: str | None = None,
              max_waiting: int | None = None, log_interval_s: float = 5.0) -> FastAPI:
    """An app over `engine`. Pass a loader (a callable returning the engine) to answer 503 while the
    model loads; the app then owns the engine and shuts it down on exit. A ready engine passed in
    stays the caller's."""
    state = ServerState(served_model_name, api_key, max_waiting)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loader = None
        if isinstance(engine, AsyncLLMEngine):
            state.attach(engine)
        else:
            loader = asyncio.create_task(_load(state, engine))
        logger = asyncio.create_task(_log_load(state, log_interval_s))
        try:
            yield
        finally:
            logger.cancel()
            if loader is not None:
                await loader  # a load in progress cannot be interrupted; wait for it, then free it
                if state.engine is not None:
                    await asyncio.to_thread(state.engine.shutdown)

    app = FastAPI(title="lmforge", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state
    install_error_handlers(app, on_error=lambda status: state.metrics and state.metrics.count_error(status))

    async def ready_and_authorized(request: Request) -> ServerState:
        if state.api_key is not None:
            auth = request.headers.get("authorization", "")
            if auth != f"Bearer {state.api_key}":
                raise OpenAIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                  None, "invalid_api_key")
        if not state.ready:
            raise OpenAIError(503, "the model is still loading" if state.engine is None and state.load_error is None
                              else f"the engine is not running: {state.load_error}", None, "engine_not_ready")
        return state

    @app.get("/health")
    async def health() -> Response:
        if not state.ready:
            raise OpenAIError(503, "the model is still loading", None, "engine_not_ready")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        from lmforge import __version__

        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.metrics is None:
            return Response(b"", media_type="text/plain; version=0.0.4")
        body = state.metrics.exposition()  # the engine's stats are a snapshot: nothing here waits for a step
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(st: ServerState = Depends(ready_and_authorized)) -> dict:
        return {"object": "list", "data": [{"id": st.served_model_name, "object": "model", "created": st.created,
                                            "owned_by": "lmforge", "root": st.model_dir, "parent": None,
                                            "max_model_len": st.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request, st: ServerState = Depends(ready_and_authorized)):
        return await _serve(st, raw, _completion_job(st, req))

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request, st: ServerState = Depends(ready_and_authorized)):
        return await _serve(st, raw, _chat_job(st, req))

    return app


async def _load(state: ServerState, loader: Callable[[], AsyncLLMEngine]) -> None:
    try:
        eng = await asyncio.to_thread(loader)
    except BaseException as e:  # keep serving 503 with the reason; the log says what broke
        state.load_error = e
        log.exception("engine failed to load")
        return
    state.attach(eng)
    log.info("engine ready: %s (max_model_len %d)", state.model_dir, state.max_model_len)


async def _log_load(state: ServerState, interval: float) -> None:
    logger = None
    while True:
        await asyncio.sleep(interval)
        if state.metrics is None:
            continue
        logger = logger or LoadLogger(state.metrics, interval)
        with contextlib.suppress(Exception):
            logger.tick(state.stats())


# ---- jobs: a validated request, ready to run ---------------------------------------------------------


class Job:
    """One HTTP request: its engine prompts (token ids), sampling params, and how to render outputs."""

    kind: str  # "text_completion" | "chat.completion"

    def __init__(self, st: ServerState, req: CompletionRequest | ChatCompletionRequest,
                 prompts: list[list[int]], params: SamplingParams, prefix: str):
        self.st, self.req, self.prompts, self.params = st, req, prompts, params
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.n = params.n


def _check_model(st: ServerState, model: str | None) -> None:
    if model is not None and model != st.served_model_name:
        raise OpenAIError(404, f"the model {model!r} does not exist; this server serves {st.served_model_name!r}",
                          "model", "model_not_found")


def _check_prompt(st: ServerState, ids: list[int], max_tokens: int | None, param: str) -> None:
    if not ids:
        raise bad_request("the prompt is empty: at least one token is needed", param)
    bad = [t for t in ids if not 0 <= t < st.vocab_size]
    if bad:
        raise bad_request(f"prompt token ids must be in [0, {st.vocab_size}): got {bad[:5]}", param)
    need = len(ids) + (max_tokens or 1)
    if need > st.max_model_len:
        raise bad_request(f"this model's maximum context length is {st.max_model_len} tokens; the request has "
                          f"{len(ids)} prompt tokens and asks for {max_tokens or 1} more ({need})",
                          "max_tokens" if max_tokens else param, "context_length_exceeded")


def _check_params(req, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    try:
        return req.sampling_params(max_tokens, logprobs)
    except ValueError as e:
        raise from_value_error(e) from None


def _completion_job(st: ServerState, req: CompletionRequest) -> Job:
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
            if st.tokenizer is None:
                raise bad_request("this model has no tokenizer: send prompts as token ids", "prompt")
            p = st.tokenizer.encode(p)  # the same call the engine makes, so outputs match offline LLM.generate
        _check_prompt(st, list(p), req.max_tokens, "prompt")
        ids.append(list(p))
    job = Job(st, req, ids, params, "cmpl")
    job.kind = "text_completion"
    job.texts = [p if isinstance(p, str) else None for p in prompts]
    return job


def _chat_job(st: ServerState, req: ChatCompletionRequest) -> Job:
    _check_model(st, req.model)
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    tok = st.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", "messages", "unsupported")
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    try:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=req.add_generation_prompt)
    except Exception as e:  # a template that raises on these messages (e.g. role order) is the client's 400
        raise bad_request(f"messages could not be rendered with the chat template: {e}", "messages") from None
    # The template writes every special token itself; do not let the tokenizer add a BOS on top.
    ids = tok.encode(text, add_special_tokens=False)
    max_tokens = req.resolved_max_tokens()
    params = _check_params(req, max_tokens, req.resolved_logprobs())
    _check_prompt(st, ids, max_tokens, "messages")
    job = Job(st, req, [ids], params, "chatcmpl")
    job.kind = "chat.completion"
    return job


# ---- running a job -----------------------------------------------------------------------------------


async def _serve(st: ServerState, raw: Request, job: Job):
    if st.max_waiting is not None and st.num_waiting + len(job.prompts) > st.max_waiting:
        raise OpenAIError(429, f"the server's waiting queue is full ({st.num_waiting} requests waiting, "
                          f"--max-waiting {st.max_waiting}); retry later", None, "queue_full")
    if job.req.stream:
        return StreamingResponse(_stream(job), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return JSONResponse(await _unless_disconnected(raw, _complete(job)))


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

    __slots__ = ("sent_text", "sent_tokens", "done", "last", "last_token_time", "waiting")

    def __init__(self, n: int):
        self.sent_text, self.sent_tokens, self.done = [0] * n, [0] * n, [False] * n
        self.last: RequestOutput | None = None
        self.last_token_time: float | None = None
        self.waiting = True


async def _outputs(job: Job, trackers: list[_Tracker]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, cumulative output) from every engine request of the job, as they come.

    Leaving early (a disconnect cancels us, or an error) aborts every engine request still running:
    `AsyncLLMEngine.generate` aborts when its consumer goes away, and pumps are cancelled."""
    st, engine = job.st, job.st.engine
    gens = [engine.generate(ids, job.params, f"{job.id}-{i}") for i, ids in enumerate(job.prompts)]
    st.num_waiting += len(gens)
    try:
        if len(gens) == 1:
            async for out in gens[0]:
                _on_output(st, trackers[0], out)
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
                    _on_output(st, trackers[i], item)
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for t in trackers:
            if t.waiting:
                t.waiting = False
                st.num_waiting -= 1
            if t.last is not None and not t.last.finished:  # aborted: count it, as vLLM does
                st.metrics.observe_finished(t.last, "abort")


def _on_output(st: ServerState, t: _Tracker, out: RequestOutput) -> None:
    if t.waiting:
        t.waiting = False
        st.num_waiting -= 1
    ltt = out.metrics.last_token_time
    if t.last_token_time is not None and ltt is not None and ltt > t.last_token_time:
        st.metrics.observe_itl(ltt - t.last_token_time)
    t.last_token_time = ltt
    t.last = out
    if out.finished:
        st.metrics.observe_finished(out)


def _usage(job: Job, trackers: list[_Tracker]) -> dict:
    outs = [t.last for t in trackers if t.last is not None]
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _engine_error(e: Exception) -> OpenAIError:
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, ValueError):
        return from_value_error(e)
    return OpenAIError(500, f"the engine failed on this request: {type(e).__name__}: {e}", None, "engine_error")


async def _complete(job: Job) -> dict:
    trackers = [_Tracker(job.n) for _ in job.prompts]
    try:
        async for _ in _outputs(job, trackers):
            pass
    except Exception as e:
        raise _engine_error(e) from None
    choices = []
    for i, t in enumerate(trackers):
        for c in t.last.outputs:
            choices.append(_final_choice(job, i, c))
    return {"id": job.id, "object": job.kind, "created": job.created, "model": job.st.served_model_name,
            "choices": choices, "usage": _usage(job, trackers)}


def _final_choice(job: Job, prompt_index: int, c) -> dict:
    index = prompt_index * job.n + c.index
    if job.kind == "chat.completion":
        lp = {"content": _chat_logprobs(job, c.token_ids, c.logprobs, 0)} if c.logprobs is not None else None
        return {"index": index, "message": {"role": "assistant", "content": c.text}, "logprobs": lp,
                "finish_reason": c.finish_reason}
    text = c.text
    if job.req.echo:
        text = (job.texts[prompt_index] or job.st.tokenizer.decode(job.prompts[prompt_index])) + text
    lp = _completion_logprobs(job, c.token_ids, c.logprobs, 0, 0) if c.logprobs is not None else None
    return {"index": index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}


def _completion_logprobs(job: Job, token_ids: list[int], logprobs: list[dict], start: int, offset: int) -> dict:
    """OpenAI's legacy shape for tokens[start:]; `offset` = characters of text before them."""
    st, tokens, token_lps, tops, offsets = job.st, [], [], [], []
    for tid, lps in zip(token_ids[start:], logprobs[start:]):
        s = st.token_text(tid)
        tokens.append(s)
        token_lps.append(lps.get(tid))
        tops.append({st.token_text(k): v for k, v in lps.items()})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(job: Job, token_ids: list[int], logprobs: list[dict], start: int) -> list[dict]:
    st, k, out = job.st, job.params.logprobs or 0, []

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
    base = {"id": job.id, "object": job.kind + ".chunk", "created": job.created, "model": job.st.served_model_name}
    chat = job.kind == "chat.completion"
    try:
        if chat:
            for i in range(job.n):
                yield _sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}]})
        elif job.req.echo:
            for p, (ids, text) in enumerate(zip(job.prompts, job.texts)):
                echo = text if text is not None else job.st.tokenizer.decode(ids)
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
        job.st.metrics.count_error(err.status)
        yield _sse(err.body())
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
