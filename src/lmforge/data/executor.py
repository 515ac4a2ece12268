"""`--executor ray`: `data prepare` and `data pack` on a Ray cluster, byte-identical to the local run.

The local executor keeps every global decision (which id repeats, which lines are boilerplate,
which document is an exact or near duplicate, which train document shares a 13-gram with
val/test) in one process, in input order. Here each of those decisions is made by hash bucket,
in parallel, and handed back to the same `_Pipeline` code the local run uses, so the bytes
written are the same for any number of workers or buckets. The stages, each one Ray task per
input shard (a file or built-in source) or per hash bucket; the driver passes object references
and a few counts and writes the pieces:

    read   (shard)   read, quarantine, normalize; ids and boilerplate line counts by bucket
    ids    (bucket)  which documents repeat an earlier id            -> renames, per shard
    lines  (bucket)  line document-counts summed                      -> boilerplate lines
    clean  (shard)   renames, empty documents, boilerplate, quality, PII, sha256, MinHash;
                     text hashes and LSH band keys by bucket
    exact  (bucket)  the first document of each text hash survives    -> exact duplicates
    bands  (bucket)  pairs sharing a band key, confirmed by signature -> similarity edges
    near   (one)     survivors in input order over those edges only   -> near duplicates
    split  (shard)   dedup and split as decided; val/test and train 13-grams by bucket
    grams  (bucket)  train 13-grams against the val/test/eval ones    -> hits per train doc
    train  (shard)   contamination as decided
    write  (driver)  the pieces in shard order into OUT/.work/ray, renamed into place at the end

`near` is one task over the similarity edges only (the documents that have a candidate), as
datatrove's MinHash cluster stage is one task: the survivor rule ("the first of a cluster, each
later one compared with the survivors before it") is sequential, but over a sparse graph.
Every task is a pure function of its inputs, so Ray retries one whose worker died
(`MAX_RETRIES`) and the result is the same. A killed driver leaves `record.json` at `running`
and no split in `OUT/splits`, which `data pack` refuses.

Inputs and the output folder must be visible to every node (one machine, or a shared
filesystem). Ray stays optional: it is imported only here, when an executor is built.

    from lmforge.data.executor import RayExecutor
    prepare_dataset(["corpus/"], "runs/data", executor=RayExecutor(address="auto"))
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import signal
import time
import zlib
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.data.boilerplate import boilerplate_keys
from lmforge.data.config import PrepareConfig
from lmforge.data.contamination import eval_strings, ngram_hashes_many
from lmforge.data.dedup import NearDedup
from lmforge.data.prepare import (_chunks, _hashing_records, _init_worker, _ListSink, _pass1, _pass2, _Pipeline,
                                  _Writer, no_documents)
from lmforge.data.readers import Source, byte_ranges, count_lines, iter_records
from lmforge.data.split import SPLITS
from lmforge.tools.cluster import connect_ray

SHARD_BYTES = 32 << 20  # an uncompressed .jsonl file is read as ranges of about this size, one task each
MAX_RETRIES = 3  # a task whose worker process dies is run again (tasks are pure: same result)
FAULT_ENV = "LMFORGE_RAY_FAULT"  # tests: a file naming a stage whose process kills itself once
RAY_MISSING = "--executor ray needs Ray, which is not installed: pip install 'lmforge[ray]'"


def _fault(stage: str) -> None:
    """Fault injection for the tests: when $LMFORGE_RAY_FAULT names a file holding `stage`, the
    first process to claim it (an atomic rename) kills itself with SIGKILL, as a lost node would."""
    path = os.environ.get(FAULT_ENV)
    if not path or not os.path.isfile(path):
        return
    try:
        with open(path) as f:
            if f.read().strip() != stage:
                return
        os.rename(path, path + ".fired")
    except OSError:  # another process claimed it first
        return
    os.kill(os.getpid(), signal.SIGKILL)


def _ret(values: list[Any]) -> Any:
    """A task's values as Ray wants them back: one value alone, several as a tuple."""
    return values[0] if len(values) == 1 else tuple(values)


