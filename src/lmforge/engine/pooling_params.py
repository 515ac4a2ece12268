"""`PoolingParams`: a request for the model's pooled hidden state instead of generated tokens (vLLM's
`vllm/pooling_params.py`, for its `embed` task).

A pooling request runs its prompt through the same scheduled prefill as any other (chunked, batched, prefix
cache and all) and ends there: the engine takes the final normed hidden state of the prompt's last token
(vLLM's default pooling for a decoder-only model, `PoolingType.LAST`) and, with `normalize`, divides it by
its L2 norm (vLLM's default for embeddings). Nothing is sampled. Knows nothing about the model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PoolingParams:
    normalize: bool = True  # L2-normalize the pooled vector (vLLM's default for `embed`)
    truncate_prompt_tokens: int | None = None  # as SamplingParams': keep the prompt's last k tokens (-1: max_model_len)

    def __post_init__(self) -> None:
        if not isinstance(self.normalize, bool):
            raise ValueError(f"PoolingParams.normalize={self.normalize!r}: must be true or false")
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not (k == -1 or k >= 1)):
            raise ValueError(f"PoolingParams.truncate_prompt_tokens={k!r}: must be -1 (the context's length) or >= 1")
