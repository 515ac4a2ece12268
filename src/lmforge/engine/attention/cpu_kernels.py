"""The C-kernel attention backend (CPU, bfloat16 or float32): every decoding sequence of a step in one
call to the compiled paged-decode kernel (`lmforge.engine.kernels`), which reads each sequence's blocks
in place whatever their order (no views, no buckets, no gather; int8 codes dequantized inside the
kernel). Every prefill chunk of a step, fresh or after cached tokens, goes to the paged prefill kernel in
one call (causal, over the pool in place: no gather, no mask) when the queries are float32 and the pool
bf16 or float32; otherwise (bf16 queries, an int8 pool, an older build) through the torch backend's
`attend_groups`.

bf16 K/V with bf16 queries run the tuned body (`decode`); float32 queries or K/V, and int8 K/V, run
`decode_any` (float32 queries over a float32 or bf16 pool: its AVX2 body). The kernel is chosen at run
time from this CPU's flags when the library is built; with no compiler the engine selects the torch
backend instead (`attention.select_backend`).
This module knows nothing about scheduling or the model beyond the hook's signature.

Shape legend: T flat tokens this step, N query heads, K kv heads, H head dim, S decoding sequences,
M blocks per sequence (padded).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..kernels import CpuKernels
from .base import AttentionBackend, GroupedMetadata, StepIndex, chunk_groups, largest_gather, slot_mapping
from .kv_pool import KVPool
from .sdpa import attend_groups


@dataclass
class KernelMetadata(GroupedMetadata):
    # the decoding sequences for the kernel: rows (S,) int64, lens (S,) int32, block tables (S, M) int32
    # padded with 0; None when no sequence decodes this step
    decode: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # the prefill chunks for the prefill kernel: (q row, q len, tokens before) (C, 3) int64, block tables (C, M)
    # int32 padded with 0; None when no chunk prefills this step or the chunks go to `attend_groups`
    prefill: tuple[torch.Tensor, torch.Tensor] | None = None


def _tables(step: StepIndex, seqs: list[int], M: int) -> torch.Tensor:
    """(S, M) int32: the block tables of sequences `seqs`, cut or padded with 0 to M blocks."""
    return torch.tensor([step.block_tables[i][:M] + [0] * (M - len(step.block_tables[i][:M])) for i in seqs],
                        dtype=torch.int32)


class KernelBackend(AttentionBackend):
    label = "paged-decode kernel (C)"

    def __init__(self, kv: KVPool, kernels: CpuKernels, rounded_activations: bool = False):
        super().__init__(kv)
        self.kernels = kernels
        # prefill chunks on the prefill kernel: float32 queries over a bf16 or float32 pool (int8 codes and bf16
        # queries take attend_groups)
        self.prefill_kernel = (kernels.prefill is not None and kv.dtype == torch.float32 and kv.device.type == "cpu"
                               and not kv.int8 and kv.store_dtype in (torch.bfloat16, torch.float32))
        # the prefill kernel's bf16 dot products (queries and probabilities rounded to bf16, float32 sums, as OpenVINO's
        # bf16 SDPA) over a bf16 pool, on a CPU with them, where the linears already round their activations
        # (`rounded_activations`: the bf16 panel GEMM, int8 activations). A bf16 prefill of the 300M: 92.6 -> 59.0 ms
        # of attention a 512-token prompt (`scripts/kernels_ab.py prefill`). LMFORGE_PREFILL_BF16=0 keeps float32.
        self.prefill_bf16 = (rounded_activations and self.prefill_kernel and kv.store_dtype == torch.bfloat16
                             and kernels.bf16_panel_rows is not None and kernels.bf16_panel_rows(-1) > 0
                             and os.environ.get("LMFORGE_PREFILL_BF16", "1") != "0")

    @property
    def name(self) -> str:
        return super().name + ("; prefill attention on bf16 dot products" if self.prefill_bf16 else "")

    def build(self, step: StepIndex) -> KernelMetadata:
        B, device = self.kv.block_size, self.kv.device
        slot_mapping_T = slot_mapping(step, B, device)
        decode, decoding = None, step.decoding
        if decoding:
            lens = [step.computed[i] + 1 for i in decoding]
            M = -(-max(lens) // B)
            decode = (torch.tensor([step.q_starts[i] for i in decoding], dtype=torch.long),
                      torch.tensor(lens, dtype=torch.int32), _tables(step, decoding, M))
        chunks = [i for i, q in enumerate(step.q_lens) if q > 1]
        prefill, groups = None, []
        if chunks and self.prefill_kernel:
            M = max(-(-(step.computed[i] + step.q_lens[i]) // B) for i in chunks)
            prefill = (torch.tensor([[step.q_starts[i], step.q_lens[i], step.computed[i]] for i in chunks],
                                    dtype=torch.int64), _tables(step, chunks, M))
        elif chunks:
            groups = chunk_groups(step, B, device)
        return KernelMetadata(slot_mapping_T, groups, largest_gather(groups), decode, prefill)

    def __call__(self, layer_idx: int, q_BTNH: torch.Tensor, k_BTKH: torch.Tensor,
                 v_BTKH: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        self.kv.write(layer_idx, k_BTKH, v_BTKH, meta.slot_mapping_T)
        q_TNH = q_BTNH[0] if meta.decode is None else q_BTNH[0].contiguous()  # the kernel reads raw rows
        out_TNH = torch.empty(q_TNH.shape, dtype=q_TNH.dtype, device=q_TNH.device)
        if meta.decode is not None:
            self._decode(layer_idx, q_TNH, out_TNH)
        if meta.prefill is not None:
            self._prefill(layer_idx, q_TNH, out_TNH)
        attend_groups(self.kv, layer_idx, q_BTNH, k_BTKH, v_BTKH, q_TNH, meta.groups, out_TNH)
        return out_TNH.unsqueeze(0)

    def _prefill(self, layer_idx: int, q_TNH: torch.Tensor, out_TNH: torch.Tensor) -> None:
        """Every prefill chunk in one C call, causal over the pool's rows in place (the chunk's own K/V were
        written just before, with whatever the sequence had cached)."""
        chunks_C3, tables_CM = self.meta.prefill
        k_cache, v_cache = self.kv.rows(layer_idx)
        if q_TNH.stride(2) != 1:
            q_TNH = q_TNH.contiguous()
        N, (K, H) = q_TNH.shape[1], k_cache.shape[1:]
        kv = 1 if k_cache.dtype == torch.float32 else 2 if self.prefill_bf16 else 0  # f32 | bf16 dots | bf16 pool
        rc = self.kernels.prefill(q_TNH.data_ptr(), q_TNH.stride(0), q_TNH.stride(1), k_cache.data_ptr(),
                                  v_cache.data_ptr(), kv, tables_CM.data_ptr(),
                                  tables_CM.shape[1], chunks_C3.data_ptr(), len(chunks_C3), N, K, H,
                                  self.kv.block_size, H ** -0.5, out_TNH.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"paged prefill kernel refused heads={N} kv_heads={K} head_dim={H}")

    def _decode(self, layer_idx: int, q_TNH: torch.Tensor, out_TNH: torch.Tensor) -> None:
        """Every decoding sequence in one C call: bf16 (the tuned body) or float32 / int8 K/V (`decode_any`)."""
        rows_S, lens_S, tables_SM = self.meta.decode
        (k_cache, v_cache), (k_scale, v_scale) = self.kv.rows(layer_idx), self.kv.scales(layer_idx)
        N, (K, H) = q_TNH.shape[1], k_cache.shape[1:]
        common = (tables_SM.data_ptr(), tables_SM.shape[1], lens_S.data_ptr(), rows_S.data_ptr(), len(rows_S), N, K, H,
                  self.kv.block_size, H ** -0.5, out_TNH.data_ptr(), torch.get_num_threads())
        if q_TNH.dtype == torch.bfloat16 and k_cache.dtype == torch.bfloat16:
            rc = self.kernels.decode(q_TNH.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), *common)
        else:
            kv_kind = 2 if k_scale is not None else int(k_cache.dtype == torch.float32)  # int8 | f32 | bf16
            rc = self.kernels.decode_any(q_TNH.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                         None if k_scale is None else k_scale.data_ptr(),
                                         None if v_scale is None else v_scale.data_ptr(), *common,
                                         int(q_TNH.dtype == torch.float32), kv_kind)
        if rc != 0:
            raise RuntimeError(f"paged decode kernel refused heads={N} kv_heads={K} head_dim={H}")