def _bucket_of(key: bytes, nb: int) -> int:
    return int.from_bytes(key[:8], "little") % nb


# ---- tasks: pure functions of their arguments ---------------------------------------------------

def _summary(pipe: _Pipeline) -> dict[str, Any]:
    """What a shard's pipeline counted, to be summed by the driver (`_absorb`)."""
    return {"steps": pipe.stats.steps, "bytes_read": pipe.bytes_read, "parts_added": pipe.parts_added,
            "lines_removed": pipe.lines_removed, "pii_counts": pipe.pii_counts, "docs_with_pii": pipe.docs_with_pii,
            "rejected": pipe.rejected.count, "quarantined": pipe.quarantine.count}


def read_task(cfg: PrepareConfig, source: Source, nb: int) -> tuple:
    """Read one shard and run pass 1's worker side; its ids and line keys by bucket."""
    _fault("read")
    _init_worker(cfg)
    pipe = _Pipeline(cfg, None)
    builtin: dict[str, dict] = {}
    if source.kind == "builtin":
        records = _hashing_records([source], cfg, pipe.quarantine.write, builtin, [])
    else:  # a file or a byte range of one (its warnings come from the driver, per file)
        records = iter_records([source], cfg.read.text_field, cfg.read.txt_mode, quarantine=pipe.quarantine.write)
    results = [r for chunk in _chunks(records) for r in _pass1(chunk)]
    ids: list[list] = [[] for _ in range(nb)]
    lines: list[Counter] = [Counter() for _ in range(nb)]
    for i, (doc, _, keys) in enumerate(results):
        key = hashlib.blake2b(doc["id"].encode("utf-8"), digest_size=12).digest()
        ids[_bucket_of(key, nb)].append((i, key))
        for k in keys if doc["text"] else ():
            lines[k % nb][k] += 1
    meta = {"docs": len(results), "nonempty": sum(1 for doc, _, _ in results if doc["text"]),
            "quarantine": pipe.quarantine.text(), "quarantined": pipe.quarantine.count,
            "builtin": builtin}
    return _ret([meta, results, *ids, *lines])


def ids_task(*per_shard: list) -> Any:
    """Per shard, the local indices of documents whose id an earlier document had (in input order)."""
    seen: set[bytes] = set()
    out = []
    for entries in per_shard:
        renamed = []
        for i, key in entries:
            if key in seen:
                renamed.append(i)
            seen.add(key)
        out.append(renamed)
    return _ret(out)


def lines_task(cfg: PrepareConfig, n_docs: int, *counters: Counter) -> tuple[frozenset[int], int]:
    counts: Counter = Counter()
    for c in counters:
        counts.update(c)
    keys = boilerplate_keys(counts, n_docs, cfg.boilerplate)
    return keys, len(keys)


def clean_task(cfg: PrepareConfig, index_base: int, nb: int, results: list, *parts: Any) -> tuple:
    """Pass 1's main side (renames, empty documents) and pass 2's worker side for one shard; the
    text hashes and band keys of the parts that reach dedup, by bucket (`q`: their order here).
    `parts`: the `nb` ids tasks' renames of this shard, then the lines tasks' boilerplate keys."""
    _fault("clean")
    _init_worker(cfg)
    renamed = {i for part in parts[:nb] for i in part}
    bp_keys = frozenset().union(*parts[nb:])
    pipe = _Pipeline(cfg, None)
    pipe.index_base = index_base
    normalized = _ListSink()
    pipe.take_normalized(results, lambda i, doc: i in renamed, normalized, None)
    items = [item for chunk in _chunks(normalized.docs) for item in _pass2((bp_keys, chunk))]
    exact, bands = dedup_keys([p for item in items for p in item["parts"] if not p["reason"]], cfg, nb)
    return _ret([{"rejected": pipe.rejected.text(), "summary": _summary(pipe)}, items, *exact, *bands])


