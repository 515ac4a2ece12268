"""Packing prepared splits into token shards, and the resumable, rank-sharded loader.

A tiny tokenizer is trained once per module on a small generated corpus; prepared folders are
written by hand (splits/*.jsonl), so this file does not depend on `prepare`. A few seconds on CPU.

    python -m pytest -q tests/test_data_pack.py
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.data.loader import PackedDataset, PackedLoader
from lmforge.data.pack import pack_dataset
from lmforge.tokenizer import load_tokenizer, train_tokenizer


def lmforge_data(*args: str) -> list[str]:
    """The CLI as users run it (switch to ["lmforge", "data", *args] once cli.py mounts it)."""
    return [str(Path(sys.executable).with_name("lmforge")), "data", *args]


WORDS = ("alpha beta gamma delta epsilon zeta theta lambda sigma omega tensor matrix vector "
         "python module function class return value error packet engine token").split()


def make_docs(n: int, seed: int, max_words: int = 60) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_words))) + f" #{i}" for i in range(n)]


def write_prepared(root: Path, splits: dict[str, list[str]]) -> Path:
    (root / "splits").mkdir(parents=True)
    for split, texts in splits.items():
        with open(root / "splits" / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for i, t in enumerate(texts):
                f.write(json.dumps({"id": f"{split}-{i}", "text": t, "meta": {}}) + "\n")
    return root


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tokcorpus")
    (root / "a.txt").write_text("\n".join(make_docs(400, 0)), encoding="utf-8")
    out = root / "tok"
    train_tokenizer([str(root / "a.txt")], out, vocab_size=320, show_progress=False)
    return out


@pytest.fixture(scope="module")
def packed(tmp_path_factory, tok_dir) -> tuple[Path, dict, dict]:
    root = tmp_path_factory.mktemp("packed")
    splits = {"train": make_docs(300, 1, max_words=12), "val": make_docs(20, 2), "test": make_docs(20, 3)}
    prepared = write_prepared(root / "prepared", splits)
    manifest = pack_dataset(prepared, tok_dir, seq_len=32, out_dir=root / "out", workers=1)
    return root / "out", manifest, splits


def test_manifest_contract(packed, tok_dir):
    out, manifest, splits = packed
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk == manifest
    for key in ("format", "seq_len", "dtype", "vocab_size", "eos_token_id", "bos_token_id",
                "tokenizer_hash", "data_hash", "splits"):
        assert key in manifest
    assert manifest["format"] == "lmforge-packed-v1" and manifest["dtype"] == "uint16"
    assert manifest["bos_token_id"] == 0 and manifest["eos_token_id"] == 1
    for split, texts in splits.items():
        s = manifest["splits"][split]
        assert s["documents"] == len(texts)
        assert s["rows"] == (s["tokens"] - 1) // 32
        assert sum(np.memmap(out / f, dtype=np.uint16, mode="r").size for f in s["files"]) == s["tokens"]
    assert json.loads((out / "record.json").read_text())["status"] == "finished"


def test_decoded_stream_gives_documents_in_order(packed, tok_dir):
    out, manifest, splits = packed
    tok = load_tokenizer(tok_dir)
    ds = PackedDataset(out, "train")
    stream = ds.tokens(0, manifest["splits"]["train"]["tokens"])
    eos, bos = manifest["eos_token_id"], manifest["bos_token_id"]
    assert stream[-1] == eos
    docs = np.split(stream, np.flatnonzero(stream == eos) + 1)[:-1]
    assert len(docs) == len(splits["train"])
    for tokens, text in zip(docs, splits["train"]):
        assert tokens[0] == bos and tokens[-1] == eos
        assert tok.decode(tokens[1:-1].tolist()) == text
    # rows overlap by one token and tile the stream
    assert np.array_equal(ds.row(0)[-1:], ds.row(1)[:1])
    assert np.array_equal(np.concatenate([ds.row(i)[:-1] for i in range(ds.num_rows)]),
                          stream[: ds.num_rows * 32])


def test_decoding_a_row_gives_its_documents_with_eos_between(packed, tok_dir):
    out, manifest, splits = packed
    tok = load_tokenizer(tok_dir)
    ds = PackedDataset(out, "train")
    row = next(r for r in map(ds.row, range(ds.num_rows)) if (r == manifest["eos_token_id"]).sum() >= 2)
    text = tok.decode(row.tolist(), skip_special_tokens=False)
    pieces = [p.replace("<|begin_of_text|>", "") for p in text.split("<|end_of_text|>")]
    joined = "<|end_of_text|>".join(splits["train"])
    inner = pieces[1:-1]  # whole documents inside the row
    assert inner and "<|end_of_text|>".join(inner) in joined
    for p in inner:
        assert p in splits["train"]


def reference_batch(rows: np.ndarray, eos: int) -> dict[str, np.ndarray]:
    """Slow, loop-by-loop reference for the loader's vectorised labels/doc_ids/positions."""
    B, T1 = rows.shape
    out = {k: np.zeros((B, T1 - 1), np.int64) for k in ("input_ids", "labels", "doc_ids", "position_ids")}
    for b in range(B):
        doc, pos = 0, 0
        for t in range(T1 - 1):
            out["input_ids"][b, t] = rows[b, t]
            out["labels"][b, t] = -100 if rows[b, t] == eos else rows[b, t + 1]
            out["doc_ids"][b, t], out["position_ids"][b, t] = doc, pos
            pos += 1
            if rows[b, t] == eos:
                doc, pos = doc + 1, 0
    return out


