"""The training pre-flight counts the run's real dtypes and agrees with `lmforge estimate memory`.

`train.guards.memory_args` maps a config (method, `lora.base_dtype`, `lora.base_quant`, train.dtype, DPO) to the
arguments of `perf.estimate.memory`, the function `lmforge estimate memory` prints. Checked here: the same
bytes through the CLI for full, LoRA (bf16 base) and QLoRA (int4 base); the weight bytes of a real light base
equal the estimate's; the issue's case (a 7B LoRA on a bf16 or int4 base on a 24 GB card) is not refused.
The measured peak is `scripts/preflight_peaks.py`'s (docs/training.md has its figures).
"""

from __future__ import annotations

import json
import shlex

import pytest
import torch
from typer.testing import CliRunner

from lmforge.cli import app
from lmforge.model import ModelConfig, Transformer
from lmforge.perf.estimate import LIGHT_BASE, PRESETS, ModelShape
from lmforge.train import guards
from lmforge.train.config import TrainConfig
from lmforge.train.lora import REBUILD_ELEMENTS, apply_lora

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def config(method: str = "full", base: str | None = None, **train) -> TrainConfig:
    cfg = TrainConfig()
    cfg.data.path = "unused"
    cfg.train.method = method
    for k, v in train.items():
        setattr(cfg.train, k, v)
    cfg.lora.rank, cfg.lora.target_modules = 16, list(ALL)
    if base in ("int8", "int4"):
        cfg.lora.base_quant = base
    elif base:
        cfg.lora.base_dtype = base
    return cfg


@pytest.mark.parametrize("method,base,flags", [
    ("full", None, "--mode full --dtype float32"),
    ("lora", "bfloat16", "--mode lora --dtype bfloat16"),
    ("lora", "int4", "--mode qlora --dtype float32 --quant-bits 4"),
])
def test_preflight_equals_estimate_memory_cli(method, base, flags):
    cfg = config(method, base, batch_size=4, gradient_checkpointing=True)
    shape = PRESETS["llama-7b"]
    kw = guards.memory_args(cfg, shape, 2048, "cuda")
    command = guards.estimate_command("llama-7b", kw)  # what the pre-flight's refusal prints
    args = shlex.split(command)[1:]
    assert args[:3] == ["estimate", "memory", "llama-7b"] and set(flags.split()) <= set(args)
    assert {"--batch", "4", "--seq-len", "2048", "--grad-ckpt"} <= set(args)
    res = CliRunner().invoke(app, [*args, "--json"])
    assert res.exit_code == 0, res.output
    printed = {t["name"]: t["value"] for t in json.loads(res.output)["terms"]}
    est = guards.train_estimate(cfg, shape, 2048, "cuda")
    assert printed["total"] == est.total and printed["framework overhead"] == est.overhead


def test_a_7b_lora_on_a_bf16_or_int4_base_fits_a_24gb_card():
    """The issue's case: refused when the pre-flight assumed a float32 base."""
    shape = PRESETS["llama-7b"]
    for base in ("bfloat16", "int4"):
        cfg = config("lora", base, batch_size=4, gradient_checkpointing=True)
        est = guards.preflight_train(cfg, shape, 2048, "cuda", available=24 * 10**9)
        assert est.total + est.overhead < 24e9, base
    fp32 = guards.train_estimate(config("lora", "float32", batch_size=4, gradient_checkpointing=True), shape, 2048,
                                 "cuda")
    assert fp32["weights"] == 4 * shape.params()  # a float32 base really is 27 GB of weights: refused
    with pytest.raises(guards.PreflightError, match="lora.base_dtype=bfloat16"):
        guards.preflight_train(config("full", batch_size=4), shape, 2048, "cuda", available=24 * 10**9)


@pytest.mark.parametrize("base", ["float32", "bfloat16", "int8", "int4"])
def test_weight_bytes_of_a_real_light_base_equal_the_estimate(base, one_thread):
    mc = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg = config("lora", base)
    model = apply_lora(Transformer(mc).init_weights(0), cfg.lora)
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    est = guards.train_estimate(cfg, ModelShape.from_config(mc), 64, "cpu")
    assert held == est["weights"] + est["adapter weights"]


def test_dpo_counts_both_completions_and_its_reference():
    shape = ModelShape(64, 2, 2, 2, 32, 128, 256, tied=True)
    cfg = config("full", batch_size=4)
    cfg.train.stage = "dpo"
    kw = guards.memory_args(cfg, shape, 128, "cpu")
    assert kw["batch"] == 8 and kw["reference_model"]
    est = guards.train_estimate(cfg, shape, 128, "cpu")
    assert est["reference model"] == est["weights"]
    cfg.dpo.precompute_ref_log_probs = True
    assert not guards.memory_args(cfg, shape, 128, "cpu")["reference_model"]
    assert guards.estimate_command("m", kw) is None  # `estimate memory` has no option for the reference
    cfg.train.method, cfg.lora.target_modules = "lora", ["q_proj", "lm_head"]
    assert not guards.memory_args(cfg, shape, 128, "cpu")["fused_loss"]  # a LoRA head: the plain loss


def test_light_base_constants_are_lora_s():
    from lmforge.perf.estimate import LOSS_CHUNK_TOKENS
    from lmforge.train.dpo import PreferenceLogps
    from lmforge.train.fused_ce import CHUNK_TOKENS

    assert LOSS_CHUNK_TOKENS == CHUNK_TOKENS == PreferenceLogps.BLOCK_TOKENS
    assert LIGHT_BASE["rebuild_elements"] == REBUILD_ELEMENTS
    from lmforge.train.lora import FrozenLinear

    q = FrozenLinear(torch.nn.Linear(128, 8, bias=False).requires_grad_(False), "int4")
    assert q.weight_scale.element_size() == LIGHT_BASE["scale_bytes"] and q.weight_scale.shape == (8, 2)  # groups of 64
