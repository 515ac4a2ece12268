"""doctor as users run it (a subprocess), hardware peaks, and the MFU arithmetic."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from lmforge.perf.hardware import NoPeakError, datasheet_peak, load_profile, peak_flops
from lmforge.perf.mfu import flops_per_token, mfu, model_flops_per_token, non_embedding_params


def doctor_cmd(*args: str) -> list[str]:
    """The CLI as users run it: the `lmforge` console script of this environment."""
    return [str(Path(sys.executable).with_name("lmforge")), "doctor", *args]


@pytest.fixture(scope="module")
def doctor_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("doctor") / "hardware.json"
    proc = subprocess.run(doctor_cmd("--quick", "--out", str(out)), capture_output=True, text=True, timeout=120)
    return proc, out


def test_doctor_exits_zero_prints_table_and_writes_profile(doctor_run):
    proc, out = doctor_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "lmforge doctor" in proc.stdout and "matmul cpu float32" in proc.stdout and "✓" in proc.stdout
    assert "engine cpu kernels" in proc.stdout
    profile = json.loads(out.read_text())
    assert profile["devices"]["cpu"]["peak_flops"]["float32"] > 0
    bw = profile["devices"]["cpu"]["mem_bandwidth"]
    # STREAM triad moves 3 arrays and copy 2: both measured, and a plausible DRAM figure (> 0.1 GB/s).
    assert bw["copy"] > 1e8 and bw["triad"] > 1e8 and "bandwidth cpu" in proc.stdout
    assert profile["devices"]["cpu"]["memory_bytes"] > 2**30
    assert profile["cpu_count"] >= 1 and profile["torch_threads"] >= 1 and profile["torch_version"]
    assert profile["measured_at"] and profile["how"]


def test_peak_flops_cpu_reads_profile(doctor_run):
    _, out = doctor_run
    profile = load_profile(out)
    assert peak_flops("cpu", "fp32", profile) == profile["devices"]["cpu"]["peak_flops"]["float32"]


def test_peak_flops_without_profile_says_run_doctor(tmp_path, monkeypatch):
    monkeypatch.setenv("LMFORGE_HOME", str(tmp_path))
    assert load_profile() is None
    with pytest.raises(NoPeakError, match="lmforge doctor"):
        peak_flops("cpu", "float32")


def test_peak_flops_cuda_uses_datasheet_table():
    assert peak_flops("cuda", "bf16", profile={}, device_name="NVIDIA H100 80GB HBM3") == 989.5e12
    assert peak_flops("cuda", "float16", profile={}, device_name="NVIDIA A100-SXM4-40GB") == 312e12
    # Longest name wins: A10G is not A10's neighbour A100, L40S is not L40, GH200 is not H200.
    assert datasheet_peak("NVIDIA A10G", "bf16") == 125e12
    assert datasheet_peak("NVIDIA L40S", "bf16") == 362.05e12
    assert datasheet_peak("NVIDIA L40", "bf16") == 181.05e12
    assert datasheet_peak("NVIDIA H100 PCIe", "tf32") == 378e12
    assert datasheet_peak("Tesla T4", "fp16") == 65e12
    with pytest.raises(NoPeakError, match="no tensor-core bfloat16"):
        datasheet_peak("Tesla V100-SXM2-16GB", "bf16")


def test_peak_flops_unknown_gpu_falls_back_to_matching_profile_only():
    profile = {"devices": {"cuda": {"name": "NVIDIA Future X1", "peak_flops": {"bfloat16": 5e14}}}}
    assert peak_flops("cuda", "bf16", profile, device_name="NVIDIA Future X1") == 5e14
    with pytest.raises(NoPeakError, match="not in the datasheet table"):
        peak_flops("cuda", "bf16", profile, device_name="NVIDIA Other Y2")


def test_flops_per_token_and_mfu_by_hand():
    # 6·N + 12·L·H·Q·T with N=1000, L=2, H=4, Q=8, T=16: 6000 + 12·2·4·8·16 = 6000 + 12288
    assert flops_per_token(1000, 2, 4, 8, 16) == 18288
    assert mfu(18288, 1000.0, 18288 * 4000.0) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="above 100%"):
        mfu(18288, 1000.0, 18288 * 999.0)
    with pytest.raises(ValueError, match="peak must be > 0"):
        mfu(1.0, 1.0, 0.0)


def test_model_flops_per_token_tiny_config_hand_count():
    cfg = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, head_dim=8, hidden_size=32,
                          intermediate_size=64, num_key_value_heads=2, vocab_size=100, tie_word_embeddings=False)
    # per layer: q 32·32 + k,v 2·32·16 + o 32·32 = 3072; mlp 3·32·64 = 6144; norms 64 -> 9280
    # N = 2·9280 + final norm 32 + untied head 32·100 = 21792
    assert non_embedding_params(cfg) == 21792
    assert model_flops_per_token(cfg, seq_len=16) == 6 * 21792 + 12 * 2 * 4 * 8 * 16
    cfg.tie_word_embeddings = True
    assert non_embedding_params(cfg) == 21792 - 3200


def test_non_embedding_params_matches_transformers_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                   tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    total = sum(p.numel() for p in model.parameters())
    assert non_embedding_params(cfg) == total - model.model.embed_tokens.weight.numel()
