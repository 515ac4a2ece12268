"""The torch attention backend: `F.scaled_dot_product_attention` over the paged pool, batched.

On CPU, a decoding sequence (one query token) whose blocks form one run of consecutive ids (the block
manager allocates that way when asked: `contiguous_runs`) attends over a strided view of the pool rows
in place: one SDPA per sequence, no copy, no padding. The remaining decoding sequences go in buckets
of similar context length, each gathered whole blocks at a time into the pool's reusable buffer and run
as one SDPA with a key-padding mask. A prefill chunk is its own group (`base.chunk_groups`). On CUDA
(and over an int8 pool, which must be dequantized) nothing is read in place: a call per sequence is
launch-bound on a GPU, so every decoding sequence is gathered.

`attend_groups` is shared with the C-kernel backend, which sends its prefill chunks here.
This module knows nothing about scheduling or the model beyond the hook's signature.

Shape legend: T flat tokens this step, N query heads, K kv heads, H head dim, S sequences in a group,
Q query tokens of a group's sequence, C context length (padded), R pool rows (P*B).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import AttentionBackend, GroupedMetadata, StepIndex, bucket_groups, chunk_groups, largest_gather, \
    slot_mapping
from .kv_pool import Group, KVPool


@dataclass
class SdpaMetadata(GroupedMetadata):
    views: list[tuple[int, int, int]] | None = None  # decode, blocks one run: (row, first slot, context len)
    view_rows: torch.Tensor | None = None  # the views' rows when they are not simply 0, 1, ..., len(views) - 1


class SdpaBackend(AttentionBackend):
    label = "torch"

    def __init__(self, kv: KVPool):
        super().__init__(kv)
        # a call per sequence: cheap on CPU, launch-bound on a GPU; int8 codes must be dequantized first
        self.in_place = kv.reads_in_place and kv.device.type == "cpu"
        self.contiguous_runs = self.in_place

    def build(self, step: StepIndex) -> SdpaMetadata:
        B, device = self.kv.block_size, self.kv.device
        slot_mapping_T = slot_mapping(step, B, device)
        views, decode = [], []
        for i in step.decoding:
            bt, n = step.block_tables[i], step.computed[i] + 1
            m = -(-n // B)
            if self.in_place and bt[m - 1] - bt[0] == m - 1 and bt[:m] == list(range(bt[0], bt[0] + m)):
                views.append((step.q_starts[i], bt[0] * B, n))  # its K/V is one strided view of the pool
            else:
                decode.append(i)
        groups = bucket_groups(step, decode, B, device) + chunk_groups(step, B, device)
        view_rows = None
        if any(v[0] != i for i, v in enumerate(views)):
            view_rows = torch.tensor([v[0] for v in views], dtype=torch.long).to(device, non_blocking=True)
        return SdpaMetadata(slot_mapping_T, groups, largest_gather(groups), views, view_rows)

    def __call__(self, layer_idx: int, q_BTNH: torch.Tensor, k_BTKH: torch.Tensor,
                 v_BTKH: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        self.kv.write(layer_idx, k_BTKH, v_BTKH, meta.slot_mapping_T)
        q_TNH = q_BTNH[0]
        out_TNH = torch.empty(q_TNH.shape, dtype=q_TNH.dtype, device=q_TNH.device)
        if meta.views:
            self._attend_views(layer_idx, q_TNH, out_TNH)
        attend_groups(self.kv, layer_idx, q_BTNH, k_BTKH, v_BTKH, q_TNH, meta.groups, out_TNH)
        return out_TNH.unsqueeze(0)

    def _attend_views(self, layer_idx: int, q_TNH: torch.Tensor, out_TNH: torch.Tensor) -> None:
        """No copy: SDPA reads the pool rows in place; one slice per tensor per sequence."""
        meta = self.meta
        k_cache, v_cache = self.kv.rows(layer_idx)
        gqa = q_TNH.shape[1] != k_cache.shape[1]
        q_1NTH = q_TNH.transpose(0, 1).unsqueeze(0)
        k_1KRH, v_1KRH = k_cache.transpose(0, 1).unsqueeze(0), v_cache.transpose(0, 1).unsqueeze(0)
        outs = [F.scaled_dot_product_attention(q_1NTH[:, :, row:row + 1], k_1KRH[:, :, first:first + n],
                                               v_1KRH[:, :, first:first + n], enable_gqa=gqa)
                for row, first, n in meta.views]
        o_NSH = torch.cat(outs, dim=2)[0]
        if meta.view_rows is None:
            out_TNH[:len(outs)] = o_NSH.transpose(0, 1)
        else:
            out_TNH[meta.view_rows] = o_NSH.transpose(0, 1)


def attend_groups(kv: KVPool, layer_idx: int, q_BTNH: torch.Tensor, k_BTKH: torch.Tensor, v_BTKH: torch.Tensor,
                  q_TNH: torch.Tensor, groups: list[Group], out_TNH: torch.Tensor) -> None:
    """Each group's rows of `out_TNH`: a fresh prefill chunk by causal SDPA over its own K/V (views, no
    copy; over an int8 pool too, as vLLM's quantized caches do), the others by one masked SDPA over the
    blocks the pool gathers (dequantized when int8)."""
    gqa = q_TNH.shape[1] != k_BTKH.shape[2]
    for g in groups:
        if g.blocks_SM is None:  # (1, heads, Q, H) views
            q_1NQH, k_1KQH, v_1KQH = (t[0, g.rows].transpose(0, 1).unsqueeze(0) for t in (q_BTNH, k_BTKH, v_BTKH))
            o_1NQH = F.scaled_dot_product_attention(q_1NQH, k_1KQH, v_1KQH, is_causal=True, enable_gqa=gqa)
            out_TNH[g.rows] = o_1NQH[0].transpose(0, 1)
            continue
        k_SKCH, v_SKCH = kv.gather(layer_idx, g)
        q_SQNH = q_TNH[g.rows].view(g.num_seqs, -1, *q_TNH.shape[1:])  # decode: Q = 1; a chunk: S = 1
        o_SNQH = F.scaled_dot_product_attention(q_SQNH.transpose(1, 2), k_SKCH, v_SKCH, attn_mask=g.mask_S1QC,
                                                enable_gqa=gqa)
        out_TNH[g.rows] = o_SNQH.transpose(1, 2).reshape(-1, *q_TNH.shape[1:])
