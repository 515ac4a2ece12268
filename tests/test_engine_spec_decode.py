"""Speculative decoding (`lmforge.engine.spec_decode`): greedy output is the plain engine's token for
token (ngram and draft model; prefix cache, preemption, max_tokens cut mid-draft, n > 1, stop strings,
requests that fall back to plain decoding), and the rejection rule keeps the target's distribution
(checked on a small vocabulary against exact probabilities).

    python -m pytest -q tests/test_engine_spec_decode.py
"""

from __future__ import annotations

import random
import subprocess
import sys

import httpx
import openai
import pytest
import torch

from hf_models import save_hf_model
from lmforge.bench.spec_decode import bench_run, to_markdown
from lmforge.engine import AsyncLLMEngine, EngineConfig, LLMEngine, SamplingParams
from lmforge.engine.spec_decode import NgramProposer, greedy_accept, rejection_sample
from lmforge.serve.app import build_app
from lmforge.serve.config import ServerConfig
from lmforge.serve.metrics import EngineCollector
from lmforge.serve.testing import ServerThread, free_port


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_hf_model("llama", tmp_path_factory.mktemp("target"), seed=1, dtype=torch.float32)


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """A draft that rarely agrees with the target (another random model, same vocabulary)."""
    return save_hf_model("llama", tmp_path_factory.mktemp("draft"), seed=7, dtype=torch.float32, hidden_size=32,
                         layers=1)


def _prompts(seed: int = 0) -> list[list[int]]:
    """Repetitive prompts (copied spans: ngram lookups hit), a shared prefix (prefix-cache hits) and a
    random one."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(3, 256) for _ in range(n)]  # noqa: E731
    span, shared = tok(12), tok(40)
    return [span * 4, tok(5) + span * 3 + tok(3), shared + span * 2, shared + tok(7) + span, tok(30), [5, 6] * 20]


def _run(model, requests, **cfg) -> tuple[list[list[list[int]]], dict]:
    """Each request's samples' token ids, and the engine's stats."""
    engine = LLMEngine(EngineConfig(model=str(model), **cfg))
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = [o.token_ids for o in out.outputs]
    return [outs[str(i)] for i in range(len(requests))], engine.stats()


def _greedy(max_tokens=(40, 3, 25, 17, 12, 30), **extra):
    return [(p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, **extra))
            for p, m in zip(_prompts(), max_tokens)]


@pytest.mark.parametrize("cfg", [
    dict(num_kv_blocks=200),
    dict(num_kv_blocks=14, block_size=8),  # preemptions: the pool holds ~2 sequences
    dict(num_kv_blocks=200, max_num_batched_tokens=24, enable_prefix_caching=False),  # chunked prefill, drafts cut
])
def test_ngram_greedy_is_the_plain_engine_token_for_token(target, cfg):
    requests = _greedy()
    plain, plain_stats = _run(target, requests, **cfg)
    spec, stats = _run(target, requests, speculative_method="ngram", num_speculative_tokens=4, **cfg)
    assert spec == plain
    assert stats["spec_decode_num_drafts"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["steps"] < plain_stats["steps"]  # several tokens per step where drafts were accepted
    if cfg["num_kv_blocks"] == 14:
        assert stats["preemptions"] > 0
    per_pos = stats["spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) == 4 and sum(per_pos) == stats["spec_decode_num_accepted_tokens"]
    assert per_pos == sorted(per_pos, reverse=True)  # position i accepted only if i-1 was


def test_max_tokens_is_never_overrun_and_n_samples_match(target):
    """max_tokens 1..6 with K = 5 (drafts capped, then cut mid-verification by max_tokens), and n = 2."""
    requests = [(_prompts()[0], SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, n=2))
                for m in range(1, 7)]
    plain, _ = _run(target, requests, num_kv_blocks=200)
    spec, _ = _run(target, requests, num_kv_blocks=200, speculative_method="ngram", num_speculative_tokens=5)
    assert spec == plain
    assert [len(s[0]) for s in spec] == list(range(1, 7))


@pytest.mark.parametrize("draft", ["self", "other"])
def test_draft_model_greedy_is_the_plain_engine(target, other, draft):
    """A draft equal to the target accepts everything; a random one almost nothing: same tokens either way."""
    model = target if draft == "self" else other
    requests = _greedy()
    plain, _ = _run(target, requests, num_kv_blocks=60, block_size=8)
    spec, stats = _run(target, requests, num_kv_blocks=60, block_size=8, speculative_model=str(model),
                       num_speculative_tokens=3)
    assert spec == plain
    rate = stats["spec_decode_acceptance_rate"]
    assert rate > 0.95 if draft == "self" else rate < 0.5
    assert stats["spec_decode_method"] == "draft" and stats["spec_decode_num_drafts"] > 0


def test_requests_that_need_more_than_the_logits_fall_back(target):
    """Penalties, logit_bias and logprobs decode plainly (no drafts counted) and equal the plain engine."""
    requests = [(_prompts()[0], SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3)),
                (_prompts()[1], SamplingParams(temperature=0, max_tokens=20, logit_bias={7: 5.0})),
                (_prompts()[5], SamplingParams(temperature=0, max_tokens=20, logprobs=2))]
    plain, _ = _run(target, requests, num_kv_blocks=200)
    spec, stats = _run(target, requests, num_kv_blocks=200, speculative_method="ngram", num_speculative_tokens=4)
    assert spec == plain and stats["spec_decode_num_drafts"] == 0


