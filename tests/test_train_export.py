"""`lmforge export` (HF layout, LoRA merged, tokenizer, stop ids) and `lmforge runs list/show/compare`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_train_loop import TINY, make_packed  # noqa: E402  (tests/ is on sys.path under pytest)


def lmforge(module: str, *args: str) -> subprocess.CompletedProcess:
    """A verb as users run it: `python -m lmforge.train ...` or the export/runs Typer apps."""
    if module == "train":
        cmd = [sys.executable, "-m", "lmforge.train"]
    else:  # the `export` verb of lmforge.train.commands, or the `runs` group of lmforge.track.commands
        app = "lmforge.train.commands" if module == "export" else "lmforge.track.commands"
        cmd = [sys.executable, "-c", f"from {app} import app; app()"] + (["export"] if module == "export" else [])
    proc = subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "LMFORGE_HOME": "/nonexistent-lmforge-home"})
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("exp")
    packed = make_packed(root / "data", n_docs=60)
    common = [TINY, f"data.path={packed}", "train.max_steps=4", "train.eval_every=2", "train.ckpt_every=2"]
    full = lmforge("train", *common, "--out", root / "runs" / "full")
    assert "mfu is null" in full.stderr and "lmforge doctor" in full.stderr  # no profile: warn, don't crash
    lmforge("train", *common, "train.method=lora", "lora.rank=4", "train.lr=1e-2", "--out", root / "runs" / "lora")
    return root / "runs"


@pytest.mark.parametrize("method", ["full", "lora"])
def test_export_loads_in_transformers_and_engine(runs, tmp_path, method):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmforge.model import Transformer
    from lmforge.train.export import load_run_model

    out = tmp_path / "model"
    lmforge("export", runs / method, "--out", out)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [1, 4]
    assert json.loads((runs / method / "record.json").read_text())["results"]["mfu"] is None
    ours, _ = load_run_model(runs / method)
    engine = Transformer.from_pretrained(out, dtype="float32", device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tok("Return the absolute value of the argument.")["input_ids"]])
    with torch.no_grad():
        ref = ours(ids)
        torch.testing.assert_close(engine(ids), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(hf(ids).logits, ref, atol=1e-4, rtol=1e-4)
    if method == "lora":
        assert not any("lora" in k for k in engine.state_dict())
        base = Transformer(engine.config).init_weights(0)  # the run's seed: LoRA moved q_proj off the init
        q = "model.layers.0.self_attn.q_proj.weight"
        assert not torch.equal(engine.state_dict()[q], base.state_dict()[q])


def test_runs_list_show_compare(runs, tmp_path):
    listed = lmforge("runs", "list", runs).stdout
    assert "full" in listed and "lora" in listed and "finished" in listed
    shown = json.loads(lmforge("runs", "show", runs / "full").stdout)
    assert shown["method"] == "full" and shown["results"]["steps"] == 4
    cmp = lmforge("runs", "compare", runs / "full", runs / "lora", "--plot", tmp_path / "cmp.png").stdout
    assert "train.method" in cmp and "lora" in cmp and "loss by step" in cmp
    assert (tmp_path / "cmp.png").stat().st_size > 1000
    assert (runs / "full" / "loss.png").is_file()
