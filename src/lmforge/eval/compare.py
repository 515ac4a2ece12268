"""Compare two eval runs task by task; refuse when a suite's bytes differ between them.

A difference in score means something only when both runs scored the same items, so a task
whose suite sha256 differs stops the comparison (`SuiteChangedError`) unless the caller
allows it, and then every such row is marked. Tasks present in one run only are listed with
the other side empty. This module knows nothing about models.

    rows, changed = compare_runs("runs/eval-a", "runs/eval-b")
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.eval.evaluate import RESULTS


class SuiteChangedError(ValueError):
    """The two runs scored different versions of a suite; the message names the tasks and the override."""


@dataclass
class Row:
    task: str
    metric: str
    a: dict[str, Any] | None  # {"value", "stderr", "n"}
    b: dict[str, Any] | None
    suite_changed: bool

    @property
    def delta(self) -> float | None:
        if self.a is None or self.b is None:
            return None
        return self.b["value"] - self.a["value"]

    @property
    def z(self) -> float | None:
        """delta over its standard error, sqrt(se_a^2 + se_b^2) (independent runs)."""
        d = self.delta
        if d is None or self.a["stderr"] is None or self.b["stderr"] is None:
            return None
        se = math.sqrt(self.a["stderr"] ** 2 + self.b["stderr"] ** 2)
        return d / se if se > 0 else None


def load_results(run: str | os.PathLike) -> dict[str, Any]:
    path = Path(run) / RESULTS if Path(run).is_dir() else Path(run)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: not found; pass an eval run folder (the --out of `lmforge eval`) "
                                f"or its results.json") from None


def compare_runs(a: str | os.PathLike, b: str | os.PathLike,
                 allow_changed_suite: bool = False) -> tuple[list[Row], list[str]]:
    """(one row per task and metric, names of tasks whose suite changed)."""
    ra, rb = load_results(a)["tasks"], load_results(b)["tasks"]
    changed = sorted(t for t in ra.keys() & rb.keys() if ra[t]["suite_sha256"] != rb[t]["suite_sha256"])
    if changed and not allow_changed_suite:
        details = "; ".join(f"{t}: v{ra[t]['version']} {ra[t]['suite_sha256'][:12]} vs "
                            f"v{rb[t]['version']} {rb[t]['suite_sha256'][:12]}" for t in changed)
        raise SuiteChangedError(f"the runs scored different suite files ({details}); their scores are not "
                                f"comparable. Rerun both on the same suite, or pass --allow-changed-suite "
                                f"to compare anyway (the table marks those rows)")
    rows = []
    for task in sorted(ra.keys() | rb.keys()):
        ta, tb = ra.get(task), rb.get(task)
        names = list(dict.fromkeys([*(ta or {}).get("metrics", {}), *(tb or {}).get("metrics", {})]))
        for metric in names:
            rows.append(Row(task, metric, _cell(ta, metric), _cell(tb, metric), task in changed))
    return rows, changed


def _cell(task: dict[str, Any] | None, metric: str) -> dict[str, Any] | None:
    if task is None or metric not in task["metrics"]:
        return None
    return {**task["metrics"][metric], "n": task["n"]}
