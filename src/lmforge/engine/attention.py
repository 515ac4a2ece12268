"""Paged attention: write this step's K/V into the per-layer block pools, then attend each query
token over its sequence's cached + new keys, causally.

Two implementations of one contract, selected by `EngineConfig.attention`:
  * reference — a per-sequence Python loop with plain matmul/softmax math. Slow, obviously right.
  * fast — no per-sequence loops inside layers. Rows that compute one token (decode, or a
    one-token chunk) form one group, longer prefill chunks another; each group gathers its
    sequences' blocks into a padded (S, C, K, H) tensor and runs one SDPA with a mask. All
    indices are built once per step (`build_metadata`), not per layer.
Tests check they agree. This module knows nothing about scheduling, sampling or the model beyond
the attention callable's signature `(layer_idx, q_BTNH, k_BTKH, v_BTKH) -> out_BTNH` with B = 1.

Shape legend: T flat tokens this step, N query heads, K kv heads, H head dim, P pool blocks,
B block size, S sequences in a group, Q query tokens per sequence (padded), C context length
(padded), M max blocks per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Group:
    rows_SQ: torch.Tensor  # flat token index of each query (padding points at row 0)
    valid_SQ: torch.Tensor  # bool: a real query, not padding
    slots_SC: torch.Tensor  # pool slot of each context position (padding points at slot 0)
    mask_S1QC: torch.Tensor  # bool: query may attend key (causal, within the context)


@dataclass
class AttentionMetadata:
    slot_mapping_T: torch.Tensor  # where each new token's K/V goes
    groups: list[Group]  # fast path
    per_seq: list[tuple[int, int, int, torch.Tensor]]  # reference: (q_start, q_len, num_computed, slots_C)


def _group(block_tables: list[list[int]], computed: list[int], q_lens: list[int], q_starts: list[int],
           block_size: int, device: torch.device) -> Group:
    S, Q, M = len(q_lens), max(q_lens), max(len(bt) for bt in block_tables)
    C = max(c + q for c, q in zip(computed, q_lens))
    bt_SM = torch.tensor([bt + [0] * (M - len(bt)) for bt in block_tables], dtype=torch.long)
    pos_C = torch.arange(C)
    slots_SC = bt_SM[:, pos_C // block_size] * block_size + pos_C % block_size
    q_SQ = torch.arange(Q).expand(S, Q)
    valid_SQ = q_SQ < torch.tensor(q_lens)[:, None]
    rows_SQ = torch.where(valid_SQ, torch.tensor(q_starts)[:, None] + q_SQ, 0)
    qpos_SQ = torch.tensor(computed)[:, None] + q_SQ  # absolute position of each query
    mask_S1QC = (pos_C[None, None, :] <= qpos_SQ[:, :, None]).unsqueeze(1)
    # padded queries may see padded keys (slot 0, finite values); their outputs are dropped
    return Group(*(t.to(device, non_blocking=True) for t in (rows_SQ, valid_SQ, slots_SC, mask_S1QC)))


def build_metadata(block_tables: list[list[int]], computed: list[int], q_lens: list[int], block_size: int,
                   device: torch.device, reference: bool = False) -> AttentionMetadata:
    """Indices for one step. Sequence s computes tokens [computed[s], computed[s] + q_lens[s])."""
    q_starts, slot_mapping, start = [], [], 0
    for bt, c, q in zip(block_tables, computed, q_lens):
        q_starts.append(start)
        start += q
        slot_mapping += [bt[p // block_size] * block_size + p % block_size for p in range(c, c + q)]
    slot_mapping_T = torch.tensor(slot_mapping, dtype=torch.long).to(device, non_blocking=True)
    if reference:
        per_seq = []
        for bt, c, q, s in zip(block_tables, computed, q_lens, q_starts):
            slots = [bt[p // block_size] * block_size + p % block_size for p in range(c + q)]
            per_seq.append((s, q, c, torch.tensor(slots, dtype=torch.long, device=device)))
        return AttentionMetadata(slot_mapping_T, [], per_seq)
    groups = []
    for is_decode in (True, False):  # one-token rows never pay for a long chunk's padding
        idx = [i for i, q in enumerate(q_lens) if (q == 1) == is_decode]
        if idx:
            groups.append(_group([block_tables[i] for i in idx], [computed[i] for i in idx],
                                 [q_lens[i] for i in idx], [q_starts[i] for i in idx], block_size, device))
    return AttentionMetadata(slot_mapping_T, groups, [])


class PagedAttention:
    """The engine's attention callable; owns the K/V pools, one pair of tensors per layer."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_pools_PBKH = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_pools_PBKH = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.meta: AttentionMetadata | None = None  # set by the model runner before each forward

    def __call__(self, layer_idx: int, q_BTNH: torch.Tensor, k_BTKH: torch.Tensor,
                 v_BTKH: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        K, H = k_BTKH.shape[2:]
        k_cache = self.k_pools_PBKH[layer_idx].view(-1, K, H)  # (P*B, K, H): one row per slot
        v_cache = self.v_pools_PBKH[layer_idx].view(-1, K, H)
        k_cache.index_copy_(0, meta.slot_mapping_T, k_BTKH[0])
        v_cache.index_copy_(0, meta.slot_mapping_T, v_BTKH[0])
        if meta.per_seq:
            return reference_attention(q_BTNH[0], k_cache, v_cache, meta.per_seq).unsqueeze(0)
        q_TNH, out_TNH = q_BTNH[0], torch.empty_like(q_BTNH[0])
        for g in meta.groups:
            q_SNQH = q_TNH[g.rows_SQ].transpose(1, 2)
            k_SKCH = k_cache[g.slots_SC].transpose(1, 2)
            v_SKCH = v_cache[g.slots_SC].transpose(1, 2)
            o_SNQH = F.scaled_dot_product_attention(q_SNQH, k_SKCH, v_SKCH, attn_mask=g.mask_S1QC,
                                                    enable_gqa=q_SNQH.shape[1] != k_SKCH.shape[1])
            out_TNH[g.rows_SQ[g.valid_SQ]] = o_SNQH.transpose(1, 2)[g.valid_SQ]
        return out_TNH.unsqueeze(0)


def reference_attention(q_TNH: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        per_seq: list[tuple[int, int, int, torch.Tensor]]) -> torch.Tensor:
    """softmax(q k^T / sqrt(H) + causal mask) v, one sequence at a time, in at least float32."""
    N, H = q_TNH.shape[1:]
    acc = torch.promote_types(q_TNH.dtype, torch.float32)
    out_TNH = torch.empty_like(q_TNH)
    for start, q_len, computed, slots_C in per_seq:
        q_NQH = q_TNH[start:start + q_len].transpose(0, 1).to(acc)
        k_NCH = k_cache[slots_C].to(acc).repeat_interleave(N // k_cache.shape[1], dim=1).transpose(0, 1)
        v_NCH = v_cache[slots_C].to(acc).repeat_interleave(N // k_cache.shape[1], dim=1).transpose(0, 1)
        scores_NQC = q_NQH @ k_NCH.transpose(1, 2) / H ** 0.5
        qpos_Q = computed + torch.arange(q_len, device=q_TNH.device)
        visible_QC = torch.arange(len(slots_C), device=q_TNH.device)[None, :] <= qpos_Q[:, None]
        probs_NQC = scores_NQC.masked_fill(~visible_QC, float("-inf")).softmax(-1)
        out_TNH[start:start + q_len] = (probs_NQC @ v_NCH).transpose(0, 1).to(q_TNH.dtype)
    return out_TNH
