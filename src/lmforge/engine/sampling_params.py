"""`SamplingParams`: how one request is decoded. Field names and defaults follow vLLM's.

Validation happens here, once, with messages that name the field, so the server can turn a
`ValueError` into an OpenAI-style 400 and the engine never sees an invalid request: types (a bool
is not a token id), finiteness (no NaN or inf penalty), ranges (a seed fits 64 bits). What needs
the model (token ids below the vocabulary size, a grammar that compiles against the tokenizer) is
checked by `LLMEngine.add_request`.

`logit_bias` follows OpenAI (token id -> bias in [-100, 100], added to the logits before sampling);
`structured_outputs` follows vLLM's `StructuredOutputsParams` (exactly one of json / json_object /
regex / choice / grammar), compiled by `engine/structured.py`.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

OUTPUT_KINDS = ("cumulative", "delta", "final_only")
# Below this a temperature is greedy, as in vLLM (_SAMPLING_EPS): logits / 1e-46 overflow float32
# to inf and the softmax turns into NaN, so "almost zero" must mean "zero", not garbage.
GREEDY_EPS = 1e-5
INT64 = (-(2**63), 2**63 - 1)
_INT_FIELDS = ("n", "top_k", "max_tokens", "min_tokens", "seed", "logprobs", "prompt_logprobs", "truncate_prompt_tokens")
MAX_BAD_WORDS, MAX_ALLOWED_TOKEN_IDS = 128, 2**17  # a list past these is a client bug, not a request
# OpenAI's limits: a bias is in [-100, 100] (its API reference) and at most 300 tokens are biased (what
# its API enforces, as we understand it; not in the reference). An unbounded map would cost Python per step.
LOGIT_BIAS_MAX, LOGIT_BIAS_MAX_ENTRIES = 100.0, 300
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
# Between JSON tokens (json, json_object), unless a request says otherwise: a newline and a space at most.
# JSON's own unbounded whitespace lets a weak model pad until max_tokens and never close the object, the
# failure OpenAI's JSON-mode docs warn of; the offline engine and the server apply the same cap.
JSON_WHITESPACE = r"[ \n]{0,2}"
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output to a language; vLLM's `StructuredOutputsParams`, set exactly one of:

    json: a JSON schema (dict or its JSON text); json_object: True for any JSON object (OpenAI's
    JSON mode); regex: a regular expression (Rust `regex` syntax, anchored at both ends); choice:
    the output is exactly one of these strings; grammar: a Lark grammar (llguidance's dialect) or a
    GBNF/EBNF one.

    JSON whitespace (json, json_object): by default each separator between JSON tokens is at most a
    newline and a space (`JSON_WHITESPACE`), so every output can end: with JSON's own unbounded rule
    (vLLM's default) a weak model pads until max_tokens, as OpenAI warns for JSON mode.
    disable_any_whitespace: none at all (compact output); whitespace_pattern: a regex each separator
    must match instead (r"[ \t\n\r]*" for JSON's own rule).
    """
    json: dict | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        set_kinds = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(f"structured_outputs: set exactly one of {', '.join(STRUCTURED_KINDS)}; "
                             f"got {', '.join(set_kinds) or 'none'}")
        kind = set_kinds[0]
        value, ok = getattr(self, kind), True
        if kind == "json":
            ok = isinstance(value, dict) or (isinstance(value, str) and bool(value))  # {} = any JSON value
        elif kind == "json_object":
            ok = value is True
        elif kind == "choice":
            ok = isinstance(value, list) and bool(value) and all(isinstance(c, str) and c for c in value)
        else:
            ok = isinstance(value, str) and bool(value)
        if not ok:
            why = {"json": "a JSON schema (an object or its JSON text)", "json_object": "true",
                   "choice": "a non-empty list of non-empty strings"}.get(kind, "a non-empty string")
            raise ValueError(f"structured_outputs.{kind}={value!r}: must be {why}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"structured_outputs.disable_any_whitespace={self.disable_any_whitespace!r}: "
                             "must be true or false")
        if self.whitespace_pattern is not None and (not isinstance(self.whitespace_pattern, str)
                                                    or self.disable_any_whitespace):
            raise ValueError(f"structured_outputs.whitespace_pattern={self.whitespace_pattern!r}: must be a "
                             "regex string, and not set together with disable_any_whitespace")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> Any:
        return getattr(self, self.kind)


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
    # OpenAI's logit_bias: token id -> bias added to its logit before penalties and sampling (+100 all
    # but forces a token, -100 all but bans it). Keys may be ints or their decimal strings (JSON's).
    logit_bias: dict[int, float] | None = None
    # Constrained decoding (engine/structured.py); a dict is read as StructuredOutputsParams(**dict).
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's: sample only among these token ids (every other logit -inf, before anything else)
    allowed_token_ids: list[int] | None = None
    # vLLM's: words never generated. Each is encoded as it would start a text and after a space; a one-token
    # word is banned always, a longer one's last token whenever the output ends with the tokens before it
    bad_words: list[str] | None = None
    # vLLM's: keep only the prompt's last k tokens (-1: the last max_model_len), before anything is checked
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.logit_bias = _logit_bias(self.logit_bias)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = _structured_from_dict(self.structured_outputs)
        elif not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            raise ValueError(f"SamplingParams.structured_outputs={self.structured_outputs!r}: must be a "
                             "StructuredOutputsParams or a dict of its fields")
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
            ("allowed_token_ids", self.allowed_token_ids is None or (
                0 < len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS
                and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT64[1]
                        for t in self.allowed_token_ids)),
             f"must be a non-empty list of at most {MAX_ALLOWED_TOKEN_IDS} non-negative token ids"),
            ("bad_words", self.bad_words is None or (
                len(self.bad_words) <= MAX_BAD_WORDS and all(isinstance(w, str) and w.strip() for w in self.bad_words)),
             f"must be at most {MAX_BAD_WORDS} non-blank strings"),
            ("truncate_prompt_tokens", self.truncate_prompt_tokens is None or self.truncate_prompt_tokens == -1
             or self.truncate_prompt_tokens >= 1, "must be -1 (the context's length) or >= 1"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def truncate_prompt(token_ids: list[int], truncate_prompt_tokens: int | None, max_model_len: int) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the prompt's last k tokens (k = -1: max_model_len); ValueError for a
    k beyond the context, which could never be served."""
    k = truncate_prompt_tokens
    if k is None:
        return token_ids
    if k > max_model_len:
        raise ValueError(f"SamplingParams.truncate_prompt_tokens={k}: must be <= max_model_len ({max_model_len})")
    return token_ids[-(max_model_len if k == -1 else k):]


def _logit_bias(bias: Any) -> dict[int, float] | None:
    """OpenAI's logit_bias checked and normalized to {int token id: float}; None when empty. Ranges are
    refused, not clamped: a bias of 1e30 is a client bug, not a request for +100."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"SamplingParams.logit_bias={bias!r}: must be a map of token id to bias")
    if len(bias) > LOGIT_BIAS_MAX_ENTRIES:
        raise ValueError(f"SamplingParams.logit_bias: {len(bias)} entries; at most {LOGIT_BIAS_MAX_ENTRIES} "
                         "tokens may be biased (OpenAI's limit)")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = _bias_token_id(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or abs(value) > LOGIT_BIAS_MAX:
            raise ValueError(f"SamplingParams.logit_bias[{key!r}]={value!r}: the bias must be a number in "
                             f"[-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}]")
        out[token] = float(value)
    return out or None


def _bias_token_id(key: Any) -> int:
    try:
        if isinstance(key, bool):
            raise TypeError
        token = int(key, 10) if isinstance(key, str) else operator.index(key)
    except (TypeError, ValueError):
        raise ValueError(f"SamplingParams.logit_bias: key {key!r} is not a token id (an integer, "
                         "or its decimal string)") from None
    if not 0 <= token <= INT64[1]:
        raise ValueError(f"SamplingParams.logit_bias: token id {key!r} must be >= 0")
    return token


def _structured_from_dict(d: dict) -> StructuredOutputsParams:
    known = StructuredOutputsParams.__dataclass_fields__
    unknown = sorted(str(k) for k in d if k not in known)
    if unknown:
        raise ValueError(f"structured_outputs: unknown field(s) {', '.join(unknown)}; "
                         f"expected {', '.join(known)}")
    return StructuredOutputsParams(**d)
