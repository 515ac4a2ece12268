"""Paged attention: write this step's K/V into the per-layer block pools, then attend each query token
over its sequence's cached + new keys, causally. One backend is chosen once, when the engine starts
(`select_backend`), and the model runner hands it to the model as its `attn(layer_idx, q_BTNH, k_BTKH,
v_BTKH) -> out_BTNH` hook (B = 1: the step's tokens in one flat row).

Each backend owns its KV pool object and builds its own metadata, once per step (`prepare`):
  * `ReferenceBackend` (reference.py) - a per-sequence loop with plain math. Slow, obviously right.
  * `SdpaBackend` (sdpa.py) - torch SDPA: on CPU, decode over in-place pool views where a sequence's
    blocks are one run, buckets of gathered blocks otherwise; on CUDA (or over int8 K/V) gathered only.
  * `KernelBackend` (cpu_kernels.py) - CPU bf16 / float32: every decode row in one compiled C call.
The pool (kv_pool.py) is `KVPool` in the model's dtype (or the float dtype `kv_cache_dtype` names) or
`Int8KVPool` (`kv_cache_dtype="int8"`):
any backend reads either. The engine asks the chosen backend what it needs: `bytes_per_block` (the pool
it sizes) and `contiguous_runs` (the block allocation it reads fastest). Tests check the backends agree.
This package knows nothing about scheduling, sampling or the model beyond the hook's signature.
"""

from __future__ import annotations

import torch

from ..kernels import CpuKernels, supports
from .base import AttentionBackend
from .cpu_kernels import KernelBackend
from .kv_pool import Int8KVPool, KVPool, kv_bytes_per_token, quantize_kv
from .reference import ReferenceBackend, reference_attention
from .sdpa import SdpaBackend

__all__ = ["AttentionBackend", "Int8KVPool", "KVPool", "KernelBackend", "ReferenceBackend", "SdpaBackend",
           "kv_bytes_per_token", "kv_store_dtype", "quantize_kv", "reference_attention", "select_backend"]


def kv_store_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The float dtype a `kv_cache_dtype` keeps K/V in: "auto" the activations' (`dtype`), else the one named."""
    return dtype if kv_cache_dtype in ("auto", "int8") else getattr(torch, kv_cache_dtype)


def select_backend(num_layers: int, num_blocks: int, block_size: int, num_heads: int, num_kv_heads: int,
                   head_dim: int, dtype: torch.dtype, device: torch.device, reference: bool = False,
                   kernels: CpuKernels | None = None, kv_cache_dtype: str = "auto",
                   rounded_activations: bool = False) -> AttentionBackend:
    """The one backend this engine uses, over a fresh pool of `num_blocks` blocks per layer. `kernels`:
    the loaded C library (None: torch only); used for attention when its decode kernel takes these heads."""
    if reference or (kernels is not None and not supports(num_heads, num_kv_heads, head_dim)):
        kernels = None  # the reference writes its K/V with torch too
    if kv_cache_dtype == "int8":
        kv = Int8KVPool(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device, kernels=kernels)
    else:
        kv = KVPool(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device, kernels=kernels,
                    store_dtype=kv_store_dtype(kv_cache_dtype, dtype))
    if reference:
        return ReferenceBackend(kv)
    if kernels is not None:
        return KernelBackend(kv, kernels, rounded_activations)
    return SdpaBackend(kv)
