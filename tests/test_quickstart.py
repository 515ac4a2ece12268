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

from lmforge.quickstart import build_report, drop_traces

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
    assert re.search(r"Reasoning: accuracy on arith-cot-2d from \d+\.\d% \(SFT\) to \d+\.\d% \(GRPO\), n=16; "
                     r"on all of arith-cot from \d+\.\d% to \d+\.\d%, n=16\.", summary)
    assert re.search(r"Gain [+-]\d+\.\d points; the ±2 stderr intervals \[-?\d+\.\d, \d+\.\d\] \(SFT\) and "
                     r"\[-?\d+\.\d, \d+\.\d\] \(GRPO\) (do not overlap|overlap)\.", report)
    assert "argmax agreement 100%" in report
    assert re.search(r"GRPO's own rollouts \(temperature 1, first / last 1 steps\): accuracy \d+\.\d% → \d+\.\d%, "
                     r"well-formed \d+\.\d% → \d+\.\d%, mean length \d+ → \d+ tokens\.", report)
    assert re.search(r"that work the steps out \(a non-empty think block\): SFT \d+/\d+, GRPO \d+/\d+\.", report)


def test_the_chain_is_consistent(quickstart):
    _, out, _, _ = quickstart
    data_hash = json.loads((out / "data/manifest.json").read_text())["data_hash"]
    assert json.loads((out / "packed/manifest.json").read_text())["data_hash"] == data_hash
    assert json.loads((out / "train/record.json").read_text())["data_hash"] == data_hash
    parity = json.loads((out / "model/parity.json").read_text())
    assert parity["max_abs_err"] < 1e-4 and parity["argmax_agree"] == 1.0
    tasks = json.loads((out / "reasoning/data/train.jsonl.record.json").read_text())
    assert tasks["eval_overlap_after"] == 0 and tasks["eval_prompts_checked"] == 920
    assert set(tasks["eval_suites"]) == {"arith-cot", "arith-cot-2d"}
    grpo = json.loads((out / "reasoning/grpo/run/record.json").read_text())
    assert grpo["status"] == "finished" and grpo["results"]["steps"] == 2
    assert Path(grpo["config"]["model"]["init"]).resolve() == (out / "reasoning/sft/model").resolve()
    sft_rows = [json.loads(ln) for ln in (out / "reasoning/data/sft.jsonl").read_text().splitlines()]
    assert 0 < sum(not r["reasoning"] for r in sft_rows) < len(sft_rows)  # some rows without their steps
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


