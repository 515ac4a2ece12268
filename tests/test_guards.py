"""Guard rails: pre-flight refusals with remedies, the OOM answer, spike warnings and skips, graph
breaks recorded, odd dims warned, deterministic mode recorded, MFU > 100% an error."""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.model.config import ModelConfig, alignment_warnings
from lmforge.perf.estimate import PRESETS, ModelShape
from lmforge.train import guards
from lmforge.train.config import TrainConfig


def cfg_for(**train) -> TrainConfig:
    cfg = TrainConfig()
    cfg.data.path = "unused"
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return cfg.validate()


def test_preflight_refuses_with_remedies_in_order():
    cfg = cfg_for(batch_size=8)
    shape = PRESETS["qwen2.5-1.5b"]  # full fp32-master AdamW at 8 × 2048 tokens: ~80 GB
    with pytest.raises(guards.PreflightError) as e:
        guards.preflight_train(cfg, shape, seq_len=2048, device="cuda", available=8 * 10**9)
    msg = str(e.value)
    assert "needs ~" in msg and "8 GB free" in msg and "train.preflight=false" in msg
    # checkpointing first, then LoRA on a bf16 base, then a smaller micro-batch with more accumulation, up to the
    # first that fits
    assert (msg.index("gradient_checkpointing=true") < msg.index("method=lora lora.base_dtype=bfloat16")
            < msg.index("batch_size=4"))
    assert "grad_accum=2" in msg and "batch_size=2" not in msg
    lora = cfg_for(method="lora", gradient_checkpointing=True, batch_size=4)
    lora.lora.base_dtype = "bfloat16"
    est = guards.preflight_train(lora, shape, 2048, "cuda", available=8 * 10**9)
    assert est["available"] == 8e9 and est.total < 8e9
    with pytest.raises(guards.PreflightError, match="more memory"):
        guards.preflight_train(cfg, PRESETS["llama3-70b"], 2048, "cuda", available=11 * 10**9)


def test_preflight_uses_this_machines_free_memory():
    avail, source = guards.available_memory("cpu")
    assert avail is None or avail > 0 and source
    small = ModelShape(64, 2, 2, 2, 32, 128, 256, tied=True)
    assert guards.preflight_train(cfg_for(), small, 64, torch.device("cpu")).total < 50e6


def test_preflight_inference_suggests_what_fits():
    with pytest.raises(guards.PreflightError, match=r"max_num_seqs=\d+") as e:
        guards.preflight_inference("llama3-8b", "bfloat16", max_num_seqs=256, max_model_len=8192, device="cuda",
                                   available=40 * 10**9)
    fits = int(str(e.value).split("max_num_seqs=")[1].split()[0])
    assert guards.preflight_inference("llama3-8b", "bfloat16", fits, 8192, "cuda", available=40 * 10**9)
    with pytest.raises(guards.PreflightError, match="weights alone do not fit"):
        guards.preflight_inference("llama3-70b", "bfloat16", 1, 1024, "cuda", available=80 * 10**9)


def test_oom_answered_with_estimate_peak_and_remedies():
    err = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert guards.is_oom(err) and guards.is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: 9 GB"))
    assert not guards.is_oom(RuntimeError("shape mismatch"))
    msg = guards.oom_message(err, cfg_for(), PRESETS["llama-7b"], 2048, "cuda", 23 * 10**9, step=0)
    assert "out of memory at step 1" in msg and "Tried to allocate 2.00 GiB" in msg
    assert "Estimated ~" in msg and "measured peak 23 GB" in msg and "gradient_checkpointing=true" in msg


def test_spike_detector_names_step_and_rows_and_keeps_spikes_out():
    det = guards.SpikeDetector(zscore=6.0, window=20, min_history=10)
    g = torch.Generator().manual_seed(0)
    for step in range(1, 31):
        loss = 3.0 - 0.01 * step + 0.01 * float(torch.randn((), generator=g))
        assert det.check(step, loss=loss, grad_norm=1.0 + 0.05 * float(torch.randn((), generator=g))) == []
    (spike,) = det.check(31, rows=[4, 9], loss=2.7, grad_norm=25.0)
    assert spike.metric == "grad_norm" and spike.step == 31 and spike.zscore > 6
    assert "step 31" in spike.message() and "[4, 9]" in spike.message()
    assert det.check(32, loss=2.69, grad_norm=1.0) == []  # the spike did not enter the window
    assert det.check(33, loss=math.nan)[0].metric == "loss"


def test_batch_rows_of_a_packed_loader(tmp_path):
    import numpy as np

    class Loader:  # PackedLoader's epoch order, the fields batch_rows reads
        epoch, global_batch, rank, world_size = 0, 4, 0, 1

        def _epoch_order(self):
            return np.random.default_rng(self.epoch).permutation(20)

    loader = Loader()
    rows = guards.batch_rows(loader, {"epoch": 1, "step": 2})
    assert rows == [int(i) for i in np.random.default_rng(1).permutation(20)[8:12]] and loader.epoch == 0
    assert guards.batch_rows(object(), {"step": 0}) == []


