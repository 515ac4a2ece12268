"""Tool calls through the `openai` client against a real server (issue 26 item 2): `tool_choice` named and
`required` force a call whose arguments validate against the function's schema (with a random model),
streamed (the client's stream helper assembles `delta.tool_calls`) and not; `auto` parses what the model
wrote, `none` leaves text alone; a tool result round-trips through the chat template; both parser families
(`hermes`, `llama3_json`) read whole replies and streamed increments; bad tool requests get a 400 naming
the field.

    python -m pytest -q tests/test_serve_tools.py
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import jsonschema
import openai
import pytest

from lmforge.engine import AsyncLLMEngine, EngineConfig
from lmforge.serve.app import build_app
from lmforge.serve.config import ServerConfig
from lmforge.serve.protocol import ChatCompletionRequest
from lmforge.serve.serving_chat import template_features, template_messages, with_tools_prompt
from lmforge.serve.testing import ServerThread
from lmforge.serve.tool_parsers import ToolCallStream, get_tool_parser, scan_object
from lmforge.tokenizer import load_tokenizer

MODEL = "tiny"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12},
                   "unit": {"enum": ["celsius", "fahrenheit"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(chat_model_dir, tmp_path_factory):
    # the tools' system prompt takes ~700 tokens of this 512-entry vocabulary: a longer context (random RoPE
    # weights do not care)
    model_dir = tmp_path_factory.mktemp("tools-model") / "model"
    shutil.copytree(chat_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    engine = AsyncLLMEngine(EngineConfig(model=str(model_dir), dtype="float32", max_model_len=2048,
                                         num_kv_blocks=1024))
    app = build_app(engine, ServerConfig(MODEL))
    with ServerThread(app) as srv:
        srv.state = app.state.server
        yield srv
    engine.shutdown()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def _check_calls(calls, names=None):
    assert calls, "no tool call"
    for c in calls:
        assert c.id.startswith("call_") and c.type == "function"
        assert names is None or c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


# ---- forced calls: named and required, streamed and not ------------------------------------------------------------

def test_named_tool_choice_forces_a_valid_call(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named,
                                           max_tokens=120, temperature=1.0, seed=seed)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert len(choice.message.tool_calls) == 1 and choice.message.content is None
        _check_calls(choice.message.tool_calls, {"get_weather"})


def test_required_streamed_is_assembled_by_the_client_and_matches_the_plain_reply(client):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0,
              parallel_tool_calls=False)
    plain = client.chat.completions.create(**kw).choices[0]
    assert plain.finish_reason == "tool_calls" and len(plain.message.tool_calls) == 1
    _check_calls(plain.message.tool_calls)
    with client.chat.completions.stream(**kw) as stream:
        fragments = [e for e in stream if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion().choices[0]
    assert len(fragments) > 1  # the arguments came in pieces, not in one chunk at the end
    assert final.finish_reason == "tool_calls"
    streamed = final.message.tool_calls
    _check_calls(streamed)
    assert [(c.function.name, c.function.arguments) for c in streamed] == \
        [(c.function.name, c.function.arguments) for c in plain.message.tool_calls]  # greedy: the same call


def test_raw_stream_sends_name_first_then_argument_fragments(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=80, temperature=0, stream=True))
    deltas = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or ()]
    first = deltas[0]
    assert first.index == 0 and first.id.startswith("call_") and first.function.name == "get_time"
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    args = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(args), TIME)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_with_parallel_calls_gives_calls_of_the_listed_tools(client):
    for seed in range(2):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=400, temperature=1.0, seed=seed)
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
        _check_calls(r.choices[0].message.tool_calls, set(SCHEMAS))


# ---- auto and none ------------------------------------------------------------------------------------------------

def test_auto_parses_a_call_the_model_wrote_and_none_leaves_text(client):
    wrote = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    regex = "Sure[.]\n" + wrote.replace("{", "\\{").replace("}", "\\}")  # makes the random model write a call
    auto = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=150,
                                          extra_body={"guided_regex": regex})
    choice = auto.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure.\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("get_time", {"zone": "UTC"})]
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=150,
                                                 stream=True, extra_body={"guided_regex": regex}))
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert content == "Sure.\n" and "<tool" not in content
    none = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                          max_tokens=150, extra_body={"guided_regex": regex})
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content == "Sure.\n" + wrote
    assert none.choices[0].finish_reason == "stop"
    free = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=20, temperature=0)
    assert free.choices[0].message.tool_calls is None and free.choices[0].message.content


# ---- a tool result round-trips ------------------------------------------------------------------------------------

def test_tool_result_round_trip(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named,
                                           max_tokens=120, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "22 C, sunny"}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=16,
                                            temperature=0)
    assert answer.choices[0].message.content and answer.usage.prompt_tokens > first.usage.prompt_tokens + 20


def test_the_template_sees_the_tools_the_calls_and_the_results(chat_model_dir):
    tok = load_tokenizer(chat_model_dir)
    assert template_features(tok) == (False, False)  # ChatML ignores tools: the fallbacks below apply
    parser = get_tool_parser("hermes")
    req = ChatCompletionRequest(messages=[
        {"role": "system", "content": "Be brief."}, *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}], tools=TOOLS)
    messages = with_tools_prompt(template_messages(req, parser, False), parser.system_prompt(TOOLS))
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools\n") and json.dumps(TOOLS[0]) in text
    assert "</tools>" in text and "Be brief.<|im_end|>" in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>' \
        "<|im_end|>" in text
    assert text.endswith("<|im_start|>tool\n12:00<|im_end|>\n<|im_start|>assistant\n")
    # a template that renders tool_calls gets them with the arguments as an object (Hugging Face's convention)
    native = template_messages(req, parser, True)
    assert native[2]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": {"zone": "UTC"}}
    assert native[3]["tool_call_id"] == "call_1"


# ---- the llama3_json parser through the server ----------------------------------------------------------------------

def test_llama3_json_parser_forces_and_parses_its_format(server, client):
    server.state.tool_call_parser = "llama3_json"
    try:
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=300, temperature=1.0, seed=1)
        assert r.choices[0].finish_reason == "tool_calls"
        _check_calls(r.choices[0].message.tool_calls)
        with client.chat.completions.stream(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0,
                                            tool_choice={"type": "function", "function": {"name": "get_time"}}) as s:
            final = s.get_final_completion().choices[0]
        _check_calls(final.message.tool_calls, {"get_time"})
    finally:
        server.state.tool_call_parser = "hermes"


# ---- bad requests: a 400 naming the field ------------------------------------------------------------------------

@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "<|im_start|>system"}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
])
def test_bad_tool_requests_are_refused_by_name(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=extra)
    assert e.value.body["param"] == param, e.value.body


@pytest.mark.parametrize("message, param", [
    ({"role": "tool", "content": "42"}, "messages[1].tool_call_id"),
    ({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "not json"}}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"role": "user", "content": "x", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, "messages[1].tool_calls"),
])
def test_bad_tool_messages_are_refused_by_name(client, message, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[*ASK, message], max_tokens=4)
    assert e.value.body["param"] == param, e.value.body


CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]}


@pytest.mark.parametrize("messages, extra, param", [
    ([*ASK, CALLED, {"role": "tool", "tool_call_id": "call_9", "content": "12:00"}], {}, "messages[2].tool_call_id"),
    ([{"role": "tool", "tool_call_id": "call_1", "content": "12:00"}, *ASK], {}, "messages[0].tool_call_id"),
    ([*ASK, CALLED, *ASK, {"role": "tool", "tool_call_id": "call_1", "content": "late"}], {},
     "messages[3].tool_call_id"),  # a result answers the assistant message just before it
    ([*ASK, {**CALLED, "tool_calls": CALLED["tool_calls"] * 2}], {}, "messages[1].tool_calls[1].id"),
    (ASK, {"tools": [TOOLS[0], TOOLS[1], TOOLS[0]]}, "tools[2].function.name"),
    (ASK, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
     "tools[0].function.parameters"),  # tool_choice auto: the schema is never compiled, but still must be one
    (ASK, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": "x"}}}],
           "tool_choice": "none"}, "tools[0].function.parameters"),
], ids=["unknown-call-id", "tool-first", "tool-after-user", "duplicate-call-id", "duplicate-tool",
        "bad-schema-auto", "bad-schema-none"])
def test_inconsistent_tools_and_tool_messages_are_refused_by_name(client, messages, extra, param):
    """Issue 43: each was a 200."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, extra_body=extra)
    assert e.value.body["param"] == param, e.value.body