def _write_fake_stage_files(out: Path, low_sft_accuracy: bool = False) -> None:
    """Every file build_report reads, with made-up figures."""
    def put(rel, obj):
        p = out / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(obj if isinstance(obj, str) else json.dumps(obj))

    finished = {"status": "finished"}
    put("doctor/hardware.json", {"device_name": "cpu", "cpu_count": 2, "torch_version": "2.9",
                                 "peak_flops": {"float32": 1.2e11, "bfloat16": 3.4e10}})
    steps = {"read": {"in": 120, "out": 118, "dropped": {"quarantined": 2}},
             "pii": {"in": 100, "out": 100, "dropped": {}, "counts": {"email": 3}},
             "near_dedup": {"in": 100, "out": 97, "dropped": {"near_duplicate": 3}, "duplicate_rate": 0.03},
             "split": {"in": 97, "out": 97, "dropped": {}, "sizes": {"train": 87, "val": 5, "test": 5}}}
    put("data/stats.json", {"steps": steps, "mb_per_s": 1.23456,
                            "totals": {"read": 120, "kept": 97, "rejected": 21, "quarantined": 2}})
    put("data/manifest.json", {"data_hash": "ab" * 32})
    put("tokenizer/record.json", {"vocab_size": 1024, "bytes": 2_345_678, "seconds": 1.5, "bytes_per_token": 3.21})
    put("packed/manifest.json", {"seq_len": 128, "splits": {"train": {"tokens": 9000}, "val": {"tokens": 500}}})
    put("train/record.json", {"num_parameters": 123456, "config": {"train": {"dtype": "float32"}},
                              "results": {"steps": 30, "final_train_loss": 5.4321, "final_val_loss": 5.6789,
                                          "tokens_per_s": 12345.6, "mfu": 0.01234, "train_time_s": 12.34,
                                          "target_val_loss": 6.0,
                                          "target_reached": {"step": 15, "train_s": 6.1, "train_plus_eval_s": 7.2,
                                                             "tokens": 61440}}})
    put("train/metrics.jsonl", "".join(json.dumps(m) + "\n" for m in (
        {"step": 1, "loss": 6.9}, {"step": 15, "loss": 6.0, "val_loss": 6.1, "val_bpb": 2.5},
        {"step": 30, "loss": 5.4, "val_loss": 5.6789, "val_bpb": 2.3})))
    put("model/parity.json", {"architecture": "LlamaForCausalLM", "tokens": 21, "max_abs_err": 1.5e-6,
                              "argmax_agree": 1.0})
    put("eval/results.json", {"tasks": {
        "val-python-docs": {"kind": "perplexity", "n": 50, "suite_sha256": "0123456789abcdef",
                            "metrics": {"bits_per_byte": {"value": 2.345678, "stderr": 0.01}, "tokens": {"value": 5}}},
        "arith": {"kind": "generate", "n": 12, "suite_sha256": "fedcba9876543210",
                  "metrics": {"exact_match": {"value": 0.25, "stderr": 0.12}}}}})
    put("bench/bench.json", {"command": "lmforge bench engine --model m", "provenance": {"threads": 2},
                             "systems": [{"system": "hf-sequential", "requests": 2, "output_tok_s": 40.5, "req_s": 0.5,
                                          "ttft_ms": {"mean": 20.25}, "tpot_ms": {"mean": 24.5}},
                                         {"system": "lmforge", "requests": 8, "output_tok_s": 400.25, "req_s": 4.5,
                                          "ttft_ms": {"mean": 30.5}, "tpot_ms": {"mean": 2.5}}]})
    put("serve/serve.json", {"command": "lmforge serve m --port 1", "ready_s": 2.5, "exit_code": 0,
                             "metrics": {"vllm:prompt_tokens_total": 40.0},
                             "exchanges": [{"kind": "chat (streamed)", "prompt": "hi", "output": "a|b\nc" * 30,
                                            "ttft_s": 0.05, "e2e_s": 0.5},
                                           {"kind": "completion", "prompt": "x", "output": "y", "ttft_s": None,
                                            "e2e_s": 0.25}]})
    sft_acc, grpo_acc = (0.05, 0.04) if low_sft_accuracy else (0.5, 0.625)
    for stage, acc, outputs in (("sft", sft_acc, ["<think>\n\n</think>\nAnswer: 5", "<think>\n2+3=5\n</think>\nAnswer: 5"]),
                                ("grpo", grpo_acc, ["<think>\n2+3=5\n</think>\nAnswer: 5"] * 2)):
        (out / f"reasoning/{stage}/eval").mkdir(parents=True, exist_ok=True)
        (out / f"reasoning/{stage}/eval/samples.jsonl").write_text("".join(
            json.dumps({"task": t, "category": c, "output": o}) + "\n"
            for t, c, o in [("arith-cot-2d", "add-2d", outputs[0]), ("arith-cot-2d", "sub-2d", outputs[1]),
                            ("arith-cot", "add-2d", "<think>\n1\n</think>\nAnswer: 1")]))
        put(f"reasoning/{stage}/eval/record.json", finished)
        metrics = {"acc": {"value": acc, "stderr": 0.125}, "acc/add-2d": {"value": acc}, "acc/mul-2x1": {"value": 0.0}}
        put(f"reasoning/{stage}/eval/results.json", {"tasks": {"arith-cot-2d": {"n": 16, "metrics": metrics},
                                                               "arith-cot": {"n": 8, "metrics": metrics}}})
    put("reasoning/sft/run/record.json", {"num_parameters": 5000, "results": {"steps": 6, "train_time_s": 3.0}})
    put("reasoning/grpo/run/record.json", {"config": {"grpo": {"prompts_per_step": 2, "group_size": 4}},
                                           "results": {"steps": 2, "train_time_s": 4.0, "accuracy_first": 0.25,
                                                       "accuracy_last": 0.5, "averaged_over_steps": 1,
                                                       "format_rate_first": 0.75, "format_rate_last": 1.0}})
    put("reasoning/data/train.jsonl.record.json", {"n": 400, "seed": 1, "dropped_eval_overlap": 3,
                                                   "eval_overlap_after": 0})


