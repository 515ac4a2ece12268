"""Request bodies of OpenAI's `/v1/completions`, `/v1/chat/completions`, `/v1/responses` and `/v1/embeddings`
and vLLM's `/tokenize` and `/detokenize`, as pydantic models.

Field names, defaults and ranges are OpenAI's (vLLM's extras `top_k`, `min_tokens`,
`repetition_penalty`, `ignore_eos`, `stop_token_ids`, `skip_special_tokens`, `prompt_logprobs`,
`allowed_token_ids`, `bad_words`, `include_stop_str_in_output`, `truncate_prompt_tokens` too, each becoming
the `SamplingParams` field of the same name; chat's template options go to `apply_chat_template`). Integers are
strict and 64-bit, so `true` is never token id 1 and no value overflows the engine's tensors. Type and range
errors become 400s through FastAPI's validation (see `errors.py`); the rest is checked once, by
`SamplingParams`. A field that would change what the answer means if it were ignored
(`response_format`, `tools`, `best_of`, an image part, ...) is either implemented or refused with a
400 naming it (`unsupported()`, `REFUSED`: `tools`, `tool_choice` and tool messages are implemented,
see `serving_chat.py`; the legacy `functions` / `function_call` are refused); other unknown fields are
ignored, as OpenAI's clients send some that change nothing here (docs/serving.md lists the known ones).

Responses are built as plain dicts in `app.py` rather than pydantic models: a streamed reply
serializes one chunk per token per request, and `json.dumps` of a small dict is several times
cheaper than a model's validation + dump on that path. Their shape is OpenAI's, checked by the
tests through the official `openai` client. This module knows nothing about the engine's internals.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import json
import math

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, StrictInt

from lmforge.engine import SamplingParams

MAX_N = 16  # samples per prompt: each holds a sequence slot and its own KV blocks
INT64 = 2**63
MAX_USER_LEN = 256  # an end-user id, not a document: it is stored with every logged exchange

# Fields that change what an answer means, refused with a 400 naming them until implemented
# (field -> why). A value that asks for nothing (`tool_choice: "none"`, `modalities: ["text"]`) passes.
REFUSED = {
    "functions": "function calling (legacy `functions`) is not supported; send `tools` instead",
    "function_call": "function calling (legacy `function_call`) is not supported; send `tool_choice` instead",
    "best_of": "best_of (server-side selection among samples) is not supported; ask for n samples instead",
    "modalities": "only text output is supported (modalities: [\"text\"])",
    "audio": "audio output is not supported",
    "web_search_options": "web search is not supported",
    "use_beam_search": "beam search is not supported (vLLM's use_beam_search); sample with n instead",
}
_NOTHING_ASKED = {"modalities": (["text"],), "use_beam_search": (False,)}
MAX_TOOLS = 128  # OpenAI's limit on `tools`
MAX_CHAT_TEMPLATE = 64 * 1024  # characters of a request's own Jinja chat template


def _not_bool(v):
    if isinstance(v, bool):  # JSON true is not 1.0 here (pydantic's lax mode would say it is)
        raise ValueError("a number is required, not a boolean")
    return v


def _json_number(v):
    """A JSON number: not a boolean, not a string that looks like one ("1"), not NaN or infinity."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError("a JSON number is required")
    if not math.isfinite(v):
        raise ValueError("a finite number is required (NaN and infinity are not numbers in JSON)")
    return v


