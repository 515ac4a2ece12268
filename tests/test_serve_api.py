"""The OpenAI-compatible server, tested the way users call it: the official `openai` client (and
raw httpx for malformed input) against a uvicorn server on a free loopback port, over a tiny
random Llama with a tokenizer trained in the fixture. Greedy outputs must equal the offline
`LLM.generate`; counters must reconcile with what was sent; bad input gets OpenAI's error JSON
and never hurts the server; a client that disconnects frees its KV blocks.

    python -m pytest -q tests/test_serve_api.py
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lmforge.engine import LLM, AsyncLLMEngine, EngineConfig, SamplingParams
from lmforge.serve.app import build_app
from lmforge.serve.config import ServerConfig, ServerLimits
from lmforge.serve.testing import ServerThread

MODEL = "tiny"
PROMPTS = ["The city of", "Python code data", "A river in the school"]


@pytest.fixture(scope="module")
def model_dir(chat_model_dir) -> Path:
    return chat_model_dir


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = AsyncLLMEngine(EngineConfig(model=str(model_dir), dtype="float32", max_model_len=256))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(build_app(engine, ServerConfig(MODEL))) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def scrape(url: str) -> dict[str, float]:
    """Every sample of /metrics as 'name{label=value,...}' -> value (labels sorted; model_name and model_version
    dropped: one version here)."""
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "model_version"))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def delta(after: dict, before: dict, key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


# ---- the happy paths ---------------------------------------------------------------------------------


def test_greedy_completions_match_offline_engine(client, model_dir):
    offline = LLM(str(model_dir), dtype="float32", max_model_len=256).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    for prompt, ref in zip(PROMPTS, offline):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert r.choices[0].text == ref.outputs[0].text
        assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == MODEL
        streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                                  stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in streamed if c.choices) == ref.outputs[0].text
        assert streamed[-1].usage.completion_tokens == r.usage.completion_tokens
        assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == r.choices[0].finish_reason


def test_token_id_prompts_and_batches(client):
    single = client.completions.create(model=MODEL, prompt=[10, 11, 12, 13], max_tokens=5, temperature=0)
    batch = client.completions.create(model=MODEL, prompt=[[10, 11, 12, 13], [20, 21]], max_tokens=5, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == single.choices[0].text
    assert batch.usage.prompt_tokens == 6 and batch.usage.completion_tokens == 10


def test_chat_streaming_and_not(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a river."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason in ("stop", "length")
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    u, ref = chunks[-1].usage, r.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (ref.prompt_tokens, ref.completion_tokens,
                                                                      ref.total_tokens)
    assert u.prompt_tokens_details.cached_tokens == 32  # the same prompt again: its 2 full blocks are cached
    lp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                        logprobs=True, top_logprobs=3).choices[0].logprobs.content
    assert len(lp) == 4 and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in lp)


def test_n2_seed_reproducible_and_usage(client):
    kw = dict(model=MODEL, prompt="The city of", max_tokens=8, temperature=1.0, n=2, seed=1234, ignore_eos=True)
    a = client.completions.create(**{k: v for k, v in kw.items() if k != "ignore_eos"}, extra_body={"ignore_eos": True})
    b = client.completions.create(**{k: v for k, v in kw.items() if k != "ignore_eos"}, extra_body={"ignore_eos": True})
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text  # seed + i: two different samples
    assert a.usage.completion_tokens == 16
    streamed = list(client.completions.create(model=MODEL, prompt="The city of", max_tokens=8, n=2, seed=1234,
                                              stream=True, extra_body={"ignore_eos": True}))
    for i in (0, 1):
        assert "".join(c.choices[0].text for c in streamed if c.choices and c.choices[0].index == i) == a.choices[i].text


def test_stop_strings_cut_the_text(client):
    full = client.completions.create(model=MODEL, prompt="Python code data", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = next(full[i:i + 2] for i in range(3, len(full) - 2) if full[i:i + 2].strip() and "\ufffd" not in full[i:i + 2])
    r = client.completions.create(model=MODEL, prompt="Python code data", max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt="Python code data", max_tokens=24, temperature=0,
                                            stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_logprobs_echo_and_models(client, server):
    r = client.completions.create(model=MODEL, prompt="The city of", max_tokens=3, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    e = client.completions.create(model=MODEL, prompt="The city of", max_tokens=3, temperature=0, echo=True)
    assert e.choices[0].text == "The city of" + r.choices[0].text
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]


def test_prefix_cache_hits_are_reported_as_cached_tokens(client):
    prompt = "The city of the river " * 8  # > 2 blocks of 16 tokens
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


# ---- load and metrics --------------------------------------------------------------------------------


def test_64_concurrent_streams_and_metrics_agree(server, engine):
    before = scrape(server.url)
    tok = engine.tokenizer
    prompts = [f"Request {i}: the city of " + "data " * (i % 7) for i in range(64)]
    max_tokens = [4 + i % 9 for i in range(64)]

    async def one(ac, prompt, n):
        stream = await ac.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0.8, seed=7,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        return chunks

    async def main():
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        try:
            return await asyncio.gather(*(one(ac, p, n) for p, n in zip(prompts, max_tokens)))
        finally:
            await ac.close()

    results = asyncio.run(main())
    for prompt, n, chunks in zip(prompts, max_tokens, results):
        usage = chunks[-1].usage
        assert usage.completion_tokens == n and usage.prompt_tokens == len(tok.encode(prompt))
        assert sum(1 for c in chunks if c.choices) == n  # one chunk per token
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    after = scrape(server.url)
    assert delta(after, before, "vllm:request_success_total{finished_reason=length}") == 64
    assert delta(after, before, "vllm:prompt_tokens_total") == sum(len(tok.encode(p)) for p in prompts)
    assert delta(after, before, "vllm:generation_tokens_total") == sum(max_tokens)
    assert delta(after, before, "vllm:time_to_first_token_seconds_count") == 64
    assert delta(after, before, "vllm:e2e_request_latency_seconds_count") == 64
    assert delta(after, before, "vllm:inter_token_latency_seconds_count") == sum(n - 1 for n in max_tokens)
    assert delta(after, before, "vllm:request_generation_tokens_sum") == sum(max_tokens)
    assert after["vllm:num_requests_running"] == 0 and after["vllm:kv_cache_usage_perc"] == 0


def test_disconnect_mid_stream_aborts_and_frees_kv(server):
    idle = scrape(server.url)["vllm:kv_cache_usage_perc"]
    before = scrape(server.url)
    body = {"model": MODEL, "prompt": "The city of", "max_tokens": 240, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as c, c.stream("POST", server.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(x.startswith("data: ") for x in got)
        busy = scrape(server.url)["vllm:kv_cache_usage_perc"]
    assert busy > idle
    deadline = time.time() + 10
    while time.time() < deadline:
        after = scrape(server.url)
        if after["vllm:kv_cache_usage_perc"] == idle and after["vllm:num_requests_running"] == 0:
            break
        time.sleep(0.05)
    assert after["vllm:kv_cache_usage_perc"] == idle and after["vllm:num_requests_running"] == 0
    assert delta(after, before, "vllm:request_success_total{finished_reason=abort}") == 1
    assert delta(after, before, "vllm:generation_tokens_total") < 240


# ---- bad input ---------------------------------------------------------------------------------------

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
BAD = [  # (path, body or raw bytes, status, param)
    (C, b"{not json", 400, None),
    (C, b"[1, 2]", 400, None),
    (C, {}, 400, "prompt"),
    (C, {"prompt": ""}, 400, "prompt"),
    (C, {"prompt": []}, 400, "prompt"),
    (C, {"prompt": ["a", [1, 2]]}, 400, "prompt"),
    (C, {"prompt": [1, 2, 10**9]}, 400, "prompt"),
    (C, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
    (C, {"prompt": "x " * 300}, 400, "max_tokens"),
    (C, {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    (C, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    (C, {"prompt": "hi", "top_k": -5}, 400, "top_k"),
    (C, {"prompt": "hi", "n": 0}, 400, "n"),
    (C, {"prompt": "hi", "logprobs": 6}, 400, "logprobs"),
    (C, {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    (C, {"prompt": "hi", "stop": [""]}, 400, "stop"),
    (C, {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    (C, {"prompt": "hi", "min_tokens": 20, "max_tokens": 4}, 400, "min_tokens"),
    (C, {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    (CHAT, {"messages": "hello"}, 400, "messages"),
    (CHAT, {"messages": MSG, "top_logprobs": 30, "logprobs": True}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 10**6}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "model": "nope"}, 404, "model"),
    ("/v1/nothing", {}, 404, None),
]


def test_bad_inputs_get_openai_errors_and_the_server_survives(server, client):
    before = scrape(server.url)
    for path, body, status, param in BAD:
        kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
        r = httpx.post(server.url + path, **kw)
        assert r.status_code == status, (path, body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], (body, err)
        assert err["param"] == param, (body, err)
    after = scrape(server.url)
    assert delta(after, before, "lmforge:http_errors_total{status=400}") == sum(s == 400 for *_, s, _ in BAD)
    assert delta(after, before, "lmforge:http_errors_total{status=404}") == sum(s == 404 for *_, s, _ in BAD)
    with pytest.raises(openai.BadRequestError) as e:  # the typed exception, with .code
        client.completions.create(model=MODEL, prompt="x " * 300, max_tokens=16)
    assert e.value.code == "context_length_exceeded"
    assert client.completions.create(model=MODEL, prompt="still alive", max_tokens=3).usage.completion_tokens >= 1


def test_api_key_and_full_queue(engine):
    config = ServerConfig(MODEL, api_key="sekrit", limits=ServerLimits(max_waiting=0))
    with ServerThread(build_app(engine, config)) as srv:
        for key in (None, "wrong"):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            r = httpx.post(srv.url + C, json={"prompt": "hi"}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(srv.url + "/health").status_code == 200  # probes need no key
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekrit", max_retries=0)
        assert [m.id for m in c.models.list().data] == [MODEL]
        # --max-waiting 0 admits nothing: a request that can never fit is a 400, not "retry later"
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert e.value.code == "too_many_sequences"


def test_503_until_the_engine_is_loaded(engine):
    gate = threading.Event()

    def loader():
        gate.wait(30)
        return engine

    app = build_app(loader, ServerConfig(MODEL))
    with ServerThread(app) as srv:
        assert httpx.get(srv.url + "/health").status_code == 503
        r = httpx.post(srv.url + C, json={"prompt": "hi"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        gate.set()
        deadline = time.time() + 10
        while httpx.get(srv.url + "/health").status_code != 200 and time.time() < deadline:
            time.sleep(0.02)
        assert httpx.post(srv.url + C, json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        app.state.server.router = None  # the engine is the fixture's: keep the app from shutting it down


# ---- the benchmark client ----------------------------------------------------------------------------


def test_bench_serve_matches_server_counters(server, tmp_path):
    before = scrape(server.url)
    cmd = [sys.executable, "-c", "from lmforge.bench.commands import app; app()", "serve",
           "--base-url", server.url, "--num-prompts", "12", "--request-rate", "50", "--max-concurrency", "6",
           "--workload", "high-variance", "--seed", "3", "--slo", "ttft=5000,tpot=1000", "--out", str(tmp_path),
           "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    after = scrape(server.url)
    report = json.loads((tmp_path / "bench.json").read_text())
    client_view, server_view = report["client"], report["server"]
    assert client_view["completed"] == 12 and client_view["failed"] == 0
    assert delta(after, before, "vllm:request_success_total{finished_reason=length}") == 12 == server_view["requests"]
    assert client_view["prompt_tokens"] == delta(after, before, "vllm:prompt_tokens_total") == server_view["prompt_tokens"]
    assert client_view["output_tokens"] == delta(after, before, "vllm:generation_tokens_total") \
        == server_view["generation_tokens"]
    assert client_view["ttft_ms"]["p50"] > 0 and client_view["goodput"] > 0
    assert "| TTFT |" in (tmp_path / "bench.md").read_text()
