"""`lmforge bench mfu`: the ladder on a tiny config; every rung measured or saying why not, the
best rung kept, the table and the JSON written."""

from __future__ import annotations

import json

import torch
from test_train_loop import make_packed

from lmforge.bench.mfu import VarlenAttention, bench_mfu
from lmforge.model.transformer import DenseAttention


def test_varlen_attention_equals_the_dense_document_mask():
    g = torch.Generator().manual_seed(0)
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 0, 0, 0, 0, 1, 1]])
    q, k, v = (torch.randn(2, 8, 4, 16, generator=g) for _ in range(3))
    k, v = k[:, :, :2], v[:, :, :2]  # GQA: 4 query heads over 2 kv heads
    torch.testing.assert_close(VarlenAttention(doc_ids)(0, q, k, v), DenseAttention(doc_ids)(0, q, k, v))


def test_ladder_runs_on_a_tiny_config(tmp_path):
    packed = make_packed(tmp_path, n_docs=40, seq_len=32)
    out = tmp_path / "mfu"
    result = bench_mfu("configs/tiny.yaml", [f"data.path={packed}", "train.batch_size=2", "train.device=cpu",
                                             "model.num_hidden_layers=1"], steps=1, out=out, max_batch=4,
                       skip=("1", "5"))
    rungs = {r["step"]: r for r in result["rungs"]}
    assert rungs["0"]["tokens_per_s"] > 0 and rungs["0"]["kept"]
    assert rungs["5"]["note"].startswith("skipped") and rungs["5"]["tokens_per_s"] is None
    measured = [r for r in result["rungs"] if r["tokens_per_s"]]
    kept = [r for r in measured if r["kept"]]
    assert all(r["speedup_vs_best"] > 1.02 for r in kept[1:]) and all(r["speedup_vs_best"] <= 1.02 for r in measured
                                                                       if not r["kept"])
    speedup = 1.0
    for r in kept[1:]:
        speedup *= r["speedup_vs_best"]  # × baseline is the product of the kept paired ratios
    assert result["best"] == kept[-1]["step"] and abs(result["speedup"] - speedup) < 1e-9
    assert rungs["6"]["setting"]["batch_size"] == 4
    saved = json.loads((out / "bench_mfu.json").read_text())
    assert saved["loadavg"] and saved["packages"] and "| step | change |" in (out / "bench_mfu.md").read_text()
