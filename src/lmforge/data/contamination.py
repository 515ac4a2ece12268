"""Contamination check: word 13-gram overlap between train and val/test/eval sets.

Text is lowercased and reduced to its word characters (`\\w+`), as in the GPT-3 paper's
contamination study (Brown et al. 2020, appendix C). Every 13-gram of every val/test document
and of every eval item's string fields (`text`, `prompt`, `question`, `answer`, `target`, each
string of `choices`; configurable) goes into an in-memory set of 64-bit hashes; a train
document sharing any 13-gram with it is dropped as `contamination`. Eval strings shorter than
13 words cannot be checked and are counted (`eval_strings_too_short`), never silently ignored.
It knows nothing about the other steps.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from lmforge.data.hashing import ngram_hashes, word_hashes

_WORD = re.compile(r"\w+")


def _ngram_hashes(text: str, n: int) -> np.ndarray:
    return ngram_hashes(word_hashes(_WORD.findall(text.lower())), n)


def eval_strings(path: str | Path, fields: Iterable[str]) -> Iterator[str]:
    """The string fields of each JSONL eval item; a bad line stops with file and line number."""
    fields = list(fields)
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: malformed JSON in eval set ({e.msg}); fix the line") from None
            if not isinstance(item, dict):
                raise ValueError(f"{path}:{lineno}: eval item must be a JSON object")
            for name in fields:
                value = item.get(name)
                values = value if isinstance(value, list) else [value]
                yield from (v for v in values if isinstance(v, str))


class ContaminationIndex:
    def __init__(self, n: int = 13):
        self.n = n
        self.ngrams: set[int] = set()
        self.too_short = 0
        self._sorted: np.ndarray | None = None  # the set as a sorted array, for vectorized lookups

    def add(self, text: str) -> None:
        grams = _ngram_hashes(text, self.n)
        self.ngrams.update(grams.tolist())
        self.too_short += not len(grams)
        self._sorted = None

    def hits(self, text: str) -> int:
        """How many of the text's 13-grams occur in the index (binary search of every one at once)."""
        if not self.ngrams:
            return 0
        if self._sorted is None:
            self._sorted = np.sort(np.fromiter(self.ngrams, dtype=np.uint64, count=len(self.ngrams)))
        grams = _ngram_hashes(text, self.n)
        at = np.minimum(np.searchsorted(self._sorted, grams), len(self._sorted) - 1)
        return int(np.count_nonzero(self._sorted[at] == grams))
