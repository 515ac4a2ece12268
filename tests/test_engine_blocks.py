"""BlockManager + Scheduler without a model: block accounting under random arrivals, aborts and
preemptions (hypothesis), the prefix cache's verification and LRU, and upfront rejections.

    python -m pytest -q tests/test_engine_blocks.py
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmforge.engine import block_manager as bm_module
from lmforge.engine.block_manager import BlockManager
from lmforge.engine.sampling_params import SamplingParams
from lmforge.engine.scheduler import Scheduler
from lmforge.engine.sequence import Sequence


def new_seq(rid: str, prompt: list[int], max_tokens: int) -> Sequence:
    return Sequence(rid, 0, prompt, SamplingParams(max_tokens=max_tokens), max_tokens)


def fake_step(sched: Scheduler, rng: random.Random) -> None:
    """What the engine does after a forward, with random tokens instead of a model."""
    scheduled = sched.schedule()
    sampling = [s.seq for s in scheduled if s.samples]
    sched.update(scheduled)
    for seq in sampling:
        seq.append_token(rng.randrange(4), 0.0)  # tiny vocabulary: many repeated blocks, many hits
        if seq.num_output_tokens >= seq.max_tokens:
            sched.finish(seq, "length")


def check_invariants(bm: BlockManager, sched: Scheduler) -> None:
    refs = [0] * bm.num_blocks
    for seq in sched.running:
        assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens
        for b in seq.block_table:
            refs[b] += 1
    for seq in sched.waiting:
        assert seq.block_table == [] and seq.num_computed_tokens == 0
    for block in bm.blocks:
        assert block.ref_count == refs[block.block_id] >= 0, "leaked or double-counted block"
        assert (block.ref_count == 0) == (block.block_id in bm.free)
    for h, b in bm.hash_to_block.items():
        assert bm.blocks[b].hash == h


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), num_blocks=st.integers(8, 40), block_size=st.sampled_from([1, 2, 4, 16]),
       budget=st.integers(1, 64), max_seqs=st.integers(1, 8), caching=st.booleans())
def test_block_accounting(seed, num_blocks, block_size, budget, max_seqs, caching):
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, block_size, caching)
    sched = Scheduler(bm, max_seqs, budget)
    capacity = num_blocks * block_size
    seqs, n = [], 0
    for _ in range(60):
        if rng.random() < 0.3:
            max_tokens = rng.randint(1, 12)
            prompt = [rng.randrange(4) for _ in range(rng.randint(1, max(1, min(40, capacity - max_tokens))))]
            if len(prompt) + max_tokens <= capacity:  # the engine refuses the rest upfront
                seqs.append(new_seq(str(n), prompt, max_tokens))
                sched.add(seqs[-1])
                n += 1
        if seqs and rng.random() < 0.05:
            sched.finish(rng.choice(seqs), "abort")
        if sched.has_unfinished():
            fake_step(sched, rng)
        check_invariants(bm, sched)
    while sched.has_unfinished():
        fake_step(sched, rng)
        check_invariants(bm, sched)
    assert bm.num_free_blocks == num_blocks  # every block free or cached-free
    assert all(b.ref_count == 0 for b in bm.blocks)


def run_to_end(sched: Scheduler, seq: Sequence) -> None:
    sched.add(seq)
    rng = random.Random(0)
    while sched.has_unfinished():
        fake_step(sched, rng)


def test_prefix_hit_reuses_blocks_and_computes_last_token():
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, 8, 64)
    run_to_end(sched, new_seq("a", list(range(12)), 1))  # 3 full blocks cached
    b = new_seq("b", list(range(12)), 1)  # same 12 tokens: the block holding token 11 is recomputed
    sched.add(b)
    scheduled = sched.schedule()
    assert b.num_computed_tokens == 8 and scheduled[0].num_new_tokens == 4
    assert bm.prefix_cache_hits == 8


def test_forced_hash_collision_is_not_served(monkeypatch):
    monkeypatch.setattr(bm_module, "block_hash", lambda parent, tokens: 42)  # every block collides
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, 8, 64)
    run_to_end(sched, new_seq("a", list(range(9)), 1))
    other = new_seq("b", list(range(100, 109)), 1)  # different tokens, same hash
    hits, _ = bm.match_prefix(other)
    assert hits == []
    same_tokens_other_parent = new_seq("c", [100, 101, 102, 103] + list(range(4, 9)), 1)
    assert bm.match_prefix(same_tokens_other_parent)[0] == []  # second block matches tokens, not parent


def test_lru_evicts_only_free_blocks():
    bm = BlockManager(4, 2)
    sched = Scheduler(bm, 8, 64)
    run_to_end(sched, new_seq("old", [1, 2, 3], 1))  # caches block [1, 2]
    run_to_end(sched, new_seq("new", [5, 6, 7], 1))  # caches block [5, 6]
    holder = new_seq("holder", [5, 6, 9], 4)
    sched.add(holder)
    sched.schedule()  # holds [5, 6] (a hit) and one fresh block
    assert bm.blocks[holder.block_table[0]].token_ids == (5, 6)
    taker = new_seq("taker", [7, 7, 7], 1)  # needs both free blocks: evicts cached [1, 2], not held [5, 6]
    sched.add(taker)
    sched.schedule()
    assert taker.block_table and not set(holder.block_table) & set(taker.block_table)
    assert bm.match_prefix(new_seq("x", [1, 2, 3], 1))[0] == []  # evicted
    assert bm.match_prefix(new_seq("y", [5, 6, 3], 1))[0] == [holder.block_table[0]]  # still cached


def test_rejects_requests_that_can_never_fit(tmp_path):
    from hf_models import save_hf_model
    from lmforge.engine import EngineConfig, LLMEngine

    save_hf_model("llama", tmp_path)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), device="cpu", max_model_len=64, num_kv_blocks=3,
                                    block_size=16))
    with pytest.raises(ValueError, match=r"prompt \(60 tokens\) \+ max_tokens \(8\) = 68 > max_model_len \(64\)"):
        engine.add_request("a", list(range(3, 63)), SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match=r"need 4 KV blocks of 16, the pool has 3"):
        engine.add_request("b", list(range(3, 53)), SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.add_request("c", "hello", SamplingParams())
    assert not engine.has_unfinished_requests()
