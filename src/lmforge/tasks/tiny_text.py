"""The `tiny-text` suite's items: short English paragraphs from a fixed grammar, for perplexity.

A grammar in this file, not `pydoc_data` (whose text changes with the interpreter): the same code
writes the same bytes on every machine and Python version. A smoke test, not a benchmark. Knows
nothing about files or models.
"""

from __future__ import annotations

from typing import Any

from lmforge.tasks.rng import SplitMix64

ADJECTIVES = ("small", "quiet", "bright", "old", "careful", "curious", "green", "tired", "busy", "gentle")
NOUNS = ("cat", "teacher", "river", "farmer", "robot", "garden", "child", "train", "bird", "baker")
VERBS = ("watches", "follows", "paints", "finds", "visits", "cleans", "hears", "helps", "builds", "carries")
PLACES = ("the old bridge", "the market", "the station", "the hill", "the library", "the harbor")
TIMES = ("In the morning", "Every evening", "On Sunday", "After the rain", "Before lunch", "At night")
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


def _sentence(rng: SplitMix64) -> str:
    form = rng.randint(0, 3)
    if form == 0:
        return (f"The {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)} {rng.choice(VERBS)} "
                f"the {rng.choice(NOUNS)} near {rng.choice(PLACES)}.")
    if form == 1:
        return f"{rng.choice(TIMES)}, a {rng.choice(NOUNS)} {rng.choice(VERBS)} a {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}."
    if form == 2:
        a, b = rng.randint(0, 5), rng.randint(0, 5)
        return f"{NUMBER_WORDS[a].capitalize()} plus {NUMBER_WORDS[b]} is {NUMBER_WORDS[a + b]}."
    return f"Nobody {rng.choice(VERBS)} {rng.choice(PLACES)} as often as the {rng.choice(NOUNS)} does."


def tiny_text_items(n: int = 40, seed: int = 3) -> list[dict[str, Any]]:
    rng = SplitMix64(seed)
    return [{"id": f"tiny-{i:04d}", "text": " ".join(_sentence(rng) for _ in range(rng.randint(3, 6)))}
            for i in range(n)]
