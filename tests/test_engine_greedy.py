"""Greedy identity against `transformers`: whatever the batch, chunking, preemptions or cache hits,
the engine's greedy tokens equal `model.generate(do_sample=False)` run one prompt at a time.

    python -m pytest -q tests/test_engine_greedy.py
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from hf_models import make_hf_model
from lmforge.engine import LLM, LLMEngine, EngineConfig, SamplingParams

VARIANTS = ["llama", "mistral", "qwen2", "qwen3"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny models: intra-op threads only add sync overhead, ruinous on a shared 2-core machine.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_prompts(seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """32 prompts (lengths 1-300; 8 share a 96-token prefix) and their max_tokens (1-200).
    Most generations are short so the one-at-a-time HF reference stays a few seconds."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(3, 256) for _ in range(n)]  # noqa: E731 (ids 0-2 are special)
    shared = tok(96)
    lengths = [1, 300, 2, 15, 16, 17, 33, 150] + [rng.randint(1, 120) for _ in range(16)]
    prompts = [tok(n) for n in lengths] + [shared + tok(rng.randint(0, 40)) for _ in range(8)]
    max_tokens = [200, 1, 120] + [rng.randint(1, 12) for _ in range(len(prompts) - 3)]
    return prompts, max_tokens


PROMPTS, MAX_TOKENS = make_prompts()


def hf_greedy(model, prompts, max_tokens) -> list[list[int]]:
    outs = []
    for p, m in zip(prompts, max_tokens):
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=m,
                             min_new_tokens=m, eos_token_id=None, pad_token_id=0)
        outs.append(out[0, len(p):].tolist())
    return outs


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """variant -> (model dir saved in float64, HF float64 model)."""
    cache = {}

    def get(variant):
        if variant not in cache:
            path = tmp_path_factory.mktemp(variant)
            hf = make_hf_model(variant, seed=1, dtype=torch.float64)
            hf.save_pretrained(path)
            cache[variant] = (path, hf)
        return cache[variant]
    return get


@pytest.fixture(scope="module")
def references(models):
    cache = {}

    def get(variant, dtype=torch.float64):
        if (variant, dtype) not in cache:
            hf = models(variant)[1]
            hf = hf if dtype == torch.float64 else copy.deepcopy(hf).to(dtype)
            with torch.inference_mode():
                cache[variant, dtype] = hf_greedy(hf, PROMPTS, MAX_TOKENS)
        return cache[variant, dtype]
    return get


def greedy(m: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)


def assert_same(outs, expected):
    got = [o.outputs[0].token_ids for o in outs]
    bad = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    assert not bad, f"{len(bad)} prompts differ, first {bad[0]}: got {got[bad[0]][:8]} want {expected[bad[0]][:8]}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_identity_float64(variant, models, references):
    llm = LLM(str(models(variant)[0]), dtype="float64", device="cpu")
    outs = llm.generate(PROMPTS, [greedy(m) for m in MAX_TOKENS], use_tqdm=False)
    assert_same(outs, references(variant))
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    assert llm.stats()["prefix_cache_hits"] > 0  # the shared-prefix prompts hit


def test_greedy_identity_float32(models, references):
    llm = LLM(str(models("llama")[0]), dtype="float32", device="cpu")
    outs = llm.generate(PROMPTS, [greedy(m) for m in MAX_TOKENS], use_tqdm=False)
    assert_same(outs, references("llama", torch.float32))


def test_reference_attention_path(models, references):
    llm = LLM(str(models("qwen3")[0]), dtype="float64", device="cpu", attention="reference",
              max_num_batched_tokens=128)
    outs = llm.generate(PROMPTS[:12], [greedy(m) for m in MAX_TOKENS[:12]], use_tqdm=False)
    assert_same(outs, references("qwen3")[:12])


def test_identity_under_preemption(models, references):
    # 20 blocks of 16 = 320 slots: just enough for the largest request (300 + 1 tokens)
    llm = LLM(str(models("llama")[0]), dtype="float64", device="cpu", num_kv_blocks=20)
    outs = llm.generate(PROMPTS, [greedy(m) for m in MAX_TOKENS], use_tqdm=False)
    assert_same(outs, references("llama"))
    stats = llm.stats()
    assert stats["preemptions"] > 0
    assert stats["kv_blocks_in_use"] == 0


def test_identity_with_chunked_prefill(models, references):
    llm = LLM(str(models("llama")[0]), dtype="float64", device="cpu", max_num_batched_tokens=48)
    engine, chunks = llm.llm_engine, {}
    schedule = engine.scheduler.schedule

    def spy():
        scheduled = schedule()
        for s in scheduled:
            if s.seq.num_output_tokens == 0:
                chunks[s.seq.request_id] = chunks.get(s.seq.request_id, 0) + 1
        return scheduled
    engine.scheduler.schedule = spy
    outs = llm.generate(PROMPTS, [greedy(m) for m in MAX_TOKENS], use_tqdm=False)
    assert_same(outs, references("llama"))
    assert max(chunks.values()) >= 300 // 48  # the 300-token prompt took at least 6 steps


def test_identity_with_requests_added_mid_decode(models, references):
    engine = LLMEngine(EngineConfig(model=str(models("llama")[0]), dtype="float64", device="cpu"))
    done = {}
    order = list(range(len(PROMPTS)))
    random.Random(1).shuffle(order)
    pending = iter(order)
    for i in [next(pending) for _ in range(4)]:
        engine.add_request(str(i), PROMPTS[i], greedy(MAX_TOKENS[i]))
    step = 0
    while engine.has_unfinished_requests() or len(done) < len(PROMPTS):
        if step % 3 == 0:  # one new request every third step, while others decode
            i = next(pending, None)
            if i is not None:
                engine.add_request(str(i), PROMPTS[i], greedy(MAX_TOKENS[i]))
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out
        step += 1
    assert_same([done[i] for i in range(len(PROMPTS))], references("llama"))
