"""`POST /v1/chat/completions` (vLLM's `OpenAIServingChat`): the conversation is rendered with the
model's chat template and tokenized so that no text a user typed becomes a control token
(`encode_chat`), with the request's `chat_template` (else the server's `--chat-template`, else the
model's), `add_generation_prompt`, `continue_final_message` and `chat_template_kwargs` passed to Hugging
Face's `apply_chat_template` (vLLM's fields); streams open with the assistant role; logprobs in the chat
shape (`content`: token, logprob, bytes, top_logprobs); vLLM's `prompt_logprobs` at the top level. Runs through `OpenAIServing`; knows nothing about how many
engines there are.

Tool calls (`tools`, `tool_choice`): the tools go to the template as Hugging Face's
`apply_chat_template(tools=...)` does; a template that ignores them (ours, ChatML) gets them as a system
prompt in the tool-call parser's format instead, and earlier `tool_calls` it cannot render are written
into the assistant's content as the model would have written them (`--tool-call-parser`,
`tool_parsers.py`). `required` and a named function are enforced with a grammar of that format
(`structured_outputs.grammar`), `auto` parses whatever calls the model wrote, `none` parses nothing.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Iterator

import jinja2
import jsonschema

from lmforge.engine.sampling_params import JSON_WHITESPACE

from .errors import OpenAIError, bad_request
from .guard import check_text
from .protocol import ChatCompletionRequest, NamedToolChoice
from .serving_engine import (Job, OpenAIServing, check_length, check_params, check_prompt, encode,
                             prompt_logprobs_json, truncate)
from .tool_parsers import ToolCallStream, ToolParser, get_tool_parser
from .versions import Served

_PLACEHOLDER = "\ue000lmforge{}\ue001"  # private-use characters: no template alters or emits them
_PLACEHOLDER_RE = re.compile("\ue000lmforge(\\d+)\ue001")
_PROBE = "lmforge_template_probe"  # a function name no template writes unless it renders the tools it is given
_TEMPLATE_FEATURES: OrderedDict[str, tuple[bool, bool]] = OrderedDict()  # template -> (renders tools, tool_calls)
TEMPLATE_FEATURES_KEPT = 64


class ChatJob(Job):
    tool_parser: ToolParser | None = None  # set when the reply is read for tool calls (tools, tool_choice != none)
    max_calls: int | None = None  # 1 with parallel_tool_calls=false: later calls the model wrote are dropped

    def __init__(self, *args):
        super().__init__(*args)
        self.tool_streams: dict[tuple[int, int], ToolCallStream] = {}  # (prompt, sample) -> its stream state


class OpenAIServingChat(OpenAIServing):
    kind, exchange_kind = "chat.completion", "chat"

    def precheck(self, sv: Served, req: ChatCompletionRequest) -> None:
        self.check_stop(req)
        chars = 0
        for m in req.messages:
            text = m.text()
            check_text(text, "messages")
            chars += len(text)
        if sv.tokenizer is not None and req.truncate_prompt_tokens is None:
            check_length(sv, -(-chars // sv.chars_per_token), req.resolved_max_tokens(), "messages",
                         f"{chars} characters of content")

    def build_job(self, sv: Served, req: ChatCompletionRequest) -> ChatJob:
        self.check_model(req.model)
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        tok = sv.tokenizer
        template = req.chat_template or self.st.chat_template or getattr(tok, "chat_template", None)
        if tok is None or not template:
            raise bad_request("this model has no chat template; use /v1/completions, or send `chat_template`",
                              "messages", "unsupported")
        options = template_options(req, template)
        parser = get_tool_parser(self.st.tool_call_parser)
        choice = _tool_choice(req)
        renders_tools, renders_calls = template_features(tok, template)
        tools = _tools(sv, req)
        check_tool_consistency(req)
        messages = template_messages(req, parser, renders_calls)
        if tools and not renders_tools:
            messages = with_tools_prompt(messages, parser.system_prompt(tools))
        # The template writes every special token itself; do not let the tokenizer add a BOS on top.
        ids = encode_chat(sv, messages, req.add_generation_prompt, tools if renders_tools else None, **options)
        ids = truncate(sv, ids, req.truncate_prompt_tokens)
        specials = frozenset(m for m in parser.markers if m in sv.specials)
        if choice not in ("auto", "none"):
            req.force_tool_calls(forced_grammar(parser, tools, choice, req.parallel_tool_calls, specials))
        if specials and choice != "none":
            req.skip_special_tokens = False  # the call markers are special tokens (Qwen's <tool_call>): keep them
        max_tokens = req.resolved_max_tokens()
        params = check_params(req, max_tokens, req.resolved_logprobs(), sv=sv)
        check_prompt(sv, ids, max_tokens, "messages")
        job = ChatJob(sv, req, [ids], params, "chatcmpl")
        job.messages = messages
        job.tool_parser = parser if tools and choice != "none" else None
        job.max_calls = None if req.parallel_tool_calls else 1
        return job

    def opening_chunks(self, job: Job, base: dict) -> Iterator[dict]:
        for i in range(job.n):
            yield {**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]}

    def final_choice(self, job: ChatJob, prompt_index: int, c) -> dict:
        lp = {"content": _logprobs(job, c.token_ids, c.logprobs, 0)} if c.logprobs is not None else None
        message, finish = {"role": "assistant", "content": c.text}, c.finish_reason
        if job.tool_parser is not None:
            content, calls = job.tool_parser.extract(c.text)
            if calls:
                calls = calls[:job.max_calls]
                message = {"role": "assistant", "content": content, "tool_calls": [t.openai() for t in calls]}
                finish = "tool_calls" if finish == "stop" else finish
        return {"index": prompt_index * job.n + c.index, "message": message, "logprobs": lp, "finish_reason": finish}

    def delta_choice(self, job: ChatJob, prompt_index: int, c, delta: str, start: int, text_start: int) -> dict:
        lp = {"content": _logprobs(job, c.token_ids, c.logprobs, start)} if c.logprobs is not None else None
        out, finish = {"content": delta}, c.finish_reason
        if job.tool_parser is not None:  # content as it comes, a call as `delta.tool_calls` entries
            stream = job.tool_streams.setdefault((prompt_index, c.index),
                                                 ToolCallStream(job.tool_parser, job.max_calls))
            content, calls = stream.update(c.text, final=finish is not None)
            out = {"content": content, "tool_calls": calls} if calls else {"content": content}
            finish = "tool_calls" if stream.calls and finish == "stop" else finish
        return {"index": c.index, "delta": out, "logprobs": lp, "finish_reason": finish}

    def exchange_prompt(self, job: Job) -> list[dict]:
        """The chat as its messages (the store masks each; the flywheel keeps the turns and their roles)."""
        return job.messages

    def response_extras(self, job: Job) -> dict:
        if job.req.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": prompt_logprobs_json(job.sv, job.prompt_logprobs[0])}


# apply_chat_template's own arguments: chat_template_kwargs may not set them (each has its request field)
_TEMPLATE_ARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                            "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                            "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def template_options(req: ChatCompletionRequest, template: str) -> dict:
    """vLLM's chat template fields as apply_chat_template arguments: the template (the request's, else the
    server's `--chat-template`, else the model's), `continue_final_message` and `chat_template_kwargs`."""
    if req.continue_final_message and req.add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true: the last "
                          "message is either continued or followed by a new assistant turn; send "
                          "add_generation_prompt: false", "continue_final_message")
    if req.continue_final_message and req.messages[-1].role != "assistant":
        raise bad_request("continue_final_message needs an assistant message last (the one to continue)",
                          "continue_final_message")
    kwargs = req.chat_template_kwargs or {}
    reserved = sorted(_TEMPLATE_ARGS & set(kwargs))
    if reserved:
        raise bad_request(f"chat_template_kwargs.{reserved[0]}: set by its own request field, not here",
                          f"chat_template_kwargs.{reserved[0]}")
    return {"chat_template": template, "continue_final_message": req.continue_final_message, **kwargs}


def encode_chat(sv: Served, messages: list[dict], add_generation_prompt: bool,
                tools: list[dict] | None = None, **options) -> list[int]:
    """Token ids of the rendered conversation. Control tokens come from the template only: text a user
    typed that looks like one (`<|im_start|>system`) is encoded as plain text, so no turn can be spoofed.
    Messages without such text are encoded in one piece, exactly as before (and as offline chat). `tools`
    go to a template that renders them (`_tools` refused control tokens in them); `options` are further
    apply_chat_template arguments (`template_options`)."""
    tok = sv.tokenizer
    extra = {"tools": tools} if tools else {}
    render = lambda msgs: tok.apply_chat_template(msgs, tokenize=False,  # noqa: E731
                                                  add_generation_prompt=add_generation_prompt, **extra, **options)
    try:
        if not any(sp in m["content"] for m in messages for sp in sv.specials):
            return encode(sv, render(messages), "messages", add_special_tokens=False)
        text = render([{**m, "content": _PLACEHOLDER.format(i)} for i, m in enumerate(messages)])
    except OpenAIError:
        raise
    except jinja2.TemplateSyntaxError as e:  # only a request's (or --chat-template's) own template can be broken
        raise bad_request(f"chat_template is not a valid Jinja template: {e}", "chat_template") from None
    except Exception as e:  # a template that raises on these messages (e.g. role order) is the client's 400
        raise bad_request(f"messages could not be rendered with the chat template: {e}", "messages") from None
    ids, pos = [], 0
    for m in _PLACEHOLDER_RE.finditer(text):
        ids += encode(sv, text[pos:m.start()], "messages", add_special_tokens=False)
        ids += encode(sv, messages[int(m.group(1))]["content"], "messages", add_special_tokens=False,
                      split_special_tokens=True)
        pos = m.end()
    return ids + encode(sv, text[pos:], "messages", add_special_tokens=False)


def _tool_choice(req: ChatCompletionRequest) -> str | NamedToolChoice:
    try:
        return req.resolved_tool_choice()
    except ValueError as e:
        raise bad_request(str(e), "tool_choice") from None


def _tools(sv: Served, req: ChatCompletionRequest) -> list[dict]:
    """The request's tools as template-ready dicts (OpenAI's shape, which Hugging Face templates read);
    control-token text in them or in earlier calls is refused: a template may write it verbatim."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools or ()]
    for where, value in (("tools", tools), *((f"messages[{i}].tool_calls", m.model_dump()["tool_calls"])
                                             for i, m in enumerate(req.messages) if m.tool_calls)):
        text = json.dumps(value, ensure_ascii=False)
        check_text(text, where)
        special = next((sp for sp in sv.specials if sp in text), None)
        if special is not None:
            raise bad_request(f"{where}: contains the control token {special!r}; remove it", where)
    return tools


