"""Benchmark `data prepare`: MB/s per step on one core, and end to end with 1 and N workers.

Per step, each rule runs in this process over every document of the inputs (CPU time by
`time.process_time`, best of `repeats`, so other jobs on a shared machine disturb it less than
wall time). MB/s is always input megabytes (UTF-8 text as read) per second, so the steps are
comparable and their times add up; a step that sees fewer documents in the pipeline (quality
rejects some) is measured on all of them here, an upper bound of its share.
End to end, `prepare_dataset` runs on the built-in source and on a JSONL copy of the same
documents (to separate the cost of reading the source), with each worker count: wall MB/s, and
MB/s per core = MB / CPU seconds of this process and its workers, after one untimed warm-up
run that absorbs the one-off imports of a fresh process (reported as `first_run`). `--workers`
is an upper bound: prepare starts a pool only for inputs of 16 MB per worker or more, so the
table shows the workers asked for and (in brackets) those used. Outputs must be byte-identical
across worker counts; the result records whether they were.

It knows nothing about the CLI; `lmforge bench data` calls `run_bench` and prints the table. A progress
line (`lmforge.track.progress`) names the part being measured. `LMFORGE_SHORT=1` (CI) measures the first
`SHORT_DOCS` documents, once each, end to end on their JSONL copy only: the same code, not figures to quote.

    python -m lmforge.bench.data --out runs/bench-data              # python-docs, workers 1 and 2
    python -m lmforge.bench.data --inputs data/*.jsonl --workers 1 4 --repeats 5
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pickle
import platform
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from lmforge.track.short import short_mode, shrink
from lmforge.data.boilerplate import line_keys, strip_boilerplate
from lmforge.data.config import PrepareConfig
from lmforge.data.contamination import ContaminationIndex
from lmforge.data.dedup import NearDedup, exact_key, signatures
from lmforge.data.normalize import normalize_text
from lmforge.data.pii import mask_pii_many
from lmforge.data.prepare import CHUNK_DOCS, _dumps, _hashing_records, prepare_dataset
from lmforge.data.quality import quality_reasons
from lmforge.data.readers import resolve_inputs
from lmforge.data.split import assign_split
from lmforge.track.progress import Progress


def _cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (pool workers)."""
    child = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + child.ru_utime + child.ru_stime


