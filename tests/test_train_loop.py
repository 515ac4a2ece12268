"""The trainer as users call it (`python -m lmforge.train` in a subprocess) on a tiny model:
exact resume after SIGKILL, the run record, document masking, NaN stops, config errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lmforge.data.loader")
pytest.importorskip("lmforge.data.pack")

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"


def lmforge_train(*args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """`lmforge train ...` as a user runs it (module form, so no entry point is needed)."""
    proc = subprocess.run([sys.executable, "-m", "lmforge.train", *map(str, args)], capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=1200)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


# `python -m lmforge.train` that SIGKILLs itself right after logging step KILL_AT (the trainer has no test hook),
# so the kill lands after exactly that step, every time.
KILL_AT = """
import os, signal, sys
from lmforge.track.run import RunDir
kill_at, log = int(sys.argv.pop(1)), RunDir.log_metrics
def log_then_kill(self, row):
    log(self, row)
    if row.get("step") == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
RunDir.log_metrics = log_then_kill
from lmforge.train.commands import train_app
train_app(prog_name="lmforge.train")
"""


def killed_after_step(step: int, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`lmforge train ...` SIGKILLed right after step `step` is in metrics.jsonl."""
    return subprocess.run([sys.executable, "-c", KILL_AT, str(step), *map(str, args)], capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=1200)


