"""SFT on reasoning traces end to end, the way a user runs it: `lmforge data synth` and `lmforge train`
with `train.stage=sft` on the task rows as subprocesses, then export and an arith-cot evaluation
(chat template, the `answer` metric) of the result. A tiny model: this checks the plumbing, not accuracy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LMFORGE = [sys.executable, "-m", "lmforge.cli"]
pytestmark = pytest.mark.usefixtures("one_thread")


def run(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([*LMFORGE, *args], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_sft_on_traces_end_to_end(tmp_path):
    from lmforge.eval.backends import TransformerBackend
    from lmforge.eval.evaluate import evaluate
    from lmforge.tasks.suite import load_suite
    from lmforge.tokenizer import train_tokenizer
    from lmforge.train.export import export_run

    tasks = tmp_path / "tasks.jsonl"
    out = run("data", "synth", "add", "--n", "48", "--seed", "3", "--out", str(tasks))
    assert "overlap with arith-cot 0" in out.stdout.replace("\n", " ")
    train_tokenizer([str(tasks)], tmp_path / "tok", vocab_size=320, show_progress=False)
    run("train", str(ROOT / "configs/reasoning-sft.yaml"), f"data.path={tasks}", f"data.val_path={tasks}",
        f"data.tokenizer={tmp_path / 'tok'}", "model.hidden_size=32", "model.intermediate_size=64",
        "model.num_hidden_layers=1", "train.max_steps=3", "train.batch_size=2", "train.eval_every=0",
        "train.ckpt_every=0", "train.eval_batches=1", "--out", str(tmp_path / "sft"))
    record = json.loads((tmp_path / "sft" / "record.json").read_text())
    assert record["status"] == "finished" and record["stage"] == "sft"
    assert record["results"]["final_val_loss"] > 0 and record["results"]["steps"] == 3
    from lmforge.track.io import sha256_file

    assert record["data_hash"] == sha256_file(tasks)  # the task rows themselves were the SFT data
    model = export_run(tmp_path / "sft", tmp_path / "model")
    import dataclasses

    suite = load_suite("arith-cot")  # its items, chat template and metric; 16 new tokens keep a random model short
    suite = dataclasses.replace(suite, settings={**suite.settings, "max_tokens": 16})
    res = evaluate(TransformerBackend(model, dtype="float32"), [suite], tmp_path / "eval", model_dir=model, limit=2)
    t = res["tasks"]["arith-cot"]
    assert t["metric"] == "acc" and t["n"] == 2 and 0.0 <= t["value"] <= 1.0
    samples = [json.loads(x) for x in (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()]
    assert all("category" in s and "extracted" in s for s in samples)
    assert any(k.startswith("acc/") for k in t["metrics"])
