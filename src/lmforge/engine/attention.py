"""Paged attention: write this step's K/V into the per-layer block pools, then attend each query
token over its sequence's cached + new keys, causally.

Two implementations of one contract, selected by `EngineConfig.attention`:
  * reference — a per-sequence Python loop with plain matmul/softmax math. Slow, obviously right.
  * fast — on CPU, a decoding sequence (one query token) whose blocks form one run of consecutive
    ids (the block manager allocates that way when it can) attends over a strided view of the
    pool rows in place: one SDPA per sequence, no copy, no padding. The remaining decoding sequences
    are sorted by context length and cut into buckets whose padding stays under
    `MAX_PADDING` (one long sequence no longer pads a hundred short ones); each bucket gathers
    its block tables, whole blocks at a time, into a preallocated buffer (no fresh allocation
    per layer: on CPU, page-faulting a new 100 MB tensor cost more than the copy) and runs one
    SDPA with a key-padding mask. A prefill chunk is its own group: with nothing cached before
    it, it attends over its own fresh K/V (causal SDPA, no gather at all); otherwise it gathers
    its blocks like a bucket of one. All indices are built once per step (`build_metadata`).
Tests check they agree. This module knows nothing about scheduling, sampling or the model beyond
the attention callable's signature `(layer_idx, q_BTNH, k_BTKH, v_BTKH) -> out_BTNH` with B = 1.

KV cache dtype int8 (`kv_cache_dtype="int8"`): each token's K and V are stored per head as int8 codes
plus one bfloat16 scale (absmax / 127, symmetric), written by the K/V write and dequantized where the
cache is read (the gather, the reference loop, the C decode kernel). A prefill chunk with nothing
cached before it attends over its own fresh K/V, as vLLM's quantized caches do. Bytes per token per
layer: 2 * K * (H + 2) instead of 2 * K * H * 2 for bf16 (1.94x the tokens at H = 64).

Shape legend: T flat tokens this step, N query heads, K kv heads, H head dim, P pool blocks,
B block size, S sequences in a group, Q query tokens of a group's sequence, C context length
(padded), M blocks per sequence (padded), X = B*K*H one block's values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kernels import CpuKernels

MAX_PADDING = 1.25  # a decode bucket's padded context area may exceed its real one by this factor
KV_SCALE_DTYPE = torch.bfloat16  # one per token per head: 2 bytes next to H int8 codes


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


@dataclass
class Group:
    rows: torch.Tensor | slice  # flat token rows of the queries: (S,) for decode, a slice for a chunk
    blocks_SM: torch.Tensor | None  # block ids to gather, flattened (S*M,); None: attend fresh K/V only
    num_seqs: int  # S
    num_blocks: int  # M
    context_len: int  # C
    mask_S1QC: torch.Tensor | None  # bool: query may attend key; None with blocks_SM None (causal)


@dataclass
class AttentionMetadata:
    slot_mapping_T: torch.Tensor  # where each new token's K/V goes
    groups: list[Group]  # fast path
    per_seq: list[tuple[int, int, int, torch.Tensor]]  # reference: (q_start, q_len, num_computed, slots_C)
    max_gather_blocks: int = 0  # the largest group's S*M: the gather buffer's size
    views: list[tuple[int, int, int]] | None = None  # decode, blocks one run: (row, first slot, context len)
    view_rows: torch.Tensor | None = None  # the views' rows when they are not simply 0, 1, ..., len(views) - 1
    kernel: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # decode for the C kernel:
    # rows (S,) int64, lens (S,) int32, block tables (S, M) int32 padded with 0


def _slots(bt: list[int], start: int, stop: int, block_size: int) -> list[int]:
    return [bt[p // block_size] * block_size + p % block_size for p in range(start, stop)]


def _decode_buckets(lens: list[int]) -> list[list[int]]:
    """Indices into `lens`, ascending by length, cut so each bucket's S * max(len) <= MAX_PADDING * sum."""
    buckets: list[list[int]] = []
    cur, total = [], 0
    for i in sorted(range(len(lens)), key=lens.__getitem__):
        if cur and (len(cur) + 1) * lens[i] > MAX_PADDING * (total + lens[i]):
            buckets.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += lens[i]
    return buckets + [cur] if cur else buckets


