"""Run suites against one backend and write the run folder.

    out/results.json     per task: primary metric, value, stderr, n, all metrics, suite name/version/
                         sha256, model hash, engine settings; plus the model and engine at the top
    out/samples.jsonl    one line per item: task, id, prompt, target, output, score, ...
    out/bad_cases.jsonl  the failed samples only, for review (and, later, for training data)
    out/config.yaml, record.json, metrics.jsonl   the run-directory contract (lmforge.track.run)

This module knows nothing about tokens or command-line parsing.

    from lmforge.eval.evaluate import evaluate
    evaluate(TransformerBackend("runs/model"), [load_suite("arith")], "runs/eval-1", model_dir="runs/model")
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

from lmforge.eval.backends import Backend, model_hash
from lmforge.eval.scoring import run_task
from lmforge.tasks.suite import Suite, SuiteError
from lmforge.track.io import atomic_write_json, atomic_write_text, sha256_file
from lmforge.track.progress import Progress
from lmforge.track.run import RunDir, RunExistsError

RESULTS, SAMPLES, BAD_CASES = "results.json", "samples.jsonl", "bad_cases.jsonl"


def _run_with_progress(suite: Suite, backend: Backend, show: bool) -> Any:
    """`run_task`, with a progress line per suite (`eval NAME: done/total requests, ETA`) when asked."""
    if not show or not hasattr(backend, "progress"):
        return run_task(suite, backend)
    with Progress(f"eval {suite.name}", unit="requests", heartbeat=True) as bar:
        backend.progress = bar
        try:
            return run_task(suite, backend)
        finally:
            backend.progress = None


def _jsonl(rows: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def refuse_finished_run(out: str | os.PathLike, overwrite: bool) -> None:
    """Stop before loading a model when --out already holds a finished run (RunDir would, later)."""
    try:
        finished = json.loads((Path(out) / "record.json").read_text()).get("status") == "finished"
    except (OSError, ValueError):
        return
    if finished and not overwrite:
        raise RunExistsError(f"{out} holds a finished eval run (record.json status 'finished'); choose a new "
                             f"--out, or pass --overwrite to replace it")


def evaluate(backend: Backend, suites: list[Suite], out: str | os.PathLike, *, model_dir: str | os.PathLike | None = None,
             limit: int | None = None, overwrite: bool = False, config: dict[str, Any] | None = None,
             log: Any = None, progress: bool = False) -> dict[str, Any]:
    """Score every suite (its first `limit` items when given) and write the run folder; returns results.
    `progress`: report each suite's requests as they are scored (`track.progress`, on stderr), for
    backends that count them (`TransformerBackend.progress`)."""
    names = [s.name for s in suites]
    if len(set(names)) != len(names):
        raise SuiteError(f"two suites share a name ({names}); a run reports tasks by suite name")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    m_hash = model_hash(model_dir) if model_dir is not None else None
    engine = backend.info()
    with RunDir(out, overwrite=overwrite) as run:
        run.write_config(config or {"model": str(model_dir), "suites": names, "limit": limit})
        results: dict[str, Any] = {"model": {"dir": None if model_dir is None else str(model_dir), "hash": m_hash},
                                   "engine": engine, "limit": limit, "tasks": {}}
        samples: list[dict[str, Any]] = []
        for suite in suites:
            part = dataclasses.replace(suite, items=suite.items[:limit]) if limit else suite
            t0 = time.perf_counter()
            res = _run_with_progress(part, backend, progress)
            seconds = time.perf_counter() - t0
            primary = res.metrics[res.primary]
            results["tasks"][suite.name] = {
                "suite": suite.name, "version": suite.version, "kind": suite.kind, "metric": res.primary,
                "value": primary["value"], "stderr": primary["stderr"], "n": part.n, "suite_n": suite.n,
                "metrics": res.metrics, "suite_sha256": suite.sha256, "suite_path": str(suite.path),
                "model_hash": m_hash, "engine": engine, "seconds": round(seconds, 3)}
            run.log_metrics({"event": "task", "task": suite.name, "n": part.n, "seconds": round(seconds, 3),
                             **{k: v["value"] for k, v in res.metrics.items()}})
            samples += [{"task": suite.name, **s} for s in res.samples]
            if log:
                log(suite.name, results["tasks"][suite.name])
        out = Path(out)
        atomic_write_json(out / RESULTS, results)
        atomic_write_text(out / SAMPLES, _jsonl(samples))
        atomic_write_text(out / BAD_CASES, _jsonl([s for s in samples if s.get("failed")]))
        run.write_record({"inputs": {"model_hash": m_hash, "model_dir": results["model"]["dir"],
                                     "suites": {s.name: {"version": s.version, "sha256": s.sha256} for s in suites}},
                          "outputs": {f: sha256_file(out / f) for f in (RESULTS, SAMPLES, BAD_CASES)}})
        run.finish(**{name: {"metric": t["metric"], "value": t["value"], "stderr": t["stderr"], "n": t["n"]}
                      for name, t in results["tasks"].items()})
    return results
