"""Distillation by rejection sampling: a teacher writes K reasoning traces per task through the engine,
the ones whose final answer is right become SFT data for a smaller student.

    lmforge distill TEACHER --tasks FILE --n K --out DIR
    lmforge train configs/reasoning-sft.yaml data.path=DIR/sft.jsonl ...   # the student, train.stage=sft

For each task (`lmforge.data.synth.read_tasks`: prompt/answer rows or GSM8K's question/`#### N`)
the teacher gets the chat-templated prompt and samples K completions (seeded per task). A trace is
kept when it is well-formed (the reasoning format: `<think>...</think>` then one `Answer:` line) and
its answer equals the task's (the shared extractor, `lmforge.tasks.reasoning`). Kept traces are
written as chat rows `{"messages": [user, assistant], "category", "task"}`; the counts reconcile:
samples = kept + wrong + malformed (a malformed trace may still hold the right answer: it counts
in the teacher's accuracy, not in the kept data).

The same samples make preference pairs for DPO (`preferences.jsonl`, TRL's conversational format). With
`pairs="samples"` (the default) each task's kept traces are paired in order with its rejected ones (wrong, or
malformed and not right), so a task gives min(kept, rejected) pairs and a task the teacher always or never
solves gives none: with the student as its own "teacher", its own right answer against its own wrong one on
the same prompt. With `pairs="reference"` every rejected sample is paired with the task's own reference turn
(its reasoning, empty or not, and its answer in the reasoning format): greedy (`temperature=0`, `n=1`) that is
the model's mode where it is wrong against the right answer (`lmforge train configs/dpo.yaml
data.path=DIR/preferences.jsonl`).

Writes into DIR: sft.jsonl, preferences.jsonl, config.yaml, metrics.jsonl (one line per category), record.json
(teacher hash, task file hash, teacher accuracy = correct samples / samples, teacher pass@K,
kept fraction, per-category counts). Knows nothing about training.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from lmforge.data.synth import read_tasks
from lmforge.engine import LLM, SamplingParams
from lmforge.engine.batch import generate_file
from lmforge.eval.backends import model_hash
from lmforge.tokenizer import load_tokenizer
from lmforge.tasks.reasoning import DEFAULT_FORMAT, answers_match
from lmforge.track.io import atomic_write_text, sha256_file
from lmforge.track.run import RunDir

from .grpo.rollout import chat_prompt_ids

PAIRINGS = ("samples", "reference")  # what a rejected sample is paired with: a right sample, or the task's own turn
COUNTS = ("tasks", "samples", "kept", "wrong", "malformed", "correct", "tasks_solved")


def distill(teacher: str | os.PathLike, tasks_path: str | os.PathLike, n: int, out: str | os.PathLike, *,
            temperature: float = 0.8, top_p: float = 1.0, max_tokens: int = 320, seed: int = 0,
            limit: int | None = None, dtype: str = "auto", device: str = "auto",
            overwrite: bool = False, executor: str = "local", replicas: int = 1,
            ray_address: str | None = None, pairs: str = "samples") -> dict[str, Any]:
    if n < 1:
        raise ValueError(f"--n must be >= 1, got {n}")
    if pairs not in PAIRINGS:
        raise ValueError(f"--pairs {pairs!r}: use one of {', '.join(PAIRINGS)}")
    tasks = read_tasks(tasks_path)[:limit] if limit else read_tasks(tasks_path)
    config = {"teacher": str(teacher), "tasks": str(tasks_path), "n": n, "temperature": temperature, "top_p": top_p,
              "max_tokens": max_tokens, "seed": seed, "limit": limit, "dtype": dtype, "device": device, "pairs": pairs,
              **({"executor": executor, "replicas": replicas} if executor != "local" else {})}
    with RunDir(out, overwrite=overwrite) as run:
        run.write_config(config)
        sample = dict(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed, dtype=dtype, device=device)
        outputs = (sample_traces(teacher, tasks, n, **sample) if executor == "local" else
                   sample_traces_batch(teacher, tasks, n, Path(out) / ".generate", executor=executor,
                                       replicas=replicas, ray_address=ray_address, **sample))
        rows, per_cat = judge_traces(tasks, outputs)
        sft, prefs = Path(out) / "sft.jsonl", Path(out) / "preferences.jsonl"
        atomic_write_text(sft, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        pair_rows = preference_pairs(tasks, outputs, reference=pairs == "reference")
        atomic_write_text(prefs, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in pair_rows))
        for cat, c in sorted(per_cat.items()):
            run.log_metrics({"event": "category", "category": cat, **c})
        results = {**summarize(per_cat, n), "pairs": len(pair_rows)}
        run.write_record({"inputs": {"teacher_hash": model_hash(teacher), "tasks_sha256": sha256_file(tasks_path)},
                          "outputs": {"sft.jsonl": sha256_file(sft), "preferences.jsonl": sha256_file(prefs)}})
        run.finish(**results)
    return results


def sample_traces(teacher: str | os.PathLike, tasks: list[dict[str, Any]], n: int, *, temperature: float,
                  top_p: float, max_tokens: int, seed: int, dtype: str, device: str) -> list[Any]:
    """K completions per task from the teacher through the engine, chat-templated, seeded per task."""
    llm = LLM(str(teacher), dtype=dtype, device=device)
    tok = llm.get_tokenizer()
    if tok is None or not getattr(tok, "chat_template", None):
        raise ValueError(f"{teacher}: the teacher needs a tokenizer with a chat template")
    ids = [chat_prompt_ids(tok, t["prompt"]) for t in tasks]
    room = llm.llm_engine.max_model_len - max(len(i) for i in ids)
    params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=min(max_tokens, room),
                             seed=seed * 1_000_003 + i) for i in range(len(tasks))]
    return llm.generate(ids, params, use_tqdm=True)


def sample_traces_batch(teacher: str | os.PathLike, tasks: list[dict[str, Any]], n: int, work: Path, *,
                        executor: str, replicas: int, ray_address: str | None, temperature: float, top_p: float,
                        max_tokens: int, seed: int, dtype: str, device: str) -> list[Any]:
    """`sample_traces` through `lmforge generate`'s batch path (`engine.batch.generate_file`, Ray replicas with
    executor="ray"): the same chat-templated ids, per-task seeds and budget, so the same traces."""
    tok = load_tokenizer(Path(teacher))
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"{teacher}: the teacher needs a tokenizer with a chat template")
    ids = [chat_prompt_ids(tok, t["prompt"]) for t in tasks]
    context = json.loads((Path(teacher) / "config.json").read_text())["max_position_embeddings"]
    budget = min(max_tokens, context - max(len(i) for i in ids))
    work.mkdir(parents=True, exist_ok=True)
    lines = [{"custom_id": str(i), "prompt": p, "n": n, "temperature": temperature, "top_p": top_p,
              "max_tokens": budget, "seed": seed * 1_000_003 + i} for i, p in enumerate(ids)]
    atomic_write_text(work / "prompts.jsonl", "".join(json.dumps(x) + "\n" for x in lines))
    generate_file(teacher, work / "prompts.jsonl", work / "traces.jsonl", executor=executor, replicas=replicas,
                  ray_address=ray_address, overwrite=True, engine_kwargs={"dtype": dtype, "device": device})
    records = [json.loads(x) for x in (work / "traces.jsonl").read_text().splitlines()]
    return [SimpleNamespace(outputs=[SimpleNamespace(text=c["text"]) for c in sorted(r["choices"],
                                                                                      key=lambda c: c["index"])])
            for r in records]


def judge_traces(tasks: list[dict[str, Any]], outputs: list[Any]) -> tuple[list[dict[str, Any]], dict[str, dict]]:
    """(the kept SFT rows, per-category counts): a trace is kept when well-formed and right; a malformed
    trace with the right answer counts in `correct` (the teacher's accuracy) but is not kept."""
    rows: list[dict[str, Any]] = []
    per_cat: dict[str, dict] = defaultdict(lambda: dict.fromkeys(COUNTS, 0))
    for i, (task, o) in enumerate(zip(tasks, outputs)):
        c = per_cat[task["category"]]
        c["tasks"] += 1
        solved = False
        for comp in o.outputs:
            c["samples"] += 1
            right = answers_match(DEFAULT_FORMAT.extract(comp.text), task["answer"])
            solved |= right
            c["correct"] += right
            if not DEFAULT_FORMAT.is_well_formed(comp.text):
                c["malformed"] += 1
            elif not right:
                c["wrong"] += 1
            else:
                c["kept"] += 1
                rows.append({"messages": [{"role": "user", "content": task["prompt"]},
                                          {"role": "assistant", "content": comp.text.strip()}],
                             "category": task["category"], "task": i})
        c["tasks_solved"] += solved
    return rows, per_cat


def preference_pairs(tasks: list[dict[str, Any]], outputs: list[Any], reference: bool = False) -> list[dict[str, Any]]:
    """DPO pairs (TRL's conversational format) from the same samples: per task, each kept trace (well-formed and
    right) with one rejected trace (wrong, or malformed and not right), in sampling order; with `reference`, every
    rejected trace with the task's own reference turn."""
    pairs: list[dict[str, Any]] = []
    for i, (task, o) in enumerate(zip(tasks, outputs)):
        good, bad = [], []
        for comp in o.outputs:
            right = answers_match(DEFAULT_FORMAT.extract(comp.text), task["answer"])
            if right and DEFAULT_FORMAT.is_well_formed(comp.text):
                good.append(comp.text.strip())
            elif not right:
                bad.append(comp.text.strip())
        if reference:
            good = [DEFAULT_FORMAT.render(task["reasoning"] or "", task["answer"])] * len(bad)
        pairs += [{"prompt": [{"role": "user", "content": task["prompt"]}],
                   "chosen": [{"role": "assistant", "content": g}], "rejected": [{"role": "assistant", "content": b}],
                   "category": task["category"], "task": i} for g, b in zip(good, bad)]
    return pairs


def summarize(per_cat: dict[str, dict], n: int) -> dict[str, Any]:
    """Totals over categories, the teacher's accuracy and pass@K, the kept fraction, and the per-category counts."""
    total = {k: sum(c[k] for c in per_cat.values()) for k in COUNTS}
    return {**total, "teacher_accuracy": total_ratio(total["correct"], total["samples"]),
            f"teacher_pass@{n}": total_ratio(total["tasks_solved"], total["tasks"]),
            "kept_fraction": total_ratio(total["kept"], total["samples"]),
            "per_category": dict(per_cat)}


def total_ratio(a: float, b: float) -> float | None:
    return a / b if b else None
