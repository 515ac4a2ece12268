"""Structured outputs and logit_bias through the `openai` client against a real server (issue 26 item 1,
issue 24 finding 6): JSON mode, a nested JSON schema (every output validates with `jsonschema`, from a
random model that would otherwise emit garbage), vLLM's guided_* / structured_outputs extras, streamed
and not, constrained and free requests in one batch, and the 400s that name what is wrong.

    python -m pytest -q tests/test_serve_structured.py
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

from lmforge.engine import AsyncLLMEngine, EngineConfig
from lmforge.serve.app import build_app
from lmforge.serve.config import ServerConfig
from lmforge.serve.testing import ServerThread
from lmforge.tokenizer import load_tokenizer

MODEL = "tiny"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                  "required": ["zip"], "additionalProperties": False},
    },
    "required": ["name", "kind", "age", "tags", "owner"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def server(chat_model_dir):
    engine = AsyncLLMEngine(EngineConfig(model=str(chat_model_dir), dtype="float32", max_model_len=512,
                                         num_kv_blocks=512))
    with ServerThread(build_app(engine, ServerConfig(MODEL))) as srv:
        yield srv
    engine.shutdown()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def test_json_schema_outputs_validate_streamed_and_not(client):
    msgs = [{"role": "user", "content": "Describe a pet."}]
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=msgs, response_format=FORMAT, max_tokens=200,
                                           temperature=1.0, seed=seed)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    chunks = client.chat.completions.create(model=MODEL, messages=msgs, response_format=FORMAT, max_tokens=200,
                                            stream=True, temperature=0)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    free = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=60, temperature=1.0, seed=0)
    with pytest.raises(json.JSONDecodeError):  # the same model, unconstrained: garbage
        json.loads(free.choices[0].message.content)


def test_json_mode_gives_an_object(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "JSON please"}],
                                       response_format={"type": "json_object"}, max_tokens=200, temperature=0)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # JSON mode leaves string contents free: a random model may run out of tokens inside one
        assert r.choices[0].message.content.lstrip().startswith("{")


def test_vllm_extras_on_completions_and_a_mixed_batch(server, client):
    choice = client.completions.create(model=MODEL, prompt="The answer is", max_tokens=20,
                                       extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert choice.choices[0].text in ("yes", "no", "maybe")
    regex = client.completions.create(model=MODEL, prompt="Call", max_tokens=20,
                                      extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", regex.choices[0].text)

    async def batch():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        jobs = [c.completions.create(model=MODEL, prompt=f"The city of {i}", max_tokens=24, temperature=0,
                                     extra_body={"guided_json": SCHEMA} if i % 2 else {}) for i in range(6)]
        return await asyncio.gather(*jobs)

    outs = asyncio.run(batch())
    for i, o in enumerate(outs):
        if i % 2 and o.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(o.choices[0].text), SCHEMA)
        elif not i % 2:  # the free rows are untouched by their neighbours' masks: same as alone
            alone = client.completions.create(model=MODEL, prompt=f"The city of {i}", max_tokens=24, temperature=0)
            assert o.choices[0].text == alone.choices[0].text


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "format": "hostname-idn-xyz"}}}}}},
     "response_format"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "response_format"),
    ({"guided_regex": "("}, "guided_regex"),
    ({"response_format": {"type": "xml"}}, "response_format"),
])
def test_bad_constraints_are_400s_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       stream=True, extra_body=extra)
    assert e.value.body["param"] == param, e.value.body


CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}


def _schema_format(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


@pytest.mark.parametrize("extra, param", [
    ({"guided_choice": [f"choice {i} 123-45-6789 a@b.example" for i in range(3000)]}, "guided_choice"),
    ({"guided_grammar": "start: " + " | ".join(f'"w{i}x"' for i in range(5000))}, "guided_grammar"),
    ({"guided_regex": "((a{100}){100}){100}"}, "guided_regex"),
    (_schema_format({"$ref": "#"}), "response_format"),
    (_schema_format(CYCLE), "response_format"),
], ids=["choice-3000", "lark-5000", "regex-nested", "ref-self", "ref-cycle"])
def test_grammars_that_cannot_run_are_refused_at_admission(client, caplog, extra, param):
    """Issue 43: each compiled, then died at its first token (llguidance's limits: 2,000 items a row, the
    lexer's fuel; an empty recursion): a 200 with finish_reason "abort" and the grammar in the log."""
    for stream in (True, False):
        with caplog.at_level("DEBUG"), pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                           stream=stream, extra_body=extra)
        assert e.value.body["param"] == param and "cannot run" in e.value.body["message"], e.value.body
    assert "123-45-6789" not in caplog.text and "w4999x" not in caplog.text and "a{100}" not in caplog.text


def test_logit_bias_forces_a_token_and_bans_another(client, chat_model_dir):
    tok = load_tokenizer(chat_model_dir)
    forced = client.completions.create(model=MODEL, prompt="The city of", max_tokens=5, temperature=0,
                                       logit_bias={"25": 100})
    assert forced.choices[0].text == tok.decode([25] * 5)
    free = client.completions.create(model=MODEL, prompt="The city of", max_tokens=5, temperature=0)
    first = tok.encode(free.choices[0].text, add_special_tokens=False)[0]
    banned = client.completions.create(model=MODEL, prompt="The city of", max_tokens=5, temperature=0,
                                       logit_bias={str(first): -100})
    assert banned.choices[0].text != free.choices[0].text
    assert not banned.choices[0].text.startswith(tok.decode([first]))