def dedup_keys(parts: list[dict], cfg: PrepareConfig, nb: int) -> tuple[list[list], list[list]]:
    """By bucket, each part's (q, text hash, id) and (q, id, signature, its band keys in that bucket);
    `q` is the part's position among `parts`, the shard's parts that reach dedup, in order."""
    exact: list[list] = [[] for _ in range(nb)]
    bands: list[list] = [[] for _ in range(nb)]
    lsh = NearDedup(cfg.near_dedup) if cfg.near_dedup.enabled else None
    for q, part in enumerate(parts):
        if cfg.exact_dedup:
            exact[_bucket_of(part["exact"], nb)].append((q, part["exact"], part["doc"]["id"]))
        if lsh is not None:
            by_bucket = defaultdict(list)
            for i, band in enumerate(lsh.band_keys(part["sig"])):
                by_bucket[zlib.crc32(band, i) % nb].append((i, band))  # the band's index is part of its key
            for b, keys in by_bucket.items():
                bands[b].append((q, part["doc"]["id"], part["sig"], keys))
    return exact, bands


def exact_task(n_shards: int, *per_shard: list) -> Any:
    """The first document (in input order) of each text hash survives. Per shard: {q: first id};
    and each duplicate as (its position, its survivor's position, its survivor's id), positions
    being (shard, q)."""
    first: dict[bytes, tuple[tuple[int, int], str]] = {}
    dups: list[dict[int, str]] = [{} for _ in range(n_shards)]
    targets = []
    for s, entries in enumerate(per_shard):
        for q, key, doc_id in entries:
            where, first_id = first.setdefault(key, ((s, q), doc_id))
            if first_id != doc_id:
                dups[s][q] = first_id
                targets.append(((s, q), where, first_id))
    return _ret([*dups, targets])


def bands_task(confirm: float, n_exact: int, *parts: list) -> list[tuple]:
    """Pairs of documents sharing a band key whose signatures agree on >= `confirm` of their
    positions, as (later, earlier, earlier's id, similarity) with (shard, q) positions. `parts`:
    the exact tasks' duplicate lists (those never enter the LSH index), then each shard's entries."""
    exact_dups = {dup for p in parts[:n_exact] for dup, _, _ in p}
    groups: dict[tuple[int, bytes], list] = defaultdict(list)
    sigs: dict[tuple[int, int], tuple[str, np.ndarray]] = {}
    for s, entries in enumerate(parts[n_exact:]):
        for q, doc_id, sig, keys in entries:
            if (s, q) in exact_dups:
                continue
            sigs[(s, q)] = (doc_id, sig)
            for key in keys:
                groups[key].append((s, q))
    pairs = {(a, b) for members in groups.values() if len(members) > 1
             for k, b in enumerate(members) for a in members[k + 1:]}  # members are in input order: a after b
    edges = []
    for a, b in sorted(pairs):
        sim = float(np.mean(sigs[b][1] == sigs[a][1]))  # as NearDedup.add computes it
        if sim >= confirm:
            edges.append((a, b, sigs[b][0], sim))
    return edges


