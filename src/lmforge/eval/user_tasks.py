"""Users' own task files as eval suites: a GSM8K-style JSONL (`question`, `answer` ending in `#### N`) or a
plain `prompt`/`answer` JSONL (with or without `reasoning`), the same files `lmforge train` reads for SFT and
GRPO (`lmforge.data.synth.read_tasks`).

`load_any_suite(ref)` is what `lmforge eval --suite REF` calls: a built-in name or suite file as before, or a
task file, which becomes a `generate` suite scored like the built-in `arith-cot`: the chat template, greedy, the
reasoning format's one `Answer:` line (metric `answer`), compared through the one `normalize_answer` that GRPO's
`correct` reward uses too (`lmforge.tasks.reasoning`), so a reward of 1 and an eval score of 1 mean the same
thing. Its sha256 is the task file's own bytes, recorded with every result like a built-in suite's hash.
`make_task_suite` freezes a task file into a suite file with a header (name, version, settings and the source
file's sha256): `lmforge eval make-suite tasks FILE --out SUITE.jsonl`.

This module knows nothing about models or metrics.

    suite = load_any_suite("data/gsm8k_test.jsonl")   # 1319 items, sha256 of the file
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from lmforge.data.synth import read_tasks
from lmforge.eval.suites import write_suite
from lmforge.tasks.suite import Suite, load_suite, parse_suite, render_suite

# How a task file is scored: as arith-cot is, with room for GSM8K's longer reasoning.
TASK_SUITE_SETTINGS = {"max_tokens": 512, "stop": [], "chat": True}


def is_task_file(path: str | os.PathLike) -> bool:
    """A JSONL whose first non-blank line is a task row (prompt/question + answer), not a suite header."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    return False  # load_suite names the line
                return isinstance(obj, dict) and "suite" not in obj and "answer" in obj and (
                    "prompt" in obj or "question" in obj)
    return False


def task_suite_parts(path: str | os.PathLike, name: str | None = None, version: int = 1,
                     **settings: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(header, items) of the suite a task file becomes; `settings` override `TASK_SUITE_SETTINGS`."""
    path = Path(path)
    name = name or path.stem
    tasks = read_tasks(path)
    items = [{"id": f"{name}-{i:05d}", "prompt": t["prompt"], "answer": t["answer"], "category": t["category"]}
             for i, t in enumerate(tasks)]
    header = {"suite": name, "version": version, "kind": "generate", "metric": "answer",
              "description": f"{len(items)} tasks of {path.name}: chat template, greedy, the one 'Answer:' line "
                             "after </think> must equal the answer",
              **TASK_SUITE_SETTINGS, **settings,
              "source": path.name, "source_sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    return header, items


def suite_from_tasks(path: str | os.PathLike, **settings: Any) -> Suite:
    """A task file as a suite, in memory; its sha256 is the task file's."""
    header, items = task_suite_parts(path, **settings)
    suite = parse_suite(render_suite(header, items, str(path)), str(path))
    suite.sha256, suite.path = header["source_sha256"], Path(path)
    return suite


def load_any_suite(ref: str | os.PathLike) -> Suite:
    """A built-in suite name, a suite file, or a task file (GSM8K or prompt/answer JSONL)."""
    return suite_from_tasks(ref) if is_task_file(ref) else load_suite(ref)


def make_task_suite(tasks: str | os.PathLike, out: str | os.PathLike, name: str | None = None, version: int = 1,
                    **settings: Any) -> Suite:
    """Freeze a task file into the suite file `out` (atomically); returns it as loaded."""
    header, items = task_suite_parts(tasks, name=name, version=version, **settings)
    write_suite(out, header, items)
    return load_suite(out)
