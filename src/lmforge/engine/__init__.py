"""lmforge.engine: paged-KV continuous-batching inference, in vLLM's shape.

    from lmforge.engine import LLM, SamplingParams
    outs = LLM("model-dir").generate(["Hello"], SamplingParams(max_tokens=16))

See docs/engine.md for the design and the async API the server uses.

The names below load on first use (PEP 562), so that a light submodule (`engine.spawn`, `engine.config`) can be
imported without torch: `lmforge serve` starts its engine child before the CLI imports torch (`lmforge.launch`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "AsyncLLMEngine": "async_engine", "ProcessAsyncLLMEngine": "async_engine", "EngineConfig": "config",
    "LLM": "llm", "LLMEngine": "llm_engine", "LoRARequest": "lora", "EngineDeadError": "messages",
    "EngineStepError": "messages", "CompletionOutput": "outputs", "Logprob": "outputs", "RequestMetrics": "outputs",
    "RequestOutput": "outputs", "PoolingParams": "pooling_params", "SamplingParams": "sampling_params",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # once: later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # for type checkers and editors: the same names, eagerly
    from .async_engine import AsyncLLMEngine, ProcessAsyncLLMEngine
    from .config import EngineConfig
    from .llm import LLM
    from .llm_engine import LLMEngine
    from .lora import LoRARequest
    from .messages import EngineDeadError, EngineStepError
    from .outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
    from .pooling_params import PoolingParams
    from .sampling_params import SamplingParams
