"""`lmforge eval` end to end on a real tiny random model: every suite kind through the CLI, the
output files, perplexity and log-likelihoods against a hand computation, the engine against the
reference generation loop, and `compare` refusing a changed suite.

The model (Llama, 2 layers, hidden 64) and its tokenizer (vocab 320) are built offline in a few
seconds; the whole file takes ~20 s on a 2-core CPU.

    python -m pytest -q tests/test_eval_cli.py
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_models import save_hf_model
from lmforge.eval.backends import TransformerBackend
from lmforge.tasks.suite import load_suite


def lmforge_eval(*args: str) -> list[str]:
    """The CLI as users run it (becomes ["lmforge", "eval", *args] once cli.py mounts it)."""
    return [str(Path(sys.executable).with_name("lmforge")), "eval", *args]


def run_cli(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(lmforge_eval(*args), capture_output=True, text=True, timeout=300)
    if ok:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from lmforge.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("eval-model")
    corpus = root / "corpus.jsonl"
    texts = [it["text"] for it in load_suite("tiny-text").items] + [it["prompt"] for it in load_suite("arith").items]
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    train_tokenizer([str(corpus)], root / "tok", vocab_size=320, show_progress=False)
    model = save_hf_model("llama", root / "model", vocab_size=320)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(root / "tok" / f, model / f)
    return model


@pytest.fixture(scope="module")
def ppl_suite(tmp_path_factory) -> Path:
    """A perplexity suite made through the CLI from a prepared-data folder, as users would."""
    root = tmp_path_factory.mktemp("prepared")
    (root / "prep" / "splits").mkdir(parents=True)
    docs = [{"id": "a", "text": "Two plus two is four.", "meta": {}},
            {"id": "b", "text": "Grüße! 🙂 The quiet river.", "meta": {"lang": "mixed"}}]
    (root / "prep" / "splits" / "val.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    run_cli("make-suite", "perplexity", str(root / "prep"), "--out", str(root / "val.jsonl"), "--name", "val-tiny")
    return root / "val.jsonl"


@pytest.fixture(scope="module")
def eval_run(model_dir, ppl_suite, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "a"
    # The default verb: `lmforge eval MODEL_DIR ...` is `lmforge eval run MODEL_DIR ...`.
    proc = run_cli(str(model_dir), "--suite", "arith,arith-stability", "--suite", "choice-basics", "--suite",
                   "tiny-text", "--suite", str(ppl_suite), "--limit", "3", "--out", str(out))
    (out.parent / "stderr.txt").write_text(proc.stderr)
    return out


def test_each_suite_reports_its_progress(eval_run):
    """Off a terminal each suite ends with one progress line (and prints one every few seconds before)."""
    err = (eval_run.parent / "stderr.txt").read_text()
    assert "eval arith: 3/3 requests (100%)" in err  # generation: one request per item
    assert "eval choice-basics: 12/12 requests (100%)" in err  # four choices per item, one request each
    assert err.count("done in") == 5


def test_every_kind_end_to_end(eval_run, ppl_suite):
    results = json.loads((eval_run / "results.json").read_text())
    assert set(results["tasks"]) == {"arith", "arith-stability", "choice-basics", "tiny-text", "val-tiny"}
    for name, t in results["tasks"].items():
        assert t["n"] == (2 if name == "val-tiny" else 3)
        assert t["suite_sha256"] == load_suite(t["suite_path"]).sha256
        assert len(t["model_hash"]) == 64 and t["engine"]["backend"] == "transformer"
        assert t["value"] is not None and math.isfinite(t["value"])
    assert 0 <= results["tasks"]["choice-basics"]["metrics"]["acc_norm"]["value"] <= 1
    assert 0 < results["tasks"]["arith-stability"]["metrics"]["agreement"]["value"] <= 1
    samples = [json.loads(line) for line in (eval_run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 * 3 + 2
    assert {"task", "id", "prompt", "target", "output", "score"} <= set(samples[0])
    bad = (eval_run / "bad_cases.jsonl").read_text().splitlines()
    assert len(bad) == sum(1 for s in samples if s["failed"])
    record = json.loads((eval_run / "record.json").read_text())
    assert record["status"] == "finished" and record["inputs"]["suites"]["val-tiny"]["sha256"] == load_suite(ppl_suite).sha256
    assert (eval_run / "config.yaml").is_file()


def _hand_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]]))[0].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_perplexity_equals_hand_computation(eval_run, model_dir, ppl_suite):
    from lmforge.model import Transformer
    from lmforge.tokenizer import load_tokenizer

    model, tok = Transformer.from_pretrained(model_dir, dtype="float32", device="cpu"), load_tokenizer(model_dir)
    nll, tokens, nbytes = 0.0, 0, 0
    for it in load_suite(ppl_suite).items:
        ids = [tok.bos_token_id] + tok.encode(it["text"], add_special_tokens=False)
        nll -= _hand_logprobs(model, ids).sum().item()
        tokens, nbytes = tokens + len(ids) - 1, nbytes + len(it["text"].encode("utf-8"))
    m = json.loads((eval_run / "results.json").read_text())["tasks"]["val-tiny"]["metrics"]
    assert m["bits_per_byte"]["value"] == pytest.approx(nll / (math.log(2) * nbytes), rel=1e-4)
    assert m["token_perplexity"]["value"] == pytest.approx(math.exp(nll / tokens), rel=1e-4)
    assert m["tokens"]["value"] == tokens and m["bytes"]["value"] == nbytes


def test_choice_loglikelihoods_equal_hand_computation(eval_run, model_dir):
    from lmforge.model import Transformer
    from lmforge.tokenizer import load_tokenizer

    model, tok = Transformer.from_pretrained(model_dir, dtype="float32", device="cpu"), load_tokenizer(model_dir)
    sample = next(json.loads(line) for line in (eval_run / "samples.jsonl").read_text().splitlines()
                  if json.loads(line)["task"] == "choice-basics")
    for choice, ll in zip(sample["choices"], sample["loglikelihoods"]):
        ctx = [tok.bos_token_id] + tok.encode(sample["prompt"], add_special_tokens=False)
        whole = [tok.bos_token_id] + tok.encode(sample["prompt"] + " " + choice, add_special_tokens=False)
        assert whole[:len(ctx)] == ctx  # the prompt ends in ':' so the split is clean
        want = _hand_logprobs(model, whole)[len(ctx) - 1:].sum().item()
        assert ll == pytest.approx(want, abs=1e-4)


def test_rolling_windows_cover_every_token_once(model_dir):
    backend = TransformerBackend(model_dir, dtype="float32", device="cpu", engine="simple")
    text = "The quiet river follows the old bridge. " * 6
    (full_nll, full_n), = backend.rolling_nll([text])
    backend.max_len = 16  # force several windows
    (win_nll, win_n), = backend.rolling_nll([text])
    assert win_n == full_n == len(backend._encode(text))
    assert math.isfinite(win_nll) and win_nll != pytest.approx(full_nll)  # less context, other numbers


def test_engine_greedy_matches_reference_loop(model_dir):
    prompts = [it["prompt"] for it in load_suite("arith").items[:3]]
    ref = TransformerBackend(model_dir, dtype="float32", device="cpu", engine="simple")
    llm = TransformerBackend(model_dir, dtype="float32", device="cpu", engine="llm")
    kw = dict(max_tokens=12, stop=["\n"], temperature=0.0)
    assert llm.generate(prompts, **kw) == ref.generate(prompts, **kw)


def test_compare_refuses_changed_suite(eval_run, tmp_path):
    same = run_cli("compare", str(eval_run), str(eval_run))
    assert "arith" in same.stdout and "CHANGED" not in same.stdout
    other = tmp_path / "b"
    shutil.copytree(eval_run, other)
    results = json.loads((other / "results.json").read_text())
    results["tasks"]["arith"]["suite_sha256"] = "0" * 64
    (other / "results.json").write_text(json.dumps(results))
    refused = run_cli("compare", str(eval_run), str(other), ok=False)
    assert refused.returncode == 2 and "--allow-changed-suite" in refused.stderr
    allowed = run_cli("compare", str(eval_run), str(other), "--allow-changed-suite")
    assert "CHANGED" in allowed.stdout and "SUITES CHANGED: arith" in allowed.stdout


def test_refuses_finished_run_and_bad_suite(eval_run, model_dir):
    again = run_cli(str(model_dir), "--suite", "arith", "--out", str(eval_run), ok=False)
    assert again.returncode == 2 and "--overwrite" in again.stderr
    bad = run_cli("run", str(model_dir), "--suite", "nope", "--out", str(eval_run.parent / "x"), ok=False)
    assert bad.returncode == 2 and "built-in" in bad.stderr