def test_graph_breaks_are_counted_with_reasons():
    import torch._dynamo

    torch._dynamo.reset()
    before = guards.graph_breaks()["count"]

    def f(x):
        y = x * 2
        print("", end="")  # a side effect dynamo cannot trace: one graph break
        return y + 1

    torch.compile(f, backend="eager")(torch.ones(3))
    breaks = guards.graph_breaks()
    assert breaks["count"] > before and breaks["reasons"]


def test_alignment_warnings_name_dim_and_nearest_sizes():
    cfg = ModelConfig(vocab_size=1000, hidden_size=100, intermediate_size=256, num_attention_heads=5)  # head_dim 20
    warnings = alignment_warnings(cfg)
    assert any("hidden_size=100" in w and "96 or 104" in w for w in warnings)
    assert any("vocab_size=1000" in w and "960 or 1024" in w for w in warnings)
    assert any("head_dim=20" in w and "16 or 24" in w for w in warnings)
    assert not any("intermediate_size" in w for w in warnings)
    assert alignment_warnings(ModelConfig(vocab_size=1024, hidden_size=128, intermediate_size=256)) == []


def test_deterministic_mode_sets_and_records_flags():
    try:
        rec = guards.set_deterministic(True)
        assert rec["use_deterministic_algorithms"] and rec["cudnn_deterministic"] and not rec["cudnn_benchmark"]
        assert rec["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False
    assert guards.set_deterministic(False)["use_deterministic_algorithms"] is False


def test_mfu_above_100_percent_names_formula_and_peak():
    from lmforge.perf.mfu import mfu

    with pytest.raises(ValueError, match="above 100% is an error") as e:
        mfu(6e9, 1e5, 1e14)
    assert "FLOP/token" in str(e.value) and "peak 1e+14 FLOP/s" in str(e.value)


def test_repetition_metrics_count_loops():
    from lmforge.eval.metrics import distinct_n, repeated_ngram_rate, repetition_metrics

    loop = "the cat sat " * 10
    fresh = "one two three four five six seven eight nine ten"
    assert repeated_ngram_rate(fresh) == 0.0
    # 28 trigrams, only the first 3 are new
    assert repeated_ngram_rate(loop) == pytest.approx(25 / 28)
    assert distinct_n([fresh], 1) == 1.0 and distinct_n([loop], 1) == pytest.approx(3 / 30)
    assert distinct_n(["a b", "a b"], 2) == 0.5 and distinct_n(["a"], 2) is None
    m = repetition_metrics([loop, fresh, ""])
    assert m["rep_3gram"]["value"] == pytest.approx((25 / 28 + 0 + 0) / 3)
    assert m["distinct_1"]["value"] == pytest.approx(13 / 40) and m["distinct_2"]["value"] < 1


def test_smoke_chain_preflight_determinism_and_spikes(tmp_path):
    """One tiny packed dataset for the trainer-level guards: a model too large for this machine is
    refused before it is built; the smoke chain passes end to end, its training run records the
    deterministic flags and, at a hair-trigger z-score, warns and skips spiking updates."""
    import json

    from test_train_loop import make_packed

    from lmforge.config import load_config
    from lmforge.train.loop import Trainer
    from lmforge.train.smoke import smoke

    bad = smoke("configs/tiny.yaml", [f"data.path={tmp_path / 'missing'}"], tmp_path / "bad")
    assert not bad["passed"] and bad["stages"][0]["status"] == "failed" and "manifest.json" in bad["stages"][0]["detail"]
    assert [s["status"] for s in bad["stages"][1:]] == ["not run"] * 4
    packed = make_packed(tmp_path, n_docs=40, seq_len=32)
    tiny = [f"data.path={packed}", "train.device=cpu", "train.batch_size=2", "model.hidden_size=32",
            "model.intermediate_size=64", "model.num_hidden_layers=1", "model.num_attention_heads=2"]
    huge = load_config(TrainConfig, "configs/tiny.yaml", tiny + ["model.hidden_size=65536", "model.num_hidden_layers=64",
                                                                  "model.intermediate_size=131072"])
    with pytest.raises(guards.PreflightError, match="needs ~"):
        Trainer(huge, tmp_path / "huge")
    try:
        good = smoke("configs/tiny.yaml", tiny + ["train.deterministic=true", "train.spike_zscore=0.01",
                                                  "train.skip_spikes=true"], tmp_path / "ok", steps=13)
    finally:
        torch.use_deterministic_algorithms(False)
    assert good["passed"], good["stages"]
    assert [s["stage"] for s in good["stages"]] == ["config", "train", "resume", "export", "generate"]
    assert "| generate | ok |" in (tmp_path / "ok" / "smoke.md").read_text()
    record = json.loads((tmp_path / "ok" / "train" / "record.json").read_text())
    assert record["determinism"]["use_deterministic_algorithms"] is True
    rows = [json.loads(line) for line in (tmp_path / "ok" / "train" / "metrics.jsonl").read_text().splitlines()]
    spiked = [r for r in rows if r.get("spike")]
    assert spiked and all(r["skipped"] for r in spiked) and all(r["step"] > 10 for r in spiked)
    assert "spike at step" in good["stages"][1]["detail"] and "packed rows" in good["stages"][1]["detail"]
