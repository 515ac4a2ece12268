"""The endpoints beyond completions and chat, through the official `openai` client where it has them (httpx
for vLLM's own): `POST /tokenize`, `/detokenize`, `GET /tokenizer_info`, `GET /v1/models/{id}`,
`POST /v1/embeddings` (last-token pooling, L2-normalized, equal to transformers' hidden state) and the
Responses API (`POST /v1/responses`, streamed and not, the same text as chat; 400 for what it does not serve).

    python -m pytest -q tests/test_serve_endpoints.py
"""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from lmforge.engine import AsyncLLMEngine, EngineConfig
from lmforge.serve.app import build_app
from lmforge.serve.config import ServerConfig
from lmforge.serve.testing import ServerThread

MODEL = "tiny"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a river."}]


@pytest.fixture(scope="module")
def engine(chat_model_dir, one_thread):
    eng = AsyncLLMEngine(EngineConfig(model=str(chat_model_dir), dtype="float32", max_model_len=256,
                                      max_num_batched_tokens=8))  # prompts run in chunks: pooling at the last
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(build_app(engine, ServerConfig(MODEL))) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    return response.json()["error"]["param"]


def test_tokenize_and_detokenize(server, client, engine):
    tok = engine.tokenizer
    r = httpx.post(server.url + "/tokenize", json={"prompt": "The city of", "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("The city of") and r["count"] == len(r["tokens"]) and r["max_model_len"] == 256
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    chat = httpx.post(server.url + "/tokenize", json={"messages": CHAT}).json()
    used = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1).usage.prompt_tokens
    assert chat["count"] == used  # rendered exactly as the chat endpoint renders it
    assert httpx.post(server.url + "/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()[
        "count"] < used
    assert httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "The city of"}
    assert error(httpx.post(server.url + "/detokenize", json={"tokens": [10**6]}), 400) == "tokens"
    assert error(httpx.post(server.url + "/tokenize", json={"prompt": "x", "messages": CHAT}), 400) == "prompt"
    assert error(httpx.post(server.url + "/tokenize", json={"prompt": "x", "model": "nope"}), 404) == "model"
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template


def test_model_by_id(client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.code == "model_not_found"


def test_embeddings_are_the_normalized_last_hidden_state(client, chat_model_dir, engine):
    texts = ["The city of the river", "Python code data model token"]
    hf = AutoModelForCausalLM.from_pretrained(chat_model_dir, dtype=torch.float32).eval()
    r = client.embeddings.create(model=MODEL, input=texts)  # the client asks for base64 and decodes it
    assert [d.index for d in r.data] == [0, 1]
    for text, d in zip(texts, r.data):
        ids = engine.tokenizer.encode(text)
        with torch.no_grad():
            h = hf.model(torch.tensor([ids])).last_hidden_state[0, -1]
        assert torch.tensor(d.embedding) == pytest.approx(torch.nn.functional.normalize(h, dim=0), abs=1e-5)
    one = client.embeddings.create(model=MODEL, input=texts[1], encoding_format="float")
    assert one.data[0].embedding == pytest.approx(r.data[1].embedding, abs=1e-6)
    assert r.usage.prompt_tokens == sum(len(engine.tokenizer.encode(t)) for t in texts)
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MODEL, input="x", dimensions=8)
    assert e.value.param == "dimensions"


def test_responses_text_in_and_out(client):
    ref = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    r = client.responses.create(model=MODEL, instructions=CHAT[0]["content"], input=CHAT[1]["content"],
                                max_output_tokens=8, temperature=0)
    assert r.object == "response" and r.output_text == ref.choices[0].message.content
    assert r.status == ("incomplete" if ref.choices[0].finish_reason == "length" else "completed")
    assert (r.usage.input_tokens, r.usage.output_tokens) == (ref.usage.prompt_tokens, ref.usage.completion_tokens)
    events = list(client.responses.create(model=MODEL, input=[{"role": "system", "content": CHAT[0]["content"]},
                                                              {"role": "user", "content": [
                                                                  {"type": "input_text", "text": "Name a river."}]}],
                                          max_output_tokens=8, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].type"),
    ({"text": {"format": {"type": "json_object"}}}, "text.format"),
])
def test_responses_refuses_what_it_does_not_serve(server, extra, param):
    body = {"model": MODEL, "input": "hi", **extra}
    assert error(httpx.post(server.url + "/v1/responses", json=body), 400) == param


def test_malformed_bodies_are_400s_and_the_server_stays_healthy(server):
    for path, body in [("/v1/responses", {"input": []}), ("/v1/responses", {"input": "x", "text": {"format": "json"}}),
                       ("/v1/embeddings", {"input": []}), ("/v1/embeddings", {"input": [[]]}),
                       ("/tokenize", {"messages": [{"role": "assistant", "content": None,
                                                    "tool_calls": [{"id": "1", "function": {"name": "f",
                                                                                            "arguments": ""}}]}]})]:
        r = httpx.post(server.url + path, json=body)
        assert r.status_code == 400, (path, body, r.text)
    assert httpx.get(server.url + "/health").status_code == 200
