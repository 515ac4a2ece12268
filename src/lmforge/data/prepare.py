"""`prepare_dataset`: raw inputs -> clean, deduplicated, split, decontaminated JSONL.

Documents `{id, text, meta}` flow through steps in the datatrove style, each counting in, out
and drops per reason (every drop lands in `rejected.jsonl`, every unreadable line in
`quarantine.jsonl`):

    pass 1 (workers)  read -> normalize -> count candidate boilerplate lines
    pass 2 (workers)  boilerplate -> quality (length, split/drop long, Gopher) -> PII -> sha256, MinHash
           (main)     exact dedup -> near dedup (LSH) -> split by cluster hash
    pass 3 (main)     contamination: train 13-grams against val/test/--eval-set

Per-document work runs in worker processes over fixed chunks whose results come back in order;
everything stateful (dedup, LSH, split, writing) runs in the main process in input order, so the
outputs are byte-identical for any number of workers. Between passes documents stream through
`OUT/.work/` (pickled chunks); memory holds the boilerplate line counts, the exact-hash set, the LSH index
and the val/test 13-gram set, never the corpus. Counts reconcile (read + parts added by splitting
= kept + rejected + quarantined), checked before manifest.json is written.
This module wires the steps together; each rule lives in its own module.

    from lmforge.data.prepare import prepare_dataset
    stats = prepare_dataset(["python-docs"], "runs/data", overrides=["split.val=0.02"])
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import logging
import multiprocessing as mp
import os
import pickle
import shutil
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from lmforge.config import load_config, to_dict
from lmforge.data.boilerplate import boilerplate_keys, line_keys, strip_boilerplate
from lmforge.data.config import PrepareConfig
from lmforge.data.contamination import ContaminationIndex, eval_strings
from lmforge.data.dedup import NearDedup, exact_key, signatures
from lmforge.data.normalize import normalize_text
from lmforge.data.pii import mask_pii_many
from lmforge.data.quality import quality_reasons, split_long
from lmforge.data.readers import file_sha256, file_size, iter_records, resolve_inputs
from lmforge.data.sources import python_docs_snapshot
from lmforge.data.split import SPLITS, assign_split
from lmforge.track.io import atomic_write_json, atomic_write_text, sha256_file
from lmforge.track.progress import Progress
from lmforge.track.run import RunDir

log = logging.getLogger("lmforge.data")

CHUNK_DOCS = 64
MIN_BYTES_PER_WORKER = 16_000_000  # input bytes that pay for starting one worker process (~0.3 s CPU) 10x over
STEPS = ("read", "normalize", "boilerplate", "quality", "pii", "exact_dedup", "near_dedup", "split",
         "contamination")

_cfg: PrepareConfig | None = None


# ---- worker side: pure functions of one chunk of documents -------------------------------------

def _init_worker(cfg: PrepareConfig) -> None:
    global _cfg
    _cfg = cfg


def _pass1(docs: list[dict]) -> list[tuple[dict, int]]:
    """Normalize each document; also the hashes of its candidate boilerplate lines."""
    out = []
    for doc in docs:
        nbytes = len(doc["text"].encode("utf-8"))
        if _cfg.normalize:
            doc["text"] = normalize_text(doc["text"])
        keys = line_keys(doc["text"], _cfg.boilerplate.min_line_chars) if _cfg.boilerplate.enabled else []
        out.append((doc, nbytes, keys))
    return out


def _process_parts(parts: list[dict]) -> list[dict]:
    """Quality, PII, hashes of documents (or parts of split documents), the numpy work batched."""
    reasons = quality_reasons([doc["text"] for doc in parts], _cfg.quality)
    out = [{"doc": doc, "reason": reason, "step": "quality"} if reason else {"doc": doc, "reason": None, "pii": {}}
           for doc, reason in zip(parts, reasons)]
    kept = [item for item in out if item["reason"] is None]
    if _cfg.pii.enabled and kept:
        for item, (text, pii) in zip(kept, mask_pii_many([item["doc"]["text"] for item in kept], _cfg.pii)):
            item["doc"]["text"], item["pii"] = text, pii
    for item in kept:
        item["exact"], item["sig"] = exact_key(item["doc"]["text"]), None
    if _cfg.near_dedup.enabled and kept:
        for item, sig in zip(kept, signatures([item["doc"]["text"] for item in kept], _cfg.near_dedup)):
            item["sig"] = sig
    return out


def _pass2(task: tuple[frozenset[int], list[dict]]) -> list[dict]:
    """Boilerplate, length / long-document policy, quality, PII, sha256 and MinHash per document.

    The boilerplate keys travel with each chunk (a few hundred ints), so one pool serves both passes."""
    bp_keys, docs = task
    out, parts, owners = [], [], []  # owners[i]: the item that part i belongs to
    for doc in docs:
        text, removed = strip_boilerplate(doc["text"], bp_keys, _cfg.boilerplate.min_line_chars)
        item: dict[str, Any] = {"id": doc["id"], "boilerplate_lines": removed, "parts": []}
        out.append(item)
        if not text:
            item["parts"] = [{"doc": doc, "reason": "boilerplate_only", "step": "boilerplate"}]
            continue
        doc["text"] = text
        if len(text) > _cfg.quality.max_chars and _cfg.quality.long_docs == "drop":
            item["parts"] = [{"doc": doc, "reason": "too_long", "step": "quality"}]
            continue
        pieces = split_long(text, _cfg.quality.max_chars) if len(text) > _cfg.quality.max_chars else [text]
        for k, piece in enumerate(pieces):
            part = doc if len(pieces) == 1 else {"id": f"{doc['id']}#part{k}", "text": piece,
                                                 "meta": {**doc["meta"], "part": k, "parent": doc["id"]}}
            parts.append(part)
            owners.append(item)
    for item, processed in zip(owners, _process_parts(parts)):
        item["parts"].append(processed)
    return out


# ---- main side ---------------------------------------------------------------------------------

def _chunks(items: Iterable[Any], size: int = CHUNK_DOCS) -> Iterator[list[Any]]:
    """Lists of `size` consecutive items (the last one shorter)."""
    it = iter(items)
    return iter(lambda: list(itertools.islice(it, size)), [])


def _read_jsonl(path: Path) -> Iterator[dict]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)


def _dumps(obj: Any, **kwargs: Any) -> str:
    """`json.dumps(obj, ensure_ascii=False, **kwargs)`, through json's ~2x faster ASCII escaper when
    that writes the same: it differs only by `\\uXXXX` escapes, so an output without "\\u" stands.
    A document whose text is not ASCII (`isascii` is O(1) on str) goes the plain way at once."""
    text = obj.get("text") if isinstance(obj, dict) else None
    if not (isinstance(text, str) and text.isascii()):
        return json.dumps(obj, ensure_ascii=False, **kwargs)
    out = json.dumps(obj, **kwargs)
    return out if "\\u" not in out else json.dumps(obj, ensure_ascii=False, **kwargs)


class _Writer:
    """Append-only JSONL with one fixed key order, so the bytes are reproducible. `path=None` keeps
    the lines in memory (`text()`): a Ray task's piece of an output, concatenated by the driver."""

    def __init__(self, path: Path | None):
        self.path, self.count = path, 0
        if path is None:
            self._f: Any = io.StringIO()
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(path, "w", encoding="utf-8")

    def write(self, obj: dict) -> None:
        self._f.write(_dumps(obj) + "\n")
        self.count += 1

    def text(self) -> str:
        return self._f.getvalue()

    def close(self) -> None:
        if self.path is not None:
            self._f.close()


