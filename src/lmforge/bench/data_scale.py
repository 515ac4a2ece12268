"""The data half of `lmforge bench scale`: `data prepare` with the local executor and on a local Ray
cluster at 1 and N workers, the Ray overhead, and what 8 nodes would give on paper.

For each worker count: the local executor (`--workers N`: a pool starts only for 16 MB of input
per worker, so the table shows the workers used) and Ray (`ray.init(num_cpus=N)`, a fresh local
cluster per count; its start-up is timed apart from the run). MB/s is input megabytes per wall
second. The corpus is one JSONL file (the inputs' documents, `copies` times with distinct ids and
one word changed per copy so dedup keeps them), read by Ray as byte ranges of `size / (2 N)`.
Every Ray run must write the local run's bytes (`data_hash` and the sha256 of every output); the
report says whether it did.

On paper, 8 nodes: the Ray run's per-worker MB/s times the workers of 8 nodes, minus what does
not spread: the driver's writing of the outputs (measured, `RayExecutor.seconds["write"]`) stays
one process (Amdahl). The `near` task and the per-bucket tasks also grow with the corpus, not
with the nodes; they are inside the measured parallel time, so the estimate is an upper bound.

    python -m lmforge.bench.data_scale --out runs/bench-scale --workers 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmforge.bench.report import emit, provenance
from lmforge.data.config import PrepareConfig
from lmforge.data.executor import RayExecutor
from lmforge.data.prepare import _hashing_records, prepare_dataset
from lmforge.data.readers import resolve_inputs
from lmforge.track.io import sha256_file

OUTPUTS = ("splits/train.jsonl", "splits/val.jsonl", "splits/test.jsonl", "rejected.jsonl", "quarantine.jsonl",
           "manifest.json")


def write_corpus(inputs: Sequence[str], copies: int, path: Path) -> int:
    """The inputs' documents `copies` times into one JSONL file (copy k: ids `~ck`, its first word
    doubled, so copies are near duplicates, not exact ones); its size in bytes."""
    docs = list(_hashing_records(resolve_inputs(list(inputs)), PrepareConfig(), lambda bad: None, {}, []))
    with open(path, "w", encoding="utf-8") as f:
        for k in range(copies):
            for d in docs:
                text = d["text"] if k == 0 else f"{d['text'].split(' ', 1)[0]} {d['text']}"
                f.write(json.dumps({"id": f"{d['id']}~c{k}", "text": text}, ensure_ascii=False) + "\n")
    return path.stat().st_size


def _hashes(out: Path) -> dict[str, str]:
    return {name: sha256_file(out / name) for name in OUTPUTS}


def _run(corpus: Path, out: Path, workers: int, executor: RayExecutor | None) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.monotonic()
    stats = prepare_dataset([str(corpus)], out, workers=workers, executor=executor)
    wall = time.monotonic() - t0
    return {"workers": workers, "workers_used": stats["workers"], "wall_s": round(wall, 3),
            "mb_per_s": round(stats["bytes_read"] / 1e6 / wall, 3), "hashes": _hashes(out)}


def _ray_run(corpus: Path, out: Path, workers: int, size: int) -> dict[str, Any]:
    import ray  # deferred: optional dependency (pip install 'lmforge[ray]')

    t0 = time.monotonic()
    ray.init(num_cpus=workers, include_dashboard=False, logging_level="WARNING")
    try:
        ex = RayExecutor(shard_bytes=max(1 << 20, size // (2 * workers)))
        init_s = time.monotonic() - t0
        run = _run(corpus, out, workers, ex)
        run["write_s"] = round(ex.seconds.get("write", 0.0), 3)
    finally:
        ray.shutdown()
    return {**run, "ray_init_s": round(init_s, 3)}


def eight_nodes(ray_runs: list[dict], mb: float, cores_per_node: int) -> dict[str, Any]:
    """Amdahl on the widest Ray run: parallel time shrinks with 8 x cores_per_node workers, the
    driver's write does not."""
    r = max(ray_runs, key=lambda x: x["workers"])
    parallel_s = max(r["wall_s"] - r["write_s"], 1e-9)
    workers = 8 * cores_per_node
    wall = parallel_s * r["workers"] / workers + r["write_s"]
    return {"nodes": 8, "cores_per_node": cores_per_node, "from_workers": r["workers"],
            "mb_per_s_per_worker": round(mb / parallel_s / r["workers"], 3),
            "serial_write_s": r["write_s"], "mb_per_s": round(mb / wall, 2),
            "mb_per_s_no_serial": round(mb / parallel_s * workers / r["workers"], 2)}


