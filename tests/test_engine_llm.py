"""The offline `LLM` API as users call it: n > 1, seeds, end conditions, outputs and stats.

    python -m pytest -q tests/test_engine_llm.py
"""

from __future__ import annotations

import pytest
import torch

from hf_models import save_hf_model
from lmforge.engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM(str(save_hf_model("llama", tmp_path_factory.mktemp("llama"))), device="cpu", block_size=4)
    torch.set_num_threads(n)


def test_n_samples_share_the_prompt_and_seeds_reproduce(llm):
    prompt = list(range(3, 40))
    p = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    before = llm.stats()["prefix_cache_hits"]
    a = llm.generate([prompt], p, use_tqdm=False)[0]
    b = llm.generate([prompt], p, use_tqdm=False)[0]
    assert [o.index for o in a.outputs] == [0, 1, 2]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1  # seed + i differ
    assert llm.stats()["prefix_cache_hits"] - before >= 2 * 36  # samples 1, 2 reuse sample 0's blocks
    assert llm.stats()["kv_blocks_in_use"] == 0


def test_end_conditions_and_outputs(llm):
    prompt = [5, 6, 7, 8]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    ids = free.outputs[0].token_ids
    stop_at = ids[3]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                               stop_token_ids=[stop_at]), use_tqdm=False)[0]
    first = ids.index(stop_at)
    assert out.outputs[0].token_ids == ids[:first + 1] and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop_at
    late = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, min_tokens=first + 2,
                                                stop_token_ids=[stop_at]), use_tqdm=False)[0]
    assert len(late.outputs[0].token_ids) > first + 1  # min_tokens: no stop before
    lp = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, logprobs=2), use_tqdm=False)[0]
    o = lp.outputs[0]
    assert len(o.logprobs) == len(o.token_ids) and all(t in d for t, d in zip(o.token_ids, o.logprobs))
    assert o.cumulative_logprob == pytest.approx(sum(d[t] for t, d in zip(o.token_ids, o.logprobs)))
    m = lp.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time


def test_mixed_prompts_in_input_order_and_errors(llm):
    outs = llm.generate([[9, 9, 9], [4]], [SamplingParams(max_tokens=3, ignore_eos=True),
                                           SamplingParams(max_tokens=1)], use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [[9, 9, 9], [4]]
    assert [o.outputs[0].text for o in outs] == ["", ""]  # no tokenizer files: ids only
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["hello"], use_tqdm=False)
    with pytest.raises(ValueError, match="2 prompts but 3"):
        llm.generate([[1], [2]], [SamplingParams()] * 3, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    s = llm.stats()
    assert {"steps", "preemptions", "prefix_cache_queries", "prefix_cache_hits", "kv_blocks_total",
            "kv_blocks_in_use", "kv_utilization_avg", "tokens_processed"} <= set(s)
    assert 0 < s["kv_utilization_avg"] <= 1


def test_packed_bf16_linears_give_the_same_tokens(tmp_path, one_thread):
    """CPU bfloat16: the engine reorders linear weights once for oneDNN (`pack_weights`); the greedy
    tokens and logprobs equal the unpacked engine's (the same matmul, without the per-call reorder)."""
    from lmforge.engine.model_runner import PackedLinear, can_pack_linear

    model_dir = str(save_hf_model("qwen2", tmp_path))  # q/k/v biases too
    prompts = [list(range(3, 3 + n)) for n in (1, 9, 40, 70)]
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    runs = []
    for pack in (True, False):
        llm = LLM(model_dir, dtype="bfloat16", device="cpu", block_size=4, pack_weights=pack)
        runner = llm.llm_engine.model_runner
        packed = [m for m in runner.model.modules() if isinstance(m, PackedLinear)]
        if pack and can_pack_linear(torch.device("cpu"), torch.bfloat16):
            c = runner.model.config
            # q/k/v and gate/up are one packed linear each when the kernels fuse them (engine.fused)
            per_layer = 4 if runner.fused_projections else 7
            assert runner.packed_linears == len(packed) == per_layer * c.num_hidden_layers + 1  # + lm_head
        else:
            assert runner.packed_linears == len(packed) == 0
        runs.append([(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob)
                     for o in llm.generate(prompts, p, use_tqdm=False)])
    assert runs[0] == runs[1]


def test_one_load_tokenizer_for_the_engine_and_the_pipeline(llm, tmp_path, monkeypatch):
    """The engine's twin returned None for a folder without tokenizer files, the pipeline's raised:
    the one `load_tokenizer` raises unless the caller says the tokenizer is optional (the engine does,
    and then serves token-id prompts). A folder with any tokenizer file is loaded by both callers."""
    from lmforge.tokenizer.load import TOKENIZER_FILES, load_tokenizer

    model_dir = llm.llm_engine.config.model
    assert load_tokenizer(model_dir, optional=True) is None and llm.llm_engine.tokenizer is None
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(model_dir)
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    import transformers

    loaded = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda d: loaded.append(d) or d)
    for name in TOKENIZER_FILES:  # a Hugging Face folder with any one of them (slow files only too): loaded
        folder = tmp_path / name.replace(".", "_")
        folder.mkdir()
        (folder / name).write_text("{}")
        assert load_tokenizer(folder) == load_tokenizer(folder, optional=True) == str(folder)
    assert len(loaded) == 2 * len(TOKENIZER_FILES)
