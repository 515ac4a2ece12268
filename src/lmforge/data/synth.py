"""Tasks with verifiable answers: synthetic arithmetic with written-out steps, and reading users' task files.

`synth_rows(task, n, seed)` makes rows

    {"prompt": "What is 347 + 85?", "answer": "432", "reasoning": "7+5+0=12 -> 2\\n...",
     "category": "add-3d", "difficulty": 3, "text": "..."}

where `reasoning` is what a person writes on paper: column addition right to left with the carry
("4+8+1=13 -> 32": the digits, the carry in, the column sum, the result so far), column
subtraction with borrows, multiplication digit by digit with carries and, for a 2-digit
multiplier, two partial products added in columns; word problems (quantities, containers, "how
many are left") chain those blocks, one per operation. Every block ends with its equation
("347+85=432"). `text` is the prompt and the rendered assistant turn, for tokenizer training.

Tasks: add, sub, mul, word, and mix (all categories uniformly). The frozen eval suite `arith-cot`
(`lmforge.eval.builtin`) is drawn from the same categories with `EVAL_SEED`; training seeds must
differ, and `synth_rows` drops any row whose prompt is in `exclude` (by default every arith-cot
prompt), so no eval prompt can reach a training file; `write_synth` records the proof (eval suite
hash, rows dropped, overlap after = 0) next to the file.

`read_tasks(path)` reads a user's JSONL: `prompt`/`answer` (+ optional `reasoning`, `category`), or
GSM8K's `question`/`answer` where the answer ends in `#### N` (the text before is the reasoning).
Every verb that takes tasks (eval suites, GRPO, distill, SFT) reads them through it.

Randomness is SplitMix64 (`lmforge.eval.builtin`): the same seed gives the same bytes everywhere.
This module knows nothing about tokenizers or models.

    lmforge data synth mix --n 20000 --seed 1 --out runs/reasoning/train.jsonl
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmforge.config import ConfigError
from lmforge.eval.reasoning import DEFAULT_FORMAT

EVAL_SEED = 1_000_003  # arith-cot's seed; training seeds must differ
NAMES = ("Ava", "Ben", "Chloe", "Dan", "Emma", "Finn", "Grace", "Hugo", "Iris", "Jack", "Lena", "Omar")
THINGS = ("apples", "marbles", "pencils", "stickers", "cookies", "books", "coins", "shells")
CONTAINERS = (("box", "boxes"), ("bag", "bags"), ("jar", "jars"), ("crate", "crates"))


class TaskFileError(ConfigError):
    """A task file line a person must fix; the message names the file, line and field."""


def _rng(seed: int):
    from lmforge.eval.builtin import SplitMix64

    return SplitMix64(seed)


def _num(rng, digits: int) -> int:
    return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)


# ---- written-out steps -----------------------------------------------------------------------------

def add_steps(a: int, b: int) -> list[str]:
    """Column addition, right to left: 'da+db+carry=sum -> result so far'."""
    xs, ys, lines, carry, done = str(a)[::-1], str(b)[::-1], [], 0, ""
    for i in range(max(len(xs), len(ys))):
        da, db = int(xs[i]) if i < len(xs) else 0, int(ys[i]) if i < len(ys) else 0
        s = da + db + carry
        done = str(s % 10) + done
        lines.append(f"{da}+{db}+{carry}={s} -> {done}")
        carry = s // 10
    if carry:
        lines.append(f"carry {carry} -> {carry}{done}")
    return lines + [f"{a}+{b}={a + b}"]


def sub_steps(a: int, b: int) -> list[str]:
    """Column subtraction (a >= b), right to left; a column that goes below 0 borrows 10."""
    assert a >= b
    xs, ys, lines, borrow, done = str(a)[::-1], str(b)[::-1], [], 0, ""
    for i in range(len(xs)):
        da, db = int(xs[i]), int(ys[i]) if i < len(ys) else 0
        r = da - db - borrow
        if r < 0:
            done = str(r + 10) + done
            lines.append(f"1{da}-{db}-{borrow}={r + 10} borrow 1 -> {done}")
            borrow = 1
        else:
            done = str(r) + done
            lines.append(f"{da}-{db}-{borrow}={r} -> {done}")
            borrow = 0
    return lines + [f"{a}-{b}={a - b}"]


def mul1_steps(a: int, d: int) -> list[str]:
    """a times a single digit d, digit by digit with carries."""
    lines, carry, done = [], 0, ""
    for ch in str(a)[::-1]:
        p = int(ch) * d + carry
        done = str(p % 10) + done
        lines.append(f"{ch}*{d}+{carry}={p} -> {done}")
        carry = p // 10
    if carry:
        lines.append(f"carry {carry} -> {carry}{done}")
    return lines + [f"{a}*{d}={a * d}"]


def mul_steps(a: int, b: int) -> list[str]:
    """a times b (1 or 2 digits): one partial product per digit of b, then their column sum."""
    if b < 10:
        return mul1_steps(a, b)
    hi, lo = divmod(b, 10)
    lines = mul1_steps(a, lo) + mul1_steps(a, hi) + [f"{a * hi}*10={a * hi * 10}"]
    return lines + add_steps(a * lo, a * hi * 10)[:-1] + [f"{a}*{b}={a * b}"]


def _steps(op: str, a: int, b: int) -> tuple[list[str], int]:
    if op == "+":
        return add_steps(a, b), a + b
    if op == "-":
        return sub_steps(a, b), a - b
    return mul_steps(a, b), a * b


# ---- categories ------------------------------------------------------------------------------------

def _arith(op: str, da: int, db: int) -> Callable:
    def make(rng) -> tuple[str, list[str], int, int]:
        a, b = _num(rng, da), _num(rng, db)
        if op == "-" and a < b:
            a, b = b, a
        steps, ans = _steps(op, a, b)
        return f"What is {a} {op} {b}?", steps, ans, max(da, db) + (db if op == "*" else 0)
    return make


def _word(rng) -> tuple[str, list[str], int, int]:
    name, other, thing = rng.choice(NAMES), rng.choice(NAMES), rng.choice(THINGS)
    while other == name:
        other = rng.choice(NAMES)
    box, boxes = rng.choice(CONTAINERS)
    form = rng.randint(0, 3)
    if form == 0:
        a, b = _num(rng, 2), _num(rng, 2)
        c = rng.randint(1, a + b)
        q = (f"{name} has {a} {thing}. {name} buys {b} more, then gives {c} to {other}. "
             f"How many {thing} does {name} have now?")
        ops = [(f"{a} {thing} and {b} more:", "+", a, b), (f"gives {c} away:", "-", a + b, c)]
    elif form == 1:
        a, b = _num(rng, 2), rng.randint(2, 9)
        q = f"A {box} holds {a} {thing}. How many {thing} are in {b} {boxes}?"
        ops = [(f"{b} {boxes} of {a}:", "*", a, b)]
    elif form == 2:
        a, b = _num(rng, 2), rng.randint(2, 9)
        c = rng.randint(1, a * b)
        q = (f"{name} buys {b} {boxes} with {a} {thing} in each and gives {c} {thing} to {other}. "
             f"How many {thing} are left?")
        ops = [(f"{b} {boxes} of {a}:", "*", a, b), (f"gives {c} away:", "-", a * b, c)]
    else:
        a = _num(rng, 2)
        b, c = rng.randint(1, a), _num(rng, 2)
        q = f"{name} had {a} {thing}, lost {b} and then found {c}. How many {thing} does {name} have now?"
        ops = [(f"{a} {thing}, lost {b}:", "-", a, b), (f"found {c}:", "+", a - b, c)]
    lines, ans = [], 0
    for label, op, x, y in ops:
        steps, ans = _steps(op, x, y)
        lines += [label, *steps]
    return q, lines, ans, 2 + len(ops)


CATEGORIES: dict[str, Callable] = {
    "add-2d": _arith("+", 2, 2), "add-3d": _arith("+", 3, 3), "add-4d": _arith("+", 4, 4),
    "sub-2d": _arith("-", 2, 2), "sub-3d": _arith("-", 3, 3), "sub-4d": _arith("-", 4, 4),
    "mul-2x1": _arith("*", 2, 1), "mul-3x1": _arith("*", 3, 1), "mul-2x2": _arith("*", 2, 2),
    "word": _word,
}
TASKS: dict[str, tuple[str, ...]] = {
    "add": ("add-2d", "add-3d", "add-4d"), "sub": ("sub-2d", "sub-3d", "sub-4d"),
    "mul": ("mul-2x1", "mul-3x1", "mul-2x2"), "word": ("word",),
    "mix": ("add-2d", "add-3d", "sub-2d", "sub-3d", "mul-2x1", "mul-3x1", "mul-2x2", "word"),
}


def make_row(category: str, rng) -> dict[str, Any]:
    prompt, steps, answer, difficulty = CATEGORIES[category](rng)
    reasoning = "\n".join(steps)
    row = {"prompt": prompt, "answer": str(answer), "reasoning": reasoning, "category": category,
           "difficulty": difficulty}
    row["text"] = f"{prompt}\n{DEFAULT_FORMAT.render(reasoning, row['answer'])}"
    return row


def synth_rows(task: str, n: int, seed: int, exclude: set[str] | None = None,
               categories: tuple[str, ...] | None = None) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """n rows of `task` (categories in turn), unique prompts, none in `exclude`; and the counts."""
    cats = categories or TASKS.get(task)
    if cats is None:
        raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    if n < 1:
        raise ValueError(f"--n must be >= 1, got {n}")
    rng, rows, seen, dropped = _rng(seed), [], set(), Counter()
    exclude, live, misses, exhausted = exclude or set(), list(cats), Counter(), []
    while len(rows) < n:
        if not live:
            raise ValueError(f"task {task!r}: could not find {n} distinct prompts (got {len(rows)}); "
                             f"the categories {cats} are too small for that many rows")
        cat = live[len(rows) % len(live)]
        row = make_row(cat, rng)
        if row["prompt"] in exclude:
            dropped["eval_overlap"] += 1
        elif row["prompt"] in seen:
            dropped["duplicate"] += 1
            misses[cat] += 1
            if misses[cat] >= 200:  # (nearly) every prompt of this category is taken: go on without it
                live.remove(cat)
                exhausted.append(cat)
        else:
            seen.add(row["prompt"])
            rows.append(row)
            misses[cat] = 0
    return rows, {"rows": len(rows), "dropped_eval_overlap": dropped["eval_overlap"],
                  "dropped_duplicate": dropped["duplicate"], "exhausted_categories": exhausted}


def eval_prompts() -> tuple[set[str], str | None]:
    """Every prompt of the frozen arith-cot suite and its sha256 (empty, None before it exists)."""
    from lmforge.eval.suites import SuiteError, load_suite

    try:
        suite = load_suite("arith-cot")
    except SuiteError:
        return set(), None
    return {it["prompt"] for it in suite.items}, suite.sha256


def write_synth(task: str, n: int, seed: int, out: str | os.PathLike, overwrite: bool = False) -> dict[str, Any]:
    """Write `out` (JSONL) and `out` + `.record.json` (seed, counts, categories, the disjointness proof)."""
    from lmforge.track.io import atomic_write_json, atomic_write_text, sha256_file
    from lmforge.track.provenance import git_info

    if seed == EVAL_SEED:
        raise ValueError(f"--seed {seed} is arith-cot's eval seed; pick any other seed for training data")
    out = Path(out)
    record_path = out.with_name(out.name + ".record.json")
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass --overwrite or choose another --out")
    exclude, suite_hash = eval_prompts()
    rows, counts = synth_rows(task, n, seed, exclude)
    overlap = sum(r["prompt"] in exclude for r in rows)
    assert overlap == 0  # synth_rows dropped them; this is the proof recorded below
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    record = {"stage": "synth", "task": task, "n": n, "seed": seed, "eval_seed": EVAL_SEED, **counts,
              "categories": dict(Counter(r["category"] for r in rows)),
              "eval_suite": "arith-cot", "eval_suite_sha256": suite_hash, "eval_prompts_checked": len(exclude),
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
