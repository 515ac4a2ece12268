"""Sampler: logit processing against `transformers`' own processors, sampling statistics,
batch-invariant seeds, raw logprobs. Random logits on CPU; the file runs in a few seconds.

    python -m pytest -q tests/test_engine_sampler.py
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from lmforge.engine.sampler import Sampler, SampleResult, make_generator
from lmforge.engine.sampling_params import SamplingParams

V = 64
EOS = 3


@dataclass
class Seq:
    """The attributes the Sampler reads from the engine's Sequence."""
    sampling_params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


def hf_reference(logits_V: torch.Tensor, seq: Seq, eos: list[int]) -> torch.Tensor:
    """One row through HF's processors, in generate()'s order."""
    p = seq.sampling_params
    ids_1L = torch.tensor([seq.prompt_token_ids + seq.output_token_ids])
    scores = logits_V.unsqueeze(0).clone()
    stops = list(p.stop_token_ids) + ([] if p.ignore_eos else eos)
    if p.min_tokens and stops:
        min_new = MinNewTokensLengthLogitsProcessor(len(seq.prompt_token_ids), p.min_tokens, stops)
        scores = min_new(ids_1L, scores)
    if p.logit_bias:
        scores = SequenceBiasLogitsProcessor([[[t], b] for t, b in p.logit_bias.items()])(ids_1L, scores)
    if p.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids_1L, scores)
    if p.greedy:
        return scores[0]
    if p.temperature != 1.0:
        scores = TemperatureLogitsWarper(p.temperature)(ids_1L, scores)
    if p.top_k:
        scores = TopKLogitsWarper(p.top_k)(ids_1L, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(ids_1L, scores)
    if p.min_p > 0.0:
        scores = MinPLogitsWarper(p.min_p)(ids_1L, scores)
    return scores[0]


def random_seq(g: torch.Generator, **overrides) -> Seq:
    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]
    fields = dict(temperature=pick([0.0, 0.5, 1.0, 1.7]), top_k=pick([0, 1, 5, 20]),
                  top_p=pick([1.0, 0.9, 0.5, 0.05]),
                  min_p=pick([0.0, 0.05, 0.3]), repetition_penalty=pick([1.0, 1.3, 0.8]),
                  min_tokens=pick([0, 0, 4]), stop_token_ids=pick([[], [7, 9]]), ignore_eos=pick([False, True]),
                  logit_bias=pick([None, None, {5: 3.0, 11: -2.5, 40: 100.0}, {"7": -100}]))
    fields.update(overrides)
    prompt = torch.randint(V, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
    output = torch.randint(V, (int(torch.randint(0, 8, (1,), generator=g)),), generator=g).tolist()
    return Seq(SamplingParams(**fields), prompt, output)


def test_process_logits_matches_transformers_processors():
    g = torch.Generator().manual_seed(0)
    sampler = Sampler(eos_token_ids=[EOS])
    for trial in range(20):
        seqs = [random_seq(g) for _ in range(16)]
        logits_SV = torch.randn(16, V, generator=g) * 3
        ours_SV = sampler.process_logits(logits_SV, seqs)
        for i, seq in enumerate(seqs):
            ref_V = hf_reference(logits_SV[i], seq, [EOS])
            same_allowed = torch.equal(torch.isfinite(ours_SV[i]), torch.isfinite(ref_V))
            assert same_allowed, (trial, i, seq.sampling_params)
            if seq.sampling_params.greedy:
                assert ours_SV[i].argmax() == ref_V.argmax()
            else:
                torch.testing.assert_close(ours_SV[i].softmax(-1), ref_V.softmax(-1), atol=1e-6, rtol=0)


def test_presence_and_frequency_penalties_by_hand():
    logits_SV = torch.randn(2, V, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25)
    seqs = [Seq(params, prompt_token_ids=[1, 2], output_token_ids=[5, 5, 5, 6]),
            Seq(SamplingParams(temperature=0))]
    out_SV = Sampler().process_logits(logits_SV, seqs)
    expected_V = logits_SV[0].clone()
    expected_V[5] -= 0.5 + 0.25 * 3
    expected_V[6] -= 0.5 + 0.25 * 1  # prompt tokens 1, 2 are not penalized
    torch.testing.assert_close(out_SV[0], expected_V)
    torch.testing.assert_close(out_SV[1], logits_SV[1])


def test_min_tokens_suppresses_eos_and_stop_tokens_then_releases_them():
    logits_SV = torch.zeros(1, V)
    logits_SV[0, EOS] = logits_SV[0, 9] = 100.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[9])
    sampler = Sampler(eos_token_ids=[EOS])
    assert sampler(logits_SV, [Seq(params, [1], [4])])[0].token_id not in (EOS, 9)
    assert sampler(logits_SV, [Seq(params, [1], [4, 4])])[0].token_id in (EOS, 9)
    ignore = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    # ignore_eos: EOS is an ordinary token.
    assert sampler(logits_SV, [Seq(ignore, [1], [])])[0].token_id == EOS


