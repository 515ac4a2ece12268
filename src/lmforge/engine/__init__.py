"""lmforge.engine: paged-KV continuous-batching inference, in vLLM's shape.

    from lmforge.engine import LLM, SamplingParams
    outs = LLM("model-dir").generate(["Hello"], SamplingParams(max_tokens=16))

See docs/engine.md for the design and the async API the server uses.
"""

from .async_engine import AsyncLLMEngine, ProcessAsyncLLMEngine
from .config import EngineConfig
from .llm import LLM
from .llm_engine import LLMEngine
from .lora import LoRARequest
from .messages import EngineDeadError, EngineStepError
from .outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from .pooling_params import PoolingParams
from .sampling_params import SamplingParams

__all__ = ["LLM", "AsyncLLMEngine", "CompletionOutput", "EngineConfig", "EngineDeadError", "EngineStepError", "LLMEngine", "LoRARequest", "Logprob",
           "PoolingParams", "ProcessAsyncLLMEngine", "RequestMetrics", "RequestOutput", "SamplingParams"]
