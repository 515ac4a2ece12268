"""Weights in transparent huge pages (Linux, CPU).

A decode step streams every weight byte once; with 4 KB pages the random 300M's Q4_0 weights (156 MiB) are ~40,000
pages, a TLB miss and page walk each time the kernels cross into one; in 2 MB pages the same bytes are ~80. Linux backs
a region with huge pages only where it is 2 MB-aligned and the process asked (`madvise(MADV_HUGEPAGE)`: this
project's machines have `/sys/kernel/mm/transparent_hugepage/enabled` = madvise), and torch's allocator asks for
nothing, while the weights lie in hundreds of tensors of 1-3 MB, few of which hold an aligned 2 MB range. So
`place_linears` copies the engine's integer and bf16 weights (codes and scales) into one anonymous mapping advised
for huge pages and points the layers at the copies. (The K/V pools need nothing: numpy's allocator, which
`kv_pool.lazy_zeros` uses, advises huge pages itself.)

Measured with `python scripts/hugepage_ab.py MODEL` (two engines in one process taking turns, default flags; Zen 5,
2 threads, 2026-12-06): one sequence at depth 128, random 300M Q4_0 144.3 -> 161.4 tok/s best of 8 (median 133.9
-> 149.7), bf16 66.3 -> 70.6; 16 sequences and a 512-token prefill within the noise (the engine built first ran
~3-6% faster whichever it was).

Nothing changes a number: the same bytes at other addresses. `LMFORGE_HUGEPAGES=0` keeps torch's own memory (for
A/B runs); elsewhere than Linux, on CUDA, or where no mapping is to be had, nothing moves.
"""

from __future__ import annotations

import mmap
import os
import sys

import torch
from torch import nn

HUGE = 2 << 20  # bytes of an x86-64 transparent huge page
ALIGN = 64  # each tensor's start in the arena: a cache line (the kernels' vector loads)


def enabled() -> bool:
    """Linux, and not switched off (`LMFORGE_HUGEPAGES=0`)."""
    return sys.platform.startswith("linux") and os.environ.get("LMFORGE_HUGEPAGES", "1") != "0"


class Arena:
    """One anonymous private mapping advised for huge pages, handed out 64 bytes aligned; the tensors it returns keep
    it alive (`torch.frombuffer` holds the mapping)."""

    def __init__(self, nbytes: int):
        self.map = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.buf = torch.frombuffer(self.map, dtype=torch.uint8)
        self.off = (-self.buf.data_ptr()) % HUGE  # the first tensor on a huge-page boundary
        self.map.madvise(mmap.MADV_HUGEPAGE)

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        dst = self.buf[self.off:self.off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        dst.copy_(t)
        self.off += padded(t)
        return dst


def padded(t: torch.Tensor) -> int:
    """t's bytes in the arena: its size rounded up to ALIGN."""
    return -(-t.numel() * t.element_size() // ALIGN) * ALIGN


def _weights(m: nn.Module) -> list[str]:
    """A `QmmLinear`'s tensors the kernels stream (codes, scales, zeros and their super-block levels)."""
    return [n for n in ("codes", "scale", "scale_super", "zero", "zero_super") if getattr(m, n, None) is not None]


def place_linears(model: nn.Module) -> int:
    """Copy every integer- or bf16-weight `QmmLinear`'s codes and scales into one huge-page arena and point the layer
    at the copies (its scale descriptor rebuilt); bytes moved (0: nothing moved). Not float32 layers (`from_f32`),
    whose codes are the checkpoint's own tensors, which `LLM.load_weights` writes in place. Call before anything
    records the weights' addresses (the C decoder layers' parameter arrays)."""
    from lmforge.quant.linear import QmmLinear

    if not enabled():
        return 0
    mods = [m for m in model.modules() if isinstance(m, QmmLinear) and m.bits != 32 and m.codes.device.type == "cpu"]
    # not a layer whose tensors another module reads too (a tied LM head's codes under a `QuantizedEmbedding`): the
    # copy would leave two
    others = {t.data_ptr() for o in model.modules() if not isinstance(o, QmmLinear)
              for t in [*o.parameters(recurse=False), *o.buffers(recurse=False)]}
    moves = [(m, _weights(m)) for m in mods]
    moves = [(m, names) for m, names in moves if not any(getattr(m, n).data_ptr() in others for n in names)]
    nbytes = sum(padded(getattr(m, n)) for m, names in moves for n in names)
    if nbytes < HUGE:  # an arena this small holds no aligned huge page
        return 0
    try:
        arena = Arena(nbytes)
    except (OSError, ValueError, AttributeError):  # no mapping to be had, or no MADV_HUGEPAGE on this platform
        return 0
    for m, names in moves:
        for n in names:
            setattr(m, n, arena.copy(getattr(m, n)))
        m.redescribe()
    return nbytes