def test_greedy_is_argmax_and_degenerate_filters_are_greedy():
    g = torch.Generator().manual_seed(2)
    logits_SV = torch.randn(8, V, generator=g)
    argmax = logits_SV.argmax(-1).tolist()
    sampler = Sampler()
    for params in [SamplingParams(temperature=0.0), SamplingParams(top_k=1), SamplingParams(top_p=1e-6),
                   SamplingParams(temperature=0.0, logprobs=2)]:
        assert [r.token_id for r in sampler(logits_SV, [Seq(params) for _ in range(8)])] == argmax, params
    mixed = [Seq(SamplingParams(temperature=0.0) if i % 2 else SamplingParams()) for i in range(8)]
    tokens = [r.token_id for r in sampler(logits_SV, mixed)]
    assert tokens[1::2] == argmax[1::2]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=4),
                                    SamplingParams(top_p=0.8, min_p=0.05)])
def test_sampled_frequencies_match_the_processed_distribution(params):
    torch.manual_seed(3)
    logits_V = torch.randn(12) * 1.5
    n = 40_000
    seqs = [Seq(params) for _ in range(n)]
    sampler = Sampler()
    expected_V = sampler.process_logits(logits_V.unsqueeze(0), seqs[:1])[0].softmax(-1)
    tokens = torch.tensor([r.token_id for r in sampler(logits_V.expand(n, -1), seqs)])
    observed_V = torch.bincount(tokens, minlength=12).float() / n
    assert (observed_V[expected_V == 0] == 0).all()  # filtered tokens are never drawn
    # 4.5 standard errors per token: a false alarm is ~1e-5 per token.
    sigma_V = (expected_V * (1 - expected_V) / n).sqrt()
    assert ((observed_V - expected_V).abs() <= 4.5 * sigma_V + 1e-9).all(), (observed_V, expected_V)


def decode_steps(sampler: Sampler, target: Seq, others: list[Seq], position: int, steps: int,
                 g: torch.Generator) -> list[int]:
    """Sample `steps` tokens for `target` at batch `position` among fresh random rows."""
    for _ in range(steps):
        batch = others[:position] + [target] + others[position:]
        logits_SV = torch.randn(len(batch), V, generator=g)
        logits_SV[position] = torch.linspace(-1, 1, V)  # the target sees the same logits every run
        target.output_token_ids.append(sampler(logits_SV, batch)[position].token_id)
    return target.output_token_ids


def test_seeded_request_is_independent_of_its_batch():
    sampler = Sampler()
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    g = torch.Generator().manual_seed(4)

    def run(position: int, n_others: int, seed: int = 1234) -> list[int]:
        target = Seq(params, [1, 2, 3], [], make_generator(seed, 0, "cpu"))
        others = [Seq(SamplingParams(temperature=float(t)), [5], [], make_generator(int(t * 10), 0, "cpu")
                      if t % 2 else None) for t in torch.randint(1, 4, (n_others,), generator=g)]
        return decode_steps(sampler, target, others, position, 12, g)

    alone = run(0, 0)
    assert run(0, 5) == alone
    assert run(3, 7) == alone
    assert run(9, 9) == alone
    assert run(0, 0, seed=99) != alone
    # n > 1: sample i uses seed + i, so the samples differ from each other but each reproduces.
    assert make_generator(1234, 1, "cpu").initial_seed() == 1235
    assert make_generator(None, 0, "cpu") is None


