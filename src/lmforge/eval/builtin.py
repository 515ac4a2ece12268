"""The built-in suites: each one's header (kind, metric, settings) over items from a seeded
generator in `lmforge.tasks`, frozen as files in `lmforge/tasks/suites/`.

    arith            generate    200 one- and two-step arithmetic word problems, integer answers
    arith-stability  stability   the first 40 of them, 5 samples each at temperature 0.8
    choice-basics    choice      120 four-way questions (next day/month, sums, opposites, plurals, ...)
    tiny-text        perplexity  40 short synthetic English paragraphs from a fixed grammar
    arith-cot        generate    320 reasoning problems (40 per category: add/sub 2-3 digits, mul 2x1,
                                 3x1, 2x2, word problems) from `lmforge.tasks.arith_cot` with its eval
                                 seed; chat template, up to 320 new tokens, scored on the `Answer:` line
    arith-cot-2d     generate    600 more of its three 2-digit categories (200 each: add-2d, sub-2d,
                                 mul-2x1), disjoint from arith-cot, with a seed of its own; same scoring

Randomness comes from our own SplitMix64 generator (`lmforge.tasks.rng`), not `random`, and the
perplexity text from a fixed grammar, not `pydoc_data` (whose text changes with the interpreter):
the same code writes the same bytes on every machine and Python version. The files are what count,
though: they are frozen (suites.lock.json) and only regenerated on a version bump:

    lmforge eval make-suite builtins            # rewrites suites/*.jsonl and suites.lock.json

This module knows nothing about models or metrics.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmforge.eval.suites import write_lock, write_suite
from lmforge.tasks import arith_cot
from lmforge.tasks.arith import arith_items
from lmforge.tasks.choice import choice_items
from lmforge.tasks.suite import BUILTIN_DIR, Suite, load_suite
from lmforge.tasks.tiny_text import tiny_text_items

# Bump a suite's version whenever its generator changes; the lock test enforces it.
VERSIONS = {"arith": 1, "arith-stability": 1, "choice-basics": 1, "tiny-text": 1, "arith-cot": 1, "arith-cot-2d": 1}


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
                       "max_tokens": 320, "stop": [], "chat": True}, arith_cot.suite_items()),
        "arith-cot-2d": ({"suite": "arith-cot-2d", "version": VERSIONS["arith-cot-2d"], "kind": "generate",
                          "metric": "answer", "description": "arithmetic with written-out steps on the three "
                          "2-digit categories (add-2d, sub-2d, mul-2x1; 200 each, none an arith-cot prompt); greedy, "
                          "chat template, the one 'Answer:' line after </think> must equal the answer",
                          "max_tokens": 320, "stop": [], "chat": True}, arith_cot.suite_2d_items()),
    }


def write_builtin_suites(directory: Path = BUILTIN_DIR) -> list[Suite]:
    """(Re)write every built-in suite file and the lock."""
    directory.mkdir(parents=True, exist_ok=True)
    suites = []
    for name, (header, items) in builtin_suites().items():
        suites.append(load_suite(write_suite(directory / f"{name}.jsonl", header, items)))
    write_lock(directory, suites)
    return suites
