"""Tokenize prepared splits and pack them into flat token shards that training memory-maps.

Layout (`lmforge-packed-v1`): each split is one contiguous token stream, cut into numpy
memmap shards `{split}_{k:05d}.bin` (raw little-endian `uint16` when the vocabulary fits,
else `uint32`). Every document is written as `[BOS] + tokens + [EOS]`, in the order of
`splits/{split}.jsonl`, so document boundaries are recoverable from EOS alone. Row `i` of a
split is `stream[i*T : i*T + T + 1]` (`T = seq_len`): `T` inputs, each with its next-token
target; consecutive rows share one token. Rows never pad; a tail shorter than `T + 1` tokens
is not a row (its size is reported as `tail_tokens`). `lmforge.data.loader` turns rows into
`input_ids / labels / doc_ids / position_ids`.

Tokenization runs in worker processes over fixed-size chunks of documents and the results are
written in chunk order, so the shards are byte-identical for any number of workers.
This module knows nothing about cleaning (that is `prepare`) or about training.

    from lmforge.data.pack import pack_dataset
    manifest = pack_dataset("runs/data", "runs/tok", seq_len=512, out_dir="runs/packed")
"""

from __future__ import annotations

import hashlib
import itertools
import json
import multiprocessing as mp
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from lmforge.tokenizer.load import _tokenizer_json, tokenizer_hash
from lmforge.tokenizer.special import BOS, EOS
from lmforge.track.io import atomic_write_json, sha256_file
from lmforge.track.progress import Progress
from lmforge.track.run import RunDir

FORMAT = "lmforge-packed-v1"
SPLITS = ("train", "val", "test")
CHUNK_DOCS = 256  # documents per worker task: big enough to amortize IPC, small enough to stream
DEFAULT_SHARD_TOKENS = 1 << 28  # 512 MiB of uint16 per shard

_worker_tok: Any = None


def _load_raw_tokenizer(tokenizer_dir: str | os.PathLike) -> Any:
    return Tokenizer.from_file(str(_tokenizer_json(tokenizer_dir)))


def _init_worker(tokenizer_dir: str) -> None:
    global _worker_tok
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _worker_tok = _load_raw_tokenizer(tokenizer_dir)


def _encode_chunk(args: tuple[list[str], int, int, str]) -> tuple[bytes, int, int]:
    """Token bytes of one chunk of documents: [BOS] + ids + [EOS] per document."""
    texts, bos, eos, dtype = args
    encodings = _worker_tok.encode_batch(texts, add_special_tokens=False)
    flat = np.concatenate([np.asarray([bos, *enc.ids, eos], dtype=np.int64) for enc in encodings])
    return flat.astype(dtype).tobytes(), len(flat), sum(len(t.encode("utf-8")) for t in texts)


def _read_split_texts(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: expected a JSON object with a string field 'text' "
                                 f"({e}); rerun `lmforge data prepare` to regenerate the split") from None
            yield text


def _chunks(texts: Iterator[str], size: int) -> Iterator[list[str]]:
    """Lists of `size` consecutive items (the last one shorter)."""
    it = iter(texts)
    return iter(lambda: list(itertools.islice(it, size)), [])


