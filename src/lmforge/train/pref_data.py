"""Preference pairs for DPO: TRL's two explicit-prompt formats, tokenized the way TRL's `DPOTrainer` does.

Input: one pair per JSONL line, either

    conversational  {"prompt": [{"role": "user", "content": ...}, ...],
                     "chosen": [{"role": "assistant", "content": ...}],
                     "rejected": [{"role": "assistant", "content": ...}]}      (what `lmforge flywheel build`
                                                                              writes to preferences.jsonl)
    standard        {"prompt": "...", "chosen": "...", "rejected": "..."}

Other keys (`id`, `meta`) are kept out of the way. Tokenization follows TRL 1.16 (`DPOTrainer._prepare_dataset`)
so that the two train on the same ids: conversational pairs render `prompt` with the chat template and a
generation prompt, and `prompt + chosen` / `prompt + rejected` as whole chats; standard pairs tokenize the
strings, with EOS appended to each completion when it does not end with it. The completion starts where the
tokenized prompt and prompt+completion first differ (TRL's `common_prefix_length`), so the completion holds
the assistant's content, its `<|im_end|>` and whatever the template adds after it. Rows longer than
`max_length` are cut at the end (TRL's `keep_start`); a pair whose prompt alone fills `max_length` is dropped
and counted (`.stats`), as TRL drops it.

Batches: B pairs give 2B right-padded rows, chosen first (`input_ids`, `completion_mask` (2B, L) with
`completion_mask[i, t]` = token t of row i is a completion token, and `index` (B,) the pairs' positions in
the file, for precomputed reference log-probs). Order and resume are the SFT loader's: epoch e visits pairs
in `np.random.default_rng(seed + e).permutation`, step s takes the global slice, rank r keeps `[r::W]`, an
incomplete last global batch is skipped; `state_dict()` / `load_state_dict()` resume at the exact next batch.

This module knows nothing about models or the training loop.

    loader = PreferenceLoader("preferences.jsonl", tokenizer, max_length=512, batch_size=4)
    batch = next(loader)  # {"input_ids", "completion_mask": (2B, L), "index": (B,)}

Shape legend: B pairs per batch, L longest prompt + completion in the batch.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from lmforge.track.io import sha256_file


class PreferenceDataError(ValueError):
    """A preference line a person must fix; the message names the file, line and field."""


@dataclass
class PreferenceStats:
    """Counts that reconcile: pairs read = kept + prompt_too_long."""

    read: int = 0
    kept: int = 0
    prompt_too_long: int = 0  # dropped: the prompt alone fills max_length (no completion token left)
    truncated: int = 0  # kept but cut to max_length
    conversational: int = 0
    prompt_diverged: int = 0  # the prompt's tokens are not a prefix of prompt+completion's (TRL warns too)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class Pair:
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]


def _messages(value: Any, where: str, key: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise PreferenceDataError(f"{where}: field {key!r} must be a non-empty list of messages in a "
                                  "conversational pair (or a string in a standard one)")
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise PreferenceDataError(f"{where}: field {key}[{i}] must be an object with string 'role' and 'content'")
    return value


def parse_pair(obj: Any, where: str) -> tuple[Any, Any, Any, bool]:
    """(prompt, chosen, rejected, conversational) of one line, validated."""
    if not isinstance(obj, dict):
        raise PreferenceDataError(f"{where}: each line must be a JSON object with prompt, chosen and rejected")
    for key in ("prompt", "chosen", "rejected"):
        if key not in obj:
            hint = (" (an implicit-prompt pair: put the shared turns in 'prompt')" if key == "prompt" else "")
            raise PreferenceDataError(f"{where}: field {key!r} is missing{hint}")
    if isinstance(obj["prompt"], list):
        return (_messages(obj["prompt"], where, "prompt"), _messages(obj["chosen"], where, "chosen"),
                _messages(obj["rejected"], where, "rejected"), True)
    for key in ("prompt", "chosen", "rejected"):
        if not isinstance(obj[key], str) or (key != "prompt" and not obj[key]):
            raise PreferenceDataError(f"{where}: field {key!r} must be a non-empty string in a standard pair "
                                      "(or all three lists of messages in a conversational one)")
    return obj["prompt"], obj["chosen"], obj["rejected"], False


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def tokenize_pair(tokenizer: Any, prompt: Any, chosen: Any, rejected: Any, conversational: bool) -> tuple[Pair, bool]:
    """TRL's tokenization of one pair; and whether the prompt's ids were not a prefix of the completion's."""
    if conversational:
        def ids(messages: list[dict], **kw: Any) -> list[int]:
            out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)
            return list(out["input_ids"])

        prompt_ids = ids(prompt, add_generation_prompt=True)
        chosen_full, rejected_full = ids(prompt + chosen), ids(prompt + rejected)
    else:
        eos = tokenizer.eos_token or ""
        chosen, rejected = (c if c.endswith(eos) else c + eos for c in (chosen, rejected))
        prompt_ids = list(tokenizer(prompt)["input_ids"])
        chosen_full = list(tokenizer(prompt + chosen)["input_ids"])
        rejected_full = list(tokenizer(prompt + rejected)["input_ids"])
    n = min(common_prefix_length(prompt_ids, chosen_full), common_prefix_length(prompt_ids, rejected_full))
    return Pair(prompt_ids[:n], chosen_full[n:], rejected_full[n:]), n < len(prompt_ids)


