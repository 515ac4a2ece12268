"""DPO (`train.stage=dpo`): parity with TRL 1.16's DPOTrainer, exact resume, the reference model, data errors.

Parity: `scripts/dpo_trl_parity.py` ran TRL's `DPOTrainer` on a seeded tiny model, reference and pairs
(tests/dpo_fixtures.py) and recorded its token ids, loss, metrics and per-parameter gradients in
tests/dpo_trl_reference.json; this test rebuilds the same setup (the hashes must match) and recomputes
lmforge's side against TRL's recorded numbers. TRL is not needed to run it.

    python -m pytest -q tests/test_train_dpo.py
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import dpo_fixtures  # noqa: E402

from lmforge.config import ConfigError, load_config  # noqa: E402
from lmforge.quant import load_pretrained  # noqa: E402
from lmforge.tokenizer.load import load_tokenizer  # noqa: E402
from lmforge.train.config import TrainConfig  # noqa: E402
from lmforge.train.dpo import METRICS, DPOTrainer, dpo_loss, sequence_logps, train_dpo  # noqa: E402
from lmforge.train.pref_data import PreferenceDataError, PreferenceLoader, collate, read_pairs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = json.loads((Path(__file__).parent / "dpo_trl_reference.json").read_text())
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return dpo_fixtures.build(tmp_path_factory.mktemp("dpo"))


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("case", REFERENCE["cases"], ids=lambda c: c["name"])
def test_loss_metrics_and_gradients_equal_trl(files, case):
    h = REFERENCE["hashes"]
    assert _sha(files["model"] / "tokenizer.json") == h["tokenizer.json"], "the fixture setup changed: rerun the script"
    assert _sha(files["model"] / "model.safetensors") == h["model.safetensors"]
    assert _sha(files["ref"] / "model.safetensors") == h["ref.safetensors"]
    assert _sha(files[case["data"]]) == h[case["data"]]
    trl = case["trl"]
    tok = load_tokenizer(files["model"])
    pairs, _ = read_pairs(str(files[case["data"]]), tok, REFERENCE["max_length"])
    batch = collate(pairs[:REFERENCE["pairs"]], tok.pad_token_id, REFERENCE["max_length"])
    assert batch["input_ids"].tolist() == trl["input_ids"]  # TRL's tokenization, chat template and EOS rules
    assert batch["completion_mask"].tolist() == trl["completion_mask"]
    model = load_pretrained(files["model"], dtype="float32", device="cpu").train()
    ref = load_pretrained(files["ref"], dtype="float32", device="cpu").eval()
    with torch.no_grad():
        ref_logps, _ = sequence_logps(ref, batch)
    logps, lengths = sequence_logps(model, batch)
    losses, stats = dpo_loss(logps, ref_logps, lengths, case["beta"], case["loss_type"])
    loss = losses.mean()
    loss.backward()
    assert float(loss.detach()) == pytest.approx(trl["loss"], abs=2e-5)
    assert abs(float(loss.detach()) - math.log(2)) > 1e-3  # the reference differs from the policy: a real test
    for k in METRICS:
        assert float(stats[k].mean()) == pytest.approx(trl["metrics"][k], rel=1e-5, abs=1e-5), k
    grads = {n: p.grad.double().flatten() for n, p in model.named_parameters()}
    assert set(grads) == set(trl["grads"])  # HF parameter names, the tied head once
    for name, g in grads.items():
        want = trl["grads"][name]
        assert float(g.norm()) == pytest.approx(want["norm"], rel=1e-4, abs=1e-7), name
        assert g[:6].tolist() == pytest.approx(want["head"], rel=1e-4, abs=1e-6), name


def test_loss_by_hand():
    logps = torch.tensor([-10.0, -20.0, -12.0, -18.0])  # chosen rows, then rejected rows
    ref = torch.tensor([-11.0, -20.0, -11.0, -19.0])
    lengths = torch.tensor([2, 4, 3, 2])
    losses, st = dpo_loss(logps, ref, lengths, 0.5, "sigmoid")
    # pair 0: chosen ratio +1, rejected ratio -1 -> -log sigmoid(0.5 * 2); pair 1: 0 and +1 -> -log sigmoid(-0.5)
    assert losses.tolist() == pytest.approx([-math.log(1 / (1 + math.exp(-1))), -math.log(1 / (1 + math.exp(0.5)))])
    assert st["rewards/accuracies"].tolist() == [1.0, 0.0]
    assert st["rewards/margins"].tolist() == pytest.approx([1.0, -0.5])
    ipo, _ = dpo_loss(logps, ref, lengths, 0.5, "ipo")
    assert ipo.tolist() == pytest.approx([(1 / 2 + 1 / 3 - 1) ** 2, (0 - 1 / 2 - 1) ** 2])


def _cfg(files: dict, *extra: str) -> TrainConfig:
    return load_config(TrainConfig, ROOT / "configs/dpo.yaml", [
        f"model.init={files['model']}", f"data.path={files['conversational']}", f"data.val_path={files['standard']}",
        "train.max_steps=6", "train.lr=3e-3", "train.warmup_steps=1", "train.log_every=0", "train.eval_every=3",
        "train.ckpt_every=3", "train.batch_size=2", "train.preflight=false", *extra])


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("method", ["lora", "full"])
def test_resume_is_bit_exact(files, tmp_path, monkeypatch, method):
    """A run stopped after step 4 (checkpoint at 3) and resumed equals an uninterrupted one bit for bit."""
    from lmforge.train.checkpoint import load_state, resolve_checkpoint

    cfg = lambda: _cfg(files, f"train.method={method}")  # noqa: E731
    a = train_dpo(cfg(), tmp_path / "a")
    assert a["status"] == "finished" and a["dpo"]["pairs"]["kept"] == 16 and len(a["model_init_hash"]) == 64
    assert a["memory_estimate"]["args"]["batch"] == 4 and a["memory_estimate"]["total_bytes"] > 0  # 2 pairs, 4 rows
    real_step = DPOTrainer.train_step

    def stop_after_4(self):
        if self.step == 4:
            raise KeyboardInterrupt("stopped")
        return real_step(self)

    monkeypatch.setattr(DPOTrainer, "train_step", stop_after_4)
    with pytest.raises(KeyboardInterrupt):
        train_dpo(cfg(), tmp_path / "b")
    monkeypatch.setattr(DPOTrainer, "train_step", real_step)
    assert [m["step"] for m in _metrics(tmp_path / "b")] == [1, 2, 3, 4]
    b = train_dpo(cfg(), tmp_path / "b", resume=True)
    assert b["status"] == "finished"
    ma, mb = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    assert [m["step"] for m in mb] == list(range(1, 7))
    for key in ("loss", "grad_norm", *METRICS, "val_loss", "val_rewards/accuracies"):
        assert [m.get(key) for m in ma] == [m.get(key) for m in mb], key
    # it learns to prefer chosen: on held-out pairs (same tasks, the other format) below log 2, margin > 0
    assert ma[-1]["val_loss"] < math.log(2) and ma[-1]["val_rewards/margins"] > 0
    wa = load_state(resolve_checkpoint(tmp_path / "a", "last")[0])["model"]
    wb = load_state(resolve_checkpoint(tmp_path / "b", "last")[0])["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_reference_is_the_starting_model(files, tmp_path):
    """LoRA: adapters off = the base, so step 1's loss is exactly log 2; full: precomputed reference log-probs
    give the same run as the frozen copy."""
    lora = train_dpo(_cfg(files, "train.max_steps=2", "train.eval_every=0"), tmp_path / "lora")
    first = _metrics(tmp_path / "lora")[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-7) and first["rewards/margins"] == 0.0
    assert lora["dpo"]["reference"] == "adapters disabled"
    runs = {}
    for name, extra in (("copy", ()), ("pre", ("dpo.precompute_ref_log_probs=true",))):
        rec = train_dpo(_cfg(files, "train.method=full", "train.max_steps=3", *extra), tmp_path / name)
        runs[name] = _metrics(tmp_path / name)
        assert rec["dpo"]["reference"] == ("precomputed" if name == "pre" else "frozen copy of model.init")
    for key in ("loss", "rewards/chosen", "val_loss"):
        assert [m.get(key) for m in runs["copy"]] == [m.get(key) for m in runs["pre"]], key


def test_bad_pairs_and_config_are_refused_with_the_place(files, tmp_path):
    tok = load_tokenizer(files["model"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "q", "chosen": "a", "rejected": "b"}\n{"prompt": "q", "chosen": "a"}\n')
    with pytest.raises(PreferenceDataError, match=r"bad.jsonl:2: field 'rejected' is missing"):
        PreferenceLoader(bad, tok, max_length=64, batch_size=1)
    bad.write_text('{"prompt": [{"role": "user", "content": "q"}], "chosen": "a", "rejected": "b"}\n')
    with pytest.raises(PreferenceDataError, match=r"bad.jsonl:1: field 'chosen' must be a non-empty list"):
        PreferenceLoader(bad, tok, max_length=64, batch_size=1)
    with pytest.warns(UserWarning, match="dropped"):  # every prompt longer than max_length: nothing left
        with pytest.raises(PreferenceDataError, match="raise train.seq_len"):
            PreferenceLoader(files["conversational"], tok, max_length=4, batch_size=1)
    with pytest.raises(ConfigError, match="model.init"):
        load_config(TrainConfig, ROOT / "configs/dpo.yaml", [f"data.path={files['standard']}"]).validate()
    with pytest.raises(ConfigError, match="dpo.beta"):
        _cfg(files, "dpo.beta=0").validate()


@pytest.mark.slow
def test_ddp_two_processes_equal_one_with_twice_the_pairs(files, tmp_path):
    """The loss is the mean over the step's pairs across ranks and micro-batches: 2 processes x 1 pair (torchrun)
    = 1 process x 2 pairs = 1 process x 1 pair x accumulation 2."""
    from test_train_ddp import lmforge_train

    common = ["train.method=full", "train.max_steps=3", "train.lr=3e-3", "train.warmup_steps=1", "train.eval_every=0",
              "train.ckpt_every=0", "train.preflight=false", "train.dtype=float32", f"data.path={files['conversational']}"]
    lmforge_train(ROOT / "configs/dpo.yaml", f"model.init={files['model']}", *common, "train.batch_size=1",
                  "--out", tmp_path / "ddp", nproc=2)
    train_dpo(_cfg(files, *common, "train.batch_size=2", "data.val_path=null"), tmp_path / "one")
    train_dpo(_cfg(files, *common, "train.batch_size=1", "train.grad_accum=2", "data.val_path=null"),
              tmp_path / "accum")
    runs = {n: _metrics(tmp_path / n) for n in ("ddp", "one", "accum")}
    for key in ("loss", "rewards/margins", "grad_norm"):
        assert [m[key] for m in runs["ddp"]] == pytest.approx([m[key] for m in runs["one"]], abs=1e-5), key
        assert [m[key] for m in runs["accum"]] == pytest.approx([m[key] for m in runs["one"]], abs=1e-5), key
    assert runs["one"][-1]["loss"] != runs["one"][0]["loss"]
