"""Throughput of the feedback store and latency of registry operations, as a run folder.

    python -m lmforge.bench.registry [--out runs/bench-registry] [--n 5000] [--batch 32]

Measures, on fresh files in `OUT/work/`: `log_exchanges` in batches of `--batch` rows (PII masking
included, as the server calls it), `add_feedback` one call = one transaction (the endpoint's
path), `stats()`, and registry `add` / `get` / `set_alias` / `promote --force` / `rollback` on a
small model folder, then `flywheel build` over the stored exchanges. Writes `bench.json` and
`bench.md` (with the machine and the date) plus the
run-directory record. The target from issue 15 is add_feedback >= 1,000/s.
It knows nothing about HTTP; the server's own overhead is measured by `lmforge bench serve`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from lmforge.registry.feedback import FeedbackStore
from lmforge.registry.flywheel import build
from lmforge.registry.store import Registry
from lmforge.track.io import atomic_write_json, atomic_write_text
from lmforge.track.run import RunDir

TARGET_FEEDBACK_PER_S = 1000.0


def _rows(n: int, start: int = 0) -> list[dict[str, Any]]:
    return [{"id": f"cmpl-{i}", "created": "2026-12-01T00:00:00+00:00", "model": "bench", "model_version": "1",
             "user": f"user-{i % 97}", "kind": "chat",
             "prompt": f"Question {i}: how do I sort a dict by value? Reach me at user{i}@example.com.",
             "response": "Use sorted(d.items(), key=lambda kv: kv[1]) and build a new dict from it."}
            for i in range(start, start + n)]


def bench_feedback(work: Path, n: int, batch: int) -> dict[str, Any]:
    store = FeedbackStore(work / "feedback.db")
    rows = _rows(n)
    t0 = time.perf_counter()
    for i in range(0, n, batch):
        store.log_exchanges(rows[i:i + batch])
    log_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    known = sum(store.add_feedback(f"cmpl-{i}", -1 if i % 3 == 0 else 1,
                                   correction="Use dict(sorted(d.items(), key=lambda kv: kv[1]))." if i % 3 == 0
                                   else None) for i in range(n))
    fb_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    unknown = sum(store.add_feedback(f"missing-{i}", 1) for i in range(min(n, 1000)))
    unknown_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    stats = store.stats()
    stats_s = time.perf_counter() - t0
    store.close()
    assert known == n and unknown == 0 and stats["with_feedback"] == n, (known, unknown, stats)
    return {"exchanges": n, "batch": batch, "log_exchanges_rows_per_s": n / log_s,
            "add_feedback_per_s": n / fb_s, "add_feedback_unknown_id_per_s": min(n, 1000) / unknown_s,
            "stats_ms": stats_s * 1e3, "low_score_ratio": stats["low_score_ratio"],
            "db_bytes": sum(p.stat().st_size for p in work.glob("feedback.db*"))}


def _timed(fn: Any, repeats: int) -> dict[str, float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(times), "max_ms": max(times)}


def bench_registry(work: Path, repeats: int = 20) -> dict[str, Any]:
    model = work / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(os.urandom(4 << 20))  # 4 MiB of "weights": hashing is in add
    reg = Registry(work / "registry.db")
    out = {"add_4MiB": _timed(lambda: reg.add("bench", model), repeats),
           "get_champion": _timed(lambda: reg.get("bench", "champion"), repeats),
           "set_alias": _timed(lambda: reg.set_alias("bench", "challenger", 2), repeats)}
    versions = iter(range(2, 2 + repeats))
    out["promote_force"] = _timed(lambda: reg.promote("bench", next(versions), force=True), repeats - 1)
    out["rollback"] = _timed(lambda: reg.rollback("bench"), 1)
    return out


def bench_flywheel(work: Path) -> dict[str, Any]:
    """`flywheel build` over the exchanges `bench_feedback` stored (a third corrected, all near-duplicates
    of each other after masking, as templated traffic is), against the champion `bench_registry` made."""
    t0 = time.perf_counter()
    stats = build(work / "feedback.db", Registry(work / "registry.db"), "bench", work / "flywheel", min_count=50)
    seconds = time.perf_counter() - t0
    return {"exchanges": stats["in"], "seconds": seconds, "exchanges_per_s": stats["in"] / seconds,
            "kept": stats["kept"], "dropped": {k: v for k, v in stats["dropped"].items() if v}}


def run_bench(out: str | os.PathLike, n: int = 5000, batch: int = 32) -> dict[str, Any]:
    with RunDir(out, overwrite=True) as run:
        run.write_config({"n": n, "batch": batch})
        work = Path(out) / "work"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        result = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                  "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                              "python": platform.python_version()},
                  "feedback": bench_feedback(work, n, batch), "registry": bench_registry(work)}
        result["flywheel"] = bench_flywheel(work)
        result["target_add_feedback_per_s"] = TARGET_FEEDBACK_PER_S
        result["meets_target"] = result["feedback"]["add_feedback_per_s"] >= TARGET_FEEDBACK_PER_S
        shutil.rmtree(work, ignore_errors=True)
        atomic_write_json(Path(out) / "bench.json", result)
        atomic_write_text(Path(out) / "bench.md", _markdown(result))
        run.finish(add_feedback_per_s=result["feedback"]["add_feedback_per_s"], meets_target=result["meets_target"])
    return result


def _markdown(r: dict[str, Any]) -> str:
    f = r["feedback"]
    lines = [f"# Feedback store and registry ({r['date']}, {r['machine']['platform']}, "
             f"{r['machine']['cpu_count']} CPUs)", "",
             "`python -m lmforge.bench.registry`", "", "| operation | rate / latency |", "| --- | --- |",
             f"| log_exchanges, batches of {f['batch']} (PII masking included) | "
             f"{f['log_exchanges_rows_per_s']:,.0f} rows/s |",
             f"| add_feedback, one transaction per call | {f['add_feedback_per_s']:,.0f} /s "
             f"(target {r['target_add_feedback_per_s']:,.0f}: {'met' if r['meets_target'] else 'MISSED'}) |",
             f"| add_feedback, unknown id (returns False) | {f['add_feedback_unknown_id_per_s']:,.0f} /s |",
             f"| stats() over {f['exchanges']:,} exchanges | {f['stats_ms']:.1f} ms |"]
    for op, t in r["registry"].items():
        lines.append(f"| registry {op} | median {t['median_ms']:.2f} ms, max {t['max_ms']:.2f} ms |")
    fw = r["flywheel"]
    lines.append(f"| flywheel build over {fw['exchanges']:,} exchanges | {fw['seconds']:.2f} s "
                 f"({fw['exchanges_per_s']:,.0f} exchanges/s; kept {fw['kept']}, dropped {fw['dropped']}) |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m lmforge.bench.registry", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/bench-registry", help="run folder for bench.json and bench.md")
    p.add_argument("--n", type=int, default=5000, help="exchanges logged, then scored")
    p.add_argument("--batch", type=int, default=32, help="rows per log_exchanges call")
    a = p.parse_args(argv)
    r = run_bench(a.out, a.n, a.batch)
    print(_markdown(r), end="")


if __name__ == "__main__":
    main()