# ---- the parsers alone -------------------------------------------------------------------------------------------

def _stream(parser_name: str, text: str, step: int = 1):
    """Feed `text` in growing prefixes; (content, [(id, name, arguments)], number of argument fragments)."""
    s, content, calls, fragments = ToolCallStream(get_tool_parser(parser_name)), "", {}, 0
    for end in [*range(step, len(text), step), len(text)]:
        piece, deltas = s.update(text[:end], final=False)
        content += piece
        for d in deltas:
            if "id" in d:
                assert d["index"] == len(calls) and d["function"]["name"]
                calls[d["index"]] = [d["id"], d["function"]["name"], ""]
            else:
                assert d["function"]["arguments"] and set(d) == {"index", "function"}
            calls[d["index"]][2] += d["function"].get("arguments", "")
            fragments += bool(d["function"].get("arguments"))
    piece, deltas = s.update(text, final=True)
    assert not deltas
    return content + piece, [tuple(c) for c in calls.values()], fragments


def test_hermes_parser_whole_and_streamed():
    text = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris}", "days": [1, {"a": 2}]}}'
            '\n</tool_call>\n<tool_call>\n{"arguments": {"zone": "UTC"}, "name": "get_time"}\n</tool_call>')
    content, calls = get_tool_parser("hermes").extract(text)
    assert content == "Checking.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": 'Pa"ris}', "days": [1, {"a": 2}]}), ("get_time", {"zone": "UTC"})]
    s_content, s_calls, fragments = _stream("hermes", text)
    assert s_content == "Checking.\n" and fragments > 10  # the first call's arguments, a character at a time
    assert [(n, a) for _, n, a in s_calls] == [(c.name, c.arguments) for c in calls]
    assert get_tool_parser("hermes").extract("no calls <tool_call> {broken") == ("no calls <tool_call> {broken", [])
    assert _stream("hermes", "a <tool_ca", 3)[:2] == ("a <tool_ca", [])  # held back, then given at the end


