"""The `choice-basics` suite's items: four-way everyday questions (next day or month, sums, opposites,
plurals, animal sounds), scored by the log-likelihood of each choice.

Each item is {id, prompt, choices, answer: index}; the three wrong choices come from a pool of
plausible ones, shuffled with SplitMix64 (seed 2). Knows nothing about files or models.
"""

from __future__ import annotations

from typing import Any

from lmforge.tasks.reasoning import qa_prompt
from lmforge.tasks.rng import SplitMix64

DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December")
OPPOSITES = (("hot", "cold"), ("big", "small"), ("up", "down"), ("early", "late"), ("happy", "sad"),
             ("open", "closed"), ("light", "dark"), ("fast", "slow"), ("full", "empty"), ("old", "young"))
PLURALS = (("mouse", "mice"), ("child", "children"), ("foot", "feet"), ("tooth", "teeth"),
           ("goose", "geese"), ("man", "men"), ("person", "people"), ("leaf", "leaves"))
SOUNDS = (("dog", "bark"), ("cow", "moo"), ("cat", "meow"), ("duck", "quack"), ("sheep", "baa"),
          ("lion", "roar"), ("owl", "hoot"), ("snake", "hiss"))


def _four(rng: SplitMix64, correct: str, pool: list[str]) -> tuple[list[str], int]:
    wrong = [p for p in pool if p != correct]
    rng.shuffle(wrong)
    choices = rng.shuffle([correct, *wrong[:3]])
    return choices, choices.index(correct)


def choice_items(n: int = 120, seed: int = 2) -> list[dict[str, Any]]:
    rng, items = SplitMix64(seed), []
    for i in range(n):
        form = i % 6
        if form == 0:
            d = rng.randint(0, 6)
            q, correct, pool = f"What day comes after {DAYS[d]}?", DAYS[(d + 1) % 7], list(DAYS)
        elif form == 1:
            m = rng.randint(0, 11)
            q, correct, pool = f"What month comes after {MONTHS[m]}?", MONTHS[(m + 1) % 12], list(MONTHS)
        elif form == 2:
            a, b = rng.randint(1, 50), rng.randint(1, 50)
            offsets = [-10, -2, -1, 1, 2, 10]
            q, correct = f"What is {a} plus {b}?", str(a + b)
            pool = [str(a + b + o) for o in offsets if a + b + o >= 0]
        elif form == 3:
            w, opp = rng.choice(OPPOSITES)
            q, correct, pool = f"What is the opposite of {w}?", opp, [o for _, o in OPPOSITES] + [w for w, _ in OPPOSITES]
        elif form == 4:
            w, pl = rng.choice(PLURALS)
            q, correct = f"What is the plural of {w}?", pl
            pool = [w + "s", w + "es", pl + "s", w]
        else:
            animal, sound = rng.choice(SOUNDS)
            q, correct, pool = f"What sound does a {animal} make?", sound, [s for _, s in SOUNDS]
        choices, answer = _four(rng, correct, pool)
        items.append({"id": f"choice-{i:04d}", "prompt": qa_prompt(q), "choices": choices, "answer": answer})
    return items