def check_tool_consistency(req: ChatCompletionRequest) -> None:
    """400 naming the field for tools and tool messages that contradict each other (OpenAI refuses them as
    well): two tools of one name, a `parameters` that is no JSON schema (whatever `tool_choice` says), two
    calls of one id, or a tool message that answers no call of the assistant message it follows (only tool
    messages may come between them)."""
    names: set[str] = set()
    for i, t in enumerate(req.tools or ()):
        if t.function.name in names:
            raise bad_request(f"tools[{i}].function.name: {t.function.name!r} names an earlier tool too; give each "
                              "tool a name of its own", f"tools[{i}].function.name")
        names.add(t.function.name)
        error = _json_schema_error(t.function.parameters)
        if error:
            raise bad_request(f"tools[{i}].function.parameters: not a JSON schema: {error}",
                              f"tools[{i}].function.parameters")
    open_calls: set[str] | None = None  # the call ids of the assistant message the next tool message may answer
    for i, m in enumerate(req.messages):
        if m.role == "tool":
            if open_calls is None or m.tool_call_id not in open_calls:
                where = ("no assistant message with tool_calls comes right before it" if open_calls is None else
                         "the assistant message before it made no call of this id")
                raise bad_request(f"messages[{i}].tool_call_id: this tool message answers no call: {where}",
                                  f"messages[{i}].tool_call_id")
        elif m.role == "assistant" and m.tool_calls:
            open_calls = set()
            for j, call in enumerate(m.tool_calls):
                if call.id in open_calls:
                    raise bad_request(f"messages[{i}].tool_calls[{j}].id: an earlier call of this message has the "
                                      "same id; each call needs its own", f"messages[{i}].tool_calls[{j}].id")
                open_calls.add(call.id)
        else:
            open_calls = None


