"""Read packed token shards (`lmforge-packed-v1`, written by `lmforge.data.pack`) as training batches.

`PackedDataset` memory-maps one split and returns rows of `seq_len + 1` tokens (row `i` is
`stream[i*T : i*T + T + 1]`). `PackedLoader` turns rows into batches, forever:

    input_ids    (B, T)  row[:-1]
    labels       (B, T)  row[1:], with -100 where the input token is EOS: the token after an
                         EOS is the next document's BOS, which is not predicted across a boundary
    doc_ids      (B, T)  document index within the row (0, 1, ...); an EOS belongs to the
                         document it ends, so attention masks `doc_ids[q] == doc_ids[k]`
    position_ids (B, T)  restart at 0 at each document start and at the row start

Order: epoch `e` visits rows in `np.random.default_rng(seed + e).permutation(num_rows)` (or in
order with `shuffle=False`). Step `s` takes the global slice `order[s*B*W : (s+1)*B*W]` and rank
`r` keeps every `W`-th row of it (`[r::W]`), so `W` ranks with batch `B` see exactly the rows one
process with batch `W*B` sees, and no row twice. An incomplete last global batch of an epoch is
skipped. `state_dict()` holds `(epoch, step)`; `load_state_dict` resumes with the identical next batch.
It knows nothing about models, optimizers or tokenizers.

    loader = PackedLoader("runs/packed", "train", batch_size=8, rank=rank, world_size=world)
    batch = next(loader); state = loader.state_dict(); ...; loader.load_state_dict(state)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

IGNORE_INDEX = -100


class PackedDataset:
    """One split of a packed folder: `num_rows` rows of `seq_len + 1` tokens, memory-mapped."""

    def __init__(self, path: str | os.PathLike, split: str = "train"):
        self.path = Path(path)
        manifest_path = self.path / "manifest.json"
        if not manifest_path.is_file():
            raise FileNotFoundError(f"{self.path}: no manifest.json; pack a prepared folder with "
                                    f"`lmforge data pack PREPARED --tokenizer TOK --seq-len N --out {self.path}`")
        self.manifest: dict[str, Any] = json.loads(manifest_path.read_text())
        if self.manifest.get("format") != "lmforge-packed-v1":
            raise ValueError(f"{manifest_path}: format {self.manifest.get('format')!r} is not "
                             "'lmforge-packed-v1'; repack with `lmforge data pack`")
        if split not in self.manifest["splits"]:
            raise KeyError(f"{manifest_path}: no split {split!r}; it has {sorted(self.manifest['splits'])}")
        info = self.manifest["splits"][split]
        self.split = split
        self.seq_len: int = int(self.manifest["seq_len"])
        self.num_rows: int = int(info["rows"])
        self.eos_token_id: int = int(self.manifest["eos_token_id"])
        dtype = np.dtype(self.manifest["dtype"])
        self._shards = [np.memmap(self.path / name, dtype=dtype, mode="r") if n else np.zeros(0, dtype)
                        for name, n in zip(info["files"], info["file_tokens"])]
        self._starts = np.cumsum([0] + [len(s) for s in self._shards])  # stream offset of each shard
        if self._starts[-1] != info["tokens"]:
            raise ValueError(f"{self.path}: shards of {split!r} hold {self._starts[-1]} tokens, manifest says "
                             f"{info['tokens']}; the folder is incomplete, repack it")

    def __len__(self) -> int:
        return self.num_rows

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Stream tokens [start, stop) as int64, across shard boundaries."""
        parts = []
        k = int(np.searchsorted(self._starts, start, side="right")) - 1
        while start < stop:
            shard, offset = self._shards[k], start - self._starts[k]
            take = min(stop - start, len(shard) - offset)
            parts.append(shard[offset:offset + take])
            start += take
            k += 1
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    def row(self, i: int) -> np.ndarray:
        """Row `i`: `seq_len + 1` tokens (inputs are `[:-1]`, next-token targets `[1:]`)."""
        if not 0 <= i < self.num_rows:
            raise IndexError(f"row {i} out of range for {self.num_rows} rows of split {self.split!r}")
        return self.tokens(i * self.seq_len, i * self.seq_len + self.seq_len + 1)