@pytest.mark.parametrize("low_sft_accuracy", [False, True])
def test_report_sections_from_stage_files(tmp_path, low_sft_accuracy):
    """The report card from made-up stage files, without running the chain: one section per stage,
    one "From X to Y" line each, in order, and the timings table when given."""
    _write_fake_stage_files(tmp_path, low_sft_accuracy)
    report = build_report(tmp_path, [{"stage": "data", "seconds": 1.25, "skipped": False},
                                     {"stage": "train", "seconds": None, "skipped": True}])
    at = [report.index(s) for s in SECTIONS + ["## Time per stage"]]
    assert at == sorted(at)
    summary = report.split("## From X to Y", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in summary.splitlines() if line.startswith("- ")]
    assert [line.split(":", 1)[0] for line in lines] == ["- Data", "- Tokenizer", "- Training", "- Evaluation",
                                                          "- Engine", "- Serving", "- Reasoning"]
    assert "- Engine: from 40 output tok/s (transformers, one request at a time) to 400" in summary
    assert "| data | 1.2 |" in report and "| train | skipped (complete) |" in report
    assert "| a\\|b ca\\|b c" in report  # output cells escape pipes and join lines
    assert ("A GRPO group learns only from samples that beat its mean" in report) is low_sft_accuracy
    # the worked-steps share counts arith-cot-2d's answers only and empty think blocks as none
    assert "(a non-empty think block): SFT 1/2, GRPO 2/2." in report
    assert "| **arith-cot-2d** (n=16) |" in report and "| **arith-cot** (n=8) |" in report
    assert ("Gain -1.0 points" if low_sft_accuracy else "Gain +12.5 points") in report
    assert build_report(tmp_path) == build_report(tmp_path, None)
    assert "## Time per stage" not in build_report(tmp_path)


def test_drop_traces_strips_a_seeded_share_and_keeps_the_rest():
    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1), "reasoning": f"{i}+1={i + 1}"} for i in range(400)]
    out = drop_traces(rows, 0.5)
    stripped = [r for r in out if r["reasoning"] == ""]
    assert 150 < len(stripped) < 250 and out == drop_traces(rows, 0.5)  # seeded: the same rows each time
    assert all(o["answer"] == r["answer"] and o["prompt"] == r["prompt"] for o, r in zip(out, rows))
    assert all(r["reasoning"] for r in rows)  # the input rows are not changed
    assert drop_traces(rows, 0.0) == rows and all(r["reasoning"] == "" for r in drop_traces(rows, 1.0))
    with pytest.raises(ValueError, match="reasoning_direct_fraction"):
        drop_traces(rows, 1.5)


def test_gain_interval_says_whether_two_stderr_intervals_part():
    from lmforge.quickstart import gain_interval

    apart = gain_interval({"value": 0.10, "stderr": 0.01}, {"value": 0.20, "stderr": 0.02})
    assert apart == ("Gain +10.0 points; the ±2 stderr intervals [8.0, 12.0] (SFT) and [16.0, 24.0] (GRPO) "
                     "do not overlap.")
    close = gain_interval({"value": 0.10, "stderr": 0.02}, {"value": 0.15, "stderr": 0.02})
    assert close.endswith("[6.0, 14.0] (SFT) and [11.0, 19.0] (GRPO) overlap.")
    assert gain_interval({"value": 0.1, "stderr": None}, {"value": 0.2, "stderr": 0.01}) is None