class _WorkFile:
    """Documents between passes (`OUT/.work`, deleted at the end): pickled lists of CHUNK_DOCS
    documents, ~5x cheaper to write and read back than JSON lines; same `write`/`count` as _Writer."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.count = path, 0
        self._f = open(path, "wb")
        self._buffer: list[dict] = []

    def write(self, obj: dict) -> None:
        self._buffer.append(obj)
        self.count += 1
        if len(self._buffer) == CHUNK_DOCS:
            pickle.dump(self._buffer, self._f, protocol=pickle.HIGHEST_PROTOCOL)
            self._buffer = []

    def close(self) -> None:
        if self._buffer:
            pickle.dump(self._buffer, self._f, protocol=pickle.HIGHEST_PROTOCOL)
        self._f.close()

    @staticmethod
    def read(path: Path) -> Iterator[dict]:
        with open(path, "rb") as f:
            while True:
                try:
                    yield from pickle.load(f)
                except EOFError:
                    return


class _Stats:
    def __init__(self) -> None:
        self.steps = {name: {"in": 0, "out": 0, "dropped": Counter()} for name in STEPS}
        self.extra: dict[str, Any] = {}

    def as_dict(self) -> dict:
        return {name: {"in": s["in"], "out": s["out"], "dropped": dict(sorted(s["dropped"].items())),
                       **{k: v for k, v in s.items() if k not in ("in", "out", "dropped")}}
                for name, s in self.steps.items()}


class _SequentialDedup:
    """Exact and near dedup decided here, in input order (the local executor): the first document
    with a text hash survives, and each survivor joins the LSH index as it comes. The Ray executor
    decides the same by hash bucket (`data/executor.py`) and hands `_Pipeline` its decisions."""

    def __init__(self, cfg: PrepareConfig):
        self.cfg = cfg
        self.exact_seen: dict[bytes, str] = {}
        self.lsh = NearDedup(cfg.near_dedup) if cfg.near_dedup.enabled else None

    def exact(self, part: dict) -> str | None:
        """The id of the first document with this part's text, when that is not this one."""
        if not self.cfg.exact_dedup:
            return None
        first = self.exact_seen.setdefault(part["exact"], part["doc"]["id"])
        return first if first != part["doc"]["id"] else None

    def near(self, part: dict) -> tuple[str | None, float]:
        return (None, 0.0) if self.lsh is None else self.lsh.add(part["doc"]["id"], part["sig"])


