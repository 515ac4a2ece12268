"""`lmforge quickstart --tiny`: the whole chain as a user runs it, every product checked."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

LMFORGE = str(Path(sys.executable).with_name("lmforge"))

PRODUCTS = [
    "doctor/hardware.json",
    "data/splits/train.jsonl", "data/splits/val.jsonl", "data/splits/test.jsonl", "data/stats.json",
    "data/manifest.json", "data/record.json", "data/rejected.jsonl", "data/quarantine.jsonl",
    "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json", "tokenizer/record.json",
    "packed/manifest.json",
    "train/config.yaml", "train/record.json", "train/metrics.jsonl", "train/loss.png",
    "model/config.json", "model/model.safetensors", "model/tokenizer.json", "model/generation_config.json",
    "model/parity.json",
    "eval/results.json", "eval/samples.jsonl", "eval/bad_cases.jsonl", "eval/record.json",
    "bench/bench.json", "bench/bench.md",
    "serve/serve.json",
    "reasoning/data/train.jsonl", "reasoning/data/train.jsonl.record.json", "reasoning/data/val.jsonl",
    "reasoning/data/grpo.jsonl", "reasoning/data/tok/tokenizer.json",
    "reasoning/sft/run/record.json", "reasoning/sft/model/config.json", "reasoning/sft/eval/results.json",
    "reasoning/grpo/run/record.json", "reasoning/grpo/run/metrics.jsonl", "reasoning/grpo/run/reward.png",
    "reasoning/grpo/model/config.json", "reasoning/grpo/eval/results.json",
    "report.md",
]
SECTIONS = ["## From X to Y", "## Data", "## Tokenizer", "## Training", "## Model", "## Evaluation",
            "## Engine", "## Serving", "## Reasoning"]


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    out = tmp_path_factory.mktemp("qs") / "run"
    env = {**os.environ, "LMFORGE_HOME": str(out.parent / "home")}
    t0 = time.perf_counter()
    proc = subprocess.run([LMFORGE, "quickstart", "--tiny", "--out", str(out)], capture_output=True, text=True,
                          env=env, timeout=600)
    return proc, out, time.perf_counter() - t0, env


def test_runs_end_to_end_and_writes_every_product(quickstart):
    proc, out, seconds, _ = quickstart
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    missing = [p for p in PRODUCTS if not (out / p).is_file()]
    assert not missing, missing
    for stage in ("data", "train", "eval"):
        assert json.loads((out / stage / "record.json").read_text())["status"] == "finished"
    print(f"quickstart --tiny: {seconds:.0f} s")


def test_report_has_every_section_with_figures(quickstart):
    _, out, _, _ = quickstart
    report = (out / "report.md").read_text()
    for section in SECTIONS:
        assert section in report, section
    summary = report.split("## From X to Y", 1)[1].split("\n## ", 1)[0]
    for stage in ("Data:", "Tokenizer:", "Training:", "Evaluation:", "Engine:", "Serving:", "Reasoning:"):
        assert stage in summary, stage
    assert re.search(r"Reasoning: accuracy on arith-cot from \d+\.\d% \(SFT\) to \d+\.\d% \(GRPO\), n=16", summary)
    assert "argmax agreement 100%" in report
    assert re.search(r"GRPO's own rollouts \(temperature 1, first / last 1 steps\): accuracy \d+\.\d% → \d+\.\d%, "
                     r"well-formed \d+\.\d% → \d+\.\d%\.", report)


def test_the_chain_is_consistent(quickstart):
    _, out, _, _ = quickstart
    data_hash = json.loads((out / "data/manifest.json").read_text())["data_hash"]
    assert json.loads((out / "packed/manifest.json").read_text())["data_hash"] == data_hash
    assert json.loads((out / "train/record.json").read_text())["data_hash"] == data_hash
    parity = json.loads((out / "model/parity.json").read_text())
    assert parity["max_abs_err"] < 1e-4 and parity["argmax_agree"] == 1.0
    tasks = json.loads((out / "reasoning/data/train.jsonl.record.json").read_text())
    assert tasks["eval_overlap_after"] == 0 and tasks["eval_prompts_checked"] == 320
    grpo = json.loads((out / "reasoning/grpo/run/record.json").read_text())
    assert grpo["status"] == "finished" and grpo["results"]["steps"] == 2
    assert Path(grpo["config"]["model"]["init"]).resolve() == (out / "reasoning/sft/model").resolve()
    served = json.loads((out / "serve/serve.json").read_text())
    assert served["exit_code"] == 0
    assert all(x["usage"]["completion_tokens"] > 0 for x in served["exchanges"])


def test_rerun_skips_complete_stages(quickstart):
    _, out, _, env = quickstart
    proc = subprocess.run([LMFORGE, "quickstart", "--tiny", "--out", str(out)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count("skipped") >= 12
    assert "## Serving" in (out / "report.md").read_text()
