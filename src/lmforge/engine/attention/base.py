"""What every attention backend shares: the base class (a KV pool, the metadata of the current step,
the `attn(layer_idx, q, k, v)` hook the model calls) and the index builders the backends assemble their
metadata from: `slot_mapping`, decode buckets, gather groups, prefill-chunk groups.

A backend builds its metadata once per step, from the step's block tables (`prepare`), and every layer
reuses it. This module knows nothing about scheduling, sampling, or how a backend attends.

Shape legend: T flat tokens this step, N query heads, K kv heads, H head dim, S sequences in a group,
Q query tokens of a group's sequence, C context length (padded), M blocks per sequence (padded).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from .kv_pool import Group, KVPool

MAX_PADDING = 1.25  # a decode bucket's padded context area may exceed its real one by this factor


@dataclass
class StepIndex:
    """A step's sequences as the builders read them: sequence s computes tokens
    [computed[s], computed[s] + q_lens[s]), its queries at flat rows q_starts[s].. of the step."""
    block_tables: list[list[int]]
    computed: list[int]
    q_lens: list[int]
    q_starts: list[int]

    @classmethod
    def of(cls, block_tables: list[list[int]], computed: list[int], q_lens: list[int]) -> StepIndex:
        starts = list(accumulate(q_lens, initial=0))[:-1]
        return cls(block_tables, computed, q_lens, starts)

    @property
    def decoding(self) -> list[int]:
        """Sequences with one query token."""
        return [i for i, q in enumerate(self.q_lens) if q == 1]


@dataclass
class GroupedMetadata:
    """Slots to write, and the groups that attend over gathered (or fresh) K/V."""
    slot_mapping_T: torch.Tensor  # where each new token's K/V goes
    groups: list[Group]
    max_gather_blocks: int = 0  # the largest group's S*M: the gather buffers' size


class AttentionBackend:
    """The engine's attention callable over one KV pool; subclasses build their own metadata and attend."""

    label = ""  # the backend's name, before the pool's
    contiguous_runs = False  # the allocation it reads fastest: each sequence's blocks one run

    def __init__(self, kv: KVPool):
        self.kv = kv
        self.meta = None  # this step's metadata: set by `prepare`, cleared by `finish`

    @property
    def name(self) -> str:
        return self.label + self.kv.label

    @property
    def bytes_per_block(self) -> int:
        """The KV pool's bytes per block, every layer, k and v."""
        return self.kv.bytes_per_block

    def prepare(self, block_tables: list[list[int]], computed: list[int], q_lens: list[int]) -> None:
        """Build this step's indices once (every layer reuses them) and size the gather buffers."""
        self.meta = self.build(StepIndex.of(block_tables, computed, q_lens))
        self.kv.reserve(getattr(self.meta, "max_gather_blocks", 0))

    def finish(self) -> None:
        self.meta = None

    def build(self, step: StepIndex):
        raise NotImplementedError

    def __call__(self, layer_idx: int, q_BTNH: torch.Tensor, k_BTKH: torch.Tensor,
                 v_BTKH: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def slots(bt: list[int], start: int, stop: int, block_size: int) -> list[int]:
    """Pool rows of a sequence's tokens [start, stop)."""
    return [bt[p // block_size] * block_size + p % block_size for p in range(start, stop)]


def slot_mapping(step: StepIndex, block_size: int, device: torch.device) -> torch.Tensor:
    """(T,) the pool row of every new token this step."""
    rows: list[int] = []
    for bt, c, q in zip(step.block_tables, step.computed, step.q_lens):
        rows += slots(bt, c, c + q, block_size)
    return torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)


def decode_buckets(lens: list[int]) -> list[list[int]]:
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


def gather_group(rows, block_tables: list[list[int]], lens: list[int], q_len: int, block_size: int,
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


def bucket_groups(step: StepIndex, decode: list[int], block_size: int, device: torch.device) -> list[Group]:
    """The decoding sequences `decode`, sorted by context length and cut into buckets whose padding stays
    under `MAX_PADDING` (one long sequence no longer pads a hundred short ones); a gather group each."""
    groups = []
    for bucket in decode_buckets([step.computed[i] + 1 for i in decode]):
        idx = [decode[j] for j in bucket]
        rows = torch.tensor([step.q_starts[i] for i in idx], dtype=torch.long).to(device, non_blocking=True)
        groups.append(gather_group(rows, [step.block_tables[i] for i in idx], [step.computed[i] + 1 for i in idx],
                                   1, block_size, device))
    return groups


def chunk_groups(step: StepIndex, block_size: int, device: torch.device) -> list[Group]:
    """A prefill chunk is its own group: with nothing cached before it, it attends over its own fresh
    K/V (causal SDPA, no gather at all); otherwise it gathers its blocks like a bucket of one."""
    groups = []
    for i, q in enumerate(step.q_lens):
        if q == 1:
            continue
        rows, c = slice(step.q_starts[i], step.q_starts[i] + q), step.computed[i]
        if c == 0:
            groups.append(Group(rows, None, 1, 0, q, None))
        else:
            groups.append(gather_group(rows, [step.block_tables[i]], [c + q], q, block_size, device))
    return groups


def largest_gather(groups: list[Group]) -> int:
    return max((g.num_seqs * g.num_blocks for g in groups), default=0)
