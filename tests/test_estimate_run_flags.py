"""`lmforge estimate memory` takes every setting the training pre-flight uses (compute dtype, LoRA
targets, the unfused loss, DPO's reference copy), and `lmforge perf report` compares a run's measured
peak with the estimate its record kept (`memory_estimate`) rather than re-deriving it with a float32 base.

    python -m pytest -q tests/test_estimate_run_flags.py
"""

from __future__ import annotations

import json

from typer.testing import CliRunner

from lmforge.cli import app
from lmforge.perf.estimate import memory
from lmforge.perf.report import run_memory_gap

RUN = dict(mode="lora", dtype="bfloat16", batch=4, seq_len=512, compute_dtype="float32",
           lora_targets=("q_proj", "v_proj"), fused_loss=False, reference_model=True)


def _cli_total(*flags: str) -> float:
    res = CliRunner().invoke(app, ["estimate", "memory", "llama-7b", "--mode", "lora", "--dtype", "bfloat16",
                                   "--batch", "4", "--seq-len", "512", "--json", *flags])
    assert res.exit_code == 0, res.output
    return next(t["value"] for t in json.loads(res.output)["terms"] if t["name"] == "total")


def test_estimate_memory_flags_reach_the_calculator():
    flags = (("--compute-dtype", "float32"), ("--lora-targets", "q_proj,v_proj"), ("--no-fused-loss",),
             ("--reference-model",))
    assert _cli_total(*(f for pair in flags for f in pair)) == memory("llama-7b", **RUN).total
    plain = memory("llama-7b", mode="lora", dtype="bfloat16", batch=4, seq_len=512).total
    assert _cli_total() == plain
    for flag in flags:  # each alone changes the figure: none is dropped on the way to the calculator
        assert _cli_total(*flag) != plain, flag
    res = CliRunner().invoke(app, ["estimate", "memory", "llama-7b", "--mode", "lora", "--lora-targets", ","])
    assert res.exit_code == 2 and "--lora-targets" in res.output


def test_report_uses_the_records_own_estimate():
    mc = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 4, "vocab_size": 256}
    rec = {"config": {"train": {"method": "lora"}, "lora": {"rank": 8}}, "model_config": mc, "device": "cpu",
           "batch_size": 2, "seq_len": 64, "dtype": "float32", "results": {"peak_mem": 300e6},
           "memory_estimate": {"args": {"mode": "lora", "dtype": "bfloat16"}, "total_bytes": 100e6,
                               "overhead_bytes": 150e6}}
    gap = run_memory_gap(rec)
    assert gap["expected"] == 250e6 and gap["ratio"] == 300e6 / 250e6  # total + overhead (CPU RSS holds both)
    old = dict(rec)
    del old["memory_estimate"]  # a record from before: re-derived, and a different figure
    assert run_memory_gap(old)["expected"] != 250e6
    cuda = {**rec, "device": "cuda:0"}
    assert run_memory_gap(cuda)["expected"] == 100e6  # allocated bytes: no framework overhead
