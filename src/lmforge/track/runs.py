"""Reading run directories back: list them, summarize one, compare two.

A run directory is what `RunDir` writes: `config.yaml`, `record.json`, `metrics.jsonl`.
`list_runs` finds every run below a folder, `summarize` pulls the headline numbers out of a
record, `config_diff` flattens two resolved configs to dotted keys and returns those that
differ, and `metrics_side_by_side` aligns two runs' metrics by step. Knows nothing about any
stage's internals, only the files. `read_metrics` is the one reader of metrics.jsonl (it tolerates
the torn last line of a killed process); `truncate_metrics` cuts it back to a resumed step.

    from lmforge.track.runs import list_runs, config_diff
    for run in list_runs("runs"): print(run)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from lmforge.track.io import atomic_write_text

RECORD, CONFIG, METRICS = "record.json", "config.yaml", "metrics.jsonl"
HEADLINE = ("final_train_loss", "final_val_loss", "tokens_per_s", "mfu", "peak_mem", "steps")


def read_record(run: str | os.PathLike) -> dict[str, Any]:
    path = Path(run) / RECORD
    if not path.is_file():
        raise FileNotFoundError(f"{run}: no {RECORD}; is it a run directory (written with --out)?")
    return json.loads(path.read_text())


def read_config(run: str | os.PathLike) -> dict[str, Any]:
    path = Path(run) / CONFIG
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}


def read_metrics(run: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a run's metrics.jsonl (`run` is the run directory or the file itself); [] when absent.
    A line that does not parse (the torn last line of a process killed mid-write) is skipped with a
    warning on stderr: the lines before it stand, and `truncate_metrics` rewrites the file without it."""
    path = Path(run)
    if path.is_dir() or not path.name.endswith(".jsonl"):
        path = path / METRICS
    if not path.is_file():
        return []
    rows = []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            print(f"warning: {path}:{n}: not a JSON line (torn by a kill?); dropped", file=sys.stderr, flush=True)
    return rows


def truncate_metrics(run: str | os.PathLike, step: int) -> None:
    """Drop the rows logged after `step` (the checkpoint a run resumes from): those steps run again."""
    path = Path(run) / METRICS
    lines = [json.dumps(m) for m in read_metrics(path) if m.get("step", 0) <= step]
    atomic_write_text(path, "".join(line + "\n" for line in lines))


def list_runs(root: str | os.PathLike = "runs") -> list[Path]:
    """Every folder below `root` (and `root` itself) holding a record.json, sorted by path."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such folder")
    return sorted(p.parent for p in root.rglob(RECORD) if "checkpoints" not in p.parts)


def summarize(run: str | os.PathLike) -> dict[str, Any]:
    """Headline fields of a run: what `runs list` prints per row."""
    rec = read_record(run)
    res = rec.get("results", {})
    row = {"run": str(run), "status": rec.get("status"), "stage": rec.get("stage"), "method": rec.get("method"),
           "started_at": rec.get("started_at"), "wall_time_s": rec.get("wall_time_s")}
    row.update({k: res.get(k, rec.get(k)) for k in HEADLINE})
    return row


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix.rstrip("."): d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def config_diff(a: str | os.PathLike, b: str | os.PathLike) -> list[tuple[str, Any, Any]]:
    """(dotted key, value in a, value in b) for every config key whose values differ."""
    fa, fb = flatten(read_config(a)), flatten(read_config(b))
    missing = object()
    rows = []
    for key in sorted(set(fa) | set(fb)):
        va, vb = fa.get(key, missing), fb.get(key, missing)
        if va != vb:
            rows.append((key, None if va is missing else va, None if vb is missing else vb))
    return rows


def metrics_side_by_side(a: str | os.PathLike, b: str | os.PathLike, key: str = "loss",
                         every: int = 1) -> list[tuple[int, Any, Any]]:
    """(step, a's value, b's value) for every step either run logged `key` at (thinned by `every`)."""
    ma = {m["step"]: m.get(key) for m in read_metrics(a) if "step" in m and key in m}
    mb = {m["step"]: m.get(key) for m in read_metrics(b) if "step" in m and key in m}
    steps = sorted(set(ma) | set(mb))
    last = steps[-1] if steps else None
    return [(s, ma.get(s), mb.get(s)) for s in steps if s % max(every, 1) == 0 or s == last]


# What can make two runs of the same code differ, section by section (the seed's "works on their
# machine, not on mine" row): the resolved config, the packages, the code, the data, the hardware.
PROVENANCE = {"packages": ("packages",), "git": ("git",), "data": ("data_hash", "tokenizer_hash", "tokenizer_dir"),
              "hardware": ("hardware",), "determinism": ("determinism", "seed", "dtype", "device")}


def provenance_diff(a: str | os.PathLike, b: str | os.PathLike) -> dict[str, list[tuple[str, Any, Any]]]:
    """{section: [(dotted key, a's value, b's value), ...]} for config, packages, git, data, hardware
    and determinism, only the keys that differ."""
    ra, rb = read_record(a), read_record(b)
    out = {"config": config_diff(a, b)}
    missing = object()
    for section, keys in PROVENANCE.items():
        fa = flatten({k: ra[k] for k in keys if k in ra})
        fb = flatten({k: rb[k] for k in keys if k in rb})
        rows = []
        for key in sorted(set(fa) | set(fb)):
            va, vb = fa.get(key, missing), fb.get(key, missing)
            if va != vb:
                rows.append((key, None if va is missing else va, None if vb is missing else vb))
        out[section] = rows
    return out
