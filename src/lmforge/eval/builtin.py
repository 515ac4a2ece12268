"""The built-in suites, generated deterministically by code and frozen as files in `suites/`.

    arith            generate    200 one- and two-step arithmetic word problems, integer answers
    arith-stability  stability   the first 40 of them, 5 samples each at temperature 0.8
    choice-basics    choice      120 four-way questions (next day/month, sums, opposites, plurals, ...)
    tiny-text        perplexity  40 short synthetic English paragraphs from a fixed grammar
    arith-cot        generate    320 reasoning problems (40 per category: add/sub 2-3 digits, mul 2x1,
                                 3x1, 2x2, word problems) from `lmforge.data.synth` with its eval seed;
                                 chat template, up to 320 new tokens, scored on the `Answer:` line

Randomness comes from our own SplitMix64 generator, not `random`, and the perplexity text from
a grammar in this file, not `pydoc_data` (whose text changes with the interpreter): the same
code writes the same bytes on every machine and Python version. The files are what count,
though: they are frozen (suites.lock.json) and only regenerated on a version bump:

    lmforge eval make-suite builtins            # rewrites suites/*.jsonl and suites.lock.json

This module knows nothing about models or metrics.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmforge.eval.suites import BUILTIN_DIR, Suite, load_suite, write_lock, write_suite

# Bump a suite's version whenever its generator changes; the lock test enforces it.
VERSIONS = {"arith": 1, "arith-stability": 1, "choice-basics": 1, "tiny-text": 1, "arith-cot": 1}
ARITH_COT_PER_CATEGORY = 40


class SplitMix64:
    """Steele et al.'s SplitMix64: tiny, well mixed, and identical on every platform."""

    def __init__(self, seed: int):
        self.state = seed & (2**64 - 1)

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & (2**64 - 1)
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
        return z ^ (z >> 31)

    def randint(self, lo: int, hi: int) -> int:
        """Uniform in [lo, hi] (modulo bias is negligible for our small ranges)."""
        return lo + self.next() % (hi - lo + 1)

    def choice(self, seq: list | tuple) -> Any:
        return seq[self.next() % len(seq)]

    def shuffle(self, seq: list) -> list:
        for i in range(len(seq) - 1, 0, -1):  # Fisher-Yates
            j = self.next() % (i + 1)
            seq[i], seq[j] = seq[j], seq[i]
        return seq


NAMES = ("Ava", "Ben", "Chloe", "Dan", "Emma", "Finn", "Grace", "Hugo", "Iris", "Jack", "Lena", "Omar")
THINGS = ("apples", "marbles", "pencils", "stickers", "cookies", "books", "coins", "shells")
CONTAINERS = (("box", "boxes"), ("bag", "bags"), ("jar", "jars"), ("crate", "crates"), ("basket", "baskets"))


def _qa(question: str) -> str:
    return f"Question: {question}\nAnswer:"


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
        items.append({"id": f"arith-{i:04d}", "prompt": _qa(q), "answer": str(ans), "question": q})
    return items


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
        items.append({"id": f"choice-{i:04d}", "prompt": _qa(q), "choices": choices, "answer": answer})
    return items


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


def arith_cot_items() -> list[dict[str, Any]]:
    """40 items per category of `synth.TASKS['mix']`, drawn with the eval seed (training seeds differ)."""
    from lmforge.data.synth import EVAL_SEED, TASKS, synth_rows

    cats = TASKS["mix"]
    rows, _ = synth_rows("mix", ARITH_COT_PER_CATEGORY * len(cats), EVAL_SEED)
    return [{"id": f"arith-cot-{i:04d}", "prompt": r["prompt"], "answer": r["answer"], "category": r["category"],
             "difficulty": r["difficulty"]} for i, r in enumerate(rows)]


def builtin_suites() -> dict[str, tuple[dict[str, Any], list[dict[str, Any]]]]:
    """name -> (header, items) for every built-in suite."""
    arith = arith_items()
    qa_regex = r"-?\d+"
    return {
        "arith": ({"suite": "arith", "version": VERSIONS["arith"], "kind": "generate", "metric": "regex",
                   "description": "one- and two-step arithmetic word problems; the last integer in the "
                                  "first line of the greedy output must equal the answer",
                   "max_tokens": 24, "stop": ["\n"], "answer_regex": qa_regex}, arith),
        "arith-stability": ({"suite": "arith-stability", "version": VERSIONS["arith-stability"],
                             "kind": "stability", "metric": "regex",
                             "description": "the first 40 arith problems, sampled 5 times at temperature 0.8",
                             "max_tokens": 24, "stop": ["\n"], "answer_regex": qa_regex, "samples": 5,
                             "temperature": 0.8, "seed": 0},
                            [{**it, "id": it["id"].replace("arith", "arith-stab")} for it in arith[:40]]),
        "choice-basics": ({"suite": "choice-basics", "version": VERSIONS["choice-basics"], "kind": "choice",
                           "metric": "acc", "description": "four-way everyday questions scored by the "
                           "log-likelihood of ' ' + choice (acc) and of it per character (acc_norm)",
                           "target_delimiter": " "}, choice_items()),
        "tiny-text": ({"suite": "tiny-text", "version": VERSIONS["tiny-text"], "kind": "perplexity",
                       "metric": "bits_per_byte", "description": "synthetic English paragraphs from a fixed "
                       "grammar (interpreter-independent); a smoke test, not a benchmark"}, tiny_text_items()),
        "arith-cot": ({"suite": "arith-cot", "version": VERSIONS["arith-cot"], "kind": "generate", "metric": "answer",
                       "description": "arithmetic with written-out steps (8 categories x 40); greedy, chat "
                       "template, the one 'Answer:' line after </think> must equal the answer",
                       "max_tokens": 320, "stop": [], "chat": True}, arith_cot_items()),
    }


def write_builtin_suites(directory: Path = BUILTIN_DIR) -> list[Suite]:
    """(Re)write every built-in suite file and the lock."""
    directory.mkdir(parents=True, exist_ok=True)
    suites = []
    for name, (header, items) in builtin_suites().items():
        suites.append(load_suite(write_suite(directory / f"{name}.jsonl", header, items)))
    write_lock(directory, suites)
    return suites
