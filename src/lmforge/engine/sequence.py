"""`Sequence`: one sample being generated, and the bookkeeping the scheduler and server read.

A request with `n` samples becomes `n` sequences (`index` 0..n-1) that share the prompt's KV blocks
through the prefix cache. This module knows nothing about tensors, blocks' contents or sampling.
"""

from __future__ import annotations

import time
from enum import Enum, auto

import torch

from .sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, max_tokens: int,
                 generator: torch.Generator | None = None, arrival_time: float | None = None):
        self.request_id, self.index = request_id, index
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens  # resolved: sampling_params.max_tokens or what max_model_len leaves
        self.generator = generator
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.token_ids = list(prompt_token_ids)  # prompt + output, what the KV cache holds
        self.num_computed_tokens = 0  # tokens whose K/V are in the pool
        self.num_cached_tokens = 0  # of the prompt, served by the prefix cache on first admission
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # hash chain of this sequence's full, computed blocks
        self.status = SequenceStatus.WAITING
        self.num_preemptions = 0
        self.logprobs: list[dict[int, float]] = []  # per output token: sampled + top ids -> logprob
        # per prompt token (outputs.PromptLogprobs), collected chunk by chunk; sample 0 of a request that
        # asked for them (sampling_params.prompt_logprobs), else None
        self.prompt_logprobs: list | None = [None] if sampling_params.prompt_logprobs is not None and index == 0 \
            else None
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None  # stop | length | abort
        self.stop_reason: int | str | None = None  # the stop token id or stop string that matched
        self.detokenizer = None  # set by the engine when the model has a tokenizer
        self.bad_words_token_ids: list[list[int]] = []  # sampling_params.bad_words, encoded by the engine
        self.pooling = None  # PoolingParams: the request wants its last prompt token's hidden state, not tokens
        self.embedding: list[float] | None = None  # ... which the engine puts here after the prefill
        self.grammar = None  # structured outputs: this sample's matcher (engine/structured.py), advanced per token
        self.spec_token_ids: list[int] = []  # speculative decoding: this step's proposals (engine/spec_decode.py)
        self.spec_probs: list[torch.Tensor] = []  # their draft probabilities q (V,), for sampled rows of a draft model
        self.draft_view = None  # the draft model's view of this sequence (spec_decode.DraftView)
        self.lora_request = None  # multi-LoRA: the adapter this sample runs with (engine/lora.py's LoRARequest)
        self.output_text = ""  # text emitted so far (stop-string hold-back excluded)
        self.wait_for: Sequence | None = None  # n > 1: sample 0, whose prompt blocks we reuse
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.token_times: list[float] = []
        self.finished_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs still to collect: every prompt position must run through the model, so the
        prefix cache is not read for this sequence (vLLM's rule), though the blocks it computes are cached."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def prompt_logprob_positions(self, num_new_tokens: int) -> range:
        """The positions of the next `num_new_tokens` whose logits give a prompt logprob not collected yet:
        position p predicts prompt token p + 1 (a recompute after preemption collects nothing twice)."""
        if not self.needs_prompt_logprobs:
            return range(0)
        start = max(self.num_computed_tokens, len(self.prompt_logprobs) - 1)
        return range(start, min(self.num_computed_tokens + num_new_tokens, self.num_prompt_tokens - 1))

    @property
    def lora_int_id(self) -> int:  # 0: the base model
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int, now: float) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        self.token_times.append(now)
        if self.first_token_time is None:
            self.first_token_time = now

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id}#{self.index}, {self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens}, blocks={self.block_table})")
