"""lm-evaluation-harness 0.4.13's `local-completions` against our server, replayed from a recording: the
exact payloads it sent (`echo: true, logprobs: 1, max_tokens: 1`, token-id prompts) for a multiple-choice
task (loglikelihood) and a loglikelihood_rolling task, parsed with its own rule (`parse_logprobs`: the sum of
`token_logprobs[ctxlen:-1]`, greedy when each equals its top logprob), must give `lm_eval --model hf`'s
log-likelihoods on the same model folder within 1e-4 nats. The model is the serving tests' deterministic
`chat_model_dir` (`tests/lm_eval_tasks.py`); re-record with `scripts/lm_eval_fixture.py` (docs/eval.md).

    python -m pytest -q tests/test_lm_eval_fixture.py
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from lmforge.engine import AsyncLLMEngine, EngineConfig
from lmforge.serve.app import build_app
from lmforge.serve.config import ServerConfig
from lmforge.serve.testing import ServerThread

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "lm_eval_local_completions.json").read_text())


@pytest.fixture(scope="module")
def server(chat_model_dir, one_thread):
    engine = AsyncLLMEngine(EngineConfig(model=str(chat_model_dir), dtype="float32", max_model_len=512))
    with ServerThread(build_app(engine, ServerConfig("tiny"))) as srv:
        yield srv
    engine.shutdown()


def parse_logprobs(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """lm-eval 0.4.13's LocalCompletionsAPI.parse_logprobs, for one choice."""
    token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    return sum(token_logprobs), all(t == max(top.values()) for t, top in zip(token_logprobs, top_logprobs))


def test_the_fixture_is_this_model(chat_model_dir):
    """The recorded answers are transformers' on this very model (else the fixture is stale: re-record)."""
    hf = AutoModelForCausalLM.from_pretrained(chat_model_dir, dtype=torch.float32).eval()
    for r in FIXTURE["requests"][:4]:
        ids = r["payload"]["prompt"][0]
        with torch.no_grad():
            lp_TV = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), dim=-1)
        ll = sum(lp_TV[t - 1, ids[t]].item() for t in range(r["ctxlen"], len(ids)))
        assert ll == pytest.approx(r["expected"][0], abs=1e-4)


def test_local_completions_equal_lm_eval_hf(server):
    worst = 0.0
    for r in FIXTURE["requests"]:
        body = httpx.post(server.url + "/v1/completions", json=r["payload"], timeout=60).json()
        choice = body["choices"][0]
        prompt = r["payload"]["prompt"][0]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(prompt) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        ll, greedy = parse_logprobs(choice, r["ctxlen"])
        worst = max(worst, abs(ll - r["expected"][0]))
        assert ll == pytest.approx(r["expected"][0], abs=1e-4)
        assert greedy == r["expected"][1]
    assert worst < 1e-4


def test_echo_alone_with_max_tokens_0(server):
    """OpenAI's older scoring shape (max_tokens 0): the prompt and its logprobs, nothing generated."""
    r = FIXTURE["requests"][0]
    body = httpx.post(server.url + "/v1/completions", json={**r["payload"], "max_tokens": 0}).json()
    choice, prompt = body["choices"][0], r["payload"]["prompt"][0]
    assert len(choice["logprobs"]["tokens"]) == len(prompt) and body["usage"]["completion_tokens"] == 0
    assert sum(choice["logprobs"]["token_logprobs"][r["ctxlen"]:]) == pytest.approx(r["expected"][0], abs=1e-4)
    bad = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_streamed_echo_carries_the_prompt_logprobs_first(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    kw = dict(model="tiny", prompt=FIXTURE["requests"][0]["payload"]["prompt"][0], max_tokens=3, temperature=0,
              logprobs=1, echo=True)
    whole = client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**kw, stream=True)]
    assert "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks for t in c.logprobs.token_logprobs] == whole.logprobs.token_logprobs
    assert [o for c in chunks for o in c.logprobs.text_offset] == whole.logprobs.text_offset