def test_logprobs_are_raw_log_softmax_with_sorted_top_entries():
    g = torch.Generator().manual_seed(5)
    logits_SV = torch.randn(3, V, generator=g) * 2
    seqs = [Seq(SamplingParams(temperature=0.5, repetition_penalty=1.5, logprobs=5), [1, 2], [2]),
            Seq(SamplingParams(temperature=0.0)),
            Seq(SamplingParams(logprobs=0))]
    results = Sampler()(logits_SV, seqs)
    raw_SV = torch.log_softmax(logits_SV, dim=-1)
    assert isinstance(results[0], SampleResult)
    for i in (0, 2):
        r = results[i]
        assert r.logprob == pytest.approx(raw_SV[i, r.token_id].item(), abs=1e-6)
    top = results[0].top_logprobs
    values, ids = raw_SV[0].topk(5)
    assert list(top) == ids.tolist()
    assert list(top.values()) == pytest.approx(values.tolist(), abs=1e-6)
    assert list(top.values()) == sorted(top.values(), reverse=True)
    assert results[1].logprob is None and results[1].top_logprobs is None
    assert results[2].top_logprobs == {}


def test_fast_path_and_input_checks():
    logits_SV = torch.randn(4, V, dtype=torch.bfloat16)
    results = Sampler()(logits_SV, [Seq(SamplingParams(temperature=0.0)) for _ in range(4)])
    assert [r.token_id for r in results] == logits_SV.float().argmax(-1).tolist()
    assert all(r.logprob is None and r.top_logprobs is None for r in results)
    with pytest.raises(ValueError, match="one \\(S, V\\) row per"):
        Sampler()(logits_SV, [Seq(SamplingParams())])
    # Token ids beyond the lm_head (embedding table padded larger) are ignored, as in HF.
    seq = Seq(SamplingParams(repetition_penalty=2.0), [V + 5, 1])
    out_SV = Sampler().process_logits(torch.ones(1, V), [seq])
    assert out_SV[0, 1] == 0.5 and (out_SV[0, 2:] == 1).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_and_seeds_are_batch_invariant_on_cuda():
    g = torch.Generator().manual_seed(6)
    seqs = [random_seq(g) for _ in range(16)]
    logits_SV = torch.randn(16, V, generator=g) * 3
    sampler = Sampler(eos_token_ids=[EOS])
    cpu_SV = sampler.process_logits(logits_SV, seqs)
    cuda_SV = sampler.process_logits(logits_SV.cuda(), seqs).cpu()
    assert torch.equal(torch.isfinite(cpu_SV), torch.isfinite(cuda_SV))
    torch.testing.assert_close(cpu_SV.softmax(-1), cuda_SV.softmax(-1), atol=1e-5, rtol=0)
    params = SamplingParams(temperature=1.0, seed=7)
    logits_1V = torch.linspace(-1, 1, V, device="cuda").unsqueeze(0)
    alone = sampler(logits_1V, [Seq(params, generator=make_generator(7, 0, "cuda"))])[0].token_id
    batch_SV = torch.cat([torch.randn(5, V, device="cuda"), logits_1V])
    others = [Seq(SamplingParams()) for _ in range(5)]
    in_batch = sampler(batch_SV, others + [Seq(params, generator=make_generator(7, 0, "cuda"))])[-1].token_id
    assert alone == in_batch


def test_logit_bias_forces_and_bans_tokens_per_row_in_one_batch():
    g = torch.Generator().manual_seed(7)
    logits_SV = torch.randn(4, V, generator=g) * 5
    argmax = logits_SV.argmax(-1).tolist()
    forced = (argmax[0] + 1) % V
    seqs = [Seq(SamplingParams(temperature=0.0, logit_bias={forced: 100})),  # greedy: +100 forces it
            Seq(SamplingParams(temperature=0.0)),  # unbiased rows in the same batch are untouched
            Seq(SamplingParams(temperature=0.0, logit_bias={str(argmax[2]): -100})),  # JSON keys are strings
            Seq(SamplingParams(temperature=1.0, seed=1, logit_bias={forced: 100}),
                generator=make_generator(1, 0, "cpu"))]
    tokens = [r.token_id for r in Sampler()(logits_SV, seqs)]
    assert tokens[0] == forced and tokens[1] == argmax[1] and tokens[2] != argmax[2] and tokens[3] == forced
    out_SV = Sampler().process_logits(logits_SV, seqs[:3])
    torch.testing.assert_close(out_SV[0, forced], logits_SV[0, forced] + 100)
    torch.testing.assert_close(out_SV[1], logits_SV[1])