def test_stop_strings_and_eos_end_a_verification_midway(chat_model_dir):
    """With text: a stop string or EOS inside the accepted drafts ends the sequence there, as plain."""
    text = "the cat sat on the mat. the cat sat on the mat. the cat sat on the"
    requests = [(text, SamplingParams(temperature=0, max_tokens=30, stop=stop)) for stop in ([], ["mat"], [" on"])]
    engines = [LLMEngine(EngineConfig(model=str(chat_model_dir), num_kv_blocks=100, **cfg))
               for cfg in ({}, dict(speculative_method="ngram", num_speculative_tokens=4))]
    results = []
    for engine in engines:
        for i, (prompt, params) in enumerate(requests):
            engine.add_request(str(i), prompt, params)
        outs = {}
        while engine.has_unfinished_requests():
            outs.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
        results.append([(outs[str(i)].text, outs[str(i)].token_ids, outs[str(i)].finish_reason) for i in range(3)])
    assert results[0] == results[1]


def test_ngram_proposer_takes_the_most_recent_longest_match():
    p = NgramProposer(min_n=1, max_n=3)
    assert p.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2) == [7, 8]  # 3-gram, most recent occurrence
    assert p.propose([4, 5, 6, 5], 3) == [6, 5, 6]  # 1-gram; what follows, then the copy copies itself
    assert p.propose([7, 7, 7], 4) == [7, 7, 7, 7]  # a loop of period 1 proposes K tokens
    assert p.propose([1, 2, 3], 4) == []
    assert NgramProposer(min_n=2, max_n=3).propose([1, 2, 3, 1], 2) == []  # no 2-gram repeats


