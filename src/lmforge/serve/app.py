"""The OpenAI-compatible HTTP server: the assembly of routes, serving classes and the engine client.

`build_app(engine, ServerConfig(served_model_name, ...))` returns the app (`config.py` holds the typed
settings); `lmforge serve` runs it under uvicorn.
Endpoints: `POST /v1/completions`, `POST /v1/chat/completions`, `POST /v1/responses`, `POST /v1/embeddings`,
`POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`, `POST /v1/feedback`,
`POST /admin/reload`, `GET /v1/models`, `GET /v1/models/{id}`, `GET /health` (`/live`, `/ready`), `GET /metrics`,
`GET /version`, `/ui`; with `allow_runtime_lora_updating`, `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter` (admin key; `serving_lora.py`).
Streams are SSE (`data: {json}\\n\\n` ... `data: [DONE]\\n\\n`).

The layers, as vLLM's `entrypoints/openai` has them:

    route (here)  ->  serving class, one per endpoint        ->  EngineClient (engine_client.py)
                      serving_completions / serving_chat          VersionRouterClient: champion,
                      (both over serving_engine.OpenAIServing),   challenger, routing, restarts,
                      serving_responses (over serving_chat),      reload, drain  ->  engines
                      serving_embedding, serving_tokenization,
                      serving_feedback, serving_admin

What the HTTP side does, and why it is here rather than in the engine: it tokenizes and renders
chat templates on a worker thread and checks prompt + max_tokens against the context before
anything reaches an engine (a bad request is a 400, never a broken stream); it turns engine
timestamps into Prometheus histograms outside the step loop (`metrics.py`); it aborts a request
whose client went away; admission control (`--max-waiting`: 429 while that many sequences wait for
a first token, `guard.Admission`); limits before work (`guard.py`: the API key, or the separate admin
key, before the body is read, a body size limit and deadlines, a length bound before tokenizing;
`connection.py`: header deadline, idle timeout, connection cap, lingering close). Failure: a dead engine
is restarted (up to `max_engine_restarts`, counted in /metrics), then the server stops non-zero;
at shutdown every request still running is aborted before the listener's grace period ends, so
each stream ends with `finish_reason: "abort"` and `[DONE]`.

It knows nothing about scheduling, sampling or KV paging. Run: `lmforge serve MODEL_DIR`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from fastapi import Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from lmforge import __version__
from lmforge.engine import AsyncLLMEngine

from .config import ServerConfig
from .console import mount_console
from .engine_client import VersionRouterClient
from .errors import OpenAIError, document_errors, install_error_handlers
from .exchange_log import ExchangeLog
from .guard import Admission, GuardMiddleware, ServerLimits
from .metrics import LoadLogger, ServerMetrics
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest, FeedbackRequest,
                       ResponsesRequest, TokenizeRequest)
from .serving_admin import ServingAdmin
from .serving_chat import OpenAIServingChat
from .serving_chat import encode_chat as _encode_chat  # noqa: F401 - tests import it from here
from .serving_completions import OpenAIServingCompletion
from .serving_embedding import OpenAIServingEmbedding
from .serving_engine import VERSION_HEADER  # noqa: F401 - part of this module's surface
from .serving_feedback import ServingFeedback
from .serving_lora import ROUTE_RESPONSES as LORA_ROUTE_RESPONSES
from .serving_lora import LoadLoRAAdapterRequest, LoRAAdapters, ServingLoRA, UnloadLoRAAdapterRequest
from .serving_responses import OpenAIServingResponses
from .serving_tokenization import OpenAIServingTokenization
from .versions import Served

log = logging.getLogger("lmforge.serve")
EngineOrLoader = AsyncLLMEngine | Callable[[], AsyncLLMEngine]


class ServerState:
    """The server-wide parts; the engines are behind `client` (an `EngineClient` over the versions)."""

    def __init__(self, served_model_name: str, api_key: str | None, limits: ServerLimits, on_rollback=None):
        self.served_model_name, self.api_key, self.limits = served_model_name, api_key, limits
        self.metrics: ServerMetrics | None = None

        def rolled_back(kind: str, details: dict) -> None:
            self.metrics.auto_rollbacks.inc()
            if on_rollback is not None:
                on_rollback(kind, details)

        self.client = VersionRouterClient(limits.max_engine_restarts, self._on_attach, rolled_back,
                                          lambda: self.metrics.engine_restarts.inc())
        self.admission = Admission(limits.max_waiting)
        self.created = int(time.time())
        self.exchange_log = None  # ExchangeLog when --log-requests
        self.feedback = None  # FeedbackStore when feedback is on
        self.tool_call_parser = "hermes"  # how tool calls are written and read (--tool-call-parser)
        self.chat_template: str | None = None  # --chat-template: overrides the model's (not a request's own)
        self.loras = LoRAAdapters(served_model_name)  # model names that pick a LoRA adapter (--lora-modules)
        self.reloader: Callable[[], dict] | None = None  # role -> (label, loader, path), for /admin/reload
        # one worker: tokenization and template rendering leave the event loop, and a burst of them
        # queues here instead of multiplying memory
        self.tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="lmforge-tokenize")

    def _on_attach(self, champion: Served) -> None:
        if self.metrics is None:
            self.metrics = ServerMetrics(self.served_model_name, champion.max_model_len, self.client.version_stats,
                                         lambda: self.exchange_log)

    @property
    def router(self):  # the versions, for tests and the console; endpoints go through `client`
        return self.client.router

    @router.setter
    def router(self, value) -> None:
        self.client.router = value

    @property
    def ready(self) -> bool:
        return self.client.ready

    @property
    def fatal(self) -> str | None:
        return self.client.fatal

    @property
    def load_error(self) -> BaseException | None:
        return self.client.load_error

    @property
    def closing(self) -> bool:
        return self.client.closing

    @closing.setter
    def closing(self, value: bool) -> None:
        self.client.closing = value

    @property
    def max_model_len(self) -> int:
        return self.client.max_model_len

    def not_ready_reason(self) -> str:
        return self.client.not_ready_reason()

    async def abort_all(self) -> None:
        await self.client.abort_all()


def build_app(engine: EngineOrLoader, config: ServerConfig) -> FastAPI:
    """An app over `engine`, set up by `config`. Pass a loader (a callable returning the engine) to
    answer 503 while the model loads; the app then owns the engine, restarts it if it dies
    (`config.limits.max_engine_restarts` times) and shuts it down on exit. A ready engine passed in
    stays the caller's. Versions, feedback and request logging: see `ServerConfig`."""
    state = ServerState(config.served_model_name, config.api_key, config.limits, config.versions.on_rollback)
    state.reloader, state.feedback = config.versions.reloader, config.feedback
    state.tool_call_parser, state.chat_template = config.tool_call_parser, config.chat_template
    state.loras = LoRAAdapters(config.served_model_name, config.max_lora_rank, config.max_loaded_loras)
    base_dir = engine.model_path if isinstance(engine, AsyncLLMEngine) else None  # a loader: not known yet
    for name, path in config.lora_modules.items():  # checked (against the base's shapes when known) up front
        state.loras.add(name, path, base_dir)
    app = FastAPI(title="lmforge", lifespan=_lifespan(state, engine, config), docs_url=None, redoc_url=None)
    app.state.server = state
    count_error = lambda status: state.metrics and state.metrics.count_error(status)  # noqa: E731
    install_error_handlers(app, on_error=count_error)
    app.add_middleware(GuardMiddleware, api_key=config.api_key, admin_api_key=config.admin_api_key,
                       limits=config.limits, max_model_len_fn=lambda: state.max_model_len or 2048,
                       on_error=count_error)
    _add_health_routes(app, state)
    _add_info_routes(app, state)
    _add_openai_routes(app, state, config)
    mount_console(app)
    document_errors(app, auth=config.api_key is not None)
    return app


