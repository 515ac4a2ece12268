"""vLLM's request extensions, sent the way its users send them: the official `openai` client's `extra_body`.
Each is honoured (a `SamplingParams` field, or a chat template option) and checked against what it must
change: `prompt_logprobs`, `allowed_token_ids`, `bad_words`, `include_stop_str_in_output`,
`continue_final_message`, `add_generation_prompt`, `chat_template`, `chat_template_kwargs`,
`truncate_prompt_tokens`; `use_beam_search` is a 400 naming it; ServerConfig.chat_template (`--chat-template`).

    python -m pytest -q tests/test_serve_vllm_fields.py
"""

from __future__ import annotations

import openai
import pytest

from lmforge.engine import LLM, AsyncLLMEngine, EngineConfig, SamplingParams
from lmforge.serve.app import build_app
from lmforge.serve.config import ServerConfig
from lmforge.serve.testing import ServerThread

MODEL = "tiny"
PLAIN = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{{ greeting | default('') }}"
CHAT = [{"role": "user", "content": "Name a river."}]


@pytest.fixture(scope="module")
def engine(chat_model_dir, one_thread):
    eng = AsyncLLMEngine(EngineConfig(model=str(chat_model_dir), dtype="float32", max_model_len=256))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def client(engine):
    with ServerThread(build_app(engine, ServerConfig(MODEL))) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def offline(chat_model_dir):
    return LLM(str(chat_model_dir), dtype="float32", max_model_len=256)


def bad_request(call, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    assert e.value.param == param, e.value.message


def test_prompt_logprobs_completions_and_chat(client, offline):
    r = client.completions.create(model=MODEL, prompt="The city of the", max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    lps = r.choices[0].model_extra["prompt_logprobs"]
    ref = offline.generate(["The city of the"], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2),
                           use_tqdm=False)[0]
    assert lps[0] is None and len(lps) == len(ref.prompt_token_ids) == r.usage.prompt_tokens
    for got, want in zip(lps[1:], ref.prompt_logprobs[1:]):
        assert {int(t): v["logprob"] for t, v in got.items()} == pytest.approx({t: v.logprob for t, v in want.items()})
        assert all(v["rank"] >= 1 and isinstance(v["decoded_token"], str) for v in got.values())
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, extra_body={"prompt_logprobs": 0})
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens
    bad_request(lambda: client.completions.create(model=MODEL, prompt="x", stream=True,
                                                  extra_body={"prompt_logprobs": 1}), "prompt_logprobs")
    bad_request(lambda: client.completions.create(model=MODEL, prompt="x", extra_body={"prompt_logprobs": 21}),
                "prompt_logprobs")


def test_allowed_token_ids(client, offline):
    for temperature in (0, 1.0):
        params = SamplingParams(max_tokens=12, temperature=temperature, seed=3, allowed_token_ids=[300, 301],
                                ignore_eos=True)
        ref = offline.generate(["The city of"], params, use_tqdm=False)[0].outputs[0]
        assert set(ref.token_ids) <= {300, 301} and len(ref.token_ids) == 12
        r = client.completions.create(model=MODEL, prompt="The city of", max_tokens=12, temperature=temperature,
                                      seed=3, extra_body={"allowed_token_ids": [300, 301], "ignore_eos": True})
        assert r.choices[0].text == ref.text
    bad_request(lambda: client.completions.create(model=MODEL, prompt="x", extra_body={"allowed_token_ids": [10**6]}),
                "allowed_token_ids")


