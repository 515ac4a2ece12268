"""Training checkpoints: atomic, verifiable, pruned to the last K plus the best.

A checkpoint is a folder `checkpoints/step-00000100/` holding `state.pt` (model, optimizer,
scheduler, grad scaler, step, tokens seen, data-loader position, RNG states of python, numpy,
torch and CUDA) and `meta.json` (step, val loss, config, git commit, sha256 of `state.pt`).
It is written under a temporary name and renamed into place, and `meta.json` is written last,
so a folder without a valid `meta.json`, or whose `state.pt` does not match its hash, is a
partial or corrupt checkpoint: `latest_valid` skips it with a warning. Knows nothing about
the training loop beyond the dict it is handed.

    path = save_checkpoint(run_dir, step, state, meta, keep_last=2)
    found = latest_valid(run_dir)          # (path, meta) or None
"""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmforge.track.io import atomic_write_json, sha256_file

CKPT_DIR = "checkpoints"
STATE, META = "state.pt", "meta.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the folder and why."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: str | os.PathLike, step: int, state: dict[str, Any], meta: dict[str, Any],
                    keep_last: int = 2) -> Path:
    """Write `state` and `meta` as checkpoint `step`, atomically; then prune old ones."""
    root = Path(run_dir) / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    tmp = root / f".tmp-{checkpoint_name(step)}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    with open(tmp / STATE, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    atomic_write_json(tmp / META, {**meta, "step": step, "state_sha256": sha256_file(tmp / STATE)})
    if final.exists():  # a rerun of the same step after a resume: replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    prune(root, keep_last)
    return final


def read_meta(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: no readable {META} ({e}); the write was interrupted") from None
    if not (path / STATE).is_file():
        raise CheckpointError(f"{path}: {STATE} is missing")
    if sha256_file(path / STATE) != meta.get("state_sha256"):
        raise CheckpointError(f"{path}: {STATE} does not match the sha256 in {META} (corrupt)")
    return meta


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Checkpoint folders, oldest first (temporary ones excluded)."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))


def latest_valid(run_dir: str | os.PathLike) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that verifies, warning about each newer one that does not."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            return path, read_meta(path)
        except CheckpointError as e:
            warnings.warn(f"skipping checkpoint: {e}", stacklevel=2)
    return None


def best_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint with the lowest recorded val loss (None when no checkpoint has one)."""
    scored = []
    for path in list_checkpoints(run_dir):
        try:
            meta = json.loads((path / META).read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if meta.get("val_loss") is not None:
            scored.append((meta["val_loss"], meta["step"], path))
    return min(scored)[2] if scored else None


def resolve_checkpoint(run_dir: str | os.PathLike, which: str = "last") -> tuple[Path, dict[str, Any]]:
    """`last`, `best` or a folder name such as `step-00000100`, verified."""
    if which == "last":
        found = latest_valid(run_dir)
        if found is None:
            raise CheckpointError(f"{run_dir}: no valid checkpoint in {CKPT_DIR}/; train first")
        return found
    path = best_checkpoint(run_dir) if which == "best" else Path(run_dir) / CKPT_DIR / which
    if path is None or not path.is_dir():
        raise CheckpointError(f"{run_dir}: no checkpoint {which!r}; have "
                              f"{[p.name for p in list_checkpoints(run_dir)]}")
    return path, read_meta(path)


def load_state(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    # weights_only=False: the state holds RNG states and numpy arrays, and it is our own file.
    return torch.load(path / STATE, map_location=map_location, weights_only=False)


def prune(root: Path, keep_last: int) -> None:
    """Keep the `keep_last` newest checkpoints and the best one; delete the rest."""
    paths = list_checkpoints(root.parent)
    keep = set(paths[-keep_last:]) if keep_last > 0 else set(paths[-1:])
    best = best_checkpoint(root.parent)
    if best is not None:
        keep.add(best)
    for path in paths:
        if path not in keep:
            shutil.rmtree(path, ignore_errors=True)
