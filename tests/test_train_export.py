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
    positions = json.loads((out / "config.json").read_text())["max_position_embeddings"]
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == positions != 2048
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


def test_a_lora_run_exports_a_peft_adapter_that_peft_loads(runs, tmp_path):
    """`lmforge export RUN --adapter A --out M` on a LoRA run over a base folder: peft's PeftModel over the base
    with A gives the logits of the merged M."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hf_models import save_hf_model
    from lmforge.config import load_config
    from lmforge.train.config import TrainConfig
    from lmforge.train.loop import train

    base = save_hf_model("llama", tmp_path / "base", vocab_size=384, hidden_size=64, layers=2, intermediate_size=176,
                         num_attention_heads=4, num_key_value_heads=2)
    packed = runs.parent / "data" / "packed"  # the module's data: its tokenizer has 384 ids, as the base
    train(load_config(TrainConfig, TINY, [f"data.path={packed}", f"model.init={base}", "train.max_steps=2",
                                          "train.method=lora", "lora.rank=4", "train.lr=3e-2", "train.eval_every=2",
                                          "train.ckpt_every=2"]), tmp_path / "run")
    proc = lmforge("export", tmp_path / "run", "--adapter", tmp_path / "adapter", "--out", tmp_path / "merged")
    assert "peft adapter over" in proc.stdout
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["base_model_name_or_path"] == str(base)
    ids = torch.tensor([[5, 9, 30, 7, 100, 3, 8, 41]])
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                                tmp_path / "adapter").eval()(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()(ids).logits
    torch.testing.assert_close(peft_logits, merged, atol=1e-4, rtol=1e-4)
    assert (peft_logits - plain).abs().max() > 1e-3  # the adapter moved the model: the check above has teeth


def test_adapter_of_a_full_run_is_refused(runs, tmp_path):
    from typer.testing import CliRunner

    from lmforge.cli import app

    r = CliRunner().invoke(app, ["export", str(runs / "full"), "--adapter", str(tmp_path / "a")])
    assert r.exit_code == 2 and "not LoRA" in r.output
    r = CliRunner().invoke(app, ["export", str(runs / "full")])
    assert r.exit_code == 2 and "--adapter" in r.output


def test_runs_list_show_compare(runs, tmp_path):
    listed = lmforge("runs", "list", runs).stdout
    assert "full" in listed and "lora" in listed and "finished" in listed
    shown = json.loads(lmforge("runs", "show", runs / "full").stdout)
    assert shown["method"] == "full" and shown["results"]["steps"] == 4
    cmp = lmforge("runs", "compare", runs / "full", runs / "lora", "--plot", tmp_path / "cmp.png").stdout
    assert "train.method" in cmp and "lora" in cmp and "loss by step" in cmp
    assert (tmp_path / "cmp.png").stat().st_size > 1000
    assert (runs / "full" / "loss.png").is_file()
