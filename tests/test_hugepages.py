"""Weights and K/V pools in transparent huge pages (`lmforge.engine.hugepages`): the layers read the same bytes at their
new addresses (outputs and greedy tokens equal), the scale descriptors follow the move, shared tensors stay, the
switch keeps torch's memory, and where the kernel has them the moved weights and the pools are advised for huge pages."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lmforge.engine import LLM, SamplingParams, hugepages, kernels
from lmforge.engine.attention.kv_pool import lazy_zeros
from lmforge.quant import QuantScheme
from lmforge.quant.linear import QmmLinear, QuantizedLinear

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_available() -> bool:
    """Whether this kernel gives huge pages to a region that asks (the setting is `always` or `madvise`)."""
    return THP.is_file() and "[never]" not in THP.read_text()


def advised(t: torch.Tensor) -> bool:
    """Whether every mapping t's bytes overlap in /proc/self/smaps, past its first page, carries the huge-page advice
    (VmFlags `hg`). What the project controls: whether the kernel then grants 2 MB pages depends on its free memory's
    fragmentation (a long test run can leave none to compact: CI read 0 kB of AnonHugePages under the advice), so the
    grant is measured by `scripts/hugepage_ab.py`, not asserted here."""
    lo, hi = t.data_ptr() + 4096, t.data_ptr() + t.numel() * t.element_size()
    flags, inside = [], False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m.group(1), 16) < hi and lo < int(m.group(2), 16)
        elif inside and line.startswith("VmFlags:"):
            flags.append("hg" in line.split()[1:])
    return bool(flags) and all(flags)


def linears(bits: int, scales: torch.dtype) -> nn.Sequential:
    """Three 1,024 x 1,024 (int4: 2,048 x 1,024) QmmLinears on the A8 kernel: 3 MB of codes, so an arena holds a
    whole aligned huge page."""
    lib = kernels.load()
    if lib is None or lib.a8 is None:
        pytest.fail("lmforge's compiled kernels did not load")
    gen = torch.Generator().manual_seed(0)
    mods = []
    for _ in range(3):
        n, k = (2048, 1024) if bits == 4 else (1024, 1024)
        q = QuantizedLinear(k, n, QuantScheme(bits, 32))
        q.qweight.copy_(torch.randint(-8 if bits == 4 else -127, 8 if bits == 4 else 128, (n, k), dtype=torch.int8,
                                      generator=gen))
        q.weight_scale = (torch.rand(n, k // 32, generator=gen) * 0.02 + 0.001).to(scales)
        m = QmmLinear(q, torch.float32, a8=lib.a8())
        m.store_panels(int8=True)  # what the engine does first (where the CPU has the panel bodies; else rows)
        mods.append(m)
    return nn.Sequential(*mods)


@pytest.mark.parametrize("bits,scales", [(4, torch.float16), (8, torch.float32)])
def test_place_linears_moves_the_weights_and_keeps_the_outputs(bits, scales, monkeypatch):
    monkeypatch.delenv("LMFORGE_HUGEPAGES", raising=False)
    model = linears(bits, scales)
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(1))
    before = [m(x) for m in model]
    old = [m.codes.data_ptr() for m in model]
    moved = hugepages.place_linears(model)
    assert moved >= sum(m.codes.numel() * m.codes.element_size() for m in model)
    assert all(m.codes.data_ptr() != p for m, p in zip(model, old))
    for m in model:
        if m.desc is not None:  # the descriptor names the moved scales, not the freed ones
            assert int(m.desc[2]) == m.scale.data_ptr()
    after = [m(x) for m in model]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    if thp_available():
        assert all(advised(m.codes) for m in model), "the arena is not advised for huge pages"


def test_switch_and_shared_tensors_stay(monkeypatch):
    monkeypatch.setenv("LMFORGE_HUGEPAGES", "0")
    model = linears(4, torch.float16)
    ptrs = [m.codes.data_ptr() for m in model]
    assert hugepages.place_linears(model) == 0 and [m.codes.data_ptr() for m in model] == ptrs
    monkeypatch.setenv("LMFORGE_HUGEPAGES", "1")
    holder = nn.Module()  # another module reading layer 0's codes (a tied LM head's embedding): layer 0 stays
    holder.register_buffer("table", model[0].codes, persistent=False)
    both = nn.Sequential(model, holder)
    assert hugepages.place_linears(both) > 0
    assert model[0].codes.data_ptr() == ptrs[0] and model[1].codes.data_ptr() != ptrs[1]


def test_a_lazily_zeroed_pool_is_advised_for_huge_pages():
    """numpy's allocator advises huge pages for the K/V pools (`lazy_zeros`); a change of allocator must keep that."""
    pool = lazy_zeros((64, 1 << 16), torch.float32, torch.device("cpu"))  # 16 MB, untouched
    assert torch.count_nonzero(pool) == 0
    pool.fill_(1.0)
    if thp_available():
        assert advised(pool), "the pool's mapping is not advised for huge pages"
    assert float(pool.sum()) == pool.numel()


def test_engine_greedy_tokens_equal_with_and_without(monkeypatch):
    from test_real_model import smollm2_gguf

    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 1780, 1047, 1048]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    out = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("LMFORGE_HUGEPAGES", flag)
        llm = LLM(str(smollm2_gguf()))
        out[flag] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.llm_engine.memory_stats()
        assert (stats["weight_hugepage_bytes"] > 50 * 2**20) is (flag == "1")
        del llm
    assert out["0"] == out["1"]
