"""vLLM's launch names for `lmforge serve`: each is an alias of one of lmforge's own settings, so a vLLM
launch script runs with `lmforge serve` swapped in (docs/serving.md, "vLLM launch flags").

    --model X                        MODEL_DIR (without --registry; with it, still the registered name)
    --gpu-memory-utilization F       kv_cache_memory_bytes (`engine.config.kv_budget_for_utilization`)
    --chat-template FILE|TEXT        ServerConfig.chat_template (the template's text)
    --speculative-config JSON        speculative_method / speculative_model / num_speculative_tokens / ngram_*
    --enable-lora                    EngineConfig.enable_lora
    --enable-auto-tool-choice, --trust-remote-code, --enforce-eager, --disable-log-requests,
    --disable-log-stats, --enable-chunked-prefill, --uvicorn-log-level     accepted: nothing to change here
    --quantization, --pipeline-parallel-size > 1, --tokenizer (another folder), --no-enable-chunked-prefill
                                     refused with the reason (exit 2), never ignored

Pure functions of their inputs (the machine's memory is read in `kv_bytes_from_utilization` only);
ValueError names the flag and what to pass instead. Knows nothing about HTTP or Typer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# vLLM's `--speculative-config` keys this engine has a meaning for
SPEC_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
             "draft_tensor_parallel_size")
SPEC_METHODS = {"ngram": "ngram", "draft_model": "draft", "draft": "draft"}
SPEC_EXAMPLE = '\'{"method": "ngram", "num_speculative_tokens": 4}\' or \'{"model": "DRAFT_DIR", "num_speculative_tokens": 4}\''


def speculative_config(text: str) -> dict[str, Any]:
    """vLLM's `--speculative-config` JSON -> EngineConfig's speculative fields."""
    try:
        cfg = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--speculative-config: not JSON ({e}); e.g. {SPEC_EXAMPLE}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"--speculative-config: a JSON object, e.g. {SPEC_EXAMPLE}")
    unknown = sorted(set(cfg) - set(SPEC_KEYS))
    if unknown:
        raise ValueError(f"--speculative-config: {', '.join(unknown)} not supported here (known: {', '.join(SPEC_KEYS)})")
    method = cfg.get("method") or ("draft" if cfg.get("model") else None)
    if method not in SPEC_METHODS:
        raise ValueError(f"--speculative-config: method {method!r} is not implemented here; use \"ngram\" (prompt "
                         "lookup) or a draft model (\"draft_model\" with \"model\")")
    k = cfg.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"--speculative-config: num_speculative_tokens must be an integer >= 1, got {k!r}")
    if cfg.get("draft_tensor_parallel_size", 1) != 1:
        raise ValueError("--speculative-config: draft_tensor_parallel_size must be 1 (the draft runs whole)")
    out: dict[str, Any] = {"speculative_method": SPEC_METHODS[method], "num_speculative_tokens": k}
    if out["speculative_method"] == "draft":
        if not cfg.get("model"):
            raise ValueError("--speculative-config: a draft model needs \"model\": the draft's folder")
        out["speculative_model"] = str(cfg["model"])
    else:
        if cfg.get("model"):
            raise ValueError("--speculative-config: method ngram takes no \"model\" (it looks up the prompt)")
        for key in ("prompt_lookup_max", "prompt_lookup_min"):
            if key in cfg:
                out[f"ngram_{key}"] = cfg[key]
    return out


def chat_template_text(value: str) -> str:
    """`--chat-template`, as vLLM reads it: a file's text, or else the value itself when it is a Jinja
    template; checked to parse (a syntax error names its line)."""
    try:
        is_file = "\n" not in value and Path(value).is_file()
    except OSError:  # a name too long for the file system: inline text
        is_file = False
    if is_file:
        text = Path(value).read_text(encoding="utf-8")
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ValueError(f"--chat-template {value}: no such file, and not a Jinja template (no '{{{{' or '{{%'); "
                         "pass a template file or the template's text")
    import jinja2  # deferred: only with --chat-template

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        where = value if is_file else "the template text"
        raise ValueError(f"--chat-template {where}: line {e.lineno}: {e.message}") from None
    return text


def model_source(model_dir: Path | None, registry: Path | None, model: str | None) -> Path | None:
    """vLLM's `--model X` without --registry is the model (as MODEL_DIR); with --registry it stays the
    registered name. Returns MODEL_DIR to use (None with a registry)."""
    if registry is not None or model is None:
        return model_dir
    if model_dir is not None and Path(model) != model_dir:
        raise ValueError(f"MODEL_DIR {model_dir} and --model {model} name two models; pass one of them")
    path = Path(model)
    if not path.exists():
        raise ValueError(f"--model {model}: no such folder or .gguf file; lmforge serves local model folders "
                         f"(a Hugging Face Hub id: `lmforge pull {model}` prints the folder to pass)")
    return path


def check_vllm_flags(model_dir: Path, *, quantization: str | None, pipeline_parallel_size: int,
                     tokenizer: Path | None, enable_chunked_prefill: bool | None, trust_remote_code: bool,
                     enable_auto_tool_choice: bool) -> list[str]:
    """vLLM flags with no counterpart: refused (ValueError naming what to do), or accepted: returns a note
    for each accepted flag that a user may expect to do something."""
    if quantization is not None:
        raise ValueError(f"--quantization {quantization}: lmforge reads the scheme from the checkpoint "
                         "(compressed-tensors, GGUF); quantize it with `lmforge quantize` and drop the flag")
    if pipeline_parallel_size != 1:
        raise ValueError(f"--pipeline-parallel-size {pipeline_parallel_size}: serving splits a model by "
                         "--tensor-parallel-size only")
    if tokenizer is not None and tokenizer.resolve() != (model_dir if model_dir.is_dir() else model_dir.parent).resolve():
        raise ValueError(f"--tokenizer {tokenizer}: the tokenizer is read from the model folder ({model_dir}); "
                         "copy its files there and drop the flag")
    if enable_chunked_prefill is False:
        raise ValueError("--no-enable-chunked-prefill: the scheduler always chunks long prompts "
                         "(--max-num-batched-tokens bounds a chunk)")
    notes = []
    if trust_remote_code:
        notes.append("--trust-remote-code: accepted; nothing remote runs here (lmforge loads Llama-family "
                     "checkpoints with its own code, never a model's Python files)")
    if enable_auto_tool_choice:
        notes.append("--enable-auto-tool-choice: accepted; tool_choice auto works with every --tool-call-parser")
    return notes


def kv_bytes_from_utilization(fraction: float, model_dir: Path, device: str, dtype: str, max_num_seqs: int,
                              max_model_len: int | None) -> int:
    """`--gpu-memory-utilization` -> the KV pool's bytes on this machine (see `kv_budget_for_utilization`)."""
    from lmforge.engine.config import kv_budget_for_utilization  # deferred: the engine package loads torch

    cuda = device.startswith("cuda") or (device == "auto" and _cuda())
    if cuda:
        import torch  # deferred: only with --gpu-memory-utilization on CUDA

        index = torch.device(device if device.startswith("cuda") else "cuda").index or 0
        free, total = torch.cuda.mem_get_info(index)
    else:
        import psutil  # deferred: as above

        mem = psutil.virtual_memory()
        free, total = mem.available, mem.total
    config = _hf_config(model_dir)
    context = max_model_len or int(config.get("max_position_embeddings", 2048))
    need = max_num_seqs * context * _kv_bytes_per_token(config) if config else free
    return kv_budget_for_utilization(fraction, cuda=cuda, total_bytes=total, free_bytes=free,
                                     weights_bytes=_weights_bytes(model_dir, dtype, config), need_bytes=need)


def _cuda() -> bool:
    import torch  # deferred: a CLI verb starts without torch

    return torch.cuda.is_available()


def _hf_config(model_dir: Path) -> dict:
    try:
        return json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):  # a .gguf file: its shapes are in its header
        return {}


def _kv_bytes_per_token(config: dict) -> int:
    """K and V of every layer for one token, at 4 bytes a value: an upper bound (a bf16 or int8 pool holds
    more tokens in the same bytes), used only to cap a CPU pool."""
    heads = int(config.get("num_attention_heads", 1))
    head_dim = int(config.get("head_dim") or int(config.get("hidden_size", heads)) // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    return 2 * int(config.get("num_hidden_layers", 1)) * kv_heads * head_dim * 4


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _weights_bytes(model_dir: Path, dtype: str, config: dict) -> int:
    """The weights' bytes as served: the checkpoint's files, scaled when --dtype widens or narrows them."""
    if model_dir.is_file():
        return model_dir.stat().st_size
    size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    stored = DTYPE_BYTES.get(str(config.get("torch_dtype") or config.get("dtype")))
    if dtype in DTYPE_BYTES and stored and "quantization_config" not in config:
        size = size * DTYPE_BYTES[dtype] // stored
    return size
