"""The frozen quant-check suite (three categories, >= 200 items, reproducible from its generator) and
`lmforge eval diff`: a model against itself is all `same`; against its int4 quantization the per-sample
records and per-category summaries reconcile."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections import Counter

import pytest

from lmforge.model.reference import save_hf_model
from lmforge.quant import check_suite, load_pretrained
from lmforge.quant.quantize import QuantizeConfig, quantize_model
from lmforge.track.io import sha256_file


def test_suite_is_frozen_and_reproducible(tmp_path):
    suite = check_suite.load()
    cats = Counter(it["category"] for it in suite.items)
    assert suite.n >= 200 and set(cats) == {"prose", "code", "math"} and min(cats.values()) >= 60
    code = [it["text"] for it in suite.items if it["category"] == "code"]
    starts = ("def ", "return", "if ", "for ")
    assert all('"""' not in t and sum(ln.lstrip().startswith(starts) for ln in t.splitlines()) >= 2 for t in code)
    assert all(it["text"] == f"{it['prompt']} {it['answer']}" for it in suite.items if it["category"] == "math")
    assert sha256_file(check_suite.write(tmp_path / "again.jsonl")) == check_suite.SHA256


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("diff")
    src = save_hf_model("llama", root / "m", seed=4, hidden_size=64, vocab_size=512)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([it["text"] for it in check_suite.load().items],
                            trainers.BpeTrainer(vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(src / "tokenizer.json"))
    quantize_model(QuantizeConfig(model=str(src), out=str(root / "w4"), scheme="w4a16", group_size=32))
    suite = check_suite.load()
    picked = [it for c in ("prose", "code", "math") for it in [i for i in suite.items if i["category"] == c][:2]]
    return src, root / "w4", dataclasses.replace(suite, items=picked)


def test_diff_against_itself_is_all_same(pair, tmp_path):
    from lmforge.eval.compare import diff_models

    src, _, suite = pair
    suite = dataclasses.replace(suite, items=suite.items[::2])  # one item per category
    report = diff_models(src, src, suite, tmp_path / "d")
    assert set(report["categories"]) == {"prose", "code", "math", "all"}
    for c, s in report["categories"].items():
        assert s["same"] == s["n"] and s["agreement"] == 1.0 and s["perplexity_change"] == 0.0, c
    assert report["categories"]["math"]["newly_wrong"] == report["categories"]["math"]["newly_right"] == 0


def test_diff_cli_reconciles_per_sample_and_summary(pair, tmp_path):
    src, w4, _ = pair
    out = tmp_path / "cli"
    proc = subprocess.run([sys.executable, "-m", "lmforge.cli", "eval", "diff", str(src), str(w4), "--limit", "3",
                           "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "per_sample.jsonl").read_text().splitlines()]
    report = json.loads((out / "diff.json").read_text())
    assert len(rows) == 3 and report["categories"]["all"]["n"] == 3
    s = report["categories"]["all"]
    assert s["same"] + s["changed"] == 3 and s["same"] == sum(r["same"] for r in rows)
    assert s["perplexity_a"] > 1 and s["perplexity_b"] > 1 and s["perplexity_a"] != s["perplexity_b"]
    assert "| all | 3 |" in (out / "diff.md").read_text()
    assert json.loads((out / "record.json").read_text())["status"] == "finished"


def test_gptq_beats_rtn_on_its_calibration_inputs():
    """On correlated inputs, GPTQ's output error ||XWᵀ - XW'ᵀ|| is below RTN's with the same scheme."""
    import torch

    from lmforge.quant import QuantScheme, dequantize, quantize_rtn
    from lmforge.quant.gptq import gptq_quantize

    g = torch.Generator().manual_seed(0)
    X = torch.randn(512, 64, generator=g) @ torch.randn(64, 64, generator=g)  # correlated features
    W = torch.randn(48, 64, generator=g)
    scheme = QuantScheme(4, 16)
    H = 2 * X.t() @ X / X.shape[0]
    q, s = gptq_quantize(W, H, scheme, torch.float32)
    assert q.dtype == torch.int8 and int(q.min()) >= -8 and int(q.max()) <= 7 and s.shape == (48, 4)
    err_gptq = (X @ (W - dequantize(q, s)).t()).norm()
    err_rtn = (X @ (W - dequantize(*quantize_rtn(W, scheme, torch.float32))).t()).norm()
    assert err_gptq < 0.8 * err_rtn, (err_gptq, err_rtn)


def test_quantize_gptq_folder_loads_and_fits_calibration_better(pair, tmp_path):
    import torch

    src, rtn_dir, _ = pair
    calib = tmp_path / "calib.jsonl"
    texts = [it["text"] for it in check_suite.load().items[::12]]
    calib.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    res = quantize_model(QuantizeConfig(model=str(src), out=str(tmp_path / "g"), scheme="w4a16", group_size=32,
                                        method="gptq", calibration=str(calib), calibration_samples=20))
    assert res["method"] == "gptq"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src))
    ids = torch.tensor([tok.encode(texts[0])[:64]])
    ref = load_pretrained(src, dtype="float32", device="cpu")
    errs = []
    for d in (tmp_path / "g", rtn_dir):
        with torch.no_grad():
            errs.append((load_pretrained(d, dtype="float32", device="cpu")(ids) - ref(ids)).norm().item())
    assert errs[0] < errs[1], errs


def test_diff_a8_against_a16_on_one_folder(pair, tmp_path):
    """One int4 folder as A (exact A16 kernels) and B (`--quant-activations-b int8`): the NLLs differ (B's
    forward ran on int8 activations) by a fraction of a percent; a generate suite is refused with the
    commands to use instead."""
    from lmforge.engine import kernels
    from lmforge.eval.compare import diff_models
    from lmforge.tasks.suite import load_suite

    if kernels.load() is None:
        pytest.skip(f"A8 needs the compiled kernels: {kernels.status()}")
    _, w4, suite = pair
    report = diff_models(w4, w4, suite, tmp_path / "a8", quant_activations=("none", "int8"))
    s = report["categories"]["all"]
    assert report["quant_activations"] == ["none", "int8"] and s["n"] == 6
    assert s["perplexity_a"] != s["perplexity_b"] and abs(s["perplexity_change"]) < 0.02
    assert "with int8 activations (B)" in (tmp_path / "a8" / "diff.md").read_text()
    with pytest.raises(ValueError, match="generate suite.*eval run"):
        diff_models(w4, w4, load_suite("arith"), tmp_path / "gen", quant_activations=("none", "int8"))


def test_diff_kv_cache_dtype_on_one_folder(pair, tmp_path):
    """One folder as A (float32 K/V) and B (`--kv-cache-dtype-b int8`): the NLLs are the same plain forward (the
    cache only changes what decode steps read), the report and its markdown name each side's cache, and a cache
    dtype the engine does not know is refused."""
    from lmforge.eval.compare import diff_models

    src, _, suite = pair
    report = diff_models(src, src, suite, tmp_path / "kv", kv_cache_dtype=("float32", "int8"))
    s = report["categories"]["all"]
    assert report["kv_cache_dtype"] == ["float32", "int8"] and s["n"] == 6 and s["perplexity_change"] == 0.0
    md = (tmp_path / "kv" / "diff.md").read_text()
    assert "float32 KV cache (A)" in md and "int8 KV cache (B)" in md
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        diff_models(src, src, suite, tmp_path / "bad", kv_cache_dtype=("auto", "int3"))


def test_eval_backend_quant_activations(pair):
    """`lmforge eval run --quant-activations int8`: the engine and the log-likelihood model both run A8 and
    the run's record says so; the reference loop and Ray replicas are refused (they would run A16)."""
    from lmforge.engine import kernels
    from lmforge.eval.backends import TransformerBackend

    if kernels.load() is None:
        pytest.skip(f"A8 needs the compiled kernels: {kernels.status()}")
    _, w4, _ = pair
    b = TransformerBackend(w4, dtype="float32", device="cpu", engine="llm", quant_activations="int8")
    assert b.info()["quant_activations"] == "int8"
    assert any(getattr(m, "a8", None) is not None for m in b.model.modules())
    assert len(b.generate(["def f"], max_tokens=4, stop=[])) == 1
    assert "lmf_qmm_a8" in b._llm.stats()["linear_backend"]
    with pytest.raises(ValueError, match="--engine llm"):
        TransformerBackend(w4, dtype="float32", device="cpu", engine="simple", quant_activations="int8")
