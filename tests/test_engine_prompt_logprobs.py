"""Prompt logprobs (`SamplingParams.prompt_logprobs`, vLLM's): computed in the prefill forward, equal to
`transformers`' log_softmax at every prompt position, whatever the chunking, the prefix cache, the batch or
a preemption; `RequestOutput.prompt_logprobs` in vLLM's shape.

    python -m pytest -q tests/test_engine_prompt_logprobs.py
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_models import save_hf_model
from lmforge.engine import LLM, SamplingParams

PROMPT = [(7 * i + 3) % 250 + 2 for i in range(45)]  # 45 tokens: 3 blocks of 16 minus a few


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, one_thread):
    return save_hf_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def reference(model_dir):
    """transformers' log-probabilities of PROMPT, (T, V) float64 from its float32 logits."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def check(prompt_lps, ref_TV, k):
    assert len(prompt_lps) == len(PROMPT) and prompt_lps[0] is None
    for t in range(1, len(PROMPT)):
        entry, row = prompt_lps[t], ref_TV[t - 1]
        assert entry[PROMPT[t]].logprob == pytest.approx(row[PROMPT[t]].item(), abs=1e-5)
        assert entry[PROMPT[t]].rank == int((row >= row[PROMPT[t]]).sum())
        top = row.topk(k).indices.tolist()
        assert set(entry) == {PROMPT[t], *top}
        assert [entry[i].rank for i in top] == list(range(1, k + 1)) or PROMPT[t] in top


@pytest.mark.parametrize("chunk", [2048, 16, 7])
def test_equal_to_transformers_whatever_the_chunking(model_dir, reference, chunk):
    llm = LLM(str(model_dir), device="cpu", dtype="float32", max_num_batched_tokens=chunk, block_size=4)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3), use_tqdm=False)[0]
    check(out.prompt_logprobs, reference, 3)
    plain = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None
    assert plain.outputs[0].token_ids == out.outputs[0].token_ids  # asking changes nothing else


def test_a_cached_prefix_is_computed_again(model_dir, reference):
    llm = LLM(str(model_dir), device="cpu", dtype="float32", block_size=4)
    warm = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    assert warm.num_cached_tokens == 0
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0  # the cache was not read: every position went through the model
    check(out.prompt_logprobs, reference, 0)
    again = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    assert again.num_cached_tokens == 44  # ... and what it computed is cached for the others


def test_batched_with_others_n2_and_preempted(model_dir, reference):
    # a pool of 14 blocks of 4 tokens: the prompt needs 12, so the batch preempts and recomputes
    llm = LLM(str(model_dir), device="cpu", dtype="float32", block_size=4, num_kv_blocks=14,
              max_num_batched_tokens=16)
    params = [SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=2, n=2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]
    outs = llm.generate([PROMPT, PROMPT[:20]], params, use_tqdm=False)
    check(outs[0].prompt_logprobs, reference, 2)
    assert outs[1].prompt_logprobs is None
    assert llm.stats()["preemptions"] > 0


def test_out_of_range_is_refused():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
