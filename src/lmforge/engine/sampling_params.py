"""`SamplingParams`: how one request is decoded. Field names and defaults follow vLLM's.

Validation happens here, once, with messages that name the field, so the server can turn a
`ValueError` into an OpenAI-style 400 and the engine never sees an invalid request: types (a bool
is not a token id), finiteness (no NaN or inf penalty), ranges (a seed fits 64 bits). What needs
the model (token ids below the vocabulary size) is checked by `LLMEngine.add_request`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

OUTPUT_KINDS = ("cumulative", "delta", "final_only")
# Below this a temperature is greedy, as in vLLM (_SAMPLING_EPS): logits / 1e-46 overflow float32
# to inf and the softmax turns into NaN, so "almost zero" must mean "zero", not garbage.
GREEDY_EPS = 1e-5
INT64 = (-(2**63), 2**63 - 1)
_INT_FIELDS = ("n", "top_k", "max_tokens", "min_tokens", "seed", "logprobs", "prompt_logprobs")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF/CTRL style, over prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI style, over output tokens
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None = up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (the sampled one is always given)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # vLLM's RequestOutputKind: what each RequestOutput carries. cumulative = everything so far;
    # delta = only what is new since the last output; final_only = one output, when the request ends
    # (no per-step copies: the offline API's choice).
    output_kind: str = "cumulative"

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._check_types()
        if self.top_k == -1:
            self.top_k = 0
        if 0 < self.temperature < GREEDY_EPS:
            self.temperature = 0.0
        self._validate()

    def _check_types(self) -> None:
        """Integers are ints (not bools, which Python counts as ints), floats are finite numbers: a
        value that passes here can never overflow or poison a batched tensor in the engine step."""
        for name in _INT_FIELDS:
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise ValueError(f"SamplingParams.{name}={v!r}: must be an integer")
        for name in _FLOAT_FIELDS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"SamplingParams.{name}={v!r}: must be a finite number")
        if self.seed is not None and not INT64[0] <= self.seed <= INT64[1]:
            raise ValueError(f"SamplingParams.seed={self.seed!r}: must be a 64-bit signed integer")

    def _validate(self) -> None:
        checks = [
            ("n", self.n >= 1, "must be >= 1"),
            ("temperature", self.temperature >= 0, "must be >= 0"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be -1, 0 (disabled) or positive"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0, "must be > 0"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be >= 1"),
            ("min_tokens", self.min_tokens >= 0, "must be >= 0"),
            ("min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens,
             "must be <= max_tokens"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be in [0, 20]"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
             "must be in [0, 20]"),
            ("output_kind", self.output_kind in OUTPUT_KINDS, f"must be one of {', '.join(OUTPUT_KINDS)}"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            ("stop_token_ids", all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT64[1]
                                   for t in self.stop_token_ids), "must be non-negative token ids"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
