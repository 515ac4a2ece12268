"""The reference attention backend (`EngineConfig.attention="reference"`): a per-sequence Python loop
with plain matmul / softmax math in at least float32, over the slots each sequence has written.
Slow, obviously right; the tests hold every fast backend to it. Over an int8 pool it dequantizes
what it reads (codes * scale).

This module knows nothing about scheduling or the model beyond the hook's signature.

Shape legend: T flat tokens this step, N query heads, K kv heads, H head dim, Q query tokens of a
sequence, C its context length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import AttentionBackend, StepIndex, slot_mapping, slots


@dataclass
class ReferenceMetadata:
    slot_mapping_T: torch.Tensor  # where each new token's K/V goes
    per_seq: list[tuple[int, int, int, torch.Tensor]]  # (q_start, q_len, num_computed, slots_C)


class ReferenceBackend(AttentionBackend):
    label = "torch"

    def build(self, step: StepIndex) -> ReferenceMetadata:
        B, device = self.kv.block_size, self.kv.device
        per_seq = [(s, q, c, torch.tensor(slots(bt, 0, c + q, B), dtype=torch.long, device=device))
                   for bt, c, q, s in zip(step.block_tables, step.computed, step.q_lens, step.q_starts)]
        return ReferenceMetadata(slot_mapping(step, B, device), per_seq)

    def __call__(self, layer_idx: int, q_BTNH: torch.Tensor, k_BTKH: torch.Tensor,
                 v_BTKH: torch.Tensor) -> torch.Tensor:
        self.kv.write(layer_idx, k_BTKH, v_BTKH, self.meta.slot_mapping_T)
        (k_cache, v_cache), (k_scale, v_scale) = self.kv.rows(layer_idx), self.kv.scales(layer_idx)
        return reference_attention(q_BTNH[0], k_cache, v_cache, self.meta.per_seq, k_scale, v_scale).unsqueeze(0)


def reference_attention(q_TNH: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        per_seq: list[tuple[int, int, int, torch.Tensor]], k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(H) + causal mask) v, one sequence at a time, in at least float32. With
    scales (rows, K), the caches hold int8 codes: K/V = codes * scale."""
    N, H = q_TNH.shape[1:]
    acc = torch.promote_types(q_TNH.dtype, torch.float32)
    out_TNH = torch.empty_like(q_TNH)
    for start, q_len, computed, slots_C in per_seq:
        q_NQH = q_TNH[start:start + q_len].transpose(0, 1).to(acc)
        k_CKH, v_CKH = k_cache[slots_C].to(acc), v_cache[slots_C].to(acc)
        if k_scale is not None:
            k_CKH, v_CKH = k_CKH * k_scale[slots_C].to(acc)[..., None], v_CKH * v_scale[slots_C].to(acc)[..., None]
        k_NCH = k_CKH.repeat_interleave(N // k_cache.shape[1], dim=1).transpose(0, 1)
        v_NCH = v_CKH.repeat_interleave(N // k_cache.shape[1], dim=1).transpose(0, 1)
        scores_NQC = q_NQH @ k_NCH.transpose(1, 2) / H ** 0.5
        qpos_Q = computed + torch.arange(q_len, device=q_TNH.device)
        visible_QC = torch.arange(len(slots_C), device=q_TNH.device)[None, :] <= qpos_Q[:, None]
        probs_NQC = scores_NQC.masked_fill(~visible_QC, float("-inf")).softmax(-1)
        out_TNH[start:start + q_len] = (probs_NQC @ v_NCH).transpose(0, 1).to(q_TNH.dtype)
    return out_TNH
