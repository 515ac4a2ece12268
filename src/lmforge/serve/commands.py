"""CLI verb of the serving stage: `lmforge serve MODEL_DIR` (`lmforge bench serve` is in `lmforge.bench.commands`).

`serve` opens the port at once and answers 503 while the model loads, then serves the
OpenAI API (see `app.py`). SIGTERM or SIGINT: uvicorn stops accepting connections, in-flight
requests get `--shutdown-timeout` seconds to finish (then they are aborted in the engine, so each
stream still ends with finish_reason "abort" and [DONE]), the engine shuts down, and the process
exits 0. A model that fails to load exits 1 with the reason; an engine that dies more often than
`--max-engine-restarts` exits 3. Heavy imports happen inside the verbs.

    lmforge serve runs/model --port 8000 --served-model-name tiny

Mounted by `lmforge.cli` (`serve` as a command); `app` runs it
stand-alone: `python -c "from lmforge.serve.commands import app; app()" serve MODEL_DIR`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(name="serve", no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False,
                  help="Serve a model over the OpenAI API.")


def serve(
    model_dir: Annotated[Optional[Path], typer.Argument(
        help="A Hugging Face layout model directory (with tokenizer files); or use --registry/--model.")] = None,
    registry: Annotated[Optional[Path], typer.Option(
        help="Serve versions from this registry (SQLite file; `lmforge registry`) instead of MODEL_DIR.")] = None,
    model: Annotated[Optional[str], typer.Option(help="With --registry: the registered model's name.")] = None,
    canary: Annotated[float, typer.Option(
        help="With --registry: percent of requests for the `challenger` alias (sticky per `user`).")] = 0.0,
    log_requests: Annotated[bool, typer.Option(
        help="Store every exchange (PII masked) in --feedback-db, for /v1/feedback and the flywheel.")] = False,
    feedback_db: Annotated[Optional[Path], typer.Option(
        help="Feedback store (SQLite) [default: $LMFORGE_HOME/feedback.db]; enables POST /v1/feedback.")] = None,
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
    kv_cache_dtype: Annotated[str, typer.Option(
        help="auto (the model's dtype) | int8 (a scale per token per head: ~2x the tokens per byte).")] = "auto",
    max_num_seqs: Annotated[int, typer.Option(help="Most sequences in one step.")] = 128,
    max_num_batched_tokens: Annotated[int, typer.Option(help="Per-step token budget.")] = 2048,
    max_model_len: Annotated[Optional[int], typer.Option(help="Context length (default: the model's).")] = None,
    enable_prefix_caching: Annotated[bool, typer.Option(help="Reuse KV blocks of shared prompt prefixes.")] = True,
    seed: Annotated[int, typer.Option(help="Seed for requests without one.")] = 0,
    tensor_parallel_size: Annotated[int, typer.Option(
        help="Split the model's layers over this many processes (CUDA: one GPU each), as vLLM's flag.")] = 1,
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

    if (model_dir is None) == (registry is None) or (registry is not None and not model):
        typer.echo("error: pass either MODEL_DIR or --registry R --model NAME", err=True)
        raise typer.Exit(2)
    if not 0 <= canary <= 100 or (canary and registry is None):
        typer.echo("error: --canary is a percent in [0, 100] and needs --registry", err=True)
        raise typer.Exit(2)
    versions = None
    if registry is not None:
        from lmforge.registry import RegistryError

        try:
            versions = registry_versions(registry, model)
        except RegistryError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
        model_dir = Path(versions["champion"][1])
    if not (model_dir / "config.json").exists():  # before importing torch: a typo should fail fast
        typer.echo(f"error: {model_dir}: no config.json; pass a Hugging Face layout model directory", err=True)
        raise typer.Exit(2)
    from lmforge.engine import EngineConfig

    try:
        config = EngineConfig(model=str(model_dir), dtype=dtype, device=device, block_size=block_size,
                              num_kv_blocks=num_kv_blocks, kv_cache_memory_bytes=kv_cache_memory_bytes,
                              kv_cache_dtype=kv_cache_dtype,
                              max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                              max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching, seed=seed,
                              tensor_parallel_size=tensor_parallel_size)
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
    preflight(model_dir, dtype, device, max_num_seqs, max_model_len, kv_cache_memory_bytes)
    feedback = None
    if log_requests or feedback_db is not None or registry is not None:
        from lmforge.registry import FeedbackStore
        from lmforge.registry.store import default_path

        feedback = FeedbackStore(feedback_db or default_path().with_name("feedback.db"))
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    raise typer.Exit(run_server(config, served_model_name or model or model_dir.name, host, port, api_key,
                                max_waiting, shutdown_timeout, log_level, engine_process, limits,
                                registry=(registry, model) if registry else None, canary=canary, feedback=feedback,
                                log_requests=log_requests))


def preflight(model_dir: Path, dtype: str, device: str, max_num_seqs: int, max_model_len: int | None,
              kv_cache_memory_bytes: int | None) -> None:
    """Refuse, before loading anything, a model and KV pool that cannot fit the device's memory
    (`lmforge.perf.preflight`); exit 2 with what would fit. The pool is what the engine would take:
    the given budget, on CPU at most 2 GiB, on CUDA what is left after the weights."""
    import json
    import logging

    from lmforge.engine.llm_engine import CPU_KV_CACHE_BYTES
    from lmforge.perf.preflight import PreflightError, preflight_inference

    cuda = device.startswith("cuda") or (device == "auto" and _cuda_available())
    kv = kv_cache_memory_bytes if kv_cache_memory_bytes is not None else (0 if cuda else CPU_KV_CACHE_BYTES)
    try:
        context = max_model_len or json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings", 2048)
        preflight_inference(model_dir, "float32" if dtype == "float32" else "bfloat16", max_num_seqs, context,
                            "cuda" if cuda else "cpu", kv)
    except PreflightError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    except Exception as e:  # an estimate that cannot read this model must not stop a server that may fit
        logging.getLogger("lmforge.serve").warning("pre-flight memory check skipped: %s: %s", type(e).__name__, e)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def registry_versions(registry: Path, name: str) -> dict:
    """role -> (label, path) of the registry's `champion` and `challenger` aliases, weights verified
    against their hashes (a changed file is refused before anything loads)."""
    from lmforge.registry import Registry, RegistryError

    reg = Registry(registry)
    out = {}
    for role in ("champion", "challenger"):
        try:
            mv = reg.get(name, role)
        except RegistryError:
            if role == "champion":
                raise
            continue
        reg.verify(mv)
        out[role] = (str(mv.version), mv.path)
    return out


# Exit codes (docs/deploy.md): 0 clean shutdown, 1 the model failed to load, 2 bad arguments,
# 3 the engine died more often than --max-engine-restarts allows.
EXIT_LOAD_FAILED, EXIT_ENGINE_FAILED = 1, 3
ABORT_GRACE_S = 5.0  # after aborting what still runs, the time streams get to send their last chunk


def run_server(config, served_model_name: str, host: str, port: int, api_key: str | None,
               max_waiting: int | None, shutdown_timeout: float, log_level: str = "info",
               engine_process: bool = True, limits=None, registry: tuple[Path, str] | None = None,
               canary: float = 0.0, feedback=None, log_requests: bool = False) -> int:
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

    import dataclasses

    engine_cls = ProcessAsyncLLMEngine if engine_process else AsyncLLMEngine

    def loader(path: str):
        return lambda: engine_cls(dataclasses.replace(config, model=path))

    kw: dict = {}
    if registry is not None:
        from lmforge.registry import Registry

        reg_path, name = registry
        first = registry_versions(reg_path, name)
        kw["version"] = first["champion"][0]
        if "challenger" in first:
            kw["challenger"] = (first["challenger"][0], loader(first["challenger"][1]))
            kw["canary_percent"] = canary

        def reloader() -> dict:
            return {role: (label, loader(path), path) for role, (label, path) in registry_versions(reg_path, name).items()}

        kw["reloader"] = reloader
        kw["on_rollback"] = lambda kind, details: Registry(reg_path).record_event(name, kind, details)
    fastapi_app = build_app(loader(config.model), served_model_name, api_key, max_waiting, limits=limits,
                            feedback=feedback, log_requests=log_requests, **kw)
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