class _ShardWriter:
    """Append token bytes to `{split}_{k:05d}.bin`, starting a new shard every `shard_tokens`."""

    def __init__(self, out: Path, split: str, itemsize: int, shard_tokens: int):
        self.out, self.split, self.itemsize, self.shard_tokens = out, split, itemsize, shard_tokens
        self.files: list[dict] = []
        self._f = None
        self._in_shard = 0

    def _open_next(self) -> None:
        self.close()
        name = f"{self.split}_{len(self.files):05d}.bin"
        self.files.append({"name": name, "tokens": 0})
        self._f = open(self.out / name, "wb")
        self._in_shard = 0

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self._f is None or self._in_shard == self.shard_tokens:
                self._open_next()
            n = min(self.shard_tokens - self._in_shard, len(view) // self.itemsize)
            self._f.write(view[: n * self.itemsize])
            self._in_shard += n
            self.files[-1]["tokens"] += n
            view = view[n * self.itemsize:]

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def _prepared_data_hash(prepared: Path) -> str:
    """The prepared dir's `data_hash`, after checking the hand-off: a folder written by `data prepare`
    (it has a record.json) is read only when its record says finished and every split's sha256
    matches its manifest, so the output of a killed or still-running prepare is refused, naming the
    file. A folder of splits a user made by hand (no record) uses its manifest's `data_hash` when it
has one, else a hash of its split files."""
    record, manifest = prepared / "record.json", prepared / "manifest.json"
    if record.is_file():  # `data prepare` writes it first thing, so even a killed run leaves one
        status = _json(record).get("status")
        if status != "finished":
            raise ValueError(f"{record}: status {status!r}, not 'finished': the prepare run that wrote {prepared} "
                             f"did not complete (killed, failed or still running); rerun `lmforge data prepare ... "
                             f"--out {prepared} --overwrite`")
        if not manifest.is_file():
            raise ValueError(f"{manifest}: missing although {record} says finished; rerun `lmforge data prepare "
                             f"... --out {prepared} --overwrite`")
        m = _json(manifest)
        for split in SPLITS:
            name, path = f"splits/{split}.jsonl", prepared / "splits" / f"{split}.jsonl"
            want = m.get("outputs", {}).get(name)
            if want is None or not path.is_file() or sha256_file(path) != want:
                raise ValueError(f"{path}: {'missing' if not path.is_file() else 'does not match'} its sha256 in "
                                 f"{manifest}; the splits changed after prepare finished: rerun `lmforge data "
                                 f"prepare ... --out {prepared} --overwrite`")
        return m["data_hash"]
    if manifest.is_file() and _json(manifest).get("data_hash"):  # a hand-made folder that names its hash
        return _json(manifest)["data_hash"]
    h = hashlib.sha256()
    for split in SPLITS:
        path = prepared / "splits" / f"{split}.jsonl"
        if path.is_file():
            h.update(f"{split}\0{sha256_file(path)}\n".encode())
    return h.hexdigest()


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable ({type(e).__name__}: {e}); rerun the stage that wrote it") from None


def _pack_split(src: Path, writer: _ShardWriter, pool: Any, tokenizer_dir: str, bos: int, eos: int,
                dtype: str, progress: Any) -> dict[str, int]:
    tasks = ((chunk, bos, eos, dtype) for chunk in _chunks(_read_split_texts(src), CHUNK_DOCS))
    if pool is None:
        _init_worker(tokenizer_dir)
        results = map(_encode_chunk, tasks)
    else:
        results = pool.imap(_encode_chunk, tasks)  # ordered: output independent of worker count
    tokens = documents = nbytes = 0
    for data, n, b in results:
        writer.write(data)
        tokens += n
        nbytes += b
        documents += int(np.count_nonzero(np.frombuffer(data, dtype=dtype) == eos))
        if progress is not None:
            progress.advance(b)
    writer.close()
    return {"tokens": tokens, "documents": documents, "bytes": nbytes}


def _split_sources(prepared: Path) -> dict[str, Path]:
    sources = {s: prepared / "splits" / f"{s}.jsonl" for s in SPLITS}
    sources = {s: p for s, p in sources.items() if p.is_file()}
    if not sources:
        raise FileNotFoundError(f"{prepared}: no splits/train.jsonl, val.jsonl or test.jsonl; "
                                f"run `lmforge data prepare INPUT... --out {prepared}` first")
    return sources


def _special_ids(tok: Any, tokenizer_dir: str | os.PathLike) -> tuple[int, int]:
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    if bos is None or eos is None:
        raise ValueError(f"{tokenizer_dir}: tokenizer lacks {BOS} or {EOS}; train it with "
                         "`lmforge tokenizer train`")
    return bos, eos


def _split_entry(writer: _ShardWriter, counts: dict[str, int], seq_len: int) -> dict[str, Any]:
    """A split's manifest entry: its shards, and its rows of seq_len + 1 tokens (one shared)."""
    rows = max(0, (counts["tokens"] - 1) // seq_len)
    return {"files": [f["name"] for f in writer.files], "file_tokens": [f["tokens"] for f in writer.files],
            "rows": rows, "tokens": counts["tokens"], "documents": counts["documents"],
            "tail_tokens": counts["tokens"] - rows * seq_len, "text_bytes": counts["bytes"]}


def _pack_splits(out: Path, sources: dict[str, Path], tokenizer_dir: str, bos: int, eos: int, dtype: str,
                 seq_len: int, workers: int, shard_tokens: int, show_progress: bool,
                 executor: Any = None) -> dict[str, dict]:
    """Tokenize and write every split's shards (in a spawn pool when workers > 1, on the executor's
    Ray tasks when given one: the same ordered `imap`)."""
    splits: dict[str, dict] = {}
    pool = None
    try:
        if executor is not None:
            pool = executor.pool(_init_worker, (tokenizer_dir,))
        elif workers > 1:
            pool = mp.get_context("spawn").Pool(workers, _init_worker, (tokenizer_dir,))
        for split, src in sources.items():
            writer = _ShardWriter(out, split, np.dtype(dtype).itemsize, shard_tokens)
            with Progress(f"pack {split}", total=src.stat().st_size, unit="bytes", enabled=show_progress) as bar:
                counts = _pack_split(src, writer, pool, tokenizer_dir, bos, eos, dtype, bar)
            splits[split] = _split_entry(writer, counts, seq_len)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    return splits


def pack_dataset(prepared_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike, seq_len: int,
                 out_dir: str | os.PathLike, workers: int | None = None, *,
                 shard_tokens: int = DEFAULT_SHARD_TOKENS, overwrite: bool = False,
                 show_progress: bool = False, executor: Any = None) -> dict[str, Any]:
    """Tokenize `prepared_dir/splits/*.jsonl` and write packed shards + manifest.json to `out_dir`.
    `executor`: a `lmforge.data.executor.RayExecutor` tokenizes on its cluster (same bytes).

    Returns the manifest. Raises FileNotFoundError when the prepared dir has no splits or the
    tokenizer folder has no tokenizer.json, ValueError for a bad seq_len or a malformed split line.
    """
    prepared = Path(prepared_dir)
    if seq_len < 1:
        raise ValueError(f"seq_len must be a positive number of tokens, got {seq_len}")
    sources = _split_sources(prepared)
    data_hash = _prepared_data_hash(prepared)  # before any work: refuses an unfinished prepare
    tok = _load_raw_tokenizer(tokenizer_dir)  # raises naming the folder when tokenizer.json is missing
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    bos, eos = _special_ids(tok, tokenizer_dir)
    dtype = "uint16" if vocab_size <= 1 << 16 else "uint32"
    workers = max(1, workers or os.cpu_count() or 1) if executor is None else executor.workers

    out = Path(out_dir)
    run = RunDir(out, overwrite=overwrite)
    for old in out.glob("*.bin"):
        old.unlink()
    t0 = time.monotonic()
    splits = _pack_splits(out, sources, os.fspath(tokenizer_dir), bos, eos, dtype, seq_len, workers,
                          shard_tokens, show_progress, executor)
    seconds = time.monotonic() - t0
    total_bytes = sum(s["text_bytes"] for s in splits.values())
    manifest = {
        "format": FORMAT, "seq_len": seq_len, "dtype": dtype, "vocab_size": vocab_size,
        "eos_token_id": eos, "bos_token_id": bos, "bos_per_document": True,
        "row_layout": "stream: row i = tokens[i*seq_len : i*seq_len + seq_len + 1]",
        "tokenizer_hash": tokenizer_hash(tokenizer_dir), "data_hash": data_hash,
        "prepared_dir": os.fspath(prepared), "splits": splits,
    }
    manifest["packed_hash"] = hashlib.sha256("".join(
        sha256_file(out / f) for s in splits.values() for f in s["files"]).encode()).hexdigest()
    atomic_write_json(out / "manifest.json", manifest)
    run.write_config({"prepared_dir": os.fspath(prepared), "tokenizer_dir": os.fspath(tokenizer_dir),
                      "seq_len": seq_len, "workers": workers, "shard_tokens": shard_tokens})
    run.write_record({"inputs": {"data_hash": manifest["data_hash"], "tokenizer_hash": manifest["tokenizer_hash"]},
                      "outputs": {"packed_hash": manifest["packed_hash"]}})
    run.finish(seconds=round(seconds, 3), mb_per_s=round(total_bytes / 1e6 / max(seconds, 1e-9), 3),
               tokens={s: v["tokens"] for s, v in splits.items()},
               rows={s: v["rows"] for s, v in splits.items()})
    return manifest