def near_task(n_shards: int, n_exact: int, *parts: list) -> Any:
    """Near duplicates as the local executor finds them: in input order, each document that has an
    edge to an earlier survivor is a duplicate of the most similar one (ties: the smallest id).
    `parts`: the exact tasks' target lists, then the bands tasks' edges. Per shard {q: (id, sim)},
    and the number of clusters with duplicates (the local `cluster_sizes` count)."""
    exact_targets = [t for p in parts[:n_exact] for t in p]
    edges: dict[tuple[int, int], dict[tuple[int, int], tuple[str, float]]] = defaultdict(dict)
    for p in parts[n_exact:]:
        for a, b, b_id, sim in p:  # exact duplicates have no edges (bands_task left them out)
            edges[a][b] = (b_id, sim)
    dups: dict[tuple[int, int], tuple[str, float]] = {}
    for a in sorted(edges):
        best, best_sim = None, 0.0
        for b_id, sim in sorted(v for b, v in edges[a].items() if b not in dups):  # candidates: survivors
            if sim > best_sim or best is None:
                best, best_sim = b_id, sim
        if best is not None:
            dups[a] = (best, best_sim)
    per_shard: list[dict[int, tuple[str, float]]] = [{} for _ in range(n_shards)]
    for (s, q), v in dups.items():
        per_shard[s][q] = v
    dups_to: Counter = Counter()
    survives: dict[str, bool] = {}
    for _, where, first_id in exact_targets:
        dups_to[first_id] += 1
        survives[first_id] = where not in dups
    for dup_id, _ in dups.values():
        dups_to[dup_id] += 1
        survives[dup_id] = True
    clusters = sum(1 for t, c in dups_to.items() if c + survives[t] > 1)
    return _ret([*per_shard, clusters])


class _Decided:
    """Dedup decisions made by bucket, for `_Pipeline.dedup`: read back by `q`, the order in which
    `clean_task` counted the parts that reach dedup (the order `_Pipeline` asks in)."""

    def __init__(self, exact: dict[int, str], near: dict[int, tuple[str, float]]):
        self.exact_dups, self.near_dups, self.q = exact, near, -1

    def exact(self, part: dict) -> str | None:
        self.q += 1
        return self.exact_dups.get(self.q)

    def near(self, part: dict) -> tuple[str | None, float]:
        return self.near_dups.get(self.q, (None, 0.0))


def _by_bucket(grams: np.ndarray, nb: int) -> list[np.ndarray]:
    b = grams % np.uint64(nb)
    return [grams[b == k] for k in range(nb)]


def split_task(cfg: PrepareConfig, nb: int, items: list, near: dict, *exact: dict) -> tuple:
    """Pass 2's main side for one shard with the bucket decisions; val/test lines, the train
    documents, and the 13-grams of both by bucket (val/test: distinct; train: (doc, gram) pairs)."""
    _fault("split")
    pipe = _Pipeline(cfg, None)
    pipe.dedup = _Decided({q: first for d in exact for q, first in d.items()}, near)
    writers = pipe.split_writers()
    pipe.take_cleaned(items, writers)
    lines = {}
    for split in ("val", "test"):
        w = _Writer(None)
        for doc in writers[split].docs:
            w.write(doc)
        lines[split] = w.text()
    vt: list[np.ndarray] = [np.zeros(0, np.uint64)] * nb
    tr: list[tuple] = [(np.zeros(0, np.int64), np.zeros(0, np.uint64))] * nb
    if cfg.contamination.enabled:
        n = cfg.contamination.ngram
        texts = [doc["text"] for s in ("val", "test") for doc in writers[s].docs]
        vt = _by_bucket(np.unique(np.concatenate([np.zeros(0, np.uint64), *ngram_hashes_many(texts, n)])), nb)
        per_doc = ngram_hashes_many([doc["text"] for doc in writers["train"].docs], n)
        doc_idx = np.repeat(np.arange(len(per_doc)), [len(g) for g in per_doc])
        grams = np.concatenate([np.zeros(0, np.uint64), *per_doc])
        b = grams % np.uint64(nb)
        tr = [(doc_idx[b == k], grams[b == k]) for k in range(nb)]
    meta = {"rejected": pipe.rejected.text(), "summary": _summary(pipe), **lines,
            "sizes": {s: w.count for s, w in writers.items()}}
    return _ret([meta, writers["train"].docs, *vt, *tr])


