"""`lmforge bench engine` end to end on a tiny random model: the report carries lmforge's decode
throughput as a share of the bandwidth ceiling that `perf.estimate` computes from the hardware profile.

    python -m pytest -q tests/test_bench_engine.py
"""

from __future__ import annotations

import json

import pytest

from lmforge.bench.engine import BenchEngineConfig, bench_engine_run
from lmforge.model.reference import save_hf_model
from lmforge.perf.estimate import decode_ceiling


def test_bench_engine_reports_decode_as_a_share_of_the_bandwidth_ceiling(tmp_path, monkeypatch, one_thread):
    monkeypatch.setenv("LMFORGE_HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "hardware.json").write_text(json.dumps({"devices": {"cpu": {
        "name": "test cpu", "peak_flops": {"float32": 1e11}, "mem_bandwidth": {"triad": 2e10}}}}))
    model = save_hf_model("llama", tmp_path / "model", vocab_size=320, hidden_size=64, layers=2,
                          max_position_embeddings=1024)
    report = bench_engine_run(BenchEngineConfig(model=str(model), num_requests=6, dtype="float32",
                                                baselines=("lmforge",), out=str(tmp_path / "bench")))
    bw, lm = report["bandwidth"], report["systems"][0]
    assert bw["ceiling_tok_s"] == pytest.approx(decode_ceiling(model, "cpu", bw["mean_batch"], bw["mean_context"],
                                                               "float32"))
    assert bw["percent_of_ceiling"] == pytest.approx(100 * lm["output_tok_s"] / bw["ceiling_tok_s"])
    assert "Decode vs the bandwidth ceiling" in (tmp_path / "bench" / "bench.md").read_text()
