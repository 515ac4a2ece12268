"""The torch SDPA backend (in-place views for one-run block tables, gathered buckets otherwise) agrees
with the per-sequence reference over the same pool; the backend is chosen once from the engine's
options; the block manager keeps a sequence's blocks one run."""

import random

import pytest
import torch

from lmforge.engine import kernels
from lmforge.engine.attention import Int8KVPool, KernelBackend, KVPool, ReferenceBackend, SdpaBackend, select_backend
from lmforge.engine.block_manager import BlockManager
from lmforge.engine.sampling_params import SamplingParams
from lmforge.engine.sequence import Sequence


@pytest.mark.parametrize("contiguous", [True, False, None])  # None: a mix
def test_fast_matches_reference(contiguous):
    rng = random.Random(0)
    L, P, B, K, N, H = 2, 64, 4, 2, 4, 8
    kv = KVPool(L, P, B, K, H, torch.float64, torch.device("cpu"))
    for pool in kv.k_pools_PBKH + kv.v_pools_PBKH:
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
    outs, fast = [], SdpaBackend(kv)
    for attn in (fast, ReferenceBackend(kv)):  # one pool, read by both
        attn.prepare(tables, computed, q_lens)
        outs.append(torch.cat([attn(layer, q, k, v) for layer in range(L)]))
    fast.prepare(tables, computed, q_lens)
    meta = fast.meta
    if contiguous is True:
        assert len(meta.views) == 4 and all(g.num_seqs == 1 for g in meta.groups)
    if contiguous is False:
        assert all(n <= B for _, _, n in meta.views)  # only one-block tables are trivially one run
        assert len(meta.views) < 4
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-10, atol=1e-10)


def test_backend_chosen_once_from_the_options():
    """`select_backend` picks one backend and its pool; names and the allocation each asks for are the
    engine's stats of before the split (`attention_backend`, contiguous runs only for in-place reads)."""
    cpu, args = torch.device("cpu"), (2, 8, 4, 4, 2, 32)
    ref = select_backend(*args, torch.float32, cpu, reference=True, kernels=kernels.load())
    assert isinstance(ref, ReferenceBackend) and ref.kv.kernels is None and ref.name == "torch"
    fast = select_backend(*args, torch.float32, cpu)
    assert isinstance(fast, SdpaBackend) and fast.contiguous_runs and fast.name == "torch"
    int8 = select_backend(*args, torch.float32, cpu, kv_cache_dtype="int8")
    assert isinstance(int8.kv, Int8KVPool) and not int8.contiguous_runs and int8.name == "torch, int8 KV"
    assert int8.bytes_per_block == 4 * 2 * 2 * 2 * (32 + 2) and fast.bytes_per_block == 4 * 2 * 2 * 2 * 32 * 4
    lib = kernels.load()
    if lib is not None:
        c = select_backend(*args, torch.bfloat16, cpu, kernels=lib)
        assert isinstance(c, KernelBackend) and not c.contiguous_runs and c.name == "paged-decode kernel (C)"
        odd = select_backend(2, 8, 4, 4, 2, 24, torch.bfloat16, cpu, kernels=lib)  # head dim the kernel refuses
        assert isinstance(odd, SdpaBackend) and odd.kv.kernels is None


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