def _lifespan(state: ServerState, engine: EngineOrLoader, config: ServerConfig):
    """Start: the load logger, the exchange log, and the engine (attached, or loaded in the background
    and watched). Stop: refuse new work, wait for a load in progress, shut down what the app owns."""
    client, versions = state.client, config.versions

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        tasks = [asyncio.create_task(_log_load(state, config.log_interval_s))]
        loading = None
        if config.feedback is not None and config.log_requests:
            state.exchange_log = await asyncio.to_thread(ExchangeLog, config.feedback)
        if isinstance(engine, AsyncLLMEngine):
            client.attach(Served("champion", versions.version, engine))
        else:
            loading = asyncio.create_task(client.load(versions.version, engine, versions.challenger,
                                                      versions.canary_percent))
            tasks.append(asyncio.create_task(client.watch()))
        try:
            yield
        finally:
            state.closing = True
            for t in tasks:
                t.cancel()
            if loading is not None:
                await loading  # a load in progress cannot be interrupted; wait for it, then free it
                await client.shutdown()
            if state.exchange_log is not None:
                await asyncio.to_thread(state.exchange_log.close)
            state.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    return lifespan


def _ready_dependency(state: ServerState):
    """A FastAPI dependency: the state when the engine serves, else 503 with the reason."""
    async def ready(request: Request) -> ServerState:
        if not state.ready:
            raise OpenAIError(503, state.not_ready_reason(), None, "engine_not_ready")
        return state

    return ready


def _add_health_routes(app: FastAPI, state: ServerState) -> None:
    """`/health` (= `/health/ready`) and `/health/live`, as Kubernetes probes read them."""
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