def test_greedy_accept():
    assert greedy_accept([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert greedy_accept([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert greedy_accept([5], [4, 3]) == [4]


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_rejection_sampling_keeps_the_target_distribution(draft):
    """V = 5, K = 2, a context-free target (row i = p_i whatever came before): the first two emitted
    tokens must be distributed as p_0 x p_1 whatever the draft proposes. 24 cells, 12,000 draws; the
    chi-square 0.999 quantile at 23 degrees of freedom is 49.7 (a wrong rule, e.g. always accepting,
    scores in the thousands). The acceptance rate of the first draft must be sum(min(p, q))."""
    gen = torch.Generator().manual_seed(0)
    p_KV = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.1, 0.0, 0.3, 0.4, 0.2], [0.2, 0.2, 0.2, 0.2, 0.2]],
                        dtype=torch.float64)
    q_KV = torch.tensor([[0.1, 0.6, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.0, 0.25]], dtype=torch.float64)
    counts, accepted, N = torch.zeros(5, 5, dtype=torch.float64), 0, 12_000
    for _ in range(N):
        if draft == "model":
            d = [int(torch.multinomial(q_KV[i], 1, generator=gen)) for i in range(2)]
            kept = rejection_sample(d, p_KV, q_KV, gen)
        else:  # ngram: fixed proposals, q one-hot
            d = [1, 3]
            kept = rejection_sample(d, p_KV, None, gen)
        accepted += kept[0] == d[0] and len(kept) > 1
        if len(kept) == 1:  # the first draft was rejected: the next token is the bonus-free next step
            kept.append(int(torch.multinomial(p_KV[1], 1, generator=gen)))
        counts[kept[0], kept[1]] += 1
    joint = torch.outer(p_KV[0], p_KV[1])
    assert _chi_square(counts.flatten(), joint.flatten()) < 49.7
    q0 = q_KV[0] if draft == "model" else torch.nn.functional.one_hot(torch.tensor(1), 5).double()
    expected_rate = float(torch.minimum(p_KV[0], q0).sum())
    assert abs(accepted / N - expected_rate) < 4 * (expected_rate * (1 - expected_rate) / N) ** 0.5


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampled_requests_speculate_and_stay_seeded(target, method):
    """Sampled rows speculate too (drafts counted); a seeded request gives the same tokens on a rerun. A
    draft equal to the target has q = p, so min(1, p/q) accepts (almost: the two forwards round apart)
    every draft."""
    requests = [(p, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=3, ignore_eos=True))
                for p in _prompts()[:3]]
    spec = dict(speculative_method="ngram", ngram_prompt_lookup_min=1) if method == "ngram" else dict(
        speculative_model=str(target))
    cfg = dict(num_kv_blocks=200, num_speculative_tokens=4, **spec)
    a, stats = _run(target, requests, **cfg)
    b, _ = _run(target, requests, **cfg)
    assert a == b and stats["spec_decode_num_drafts"] > 0
    assert all(len(s[0]) == 20 for s in a)
    if method == "draft":
        assert stats["spec_decode_acceptance_rate"] > 0.9


@pytest.mark.parametrize("cfg, field", [
    (dict(speculative_method="ngram"), "num_speculative_tokens"),
    (dict(speculative_method="eagle", num_speculative_tokens=2), "speculative_method"),
    (dict(speculative_method="draft", num_speculative_tokens=2), "speculative_model"),
    (dict(speculative_method="ngram", num_speculative_tokens=2, ngram_prompt_lookup_min=5), "ngram_prompt_lookup_min"),
])
def test_config_is_checked(cfg, field):
    with pytest.raises(ValueError, match=f"EngineConfig.{field}"):
        EngineConfig(model="x", **cfg)


def test_draft_with_another_vocabulary_is_refused(target, tmp_path):
    draft = save_hf_model("llama", tmp_path / "d", vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary of 300 tokens"):
        LLMEngine(EngineConfig(model=str(target), num_kv_blocks=20, speculative_model=str(draft),
                               num_speculative_tokens=2))


# ---- issue 43: the flags checked against the model before anything serves; drafts freed ---------------------


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmforge.cli", "serve", *args, "--port", str(free_port())],
                          capture_output=True, text=True, timeout=60)