def test_logit_bias_leaves_logprobs_raw():
    logits_SV = torch.randn(1, V, generator=torch.Generator().manual_seed(8))
    r = Sampler()(logits_SV, [Seq(SamplingParams(temperature=0.0, logprobs=3, logit_bias={9: 100}))])[0]
    assert r.token_id == 9
    assert r.logprob == pytest.approx(torch.log_softmax(logits_SV[0], -1)[9].item(), abs=1e-6)


@pytest.mark.parametrize("bias, match", [({5: 1e30}, "logit_bias\\[5\\]=1e\\+30"),
                                         ({5: float("nan")}, "\\[-100, 100\\]"),
                                         ({"x": 1}, "key 'x' is not a token id"), ({-1: 1}, "token id -1"),
                                         ({i: 1 for i in range(301)}, "301 entries; at most 300"),
                                         ({5: True}, "must be a number"), ([5], "map of token id")])
def test_logit_bias_is_validated_not_clamped(bias, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(logit_bias=bias)
    assert SamplingParams(logit_bias={"5": 100, 6: -0.5}).logit_bias == {5: 100.0, 6: -0.5}
    assert SamplingParams(logit_bias={}).logit_bias is None


def test_token_mask_applies_before_everything_and_keeps_logprobs_raw():
    logits_SV = torch.randn(3, V, generator=torch.Generator().manual_seed(9)) * 4
    banned_SV = torch.ones(3, V, dtype=torch.bool)
    banned_SV[0, [10, 20]] = False
    banned_SV[1] = False  # row 1 is unconstrained
    banned_SV[2, 30] = False
    greedy = [Seq(SamplingParams(temperature=0.0)) for _ in range(3)]
    tokens = [r.token_id for r in Sampler()(logits_SV, greedy, banned_SV)]  # the plain-greedy fast path
    assert tokens == [10 if logits_SV[0, 10] > logits_SV[0, 20] else 20, logits_SV[1].argmax().item(), 30]
    # a +100 bias cannot take a row outside its grammar; sampled rows stay inside it too
    seqs = [Seq(SamplingParams(logprobs=1, logit_bias={5: 100})), Seq(SamplingParams()),
            Seq(SamplingParams(temperature=2.0, top_p=0.5))]
    for _ in range(20):
        results = Sampler()(logits_SV, seqs, banned_SV)
        assert results[0].token_id in (10, 20) and results[2].token_id == 30
    assert results[0].logprob == pytest.approx(torch.log_softmax(logits_SV[0], -1)[results[0].token_id].item(),
                                               abs=1e-6)


@dataclass
class WordsSeq(Seq):
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # what the engine encodes at admission


def test_allowed_token_ids_and_bad_words_mask_per_row():
    g = torch.Generator().manual_seed(11)
    logits_SV = torch.randn(4, V, generator=g) * 5
    best = logits_SV.argmax(-1).tolist()
    seqs = [WordsSeq(SamplingParams(temperature=0.0, allowed_token_ids=[7, 9])),
            WordsSeq(SamplingParams(temperature=0.0), bad_words_token_ids=[[best[1]]]),  # one token: always banned
            # two tokens: the second is banned only after the first
            WordsSeq(SamplingParams(temperature=0.0), output_token_ids=[5], bad_words_token_ids=[[5, best[2]]]),
            WordsSeq(SamplingParams(temperature=0.0), output_token_ids=[6], bad_words_token_ids=[[5, best[3]]])]
    tokens = [r.token_id for r in Sampler()(logits_SV, seqs)]
    assert tokens[0] == (7 if logits_SV[0, 7] >= logits_SV[0, 9] else 9)
    assert tokens[1] != best[1] and tokens[2] != best[2] and tokens[3] == best[3]
    sampled = [WordsSeq(SamplingParams(temperature=1.0, allowed_token_ids=[7, 9]))] * 2
    assert {r.token_id for _ in range(20) for r in Sampler()(logits_SV[:2], sampled)} <= {7, 9}
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["  "])
