"""CLI verbs of the serving stage: `lmforge serve MODEL_DIR` and `lmforge bench serve`.

`serve` opens the port at once and answers 503 while the model loads, then serves the
OpenAI API (see `app.py`). SIGTERM or SIGINT: uvicorn stops accepting connections, in-flight
requests get `--shutdown-timeout` seconds to finish (then they are aborted in the engine, so each
stream still ends with finish_reason "abort" and [DONE]), the engine shuts down, and the process
exits 0. A model that fails to load exits 1 with the reason; an engine that dies more often than
`--max-engine-restarts` exits 3. Heavy imports happen inside the verbs.

    lmforge serve runs/model --port 8000 --served-model-name tiny
    lmforge bench serve --base-url http://127.0.0.1:8000 --max-concurrency 32 --out runs/bench

Mounted by `lmforge.cli` (`serve` as a command, `bench_serve` under `bench`); `app` runs both
stand-alone: `python -c "from lmforge.serve.commands import app; app()" serve MODEL_DIR`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(name="serve", no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False,
                  help="Serve a model over the OpenAI API, and benchmark a server.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks.")
app.add_typer(bench_app, name="bench")


def serve(
    model_dir: Annotated[Path, typer.Argument(help="A Hugging Face layout model directory (with tokenizer files).")],
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    served_model_name: Annotated[Optional[str], typer.Option(
        help="The model id clients send (default: the directory's name).")] = None,
    api_key: Annotated[Optional[str], typer.Option(
        envvar="LMFORGE_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1/*.")] = None,
    max_waiting: Annotated[Optional[int], typer.Option(
        help="Answer 429 while this many requests wait for their first token (default: unbounded).")] = None,
    dtype: Annotated[str, typer.Option(help="auto | float32 | bfloat16 | float16.")] = "auto",
    device: Annotated[str, typer.Option(help="auto | cpu | cuda[:N].")] = "auto",
    block_size: Annotated[int, typer.Option(help="Tokens per KV block.")] = 16,
    num_kv_blocks: Annotated[Optional[int], typer.Option(help="KV pool size in blocks (default: from memory).")] = None,
    kv_cache_memory_bytes: Annotated[Optional[int], typer.Option(help="KV pool budget in bytes.")] = None,
    max_num_seqs: Annotated[int, typer.Option(help="Most sequences in one step.")] = 128,
    max_num_batched_tokens: Annotated[int, typer.Option(help="Per-step token budget.")] = 2048,
    max_model_len: Annotated[Optional[int], typer.Option(help="Context length (default: the model's).")] = None,
    enable_prefix_caching: Annotated[bool, typer.Option(help="Reuse KV blocks of shared prompt prefixes.")] = True,
    seed: Annotated[int, typer.Option(help="Seed for requests without one.")] = 0,
    shutdown_timeout: Annotated[float, typer.Option(
        help="Seconds in-flight requests get to finish after SIGTERM/SIGINT.")] = 10.0,
    log_level: Annotated[str, typer.Option(help="debug | info | warning.")] = "info",
    engine_process: Annotated[bool, typer.Option(
        help="Run the engine in its own process (no GIL shared with the HTTP event loop), as vLLM does.")] = True,
    max_body_bytes: Annotated[Optional[int], typer.Option(
        help="Largest request body; 413 above (default: 1 MiB + 128 bytes per token of context).")] = None,
    read_timeout: Annotated[float, typer.Option(
        help="Seconds to wait for the next piece of a request body; 408 after.")] = 30.0,
    max_engine_restarts: Annotated[int, typer.Option(
        help="Restart a dead engine this many times; then exit 3 so a supervisor learns.")] = 3,
) -> None:
    """Serve MODEL_DIR over the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models),
    with /health, /metrics (Prometheus, vLLM's names) and /version."""
    import logging

    if not (model_dir / "config.json").exists():  # before importing torch: a typo should fail fast
        typer.echo(f"error: {model_dir}: no config.json; pass a Hugging Face layout model directory", err=True)
        raise typer.Exit(2)
    from lmforge.engine import EngineConfig

    try:
        config = EngineConfig(model=str(model_dir), dtype=dtype, device=device, block_size=block_size,
                              num_kv_blocks=num_kv_blocks, kv_cache_memory_bytes=kv_cache_memory_bytes,
                              max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                              max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching, seed=seed)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    from .guard import ServerLimits

    for name, value, low in (("--max-waiting", max_waiting, 0), ("--max-body-bytes", max_body_bytes, 1024),
                             ("--read-timeout", read_timeout, 0.001), ("--max-engine-restarts", max_engine_restarts, 0),
                             ("--shutdown-timeout", shutdown_timeout, 0)):
        if value is not None and value < low:
            typer.echo(f"error: {name} must be >= {low}", err=True)
            raise typer.Exit(2)
    limits = ServerLimits(max_body_bytes=max_body_bytes, read_timeout_s=read_timeout, max_waiting=max_waiting,
                          max_engine_restarts=max_engine_restarts)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    raise typer.Exit(run_server(config, served_model_name or model_dir.name, host, port, api_key, max_waiting,
                                shutdown_timeout, log_level, engine_process, limits))


# Exit codes (docs/deploy.md): 0 clean shutdown, 1 the model failed to load, 2 bad arguments,
# 3 the engine died more often than --max-engine-restarts allows.
EXIT_LOAD_FAILED, EXIT_ENGINE_FAILED = 1, 3
ABORT_GRACE_S = 5.0  # after aborting what still runs, the time streams get to send their last chunk


def run_server(config, served_model_name: str, host: str, port: int, api_key: str | None,
               max_waiting: int | None, shutdown_timeout: float, log_level: str = "info",
               engine_process: bool = True, limits=None) -> int:
    """Block serving until SIGTERM/SIGINT (see the exit codes above).

    Shutdown: uvicorn stops accepting first, then in-flight requests get `shutdown_timeout` seconds to
    finish; whatever still runs then is aborted in the engine, so every stream still ends with
    `finish_reason: "abort"` and `[DONE]` (not a cut connection), within `ABORT_GRACE_S` more."""
    import asyncio
    import contextlib
    import signal
    import threading

    import uvicorn

    from lmforge.engine import AsyncLLMEngine, ProcessAsyncLLMEngine

    from .app import build_app

    engine_cls = ProcessAsyncLLMEngine if engine_process else AsyncLLMEngine
    fastapi_app = build_app(lambda: engine_cls(config), served_model_name, api_key, max_waiting, limits=limits)
    state = fastapi_app.state.server

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn re-raises the captured signal after its graceful shutdown, so the process
            # would die "by SIGTERM" (exit -15); a clean shutdown is a normal exit here.
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, h in original.items():
                    signal.signal(s, h)

        async def on_tick(self, counter: int) -> bool:
            return state.load_error is not None or state.fatal is not None or await super().on_tick(counter)

        async def shutdown(self, sockets=None) -> None:
            state.closing = True
            loop = asyncio.get_running_loop()
            timer = loop.call_later(shutdown_timeout, lambda: loop.create_task(state.abort_all()))
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    server = Server(uvicorn.Config(fastapi_app, host=host, port=port, log_level=log_level, access_log=False,
                                   timeout_graceful_shutdown=shutdown_timeout + ABORT_GRACE_S))
    server.run()
    if state.load_error is not None:
        return EXIT_LOAD_FAILED
    return EXIT_ENGINE_FAILED if state.fatal is not None else 0


app.command("serve")(serve)


@bench_app.command("serve")
def bench_serve(
    base_url: Annotated[str, typer.Option(help="The server, e.g. http://127.0.0.1:8000.")],
    model: Annotated[Optional[str], typer.Option(help="Model id (default: the server's first).")] = None,
    num_prompts: Annotated[int, typer.Option(help="Requests to send.")] = 100,
    request_rate: Annotated[float, typer.Option(help="Poisson arrival rate, req/s; inf = all at once.")] = math.inf,
    max_concurrency: Annotated[Optional[int], typer.Option(help="Most requests in flight.")] = None,
    workload: Annotated[str, typer.Option(help="high-variance | uniform | shared-prefix.")] = "high-variance",
    input_len: Annotated[int, typer.Option(help="Prompt tokens (uniform, shared-prefix).")] = 128,
    output_len: Annotated[int, typer.Option(help="Output tokens (uniform, shared-prefix).")] = 128,
    seed: Annotated[int, typer.Option(help="Workload and arrival seed.")] = 0,
    slo: Annotated[Optional[str], typer.Option(help="SLOs for goodput, ms: 'ttft=500,tpot=50'.")] = None,
    api_key: Annotated[Optional[str], typer.Option(envvar="LMFORGE_API_KEY", help="Bearer key.")] = None,
    offline_model: Annotated[Optional[Path], typer.Option(
        help="Also run the same requests through the offline engine on this model dir (HTTP cost).")] = None,
    offline_dtype: Annotated[str, typer.Option(help="dtype for --offline-model.")] = "auto",
    out: Annotated[Optional[Path], typer.Option(help="Write bench.json and bench.md here.")] = None,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
) -> None:
    """Load-test an OpenAI-compatible server: TTFT, TPOT, ITL, E2E percentiles, throughput, goodput,
    and the server's own /metrics view beside them."""
    import httpx

    from .bench import BenchConfig, bench_serve as run, parse_slo, to_markdown

    try:
        cfg = BenchConfig(base_url.rstrip("/"), model, num_prompts, request_rate, max_concurrency, workload,
                          input_len, output_len, seed, parse_slo(slo), api_key,
                          str(offline_model) if offline_model else None, offline_dtype, progress)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    try:
        report = run(cfg, out)
    except httpx.HTTPError as e:
        typer.echo(f"error: {base_url}: {type(e).__name__}: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(to_markdown(report))
    raise typer.Exit(0 if report["client"]["failed"] == 0 else 1)
