"""Training checkpoints: atomic, verifiable, pruned to the last K plus the best.

A checkpoint is a folder `checkpoints/step-00000100/` holding `state.pt` (model, optimizer,
scheduler, grad scaler, step, tokens seen, data-loader position, RNG states of python, numpy,
torch and CUDA) and `meta.json` (step, val loss, config, git commit, sha256 of `state.pt`).
It is written under a temporary name and renamed into place, and `meta.json` is written last,
so a folder without a valid `meta.json`, or whose `state.pt` does not match its hash, is a
partial or corrupt checkpoint: `latest_valid` skips it with a warning.

`Checkpointer` is the one way every trainer (pretrain, SFT, GRPO, tensor/pipeline/FSDP parallel)
saves and restores: it takes named `Stateful` components (model, optimizer, scheduler, data loader,
RNG, counters, GRPO's task sampler), assembles them into that format, writes on its interval and
restores them, as torchtitan's `CheckpointManager` does. It knows nothing about the training loop
beyond the components it is handed.

    ckpt = Checkpointer(run_dir, {"model": model, "optimizer": opt, "rng": RNGState()}, every=100, keep_last=2)
    if ckpt.due(step, done): ckpt.save(step, lambda: {"val_loss": v})
    found = ckpt.restore()                 # (path, meta) or None
"""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np
import torch
import torch.distributed as dist

from lmforge.config import ConfigError
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


def tmp_dir(run_dir: str | os.PathLike, step: int) -> Path:
    """Where checkpoint `step` is assembled before it is renamed into place."""
    return Path(run_dir) / CKPT_DIR / f".tmp-{checkpoint_name(step)}"


def save_checkpoint(run_dir: str | os.PathLike, step: int, state: dict[str, Any], meta: dict[str, Any],
                    keep_last: int = 2, more_meta: Callable[[Path], dict[str, Any]] | None = None) -> Path:
    """Write `state` and `meta` as checkpoint `step`, atomically; then prune old ones. With `more_meta`,
    the temporary folder already holds other files (shards written by every rank): they are kept, and
    `more_meta(tmp)` (their hashes) is added to meta.json."""
    root = Path(run_dir) / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    tmp = tmp_dir(run_dir, step)
    if more_meta is None:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    with open(tmp / STATE, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    meta = {**meta, "step": step, "state_sha256": sha256_file(tmp / STATE)}
    atomic_write_json(tmp / META, {**meta, **(more_meta(tmp) if more_meta else {})})  # last: without it, partial
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


# ---- the checkpointer: Stateful components in, one checkpoint out (torchtitan's CheckpointManager) ----------


class Stateful(Protocol):
    """What the checkpointer saves: anything that hands out and takes back its own state."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class RNGState:
    """The python, numpy, torch (and CUDA) generators of this process, as one component."""

    def state_dict(self) -> dict[str, Any]:
        return rng_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_rng_state(state)


class SaveOnly:
    """A component written for readers other than the resume (the unsharded model of a sharded run, the
    layout it ran with): `state()` at save time, nothing to load back."""

    def __init__(self, state: Callable[[], dict[str, Any]]):
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class Attributes:
    """Named attributes of an object (a trainer's step and token counters) as one component."""

    def __init__(self, obj: Any, names: tuple[str, ...]):
        self.obj, self.names = obj, names

    def state_dict(self) -> dict[str, Any]:
        return {n: getattr(self.obj, n) for n in self.names}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for n in self.names:
            setattr(self.obj, n, state[n])


class Shards(Protocol):
    """State that every rank writes itself (sharded model and optimizer), beside state.pt."""

    def save(self, tmp: Path) -> None: ...

    def hashes(self, tmp: Path) -> dict[str, Any]: ...

    def load(self, path: Path, meta: dict[str, Any]) -> None: ...


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Checkpointer:
    """Assembles named Stateful components into one checkpoint, writes it atomically every `every` steps
    (and at the end), verifies and restores it. Collective under torch.distributed: every rank calls
    `save` and `restore`; rank 0 writes state.pt and meta.json.

    components  name -> Stateful, each saved under its name (in this order; restored in this order)
    per_rank    names saved as a list with one entry per process (data-loader position, RNG streams)
                and restored from this process's entry; a checkpoint from another process count is refused
    flat        names whose state dict is spread into the top level of state.pt (the step counters)
    shards      written by every rank into the checkpoint folder (`Shards`), hashed into meta.json
    validate    (state, path) -> None, raises first when the checkpoint does not fit this run
    """

    def __init__(self, out: str | os.PathLike, components: dict[str, Stateful], every: int, keep_last: int,
                 per_rank: tuple[str, ...] = (), flat: tuple[str, ...] = (), shards: Shards | None = None,
                 validate: Callable[[dict[str, Any], Path], None] | None = None):
        self.out, self.components, self.every, self.keep_last = Path(out), components, every, keep_last
        self.per_rank, self.flat, self.shards, self.validate = per_rank, flat, shards, validate
        self.last: Path | None = None

    def due(self, step: int, done: bool) -> bool:
        return done or bool(self.every and step % self.every == 0)

    def _state(self) -> dict[str, Any]:
        """Every component's state; per-rank ones gathered from every process (collective)."""
        rank, world = _rank_world()
        state: dict[str, Any] = {}
        for name, c in self.components.items():
            own = c.state_dict()
            if name in self.per_rank:
                gathered: list[Any] = [None] * world
                if world > 1:
                    dist.all_gather_object(gathered, own)
                else:
                    gathered = [own]
                state[name] = gathered
            elif name in self.flat:
                state.update(own)
            else:
                state[name] = own
        return state

    def save(self, step: int, meta: Callable[[], dict[str, Any]]) -> Path | None:
        """Write checkpoint `step` (collective); its path on rank 0, None elsewhere. `meta()` runs on rank 0."""
        rank, _ = _rank_world()
        tmp = tmp_dir(self.out, step)
        if self.shards is not None:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            dist.barrier()
        state = self._state()
        if self.shards is not None:
            self.shards.save(tmp)
            dist.barrier()
        path = None
        if rank == 0:
            more = self.shards.hashes if self.shards is not None else None
            path = self.last = save_checkpoint(self.out, step, state, meta(), self.keep_last, more)
        if self.shards is not None:
            dist.barrier()
        return path

    def restore(self) -> tuple[Path, dict[str, Any]] | None:
        """Load the newest valid checkpoint into the components (collective) and delete the newer,
        invalid ones; (path, meta), or None when there is none."""
        found = latest_valid(self.out)
        if found is None:
            return None
        path, meta = found
        rank, world = _rank_world()
        state = load_state(path, map_location="cpu")  # RNG states must stay CPU tensors; load_state_dict moves the rest
        if self.validate is not None:
            self.validate(state, path)
        for name in self.per_rank:
            if len(state[name]) != world:
                raise ConfigError(f"{path} was written by {len(state[name])} processes; resume with the same "
                                         f"--nproc-per-node (now {world})")
        if self.shards is not None:
            self.shards.load(path, meta)
        for name, c in self.components.items():
            c.load_state_dict(state if name in self.flat else state[name][rank] if name in self.per_rank
                              else state[name])
        self.last = path
        if self.shards is not None:
            dist.barrier()
        if rank == 0:
            for newer in list_checkpoints(self.out):  # partial/corrupt ones latest_valid skipped
                if newer.name > path.name:
                    shutil.rmtree(newer, ignore_errors=True)
        return path, meta
