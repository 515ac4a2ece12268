"""The run directory every stage writes into: config.yaml, metrics.jsonl, record.json, products.

    run = RunDir("runs/pretrain-01")          # refuses a finished run unless overwrite/resume
    run.write_config(cfg)                     # resolved config (dataclass or dict) -> config.yaml
    run.log_metrics({"step": 1, "loss": 3.2}) # one JSON line, flushed
    run.finish(val_loss=2.9)                  # record.json: status finished + provenance + results

`record.json` always carries provenance (git commit and dirty flag, package versions, hardware),
start/finish times, wall time and peak memory, so any two records can be compared. A run that
did not finish (crashed or still running) may be reopened; its metrics are appended to.
It knows nothing about what a stage computes; stages add their inputs' and outputs' hashes
through `write_record`.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

from lmforge.config import dump_yaml, to_dict
from lmforge.track.io import atomic_write_json, atomic_write_text
from lmforge.track.provenance import git_info, hardware_info, package_versions

CONFIG, METRICS, RECORD = "config.yaml", "metrics.jsonl", "record.json"


class RunExistsError(FileExistsError):
    """The folder holds a finished run; the message says how to proceed."""


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def peak_memory() -> dict[str, int]:
    """Peak resident memory of this process, and peak CUDA memory allocated when torch uses CUDA."""
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {"cpu_max_rss_bytes": maxrss if sys.platform == "darwin" else maxrss * 1024}  # Linux: KiB
    torch = sys.modules.get("torch")  # only when the stage already imported it: no 2 s import here
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
    return out


class RunDir:
    def __init__(self, path: str | os.PathLike, overwrite: bool = False, resume: bool = False):
        self.path = Path(path)
        self._t0 = time.monotonic()
        previous = self.read_record()
        if previous.get("status") == "finished" and not (overwrite or resume):
            raise RunExistsError(f"{self.path} holds a finished run (record.json status 'finished'); "
                                 f"choose a new --out, or pass --overwrite to replace it / --resume to continue it")
        if overwrite:
            for name in (CONFIG, METRICS, RECORD):  # the stage's own products are the stage's to replace
                (self.path / name).unlink(missing_ok=True)
            previous = {}
        self.path.mkdir(parents=True, exist_ok=True)
        self._wall_before = float(previous.get("wall_time_s") or 0.0)  # time spent before a resume
        self._record: dict[str, Any] = previous
        self.write_record({"status": "running", "started_at": previous.get("started_at") or _now()})

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.write_record({"status": "failed", "error": f"{exc_type.__name__}: {exc}"})

    def read_record(self) -> dict:
        try:
            return json.loads((self.path / RECORD).read_text())
        except FileNotFoundError:
            return {}
        except json.JSONDecodeError as e:
            raise RunExistsError(f"{self.path / RECORD} is not valid JSON ({e}); "
                                 f"inspect it, or pass --overwrite to start the run again") from e

    def write_config(self, cfg: Any) -> Path:
        """The resolved config (dataclass or mapping) as config.yaml."""
        return atomic_write_text(self.path / CONFIG, dump_yaml(cfg))

    def log_metrics(self, metrics: dict[str, Any]) -> None:
        """Append one JSON object as one line, flushed so a crash keeps every logged step."""
        with open(self.path / METRICS, "a", encoding="utf-8") as f:
            f.write(json.dumps(to_dict(metrics), ensure_ascii=False, default=str) + "\n")
            f.flush()

    def write_record(self, fields: dict[str, Any]) -> Path:
        """Merge `fields` into record.json, refreshing provenance, wall time and peak memory."""
        self._record.update(to_dict(fields))
        if not hasattr(self, "_provenance"):  # once per process: git and hardware do not change mid-run
            self._provenance = {"git": git_info(), "packages": package_versions(), "hardware": hardware_info()}
        self._record.update({
            **self._provenance,
            "wall_time_s": round(self._wall_before + time.monotonic() - self._t0, 3),
            "peak_memory": peak_memory(),
        })
        return atomic_write_json(self.path / RECORD, self._record)

    def finish(self, **results: Any) -> Path:
        """Mark the run finished, with its results; from now on the folder is protected."""
        return self.write_record({"status": "finished", "finished_at": _now(),
                                  "results": {**self._record.get("results", {}), **results}})
