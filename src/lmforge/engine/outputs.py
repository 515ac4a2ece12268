"""What the engine hands back for a request: `RequestOutput` (one per request per step), with one
`CompletionOutput` per sample, the request's `RequestMetrics` and, when asked for, its prompt's
`Logprob`s (vLLM's `vllm/outputs.py`).

Plain dataclasses, cheap to pickle: they cross the engine core's pipe (`messages.py`). This module
knows nothing about how they are produced.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """One token's log-probability at one prompt position, and its 1-based rank in that position's
    distribution (vLLM's `Logprob`; `decoded_token` is left to the caller, which holds the tokenizer)."""
    logprob: float
    rank: int
    decoded_token: str | None = None


# vLLM's PromptLogprobs: per prompt token, None for the first (nothing predicts it), else the prompt
# token's and the `prompt_logprobs` most likely tokens' Logprob, keyed by token id
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None  # per token: the sampled id and the top ids -> logprob
    finish_reason: str | None = None  # stop | length | abort; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    token_times: list[float] = field(default_factory=list)  # time.time() each token in token_ids appeared

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None


@dataclass
class RequestOutput:
    """`SamplingParams.output_kind`: cumulative (the default) — `outputs[i].token_ids`, `.text`, `.logprobs`,
    `.token_times` hold everything generated so far; delta — only what is new since the previous output;
    final_only — a single output, when the request finishes (or is aborted), holding everything.
    `prompt_logprobs` is complete in every output of a request that asked for it (delta: the first only)."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int  # prompt tokens served by the prefix cache (sample 0's first admission)
    metrics: RequestMetrics
    prompt_logprobs: PromptLogprobs | None = None  # SamplingParams.prompt_logprobs: one entry per prompt token
    embedding: list[float] | None = None  # a PoolingParams request: its pooled hidden state (no outputs' tokens)