# Integers are strict (no `true` as token id 1, no 3.0); numbers accept ints but not booleans.
Int = StrictInt
Number = Annotated[float, BeforeValidator(_not_bool)]
StrictNumber = Annotated[float, BeforeValidator(_json_number)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field("response", max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")  # `schema` shadows BaseModel's
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: text (no constraint), JSON mode, or a JSON schema."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured(self) -> dict | None:
        if self.type == "json_object":
            return {"json_object": True}  # JSON whitespace capped by the engine (JSON_WHITESPACE)
        if self.type == "json_schema":
            if self.json_schema is None:
                raise ValueError("SamplingParams.response_format=json_schema: needs `json_schema: {name, schema}`")
            return {"json": self.json_schema.json_schema or {}}
        return None


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept to be checked against REFUSED, then ignored

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
    user: str | None = Field(None, max_length=MAX_USER_LEN)
    logit_bias: dict[str, Any] | None = None  # token id (a string key) -> bias; SamplingParams checks it
    # Structured outputs: OpenAI's response_format, or vLLM's structured_outputs / guided_* extras.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's extensions, each a SamplingParams field of the same name
    prompt_logprobs: Int | None = Field(None, ge=0, le=20)
    allowed_token_ids: list[Annotated[Int, Field(ge=0, lt=INT64)]] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: Int | None = Field(None, ge=-1, lt=INT64)
    use_beam_search: bool = False  # refused when true (REFUSED)

    def structured_field(self) -> str | None:
        """The request field that carries its output constraint, to name in an error."""
        for name in ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar"):
            value = getattr(self, name)
            if value is not None and not (name == "response_format" and value.type == "text"):
                return name
        return None

    def structured(self) -> dict | None:
        """The one constraint this request asks for, as `StructuredOutputsParams` fields; ValueError when
        it asks for several (they could not all hold)."""
        asked = {name: spec for name, spec in (
            ("response_format", self.response_format.structured() if self.response_format else None),
            ("structured_outputs", self.structured_outputs),
            ("guided_json", {"json": self.guided_json} if self.guided_json is not None else None),
            ("guided_regex", {"regex": self.guided_regex} if self.guided_regex is not None else None),
            ("guided_choice", {"choice": self.guided_choice} if self.guided_choice is not None else None),
            ("guided_grammar", {"grammar": self.guided_grammar} if self.guided_grammar is not None else None),
        ) if spec is not None}
        if len(asked) > 1:
            raise ValueError(f"SamplingParams.{next(iter(asked))}=...: {' and '.join(asked)} each constrain the "
                             "output; send one of them")
        return next(iter(asked.values()), None)

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) of the first field this server cannot honour, or None."""
        extra = self.model_extra or {}
        for name, why in REFUSED.items():
            value = extra.get(name, getattr(self, name, None))
            if value is not None and value not in _NOTHING_ASKED.get(name, ()):
                return name, why
        return None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """Raises ValueError naming the field (SamplingParams validates). `prompt_logprobs`: what the endpoint
        needs (completions' echo + logprobs) when the request's own field is not set."""
        given = {k: getattr(self, k) for k in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                                               "frequency_penalty", "repetition_penalty")
                 if getattr(self, k) is not None}
        if self.prompt_logprobs is not None:
            prompt_logprobs = self.prompt_logprobs
        return SamplingParams(n=self.n, seed=self.seed, stop=self.stop or [], stop_token_ids=self.stop_token_ids or [],
                              ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, max_tokens=max_tokens,
                              logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              logit_bias=self.logit_bias, structured_outputs=self.structured(),
                              prompt_logprobs=prompt_logprobs, allowed_token_ids=self.allowed_token_ids,
                              bad_words=self.bad_words, truncate_prompt_tokens=self.truncate_prompt_tokens, **given)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    # a string, token ids, or a list of either (a batch: choices are numbered prompt * n + sample)
    prompt: str | list[Int] | list[str] | list[list[Int]]
    # OpenAI's default for completions; 0 only with echo: the prompt (and its logprobs) alone, as vLLM
    max_tokens: Int | None = Field(16, ge=0, lt=INT64)
    logprobs: Int | None = Field(None, ge=0, le=5)  # OpenAI's limit for the legacy endpoint
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object; None = no arguments
    strict: bool | None = None  # forced calls (required / named) always follow `parameters`


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`: call this function."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionName


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str  # JSON text of an object, as OpenAI returns it


class MessageToolCall(BaseModel):
    """An assistant message's earlier call, sent back with the conversation."""

    model_config = ConfigDict(extra="ignore")
    id: str = Field(max_length=200)
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = Field(None, max_length=200)  # tool: the call this message answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text or "" for p in self.content)
        return self.content or ""

    def unsupported(self, where: str) -> tuple[str, str] | None:
        """(field path, why) of a part of this message the server cannot read, or None."""
        if (self.model_extra or {}).get("function_call"):
            return f"{where}.function_call", "legacy `function_call` messages are not supported; send `tool_calls`"
        if self.tool_calls and self.role != "assistant":
            return f"{where}.tool_calls", "only assistant messages carry tool_calls"
        if self.role == "tool" and not self.tool_call_id:
            return f"{where}.tool_call_id", "a tool message needs the `tool_call_id` of the call it answers"
        for j, call in enumerate(self.tool_calls or ()):
            try:
                arguments = json.loads(call.function.arguments)
            except json.JSONDecodeError:
                arguments = None
            if not isinstance(arguments, dict):
                return (f"{where}.tool_calls[{j}].function.arguments", "must be the JSON text of an object, "
                        "as the server returned it")
        for j, part in enumerate(self.content if isinstance(self.content, list) else ()):
            if part.type != "text":
                return (f"{where}.content[{j}].type", f"content parts of type {part.type!r} are not supported "
                        "(this model reads text only: send {\"type\": \"text\", \"text\": ...})")
            if part.text is None:
                return f"{where}.content[{j}].text", "a text part needs its `text`"
        return None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = Field(None, ge=1, lt=INT64)  # None = what the context leaves
    max_completion_tokens: Int | None = Field(None, ge=1, lt=INT64)  # OpenAI's newer name; wins when both are set
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=20)
    # vLLM's chat template options, passed to the tokenizer's apply_chat_template
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message is left open, to be continued
    chat_template: str | None = Field(None, min_length=1, max_length=MAX_CHAT_TEMPLATE)  # Jinja text
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (e.g. enable_thinking)
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    _tool_grammar: str | None = PrivateAttr(None)  # set by serving_chat when tool_choice forces a call

    def force_tool_calls(self, grammar: str) -> None:
        """Constrain the output to tool calls (a Lark grammar of the tool-call parser's format)."""
        self._tool_grammar = grammar

    def structured(self) -> dict | None:
        asked = super().structured()
        if self._tool_grammar is None:
            return asked
        if asked is not None:
            raise ValueError(f"SamplingParams.tool_choice={_choice_name(self.tool_choice)!r}: a forced tool call "
                             "and response_format / guided_* each constrain the output; send one of them")
        return {"grammar": self._tool_grammar}

    def resolved_tool_choice(self) -> str | NamedToolChoice:
        """What the request asks of its tools: OpenAI's default is "auto" with tools and "none" without.
        ValueError naming `tool_choice` when it asks for a tool that is not there."""
        choice = self.tool_choice or ("auto" if self.tools else "none")
        if choice != "none" and not self.tools:
            raise ValueError(f"tool_choice={_choice_name(choice)!r} needs `tools`")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            raise ValueError(f"tool_choice: the function {choice.function.name!r} is not among `tools`")
        return choice

    def resolved_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def unsupported(self) -> tuple[str, str] | None:
        for i, m in enumerate(self.messages):
            found = m.unsupported(f"messages[{i}]")
            if found:
                return found
        return super().unsupported()

    def resolved_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def _choice_name(choice: str | NamedToolChoice) -> str:
    return choice if isinstance(choice, str) else choice.function.name


class FeedbackRequest(BaseModel):
    """`POST /v1/feedback`: a user's verdict on one completion (by its `id`)."""

    model_config = ConfigDict(extra="ignore")
    id: str = Field(min_length=1, max_length=200)
    # thumbs -1 / +1, or a 1-5 rating (the store's `normalize_score` says which values are allowed)
    score: StrictNumber = Field(ge=-1, le=5)
    comment: str | None = Field(None, max_length=10_000)
    correction: str | None = Field(None, max_length=100_000)  # the answer the user wanted


class TokenizeRequest(BaseModel):
    """vLLM's `POST /tokenize`: a `prompt`, or chat `messages` rendered as `/v1/chat/completions` renders them."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the template adds them)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = Field(None, min_length=1, max_length=MAX_CHAT_TEMPLATE)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    return_token_strs: bool = False

    def chat_request(self) -> ChatCompletionRequest:
        """The messages as a chat request, so they are rendered by the chat endpoint's own code."""
        return ChatCompletionRequest(model=self.model, messages=self.messages, tools=self.tools,
                                     add_generation_prompt=self.add_generation_prompt,
                                     continue_final_message=self.continue_final_message,
                                     chat_template=self.chat_template, chat_template_kwargs=self.chat_template_kwargs)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[Annotated[Int, Field(ge=0, lt=INT64)]]


class EmbeddingRequest(BaseModel):
    """OpenAI's `POST /v1/embeddings` (+ vLLM's `truncate_prompt_tokens`)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    input: str | list[str] | list[Int] | list[list[Int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = Field(None, ge=1)
    user: str | None = Field(None, max_length=MAX_USER_LEN)
    truncate_prompt_tokens: Int | None = Field(None, ge=-1, lt=INT64)

    def inputs(self) -> list[str | list[int]]:
        x = self.input
        if isinstance(x, str) or (x and isinstance(x[0], int)):
            return [x]
        return list(x)


class ResponsesContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ResponsesInputItem(BaseModel):
    """A message of the Responses API's `input` list (`type` "message" or omitted); other item types (function
    calls and their outputs, reasoning) are refused by name."""

    model_config = ConfigDict(extra="allow")
    type: str = "message"
    role: Literal["system", "developer", "user", "assistant"] | None = None
    content: str | list[ResponsesContentPart] | None = None


class ResponsesRequest(BaseModel):
    """OpenAI's `POST /v1/responses`, text in and text out; what it does not serve is refused by name
    (`unsupported()`)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[ResponsesInputItem]
    instructions: str | None = None
    max_output_tokens: Int | None = Field(None, ge=1, lt=INT64)
    temperature: Number | None = Field(None, ge=0, le=2)
    top_p: Number | None = Field(None, gt=0, le=1)
    stream: bool = False
    user: str | None = Field(None, max_length=MAX_USER_LEN)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    text: dict[str, Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        extra = self.model_extra or {}
        if self.tools:
            return "tools", "tools are not served on /v1/responses; use /v1/chat/completions with `tools`"
        if self.tool_choice not in (None, "none", "auto"):
            return "tool_choice", "tools are not served on /v1/responses"
        fmt = (self.text or {}).get("format") or {"type": "text"}
        if not isinstance(fmt, dict) or fmt.get("type") != "text":
            return "text.format", "structured output is not served on /v1/responses; use /v1/chat/completions " \
                                  "with response_format"
        for name in ("previous_response_id", "conversation", "background", "prompt", "reasoning"):
            if extra.get(name):
                return name, f"{name} is not supported (responses are not stored; text in, text out)"
        for i, item in enumerate(self.input if isinstance(self.input, list) else ()):
            if item.type != "message":
                return f"input[{i}].type", f"input items of type {item.type!r} are not supported (messages only)"
            if item.role is None:
                return f"input[{i}].role", "a message needs its role"
            for j, part in enumerate(item.content if isinstance(item.content, list) else ()):
                if part.type not in ("input_text", "output_text", "text") or part.text is None:
                    return (f"input[{i}].content[{j}].type", f"content of type {part.type!r} is not supported "
                            "(text only: input_text)")
        return None

    def chat_request(self) -> ChatCompletionRequest:
        """The same conversation as a chat request (instructions first, as a system message); ValueError
        (pydantic's) when it is not one (no message at all)."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            for item in self.input:
                text = item.content if isinstance(item.content, str) else "".join(p.text for p in item.content or ())
                messages.append({"role": item.role, "content": text})
        return ChatCompletionRequest(model=self.model, messages=messages, max_tokens=self.max_output_tokens,
                                     temperature=self.temperature, top_p=self.top_p, stream=self.stream,
                                     user=self.user)
