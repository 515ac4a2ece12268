"""The fast paged attention (in-place views for one-run block tables, gathered buckets otherwise)
agrees with the per-sequence reference; the block manager keeps a sequence's blocks one run."""

import random

import pytest
import torch

from lmforge.engine.attention import PagedAttention, build_metadata
from lmforge.engine.block_manager import BlockManager
from lmforge.engine.sampling_params import SamplingParams
from lmforge.engine.sequence import Sequence


@pytest.mark.parametrize("contiguous", [True, False, None])  # None: a mix
def test_fast_matches_reference(contiguous):
    rng = random.Random(0)
    L, P, B, K, N, H = 2, 64, 4, 2, 4, 8
    attn = PagedAttention(L, P, B, K, H, torch.float64, torch.device("cpu"))
    for pool in attn.k_pools_PBKH + attn.v_pools_PBKH:
        pool.normal_()
    computed = [0, 3, 9, 17, 30, 5]  # a fresh prefill, decodes, a chunk over cached tokens
    q_lens = [7, 1, 1, 1, 1, 4]
    free = list(range(P))
    rng.shuffle(free)
    tables, nxt = [], 0
    for i, (c, q) in enumerate(zip(computed, q_lens)):
        m = -(-(c + q) // B)
        run = contiguous if contiguous is not None else i % 2 == 0
        tables.append(list(range(nxt, nxt + m)) if run else [free.pop() for _ in range(m)])
        if run:
            nxt += m
            free = [b for b in free if b >= nxt]
    T = sum(q_lens)
    q, k, v = torch.randn(1, T, N, H, dtype=torch.float64), torch.randn(1, T, K, H, dtype=torch.float64), \
        torch.randn(1, T, K, H, dtype=torch.float64)
    outs = []
    for reference in (False, True):
        attn.set_metadata(build_metadata(tables, computed, q_lens, B, torch.device("cpu"), reference))
        outs.append(torch.cat([attn(layer, q, k, v) for layer in range(L)]))
    meta = build_metadata(tables, computed, q_lens, B, torch.device("cpu"))
    if contiguous is True:
        assert len(meta.views) == 4 and all(g.num_seqs == 1 for g in meta.groups)
    if contiguous is False:
        assert all(n <= B for _, _, n in meta.views)  # only one-block tables are trivially one run
        assert len(meta.views) < 4
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-10, atol=1e-10)


def test_blocks_stay_one_run():
    bm = BlockManager(num_blocks=64, block_size=4, enable_prefix_caching=False, contiguous_runs=True)
    seqs = [Sequence(f"s{i}", 0, [1] * 5, SamplingParams(max_tokens=40), 40) for i in range(3)]
    for s in seqs:
        bm.admit(s, [], [])
        bm.allocate(s, 5)
    for _ in range(3):  # decode growth interleaved across sequences
        for s in seqs:
            s.num_computed_tokens += 4
            bm.allocate(s, 4)
    for s in seqs:
        assert s.block_table == list(range(s.block_table[0], s.block_table[0] + len(s.block_table)))
    assert len({b for s in seqs for b in s.block_table}) == sum(len(s.block_table) for s in seqs)
