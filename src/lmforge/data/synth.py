"""Synthetic training data with verifiable answers, and reading users' task files.

`write_synth(task, n, seed, out)` writes rows of `lmforge.tasks.arith_cot.synth_rows` (arithmetic with
written-out steps: add, sub, mul, word, mix) as JSONL. The frozen eval suites `arith-cot` and
`arith-cot-2d` are drawn from the same categories with their own seeds (`EVAL_SEEDS`); training seeds
must differ, and every prompt of both is passed as `exclude`, so no eval prompt can reach a training
file; `write_synth` records the proof (the suites' hashes, rows dropped, overlap after = 0) next to
the file.

`read_tasks(path)` reads a user's JSONL: `prompt`/`answer` (+ optional `reasoning`, `category`), or
GSM8K's `question`/`answer` where the answer ends in `#### N` (the text before is the reasoning).
Every verb that takes tasks (eval suites, GRPO, distill, SFT) reads them through it.

This module knows nothing about tokenizers or models; the generators are in `lmforge.tasks`.

    lmforge data synth mix --n 20000 --seed 1 --out runs/reasoning/train.jsonl
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

from lmforge.config import ConfigError
from lmforge.tasks.arith_cot import EVAL_SEEDS, synth_rows
from lmforge.tasks.suite import SuiteError, load_suite
from lmforge.track.io import atomic_write_json, atomic_write_text, sha256_file
from lmforge.track.provenance import git_info


class TaskFileError(ConfigError):
    """A task file line a person must fix; the message names the file, line and field."""


EVAL_SUITES = ("arith-cot", "arith-cot-2d")  # the frozen suites drawn from the generator's categories


def eval_prompts() -> tuple[set[str], dict[str, str]]:
    """Every prompt of the frozen suites in `EVAL_SUITES` and their sha256 by name (a suite not yet
    written is left out: `lmforge eval make-suite builtins` writes them)."""
    prompts, hashes = set(), {}
    for name in EVAL_SUITES:
        try:
            suite = load_suite(name)
        except SuiteError:
            continue
        prompts |= {it["prompt"] for it in suite.items}
        hashes[name] = suite.sha256
    return prompts, hashes


def write_synth(task: str, n: int, seed: int, out: str | os.PathLike, overwrite: bool = False) -> dict[str, Any]:
    """Write `out` (JSONL) and `out` + `.record.json` (seed, counts, categories, the disjointness proof)."""
    if seed in EVAL_SEEDS:
        raise ValueError(f"--seed {seed} is an eval suite's seed ({', '.join(map(str, EVAL_SEEDS))}); pick any "
                         f"other seed for training data")
    out = Path(out)
    record_path = out.with_name(out.name + ".record.json")
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass --overwrite or choose another --out")
    exclude, suite_hashes = eval_prompts()
    rows, counts = synth_rows(task, n, seed, exclude)
    overlap = sum(r["prompt"] in exclude for r in rows)
    assert overlap == 0  # synth_rows dropped them; this is the proof recorded below
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    record = {"stage": "synth", "task": task, "n": n, "seed": seed, "eval_seeds": list(EVAL_SEEDS), **counts,
              "categories": dict(Counter(r["category"] for r in rows)),
              "eval_suites": suite_hashes, "eval_prompts_checked": len(exclude),
              "eval_overlap_after": overlap, "sha256": sha256_file(out), "git": git_info()}
    atomic_write_json(record_path, record)
    return record


# ---- users' task files -------------------------------------------------------------------------------

def parse_task(obj: Any, where: str) -> dict[str, Any]:
    """One task row -> {prompt, answer, reasoning|None, category}; GSM8K's question/'#### N' accepted."""
    if not isinstance(obj, dict):
        raise TaskFileError(f"{where}: each line must be a JSON object with prompt/answer (or question/answer)")
    prompt = obj.get("prompt", obj.get("question"))
    if not isinstance(prompt, str) or not prompt.strip():
        raise TaskFileError(f"{where}: field 'prompt' (or GSM8K's 'question') must be a non-empty string")
    answer = obj.get("answer")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str) or not answer.strip():
        raise TaskFileError(f"{where}: field 'answer' must be a non-empty string or number")
    reasoning = obj.get("reasoning")
    if "####" in answer:  # GSM8K: "steps ... #### 72"
        reasoning, _, answer = answer.rpartition("####")
        reasoning = reasoning.strip() or None
        if not answer.strip():
            raise TaskFileError(f"{where}: field 'answer' has nothing after '####'")
    return {"prompt": prompt.strip(), "answer": answer.strip(), "reasoning": reasoning,
            "category": str(obj.get("category", "all"))}


def read_tasks(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every task of a JSONL file (blank lines skipped); errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such task file; make one with `lmforge data synth mix --n 1000 "
                                f"--seed 1 --out {path}` or give JSONL with prompt/answer")
    tasks = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskFileError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
            tasks.append(parse_task(obj, f"{path}:{lineno}"))
    if not tasks:
        raise TaskFileError(f"{path}: no tasks (the file is empty)")
    return tasks