def batch_from_rows(rows_BT1: np.ndarray, eos_token_id: int) -> dict[str, np.ndarray]:
    """input_ids, labels, doc_ids, position_ids (each (B, T)) from rows of T + 1 tokens."""
    input_ids_BT = rows_BT1[:, :-1]
    labels_BT = rows_BT1[:, 1:].copy()
    is_eos_BT = input_ids_BT == eos_token_id
    labels_BT[is_eos_BT] = IGNORE_INDEX  # no prediction across a document boundary
    doc_ids_BT = np.cumsum(is_eos_BT, axis=1) - is_eos_BT  # EOS counts toward the document it ends
    T = input_ids_BT.shape[1]
    idx_BT = np.broadcast_to(np.arange(T), input_ids_BT.shape)
    starts_BT = np.ones_like(is_eos_BT)
    starts_BT[:, 1:] = is_eos_BT[:, :-1]  # a document starts after each EOS
    last_start_BT = np.maximum.accumulate(np.where(starts_BT, idx_BT, 0), axis=1)
    return {"input_ids": input_ids_BT, "labels": labels_BT, "doc_ids": doc_ids_BT,
            "position_ids": idx_BT - last_start_BT}


class PackedLoader:
    """Endless, resumable, rank-sharded batches of packed rows (see the module docstring)."""

    def __init__(self, path: str | os.PathLike, split: str = "train", batch_size: int = 8, seed: int = 0,
                 shuffle: bool = True, rank: int = 0, world_size: int = 1, device: Any = "cpu"):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} must lie in [0, world_size={world_size})")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.dataset = PackedDataset(path, split)
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.rank, self.world_size, self.device = rank, world_size, device
        self.global_batch = batch_size * world_size
        self.steps_per_epoch = self.dataset.num_rows // self.global_batch
        if self.steps_per_epoch == 0:
            raise ValueError(f"{path} split {split!r} has {self.dataset.num_rows} rows, fewer than one global "
                             f"batch (batch_size {batch_size} x world_size {world_size}); use a smaller "
                             "batch or seq_len, or more data")
        self.tokens_per_batch = batch_size * self.dataset.seq_len  # input positions per batch on this rank
        self.epoch, self.step = 0, 0
        self._order_epoch, self._order = -1, np.zeros(0, np.int64)

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            n = self.dataset.num_rows
            self._order = (np.random.default_rng(self.seed + self.epoch).permutation(n) if self.shuffle
                           else np.arange(n))
            self._order_epoch = self.epoch
        return self._order

    def __iter__(self) -> PackedLoader:
        return self

    def __next__(self) -> dict[str, Any]:
        if self.step >= self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
        lo = self.step * self.global_batch
        mine = self._epoch_order()[lo:lo + self.global_batch][self.rank::self.world_size]
        rows_BT1 = np.stack([self.dataset.row(int(i)) for i in mine])
        self.step += 1
        batch = batch_from_rows(rows_BT1, self.dataset.eos_token_id)
        return {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.int64)).to(self.device)
                for k, v in batch.items()}

    def state_dict(self) -> dict[str, Any]:
        """Where the next batch comes from; `load_state_dict` of it resumes exactly."""
        return {"epoch": self.epoch, "step": self.step, "seed": self.seed, "shuffle": self.shuffle,
                "global_batch": self.global_batch, "num_rows": self.dataset.num_rows,
                "split": self.dataset.split, "data_hash": self.dataset.manifest.get("data_hash")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        for key in ("seed", "shuffle", "global_batch", "num_rows"):
            if state[key] != mine[key]:
                raise ValueError(f"loader state has {key}={state[key]!r} but this loader has {mine[key]!r}; "
                                 "resume with the same seed, shuffle, batch_size x world_size and packed data")
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
