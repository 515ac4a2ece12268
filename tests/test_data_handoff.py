"""Hand-offs between data stages: `data pack` reads only a prepared folder whose record says finished
and whose splits match their manifest; a killed `prepare --overwrite` leaves no stale manifest behind;
symlink loops in an input folder are skipped and reported; an input with no usable documents warns;
one file named two ways gives one `data_hash`. Each as a user meets it (issue 12, item 8).

    python -m pytest -q tests/test_data_handoff.py
"""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.data import prepare as prepare_mod
from lmforge.data.pack import pack_dataset
from lmforge.data.prepare import prepare_dataset
from lmforge.tokenizer import train_tokenizer

WORDS = ("the of and to in is was for on that with as by at from it the model reads a token and writes text "
         "one step at a time while the engine streams data to the server").split()


def write_jsonl(path: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i in range(n):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(60, 120))) + f". Document {i} of {seed}."
            f.write(json.dumps({"text": text.capitalize()}) + "\n")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("handoff") / "data" / "docs.jsonl", 60, 1)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, corpus) -> Path:
    out = tmp_path_factory.mktemp("tok") / "tok"
    train_tokenizer([str(corpus)], out, vocab_size=300, show_progress=False)
    return out


def pack_cli(prepared: Path, tok: Path, out: Path) -> subprocess.CompletedProcess:
    exe = str(Path(sys.executable).with_name("lmforge"))
    return subprocess.run([exe, "data", "pack", str(prepared), "--tokenizer", str(tok), "--seq-len", "16",
                           "--out", str(out), "--workers", "1", "--no-progress"], capture_output=True, text=True)


def test_pack_refuses_unfinished_or_changed_prepares(tmp_path, corpus, tok_dir):
    prepared = tmp_path / "prepared"
    prepare_dataset([str(corpus)], prepared, workers=1)
    assert pack_dataset(prepared, tok_dir, 16, tmp_path / "ok", workers=1)["data_hash"]
    record = json.loads((prepared / "record.json").read_text())
    (prepared / "record.json").write_text(json.dumps({**record, "status": "running"}))  # what a kill leaves
    r = pack_cli(prepared, tok_dir, tmp_path / "p1")
    assert r.returncode == 2 and "record.json" in r.stderr and "'running'" in r.stderr and "--overwrite" in r.stderr
    (prepared / "record.json").write_text(json.dumps(record))
    with open(prepared / "splits" / "train.jsonl", "a") as f:
        f.write(json.dumps({"id": "x", "text": "added later", "meta": {}}) + "\n")
    r = pack_cli(prepared, tok_dir, tmp_path / "p2")
    assert r.returncode == 2 and "train.jsonl" in r.stderr and "does not match" in r.stderr
    assert not (tmp_path / "p2" / "manifest.json").exists()


def test_killed_overwrite_leaves_no_manifest_to_stamp_partial_splits(tmp_path, corpus, tok_dir, monkeypatch):
    prepared = tmp_path / "prepared"
    prepare_dataset([str(corpus)], prepared, workers=1)

    def killed(self, *a, **k):
        raise KeyboardInterrupt  # as if the process were stopped half-way through
    monkeypatch.setattr(prepare_mod._Pipeline, "pass3", killed)
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset([str(write_jsonl(tmp_path / "other.jsonl", 30, 2))], prepared, workers=1, overwrite=True)
    assert not (prepared / "manifest.json").exists()
    with pytest.raises(ValueError, match="did not complete"):
        pack_dataset(prepared, tok_dir, 16, tmp_path / "p", workers=1)


def test_symlink_loops_are_skipped_and_empty_inputs_warn(tmp_path, corpus, caplog):
    folder = tmp_path / "inputs"
    folder.mkdir()
    os.symlink(corpus, folder / "good.jsonl")
    os.symlink(folder / "b.jsonl", folder / "a.jsonl")
    os.symlink(folder / "a.jsonl", folder / "b.jsonl")
    (folder / "empty.jsonl").write_text("")
    with caplog.at_level(logging.WARNING, logger="lmforge.data"):
        stats = prepare_dataset([str(folder)], tmp_path / "out", workers=1)
    assert stats["totals"]["kept"] > 0
    assert any("a.jsonl" in m and "symlink loop" in m for m in caplog.messages)
    assert any("empty.jsonl" in w and "no usable documents" in w for w in stats["warnings"])
    r = subprocess.run([str(Path(sys.executable).with_name("lmforge")), "data", "prepare", str(folder / "a.jsonl"),
                        "--out", str(tmp_path / "o2"), "--workers", "1"], capture_output=True, text=True)
    assert r.returncode == 2 and "symlink loop" in r.stderr and "permission" not in r.stderr


def test_one_file_named_two_ways_gives_one_data_hash(tmp_path, corpus, monkeypatch):
    monkeypatch.chdir(corpus.parent.parent)
    a = prepare_dataset(["data/docs.jsonl"], tmp_path / "a", workers=1)
    b = prepare_dataset([str(corpus.parent / ".." / "data" / "docs.jsonl")], tmp_path / "b", workers=1)
    ha = json.loads((tmp_path / "a" / "manifest.json").read_text())["data_hash"]
    hb = json.loads((tmp_path / "b" / "manifest.json").read_text())["data_hash"]
    assert a["totals"] == b["totals"] and ha == hb