def _gather_group(rows, block_tables: list[list[int]], lens: list[int], q_len: int, block_size: int,
                  device: torch.device) -> Group:
    """Sequences that gather their first `lens[s]` tokens' K/V; queries are the last `q_len` of them."""
    S, C = len(block_tables), max(lens)
    M = -(-C // block_size)
    blocks_SM = torch.tensor([bt[:M] + [0] * (M - len(bt[:M])) for bt in block_tables], dtype=torch.long)
    pos_C = torch.arange(C)
    qpos_SQ = torch.tensor(lens)[:, None] - q_len + torch.arange(q_len)  # absolute position of each query
    mask_S1QC = (pos_C[None, None, :] <= qpos_SQ[:, :, None]).unsqueeze(1)
    # padded keys (block 0, finite values) are masked; every query sees at least itself
    return Group(rows, blocks_SM.flatten().to(device, non_blocking=True), S, M, C,
                 mask_S1QC.to(device, non_blocking=True))


def build_metadata(block_tables: list[list[int]], computed: list[int], q_lens: list[int], block_size: int,
                   device: torch.device, reference: bool = False, kernel: bool = False,
                   read_in_place: bool = True) -> AttentionMetadata:
    """Indices for one step. Sequence s computes tokens [computed[s], computed[s] + q_lens[s]).
    `kernel`: every decoding sequence goes to the compiled paged-decode kernel (CPU, in place).
    `read_in_place`: on CPU, a decoding sequence whose blocks are one run is read in place (not with int8 K/V,
    which must be dequantized: those are gathered)."""
    q_starts, slot_mapping, start = [], [], 0
    for bt, c, q in zip(block_tables, computed, q_lens):
        q_starts.append(start)
        start += q
        slot_mapping += _slots(bt, c, c + q, block_size)
    slot_mapping_T = torch.tensor(slot_mapping, dtype=torch.long).to(device, non_blocking=True)
    if reference:
        per_seq = [(s, q, c, torch.tensor(_slots(bt, 0, c + q, block_size), dtype=torch.long, device=device))
                   for bt, c, q, s in zip(block_tables, computed, q_lens, q_starts)]
        return AttentionMetadata(slot_mapping_T, [], per_seq)
    groups, views, decode = [], [], []
    in_place = read_in_place and device.type == "cpu"  # a call per sequence: cheap on CPU, launch-bound on a GPU
    kernel_meta = None
    decoding = [i for i, q in enumerate(q_lens) if q == 1]
    if kernel and decoding:  # all of them go to the kernel; no views, no buckets
        lens = [computed[i] + 1 for i in decoding]
        M = -(-max(lens) // block_size)
        tables = [block_tables[i][:M] + [0] * (M - len(block_tables[i][:M])) for i in decoding]
        kernel_meta = (torch.tensor([q_starts[i] for i in decoding], dtype=torch.long),
                       torch.tensor(lens, dtype=torch.int32), torch.tensor(tables, dtype=torch.int32))
    for i in [] if kernel else decoding:
        bt, n = block_tables[i], computed[i] + 1
        m = -(-n // block_size)
        if in_place and bt[m - 1] - bt[0] == m - 1 and bt[:m] == list(range(bt[0], bt[0] + m)):
            views.append((q_starts[i], bt[0] * block_size, n))  # its K/V is one strided view of the pool
        else:
            decode.append(i)
    for bucket in _decode_buckets([computed[i] + 1 for i in decode]):
        idx = [decode[j] for j in bucket]
        rows = torch.tensor([q_starts[i] for i in idx], dtype=torch.long).to(device, non_blocking=True)
        groups.append(_gather_group(rows, [block_tables[i] for i in idx], [computed[i] + 1 for i in idx], 1,
                                    block_size, device))
    for i, q in enumerate(q_lens):
        if q == 1:
            continue
        rows = slice(q_starts[i], q_starts[i] + q)
        if computed[i] == 0:  # nothing cached before the chunk: causal attention over its own K/V
            groups.append(Group(rows, None, 1, 0, q, None))
        else:
            groups.append(_gather_group(rows, [block_tables[i]], [computed[i] + q], q, block_size, device))
    most = max((g.num_seqs * g.num_blocks for g in groups), default=0)
    view_rows = None
    if any(v[0] != i for i, v in enumerate(views)):
        view_rows = torch.tensor([v[0] for v in views], dtype=torch.long).to(device, non_blocking=True)
    return AttentionMetadata(slot_mapping_T, groups, [], most, views, view_rows, kernel_meta)


class PagedAttention:
    """The engine's attention callable; owns the K/V pools, one pair of tensors per layer, and the
    gather buffers every layer reuses."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, kernels: CpuKernels | None = None, kv_int8: bool = False):
        self.kernels = kernels  # compiled CPU bf16 decode attention + K/V write; None: torch only
        self.kv_int8, self.dtype = kv_int8, dtype
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        pool_dtype = torch.int8 if kv_int8 else dtype
        self.k_pools_PBKH = [torch.zeros(shape, dtype=pool_dtype, device=device) for _ in range(num_layers)]
        self.v_pools_PBKH = [torch.zeros(shape, dtype=pool_dtype, device=device) for _ in range(num_layers)]
        scales = (num_blocks, block_size, num_kv_heads)
        self.k_scales_PBK = [torch.ones(scales, dtype=KV_SCALE_DTYPE, device=device) if kv_int8 else None
                             for _ in range(num_layers)]
        self.v_scales_PBK = [torch.ones(scales, dtype=KV_SCALE_DTYPE, device=device) if kv_int8 else None
                             for _ in range(num_layers)]
        self.meta: AttentionMetadata | None = None  # set by the model runner before each forward
        self._k_buf_X = self._v_buf_X = torch.empty(0, dtype=dtype, device=device)
        self.bytes_per_block = block_size * kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype, kv_int8)

    @property
    def name(self) -> str:
        base = "paged-decode kernel (C)" if self.kernels is not None else "torch"
        return base + (", int8 KV" if self.kv_int8 else "")

    @property
    def contiguous_runs(self) -> bool:
        """The allocation this backend wants from the block manager: the torch path on CPU reads a
        sequence whose blocks are one run in place (no gather); the C kernel and int8 K/V read any table."""
        return self.kernels is None and not self.kv_int8 and self.k_pools_PBKH[0].device.type == "cpu"

    def set_metadata(self, meta: AttentionMetadata | None) -> None:
        self.meta = meta
        X = self.k_pools_PBKH[0][0].numel()
        if meta is not None and meta.kernel is not None and self.kernels is None:
            raise ValueError("metadata built for the decode kernel, but this PagedAttention has none")
        if meta is not None and meta.max_gather_blocks * X > self._k_buf_X.numel():
            n = int(meta.max_gather_blocks * 1.25) * X  # grow with headroom; reused by every later step
            self._k_buf_X = torch.empty(n, dtype=self._k_buf_X.dtype, device=self._k_buf_X.device)
            self._v_buf_X = torch.empty_like(self._k_buf_X)

    def __call__(self, layer_idx: int, q_BTNH: torch.Tensor, k_BTKH: torch.Tensor,
                 v_BTKH: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        K, H = k_BTKH.shape[2:]
        k_pool_PBKH, v_pool_PBKH = self.k_pools_PBKH[layer_idx], self.v_pools_PBKH[layer_idx]
        k_cache, v_cache = k_pool_PBKH.view(-1, K, H), v_pool_PBKH.view(-1, K, H)  # (P*B, K, H): a row per slot
        if self.kv_int8:
            return self._call_int8(layer_idx, q_BTNH, k_BTKH, v_BTKH, k_cache, v_cache)
        if self.kernels is not None:
            k_TKH, v_TKH = k_BTKH[0].contiguous(), v_BTKH[0].contiguous()
            self.kernels.write_kv_bytes(k_TKH.data_ptr(), v_TKH.data_ptr(), meta.slot_mapping_T.data_ptr(),
                                        k_TKH.shape[0], K * H * k_TKH.element_size(), k_cache.data_ptr(),
                                        v_cache.data_ptr())
        else:
            k_cache.index_copy_(0, meta.slot_mapping_T, k_BTKH[0])
            v_cache.index_copy_(0, meta.slot_mapping_T, v_BTKH[0])
        if meta.per_seq:
            return reference_attention(q_BTNH[0], k_cache, v_cache, meta.per_seq).unsqueeze(0)
        q_TNH = q_BTNH[0] if meta.kernel is None else q_BTNH[0].contiguous()
        out_TNH = torch.empty(q_TNH.shape, dtype=q_TNH.dtype, device=q_TNH.device)
        gqa = q_TNH.shape[1] != K
        if meta.kernel is not None:  # every decoding sequence in one call, K/V read in place
            self._decode_kernel(q_TNH, k_cache, v_cache, None, None, out_TNH, k_pool_PBKH.shape[1])
        if meta.views:  # no copy: SDPA reads the pool rows in place; one slice per tensor per sequence
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
        for g in meta.groups:
            if g.blocks_SM is None:  # a fresh prefill chunk: (1, heads, Q, H) views, no copy
                q_1NQH, k_1KQH, v_1KQH = (t[0, g.rows].transpose(0, 1).unsqueeze(0) for t in (q_BTNH, k_BTKH, v_BTKH))
                o_1NQH = F.scaled_dot_product_attention(q_1NQH, k_1KQH, v_1KQH, is_causal=True, enable_gqa=gqa)
                out_TNH[g.rows] = o_1NQH[0].transpose(0, 1)
                continue
            k_SKCH, v_SKCH = (self._gather(pool, buf, g, K, H) for pool, buf in
                              ((k_pool_PBKH, self._k_buf_X), (v_pool_PBKH, self._v_buf_X)))
            q_SQNH = q_TNH[g.rows].view(g.num_seqs, -1, *q_TNH.shape[1:])  # decode: Q = 1; a chunk: S = 1
            o_SNQH = F.scaled_dot_product_attention(q_SQNH.transpose(1, 2), k_SKCH, v_SKCH, attn_mask=g.mask_S1QC,
                                                    enable_gqa=gqa)
            out_TNH[g.rows] = o_SNQH.transpose(1, 2).reshape(-1, *q_TNH.shape[1:])
        return out_TNH.unsqueeze(0)

    def _decode_kernel(self, q_TNH, k_cache, v_cache, k_scale, v_scale, out_TNH, block_size: int) -> None:
        """Every decoding sequence in one C call: bf16 (the tuned body) or float32 / int8 K/V (`_any`)."""
        rows_S, lens_S, tables_SM = self.meta.kernel
        N, (K, H) = q_TNH.shape[1], k_cache.shape[1:]
        common = (tables_SM.data_ptr(), tables_SM.shape[1], lens_S.data_ptr(), rows_S.data_ptr(), len(rows_S), N, K, H,
                  block_size, H ** -0.5, out_TNH.data_ptr(), torch.get_num_threads())
        if q_TNH.dtype == torch.bfloat16 and k_scale is None:
            rc = self.kernels.decode(q_TNH.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), *common)
        else:
            rc = self.kernels.decode_any(q_TNH.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                         None if k_scale is None else k_scale.data_ptr(),
                                         None if v_scale is None else v_scale.data_ptr(), *common,
                                         int(q_TNH.dtype == torch.float32), 2 if k_scale is not None else
                                         int(k_cache.dtype == torch.float32))
        if rc != 0:
            raise RuntimeError(f"paged decode kernel refused heads={N} kv_heads={K} head_dim={H}")

    def _call_int8(self, layer_idx: int, q_BTNH, k_BTKH, v_BTKH, k_cache, v_cache) -> torch.Tensor:
        """The int8 cache: quantize and write this step's K/V (C or torch, same bits), then the reference
        loop, or the C decode kernel (codes read in place) and gather groups that dequantize what they
        gather; no in-place views."""
        meta, (K, H) = self.meta, k_BTKH.shape[2:]
        k_scale, v_scale = self.k_scales_PBK[layer_idx].view(-1, K), self.v_scales_PBK[layer_idx].view(-1, K)
        if self.kernels is not None and q_BTNH.dtype in (torch.bfloat16, torch.float32):
            k_TKH, v_TKH = k_BTKH[0].contiguous(), v_BTKH[0].contiguous()
            self.kernels.write_kv_int8(k_TKH.data_ptr(), v_TKH.data_ptr(), meta.slot_mapping_T.data_ptr(),
                                       k_TKH.shape[0], K, H, int(k_TKH.dtype == torch.float32), k_cache.data_ptr(),
                                       v_cache.data_ptr(), k_scale.data_ptr(), v_scale.data_ptr())
        else:
            for x_TKH, cache, scale in ((k_BTKH[0], k_cache, k_scale), (v_BTKH[0], v_cache, v_scale)):
                q_TKH, s_TK = quantize_kv(x_TKH)
                cache.index_copy_(0, meta.slot_mapping_T, q_TKH)
                scale.index_copy_(0, meta.slot_mapping_T, s_TK)
        if meta.per_seq:
            return reference_attention(q_BTNH[0], k_cache, v_cache, meta.per_seq, k_scale, v_scale).unsqueeze(0)
        q_TNH = q_BTNH[0] if meta.kernel is None else q_BTNH[0].contiguous()
        out_TNH = torch.empty(q_TNH.shape, dtype=q_TNH.dtype, device=q_TNH.device)
        if meta.kernel is not None:
            self._decode_kernel(q_TNH, k_cache, v_cache, k_scale, v_scale, out_TNH, self.k_pools_PBKH[0].shape[1])
        gqa = q_TNH.shape[1] != K
        for g in meta.groups:
            if g.blocks_SM is None:  # a fresh prefill chunk attends over its own unquantized K/V
                q_1NQH, k_1KQH, v_1KQH = (t[0, g.rows].transpose(0, 1).unsqueeze(0) for t in (q_BTNH, k_BTKH, v_BTKH))
                o_1NQH = F.scaled_dot_product_attention(q_1NQH, k_1KQH, v_1KQH, is_causal=True, enable_gqa=gqa)
                out_TNH[g.rows] = o_1NQH[0].transpose(0, 1)
                continue
            k_SKCH, v_SKCH = (self._gather_int8(pool, scale, buf, g, K, H) for pool, scale, buf in
                              ((self.k_pools_PBKH[layer_idx], self.k_scales_PBK[layer_idx], self._k_buf_X),
                               (self.v_pools_PBKH[layer_idx], self.v_scales_PBK[layer_idx], self._v_buf_X)))
            q_SQNH = q_TNH[g.rows].view(g.num_seqs, -1, *q_TNH.shape[1:])
            o_SNQH = F.scaled_dot_product_attention(q_SQNH.transpose(1, 2), k_SKCH, v_SKCH, attn_mask=g.mask_S1QC,
                                                    enable_gqa=gqa)
            out_TNH[g.rows] = o_SNQH.transpose(1, 2).reshape(-1, *q_TNH.shape[1:])
        return out_TNH.unsqueeze(0)

    def _gather_int8(self, pool_PBKH, scale_PBK, buf_X, g: Group, K: int, H: int) -> torch.Tensor:
        """The group's int8 blocks and their scales, dequantized (q * scale, in the activation dtype) into
        the reusable buffer: a (S, K, C, H) view."""
        P, B = pool_PBKH.shape[:2]
        n = g.num_seqs * g.num_blocks
        q_nBKH = pool_PBKH.view(P, -1).index_select(0, g.blocks_SM).view(n, B, K, H)
        s_nBK = scale_PBK.view(P, -1).index_select(0, g.blocks_SM).view(n, B, K).to(self.dtype)
        out_nBKH = buf_X[:n * B * K * H].view(n, B, K, H)
        torch.mul(q_nBKH, s_nBK.unsqueeze(-1), out=out_nBKH)
        return out_nBKH.view(g.num_seqs, g.num_blocks * B, K, H)[:, :g.context_len].transpose(1, 2)

    @staticmethod
    def _gather(pool_PBKH: torch.Tensor, buf_X: torch.Tensor, g: Group, K: int, H: int) -> torch.Tensor:
        """The group's blocks, copied whole into the reusable buffer: a (S, K, C, H) view."""
        P, B = pool_PBKH.shape[:2]
        n = g.num_seqs * g.num_blocks
        out_nX = buf_X[:n * B * K * H].view(n, B * K * H)
        torch.index_select(pool_PBKH.view(P, -1), 0, g.blocks_SM, out=out_nX)
        return out_nX.view(g.num_seqs, g.num_blocks * B, K, H)[:, :g.context_len].transpose(1, 2)


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