class _Pipeline:
    def __init__(self, cfg: PrepareConfig, out: Path | None, pool: Any = None, progress: Any = None):
        """`out=None`: rejected and quarantined lines stay in memory (a Ray task's piece)."""
        self.cfg, self.out = cfg, out
        self.work = out / ".work" if out is not None else None
        self.pool, self.progress = pool, progress
        self.stats = _Stats()
        self.rejected = _Writer(out / "rejected.jsonl" if out is not None else None)
        self.quarantine = _Writer(out / "quarantine.jsonl" if out is not None else None)
        self.dedup: Any = _SequentialDedup(cfg)
        self.bytes_read = 0
        self.index_base = 0  # documents read before this pipeline's first (a Ray shard's offset)
        self.parts_added = 0
        self.lines_removed = 0
        self.pii_counts: Counter = Counter()
        self.docs_with_pii = 0
        self.cluster_sizes: Counter = Counter()

    def _map(self, fn: Any, tasks: Iterable[Any]) -> Iterator[Any]:
        if self.pool is None:
            _init_worker(self.cfg)
            return map(fn, tasks)
        return self.pool.imap(fn, tasks)

    def reject(self, doc: dict, step: str, reason: str, **details: Any) -> None:
        self.stats.steps[step]["dropped"][reason] += 1
        self.rejected.write({"id": doc["id"], "step": step, "reason": reason, **details,
                             "text": doc["text"], "meta": doc.get("meta", {})})

    def _tick(self, name: str, n: int) -> None:
        if self.progress is not None:
            self.progress.tick(name, n)

    def pass1(self, records: Iterator[dict]) -> Counter:
        """Read + normalize; write normalized docs to .work and count boilerplate candidates."""
        counts: Counter = Counter()
        seen_ids: set[bytes] = set()

        def seen(index: int, doc: dict) -> bool:
            key = hashlib.blake2b(doc["id"].encode("utf-8"), digest_size=12).digest()
            if key in seen_ids:
                return True
            seen_ids.add(key)
            return False

        normalized = _WorkFile(self.work / "normalized.pkl")
        for results in self._map(_pass1, _chunks(records)):
            self.take_normalized(results, seen, normalized, counts)
            self._tick("read", len(results))
        normalized.close()
        self.close_pass1()
        return counts

    def take_normalized(self, results: list[tuple[dict, int, list[int]]], seen: Any, sink: Any,
                        counts: Counter | None) -> None:
        """The main side of pass 1 for one chunk: ids made unique, empty documents rejected."""
        read, norm = self.stats.steps["read"], self.stats.steps["normalize"]
        for doc, nbytes, keys in results:
            self.bytes_read += nbytes
            read["out"] += 1
            if seen(read["out"] - 1, doc):  # ids must be unique for the split guarantees; rename, visibly
                doc["meta"]["original_id"] = doc["id"]
                doc["id"] = f"{doc['id']}~{self.index_base + read['out']}"
                read.setdefault("renamed_duplicate_ids", 0)
                read["renamed_duplicate_ids"] += 1
            norm["in"] += 1
            if not doc["text"]:
                self.reject(doc, "normalize", "empty")
                continue
            norm["out"] += 1
            if counts is not None:
                counts.update(keys)
            sink.write(doc)

    def close_pass1(self) -> None:
        read = self.stats.steps["read"]
        read["in"] = read["out"] + self.quarantine.count
        read["dropped"]["quarantined"] = self.quarantine.count

    def split_writers(self) -> dict[str, Any]:
        if self.out is None:  # a Ray shard: the documents stay in memory
            return {s: _ListSink() for s in SPLITS}
        return {s: _WorkFile(self.work / "train.pkl") if s == "train"  # checked for contamination in pass 3
                else _Writer(self.out / "splits" / f"{s}.jsonl") for s in SPLITS}

    def pass2(self, bp_keys: frozenset[int]) -> None:
        """Boilerplate, quality, PII (workers); exact + near dedup and split (here, in order)."""
        writers = self.split_writers()
        chunks = _chunks(_WorkFile.read(self.work / "normalized.pkl"))
        for items in self._map(_pass2, ((bp_keys, chunk) for chunk in chunks)):
            self.take_cleaned(items, writers)
            self._tick("clean", len(items))
        for w in writers.values():
            w.close()
        self.close_pass2(len(bp_keys), {s: w.count for s, w in writers.items()},
                         sum(1 for c in self.cluster_sizes.values() if c > 1))

    def take_cleaned(self, items: list[dict], writers: dict[str, Any]) -> None:
        """The main side of pass 2 for one chunk: rejects, then dedup and split, in input order."""
        st = self.stats.steps
        for item in items:
            st["boilerplate"]["in"] += 1
            self.lines_removed += item["boilerplate_lines"]
            parts = item["parts"]
            if parts[0].get("step") == "boilerplate":
                self.reject(parts[0]["doc"], "boilerplate", parts[0]["reason"])
                continue
            st["boilerplate"]["out"] += 1
            st["quality"]["in"] += 1
            if len(parts) > 1:
                self.parts_added += len(parts) - 1
                st["quality"]["in"] += len(parts) - 1
            for part in parts:
                self._dedup_and_split(part, writers)

    def close_pass2(self, distinct_lines: int, sizes: dict[str, int], clusters_with_duplicates: int) -> None:
        st = self.stats.steps
        st["boilerplate"]["distinct_lines"] = distinct_lines
        st["boilerplate"]["lines_removed"] = self.lines_removed
        st["quality"]["parts_added_by_split"] = self.parts_added
        st["pii"]["counts"] = dict(sorted(self.pii_counts.items()))
        st["pii"]["documents_with_pii"] = self.docs_with_pii
        nd = st["near_dedup"]
        nd["duplicate_rate"] = round(nd["dropped"]["near_duplicate"] / nd["in"], 6) if nd["in"] else 0.0
        nd["clusters_with_duplicates"] = clusters_with_duplicates
        ex = st["exact_dedup"]
        ex["duplicate_rate"] = round(ex["dropped"]["exact_duplicate"] / ex["in"], 6) if ex["in"] else 0.0
        st["split"]["out"] = sum(sizes.values())
        st["split"]["sizes"] = sizes

    def _dedup_and_split(self, part: dict, writers: dict) -> None:
        st = self.stats.steps
        doc = part["doc"]
        if part["reason"]:
            self.reject(doc, part["step"], part["reason"])
            return
        st["quality"]["out"] += 1
        st["pii"]["in"] += 1
        st["pii"]["out"] += 1
        if part["pii"]:
            self.pii_counts.update(part["pii"])
            self.docs_with_pii += 1
            doc["meta"]["pii"] = part["pii"]
        st["exact_dedup"]["in"] += 1
        first = self.dedup.exact(part)
        if first is not None:
            self.reject(doc, "exact_dedup", "exact_duplicate", duplicate_of=first, cluster_id=first)
            self.cluster_sizes[first] += 1
            return
        st["exact_dedup"]["out"] += 1
        st["near_dedup"]["in"] += 1
        dup, sim = self.dedup.near(part)
        if dup is not None:
            self.reject(doc, "near_dedup", "near_duplicate", duplicate_of=dup, cluster_id=dup,
                        similarity=round(sim, 4))
            self.cluster_sizes[dup] += 1
            return
        st["near_dedup"]["out"] += 1
        self.cluster_sizes[doc["id"]] += 1
        doc["meta"]["cluster_id"] = doc["id"]
        st["split"]["in"] += 1
        writers[assign_split(doc["id"], self.cfg.split)].write({"id": doc["id"], "text": doc["text"],
                                                               "meta": doc["meta"]})

    def contamination_index(self, eval_sets: list[str]) -> tuple[ContaminationIndex, dict, int]:
        """The val/test and eval-set 13-grams; also each eval set's string count and the too-short ones."""
        index = ContaminationIndex(self.cfg.contamination.ngram)
        eval_info: dict[str, dict] = {}
        if not self.cfg.contamination.enabled:
            return index, eval_info, 0
        for split in ("val", "test"):
            for docs in _chunks(_read_jsonl(self.out / "splits" / f"{split}.jsonl")):
                index.add_many([doc["text"] for doc in docs])
        short_before = index.too_short
        for path in eval_sets:
            n = 0
            for texts in _chunks(eval_strings(path, self.cfg.contamination.eval_fields)):
                index.add_many(texts)
                n += len(texts)
            eval_info[path] = {"strings": n}
        return index, eval_info, index.too_short - short_before

    def pass3(self, eval_sets: list[str]) -> None:
        """Drop train documents sharing a 13-gram with val, test or an eval set."""
        train = _Writer(self.out / "splits" / "train.jsonl")
        index, eval_info, too_short = self.contamination_index(eval_sets)
        for docs in _chunks(_WorkFile.read(self.work / "train.pkl")):
            hits = index.hits_many([doc["text"] for doc in docs]) if self.cfg.contamination.enabled else None
            self.take_train(docs, hits, train)
        train.close()
        self.close_pass3(eval_info, too_short, len(index.ngrams))

    def take_train(self, docs: list[dict], hits: list[int] | None, train: Any) -> None:
        """The main side of pass 3: each train document with its n-gram hits (None: check disabled)."""
        st = self.stats.steps["contamination"]
        for doc, n in zip(docs, hits if hits is not None else [0] * len(docs)):
            st["in"] += 1
            if n:
                self.reject(doc, "contamination", "contamination", ngram_hits=n)
                continue
            st["out"] += 1
            train.write(doc)

    def close_pass3(self, eval_info: dict, too_short: int, index_ngrams: int) -> None:
        st = self.stats.steps["contamination"]
        if self.cfg.contamination.enabled:
            st["eval_strings_too_short"] = too_short
        st["eval_sets"] = eval_info
        st["index_ngrams"] = index_ngrams
        st["hits"] = st["dropped"].get("contamination", 0)