def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    """`/version`, `/metrics` (Prometheus) and `/v1/models`."""
    ready = _ready_dependency(state)

    @app.get("/version")
    async def version_info() -> dict:
        info = state.client.info()
        return {"version": __version__, "models": info.models, "canary_percent": info.canary_percent,
                "rolled_back": info.rolled_back}

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.metrics is None:
            return Response(b"", media_type="text/plain; version=0.0.4")
        body = state.metrics.exposition()  # the engine's stats are a snapshot: nothing here waits for a step
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    def cards(st: ServerState) -> list[dict]:
        # `root` is the served name, not the weights' path on this machine
        return [{"id": st.served_model_name, "object": "model", "created": st.created, "owned_by": "lmforge",
                 "root": st.served_model_name, "parent": None, "max_model_len": st.max_model_len},
                *st.loras.cards(st.created, st.max_model_len)]

    @app.get("/v1/models")
    async def models(st: ServerState = Depends(ready)) -> dict:
        return {"object": "list", "data": cards(st)}

    @app.get("/v1/models/{model_id:path}", summary="One served model (the base or a LoRA adapter); 404 otherwise")
    async def model(model_id: str, st: ServerState = Depends(ready)) -> dict:
        card = next((c for c in cards(st) if c["id"] == model_id), None)
        if card is None:
            raise OpenAIError(404, f"the model {model_id!r} does not exist", "model", "model_not_found")
        return card


def _add_openai_routes(app: FastAPI, state: ServerState, config: ServerConfig) -> None:
    """The work endpoints, each one line over its serving class."""
    ready = _ready_dependency(state)
    serving_completion, serving_chat = OpenAIServingCompletion(state), OpenAIServingChat(state)
    serving_feedback, serving_admin = ServingFeedback(state), ServingAdmin(state)
    serving_responses, serving_embedding = OpenAIServingResponses(state), OpenAIServingEmbedding(state)
    serving_tokenization = OpenAIServingTokenization(state, serving_chat)

    # "stream": true answers 200 with SSE: say so in /openapi.json (clients and fuzzers read it)
    streamed = {200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}}}

    @app.post("/v1/completions", responses=streamed)
    async def completions(req: CompletionRequest, raw: Request, st: ServerState = Depends(ready)):
        return await serving_completion(req, raw)

    @app.post("/v1/chat/completions", responses=streamed)
    async def chat(req: ChatCompletionRequest, raw: Request, st: ServerState = Depends(ready)):
        return await serving_chat(req, raw)

    @app.post("/v1/responses", responses=streamed, summary="OpenAI's Responses API, text in and text out")
    async def responses(req: ResponsesRequest, raw: Request, st: ServerState = Depends(ready)):
        return await serving_responses(req, raw)

    @app.post("/v1/embeddings", summary="The served model's last-token hidden state per input, L2-normalized")
    async def embeddings(req: EmbeddingRequest, st: ServerState = Depends(ready)) -> dict:
        return await serving_embedding(req)

    @app.post("/tokenize", summary="vLLM's: a prompt's or a chat's token ids, as the endpoints encode them")
    async def tokenize(req: TokenizeRequest, st: ServerState = Depends(ready)) -> dict:
        return await serving_tokenization.tokenize(req)

    @app.post("/detokenize", summary="vLLM's: token ids to text")
    async def detokenize(req: DetokenizeRequest, st: ServerState = Depends(ready)) -> dict:
        return await serving_tokenization.detokenize(req)

    @app.get("/tokenizer_info", summary="vLLM's: special tokens and chat template (lm-eval's remote tokenizer)")
    async def tokenizer_info(st: ServerState = Depends(ready)) -> dict:
        return serving_tokenization.tokenizer_info()

    @app.post("/v1/feedback", summary="A user's score for a completion (thumbs -1/+1 or 1-5), optional comment "
                                      "and corrected answer")
    async def post_feedback(fb: FeedbackRequest) -> dict:
        return await serving_feedback(fb)

    @app.post("/admin/reload", summary="Load the registry's current champion/challenger; in-flight requests "
                                       "finish on the versions they started on")
    async def admin_reload() -> dict:
        return await serving_admin.reload()

    if config.allow_runtime_lora_updating:
        _add_lora_routes(app, state)


def _add_lora_routes(app: FastAPI, state: ServerState) -> None:
    """vLLM's runtime adapter endpoints (its VLLM_ALLOW_RUNTIME_LORA_UPDATING): behind the admin key."""
    serving_lora = ServingLoRA(state)

    @app.post("/v1/load_lora_adapter", summary="Serve a LoRA adapter (peft folder) under a new model name",
              response_class=PlainTextResponse, responses=LORA_ROUTE_RESPONSES)
    async def load_lora_adapter(req: LoadLoRAAdapterRequest):
        return await serving_lora.load(req)

    @app.post("/v1/unload_lora_adapter", summary="Stop serving a LoRA adapter (running requests finish)",
              response_class=PlainTextResponse, responses=LORA_ROUTE_RESPONSES)
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest):
        return await serving_lora.unload(req)


async def _log_load(state: ServerState, interval: float) -> None:
    logger = None
    while True:
        await asyncio.sleep(interval)
        if state.metrics is None:
            continue
        logger = logger or LoadLogger(state.metrics, interval)
        with contextlib.suppress(Exception):
            logger.tick(state.client.stats())
