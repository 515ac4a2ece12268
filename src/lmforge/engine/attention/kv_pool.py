"""The paged K/V cache: per layer one pool of blocks for k and one for v, `(P, B, K, H)`, and the two
things every attention backend asks of it: write this step's K/V rows into their slots, and gather
whole blocks of a group of sequences into a buffer every layer reuses.

Two kinds, chosen once from `kv_cache_dtype`:
  * `KVPool` - the model's dtype, or (`kv_cache_dtype="bfloat16"` / `"float32"`, the store dtype) another
    float dtype than the activations': float32 activations over a bf16 cache, as a bf16 checkpoint served
    on float32 arithmetic keeps it (half the bytes a decode step reads; llama.cpp keeps f16). Written by
    `index_copy_`, or by the C `write_kv_bytes` / `write_kv_f32_bf16` when the compiled kernels are in use
    (same bits: round to nearest even). A backend may read its rows in place when they are the
    activations' dtype; else the gather widens them.
  * `Int8KVPool` (`kv_cache_dtype="int8"`) - each token's K and V stored per head as int8 codes plus one
    bfloat16 scale (absmax / 127, symmetric): quantized on write (C or torch, same bits), dequantized
    where it is read (the gather, the reference loop, the C decode kernel); never read in place.
    Bytes per token per layer: 2 * K * (H + 2) instead of 2 * K * H * 2 for bf16 (1.94x the tokens at H = 64).

This module knows nothing about which query attends to which key (the backends' metadata does).

Shape legend: T tokens this step, K kv heads, H head dim, P pool blocks, B block size, S sequences in a
group, M blocks per sequence (padded), Q query tokens, C context length (padded), X = B*K*H one block's values.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..kernels import CpuKernels

KV_SCALE_DTYPE = torch.bfloat16  # one per token per head: 2 bytes next to H int8 codes
GROW = 1.25  # gather buffers grow with this headroom; every later step reuses them


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       kv_int8: bool = False) -> int:
    """2 (k and v) x layers x kv heads x (head dim x dtype size, or head dim int8 codes + a 2-byte scale)."""
    per_head = head_dim + KV_SCALE_DTYPE.itemsize if kv_int8 else head_dim * dtype.itemsize
    return 2 * num_layers * num_kv_heads * per_head


def quantize_kv(x_TKH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per token per head: codes (T, K, H) int8, scales (T, K) = absmax / 127."""
    x = x_TKH.float()
    scale_TK = (x.abs().amax(-1) / 127).clamp_min(1e-8).to(KV_SCALE_DTYPE)
    q_TKH = torch.round(x / scale_TK.float()[..., None]).clamp_(-127, 127).to(torch.int8)
    return q_TKH, scale_TK


PREFAULT_CHUNK = 2 << 20  # bytes a madvise call: a short hold of the address space's lock (see `_prefault`)
_MADV_POPULATE_WRITE = 23  # Linux 5.14+


