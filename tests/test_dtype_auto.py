"""`--dtype auto` on CPU (`lmforge.engine.kernels.auto_dtype`): bf16 compute only where the CPU has bf16
units, int weights with float32 activations on lmforge's integer kernels, a float32 checkpoint never
rounded; the choice and the kernels in the engine's stats, its ready log line and `/metrics`."""

from __future__ import annotations

import logging

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from lmforge.engine import LLM, kernels
from lmforge.model.reference import save_hf_model
from lmforge.quant.quantize import QuantizeConfig, quantize_model
from lmforge.serve.metrics import EngineCollector


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("dtype_auto")
    f32 = save_hf_model("llama", root / "f32", seed=1, hidden_size=64, vocab_size=128)
    bf16 = save_hf_model("llama", root / "bf16", seed=1, hidden_size=64, vocab_size=128, dtype=torch.bfloat16)
    quantize_model(QuantizeConfig(model=str(bf16), out=str(root / "w8"), scheme="w8a16"))
    return {"float32": f32, "bfloat16": bf16, "w8": root / "w8"}


@pytest.mark.parametrize("flags,bf16", [("flags : fpu avx2 avx512f avx512_vnni", False),
                                        ("flags : fpu avx2 avx512f avx512_bf16", True),
                                        ("flags : fpu amx_bf16 amx_tile", True), ("Features : fp asimd", False)])
def test_bf16_units_from_cpu_flags(monkeypatch, flags, bf16):
    monkeypatch.delenv("LMFORGE_CPU_BF16", raising=False)
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: flags)
    assert kernels.cpu_has_bf16() is bf16
    monkeypatch.setenv("LMFORGE_CPU_BF16", "0" if bf16 else "1")  # the override wins
    assert kernels.cpu_has_bf16() is not bf16


@pytest.mark.parametrize("has_bf16", ["0", "1"])
def test_policy(monkeypatch, has_bf16):
    monkeypatch.setenv("LMFORGE_CPU_BF16", has_bf16)
    assert kernels.auto_dtype("float32", False)[0] == "float32"  # never rounds a float32 checkpoint
    assert kernels.auto_dtype(None, False)[0] == "float32"
    assert kernels.auto_dtype("bfloat16", True)[0] == "float32"  # int weights: float32 on the integer kernels
    dtype, why = kernels.auto_dtype("bfloat16", False)
    assert dtype == "bfloat16" and ("has bf16 units" in why) == (has_bf16 == "1")
    assert kernels.auto_dtype("float16", False)[0] == "bfloat16"


def test_engine_reports_the_choice(folders, monkeypatch, caplog):
    monkeypatch.setenv("LMFORGE_CPU_BF16", "0")
    with caplog.at_level(logging.INFO, logger="lmforge.engine"):
        s = LLM(str(folders["bfloat16"]), device="cpu").llm_engine.stats()
    assert s["dtype"] == "bfloat16" and "without bf16 units" in s["dtype_choice"]
    assert "without bf16 units" in caplog.text and "engine ready" in caplog.text
    s = LLM(str(folders["float32"]), device="cpu").llm_engine.stats()
    assert s["dtype"] == "float32" and "kept" in s["dtype_choice"]
    s = LLM(str(folders["float32"]), device="cpu", dtype="bfloat16").llm_engine.stats()
    assert s["dtype"] == "bfloat16" and s["dtype_choice"] == "set by --dtype"


@pytest.mark.skipif(kernels.load() is None, reason="no C compiler: lmforge's CPU kernels are absent")
def test_quantized_checkpoint_runs_integer_kernels_and_metrics_say_so(folders):
    """A w8a16 folder saved in bf16 used to run torch's bf16 int8 kernel under auto; now float32
    activations on lmf_qmm_f32, and `/metrics` carries it in `lmforge:kernel_info`."""
    stats = LLM(str(folders["w8"]), device="cpu").llm_engine.stats()
    assert stats["dtype"] == "float32" and "lmf_qmm_f32" in stats["linear_backend"]
    registry = CollectorRegistry()
    registry.register(EngineCollector(lambda: {"v1": {**stats, "num_requests_running": 0, "num_requests_waiting": 0,
                                                      "kv_blocks_in_use": 0, "kv_blocks_total": 1, "preemptions": 0,
                                                      "prefix_cache_queries": 0, "prefix_cache_hits": 0}}, "tiny"))
    text = generate_latest(registry).decode()
    line = next(x for x in text.splitlines() if x.startswith("lmforge:kernel_info{"))
    assert 'dtype="float32"' in line and "lmf_qmm_f32" in line and line.endswith(" 1.0")
