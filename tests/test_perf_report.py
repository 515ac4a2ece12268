"""`lmforge report` (the template from a bench mfu folder and a run) and `lmforge runs diff`,
on records written here: no training needed."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from lmforge.cli import app

MODEL = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 256, "tie_word_embeddings": True}


def write_run(path, peak_mem, torch_version="2.0", data_hash="d1", lr=0.1):
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(f"train:\n  lr: {lr}\n  method: full\n")
    rec = {"status": "finished", "model_config": MODEL, "num_parameters": 120000, "batch_size": 4, "seq_len": 64,
           "dtype": "float32", "device": "cpu", "config": {"train": {"method": "full", "fused_loss": True}},
           "packages": {"torch": torch_version}, "git": {"commit": "abc", "dirty": False}, "data_hash": data_hash,
           "hardware": {"cpu": "x"}, "results": {"tokens_per_s": 1000.0, "mfu": 0.1, "peak_mem": peak_mem,
                                                 "warnings": ["a warning"]}}
    (path / "record.json").write_text(json.dumps(rec))
    return path


def write_ladder(path):
    path.mkdir()
    setting = {"dtype": "float32", "batch_size": 4}
    rungs = [{"step": "0", "change": "baseline", "tokens_per_s": 100.0, "mfu": 0.1, "kept": True, "reason": "ref",
              "note": "", "step_s": 1.0, "data_wait_s": 0.2, "setting": setting, "peak_flops": 1e9},
             {"step": "1", "change": "bf16 autocast", "tokens_per_s": 50.0, "mfu": 0.05, "kept": False,
              "reason": "tensor cores", "note": "slower: not kept", "step_s": 2.0, "data_wait_s": 0.2, "setting": setting},
             {"step": "2", "change": "fused loss", "tokens_per_s": 300.0, "mfu": 0.3, "kept": True, "reason": "no logits",
              "note": "", "step_s": 0.33, "data_wait_s": 0.01, "setting": setting}]
    (path / "bench_mfu.json").write_text(json.dumps({"device": "cpu", "steps": 2, "rungs": rungs, "best": "2",
                                                     "speedup": 3.0, "command": "lmforge bench mfu x", "loadavg": [1, 1, 1],
                                                     "headroom": {"attainable_flops": 1e10, "achieved_flops": 1e9,
                                                                  "headroom": 10.0, "ridge": 1.5, "intensity": 300.0,
                                                                  "device": "cpu"}}))
    return path


def test_report_follows_the_template(tmp_path):
    ladder = write_ladder(tmp_path / "mfu")
    run = write_run(tmp_path / "run", peak_mem=10 * 10**9)  # far above its estimate: an "I expected" row
    out = tmp_path / "report.md"
    res = CliRunner().invoke(app, ["report", str(ladder), str(run), "--out", str(out), "--goal", "MFU 15% -> 40%"])
    assert res.exit_code == 0, res.output
    text = out.read_text()
    for heading in ("# Optimisation goal: MFU 15% -> 40%", "## Baseline", "## Optimisation steps",
                    "## Bottlenecks", "## I expected ___, actually ___", "## How much room is left (roofline)"):
        assert heading in text
    assert "| 2 | fused loss | 300 (30.0%) | +200% | no logits |" in text
    assert "bf16 autocast to be faster" in text and "-50% against the best rung before it" in text
    assert "peak memory (RSS, with framework) ≈" in text and "10,000 MB" in text  # the memory gap row
    assert "waiting for the loader is 20.0% of the step" in text and "10.0× headroom" in text
    res = CliRunner().invoke(app, ["report", str(tmp_path / "nothing"), "--out", str(out)])
    assert res.exit_code == 2 and "neither a run directory" in res.output


def test_runs_diff_names_config_packages_and_data(tmp_path):
    a = write_run(tmp_path / "a", 1e9)
    b = write_run(tmp_path / "b", 1e9, torch_version="2.1", data_hash="d2", lr=0.2)
    res = CliRunner().invoke(app, ["runs", "diff", str(a), str(b)])
    assert res.exit_code == 0, res.output
    assert "train.lr: 0.1  ->  0.2" in res.output and "packages.torch: 2.0  ->  2.1" in res.output
    assert "data_hash: d1  ->  d2" in res.output and "git: identical" in res.output
    data = json.loads(CliRunner().invoke(app, ["runs", "diff", str(a), str(b), "--json"]).output)
    assert data["hardware"] == [] and data["data"][0]["key"] == "data_hash"
