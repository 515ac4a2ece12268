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
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from lmforge.data.hashing import ngram_hashes
from lmforge.data.words import split_words


def ngram_hashes_many(texts: list[str], n: int) -> list[np.ndarray]:
    """uint64 hashes of the word n-grams of each lowercased text (words: `re.findall(r"\\w+")`)."""
    words = split_words([t.lower() for t in texts], r"\w+")
    windows = ngram_hashes(words.hashes(), n)  # every window of the batch; those crossing texts are dropped
    first = np.searchsorted(words.doc, np.arange(len(texts) + 1))
    return [windows[a:max(a, b - n + 1)] for a, b in zip(first[:-1].tolist(), first[1:].tolist())]


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
    """A set of n-gram hashes; `add_many` texts to it, then count each text's `hits_many`."""

    def __init__(self, n: int = 13):
        self.n = n
        self.ngrams: set[int] = set()
        self.too_short = 0
        self._sorted: np.ndarray | None = None  # the set as a sorted array, for vectorized lookups
        self._mask = np.uint64(0)  # with _bitmap, built along with _sorted in hits_many
        self._bitmap = np.zeros(0, dtype=bool)

    def add_many(self, texts: list[str]) -> None:
        for grams in ngram_hashes_many(texts, self.n):
            self.ngrams.update(grams.tolist())
            self.too_short += not len(grams)
        self._sorted = None

    def add(self, text: str) -> None:
        self.add_many([text])

    def hits_many(self, texts: list[str]) -> list[int]:
        """How many of each text's n-grams occur in the index (a binary search of all at once)."""
        if not self.ngrams:
            return [0] * len(texts)
        if self._sorted is None:
            self._sorted = np.sort(np.fromiter(self.ngrams, dtype=np.uint64, count=len(self.ngrams)))
            # a bitmap of the hashes' low bits, ~16 bits per n-gram: most n-grams of a clean
            # text miss it, and only the few that hit are binary-searched
            self._mask = np.uint64((1 << max(16, int(len(self._sorted) * 16).bit_length())) - 1)
            self._bitmap = np.zeros(int(self._mask) + 1, dtype=bool)
            self._bitmap[self._sorted & self._mask] = True
        per_text = ngram_hashes_many(texts, self.n)
        grams = np.concatenate(per_text)
        text = np.repeat(np.arange(len(texts)), [len(g) for g in per_text])
        maybe = np.flatnonzero(self._bitmap[grams & self._mask])
        at = np.minimum(np.searchsorted(self._sorted, grams[maybe]), len(self._sorted) - 1)
        found = maybe[self._sorted[at] == grams[maybe]]
        return np.bincount(text[found], minlength=len(texts)).tolist()
