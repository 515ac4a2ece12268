"""Arithmetic with written-out steps: the seeded generator behind `lmforge data synth` and the
frozen `arith-cot` eval suite.

`synth_rows(task, n, seed)` makes rows

    {"prompt": "What is 347 + 85?", "answer": "432", "reasoning": "7+5+0=12 -> 2\\n...",
     "category": "add-3d", "difficulty": 3, "text": "..."}

where `reasoning` is what a person writes on paper: column addition right to left with the carry
("4+8+1=13 -> 32": the digits, the carry in, the column sum, the result so far), column
subtraction with borrows, multiplication digit by digit with carries and, for a 2-digit
multiplier, two partial products added in columns; word problems (quantities, containers, "how
many are left") chain those blocks, one per operation. Every block ends with its equation
("347+85=432"). `text` is the prompt and the rendered assistant turn (`reasoning.DEFAULT_FORMAT`),
for tokenizer training.

Tasks: add, sub, mul, word, and mix (all categories uniformly). The eval suite `arith-cot`
(`suite_items`) is drawn from the same categories with `EVAL_SEED`, and `arith-cot-2d`
(`suite_2d_items`, 200 items on each 2-digit category) with `EVAL_SEED_2D`; training seeds must
differ, and `synth_rows` drops any row whose prompt is in `exclude` (`lmforge.data.synth` passes
every prompt of both suites), so no eval prompt can reach a training file.

Randomness is SplitMix64 (`rng.py`): the same seed gives the same bytes everywhere. This module
knows nothing about files, tokenizers or models.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from lmforge.tasks.arith import NAMES, THINGS
from lmforge.tasks.reasoning import DEFAULT_FORMAT
from lmforge.tasks.rng import SplitMix64

EVAL_SEED = 1_000_003  # arith-cot's seed; training seeds must differ
EVAL_SEED_2D = 1_000_033  # arith-cot-2d's seed; training seeds must differ from it too
EVAL_SEEDS = (EVAL_SEED, EVAL_SEED_2D)
CONTAINERS = (("box", "boxes"), ("bag", "bags"), ("jar", "jars"), ("crate", "crates"))  # not arith's: no baskets


def _num(rng: SplitMix64, digits: int) -> int:
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
    def make(rng: SplitMix64) -> tuple[str, list[str], int, int]:
        a, b = _num(rng, da), _num(rng, db)
        if op == "-" and a < b:
            a, b = b, a
        steps, ans = _steps(op, a, b)
        return f"What is {a} {op} {b}?", steps, ans, max(da, db) + (db if op == "*" else 0)
    return make


def _word(rng: SplitMix64) -> tuple[str, list[str], int, int]:
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


def make_row(category: str, rng: SplitMix64) -> dict[str, Any]:
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
    rng, rows, seen, dropped = SplitMix64(seed), [], set(), Counter()
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


SUITE_PER_CATEGORY = 40  # arith-cot: 40 items per category of TASKS["mix"]


def suite_items() -> list[dict[str, Any]]:
    """The arith-cot items: 40 per category of `TASKS['mix']`, drawn with the eval seed (training seeds differ)."""
    cats = TASKS["mix"]
    rows, _ = synth_rows("mix", SUITE_PER_CATEGORY * len(cats), EVAL_SEED)
    return [{"id": f"arith-cot-{i:04d}", "prompt": r["prompt"], "answer": r["answer"], "category": r["category"],
             "difficulty": r["difficulty"]} for i, r in enumerate(rows)]


# arith-cot-2d: the three categories with 2-digit operands, 200 items each. arith-cot's 40 per category
# give a gain made in a few categories a standard error as large as the gain; 200 each measure such
# a gain (a GRPO run on these categories) at about twice the precision. Drawn with its own seed and
# disjoint from arith-cot; training files exclude both.
CATEGORIES_2D = ("add-2d", "sub-2d", "mul-2x1")
SUITE_2D_PER_CATEGORY = 200


def suite_2d_items() -> list[dict[str, Any]]:
    """The arith-cot-2d items: 200 per category of `CATEGORIES_2D`, none of them an arith-cot prompt."""
    taken = {it["prompt"] for it in suite_items()}
    rows, _ = synth_rows("mix", SUITE_2D_PER_CATEGORY * len(CATEGORIES_2D), EVAL_SEED_2D, exclude=taken,
                         categories=CATEGORIES_2D)
    return [{"id": f"arith-cot-2d-{i:04d}", "prompt": r["prompt"], "answer": r["answer"], "category": r["category"],
             "difficulty": r["difficulty"]} for i, r in enumerate(rows)]