def test_serve_checks_the_speculative_flags_against_the_model(target, tmp_path):
    """Each was an exit 1 with a traceback after the port opened, or (k = 1000 on a 512 context) accepted."""
    other_vocab = save_hf_model("llama", tmp_path / "d", vocab_size=300)
    for args, flag, says in (
            (["--speculative-model", str(other_vocab), "--num-speculative-tokens", "2"], "--speculative-model",
             "vocabulary of 300 tokens"),
            (["--speculative-model", str(tmp_path / "missing"), "--num-speculative-tokens", "2"], "--speculative-model",
             "no config.json"),
            (["--speculative-method", "ngram", "--num-speculative-tokens", "1000", "--max-model-len", "512"],
             "--num-speculative-tokens", "512-token context")):
        r = _serve(str(target), *args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and flag in lines[0] and says in lines[0], r.stderr[-2000:]


def test_the_engine_refuses_more_drafts_than_its_context_holds(target):
    with pytest.raises(ValueError, match="num_speculative_tokens=1000"):
        LLMEngine(EngineConfig(model=str(target), num_kv_blocks=20, max_model_len=512, speculative_method="ngram",
                               num_speculative_tokens=1000))


def test_drafts_are_freed_when_a_request_finishes_or_is_abandoned(target, other):
    engine = LLMEngine(EngineConfig(model=str(target), num_kv_blocks=64, speculative_model=str(other),
                                    num_speculative_tokens=8))
    pool = engine.spec.draft.block_manager
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request("left", list(range(3, 60)), params)
    engine.add_request("done", list(range(3, 20)), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert pool.num_free_blocks < 64  # both are drafting
    engine.abort_request("left")  # its client went away
    while engine.has_unfinished_requests():
        engine.step()
    assert pool.num_free_blocks == 64 and not engine.scheduler.running


def test_metrics_export_vllm_spec_decode_names():
    stats = dict(num_requests_running=0, num_requests_waiting=0, kv_blocks_in_use=0, kv_blocks_total=1,
                 preemptions=0, prefix_cache_queries=0, prefix_cache_hits=0, spec_decode_num_drafts=10,
                 spec_decode_num_draft_tokens=40, spec_decode_num_accepted_tokens=25,
                 spec_decode_num_accepted_tokens_per_pos=[9, 8, 5, 3])
    families = {f.name: f for f in EngineCollector(lambda: {"v1": stats}, "m").collect()}
    assert families["vllm:spec_decode_num_drafts"].samples[0].value == 10
    assert families["vllm:spec_decode_num_draft_tokens"].samples[0].value == 40
    assert families["vllm:spec_decode_num_accepted_tokens"].samples[0].value == 25
    per_pos = families["vllm:spec_decode_num_accepted_tokens_per_pos"].samples
    assert [(s.labels["position"], s.value) for s in per_pos] == [("0", 9), ("1", 8), ("2", 5), ("3", 3)]
    plain = dict(stats)
    for k in [k for k in plain if k.startswith("spec_decode")]:
        del plain[k]
    assert not any("spec_decode" in f.name for f in EngineCollector(lambda: {"v1": plain}, "m").collect())


def test_openai_client_greedy_is_identical_with_speculation_on_and_off(chat_model_dir):
    """Through the `openai` client: the same greedy completions (plain and streamed) from a server that
    speculates (ngram, K = 4) and one that does not; /metrics carries vLLM's spec_decode counters."""
    prompts = ["the cat sat on the mat. the cat sat on the mat. the cat", "def f(x):\n    return x\ndef f(x):\n"]
    texts = []
    for spec in ({}, dict(speculative_method="ngram", num_speculative_tokens=4)):
        engine = AsyncLLMEngine(EngineConfig(model=str(chat_model_dir), dtype="float32", max_model_len=256, **spec))
        try:
            with ServerThread(build_app(engine, ServerConfig("tiny"))) as srv:
                client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
                got = [client.completions.create(model="tiny", prompt=p, max_tokens=24, temperature=0).choices[0].text
                       for p in prompts]
                stream = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=24, temperature=0,
                                                   stream=True)
                got.append("".join(c.choices[0].text for c in stream))
                metrics = httpx.get(srv.url + "/metrics").text
        finally:
            engine.shutdown()
        texts.append(got)
        assert ("vllm:spec_decode_num_drafts_total" in metrics) == bool(spec)
    assert texts[0] == texts[1] and texts[1][0] == texts[1][2]


def test_bench_spec_decode_reports_every_system_and_checks_identity(target):
    """`lmforge.bench.spec_decode` on a tiny model (float32): a row per workload x concurrency x system,
    every output the plain engine's, and the spec rows carry their acceptance."""
    report = bench_run(target, target, "float32", k=2, num_requests=1, concurrency=2, max_tokens=8, seed=0)
    rows = report["rows"]
    assert len(rows) == 2 * 2 * 3 and all(r["identical"] for r in rows)
    assert all("acceptance_rate" in r for r in rows if r["system"] != "plain")
    assert all(r["output_tokens"] == 8 * r["concurrency"] for r in rows if r["concurrency"] == 2)
    md = to_markdown({**report, "provenance": {"date": "d", "threads": 1, "load_average": None},
                      "load_average_after": None})
    assert md.count("| code-edit |") == 6
