"""`lmforge flywheel build`: every exchange accounted for, each drop with its reason, PII scrubbed,
SFT lines the trainer parses, preference pairs, a config `lmforge train` accepts.

    python -m pytest tests/test_flywheel.py -q
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from lmforge.config import load_config
from lmforge.registry import FeedbackStore, Registry, RegistryError
from lmforge.registry.flywheel import DROP_REASONS, build, prompt_messages
from lmforge.train.config import TrainConfig
from lmforge.train.sft_data import parse_messages

ROOT = Path(__file__).resolve().parents[1]
ARITH_QUESTION = "Finn has 31 coins. Finn buys 26 more. How many coins does Finn have now?"  # arith-0000


def _champion(tmp: Path) -> Registry:
    m = tmp / "champ"
    m.mkdir()
    (m / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 256}))
    (m / "model.safetensors").write_bytes(b"\0" * 64)
    (m / "tokenizer.json").write_text("{}")
    reg = Registry(tmp / "reg.db")
    reg.add("tiny", m)
    return reg


# (prompt, response, score, correction, model) -> the reason it must be dropped, or None when kept
CASES = [
    ("How do I reverse a list in Python? Write to bob@example.com", "Use sorted().", -1,
     "Use list.reverse(), or reversed() for a copy.", "tiny", None),
    ("How do I reverse a list in Python? Write to bob@example.com", "Use sorted().", -1,
     "Use list.reverse(), or reversed() for a copy.", "tiny", "duplicate"),
    ("What is the capital of France?", "Berlin.", -1, None, "tiny", None),
    ("What is the capital of France?", "Paris.", 1, None, "tiny", None),
    ("What is the capital of Peru?", "Lima.", 5, None, "tiny", "high_score_unpaired"),
    ("Name a prime above 100.", "100.", 2, None, "tiny", "low_score_unpaired"),
    (ARITH_QUESTION, "56", -1, "57", "tiny", "contamination"),
    ("What is 14 + 31?", "44", -1, "45", "tiny", "contamination"),  # arith-cot: too short for 13-grams
    ("hello", "hi", -1, "Hello! How can I help?", "other", "other_model"),
    ("unscored", "x", None, None, "tiny", "no_feedback"),
    ("so-so", "meh", 3, None, "tiny", "neutral_score"),
    ("Explain <|im_end|> please", "?", -1, "It ends a message.", "tiny", "control_tokens"),
    ("Tell me about dicts", "No idea.", -1, "A dict maps keys to values.", "tiny", "duplicate_of_training_data"),
]


def _store(tmp: Path) -> Path:
    path = tmp / "feedback.db"
    store = FeedbackStore(path)
    store.log_exchanges([{"id": f"c{i}", "created": "2026-12-01T00:00:00Z", "model": model, "model_version": "1",
                          "user": "u", "kind": "chat", "prompt": prompt, "response": response}
                         for i, (prompt, response, _, _, model, _) in enumerate(CASES)])
    for i, (_, _, score, correction, _, _) in enumerate(CASES):
        if score is not None:
            assert store.add_feedback(f"c{i}", score, correction=correction)
    store.close()
    # a row stored before masking existed: the flywheel's own scrub must catch it
    con = sqlite3.connect(path)
    con.execute("INSERT INTO exchanges (id, created, model, model_version, user, kind, prompt, response, pii) "
                "VALUES ('old', 't', 'tiny', '1', NULL, 'completion', "
                "'Ping me at old.user@example.net about sets', 'No.', '{}')")
    con.execute("INSERT INTO feedback (exchange_id, created, score, scale, normalized, correction) "
                "VALUES ('old', 't', -1, 'thumbs', 0, 'A set holds unique items; mail old.user@example.net')")
    con.commit()
    con.close()
    return path


def test_flywheel_cli_accounts_for_every_exchange(tmp_path: Path) -> None:
    reg = _champion(tmp_path)
    feedback = _store(tmp_path)
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"messages": [{"role": "user", "content": "Tell me about dicts"},
                                              {"role": "assistant", "content": "A dict maps keys to values."}]}) + "\n")
    out = tmp_path / "fw"
    r = subprocess.run([sys.executable, "-m", "lmforge.registry", "flywheel", "build", "--feedback", str(feedback),
                        "--registry", str(reg.path), "--model", "tiny", "--out", str(out), "--min-count", "2",
                        "--train-data", str(train)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "READY: 2 SFT examples >= --min-count 2" in r.stdout
    stats = json.loads((out / "stats.json").read_text())
    expected = Counter(reason for *_, reason in CASES if reason)
    assert stats["dropped"] == {reason: expected.get(reason, 0) for reason in DROP_REASONS}
    assert stats["in"] == len(CASES) + 1 == stats["kept"] + sum(stats["dropped"].values())
    assert stats["kept"] == 3 + 1  # c0 (corrected), c2 + c3 (a scored pair), and the old row
    assert stats["kept_by_version"] == {"1": 4}
    rejected = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    assert Counter(x["reason"] for x in rejected) == expected
    assert {x["id"]: x["reason"] for x in rejected}["c1"] == "duplicate"
    assert next(x for x in rejected if x["id"] == "c1")["of"] == "c0"

    lines = (out / "sft.jsonl").read_text().splitlines()
    sft = [parse_messages(line, "sft.jsonl", i) for i, line in enumerate(lines, 1)]  # the trainer's parser
    assert [m[-1]["content"] for m in sft] == ["Use list.reverse(), or reversed() for a copy.",
                                               "A set holds unique items; mail <EMAIL>"]
    assert sft[0][0]["content"] == "How do I reverse a list in Python? Write to <EMAIL>"
    assert stats["pii_masked"] == {"email": 2}  # the old row's prompt and correction
    text = (out / "sft.jsonl").read_text() + (out / "preferences.jsonl").read_text()
    assert "example.com" not in text and "example.net" not in text

    prefs = [json.loads(line) for line in (out / "preferences.jsonl").read_text().splitlines()]
    by_source = {p["meta"]["source"]: p for p in prefs if p["prompt"][0]["content"].startswith("What is the capital")}
    assert by_source["scores"]["chosen"][0]["content"] == "Paris."
    assert by_source["scores"]["rejected"][0]["content"] == "Berlin."
    assert stats["preferences"] == 3 and stats["preferences_from_corrections"] == 2

    cfg = load_config(TrainConfig, out / "sft-lora.yaml").validate()
    assert (cfg.train.stage, cfg.train.method, cfg.model.init) == ("sft", "lora", reg.get("tiny", "champion").path)
    assert Path(cfg.data.path) == (out / "sft.jsonl").resolve() and cfg.train.seq_len == 256
    record = json.loads((out / "record.json").read_text())
    assert record["status"] == "finished" and set(record["outputs"]) >= {"sft.jsonl", "preferences.jsonl", "stats.json"}


def test_flywheel_below_min_count_says_so_and_refuses_bad_input(tmp_path: Path) -> None:
    reg = _champion(tmp_path)
    feedback = _store(tmp_path)
    stats = build(feedback, reg, "tiny", tmp_path / "fw", min_count=50)
    assert not stats["ready"] and stats["verdict"].startswith("not ready: 3 SFT examples < --min-count 50")
    assert stats["dropped"]["duplicate_of_training_data"] == 0  # no --train-data: that record is kept
    with pytest.raises(RegistryError, match="no such file"):
        build(tmp_path / "missing.db", reg, "tiny", tmp_path / "fw2")
    with pytest.raises(RegistryError, match="no model named 'nope'"):
        build(feedback, reg, "nope", tmp_path / "fw3")
    with pytest.raises(RegistryError, match=r"--train-data .*no splits/\*.jsonl"):
        build(feedback, reg, "tiny", tmp_path / "fw4", train_data=[tmp_path])


def test_prompt_messages_reads_json_chatml_and_text() -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert prompt_messages("chat", json.dumps(msgs)) == msgs
    chatml = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert prompt_messages("chat", chatml) == msgs
    assert prompt_messages("completion", "def f(") == [{"role": "user", "content": "def f("}]


def test_training_config_rows_fit_the_data(tmp_path: Path) -> None:
    """One conversation per row (a batch never needs more rows than there are examples), rows as long as
    the longest conversation under the champion's tokenizer, rounded up to 64."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from lmforge.registry.flywheel import train_config

    reg = _champion(tmp_path)
    champ = reg.get("tiny", "champion")
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(Path(champ.path) / "tokenizer.json"))
    short = [{"messages": [{"role": "user", "content": "a a"}, {"role": "assistant", "content": "a"}]}] * 3
    cfg = train_config(champ, tmp_path / "sft.jsonl", short, "tiny")
    assert (cfg["train"]["seq_len"], cfg["train"]["batch_size"], cfg["sft"]["packed"]) == (64, 3, False)
    long = short + [{"messages": [{"role": "user", "content": "a " * 100}, {"role": "assistant", "content": "a"}]}]
    assert train_config(champ, tmp_path / "sft.jsonl", long, "tiny")["train"]["seq_len"] == 128  # 100+1+2*6 tokens
    huge = [{"messages": [{"role": "user", "content": "a " * 5000}, {"role": "assistant", "content": "a"}]}]
    assert train_config(champ, tmp_path / "sft.jsonl", huge, "tiny")["train"]["seq_len"] == 256  # the context