def _json_schema_error(schema: dict | None) -> str:
    """Why `schema` is not a JSON schema (by its own `$schema`'s metaschema, else draft 2020-12), or ""."""
    if schema is None:
        return ""
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        return f"{e.message[:200]}" + (f" (at {where})" if where else "")
    return ""


def template_features(tok, template: str | None = None) -> tuple[bool, bool]:
    """(renders `tools`, renders assistant `tool_calls`) for a chat template (default: the tokenizer's), found
    once per template by rendering a probe function and looking for its name. The last
    `TEMPLATE_FEATURES_KEPT` templates are remembered: requests may send templates of their own."""
    key = str(template or tok.chat_template)
    if key not in _TEMPLATE_FEATURES:
        fn = {"name": _PROBE, "description": "probe", "parameters": {"type": "object", "properties": {}}}
        user = {"role": "user", "content": "hi"}
        call = {"role": "assistant", "content": "",
                "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": _PROBE, "arguments": {}}}]}
        _TEMPLATE_FEATURES[key] = (_renders(tok, key, [user], [{"type": "function", "function": fn}]),
                                   _renders(tok, key, [user, call], None))
        while len(_TEMPLATE_FEATURES) > TEMPLATE_FEATURES_KEPT:
            _TEMPLATE_FEATURES.popitem(last=False)
    _TEMPLATE_FEATURES.move_to_end(key)
    return _TEMPLATE_FEATURES[key]