def test_bad_words(client, offline):
    tok = offline.get_tokenizer()
    base = offline.generate(["The city of"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    word = tok.decode(base.outputs[0].token_ids[:1]).strip()  # the first word the model would say
    r = client.completions.create(model=MODEL, prompt="The city of", max_tokens=8, temperature=0,
                                  extra_body={"bad_words": [word]})
    banned = {tok.encode(word, add_special_tokens=False)[-1], tok.encode(" " + word, add_special_tokens=False)[-1]}
    assert r.choices[0].text != base.outputs[0].text
    assert not banned & set(tok.encode(r.choices[0].text, add_special_tokens=False))
    bad_request(lambda: client.completions.create(model=MODEL, prompt="x", extra_body={"bad_words": [" "]}),
                "bad_words")


def test_include_stop_str_in_output(client):
    base = client.completions.create(model=MODEL, prompt="The city of", max_tokens=10, temperature=0)
    stop = base.choices[0].text[3:6]
    cut = client.completions.create(model=MODEL, prompt="The city of", max_tokens=10, temperature=0, stop=[stop])
    kept = client.completions.create(model=MODEL, prompt="The city of", max_tokens=10, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == cut.choices[0].text + stop and not cut.choices[0].text.endswith(stop)


def test_generation_prompt_and_continue_final_message(client, offline):
    tok = offline.get_tokenizer()
    with_prompt = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    without = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1,
                                             extra_body={"add_generation_prompt": False})
    assert without.usage.prompt_tokens < with_prompt.usage.prompt_tokens
    started = CHAT + [{"role": "assistant", "content": "The river"}]
    text = tok.apply_chat_template(started, tokenize=False, continue_final_message=True)
    assert text.endswith("The river")
    ids = tok.encode(text, add_special_tokens=False)
    ref = offline.generate([ids], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0].text
    r = client.chat.completions.create(model=MODEL, messages=started, max_tokens=6, temperature=0,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert r.usage.prompt_tokens == len(ids) and r.choices[0].message.content == ref
    bad_request(lambda: client.chat.completions.create(model=MODEL, messages=started, extra_body={
        "continue_final_message": True}), "continue_final_message")  # add_generation_prompt defaults to true


def test_chat_template_and_its_kwargs(client, offline):
    tok = offline.get_tokenizer()
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, extra_body={
        "chat_template": PLAIN, "chat_template_kwargs": {"greeting": "assistant:"}})
    assert r.usage.prompt_tokens == len(tok.encode("user: Name a river.\nassistant:", add_special_tokens=False))
    bad_request(lambda: client.chat.completions.create(model=MODEL, messages=CHAT, extra_body={
        "chat_template": "{% for m in messages %}"}), "chat_template")
    bad_request(lambda: client.chat.completions.create(model=MODEL, messages=CHAT, extra_body={
        "chat_template_kwargs": {"tools": []}}), "chat_template_kwargs.tools")


def test_server_chat_template_overrides_the_models(engine, offline):
    tok = offline.get_tokenizer()
    with ServerThread(build_app(engine, ServerConfig(MODEL, chat_template=PLAIN))) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        r = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
        assert r.usage.prompt_tokens == len(tok.encode("user: Name a river.\n", add_special_tokens=False))
        own = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1,
                                        extra_body={"chat_template": tok.chat_template})  # a request's own wins
        assert own.usage.prompt_tokens > r.usage.prompt_tokens


def test_truncate_prompt_tokens(client, offline):
    ids = offline.get_tokenizer().encode("The city of the river was known for its school and its university")
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0,
                                  extra_body={"truncate_prompt_tokens": 5})
    last5 = client.completions.create(model=MODEL, prompt=ids[-5:], max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens == 5 and r.choices[0].text == last5.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1,
                                          extra_body={"truncate_prompt_tokens": 3})
    assert chat.usage.prompt_tokens == 3
    bad_request(lambda: client.completions.create(model=MODEL, prompt="x", extra_body={"truncate_prompt_tokens": 999}),
                "truncate_prompt_tokens")
    bad_request(lambda: client.completions.create(model=MODEL, prompt="x", extra_body={"truncate_prompt_tokens": -2}),
                "truncate_prompt_tokens")


def test_use_beam_search_is_refused_by_name(client):
    bad_request(lambda: client.completions.create(model=MODEL, prompt="x", extra_body={"use_beam_search": True}),
                "use_beam_search")
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=1,
                                     extra_body={"use_beam_search": False}).choices