def _best(fn: Callable[[], Any], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


def _machine() -> dict[str, Any]:
    cpu = platform.processor() or None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    versions = {"python": platform.python_version()}
    for name in ("lmforge", "numpy", "datasketch"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "load_average_1m_before": round(os.getloadavg()[0], 2), "versions": versions}


SHORT_DOCS = 60


def step_times(docs: list[dict], cfg: PrepareConfig, repeats: int = 3, progress: Progress | None = None
               ) -> dict[str, float]:
    """CPU seconds (best of `repeats`) of each prepare step over every document, in one process,
    called as the pipeline calls it (the batched steps on chunks of CHUNK_DOCS documents)."""
    texts = [normalize_text(d["text"]) for d in docs]
    chunks = [texts[i:i + CHUNK_DOCS] for i in range(0, len(texts), CHUNK_DOCS)]
    sigs = [sig for chunk in chunks for sig in signatures(chunk, cfg.near_dedup)]
    held_out = texts[::50]  # ~2% as val/test, as the default split would give

    def near_dedup() -> None:
        near = NearDedup(cfg.near_dedup)
        for k, sig in enumerate(sigs):
            near.add(str(k), sig)

    def contamination() -> None:
        index = ContaminationIndex(cfg.contamination.ngram)
        index.add_many(held_out)
        for chunk in chunks:
            index.hits_many(chunk)

    def output_and_work_files() -> None:  # every document once as a JSON line, twice through .work
        [_dumps(d) for d in docs]
        for _ in range(2):
            pickle.loads(pickle.dumps(docs, protocol=pickle.HIGHEST_PROTOCOL))

    min_line = cfg.boilerplate.min_line_chars
    steps: dict[str, Callable[[], Any]] = {
        "normalize": lambda: [normalize_text(d["text"]) for d in docs],
        "boilerplate": lambda: [strip_boilerplate(t, frozenset(line_keys(t, min_line)[:1]), min_line) for t in texts],
        "quality": lambda: [quality_reasons(chunk, cfg.quality) for chunk in chunks],
        "pii": lambda: [mask_pii_many(chunk, cfg.pii) for chunk in chunks],
        "exact_dedup": lambda: [exact_key(t) for t in texts],
        "near_dedup (minhash)": lambda: [signatures(chunk, cfg.near_dedup) for chunk in chunks],
        "near_dedup (lsh)": near_dedup,
        "split": lambda: [assign_split(d["id"], cfg.split) for d in docs],
        "contamination": contamination,
        "output JSON + .work pickle": output_and_work_files,
    }
    times = {}
    for name, fn in steps.items():
        times[name] = _best(fn, repeats)
        if progress is not None:
            progress.update(progress.done + 1, postfix=name)
    return times


def _command() -> str:
    """How this run was started: `lmforge bench data ...` or `python -m lmforge.bench.data ...`."""
    head = "lmforge" if Path(sys.argv[0]).name == "lmforge" else "python -m lmforge.bench.data"
    return " ".join([head, *sys.argv[1:]])


def _records(sources: list, cfg: PrepareConfig) -> list[dict]:
    """The documents as prepare reads them (the first SHORT_DOCS in short mode)."""
    return list(itertools.islice(_hashing_records(sources, cfg, lambda bad: None, {}, []),
                                 SHORT_DOCS if short_mode() else None))


def end_to_end(inputs: Sequence[str], workers: int, out: Path) -> dict[str, Any]:
    """One `prepare_dataset` run: wall and CPU seconds (this process + workers) and the data hash."""
    shutil.rmtree(out, ignore_errors=True)
    cpu0, wall0 = _cpu_seconds(), time.monotonic()
    stats = prepare_dataset(list(inputs), out, workers=workers)
    wall, cpu = time.monotonic() - wall0, _cpu_seconds() - cpu0
    manifest = json.loads((out / "manifest.json").read_text())
    return {"workers": workers, "workers_used": stats["workers"], "bytes": stats["bytes_read"],
            "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
            "mb_per_s": round(stats["bytes_read"] / 1e6 / wall, 3),
            "mb_per_s_per_core": round(stats["bytes_read"] / 1e6 / cpu, 3), "data_hash": manifest["data_hash"]}


def run_bench(inputs: Sequence[str] = ("python-docs",), workers: Sequence[int] = (1, 2), repeats: int = 3,
              out_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """Measure, write `bench_data.json` and `bench_data.md` into `out_dir` (when given), return the result."""
    machine, repeats = _machine(), shrink(repeats, 1)
    cfg = PrepareConfig()
    sources = resolve_inputs(list(inputs))
    labels = ("jsonl copy",) if short_mode() else ("inputs", "jsonl copy")
    with Progress("bench data", total=12 + len(labels) * len(workers), unit="parts", heartbeat=True) as bar:
        # as prepare reads: python-docs from its cache's snapshot (see sources.py), with the manifest digest
        docs = _records(sources, cfg)
        read_s = _best(lambda: _records(sources, cfg), repeats)
        bar.update(1, postfix="read")
        mb = sum(len(d["text"].encode("utf-8")) for d in docs) / 1e6
        steps = {"read": read_s, **step_times(docs, cfg, repeats, bar)}
        result = _measure(inputs, workers, docs, mb, steps, labels, bar)
    result["machine"] = {**machine, "load_average_1m_after": round(os.getloadavg()[0], 2)}
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_data.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        (out / "bench_data.md").write_text(to_markdown(result), encoding="utf-8")
    return result


def _measure(inputs: Sequence[str], workers: Sequence[int], docs: list[dict], mb: float, steps: dict[str, float],
             labels: Sequence[str], bar: Progress) -> dict[str, Any]:
    """The result: the per-step table, then `prepare_dataset` end to end on each label's inputs."""
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "command": _command(),
        "short_mode": short_mode(), "inputs": list(inputs), "documents": len(docs), "mb": round(mb, 3),
        "steps": {name: {"cpu_s": round(s, 4), "mb_per_s": round(mb / max(s, 1e-9), 2)} for name, s in steps.items()},
        "steps_total": {"cpu_s": round(sum(steps.values()), 3), "mb_per_s": round(mb / sum(steps.values()), 2)},
    }
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = Path(tmp) / "docs.jsonl"
        with open(jsonl, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(d, ensure_ascii=False) + "\n" for d in docs)
        # The first run in a process pays one-off imports (record.json's provenance imports torch);
        # it is reported apart so the runs below measure the pipeline, not the start-up.
        first = end_to_end([str(jsonl)], 1, Path(tmp) / "warm-up")
        bar.update(bar.done + 1, postfix="end to end: warm-up")
        runs = []
        for label in labels:
            for w in workers:
                run_inputs = list(inputs) if label == "inputs" else [str(jsonl)]
                runs.append({"inputs": label, **end_to_end(run_inputs, w, Path(tmp) / f"out-{len(runs)}")})
                bar.update(bar.done + 1, postfix=f"end to end: {label}, {w} worker(s)")
    result["first_run"] = {"wall_s": first["wall_s"], "cpu_s": first["cpu_s"]}
    result["end_to_end"] = runs
    result["identical_across_workers"] = all(
        len({r["data_hash"] for r in runs if r["inputs"] == label}) == 1 for label in labels)
    return result


def to_markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [f"# data prepare benchmark ({result['date']})", "",
             f"`{result['command']}` on {', '.join(result['inputs'])}: {result['documents']} documents, "
             f"{result['mb']} MB; {m['cpu']} x {m['cpu_count']}, load average {m['load_average_1m_before']} "
             f"before / {m['load_average_1m_after']} after; " +
             ", ".join(f"{k} {v}" for k, v in m["versions"].items()), "",
             *(["**Short mode** (LMFORGE_SHORT): a slice measured once; not figures to quote.", ""]
               if result.get("short_mode") else []),
             "| step (1 core, all documents) | CPU s | MB/s |", "| --- | ---: | ---: |"]
    for name, s in result["steps"].items():
        lines.append(f"| {name} | {s['cpu_s']:.3f} | {s['mb_per_s']:.1f} |")
    t = result["steps_total"]
    lines += [f"| **sum** | {t['cpu_s']:.3f} | {t['mb_per_s']:.1f} |", "",
              "| end to end | workers (used) | wall s | MB/s | CPU s | MB/s per core |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["end_to_end"]:
        lines.append(f"| {r['inputs']} | {r['workers']} ({r['workers_used']}) | {r['wall_s']:.2f} | "
                     f"{r['mb_per_s']:.2f} | {r['cpu_s']:.2f} | {r['mb_per_s_per_core']:.2f} |")
    f = result["first_run"]
    lines += ["", f"First run in a fresh process (one-off imports, not in the table): {f['wall_s']:.2f} s wall, "
                  f"{f['cpu_s']:.2f} s CPU for the jsonl copy with 1 worker."]
    lines += ["", f"Outputs byte-identical across worker counts: {result['identical_across_workers']}", ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", nargs="+", default=["python-docs"], help="files, directories, globs or python-docs")
    parser.add_argument("--workers", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3, help="per-step repeats; the fastest counts")
    parser.add_argument("--out", default=None, help="folder for bench_data.json and bench_data.md")
    args = parser.parse_args(argv)
    result = run_bench(args.inputs, args.workers, args.repeats, args.out)
    print(to_markdown(result))


if __name__ == "__main__":
    main()