class _ListSink:
    """A split writer that keeps the documents (a Ray shard's train split, checked in pass 3)."""

    def __init__(self) -> None:
        self.docs: list[dict] = []
        self.count = 0

    def write(self, doc: dict) -> None:
        self.docs.append(doc)
        self.count += 1

    def close(self) -> None:
        pass


def _hashing_records(sources: list, cfg: PrepareConfig, quarantine: Any, builtin: dict,
                     warnings: list[str]) -> Iterator[dict]:
    """Documents of every source; a built-in source (it has no file to hash) comes with its manifest
    digest, both from the snapshot next to its cache (`sources.python_docs_snapshot`)."""
    for s in sources:
        n = 0
        if s.kind == "builtin":  # the only one, python-docs: documents and digest kept next to its cache
            docs, builtin[s.location] = python_docs_snapshot(_BUILTIN_DIGEST, _builtin_digest)
            n = len(docs)
            yield from docs
        else:
            for doc in iter_records([s], cfg.read.text_field, cfg.read.txt_mode, quarantine=quarantine):
                n += 1
                yield doc
        if n == 0:
            no_documents(s.location, warnings)


def no_documents(location: str, warnings: list[str]) -> None:
    warnings.append(f"{location}: no usable documents (empty, or every line quarantined)")
    log.warning(warnings[-1])