def make_packed(root: Path, n_docs: int = 120, seq_len: int = 64) -> Path:
    """A prepared dir (python-docs slice), a small BPE tokenizer, packed shards with a val split."""
    from lmforge.data.pack import pack_dataset
    from lmforge.data.sources import iter_python_docs
    from lmforge.tokenizer import train_tokenizer

    docs = [d for _, d in zip(range(n_docs), iter_python_docs())]
    splits = root / "prep" / "splits"
    splits.mkdir(parents=True)
    n_val = max(4, n_docs // 10)
    for name, part in (("train", docs[n_val:]), ("val", docs[:n_val])):
        (splits / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in part))
    (root / "prep" / "manifest.json").write_text(json.dumps({"data_hash": "test-data-hash-0123"}))
    train_tokenizer([str(splits / "train.jsonl")], root / "tok", vocab_size=384, show_progress=False)
    pack_dataset(root / "prep", root / "tok", seq_len=seq_len, out_dir=root / "packed", workers=1)
    return root / "packed"


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    return make_packed(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """LMFORGE_HOME with a hardware profile, so MFU has a peak (a generous one: MFU stays < 1)."""
    home = tmp_path_factory.mktemp("home")
    (home / "hardware.json").write_text(json.dumps(
        {"devices": {"cpu": {"peak_flops": {"float32": 1e13, "bfloat16": 2e13}}}}))
    return home


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    from lmforge.train.checkpoint import load_state, resolve_checkpoint

    path, _ = resolve_checkpoint(run, "last")
    return load_state(path)["model"]


N = 6  # run A trains 2N steps; run B is killed after step N + 2 (checkpoint at N) and resumed


@pytest.fixture(scope="module")
def run_a(packed, home, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "a"
    lmforge_train(TINY, f"data.path={packed}", f"train.max_steps={2 * N}", f"train.ckpt_every={N // 2}",
                  f"train.eval_every={N}", "train.target_val_loss=100", "--out", out, env={"LMFORGE_HOME": str(home)})
    return out


def test_exact_resume_after_sigkill(packed, home, run_a, tmp_path):
    out = tmp_path / "b"
    args = [TINY, f"data.path={packed}", f"train.max_steps={2 * N}", f"train.ckpt_every={N // 2}",
            f"train.eval_every={N}", "train.target_val_loss=100", "--out", out]
    env = {"LMFORGE_HOME": str(home)}
    killed = killed_after_step(N + 2, *args, env=env)
    assert killed.returncode == -9, killed.stderr
    assert [m["step"] for m in metrics(out)] == list(range(1, N + 3))  # N+1, N+2 were logged, then lost
    # A newer checkpoint that a crash left corrupt: resume must skip it with a warning.
    bad = out / "checkpoints" / f"step-{N + 1:08d}"
    bad.mkdir()
    (bad / "state.pt").write_bytes(b"truncated")
    (bad / "meta.json").write_text(json.dumps({"step": N + 1, "state_sha256": "0" * 64}))
    (out / "checkpoints" / f".tmp-step-{N + 2:08d}").mkdir()  # a partial write, never renamed

    resumed = lmforge_train(*args, "--resume", env=env)
    assert "skipping checkpoint" in resumed.stderr and "does not match" in resumed.stderr
    assert "resumed from" in resumed.stderr and f"step {N})" in resumed.stderr
    logged = [ln for ln in resumed.stdout.splitlines() if ln.startswith("step ")]
    assert all("| ETA " in ln for ln in logged[:-1]) and f"step {2 * N}/{2 * N}" in logged[-1]
    assert "| done in " in logged[-1]  # the step lines carry the time left, the last the time taken

    a, b = metrics(run_a), metrics(out)
    assert [m["step"] for m in b] == list(range(1, 2 * N + 1))
    assert [m["loss"] for m in b] == [m["loss"] for m in a]  # bitwise: JSON floats round-trip exactly
    assert [m.get("val_loss") for m in b] == [m.get("val_loss") for m in a]
    wa, wb = final_weights(run_a), final_weights(out)
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert json.loads((out / "record.json").read_text())["status"] == "finished"
    reached = [json.loads((run / "record.json").read_text())["results"]["target_reached"] for run in (run_a, out)]
    assert reached[0]["step"] == reached[1]["step"] == N and reached[0]["tokens"] == reached[1]["tokens"]


def test_resume_tolerates_a_torn_metrics_line_and_a_fallback_to_step_0(packed, home, tmp_path):
    """A kill mid-write leaves half a JSON line; a resume that finds no valid checkpoint starts over.
    Neither may crash the resume or log a step twice."""
    import shutil

    out = tmp_path / "c"
    args = [TINY, f"data.path={packed}", "train.max_steps=4", "train.ckpt_every=2", "train.eval_every=0",
            "--out", out]
    env = {"LMFORGE_HOME": str(home)}
    killed = killed_after_step(3, *args, env=env)
    assert killed.returncode == -9, killed.stderr
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 3.1')  # torn: no closing brace, no newline
    shutil.rmtree(out / "checkpoints")  # nothing valid to resume from: back to step 0
    resumed = lmforge_train(*args, "--resume", env=env)
    assert "starting from step 0" in resumed.stderr and "torn" in resumed.stderr
    assert [m["step"] for m in metrics(out) if "loss" in m] == [1, 2, 3, 4]


def test_record_and_metrics(packed, run_a):
    from lmforge.train.loop import RECORD_FIELDS

    rec = json.loads((run_a / "record.json").read_text())
    missing = [f for f in RECORD_FIELDS if f not in rec and f not in rec.get("results", {})]
    assert not missing, missing
    manifest = json.loads((packed / "manifest.json").read_text())
    assert rec["data_hash"] == manifest["data_hash"] == "test-data-hash-0123"
    assert rec["tokenizer_hash"] == manifest["tokenizer_hash"]
    assert rec["git"]["commit"] and "dirty" in rec["git"]
    assert rec["effective_batch"] == rec["batch_size"] * rec["grad_accum"] * rec["world_size"]
    res = rec["results"]
    assert res["final_val_loss"] is not None and res["eval"]["val_bpb"] > 0
    assert res["eval"]["val_ppl"] == pytest.approx(2.718281828 ** res["final_val_loss"], rel=1e-6)
    assert 0 < res["mfu"] < 1 and res["tokens_per_s"] > 0 and res["peak_mem"] > 0
    assert rec["config"]["train"]["max_steps"] == 2 * N
    rows = metrics(run_a)
    assert len(rows) == 2 * N
    for row in rows:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "mem_bytes"} <= set(row)
    assert (run_a / "loss.png").stat().st_size > 1000
    # train.target_val_loss=100: reached at the first evaluation (step N); seconds are the steps' dt_s sums
    hit = res["target_reached"]
    assert res["target_val_loss"] == 100 and hit["step"] == N and hit["tokens"] == rows[N - 1]["tokens"]
    assert hit["train_s"] == pytest.approx(sum(r["dt_s"] for r in rows[:N]), abs=1e-3)
    assert hit["train_plus_eval_s"] == pytest.approx(hit["train_s"] + rows[N - 1]["eval_s"], abs=1e-3)
    assert "max_steps: 12" in (run_a / "config.yaml").read_text()
    kept = sorted(p.name for p in (run_a / "checkpoints").iterdir())
    assert kept == [f"step-{2 * N - N // 2:08d}", f"step-{2 * N:08d}"]  # keep_last 2; best is the last


def test_document_masking_matches_separate_documents(packed):
    """Per-token loss of a packed row equals each of its documents run on its own."""
    from lmforge.data.loader import PackedLoader
    from lmforge.model import ModelConfig, Transformer
    from lmforge.train.loop import token_losses

    model = Transformer(ModelConfig(vocab_size=384, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    model.init_weights(0).eval()
    loader = PackedLoader(packed, "train", batch_size=8, shuffle=False)
    for _ in range(200):  # python-docs documents are long: find a row where one ends and the next starts
        batch = next(loader)
        row = int(torch.argmax(batch["doc_ids"].max(dim=1).values))
        if int(batch["doc_ids"][row].max()) >= 1:
            break
    assert int(batch["doc_ids"][row].max()) >= 1, "need a row holding two documents"
    with torch.no_grad():
        packed_T = token_losses(model, {k: v[row:row + 1] for k, v in batch.items()})[0]
        for doc in batch["doc_ids"][row].unique():
            idx = (batch["doc_ids"][row] == doc).nonzero().flatten()
            alone = {"input_ids": batch["input_ids"][row:row + 1, idx], "labels": batch["labels"][row:row + 1, idx]}
            torch.testing.assert_close(token_losses(model, alone)[0], packed_T[idx], atol=1e-5, rtol=1e-5)


def test_nan_loss_stops_naming_step_and_checkpoint(packed, tmp_path):
    proc = lmforge_train(TINY, f"data.path={packed}", "train.lr=1e12", "train.warmup_steps=0", "train.grad_clip=0",
                         "train.max_steps=20", "train.ckpt_every=1", "train.eval_every=0", "--out", tmp_path / "nan",
                         check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "at step" in proc.stderr and "last good checkpoint is" in proc.stderr
    rec = json.loads((tmp_path / "nan" / "record.json").read_text())
    assert rec["status"] == "failed" and "TrainingDiverged" in rec["error"]


def test_config_errors_name_the_key(tmp_path):
    from lmforge.config import ConfigError, load_config
    from lmforge.train.config import TrainConfig

    cfg = load_config(TrainConfig, TINY, ["train.lr=1e-4", "train.dtype=bfloat16", "model.init=null"])
    assert cfg.train.lr == 1e-4 and cfg.train.dtype == "bfloat16" and cfg.model.hidden_size == 64
    with pytest.raises(ConfigError, match="train.dtype"):
        load_config(TrainConfig, TINY, ["train.dtype=int8"])
    with pytest.raises(ConfigError, match="unknown key 'lrr'"):
        load_config(TrainConfig, TINY, ["train.lrr=1"])
    with pytest.raises(ConfigError, match="data.path is required"):
        load_config(TrainConfig, TINY).validate()
    proc = lmforge_train(TINY, "--out", tmp_path / "x", check=False)
    assert proc.returncode == 2 and "data.path is required" in proc.stderr


def test_target_reached_is_the_first_eval_at_or_below():
    from lmforge.train.loop import target_reached

    rows = [{"step": 1, "dt_s": 2.0, "tokens": 10, "loss": 9.0},
            {"step": 2, "dt_s": 2.0, "tokens": 20, "loss": 5.0, "val_loss": 4.5, "eval_s": 1.0},
            {"step": 3, "dt_s": 2.0, "tokens": 30, "loss": 4.0, "val_loss": 3.9, "eval_s": 1.0},
            {"step": 4, "dt_s": 2.0, "tokens": 40, "loss": 3.0, "val_loss": 3.5, "eval_s": 1.0}]
    assert target_reached(rows, 4.0) == {"step": 3, "tokens": 30, "val_loss": 3.9, "train_s": 6.0,
                                         "train_plus_eval_s": 8.0}
    assert target_reached(rows, 4.5)["step"] == 2 and target_reached(rows, 3.0) is None


@pytest.mark.parametrize("tie", [True, False])
def test_fused_loss_equals_plain_loss_and_gradients(tie):
    """TrainLoss (LM head + cross-entropy in chunks, no full logits) = token_losses(...).sum(), with
    the gradients of every weight (tied head included), in float32; chunks not dividing the tokens."""
    from lmforge.model import ModelConfig, Transformer
    from lmforge.train import fused_ce
    from lmforge.train.loop import token_losses

    model = Transformer(ModelConfig(vocab_size=384, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    tie_word_embeddings=tie)).init_weights(0)
    gen = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 384, (3, 50), generator=gen), torch.randint(0, 384, (3, 50), generator=gen)
    labels[0, :7] = labels[2, 30:] = -100
    doc_ids = (torch.arange(50) >= 20).long().expand(3, 50)
    grads = []
    for fused in (False, True):
        model.zero_grad()
        if fused:
            loss = fused_ce.TrainLoss(model)(ids, labels, None, doc_ids)
        else:
            loss = token_losses(model, {"input_ids": ids, "labels": labels, "doc_ids": doc_ids}).sum()
        (loss * 0.3).backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain, g_plain), (fused, g_fused) = grads
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-4)
    for name in g_plain:
        torch.testing.assert_close(g_fused[name], g_plain[name], rtol=1e-5, atol=1e-6, msg=name)
    loss = fused_ce.chunked_lm_loss(model.hidden_states(ids, None, doc_ids), model.lm_head.weight, labels, chunk=32)
    torch.testing.assert_close(loss.detach(), plain, rtol=1e-6, atol=1e-4)  # 150 tokens in chunks of 32
    assert fused_ce.can_fuse(model)


def test_whole_val_split_eval_does_not_depend_on_batch_size(packed, home, tmp_path, monkeypatch):
    """train.eval_batches=0 evaluates every val row exactly once, so batch size 3 and 5 agree."""
    from lmforge.config import load_config
    from lmforge.data.loader import PackedDataset
    from lmforge.train.config import TrainConfig
    from lmforge.train.loop import Trainer

    monkeypatch.setenv("LMFORGE_HOME", str(home))
    rows = PackedDataset(packed, "val").num_rows
    losses = []
    for bs in (3, 5):
        cfg = load_config(TrainConfig, TINY, [f"data.path={packed}", f"train.batch_size={bs}", "train.eval_batches=0"])
        trainer = Trainer(cfg, tmp_path / f"b{bs}", overwrite=True)
        assert sum(len(b["input_ids"]) for b in trainer.data.make_val()) == rows
        losses.append(trainer.evaluate()["val_loss"])
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


def test_read_metrics_skips_a_torn_line_with_a_warning(tmp_path, capsys):
    """The one reader of metrics.jsonl (track.runs): a run dir or the file; a torn last line is dropped,
    named on stderr, and the rows before it stand; truncate_metrics rewrites the file without it."""
    from lmforge.track.runs import read_metrics, truncate_metrics

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n\n{"step": 2, "loss": 2.5}\n{"step": 3, "lo')
    assert read_metrics(tmp_path) == read_metrics(tmp_path / "metrics.jsonl") == [
        {"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5}]
    assert "metrics.jsonl:4: not a JSON line" in capsys.readouterr().err
    assert read_metrics(tmp_path / "missing") == []
    truncate_metrics(tmp_path, 1)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 3.0}\n'