def collate(pairs: list[Pair], pad_id: int, max_length: int | None) -> dict[str, torch.Tensor]:
    """2B right-padded rows (chosen rows first, then rejected) and their completion masks."""
    rows = [p.prompt_ids + p.chosen_ids for p in pairs] + [p.prompt_ids + p.rejected_ids for p in pairs]
    masks = ([[0] * len(p.prompt_ids) + [1] * len(p.chosen_ids) for p in pairs]
             + [[0] * len(p.prompt_ids) + [1] * len(p.rejected_ids) for p in pairs])
    if max_length is not None:
        rows, masks = [r[:max_length] for r in rows], [m[:max_length] for m in masks]
    L = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((len(rows), L), dtype=torch.long)
    for i, (r, m) in enumerate(zip(rows, masks)):
        input_ids[i, :len(r)] = torch.tensor(r)
        completion_mask[i, :len(m)] = torch.tensor(m)
    return {"input_ids": input_ids, "completion_mask": completion_mask}


def read_pairs(path: str, tokenizer: Any, max_length: int | None) -> tuple[list[Pair], PreferenceStats]:
    stats, pairs = PreferenceStats(), []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise PreferenceDataError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            prompt, chosen, rejected, conv = parse_pair(obj, where)
            pair, diverged = tokenize_pair(tokenizer, prompt, chosen, rejected, conv)
            stats.read += 1
            stats.conversational += conv
            stats.prompt_diverged += diverged
            if not pair.chosen_ids or not pair.rejected_ids:
                raise PreferenceDataError(f"{where}: 'chosen' or 'rejected' tokenizes to nothing after the prompt")
            if max_length is not None and len(pair.prompt_ids) >= max_length:
                stats.prompt_too_long += 1
                continue
            longest = len(pair.prompt_ids) + max(len(pair.chosen_ids), len(pair.rejected_ids))
            stats.truncated += max_length is not None and longest > max_length
            pairs.append(pair)
    stats.kept = len(pairs)
    if stats.prompt_too_long:
        warnings.warn(f"{path}: {stats.prompt_too_long} pair(s) whose prompt alone fills max_length={max_length} "
                      "tokens were dropped", stacklevel=3)
    if not pairs:
        raise PreferenceDataError(f"{path}: no preference pair to train on (empty file, or every prompt is longer "
                                  f"than max_length={max_length}: raise train.seq_len)")
    return pairs, stats


class PreferenceLoader:
    """Endless batches of preference pairs; see the module docstring."""

    def __init__(self, path: str | os.PathLike, tokenizer: Any, max_length: int | None, batch_size: int,
                 seed: int = 0, rank: int = 0, world_size: int = 1, device: str | torch.device = "cpu"):
        if batch_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"batch_size must be >= 1 and rank in [0, {world_size}), got {batch_size}, {rank}")
        self.path, self.max_length, self.batch_size = os.fspath(path), max_length, batch_size
        self.seed, self.rank, self.world_size, self.device = seed, rank, world_size, torch.device(device)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"{self.path}: no such preference file; `lmforge flywheel build` writes one "
                                    "(preferences.jsonl), or give JSONL with prompt/chosen/rejected")
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else tokenizer.eos_token_id
        self.data_hash = sha256_file(self.path)
        self.pairs, self.stats = read_pairs(self.path, tokenizer, max_length)
        self.global_batch = batch_size * world_size
        self.steps_per_epoch = len(self.pairs) // self.global_batch
        if self.steps_per_epoch == 0:
            raise ValueError(f"{self.path}: {len(self.pairs)} pairs are fewer than one global batch (batch_size "
                             f"{batch_size} x world_size {world_size}); use a smaller batch, or more pairs")
        self.epoch, self.step = 0, 0

    def batch_of(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """The batch of the pairs at these file positions (precomputing reference log-probs walks the file)."""
        batch = collate([self.pairs[i] for i in indices], self.pad_id, self.max_length)
        batch["index"] = torch.tensor(indices, dtype=torch.long)
        return {k: v.to(self.device) for k, v in batch.items()}

    def __iter__(self) -> PreferenceLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.step >= self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
        lo = self.step * self.global_batch
        order = np.random.default_rng(self.seed + self.epoch).permutation(len(self.pairs))
        mine = order[lo:lo + self.global_batch][self.rank::self.world_size]
        self.step += 1
        return self.batch_of([int(i) for i in mine])

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "step": self.step, "seed": self.seed, "global_batch": self.global_batch,
                "num_pairs": len(self.pairs), "max_length": self.max_length, "data_hash": self.data_hash}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        for key in ("seed", "global_batch", "num_pairs", "max_length", "data_hash"):
            if state[key] != mine[key]:
                raise ValueError(f"preference loader state has {key}={state[key]!r} but this loader has "
                                 f"{mine[key]!r} ({self.path}); resume with the same file, seed, seq_len and "
                                 "batch_size x world_size")
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