_BUILTIN_DIGEST = "manifest-input-v1: sha256 of each document's sort_keys JSON (prepare._dumps), bytes"


def _builtin_digest(docs: Iterable[dict]) -> dict:
    """The manifest's input entry of a built-in source: over each document as sorted-keys JSON.
    Change `_BUILTIN_DIGEST` with it (a saved digest is used only under that tag)."""
    h, size = hashlib.sha256(), 0
    for doc in docs:
        data = _dumps(doc, sort_keys=True).encode("utf-8")
        h.update(data)
        size += len(data)
    return {"bytes": size, "sha256": h.hexdigest()}


def _input_entries(sources: list, builtin: dict) -> list[dict]:
    entries = []
    for s in sources:
        if s.kind == "builtin":
            entries.append({"source": s.location, "kind": "builtin", **builtin[s.location]})
        else:
            entries.append({"path": s.location, "kind": s.kind, "bytes": file_size(s.location),
                            "sha256": file_sha256(s.location)})
    return entries


def _report(stats: dict) -> str:
    lines = ["# data prepare report", "", "| step | in | out | dropped |", "| --- | ---: | ---: | --- |"]
    for name, s in stats["steps"].items():
        dropped = ", ".join(f"{k} {v}" for k, v in s["dropped"].items()) or "-"
        lines.append(f"| {name} | {s['in']} | {s['out']} | {dropped} |")
    t = stats["totals"]
    st = stats["steps"]
    lines += ["", f"- documents read {t['read']}, kept {t['kept']} "
                  f"({', '.join(f'{k} {v}' for k, v in st['split']['sizes'].items())}), rejected "
                  f"{t['rejected']}, quarantined {t['quarantined']}, parts added by splitting {t['parts_added']}",
              f"- exact duplicate rate {st['exact_dedup']['duplicate_rate']:.4f}, near-duplicate rate "
              f"{st['near_dedup']['duplicate_rate']:.4f}",
              f"- PII masked: {st['pii']['counts'] or 'none'}",
              f"- contamination: {st['contamination']['hits']} train documents dropped",
              f"- {stats['bytes_read'] / 1e6:.2f} MB in {stats['seconds']:.2f} s = {stats['mb_per_s']:.2f} MB/s "
              f"with {stats['workers']} worker(s)", ""]
    return "\n".join(lines)


