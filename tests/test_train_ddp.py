"""DDP through torchrun: 2 CPU processes (gloo) with batch b train exactly like 1 process with batch 2b
and like 1 process with batch b and accumulation 2 (same losses within 1e-5 for 10 steps)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from test_train_loop import TINY, make_packed  # noqa: E402  (tests/ is on sys.path under pytest)


def lmforge_train(*args: str, nproc: int = 1) -> subprocess.CompletedProcess:
    """`python -m lmforge.train`, or `torchrun --nproc-per-node N -m lmforge.train` when nproc > 1."""
    if nproc == 1:
        cmd = [sys.executable, "-m", "lmforge.train"]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "lmforge.train"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True, env=env, timeout=1200)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_ddp_two_processes_match_one(tmp_path):
    packed = make_packed(tmp_path / "data", n_docs=60)
    common = [TINY, f"data.path={packed}", "train.max_steps=10", "train.eval_every=5", "train.ckpt_every=0",
              "train.eval_batches=1"]
    lmforge_train(*common, "train.batch_size=2", "--out", tmp_path / "ddp", nproc=2)
    lmforge_train(*common, "train.batch_size=4", "--out", tmp_path / "single")
    lmforge_train(*common, "train.batch_size=2", "train.grad_accum=2", "--out", tmp_path / "accum")
    ddp, single, accum = (losses(tmp_path / n) for n in ("ddp", "single", "accum"))
    assert len(ddp) == len(single) == 10
    assert ddp == pytest.approx(single, abs=1e-5)
    assert accum == pytest.approx(single, abs=1e-5)
    rec = json.loads((tmp_path / "ddp" / "record.json").read_text())
    assert rec["world_size"] == 2 and rec["effective_batch"] == 4 and rec["status"] == "finished"
    assert not (tmp_path / "ddp" / "checkpoints" / "step-00000010" / "state.pt").stat().st_size == 0