def eval_task(cfg: PrepareConfig, paths: list[str], nb: int) -> tuple:
    """The eval sets' distinct 13-grams by bucket; per set its string count, and the too-short ones."""
    info, too_short, grams = {}, 0, [np.zeros(0, np.uint64)]
    for path in paths:
        n = 0
        for texts in _chunks(eval_strings(path, cfg.contamination.eval_fields)):
            for g in ngram_hashes_many(texts, cfg.contamination.ngram):
                too_short += not len(g)
                grams.append(g)
            n += len(texts)
        info[path] = {"strings": n}
    return _ret([{"eval_sets": info, "too_short": too_short}, *_by_bucket(np.unique(np.concatenate(grams)), nb)])


def grams_task(n_shards: int, *parts: Any) -> Any:
    """One bucket of 13-grams: `parts` are each shard's val/test grams, the eval grams, then each
    shard's train (doc, gram) pairs. Per shard: hits per train document (with repeats, as
    `ContaminationIndex.hits_many` counts); and the bucket's distinct index size."""
    index = np.unique(np.concatenate(parts[:n_shards + 1]))
    hits = []
    for doc_idx, grams in parts[n_shards + 1:]:
        hits.append(doc_idx[np.isin(grams, index)])
    return _ret([*hits, len(index)])


def train_task(cfg: PrepareConfig, docs: list[dict], *hits: np.ndarray) -> dict[str, Any]:
    """Pass 3's main side for one shard: `hits` are the grams tasks' hit documents (none: disabled)."""
    _fault("train")
    pipe = _Pipeline(cfg, None)
    counts = np.bincount(np.concatenate([np.zeros(0, np.int64), *hits]), minlength=len(docs)).tolist()
    w = _Writer(None)
    pipe.take_train(docs, counts if hits else None, w)
    return {"rejected": pipe.rejected.text(), "train": w.text(), "summary": _summary(pipe)}


_initialized: Any = None


def pool_task(initializer: Callable, initargs: tuple, fn: Callable, arg: Any) -> Any:
    """`fn(arg)` in a process where `initializer(*initargs)` ran once (a `multiprocessing.Pool`'s contract)."""
    global _initialized
    _fault("pool")
    if _initialized != (initializer, initargs):
        initializer(*initargs)
        _initialized = (initializer, initargs)
    return fn(arg)


# ---- driver -----------------------------------------------------------------------------------

def _absorb(agg: _Pipeline, summary: dict[str, Any]) -> None:
    """Add one shard's counts to the driver's pipeline (whose close_pass* then derive the rest)."""
    for name, s in summary["steps"].items():
        a = agg.stats.steps[name]
        a["in"] += s["in"]
        a["out"] += s["out"]
        a["dropped"].update(s["dropped"])
        if "renamed_duplicate_ids" in s:
            a["renamed_duplicate_ids"] = a.get("renamed_duplicate_ids", 0) + s["renamed_duplicate_ids"]
    agg.bytes_read += summary["bytes_read"]
    agg.parts_added += summary["parts_added"]
    agg.lines_removed += summary["lines_removed"]
    agg.pii_counts.update(summary["pii_counts"])
    agg.docs_with_pii += summary["docs_with_pii"]
    agg.rejected.count += summary["rejected"]


class _RayPool:
    """`imap` over Ray tasks, results in task order, at most `window` in flight (a Pool's face)."""

    def __init__(self, ex: RayExecutor, initializer: Callable, initargs: tuple):
        self.ex, self.initializer, self.initargs = ex, initializer, initargs

    def imap(self, fn: Callable, tasks: Iterable[Any]) -> Iterator[Any]:
        pending: list[Any] = []
        for task in tasks:
            pending += self.ex.call(pool_task, 1, self.initializer, self.initargs, fn, task)
            if len(pending) > 2 * self.ex.workers:
                yield self.ex.ray.get(pending.pop(0))
        while pending:
            yield self.ex.ray.get(pending.pop(0))

    def close(self) -> None:
        pass

    join = terminate = close


