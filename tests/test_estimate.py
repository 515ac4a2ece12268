"""The calculators against the seeds' worked figures and against hand arithmetic.

Golden values: the training seed's 7B table (full fine-tune ≈ 112 GB, LoRA ≈ 20 GB, 4-bit
inference ≈ 6 GB), the KV cache of a 7B GQA model (Llama 3 8B: 128 KiB per token in bf16) and
the A100 ridge point (312 TFLOP/s ÷ ~2 TB/s ≈ 150 FLOP/byte).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lmforge.cli import app
from lmforge.model.config import ModelConfig
from lmforge.perf import estimate as E


def seven_b() -> E.ModelShape:
    """A shape of exactly the seed's "7B": the Llama 7B shape whose parameters are ≈ 6.74e9."""
    return E.PRESETS["llama-7b"]


def test_presets_match_published_parameter_counts():
    # Model cards: Llama 2 7B 6.74B, Llama 3 8B 8.03B, Qwen2.5-7B 7.62B, Qwen2.5-1.5B 1.54B, Mistral 7B 7.24B.
    for name, billions in (("llama-7b", 6.74), ("llama3-8b", 8.03), ("qwen2.5-7b", 7.62),
                           ("qwen2.5-1.5b", 1.54), ("mistral-7b", 7.24), ("llama3-70b", 70.55)):
        assert E.ModelShape.from_config(name).params() / 1e9 == pytest.approx(billions, abs=0.01), name


def test_shape_from_model_config_counts_like_the_model(tmp_path):
    cfg = ModelConfig(vocab_size=1000, hidden_size=96, intermediate_size=200, num_hidden_layers=3,
                      num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False,
                      model_type="qwen2", qkv_bias=True)
    shape = E.ModelShape.from_config(cfg)
    assert shape.params() == cfg.num_parameters()
    assert shape.params(embedding=False) == cfg.num_parameters(embedding=False)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf()))
    assert E.ModelShape.from_config(tmp_path) == E.ModelShape.from_config(tmp_path / "config.json")
    assert E.ModelShape.from_config(tmp_path).params() == cfg.num_parameters()
    with pytest.raises(ValueError, match="not a preset"):
        E.ModelShape.from_config(tmp_path / "nope")


def test_seed_7b_full_finetune_model_states_16_bytes_per_param():
    est = E.memory(seven_b(), mode="full", dtype="bfloat16", optimizer="adamw")
    n = seven_b().params()
    # bf16 weights 2 + bf16 grads 2 + fp32 master 4 + AdamW m, v 8 = 16 B/param.
    assert est["model states"] == pytest.approx(16 * n)
    assert est["weights"] == 2 * n and est["optimizer state"] == 8 * n and est["master weights"] == 4 * n
    # The seed rounds 7e9 × 16 = 112 GB; the real 6.74e9 gives 108 GB.
    assert est["model states"] / 1e9 == pytest.approx(112, rel=0.05)
    assert est.total > est["model states"] and est.overhead > 0
    assert "× 8 B (adamw)" in est.to_text()


def test_seed_7b_lora_about_20_gb_with_checkpointing():
    est = E.memory(seven_b(), mode="lora", batch=4, seq_len=2048, grad_ckpt=True)
    assert est.total / 1e9 == pytest.approx(20, rel=0.15)
    assert est["activations (checkpointing)"] < est["activations (no checkpointing)"] / 5
    no_ckpt = E.memory(seven_b(), mode="lora", batch=4, seq_len=2048, grad_ckpt=False)
    assert no_ckpt.total > 24e9  # without checkpointing it does not fit a 24 GB card: the seed's "需开"
    assert est["optimizer state"] < 1e9  # "optimizer state drops below 1 GB"


