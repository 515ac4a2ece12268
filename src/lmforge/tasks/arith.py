"""The `arith` and `arith-stability` suites' items: one- and two-step arithmetic word problems with
integer answers, asked as "Question: ...\\nAnswer:" (no reasoning format; scored by a regex).

Six forms in turn (buy more, give away, boxes of, share equally, gain then lose, boxes then give
away), numbers from SplitMix64 with seed 1. Knows nothing about files or models.
"""

from __future__ import annotations

from typing import Any

from lmforge.tasks.reasoning import qa_prompt
from lmforge.tasks.rng import SplitMix64

NAMES = ("Ava", "Ben", "Chloe", "Dan", "Emma", "Finn", "Grace", "Hugo", "Iris", "Jack", "Lena", "Omar")
THINGS = ("apples", "marbles", "pencils", "stickers", "cookies", "books", "coins", "shells")
CONTAINERS = (("box", "boxes"), ("bag", "bags"), ("jar", "jars"), ("crate", "crates"), ("basket", "baskets"))


def arith_items(n: int = 200, seed: int = 1) -> list[dict[str, Any]]:
    rng, items = SplitMix64(seed), []
    for i in range(n):
        name, other, thing = rng.choice(NAMES), rng.choice(NAMES), rng.choice(THINGS)
        while other == name:
            other = rng.choice(NAMES)
        a, b, c = rng.randint(2, 40), rng.randint(2, 30), rng.randint(1, 9)
        box, boxes = rng.choice(CONTAINERS)
        form = i % 6
        if form == 0:
            q, ans = f"{name} has {a} {thing}. {name} buys {b} more. How many {thing} does {name} have now?", a + b
        elif form == 1:
            a = a + b
            q, ans = f"{name} had {a} {thing} and gave {b} to {other}. How many {thing} does {name} have left?", a - b
        elif form == 2:
            a, b = a % 12 + 2, b % 9 + 2
            q, ans = f"A {box} holds {a} {thing}. How many {thing} are in {b} {boxes}?", a * b
        elif form == 3:
            a, b = a % 12 + 2, b % 9 + 2
            q, ans = (f"{name} shares {a * b} {thing} equally among {b} friends. "
                      f"How many {thing} does each friend get?"), a
        elif form == 4:
            q, ans = (f"{name} has {a} {thing}, gets {b} more from {other}, then loses {c}. "
                      f"How many {thing} does {name} have now?"), a + b - c
        else:
            a, b = a % 8 + 2, b % 9 + 2
            c = rng.randint(2, a * b - 1)
            q, ans = (f"{name} buys {a} {boxes} with {b} {thing} in each and gives {c} {thing} to {other}. "
                      f"How many {thing} does {name} keep?"), a * b - c
        items.append({"id": f"arith-{i:04d}", "prompt": qa_prompt(q), "answer": str(ans), "question": q})
    return items