def _pool_workers(workers: int, sources: list) -> int:
    """How many worker processes to start: at most `workers`, and one per MIN_BYTES_PER_WORKER of
    input (a built-in source counts as small). A worker costs ~0.3 s of CPU to start (it re-imports
    numpy and this package), what this pipeline spends on ~1.5 MB; below the threshold the
    documents are processed in this process (1 means no pool), which is cheaper in CPU and, on a
    busy machine, in wall time too. The outputs do not depend on it."""
    size = sum(file_size(s.location) for s in sources if s.kind != "builtin")
    return max(1, min(workers, size // MIN_BYTES_PER_WORKER))


def _make_pool(workers: int, cfg: PrepareConfig) -> Any:
    """One spawn pool for both passes (each start re-imports this module: ~0.3 s of CPU), or None."""
    if workers <= 1:
        return None
    return mp.get_context("spawn").Pool(workers, _init_worker, (cfg,))


def _load_prepare_config(config: str | os.PathLike | PrepareConfig | None,
                         overrides: Iterable[str]) -> PrepareConfig:
    if isinstance(config, PrepareConfig):
        cfg = config
        if overrides:
            raise ValueError("pass overrides with a config path, not with a PrepareConfig object")
    else:
        cfg = load_config(PrepareConfig, config, list(overrides))
    return cfg.validate()


def _checked_eval_sets(eval_sets: Iterable[str]) -> list[str]:
    eval_sets = [os.fspath(e) for e in eval_sets]
    for path in eval_sets:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--eval-set {path}: no such file")
    return eval_sets


def _open_run(out: Path, cfg: PrepareConfig, overwrite: bool) -> RunDir:
    run = RunDir(out, overwrite=overwrite)
    # A previous run's manifest must not outlive its splits: until this run writes its own, the
    # folder has none, so `data pack` refuses it (instead of stamping new partial splits with an
    # old data_hash after a killed --overwrite).
    for stale in ("manifest.json", "stats.json", "report.md"):
        (out / stale).unlink(missing_ok=True)
    run.write_config(cfg)
    for stale in ("splits", ".work"):
        shutil.rmtree(out / stale, ignore_errors=True)
    return run


class _PassProgress:
    """One `track.progress.Progress` per pass, each started when its pass starts (so its rate and ETA
    are its own); pass 2's total is the documents pass 1 kept."""

    NAMES = {"read": "prepare: read + normalize", "clean": "prepare: clean + dedup"}

    def __init__(self) -> None:
        self.bars: dict[str, Progress] = {}

    def tick(self, name: str, n: int, total: int | None = None) -> None:
        if name not in self.bars:
            for bar in self.bars.values():
                bar.close()
            self.bars[name] = Progress(self.NAMES[name], total=total, unit="docs")
        self.bars[name].advance(n)

    def start(self, name: str, total: int | None) -> None:
        self.tick(name, 0, total)

    def stop(self) -> None:
        for bar in self.bars.values():
            bar.close()


def _run_passes(cfg: PrepareConfig, out: Path, sources: list, eval_sets: list[str], workers: int,
                show_progress: bool) -> tuple[_Pipeline, dict[str, dict], list[str]]:
    """The three passes; returns the pipeline (its counts), built-in sources' digests and warnings."""
    progress = _PassProgress() if show_progress else None
    pool = _make_pool(workers, cfg)
    try:
        pipe = _Pipeline(cfg, out, pool, progress)
        builtin: dict[str, dict] = {}
        warnings: list[str] = []
        records = _hashing_records(sources, cfg, pipe.quarantine.write, builtin, warnings)
        counts = pipe.pass1(records)
        n_docs = pipe.stats.steps["normalize"]["out"]
        bp_keys = boilerplate_keys(counts, n_docs, cfg.boilerplate) if cfg.boilerplate.enabled else frozenset()
        del counts
        if progress is not None:
            progress.start("clean", n_docs)
        pipe.pass2(bp_keys)
        pipe.pass3(eval_sets)
    finally:
        if pool is not None:
            pool.terminate()
        if progress is not None:
            progress.stop()
    pipe.rejected.close()
    pipe.quarantine.close()
    shutil.rmtree(out / ".work", ignore_errors=True)
    return pipe, builtin, warnings


def _write_stats(out: Path, pipe: _Pipeline, warnings: list[str], seconds: float, workers: int,
                 requested: int) -> dict[str, Any]:
    """stats.json, then the check that the counts reconcile (the stats stay on disk to debug it)."""
    steps = pipe.stats.as_dict()
    kept = steps["contamination"]["out"] + steps["split"]["sizes"]["val"] + steps["split"]["sizes"]["test"]
    totals = {"read": steps["read"]["in"], "kept": kept, "rejected": pipe.rejected.count,
              "quarantined": pipe.quarantine.count, "parts_added": pipe.parts_added}
    if kept == 0:
        warnings.append("no document survived prepare: every split is empty; see rejected.jsonl and stats.json")
        log.warning(warnings[-1])
    stats = {"steps": steps, "totals": totals, "bytes_read": pipe.bytes_read, "seconds": round(seconds, 3),
             "mb_per_s": round(pipe.bytes_read / 1e6 / max(seconds, 1e-9), 3), "workers": workers,
             "workers_requested": requested, "warnings": warnings}
    atomic_write_json(out / "stats.json", stats)
    if totals["read"] + totals["parts_added"] != kept + totals["rejected"] + totals["quarantined"]:
        raise RuntimeError(f"counts do not reconcile: read {totals['read']} + parts {totals['parts_added']} != "
                           f"kept {kept} + rejected {totals['rejected']} + quarantined {totals['quarantined']}; "
                           f"see {out / 'stats.json'} (a bug: please report it)")
    return stats


def _write_manifest(out: Path, cfg: PrepareConfig, sources: list, builtin: dict, eval_sets: list[str],
                    stats: dict[str, Any]) -> dict[str, Any]:
    """manifest.json: inputs, config, each output's sha256 and the data_hash over the splits."""
    outputs = {name: sha256_file(out / name) for name in
               [f"splits/{s}.jsonl" for s in SPLITS] + ["rejected.jsonl", "quarantine.jsonl"]}
    data_hash = hashlib.sha256("".join(f"{s}\0{outputs[f'splits/{s}.jsonl']}\n" for s in SPLITS).encode()).hexdigest()
    manifest = {"format": "lmforge-prepared-v1", "inputs": _input_entries(sources, builtin),
                "eval_sets": [{"path": p, "sha256": sha256_file(p)} for p in eval_sets],
                "config": to_dict(cfg), "outputs": outputs, "counts": stats["totals"],
                "splits": stats["steps"]["split"]["sizes"], "data_hash": data_hash}
    atomic_write_json(out / "manifest.json", manifest)
    return manifest


def prepare_dataset(inputs: list[str] | tuple[str, ...] | str, out_dir: str | os.PathLike,
                    config: str | os.PathLike | PrepareConfig | None = None, eval_sets: Iterable[str] = (),
                    overrides: Iterable[str] = (), workers: int | None = None, *, overwrite: bool = False,
                    show_progress: bool = False, executor: Any = None) -> dict[str, Any]:
    """Run the whole prepare pipeline into `out_dir`; returns the stats (also in stats.json).

    Every input and eval set is checked before any work (FileNotFoundError / ReaderError naming
    it); config errors raise ConfigError naming the key. `executor`: None runs here (a process
    pool of `workers`); a `lmforge.data.executor.RayExecutor` runs the passes on its Ray cluster,
    writing the same bytes.
    """
    t0 = time.monotonic()
    inputs = [inputs] if isinstance(inputs, (str, os.PathLike)) else [os.fspath(i) for i in inputs]
    cfg = _load_prepare_config(config, overrides)
    sources = resolve_inputs(inputs)
    eval_sets = _checked_eval_sets(eval_sets)
    requested = max(1, workers or os.cpu_count() or 1)
    workers = _pool_workers(requested, sources) if executor is None else executor.workers
    out = Path(out_dir)
    run = _open_run(out, cfg, overwrite)
    if executor is None:
        pipe, builtin, warnings = _run_passes(cfg, out, sources, eval_sets, workers, show_progress)
    else:
        pipe, builtin, warnings = executor.run_passes(cfg, out, sources, eval_sets)
        shutil.rmtree(out / ".work", ignore_errors=True)
    stats = _write_stats(out, pipe, warnings, time.monotonic() - t0, workers, requested)
    manifest = _write_manifest(out, cfg, sources, builtin, eval_sets, stats)
    atomic_write_text(out / "report.md", _report(stats))
    outputs = manifest["outputs"]
    run.write_record({"inputs": {"files": manifest["inputs"], "eval_sets": manifest["eval_sets"]},
                      "outputs": {**outputs, "data_hash": manifest["data_hash"]}})
    run.finish(**stats["totals"], data_hash=manifest["data_hash"], seconds=stats["seconds"],
               mb_per_s=stats["mb_per_s"], workers=workers)
    return stats