def test_seed_7b_4bit_inference_about_6_gb():
    est = E.memory(seven_b(), mode="inference", quant_bits=4, seq_len=4096)
    assert est.total / 1e9 == pytest.approx(6, rel=0.15)
    bf16 = E.memory(seven_b(), mode="inference", dtype="bfloat16", seq_len=4096)
    assert bf16["weights"] / 1e9 == pytest.approx(14, rel=0.05)  # the seed's "BF16 推理约 14GB"


def test_kv_bytes_per_token_of_a_7b_gqa_model():
    est = E.kv_cache("llama3-8b", seq_len=8192, batch=2, budget_bytes=40e9)
    assert est["per token"] == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert est["per sequence"] == 128 * 1024 * 8192
    assert est["per batch"] == 2 * est["per sequence"]
    assert est["max sequences"] == 40e9 // est["per sequence"]
    assert E.kv_cache("llama-7b", 1)["per token"] == 4 * est["per token"]  # MHA: 4× the GQA model
    assert E.kv_cache("llama3-8b", 100, block_size=16)["per sequence"] == 128 * 1024 * 112


def test_a100_ridge_point_about_150_flop_per_byte():
    est = E.roofline("llama3-8b", "A100", batch=1, seq_len=2048)
    assert est["ridge point"] == pytest.approx(312e12 / 2.039e12)
    assert est["ridge point"] == pytest.approx(150, rel=0.05)
    assert "A100 datasheet" in est.to_text()
    assert est["decode intensity"] < est["ridge point"] < est["prefill intensity"]
    assert est["decode attainable"] == pytest.approx(est["decode intensity"] * 2.039e12)


def test_decode_ceiling_is_bandwidth_over_bytes_per_step():
    shape = E.PRESETS["llama3-8b"]
    est = E.throughput(shape, "A100", batch=1, context=0)
    weights = (shape.params() - shape.embedding_params()) * 2
    assert est["memory ceiling"] == pytest.approx(2.039e12 / weights)  # ≈ 135 tok/s
    assert est["ceiling"] == est["memory ceiling"] < est["compute ceiling"]


def test_intensity_decode_matmul_is_about_batch():
    est = E.intensity("llama3-8b", batch=4, seq_len=1024)
    # 2·M·K·N / ((M·K + K·N + M·N)·2) ≈ M for M << K, N.
    assert est["decode down_proj"] == pytest.approx(4, rel=0.01)
    assert est["prefill down_proj"] > 1000
    assert est["decode attention"] == pytest.approx(32 / 8)  # 2·heads/kv_heads / 2 B


def test_mfu_estimate_and_error_over_100_percent():
    est = E.mfu_estimate("llama3-8b", 3000, "A100", seq_len=4096)
    fpt = 6 * E.PRESETS["llama3-8b"].params(embedding=False) + 12 * 32 * 32 * 128 * 4096
    assert est["mfu"] == pytest.approx(fpt * 3000 / 312e12)
    with pytest.raises(ValueError, match="above 100% is an error"):
        E.mfu_estimate("llama3-8b", 30000, "A100", seq_len=4096)


def test_comm_ring_formulas():
    shape = E.PRESETS["llama3-8b"]
    b, s = E.dp_allreduce(shape, 8, 100e9, "float32")
    assert b == pytest.approx(2 * 7 / 8 * shape.params() * 4) and s == pytest.approx(b / 100e9)
    assert E.dp_allreduce(shape, 1, 100e9)[0] == 0
    tb, _ = E.tp_allreduce(shape, 4, 2, 1024, 100e9)
    assert tb == pytest.approx(4 * 32 * 2 * 3 / 4 * 2 * 1024 * 4096 * 2)
    # TP volume barely depends on the degree: (t-1)/t only.
    assert E.tp_allreduce(shape, 8, 2, 1024, 1)[0] / tb == pytest.approx((7 / 8) / (3 / 4))
    pb, _ = E.pp_sends(shape, 4, 1, 2048, 8, 1e9)
    assert pb == 8 * 2 * 2048 * 4096 * 2
    est = E.comm(shape, dp=2, tp=2, pp=2, microbatches=4, bandwidth=50e9)
    assert est["pipeline bubble"] == pytest.approx(1 / 5)
    assert est["total seconds"] == pytest.approx(est["DP seconds"] + est["TP seconds"] + est["PP seconds"])