def _libc_madvise() -> Callable[[int, int, int], int]:
    """libc's madvise(addr, length, advice) through ctypes (a call releases the GIL)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise


def _prefault(bufs: list[tuple[weakref.ref, int, int]], madvise: Callable[[int, int, int], int]) -> None:
    """Fault in the pools' pages ahead of use, on idle CPU only (this thread at SCHED_IDLE), a chunk at a time across
    every layer, lowest blocks first (the block manager's order). `madvise(MADV_POPULATE_WRITE)` maps each page as a
    first write would, and leaves a page already mapped (one a request has written meanwhile) as it is, so it runs
    beside the engine without a lock of ours. Why: the pool is calloc'd lazily (`lazy_zeros`), and with the prefix
    cache on the block manager hands out never-used blocks first (to keep cached ones), so every prompt of a fresh
    server faulted in fresh pages; on a VM whose memory the host backs lazily (this project's, 0.43 GB/s at first
    touch against ~11 afterwards) a 512-token bf16 prefill of the 300M spent ~60 ms of its ~880 there (prefill with
    the cache on read 0.88x off, 2026-12-06). Stops when a pool is freed (the engine closed) or the kernel lacks
    the call.

    `bufs`: (weak reference to the numpy buffer under a pool, its address, its bytes). The thread holds a buffer
    only across its madvise call, and never a torch tensor: where it held the last reference to a pool the engine
    had let go, freeing a tensor here let go of the GIL (torch frees large storage without it), and a daemon thread
    that waits for the GIL while the interpreter exits is ended by a forced unwind that C++ turns into
    `std::terminate` (`eval diff` exited with SIGABRT after writing its results, 1 run in ~30 under load). numpy
    frees its buffer holding the GIL."""
    with contextlib.suppress(AttributeError, OSError):  # Linux: the calling thread only
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    page = os.sysconf("SC_PAGE_SIZE")
    off = 0
    while True:
        left = False
        for ref, ptr, nbytes in bufs:
            buf = ref()  # held while madvise runs on its pages
            if buf is None:
                return
            if off < nbytes:
                left = True
                start = (ptr + off) // page * page
                if madvise(start, min(PREFAULT_CHUNK, ptr + nbytes - start), _MADV_POPULATE_WRITE) != 0:
                    return
            del buf
        if not left:
            return
        off += PREFAULT_CHUNK


def prefault_in_background(bufs: list[np.ndarray]) -> threading.Thread | None:
    """Start `_prefault` over the numpy buffers under CPU pools (`lazy_buffer`; held weakly: the thread ends when
    the engine lets them go); None where it does not apply: not Linux, no buffers, `LMFORGE_KV_PREFAULT=0`."""
    if not sys.platform.startswith("linux") or os.environ.get("LMFORGE_KV_PREFAULT", "1") == "0" or not bufs:
        return None
    spans = [(weakref.ref(b), b.__array_interface__["data"][0], b.nbytes) for b in bufs]
    thread = threading.Thread(target=_prefault, args=(spans, _libc_madvise()), name="lmforge-kv-prefault",
                              daemon=True)
    thread.start()
    return thread


def token_rows(x_THD: torch.Tensor) -> bool:
    """Whether each token's (heads, dim) lies packed, tokens any number of elements apart: a view of a fused
    projection's output rows, which the strided kernels read where they lie."""
    return x_THD.stride(2) == 1 and x_THD.stride(1) == x_THD.shape[2] and x_THD.stride(0) >= x_THD.shape[1] * x_THD.shape[2]


def lazy_buffer(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, np.ndarray]:
    """A zeroed CPU tensor and the numpy buffer it lies in (`lazy_zeros`)."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    buf = np.zeros(nbytes, dtype=np.uint8)
    return torch.from_numpy(buf).view(dtype).view(shape), buf


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor. On CPU from numpy's calloc: the OS hands out zero pages when they are first
    touched, so a pool of gigabytes costs neither the seconds of `torch.zeros`' memset at start nor
    resident memory until requests fill it. numpy's allocator also asks Linux for transparent huge pages
    (`madvise(MADV_HUGEPAGE)` from 4 MB), so the pool faults in 2 MB at a time (`tests/test_hugepages.py`)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return lazy_buffer(shape, dtype)[0]


@dataclass
class Group:
    """Queries that attend together over K/V gathered from the pool (or over their own fresh K/V)."""
    rows: torch.Tensor | slice  # flat token rows of the queries: (S,) for decode, a slice for a chunk
    blocks_SM: torch.Tensor | None  # block ids to gather, flattened (S*M,); None: attend fresh K/V only
    num_seqs: int  # S
    num_blocks: int  # M
    context_len: int  # C
    mask_S1QC: torch.Tensor | None  # bool: query may attend key; None with blocks_SM None (causal)


class KVPool:
    """K/V pools in the model's dtype (or `store_dtype`), and the gather buffers every layer reuses."""

    int8 = False

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, kernels: CpuKernels | None = None,
                 store_dtype: torch.dtype | None = None):
        self.dtype, self.device, self.block_size = dtype, device, block_size
        self.store_dtype = store_dtype or dtype  # of the pools (int8 pools: their scales' kind aside, codes)
        self.kernels = kernels  # compiled K/V write; None: torch only
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        pool_dtype = torch.int8 if self.int8 else self.store_dtype
        bufs: list[np.ndarray] = []

        def pool() -> torch.Tensor:
            if torch.device(device).type != "cpu":
                return torch.zeros(shape, dtype=pool_dtype, device=device)
            t, buf = lazy_buffer(shape, pool_dtype)
            bufs.append(buf)
            return t

        self.k_pools_PBKH = [pool() for _ in range(num_layers)]
        self.v_pools_PBKH = [pool() for _ in range(num_layers)]
        self._k_buf_X = self._v_buf_X = torch.empty(0, dtype=dtype, device=device)
        # pages faulted in ahead of the requests that fill them, on idle CPU (`_prefault`); K first, as before
        self.prefault = prefault_in_background(bufs)
        self.bytes_per_block = block_size * kv_bytes_per_token(num_layers, num_kv_heads, head_dim, self.store_dtype,
                                                               self.int8)

    @property
    def label(self) -> str:
        """Appended to the backend's name: the pool's kind where it is not the activations' dtype."""
        if self.int8:
            return ", int8 KV"
        return f", {str(self.store_dtype).removeprefix('torch.')} KV" if self.store_dtype != self.dtype else ""

    @property
    def reads_in_place(self) -> bool:
        """A backend may attend over the pool rows as they are (no dequantize, no widening)."""
        return not self.int8 and self.store_dtype == self.dtype

    def rows(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(P*B, K, H) views of the layer's pools: a row per slot."""
        k_PBKH, v_PBKH = self.k_pools_PBKH[layer_idx], self.v_pools_PBKH[layer_idx]
        return k_PBKH.view(-1, *k_PBKH.shape[2:]), v_PBKH.view(-1, *v_PBKH.shape[2:])

    def scales(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(P*B, K) per-row scales of an int8 pool; (None, None) for the model's dtype."""
        return None, None

    def write(self, layer_idx: int, k_BTKH: torch.Tensor, v_BTKH: torch.Tensor, slot_mapping_T: torch.Tensor) -> None:
        """This step's K/V rows into their slots (vLLM's `reshape_and_cache`)."""
        k_cache, v_cache = self.rows(layer_idx)
        same = k_BTKH.dtype == self.store_dtype
        to_bf16 = k_BTKH.dtype == torch.float32 and self.store_dtype == torch.bfloat16
        if self.kernels is not None and (same or to_bf16):
            K, H = k_BTKH.shape[2:]
            k_TKH, v_TKH = k_BTKH[0], v_BTKH[0]
            strided = self.kernels.write_kv_f32_bf16_strided if to_bf16 else None
            if strided is not None and token_rows(k_TKH) and token_rows(v_TKH):  # views of the q/k/v output
                strided(k_TKH.data_ptr(), v_TKH.data_ptr(), slot_mapping_T.data_ptr(), k_TKH.shape[0], K * H,
                        k_TKH.stride(0), v_TKH.stride(0), k_cache.data_ptr(), v_cache.data_ptr())
                return
            k_TKH, v_TKH = k_TKH.contiguous(), v_TKH.contiguous()
            args = (k_TKH.data_ptr(), v_TKH.data_ptr(), slot_mapping_T.data_ptr(), k_TKH.shape[0])
            if same:
                self.kernels.write_kv_bytes(*args, K * H * k_TKH.element_size(), k_cache.data_ptr(), v_cache.data_ptr())
            else:
                self.kernels.write_kv_f32_bf16(*args, K * H, k_cache.data_ptr(), v_cache.data_ptr())
        else:  # index_copy_ rounds to the pool's dtype as the C write does
            k_cache.index_copy_(0, slot_mapping_T, k_BTKH[0].to(self.store_dtype))
            v_cache.index_copy_(0, slot_mapping_T, v_BTKH[0].to(self.store_dtype))

    def reserve(self, max_gather_blocks: int) -> None:
        """Make the gather buffers hold `max_gather_blocks` blocks (no fresh allocation per layer: on CPU,
        page-faulting a new 100 MB tensor cost more than the copy)."""
        X = self.k_pools_PBKH[0][0].numel()
        if max_gather_blocks * X > self._k_buf_X.numel():
            n = int(max_gather_blocks * GROW) * X
            self._k_buf_X = torch.empty(n, dtype=self._k_buf_X.dtype, device=self._k_buf_X.device)
            self._v_buf_X = torch.empty_like(self._k_buf_X)

    def gather(self, layer_idx: int, g: Group) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's blocks of k and of v, copied whole into the reusable buffers: (S, K, C, H) views."""
        return (self._gather(self.k_pools_PBKH[layer_idx], self._k_buf_X, g),
                self._gather(self.v_pools_PBKH[layer_idx], self._v_buf_X, g))

    @staticmethod
    def _gather(pool_PBKH: torch.Tensor, buf_X: torch.Tensor, g: Group) -> torch.Tensor:
        P, B, K, H = pool_PBKH.shape
        n = g.num_seqs * g.num_blocks
        out_nX = buf_X[:n * B * K * H].view(n, B * K * H)
        if pool_PBKH.dtype == buf_X.dtype:
            torch.index_select(pool_PBKH.view(P, -1), 0, g.blocks_SM, out=out_nX)
        else:  # a bf16 pool under float32 activations: widened into the buffer
            out_nX.copy_(pool_PBKH.view(P, -1).index_select(0, g.blocks_SM))
        return out_nX.view(g.num_seqs, g.num_blocks * B, K, H)[:, :g.context_len].transpose(1, 2)


class Int8KVPool(KVPool):
    """int8 codes in the pools plus one bfloat16 scale per token per head."""

    int8 = True

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, kernels: CpuKernels | None = None):
        super().__init__(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device, kernels)
        shape = (num_blocks, block_size, num_kv_heads)
        self.k_scales_PBK = [torch.ones(shape, dtype=KV_SCALE_DTYPE, device=device) for _ in range(num_layers)]
        self.v_scales_PBK = [torch.ones(shape, dtype=KV_SCALE_DTYPE, device=device) for _ in range(num_layers)]

    def scales(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        K = self.k_scales_PBK[layer_idx].shape[2]
        return self.k_scales_PBK[layer_idx].view(-1, K), self.v_scales_PBK[layer_idx].view(-1, K)

    def write(self, layer_idx: int, k_BTKH: torch.Tensor, v_BTKH: torch.Tensor, slot_mapping_T: torch.Tensor) -> None:
        """Quantize and write this step's K/V: the C call where it takes the dtype, else torch (same bits)."""
        (k_cache, v_cache), (k_scale, v_scale) = self.rows(layer_idx), self.scales(layer_idx)
        if self.kernels is not None and k_BTKH.dtype in (torch.bfloat16, torch.float32):
            K, H = k_BTKH.shape[2:]
            k_TKH, v_TKH = k_BTKH[0].contiguous(), v_BTKH[0].contiguous()
            self.kernels.write_kv_int8(k_TKH.data_ptr(), v_TKH.data_ptr(), slot_mapping_T.data_ptr(),
                                       k_TKH.shape[0], K, H, int(k_TKH.dtype == torch.float32), k_cache.data_ptr(),
                                       v_cache.data_ptr(), k_scale.data_ptr(), v_scale.data_ptr())
            return
        for x_TKH, cache, scale in ((k_BTKH[0], k_cache, k_scale), (v_BTKH[0], v_cache, v_scale)):
            q_TKH, s_TK = quantize_kv(x_TKH)
            cache.index_copy_(0, slot_mapping_T, q_TKH)
            scale.index_copy_(0, slot_mapping_T, s_TK)

    def gather(self, layer_idx: int, g: Group) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's int8 blocks and their scales, dequantized (codes * scale, in the activation dtype)
        into the reusable buffers: (S, K, C, H) views."""
        return (self._dequantize(self.k_pools_PBKH[layer_idx], self.k_scales_PBK[layer_idx], self._k_buf_X, g),
                self._dequantize(self.v_pools_PBKH[layer_idx], self.v_scales_PBK[layer_idx], self._v_buf_X, g))

    def _dequantize(self, pool_PBKH: torch.Tensor, scale_PBK: torch.Tensor, buf_X: torch.Tensor,
                    g: Group) -> torch.Tensor:
        P, B, K, H = pool_PBKH.shape
        n = g.num_seqs * g.num_blocks
        q_nBKH = pool_PBKH.view(P, -1).index_select(0, g.blocks_SM).view(n, B, K, H)
        s_nBK = scale_PBK.view(P, -1).index_select(0, g.blocks_SM).view(n, B, K).to(self.dtype)
        out_nBKH = buf_X[:n * B * K * H].view(n, B, K, H)
        torch.mul(q_nBKH, s_nBK.unsqueeze(-1), out=out_nBKH)
        return out_nBKH.view(g.num_seqs, g.num_blocks * B, K, H)[:, :g.context_len].transpose(1, 2)