def test_batch_fields_match_reference(packed):
    out, manifest, _ = packed
    loader = PackedLoader(out, "train", batch_size=4, seed=3)
    ds = loader.dataset
    order = np.random.default_rng(3).permutation(ds.num_rows)
    for step in range(5):
        batch = next(loader)
        rows = np.stack([ds.row(int(i)) for i in order[step * 4: step * 4 + 4]])
        ref = reference_batch(rows, manifest["eos_token_id"])
        for key, value in ref.items():
            assert batch[key].dtype == torch.long and batch[key].shape == (4, 32)
            assert torch.equal(batch[key], torch.from_numpy(value)), key
        assert (batch["doc_ids"] > 0).any() and (batch["labels"] == -100).any()
    assert loader.tokens_per_batch == 4 * 32


def test_loader_resumes_exactly_and_reshuffles_epochs(packed):
    out, _, _ = packed
    a = PackedLoader(out, "train", batch_size=4, seed=7)
    steps = a.steps_per_epoch
    for _ in range(steps - 1):
        next(a)
    state = a.state_dict()
    expected = [next(a) for _ in range(3)]  # crosses into epoch 1
    assert a.epoch == 1
    b = PackedLoader(out, "train", batch_size=4, seed=7)
    b.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON round trip
    for want in expected:
        got = next(b)
        assert all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(ValueError, match="seed"):
        PackedLoader(out, "train", batch_size=4, seed=8).load_state_dict(state)
    first_epoch = [next(PackedLoader(out, "train", batch_size=4, seed=7))["input_ids"]]
    assert not torch.equal(first_epoch[0], expected[1]["input_ids"])


def test_ranks_take_disjoint_rows_matching_one_process(packed):
    out, _, _ = packed
    single = PackedLoader(out, "train", batch_size=4, seed=1)
    ranks = [PackedLoader(out, "train", batch_size=2, seed=1, rank=r, world_size=2) for r in range(2)]
    for _ in range(single.steps_per_epoch + 2):
        one = next(single)["input_ids"]
        r0, r1 = (next(r)["input_ids"] for r in ranks)
        assert torch.equal(one[0::2], r0) and torch.equal(one[1::2], r1)


def test_workers_give_identical_shards_and_multi_shard_rows(tmp_path, tok_dir):
    prepared = write_prepared(tmp_path / "prepared", {"train": make_docs(700, 5), "val": make_docs(5, 6)})
    m1 = pack_dataset(prepared, tok_dir, 16, tmp_path / "one", workers=1, shard_tokens=1000)
    m2 = pack_dataset(prepared, tok_dir, 16, tmp_path / "two", workers=2, shard_tokens=1000)
    assert m1["packed_hash"] == m2["packed_hash"] and len(m1["splits"]["train"]["files"]) > 3
    ds = PackedDataset(tmp_path / "two", "train")
    stream = np.concatenate([np.fromfile(tmp_path / "two" / f, dtype=np.uint16)
                             for f in m2["splits"]["train"]["files"]])
    for i in range(ds.num_rows):  # rows that straddle a shard boundary read across it
        assert np.array_equal(ds.row(i), stream[i * 16: i * 16 + 17])


def test_cli_pack_and_errors(tmp_path, tok_dir):
    prepared = write_prepared(tmp_path / "prepared", {"train": make_docs(50, 9)})
    ok = subprocess.run(lmforge_data("pack", str(prepared), "--tokenizer", str(tok_dir), "--seq-len", "8",
                                     "--out", str(tmp_path / "p"), "--workers", "1", "--no-progress"),
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "train" in ok.stdout and (tmp_path / "p" / "manifest.json").is_file()
    again = subprocess.run(lmforge_data("pack", str(prepared), "--tokenizer", str(tok_dir), "--seq-len", "8",
                                        "--out", str(tmp_path / "p"), "--no-progress"),
                           capture_output=True, text=True)
    assert again.returncode == 2 and "--overwrite" in again.stderr
    missing = subprocess.run(lmforge_data("pack", str(tmp_path / "nope"), "--tokenizer", str(tok_dir),
                                          "--seq-len", "8", "--out", str(tmp_path / "q")),
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "data prepare" in missing.stderr