def _write_pieces(path: Path, pieces: Iterable[str]) -> None:
    """One output file from its pieces, in order (fetched one at a time: the driver holds one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for piece in pieces:
            f.write(piece)
            _fault("write")


class RayExecutor:
    """Runs `prepare_dataset`'s passes and `pack_dataset`'s tokenization as Ray tasks.

    `address`: a running cluster (`ray start --head` prints it; "auto" finds the local one); None
    starts a local one, unless this process already joined a cluster (`ray.init`). `buckets`: hash
    buckets per global step (default: the cluster's CPUs); the outputs do not depend on it."""

    def __init__(self, address: str | None = None, buckets: int | None = None, shard_bytes: int = SHARD_BYTES):
        try:
            import ray  # deferred: optional dependency (pip install 'lmforge[ray]')
        except ImportError:
            raise ImportError(RAY_MISSING) from None
        self.ray = ray
        connect_ray(address)  # a HOST:PORT with nothing there: ClusterUnreachable naming it, within 30 s
        self.workers = max(1, int(ray.cluster_resources().get("CPU", 1)))
        self.buckets = max(1, buckets or self.workers)
        self.shard_bytes = shard_bytes
        self.seconds: dict[str, float] = {}  # the driver's own work of the last run ("write")
        self._remote: dict[Callable, Any] = {}

    def call(self, fn: Callable, n: int, *args: Any) -> list[Any]:
        """`fn(*args)` as a Ray task with `n` results: their object references."""
        if fn not in self._remote:
            self._remote[fn] = self.ray.remote(max_retries=MAX_RETRIES)(fn)
        refs = self._remote[fn].options(num_returns=n).remote(*args)
        return [refs] if n == 1 else list(refs)

    def pool(self, initializer: Callable, initargs: tuple) -> _RayPool:
        return _RayPool(self, initializer, initargs)

    def run_passes(self, cfg: PrepareConfig, out: Path, sources: list[Source],
                   eval_sets: list[str]) -> tuple[_Pipeline, dict[str, dict], list[str]]:
        """The three passes of `prepare._run_passes`, by shard and bucket; the same return."""
        get, nb = self.ray.get, self.buckets
        files, shards = self._shards(sources)
        S = len(shards)
        reads = [self.call(read_task, 2 + 2 * nb, cfg, src, nb) for src in shards]
        metas = get([r[0] for r in reads])
        warnings: list[str] = []
        for k, src in enumerate(sources):
            if not sum(m["docs"] for m, f in zip(metas, files) if f == k):
                no_documents(src.location, warnings)
        offsets = np.cumsum([0] + [m["docs"] for m in metas]).tolist()
        renames = [self.call(ids_task, S, *[r[2 + b] for r in reads]) for b in range(nb)]
        bp, distinct = [], 0
        if cfg.boilerplate.enabled:
            n_docs = sum(m["nonempty"] for m in metas)
            lines = [self.call(lines_task, 2, cfg, n_docs, *[r[2 + nb + b] for r in reads]) for b in range(nb)]
            bp, distinct = [x[0] for x in lines], sum(get([x[1] for x in lines]))
        cleans = [self.call(clean_task, 2 + 2 * nb, cfg, offsets[s], nb, reads[s][1],
                            *[renames[b][s] for b in range(nb)], *bp) for s in range(S)]
        del reads, renames
        exacts = ([self.call(exact_task, S + 1, S, *[c[2 + b] for c in cleans]) for b in range(nb)]
                  if cfg.exact_dedup else [])
        edges = ([self.call(bands_task, 1, NearDedup(cfg.near_dedup).confirm, len(exacts), *[e[S] for e in exacts],
                            *[c[2 + nb + b] for c in cleans])[0] for b in range(nb)]
                 if cfg.near_dedup.enabled else [])
        near = self.call(near_task, S + 1, S, len(exacts), *[e[S] for e in exacts], *edges)
        splits = [self.call(split_task, 2 + 2 * nb, cfg, nb, cleans[s][1], near[s], *[e[s] for e in exacts])
                  for s in range(S)]
        contamination = {"eval_sets": {}, "too_short": 0}
        trains, index_ngrams = self._contamination(cfg, splits, eval_sets, contamination)
        agg = self._write(cfg, out, metas, cleans, splits, trains)
        agg.close_pass1()
        agg.close_pass2(distinct, {s: sum(m["sizes"][s] for m in get([sp[0] for sp in splits])) for s in SPLITS},
                        get(near[S]))
        agg.close_pass3(contamination["eval_sets"], contamination["too_short"], index_ngrams)
        builtin = {k: v for m in metas for k, v in m["builtin"].items()}
        return agg, builtin, warnings

    def _shards(self, sources: list[Source]) -> tuple[list[int], list[Source]]:
        """Each source, or its byte ranges with their first line numbers; and the source of each."""
        files, shards = [], []
        for k, src in enumerate(sources):
            ranges = byte_ranges(src, self.shard_bytes)
            lines = self.ray.get([self.call(count_lines, 1, r)[0] for r in ranges[:-1]]) if len(ranges) > 1 else []
            first = np.cumsum([1] + lines).tolist()
            shards += [dataclasses.replace(r, first_line=n) for r, n in zip(ranges, first)]
            files += [k] * len(ranges)
        return files, shards

    def _contamination(self, cfg: PrepareConfig, splits: list, eval_sets: list[str],
                       info: dict) -> tuple[list[Any], int]:
        """Train tasks (their results' references) and the index size; fills `info` for the stats."""
        S, nb = len(splits), self.buckets
        if not cfg.contamination.enabled:
            return [self.call(train_task, 1, cfg, sp[1])[0] for sp in splits], 0
        ev = self.call(eval_task, 1 + nb, cfg, eval_sets, nb)
        grams = [self.call(grams_task, S + 1, S, *[sp[2 + b] for sp in splits], ev[1 + b],
                           *[sp[2 + nb + b] for sp in splits]) for b in range(nb)]
        trains = [self.call(train_task, 1, cfg, splits[s][1], *[g[s] for g in grams])[0] for s in range(S)]
        info.update(self.ray.get(ev[0]))
        return trains, sum(self.ray.get([g[S] for g in grams]))

    def _write(self, cfg: PrepareConfig, out: Path, metas: list[dict], cleans: list, splits: list,
               trains: list) -> _Pipeline:
        """Every output from its pieces into OUT/.work/ray, then renamed into place; the summed counts."""
        get, t0 = self.ray.get, time.monotonic()
        work = out / ".work" / "ray"
        names = {"quarantine.jsonl": [m["quarantine"] for m in metas],
                 "rejected.jsonl": _chain(get, [c[0] for c in cleans], [sp[0] for sp in splits], trains),
                 "splits/val.jsonl": (get(sp[0])["val"] for sp in splits),
                 "splits/test.jsonl": (get(sp[0])["test"] for sp in splits),
                 "splits/train.jsonl": (get(t)["train"] for t in trains)}
        for name, pieces in names.items():
            _write_pieces(work / name, pieces)
        agg = _Pipeline(cfg, None)
        for ref in [c[0] for c in cleans] + [sp[0] for sp in splits] + trains:
            _absorb(agg, get(ref)["summary"])
        agg.quarantine.count = sum(m["quarantined"] for m in metas)
        for name in names:
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(work / name, out / name)
        self.seconds["write"] = time.monotonic() - t0  # includes waiting for the last tasks
        return agg


def _chain(get: Callable, *groups: list) -> Iterator[str]:
    """The rejected lines of every shard's pass 1, then pass 2, then pass 3: the local order."""
    for refs in groups:
        for ref in refs:
            yield get(ref)["rejected"]