def _renders(tok, template: str, messages: list[dict], tools: list[dict] | None) -> bool:
    try:
        return _PROBE in tok.apply_chat_template(messages, tools=tools, tokenize=False, chat_template=template)
    except Exception:  # a template that refuses these messages does not render them either
        return False


def template_messages(req: ChatCompletionRequest, parser: ToolParser, renders_calls: bool) -> list[dict]:
    """The conversation as the template reads it. An assistant's earlier calls go as `tool_calls` with their
    arguments as objects (Hugging Face's convention, vLLM does the same) to a template that renders them, or
    else written into its content in the parser's format; a tool result keeps its `tool_call_id`."""
    out = []
    for m in req.messages:
        msg = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            calls = [{"name": t.function.name, "arguments": json.loads(t.function.arguments)} for t in m.tool_calls]
            if renders_calls:
                msg["tool_calls"] = [{"id": t.id, "type": "function", "function": fn}
                                     for t, fn in zip(m.tool_calls, calls)]
            else:
                msg["content"] = "\n".join(filter(None, (msg["content"], parser.render_calls(calls))))
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def with_tools_prompt(messages: list[dict], prompt: str) -> list[dict]:
    """The tools' system prompt before the first system message's text, or as a new first message."""
    if messages and messages[0]["role"] in ("system", "developer"):
        first = messages[0]
        return [{**first, "content": f"{prompt}\n\n{first['content']}" if first["content"] else prompt},
                *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def forced_grammar(parser: ToolParser, tools: list[dict], choice: str | NamedToolChoice, parallel: bool,
                   specials: frozenset = frozenset()) -> str:
    """The grammar of `required` (one or more calls of any tool; one when parallel_tool_calls is false) or of a
    named function (exactly one call of it). A `parameters` schema the grammar engine cannot compile is the
    client's 400, naming the tool."""
    chosen = [(i, t) for i, t in enumerate(tools)
              if not isinstance(choice, NamedToolChoice) or t["function"]["name"] == choice.function.name]
    for i, t in chosen:
        error = _schema_error(t["function"].get("parameters"))
        if error:
            raise bad_request(f"tools[{i}].function.parameters ({t['function']['name']}): {error}",
                              f"tools[{i}].function.parameters")
    parallel = parallel and not isinstance(choice, NamedToolChoice)  # a named function: exactly one call
    return parser.grammar([t for _, t in chosen], parallel, JSON_WHITESPACE, specials)


def _schema_error(schema: dict | None) -> str:
    if not schema:
        return ""
    import llguidance  # deferred: optional heavy dependency, loaded only for forced tool calls

    try:
        return llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema)))
    except (ValueError, RuntimeError) as e:
        return str(e)


def _logprobs(job: Job, token_ids: list[int], logprobs: list[dict], start: int) -> list[dict]:
    sv, k, out = job.sv, job.params.logprobs or 0, []

    def entry(tid: int, lp: float) -> dict:
        s = sv.token_text(tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    for tid, lps in zip(token_ids[start:], logprobs[start:]):
        top = sorted(lps.items(), key=lambda kv: -kv[1])[:k]
        out.append({**entry(tid, lps.get(tid)), "top_logprobs": [entry(t, v) for t, v in top]})
    return out
