"""Request bodies of OpenAI's `/v1/completions` and `/v1/chat/completions`, as pydantic models.

Field names, defaults and ranges are OpenAI's (vLLM's extras `top_k`, `min_tokens`,
`repetition_penalty`, `ignore_eos`, `stop_token_ids`, `skip_special_tokens` too). Integers are
strict and 64-bit, so `true` is never token id 1 and no value overflows the engine's tensors. Type and range
errors become 400s through FastAPI's validation (see `errors.py`); the rest is checked once, by
`SamplingParams`. Unknown fields are ignored, as OpenAI's clients send some we do not use.

Responses are built as plain dicts in `app.py` rather than pydantic models: a streamed reply
serializes one chunk per token per request, and `json.dumps` of a small dict is several times
cheaper than a model's validation + dump on that path. Their shape is OpenAI's, checked by the
tests through the official `openai` client. This module knows nothing about the engine's internals.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictInt

from lmforge.engine import SamplingParams

MAX_N = 16  # samples per prompt: each holds a sequence slot and its own KV blocks
INT64 = 2**63


def _not_bool(v):
    if isinstance(v, bool):  # JSON true is not 1.0 here (pydantic's lax mode would say it is)
        raise ValueError("a number is required, not a boolean")
    return v


# Integers are strict (no `true` as token id 1, no 3.0); numbers accept ints but not booleans.
Int = StrictInt
Number = Annotated[float, BeforeValidator(_not_bool)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # None = the served model
    n: Int = Field(1, ge=1, le=MAX_N)
    temperature: Number | None = Field(None, ge=0, le=2)
    top_p: Number | None = Field(None, gt=0, le=1)
    top_k: Int | None = Field(None, ge=-1, lt=INT64)
    min_p: Number | None = Field(None, ge=0, le=1)
    presence_penalty: Number | None = Field(None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(None, ge=-2, le=2)
    repetition_penalty: Number | None = Field(None, gt=0, le=100)
    seed: Int | None = Field(None, ge=-INT64, lt=INT64)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[Int, Field(ge=0, lt=INT64)]] | None = None
    ignore_eos: bool = False
    min_tokens: Int = Field(0, ge=0, lt=INT64)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError naming the field (SamplingParams validates)."""
        given = {k: getattr(self, k) for k in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                                               "frequency_penalty", "repetition_penalty")
                 if getattr(self, k) is not None}
        return SamplingParams(n=self.n, seed=self.seed, stop=self.stop or [], stop_token_ids=self.stop_token_ids or [],
                              ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, max_tokens=max_tokens,
                              logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
                              include_stop_str_in_output=self.include_stop_str_in_output, **given)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    # a string, token ids, or a list of either (a batch: choices are numbered prompt * n + sample)
    prompt: str | list[Int] | list[str] | list[list[Int]]
    max_tokens: Int | None = Field(16, ge=1, lt=INT64)  # OpenAI's default for completions
    logprobs: Int | None = Field(None, ge=0, le=5)  # OpenAI's limit for the legacy endpoint
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = Field(None, ge=1, lt=INT64)  # None = what the context leaves
    max_completion_tokens: Int | None = Field(None, ge=1, lt=INT64)  # OpenAI's newer name; wins when both are set
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True

    def resolved_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def resolved_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class FeedbackRequest(BaseModel):
    """`POST /v1/feedback`: a user's verdict on one completion (by its `id`)."""

    model_config = ConfigDict(extra="ignore")
    id: str = Field(min_length=1, max_length=200)
    score: Number = Field(ge=-1, le=5)  # thumbs -1 / +1, or a 1-5 rating
    comment: str | None = Field(None, max_length=10_000)
    correction: str | None = Field(None, max_length=100_000)  # the answer the user wanted
