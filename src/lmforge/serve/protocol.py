"""Request bodies of OpenAI's `/v1/completions` and `/v1/chat/completions`, as pydantic models.

Field names, defaults and ranges are OpenAI's (vLLM's extras `top_k`, `min_tokens`,
`repetition_penalty`, `ignore_eos`, `stop_token_ids`, `skip_special_tokens` too). Type and range
errors become 400s through FastAPI's validation (see `errors.py`); the rest is checked once, by
`SamplingParams`. Unknown fields are ignored, as OpenAI's clients send some we do not use.

Responses are built as plain dicts in `app.py` rather than pydantic models: a streamed reply
serializes one chunk per token per request, and `json.dumps` of a small dict is several times
cheaper than a model's validation + dump on that path. Their shape is OpenAI's, checked by the
tests through the official `openai` client. This module knows nothing about the engine's internals.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from lmforge.engine import SamplingParams

MAX_N = 16  # samples per prompt: each holds a sequence slot and its own KV blocks


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # None = the served model
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
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
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=5)  # OpenAI's limit for the legacy endpoint
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
    max_tokens: int | None = Field(None, ge=1)  # None = what the context leaves
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name; wins when both are set
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True

    def resolved_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def resolved_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