def run_data_scale(inputs: Sequence[str] = ("python-docs",), workers: Sequence[int] = (1, 2), copies: int = 4,
                   cores_per_node: int = 64, out: Path | None = None) -> dict[str, Any]:
    """Measure; with `out`, write `bench_scale_data.json` and `.md` there; return the report."""
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        size = write_corpus(inputs, copies, corpus)
        _run(corpus, Path(tmp) / "warm-up", 1, None)  # one-off imports of a fresh process, not timed
        local = [_run(corpus, Path(tmp) / f"local-{w}", w, None) for w in workers]
        on_ray = [_ray_run(corpus, Path(tmp) / f"ray-{w}", w, size) for w in workers]
    identical = all(r["hashes"] == local[0]["hashes"] for r in local + on_ray)
    for r in local + on_ray:
        r["manifest_sha256"] = r.pop("hashes")["manifest.json"]  # the manifest holds every output's sha256
    report = {"inputs": list(inputs), "copies": copies, "mb": round(size / 1e6, 3), "local": local, "ray": on_ray,
              "identical": identical, "eight_nodes": eight_nodes(on_ray, size / 1e6, cores_per_node),
              "command": "python -m lmforge.bench.data_scale", **provenance("n/a")}
    emit(report, to_markdown, out, "bench_scale_data")
    return report


def to_markdown(r: dict[str, Any]) -> str:
    lines = [f"# data prepare: local vs Ray ({r['date']})", "",
             f"{r['mb']} MB ({', '.join(r['inputs'])} x {r['copies']}), {r['machine']}, load average "
             f"{r['load_average']}", "",
             "| executor | workers (used) | wall s | MB/s | Ray start s | driver write s |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name in ("local", "ray"):
        for x in r[name]:
            lines.append(f"| {name} | {x['workers']} ({x['workers_used']}) | {x['wall_s']:.2f} | {x['mb_per_s']:.2f} | "
                         f"{x.get('ray_init_s', '-')} | {x.get('write_s', '-')} |")
    for loc, ray_ in zip(r["local"], r["ray"]):
        lines.append(f"\nRay overhead at {loc['workers']} worker(s): {ray_['wall_s'] / loc['wall_s']:.2f}x the "
                     f"local wall time (cluster start not included: {ray_['ray_init_s']} s).")
    e = r["eight_nodes"]
    lines += ["", f"Outputs byte-identical (local and Ray, every worker count): {r['identical']}", "",
              f"On paper, {e['nodes']} nodes x {e['cores_per_node']} cores: {e['mb_per_s_per_worker']} MB/s per "
              f"worker (the {e['from_workers']}-worker Ray run, driver write excluded) x {e['nodes'] * e['cores_per_node']} "
              f"workers = {e['mb_per_s_no_serial']} MB/s; with the driver's write ({e['serial_write_s']} s for this "
              f"corpus, growing with it) kept serial: {e['mb_per_s']} MB/s for a corpus of this size. An upper "
              f"bound: the bucket tasks and the one `near` task grow with the corpus too.", ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", nargs="+", default=["python-docs"])
    parser.add_argument("--workers", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--copies", type=int, default=4, help="the inputs' documents this many times (near copies)")
    parser.add_argument("--cores-per-node", type=int, default=64, help="for the 8-node estimate")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_data_scale(args.inputs, args.workers, args.copies, args.cores_per_node, args.out)


if __name__ == "__main__":
    main()