def test_quant_sizes():
    shape = E.PRESETS["llama3-8b"]
    est = E.quant_sizes(shape, group_size=128)
    lin = shape.linear_params()
    assert est["int4 linears"] == pytest.approx(lin * (0.5 + 2 / 128))  # 4.125 bits per weight
    assert est["bf16 total"] > est["int8 total"] > est["int4 total"]
    assert est["int4 total"] == pytest.approx(est["int4 linears"] + (shape.params() - lin) * 2)


def test_parallel_memory_divides_states():
    base = E.memory("llama3-8b", mode="full")
    sharded = E.memory("llama3-8b", mode="full", dp_shard=8)
    assert sharded["optimizer state"] == pytest.approx(base["optimizer state"] / 8)
    tp = E.memory("llama3-8b", mode="full", tp=2, pp=2)
    assert tp["weights"] < base["weights"] / 3
    with pytest.raises(ValueError, match="mode"):
        E.memory("llama3-8b", mode="nope")


def test_device_spec_from_profile_and_errors():
    profile = {"devices": {"cpu": {"name": "cpu x", "peak_flops": {"float32": 1e11},
                                   "mem_bandwidth": {"triad": 2e10}}}}
    dev = E.device_spec("cpu", profile=profile)
    assert dev.bandwidth == 2e10 and dev.peak("fp32") == 1e11
    with pytest.raises(ValueError, match="bfloat16"):
        dev.peak("bf16")
    with pytest.raises(ValueError, match="unknown device"):
        E.device_spec("TPU v9")
    assert E.device_spec("NVIDIA A100-SXM4-40GB").bandwidth == 1555e9


def test_cli_estimate_prints_arithmetic_and_json(tmp_path):
    """As users run it: the console script, one subprocess; the other verbs in process."""
    exe = str(Path(sys.executable).with_name("lmforge"))
    proc = subprocess.run([exe, "estimate", "memory", "llama-7b", "--mode", "full", "--json", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    terms = {t["name"]: t for t in json.loads(proc.stdout)["terms"]}
    assert terms["optimizer state"]["formula"].endswith("× 8 B (adamw)")
    assert (tmp_path / "estimate.json").is_file() and "model states" in (tmp_path / "estimate.md").read_text()
    runner = CliRunner()
    for args in (["kv", "llama3-8b", "--budget-gb", "40"], ["intensity", "qwen2.5-1.5b"],
                 ["roofline", "llama3-8b", "--device", "A100"], ["throughput", "llama3-8b", "--device", "H100"],
                 ["mfu", "llama3-8b", "--tokens-per-s", "3000", "--device", "A100"],
                 ["comm", "llama3-8b", "--dp", "8", "--tp", "2"], ["quant", "qwen2.5-7b"],
                 ["memory", "llama-7b", "--mode", "lora", "--batch", "4", "--grad-ckpt", "--device", "RTX 4090"]):
        res = runner.invoke(app, ["estimate", *args])
        assert res.exit_code == 0, (args, res.output)
        assert "×" in res.output or "/" in res.output, args  # the arithmetic is printed
    res = runner.invoke(app, ["estimate", "memory", "llama-7b", "--mode", "lora", "--grad-ckpt", "--device", "RTX 4090"])
    assert "- fits: needs" in res.output
    res = runner.invoke(app, ["estimate", "memory", "llama-7b", "--mode", "lora", "--device", "RTX 4090"])
    assert "does NOT fit" in res.output
    res = runner.invoke(app, ["estimate", "memory", "no-such-model"])
    assert res.exit_code == 2 and "not a preset" in res.output