def test_llama3_json_parser_whole_and_streamed():
    text = '{"name": "get_time", "parameters": {"zone": "CET"}}; {"name": "get_weather", "parameters": {}}'
    content, calls = get_tool_parser("llama3_json").extract(text)
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_time", '{"zone": "CET"}'),
                                                                         ("get_weather", "{}")]
    s_content, s_calls, fragments = _stream("llama3_json", text, 2)
    assert s_content == "" and fragments > 3 and [(n, a) for _, n, a in s_calls] == [
        ("get_time", '{"zone": "CET"}'), ("get_weather", "{}")]
    assert get_tool_parser("llama3_json").extract("  Hello {there}") == ("  Hello {there}", [])
    assert _stream("llama3_json", "  Hello {there}", 2)[:2] == ("  Hello {there}", [])
    tagged = '<|python_tag|>{"name": "f", "parameters": "{\\"x\\": 1}"}'  # arguments as a JSON string
    assert [(c.name, json.loads(c.arguments)) for c in get_tool_parser("llama3_json").extract(tagged)[1]] == \
        [("f", {"x": 1})]


def test_scanner_reads_partial_objects():
    text = '{"name": "f", "arguments": {"a": "}", "b": [1'
    keys, end = scan_object(text, 0)
    assert end is None and keys["name"] == (9, 12) and keys["arguments"][1] is None
    keys, end = scan_object(text + "]}}", 0)
    assert end == len(text) + 3 and text[keys["arguments"][0]:] + "]}" == '{"a": "}", "b": [1]}'


# A Hermes/Qwen2.5-style template that renders `tools` and `tool_calls` itself (abridged)
NATIVE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
    "</tools><|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for tc in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_renders_tools_gets_them_natively(chat_model_dir):
    tok = load_tokenizer(chat_model_dir)
    tok.chat_template = NATIVE_TEMPLATE
    assert template_features(tok) == (True, True)
    req = ChatCompletionRequest(messages=[*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}], tools=TOOLS)
    text = tok.apply_chat_template(template_messages(req, get_tool_parser("hermes"), True), tools=TOOLS,
                                   tokenize=False, add_generation_prompt=True)
    assert text.count('"name": "get_weather"') == 1 and "# Tools" in text  # the template's own tools prompt
    assert '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>' in text  # not re-quoted


def test_parallel_tool_calls_false_keeps_the_first_call_the_model_wrote(client):
    one = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    regex = (one + "\n" + one.replace("UTC", "CET")).replace("{", "\\{").replace("}", "\\}")
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200, extra_body={"guided_regex": regex})
    both = client.chat.completions.create(**kw).choices[0].message.tool_calls
    assert [json.loads(c.function.arguments)["zone"] for c in both] == ["UTC", "CET"]
    first = client.chat.completions.create(**kw, parallel_tool_calls=False).choices[0].message.tool_calls
    with client.chat.completions.stream(**kw, parallel_tool_calls=False) as s:
        streamed = s.get_final_completion().choices[0].message.tool_calls
    assert [json.loads(c.function.arguments)["zone"] for c in first] == ["UTC"]
    assert [json.loads(c.function.arguments)["zone"] for c in streamed] == ["UTC"]


def test_the_tool_call_parser_flag_is_checked(tmp_path):
    with pytest.raises(ValueError, match="tool_call_parser='xml'"):
        ServerConfig(MODEL, tool_call_parser="xml")
    (tmp_path / "config.json").write_text("{}")
    r = subprocess.run([sys.executable, "-m", "lmforge.cli", "serve", str(tmp_path), "--tool-call-parser", "xml"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--tool-call-parser xml: one of hermes, llama3_json" in r.stderr


def test_the_parser_flag_reaches_the_chat_endpoint(server):
    app = build_app(server.state.client.router.champion.engine, ServerConfig(MODEL, tool_call_parser="llama3_json"))
    assert app.state.server.tool_call_parser == "llama3_json"
    assert build_app(server.state.client.router.champion.engine, ServerConfig(MODEL)).state.server.tool_call_parser \
        == "hermes"
