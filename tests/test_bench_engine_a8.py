"""`lmforge bench engine --quant-activations int8`: lmforge's run on a w8a16 model takes the A8 kernel
(int8 activations, `lmf_qmm_a8`) and the report says so; a bad value is refused before anything runs."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from lmforge.bench.engine import BenchEngineConfig, bench_engine, bench_engine_run
from lmforge.engine import kernels
from lmforge.model.reference import save_hf_model
from lmforge.quant.quantize import QuantizeConfig, quantize_model


@pytest.mark.skipif(kernels.load() is None, reason="no C compiler: lmforge's CPU kernels are absent")
def test_quant_activations_int8_runs_the_a8_kernel(tmp_path, one_thread):
    model = save_hf_model("llama", tmp_path / "model", vocab_size=320, hidden_size=64, layers=2,
                          max_position_embeddings=512)
    quantize_model(QuantizeConfig(model=str(model), out=str(tmp_path / "w8"), scheme="w8a16"))
    report = bench_engine_run(BenchEngineConfig(model=str(tmp_path / "w8"), num_requests=4, dtype="float32",
                                                baselines=("lmforge",), out=str(tmp_path / "bench"),
                                                quant_activations="int8"))
    assert "lmf_qmm_a8" in report["systems"][0]["note"] and report["config"]["quant_activations"] == "int8"


def test_bad_quant_activations_is_refused(tmp_path):
    import typer

    app = typer.Typer()
    app.command()(bench_engine)
    result = CliRunner().invoke(app, ["--quant-activations", "int4", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "--quant-activations 'int4'" in result.output
