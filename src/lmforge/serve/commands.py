"""CLI verb of the serving stage: `lmforge serve MODEL_DIR` (`lmforge bench serve` is in `lmforge.bench.commands`).

`serve` opens the port at once and answers 503 while the model loads, then serves the
OpenAI API (see `app.py`). SIGTERM or SIGINT: uvicorn stops accepting connections, in-flight
requests get `--shutdown-timeout` seconds to finish (then they are aborted in the engine, so each
stream still ends with finish_reason "abort" and [DONE]), the engine shuts down, and the process
exits 0. A model that fails to load exits 1 with the reason; an engine that dies more often than
`--max-engine-restarts` exits 3. Heavy imports happen inside the verbs.

    lmforge serve runs/model --port 8000 --served-model-name tiny

Mounted by `lmforge.cli` as the `serve` command (`python -m lmforge.cli serve MODEL_DIR` runs it the
same way).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn, Optional

import typer

from . import vllm_args
from .config import ListenConfig, ServerConfig, ServerLimits, VersionsConfig
from .tool_parsers import TOOL_PARSERS

if TYPE_CHECKING:
    from lmforge.engine import EngineConfig

# `lmforge serve`'s options, one alias each, so the verb's signature reads as a list of flags.
ModelDirOpt = Annotated[Optional[Path], typer.Argument(
    help="A Hugging Face layout model directory (with tokenizer files); or use --registry/--model.")]
RegistryOpt = Annotated[Optional[Path], typer.Option(
    help="Serve versions from this registry (SQLite file; `lmforge registry`) instead of MODEL_DIR.")]
CanaryOpt = Annotated[float, typer.Option(
    help="With --registry: percent of requests for the `challenger` alias (sticky per `user`).")]
LogRequestsOpt = Annotated[bool, typer.Option(
    help="Store every exchange (PII masked) in --feedback-db, for /v1/feedback and the flywheel.")]
FeedbackDbOpt = Annotated[Optional[Path], typer.Option(
    help="Feedback store (SQLite) [default: $LMFORGE_HOME/feedback.db]; enables POST /v1/feedback.")]
ServedModelNameOpt = Annotated[Optional[str], typer.Option(
    help="The model id clients send (default: the directory's name).")]
ApiKeyOpt = Annotated[Optional[str], typer.Option(
    envvar="LMFORGE_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1/*.")]
AdminApiKeyOpt = Annotated[Optional[str], typer.Option(
    envvar="LMFORGE_ADMIN_API_KEY",
    help="Turn on /admin/* (reload versions) behind this key, distinct from --api-key (default: admin off).")]
MaxWaitingOpt = Annotated[Optional[int], typer.Option(
    help="Answer 429 while this many requests wait for their first token (default: unbounded).")]
NumKvBlocksOpt = Annotated[Optional[int], typer.Option(help="KV pool size in blocks (default: from memory).")]
QuantActivationsOpt = Annotated[str, typer.Option(
    help="auto: int8 for int-weight checkpoints where the CPU has VNNI or AVX2 integer dot products, else none | "
    "none: quantized weights run on the exact A16 kernels | int8: activations quantized per token and integer dot "
    "products, faster, within ~1% of exact.")]
KvCacheDtypeOpt = Annotated[str, typer.Option(
    help="auto (the model's dtype; bfloat16 under float32 activations over a bf16 checkpoint or with "
         "--quant-activations int8) | bfloat16 | float32 | int8 (a scale per token per head: ~2x the tokens per "
         "byte of bf16).")]
TensorParallelSizeOpt = Annotated[int, typer.Option(
    help="Split the model's layers over this many processes (CUDA: one GPU each), as vLLM's flag.")]
ShutdownTimeoutOpt = Annotated[float, typer.Option(
    help="Seconds in-flight requests get to finish after SIGTERM/SIGINT.")]
EngineProcessOpt = Annotated[bool, typer.Option(
    help="Run the engine in its own process (no GIL shared with the HTTP event loop), as vLLM does.")]
MaxBodyBytesOpt = Annotated[Optional[int], typer.Option(
    help="Largest request body; 413 above (default: 1 MiB + 128 bytes per token of context).")]
ReadTimeoutOpt = Annotated[float, typer.Option(
    help="Seconds to wait for the next piece of a request body; 408 after.")]
BodyTimeoutOpt = Annotated[float, typer.Option(
    help="Seconds for a whole request body, however it trickles in; 408 after.")]
HeaderTimeoutOpt = Annotated[float, typer.Option(
    help="Seconds for a request's headers (and a new connection's first request); 408 after.")]
KeepAliveTimeoutOpt = Annotated[float, typer.Option(
    help="Seconds an idle keep-alive connection stays open between requests.")]
MaxConnectionsOpt = Annotated[int, typer.Option(
    help="Open connections at most; one more is answered 503 and closed.")]
AdminRateOpt = Annotated[int, typer.Option(
    help="Requests a minute per client address on /admin/*; 429 past it.")]
MaxEngineRestartsOpt = Annotated[int, typer.Option(
    help="Restart a dead engine this many times; then exit 3 so a supervisor learns.")]
ToolCallParserOpt = Annotated[str, typer.Option(
    help=f"How the model writes tool calls, as vLLM's flag: {' | '.join(TOOL_PARSERS)} (docs/serving.md).")]
SpeculativeModelOpt = Annotated[Optional[str], typer.Option(
    help="Speculative decoding with this draft model (same tokenizer, smaller), as vLLM's flag (docs/engine.md).")]
NumSpeculativeTokensOpt = Annotated[int, typer.Option(
    help="Tokens proposed per step and verified in one forward; needed with --speculative-model or -method.")]
SpeculativeMethodOpt = Annotated[Optional[str], typer.Option(
    help="ngram (prompt lookup: no draft model) | draft (the default with --speculative-model).")]
ReplicasOpt = Annotated[int, typer.Option(min=1, help=(
    "Engine replicas on Ray actors behind this one endpoint, routed by prompt prefix (docs/scale.md)."))]
RayAddressOpt = Annotated[Optional[str], typer.Option(
    help="Ray cluster for the replicas (auto, HOST:6379, ray://HOST:10001) [default: a local cluster].")]
LoraModulesOpt = Annotated[Optional[list[str]], typer.Option(help=(
    "LoRA adapters (peft folders) served over the base, as name=path; repeat the flag or separate with commas; "
    "a request's model picks one (docs/serving.md)."))]
MaxLorasOpt = Annotated[int, typer.Option(min=1, help="LoRA adapters resident at once; more are swapped in LRU.")]
MaxLoraRankOpt = Annotated[int, typer.Option(min=1, help="The largest LoRA rank accepted (every slot is this wide).")]
MaxLoadedLorasOpt = Annotated[int, typer.Option(help=(
    "LoRA adapters served at once, --lora-modules and runtime loads together; a load past it is a 400 (as vLLM's "
    "--max-cpu-loras bounds what it keeps)."))]
# vLLM's launch names (serve/vllm_args.py): aliases of the settings above, so a vLLM launch script runs as it is
ModelOpt = Annotated[Optional[str], typer.Option(
    help="The model folder or .gguf file, as vLLM's --model (= MODEL_DIR); with --registry: the registered name.")]
GpuMemoryUtilizationOpt = Annotated[Optional[float], typer.Option(
    help="As vLLM's: the share of memory this server may use; sets the KV pool (CUDA: of the GPU's total, less "
         "the weights; CPU: of the memory available, at most what --max-num-seqs full-length sequences fill).")]
ChatTemplateOpt = Annotated[Optional[str], typer.Option(
    help="A Jinja chat template (a file, or the template's text) used instead of the model's, as vLLM's flag.")]
EnableAutoToolChoiceOpt = Annotated[bool, typer.Option(
    help="vLLM's switch for tool_choice auto: accepted; auto works with every --tool-call-parser here.")]
TrustRemoteCodeOpt = Annotated[bool, typer.Option(
    help="Accepted for vLLM launch scripts; nothing remote runs (no model's own Python code is ever loaded).")]
EnableLoraOpt = Annotated[bool, typer.Option(
    help="LoRA slots in the engine (implied by --lora-modules), as vLLM's flag; adapters come with "
         "--lora-modules or at run time.")]
SpeculativeConfigOpt = Annotated[Optional[str], typer.Option(
    help="vLLM's JSON form of the speculative flags: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
         "\"prompt_lookup_max\": 4} or {\"model\": \"DRAFT_DIR\", \"num_speculative_tokens\": 4}.")]
# vLLM flags kept out of --help: accepted where there is nothing to change here, refused with the reason otherwise
_HIDDEN_BOOL = Annotated[bool, typer.Option(hidden=True)]
EnableChunkedPrefillOpt = Annotated[Optional[bool], typer.Option(
    "--enable-chunked-prefill/--no-enable-chunked-prefill", hidden=True)]
UvicornLogLevelOpt = Annotated[Optional[str], typer.Option(hidden=True)]
QuantizationOpt = Annotated[Optional[str], typer.Option(hidden=True)]
PipelineParallelSizeOpt = Annotated[int, typer.Option(hidden=True)]
TokenizerOpt = Annotated[Optional[Path], typer.Option(hidden=True)]
AllowRuntimeLoraOpt = Annotated[bool, typer.Option(
    envvar=["LMFORGE_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING"],
    help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter, behind --admin-api-key (vLLM's env switch).")]


def serve(
    model_dir: ModelDirOpt = None,
    registry: RegistryOpt = None,
    model: ModelOpt = None,
    canary: CanaryOpt = 0.0,
    log_requests: LogRequestsOpt = False,
    feedback_db: FeedbackDbOpt = None,
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    served_model_name: ServedModelNameOpt = None,
    api_key: ApiKeyOpt = None,
    admin_api_key: AdminApiKeyOpt = None,
    max_waiting: MaxWaitingOpt = None,
    dtype: Annotated[str, typer.Option(help="auto | float32 | bfloat16 | float16.")] = "auto",
    device: Annotated[str, typer.Option(help="auto | cpu | cuda[:N].")] = "auto",
    block_size: Annotated[int, typer.Option(help="Tokens per KV block.")] = 16,
    num_kv_blocks: NumKvBlocksOpt = None,
    kv_cache_memory_bytes: Annotated[Optional[int], typer.Option(help="KV pool budget in bytes.")] = None,
    kv_cache_dtype: KvCacheDtypeOpt = "auto",
    max_num_seqs: Annotated[int, typer.Option(help="Most sequences in one step.")] = 128,
    max_num_batched_tokens: Annotated[int, typer.Option(help="Per-step token budget.")] = 2048,
    max_model_len: Annotated[Optional[int], typer.Option(help="Context length (default: the model's).")] = None,
    enable_prefix_caching: Annotated[bool, typer.Option(help="Reuse KV blocks of shared prompt prefixes.")] = True,
    seed: Annotated[int, typer.Option(help="Seed for requests without one.")] = 0,
    tensor_parallel_size: TensorParallelSizeOpt = 1,
    shutdown_timeout: ShutdownTimeoutOpt = 10.0,
    log_level: Annotated[str, typer.Option(help="debug | info | warning.")] = "info",
    engine_process: EngineProcessOpt = True,
    max_body_bytes: MaxBodyBytesOpt = None,
    read_timeout: ReadTimeoutOpt = ServerLimits.read_timeout_s,
    body_timeout: BodyTimeoutOpt = ServerLimits.body_timeout_s,
    header_timeout: HeaderTimeoutOpt = ServerLimits.header_timeout_s,
    keep_alive_timeout: KeepAliveTimeoutOpt = ServerLimits.keep_alive_timeout_s,
    max_connections: MaxConnectionsOpt = ServerLimits.max_connections,
    admin_rate: AdminRateOpt = ServerLimits.admin_requests_per_minute,
    max_engine_restarts: MaxEngineRestartsOpt = ServerLimits.max_engine_restarts,
    tool_call_parser: ToolCallParserOpt = ServerConfig.tool_call_parser,
    speculative_model: SpeculativeModelOpt = None,
    speculative_method: SpeculativeMethodOpt = None,
    num_speculative_tokens: NumSpeculativeTokensOpt = 0,
    quant_activations: QuantActivationsOpt = "auto",
    replicas: ReplicasOpt = 1,
    ray_address: RayAddressOpt = None,
    lora_modules: LoraModulesOpt = None,
    max_loras: MaxLorasOpt = 1,
    max_lora_rank: MaxLoraRankOpt = 16,
    max_loaded_loras: MaxLoadedLorasOpt = ServerConfig.max_loaded_loras,
    allow_runtime_lora_updating: AllowRuntimeLoraOpt = False,
    gpu_memory_utilization: GpuMemoryUtilizationOpt = None,
    chat_template: ChatTemplateOpt = None,
    enable_auto_tool_choice: EnableAutoToolChoiceOpt = False,
    trust_remote_code: TrustRemoteCodeOpt = False,
    enable_lora: EnableLoraOpt = False,
    speculative_config: SpeculativeConfigOpt = None,
    enforce_eager: _HIDDEN_BOOL = False,  # no CUDA graphs are captured here: nothing to turn off
    disable_log_requests: _HIDDEN_BOOL = False,  # request bodies are never logged (only with --log-requests)
    disable_log_stats: _HIDDEN_BOOL = False,  # the load log line stays: it is one line every few seconds
    enable_chunked_prefill: EnableChunkedPrefillOpt = None,
    uvicorn_log_level: UvicornLogLevelOpt = None,
    quantization: QuantizationOpt = None,
    pipeline_parallel_size: PipelineParallelSizeOpt = 1,
    tokenizer: TokenizerOpt = None,
) -> None:
    """Serve MODEL_DIR over the OpenAI API (/v1/*), with /health, /metrics (vLLM's names) and /version."""
    model_dir = _model_dir(_vllm(vllm_args.model_source, model_dir, registry, model), registry, model, canary)
    for note in _vllm(vllm_args.check_vllm_flags, model_dir, quantization=quantization, tokenizer=tokenizer,
                      pipeline_parallel_size=pipeline_parallel_size, enable_chunked_prefill=enable_chunked_prefill,
                      trust_remote_code=trust_remote_code, enable_auto_tool_choice=enable_auto_tool_choice):
        typer.echo(f"note: {note}", err=True)
    spec = _speculative(speculative_config, speculative_model, speculative_method, num_speculative_tokens)
    kv_cache_memory_bytes = _kv_budget(gpu_memory_utilization, kv_cache_memory_bytes, num_kv_blocks, model_dir, device,
                                       dtype, max_num_seqs, max_model_len)
    loras = _lora_modules(lora_modules or [], model_dir, max_lora_rank)
    if (replicas > 1 or ray_address) and (loras or allow_runtime_lora_updating or enable_lora):
        _usage_error("--replicas does not carry LoRA adapters yet: serve adapters from one engine, or merge each "
                     "adapter (`lmforge export`) and serve the merged folders")
    config = _engine_config(model=str(model_dir), dtype=dtype, device=device, block_size=block_size, seed=seed,
                            num_kv_blocks=num_kv_blocks, kv_cache_memory_bytes=kv_cache_memory_bytes,
                            kv_cache_dtype=kv_cache_dtype, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                            max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=enable_prefix_caching,
                            tensor_parallel_size=tensor_parallel_size, **spec,
                            quant_activations=quant_activations, max_loras=max_loras, max_lora_rank=max_lora_rank,
                            enable_lora=bool(loras) or allow_runtime_lora_updating or enable_lora)
    limits = _server_limits(max_waiting=max_waiting, max_body_bytes=max_body_bytes, read_timeout_s=read_timeout,
                            body_timeout_s=body_timeout, header_timeout_s=header_timeout,
                            keep_alive_timeout_s=keep_alive_timeout, max_connections=max_connections,
                            admin_requests_per_minute=admin_rate, max_engine_restarts=max_engine_restarts)
    if shutdown_timeout < 0:
        _usage_error("--shutdown-timeout must be >= 0")
    if config.speculative_method is not None:  # against the models' configs, before the port opens
        from lmforge.engine.spec_decode import check_speculative  # deferred: torch, only with speculation

        _vllm(check_speculative, str(model_dir), config.speculative_model, config.num_speculative_tokens,
              max_model_len, max_num_batched_tokens)
    preflight(model_dir, dtype, device, max_num_seqs, max_model_len, kv_cache_memory_bytes)
    server = _server_config(served_model_name or model or model_dir.name, log_requests, feedback_db,
                            registry is not None, api_key=api_key, admin_api_key=admin_api_key, limits=limits,
                            tool_call_parser=tool_call_parser, lora_modules=loras, max_lora_rank=max_lora_rank,
                            allow_runtime_lora_updating=allow_runtime_lora_updating, max_loaded_loras=max_loaded_loras,
                            chat_template=_vllm(vllm_args.chat_template_text, chat_template) if chat_template else None)
    log_level = uvicorn_log_level or log_level
    raise typer.Exit(run_server(config, server, ListenConfig(host, port, shutdown_timeout, log_level), engine_process,
                                registry=(registry, model) if registry else None, canary=canary,
                                replicas=(replicas, ray_address)))


def _vllm(fn: Callable, *args, **kwargs):
    """A `vllm_args` function; its ValueError (naming the flag) exits 2."""
    try:
        return fn(*args, **kwargs)
    except ValueError as e:
        _usage_error(str(e))


def _speculative(config_json: str | None, model: str | None, method: str | None, k: int) -> dict:
    """EngineConfig's speculative fields from lmforge's flags or vLLM's --speculative-config (not both)."""
    if config_json is None:
        return {"speculative_model": model, "speculative_method": method, "num_speculative_tokens": k}
    if model is not None or method is not None or k:
        _usage_error("--speculative-config and --speculative-model/--speculative-method/--num-speculative-tokens "
                     "say the same thing; pass one form")
    return _vllm(vllm_args.speculative_config, config_json)


def _kv_budget(fraction: float | None, kv_bytes: int | None, num_kv_blocks: int | None, model_dir: Path, device: str,
               dtype: str, max_num_seqs: int, max_model_len: int | None) -> int | None:
    """--kv-cache-memory-bytes, or the bytes --gpu-memory-utilization gives the pool on this machine."""
    if fraction is None:
        return kv_bytes
    if kv_bytes is not None or num_kv_blocks is not None:
        _usage_error("--gpu-memory-utilization sizes the KV pool, as --kv-cache-memory-bytes and --num-kv-blocks do; "
                     "pass one of them")
    budget = _vllm(vllm_args.kv_bytes_from_utilization, fraction, model_dir, device, dtype, max_num_seqs,
                   max_model_len)
    typer.echo(f"note: --gpu-memory-utilization {fraction}: a KV pool of {budget / 2**30:.3f} GiB", err=True)
    return budget


def _model_dir(model_dir: Path | None, registry: Path | None, model: str | None, canary: float) -> Path:
    """MODEL_DIR, or the registry's champion; exit 2 before importing torch when it is not a model folder."""
    _check_source(model_dir, registry, model, canary)
    if registry is not None:
        model_dir = _champion_dir(registry, model)
    gguf_file = model_dir.suffix.lower() == ".gguf" and model_dir.is_file()  # a llama.cpp file, served as is
    if not gguf_file and not (model_dir / "config.json").exists():  # before importing torch: fail fast on a typo
        _usage_error(f"{model_dir}: no config.json; pass a Hugging Face layout model directory or a .gguf file")
    if gguf_file:
        _check_gguf(model_dir)
    return model_dir


def _check_gguf(path: Path) -> None:
    """Parse the file's header and tensor table and read its config (cheap: nothing is loaded), so a damaged or
    unsupported file is one line naming the file and the fault, exit 2, not a traceback after the port opened."""
    from lmforge.quant.gguf_file import open_gguf  # deferred: numpy and gguf, only for a .gguf
    from lmforge.quant.gguf_load import hf_config  # deferred: torch

    try:
        f = open_gguf(path)
        hf_config(f.metadata, path, set(f.tensors))
    except (ValueError, OSError) as e:  # GGUFError is a ValueError; hf_config's refusals name the file and the key
        _usage_error(str(e).splitlines()[0] if str(path) in str(e) else f"{path}: {e}")


def _lora_modules(values: list[str], model_dir: Path, max_lora_rank: int) -> dict[str, str]:
    """--lora-modules name=path[,name=path] (or vLLM's JSON {"name": .., "path": ..}) -> {name: path}, each
    folder checked against the base (`lmforge.engine.lora.read_adapter`); exit 2 naming what is wrong."""
    pairs = []
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                item = json.loads(value)
                pairs.append((item["name"], item["path"]))
            except (ValueError, KeyError, TypeError):
                _usage_error(f'--lora-modules {value}: the JSON form is {{"name": "NAME", "path": "PATH"}}')
        else:
            pairs += [tuple(p.split("=", 1)) if "=" in p else (p, "") for p in value.split(",") if p.strip()]
    names = [name for name, _ in pairs]
    for name, path in pairs:
        if not name.strip() or not path.strip() or names.count(name) > 1:
            _usage_error(f"--lora-modules {name}={path}: each adapter is NAME=PATH, with a name of its own")
    if not pairs:
        return {}
    from lmforge.engine.lora import check_adapter  # deferred: torch, after the cheap checks

    out = {}
    for name, path in pairs:
        try:
            check_adapter(path, model_dir, max_lora_rank, name)
        except ValueError as e:
            _usage_error(f"--lora-modules {name}: {e}")
        out[name] = path
    return out


def _usage_error(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def _check_source(model_dir: Path | None, registry: Path | None, model: str | None, canary: float) -> None:
    """Exactly one source (MODEL_DIR, or --registry with --model); --canary only with a registry."""
    if (model_dir is None) == (registry is None) or (registry is not None and not model):
        _usage_error("pass either MODEL_DIR or --registry R --model NAME")
    if not 0 <= canary <= 100 or (canary and registry is None):
        _usage_error("--canary is a percent in [0, 100] and needs --registry")


def _champion_dir(registry: Path, model: str) -> Path:
    """The registry's champion folder (weights verified), or exit 2 with the registry's reason."""
    from lmforge.registry import RegistryError  # deferred: the registry pulls numpy; a CLI verb starts light

    try:
        versions = registry_versions(registry, model)
    except RegistryError as e:
        _usage_error(str(e))
    return Path(versions["champion"][1])


def _engine_config(**kwargs) -> EngineConfig:
    """The engine's config from the flags; a value it refuses exits 2 with its message."""
    from lmforge.engine import EngineConfig  # deferred: torch, after the cheap checks

    try:
        return EngineConfig(**kwargs)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


_FLAGS = {"max_waiting": "--max-waiting", "max_body_bytes": "--max-body-bytes", "read_timeout_s": "--read-timeout",
          "body_timeout_s": "--body-timeout", "header_timeout_s": "--header-timeout",
          "keep_alive_timeout_s": "--keep-alive-timeout", "max_connections": "--max-connections",
          "admin_requests_per_minute": "--admin-rate", "max_engine_restarts": "--max-engine-restarts"}


def _server_limits(**values) -> ServerLimits:
    """The request limits from the flags; a value ServerLimits refuses exits 2 naming the flag."""
    if values["max_waiting"] is not None and values["max_waiting"] < 0:
        _usage_error("--max-waiting must be >= 0")
    if values["max_body_bytes"] is not None and values["max_body_bytes"] < 1024:
        _usage_error("--max-body-bytes must be >= 1024")
    if values["max_engine_restarts"] < 0:
        _usage_error("--max-engine-restarts must be >= 0")
    try:
        return ServerLimits(**values)
    except ValueError as e:
        field_name = str(e).split("=", 1)[0].removeprefix("ServerLimits.")
        _usage_error(f"{_FLAGS.get(field_name, field_name)}: {str(e).split(': ', 1)[-1]}")


def _server_config(served_model_name: str, log_requests: bool, feedback_db: Path | None, from_registry: bool,
                   **fields) -> ServerConfig:
    """The app's settings (`fields`: ServerConfig's, checked there; a value it refuses exits 2); a feedback
    store (--feedback-db, by default `feedback.db` beside the registry's default store) when requests are
    logged, a store is named, or versions come from a registry."""
    feedback = None
    if log_requests or feedback_db is not None or from_registry:
        from lmforge.registry import FeedbackStore  # deferred: the registry pulls numpy
        from lmforge.registry.store import default_path

        feedback = FeedbackStore(feedback_db or default_path().with_name("feedback.db"))
    try:
        return ServerConfig(served_model_name, feedback=feedback, log_requests=log_requests, **fields)
    except ValueError as e:
        _usage_error(str(e))


def preflight(model_dir: Path, dtype: str, device: str, max_num_seqs: int, max_model_len: int | None,
              kv_cache_memory_bytes: int | None) -> None:
    """Refuse, before loading anything, a model and KV pool that cannot fit the device's memory
    (`lmforge.perf.preflight`); exit 2 with what would fit. The pool is what the engine would take:
    the given budget, on CPU at most 2 GiB, on CUDA what is left after the weights."""
    from lmforge.engine.llm_engine import CPU_KV_CACHE_BYTES  # deferred: torch, only when serving
    from lmforge.perf.preflight import PreflightError, preflight_inference

    if model_dir.suffix == ".gguf":  # the estimate reads config.json; a GGUF file's shapes are in its header
        logging.getLogger("lmforge.serve").info("pre-flight memory check skipped for a .gguf file")
        return
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
    import torch  # deferred: a CLI verb starts without torch

    return torch.cuda.is_available()


def registry_versions(registry: Path, name: str) -> dict:
    """role -> (label, path) of the registry's `champion` and `challenger` aliases, weights verified
    against their hashes (a changed file is refused before anything loads)."""
    from lmforge.registry import Registry, RegistryError  # deferred: the registry pulls numpy

    reg = Registry(registry, create=False)  # a mistyped --registry is an error, not a new empty file
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
    if "challenger" in out and out["challenger"][0] == out["champion"][0]:
        del out["challenger"]  # a registry written before rollback cleared it: one version, one engine
    return out


# Exit codes (docs/deploy.md): 0 clean shutdown, 1 the model failed to load, 2 bad arguments,
# 3 the engine died more often than --max-engine-restarts allows.
EXIT_LOAD_FAILED, EXIT_ENGINE_FAILED = 1, 3
ABORT_GRACE_S = 5.0  # after aborting what still runs, the time streams get to send their last chunk


def run_server(config: EngineConfig, server: ServerConfig, listen: ListenConfig, engine_process: bool = True,
               registry: tuple[Path, str] | None = None, canary: float = 0.0,
               replicas: tuple[int, str | None] = (1, None)) -> int:
    """Block serving until SIGTERM/SIGINT (see the exit codes above). `config` is every engine's (a
    registry version's differs only in its model folder); with `registry=(path, name)` the champion
    and challenger come from there, the challenger taking `canary` percent of requests.

    Shutdown: uvicorn stops accepting first, then in-flight requests get `listen.shutdown_timeout`
    seconds to finish; whatever still runs then is aborted in the engine, so every stream still ends
    with `finish_reason: "abort"` and `[DONE]` (not a cut connection), within `ABORT_GRACE_S` more.
    `replicas=(N, address)` with N > 1 or an address: each engine is N replicas on Ray actors
    (`replicas.RayReplicaEngine`, each its own process, so `engine_process` does not apply)."""
    if engine_process and replicas == (1, None):  # the engine child loads while this process builds the app
        from lmforge.engine.messages import CoreStart
        from lmforge.engine.spawn import prespawn

        # one version: its CoreStart now (the child may be importing since `lmforge.launch`); with a registry
        # the child only imports here, and the first engine built sends it its start
        prespawn(CoreStart(config, os.getpid(), None) if registry is None else None)
    from lmforge.engine import AsyncLLMEngine, ProcessAsyncLLMEngine  # deferred: torch, only when serving

    from .app import build_app  # deferred: fastapi and the engine, only when serving

    logging.basicConfig(level=listen.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine_cls = ProcessAsyncLLMEngine if engine_process else AsyncLLMEngine
    if replicas[0] > 1 or replicas[1] is not None:
        from .replicas import RayReplicaEngine, init_ray  # deferred: torch and (inside) Ray, only for --replicas

        try:
            init_ray(replicas[1])  # here, on the main thread, before uvicorn takes the signals
        except ConnectionError as e:  # --ray-address with no cluster there: one line, within 30 s
            _usage_error(str(e))
        engine_cls = functools.partial(RayReplicaEngine, replicas=replicas[0], address=replicas[1],
                                       max_restarts=server.limits.max_engine_restarts)
    loader = _engine_loader(config, engine_cls)
    if registry is not None:
        server = dataclasses.replace(server, versions=_registry_versions_config(*registry, canary, loader))
    fastapi_app = build_app(loader(config.model), server)
    state = fastapi_app.state.server
    _uvicorn_server(fastapi_app, listen).run()
    if state.load_error is not None:
        return EXIT_LOAD_FAILED
    return EXIT_ENGINE_FAILED if state.fatal is not None else 0


def _engine_loader(config: EngineConfig, engine_cls: type) -> Callable[[str], Callable[[], object]]:
    """path -> a loader of an engine on that model folder, with the rest of `config`."""
    def loader(path: str):
        return lambda: engine_cls(dataclasses.replace(config, model=path))

    return loader


def _registry_versions_config(reg_path: Path, name: str, canary: float, loader) -> VersionsConfig:
    """The registry's champion (and challenger, at `canary` percent), its reload and rollback hooks."""
    from lmforge.registry import Registry  # deferred: the registry pulls numpy

    first = registry_versions(reg_path, name)
    challenger = (first["challenger"][0], loader(first["challenger"][1])) if "challenger" in first else None

    def reloader() -> dict:
        return {role: (label, loader(path), path) for role, (label, path) in registry_versions(reg_path, name).items()}

    return VersionsConfig(version=first["champion"][0], challenger=challenger,
                          canary_percent=canary if challenger else 0.0, reloader=reloader,
                          on_rollback=lambda kind, details: Registry(reg_path).record_event(name, kind, details))


def _uvicorn_server(fastapi_app, listen: ListenConfig):
    """uvicorn's server with our shutdown: a clean exit code on SIGTERM, a stop when the engine fails
    for good, and in-flight requests aborted `listen.shutdown_timeout` seconds into the shutdown."""
    import uvicorn  # deferred: only `lmforge serve` needs it, not every CLI verb

    from .connection import uvicorn_config  # deferred: uvicorn, as above

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
            timer = loop.call_later(listen.shutdown_timeout, lambda: loop.create_task(state.abort_all()))
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    return Server(uvicorn_config(fastapi_app, host=listen.host, port=listen.port, log_level=listen.log_level,
                                 access_log=False, timeout_graceful_shutdown=listen.shutdown_timeout + ABORT_GRACE_S))
