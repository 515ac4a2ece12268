"""The one Checkpointer (train/checkpoint.py) on plain Stateful components, no trainer: what it writes,
what it restores, its interval, and the behaviours the trainers' former copies disagreed on (a resume
deletes newer invalid checkpoints, for every trainer; a checkpoint from another process count is refused)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from lmforge.config import ConfigError
from lmforge.train import checkpoint as ckpt


class Box:
    def __init__(self, value: int = 0):
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


class Counters:
    step = tokens_seen = 0


def _checkpointer(out, box, counters, every=2):
    return ckpt.Checkpointer(out, {"box": box, "counters": ckpt.Attributes(counters, ("step", "tokens_seen")),
                                   "loader": Box(7), "rng": ckpt.RNGState()}, every=every, keep_last=2,
                             per_rank=("loader", "rng"), flat=("counters",))


def test_save_writes_the_old_layout_and_restore_brings_every_component_back(tmp_path):
    box, counters = Box(3), Counters()
    counters.step, counters.tokens_seen = 4, 128
    c = _checkpointer(tmp_path, box, counters)
    assert [c.due(s, done=False) for s in (1, 2, 3, 4)] == [False, True, False, True] and c.due(5, done=True)
    random.seed(1)
    path = c.save(4, lambda: {"val_loss": 1.5})
    expected = random.random()
    state = ckpt.load_state(path)
    assert list(state) == ["box", "step", "tokens_seen", "loader", "rng"]  # flat counters, per-rank lists
    assert state["loader"] == [{"value": 7}] and state["step"] == 4
    meta = json.loads((path / ckpt.META).read_text())
    assert meta["val_loss"] == 1.5 and meta["step"] == 4 and meta["state_sha256"]

    box2, counters2 = Box(), Counters()
    c2 = _checkpointer(tmp_path, box2, counters2)
    found = c2.restore()
    assert found is not None and found[0] == path == c2.last
    assert (box2.value, counters2.step, counters2.tokens_seen) == (3, 4, 128)
    assert random.random() == expected  # the RNG stream continues where the save left it


def test_restore_deletes_newer_invalid_checkpoints_and_refuses_another_process_count(tmp_path):
    c = _checkpointer(tmp_path, Box(1), Counters())
    good = c.save(2, dict)
    bad = tmp_path / ckpt.CKPT_DIR / ckpt.checkpoint_name(3)
    bad.mkdir()
    (bad / ckpt.STATE).write_bytes(b"torn")
    (bad / ckpt.META).write_text(json.dumps({"step": 3, "state_sha256": "0" * 64}))
    with pytest.warns(UserWarning, match="does not match"):
        found = _checkpointer(tmp_path, Box(), Counters()).restore()
    assert found[0] == good and not bad.exists()

    state = ckpt.load_state(good)
    state["loader"] = state["loader"] * 2  # as if two processes had written it
    torch.save(state, good / ckpt.STATE)
    meta = json.loads((good / ckpt.META).read_text())
    meta["state_sha256"] = ckpt.sha256_file(good / ckpt.STATE)
    (good / ckpt.META).write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="written by 2 processes"):
        _checkpointer(tmp_path, Box(), Counters()).restore()
