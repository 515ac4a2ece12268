"""Words of a batch of texts as numpy arrays: spans, character classes and hashes.

The quality rules and the contamination check look at every word of every document. Done per
word in Python that is ~0.1 us per word and per operation, and per document in numpy ~2 us per
call; here a whole batch of documents is one array of code points (latin-1 bytes when every
character fits, else UTF-32) and each step is one numpy call over all of it, touching each
character as few times as possible (one class lookup, one sum per word). Two tokenizations, each
equal to its Python spelling (tested):

    split_words(texts)            the words of `text.split()`   (separators: `str.isspace`)
    split_words(texts, r"\\w+")    the words of `re.findall(r"\\w+", text)`

`Words.classes()` ORs each word's character classes (letter, not punctuation) and
`Words.hashes()` gives each word a 64-bit polynomial hash of its code points (sum of c_i * P^i
mod 2^64). Only the equality of these hashes is used (repetition and contamination n-grams),
never their values; MinHash keeps its CRC-32 word hashes (dedup.py), whose values decide
signatures. It knows nothing about documents or rules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

PUNCTUATION = frozenset("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~…“”‘’«»–—·•")  # Gopher's "symbol" words
SPACE, LETTER, NOT_PUNCT, WORD_CHAR, DIGIT = 1, 2, 4, 8, 16  # bits of a character's class
_P = 0x100000001B3  # the FNV-64 prime: odd, so invertible mod 2^64
_P_INV = pow(_P, -1, 1 << 64)
_TABLE_SIZE = 0x3002  # every whitespace character (the last is U+3000) and punctuation mark is below it
_LETTER = re.compile(r"[^\W\d_]")  # a "letter" as in Gopher's alphabetic-word rule
_WORD = re.compile(r"\w")
_DIGIT = re.compile(r"\d")  # Unicode decimal digits, as `\d` in a str pattern


def _class(c: str) -> int:
    return (SPACE * c.isspace() | LETTER * bool(_LETTER.match(c)) |
            NOT_PUNCT * (not c.isspace() and c not in PUNCTUATION) | WORD_CHAR * bool(_WORD.match(c)) |
            DIGIT * bool(_DIGIT.match(c)))


_table: np.ndarray | None = None  # class of every code point below _TABLE_SIZE, built on first use
_high: dict[int, int] = {}  # classes of code points above it, as met


def char_classes(cp: np.ndarray) -> np.ndarray:
    """(C,) uint8 class bits of each code point."""
    global _table
    if _table is None:  # each regex once over all the characters: ~10x faster than _class per character
        chars = "".join(map(chr, range(_TABLE_SIZE)))
        _table = np.array([SPACE * c.isspace() | NOT_PUNCT * (not c.isspace() and c not in PUNCTUATION)
                           for c in chars], dtype=np.uint8)
        for pattern, bit in ((_LETTER, LETTER), (_WORD, WORD_CHAR), (_DIGIT, DIGIT)):
            _table[[m.start() for m in pattern.finditer(chars)]] |= bit
    if cp.dtype == np.uint8:  # a C-level byte translation: ~4x faster than a numpy take
        return np.frombuffer(cp.tobytes().translate(_table[:256].tobytes()), dtype=np.uint8)
    out = _table.take(np.minimum(cp, _TABLE_SIZE - 1))
    high = cp >= _TABLE_SIZE - 1
    if high.any():
        values = np.unique(cp[high])
        for c in values.tolist():
            if c not in _high:
                _high[c] = _class(chr(c))
        out[high] = np.array([_high[c] for c in values.tolist()], dtype=np.uint8)[np.searchsorted(values, cp[high])]
    return out


def code_points(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The texts joined by "\\n" (plus a final "\\n") as code points, uint8 when every one is
    below 256, else uint32; and the offset of each text in it (len(texts) + 1 values)."""
    lengths = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
    offsets = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(lengths + 1, out=offsets[1:])
    joined = "\n".join(texts) + "\n"
    try:
        return np.frombuffer(joined.encode("latin-1"), dtype=np.uint8), offsets
    except UnicodeEncodeError:
        return np.frombuffer(joined.encode("utf-32-le", "surrogatepass"), dtype=np.uint32), offsets


_powers = np.ones(1, dtype=np.uint64), np.ones(1, dtype=np.uint64)


def _power_tables(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(P^i, P^-i) mod 2^64 for i < n (at least), grown by doubling and kept."""
    global _powers
    if len(_powers[0]) < n:
        size = max(n, 2 * len(_powers[0]))
        tables = []
        for base in (_P, _P_INV):
            t = np.full(size, base, dtype=np.uint64)
            t[0] = 1
            tables.append(np.multiply.accumulate(t))  # wraps mod 2^64
        _powers = tables[0], tables[1]
    return _powers


@dataclass
class Words:
    """Words of `n_texts` texts: `starts`/`ends` index `cp`; `doc` (ascending) is each word's text."""

    cp: np.ndarray  # (C,) code points of the joined texts, uint8 or uint32
    cls: np.ndarray  # (C,) uint8 class bits
    starts: np.ndarray  # (W,) int64
    ends: np.ndarray  # (W,) int64
    doc: np.ndarray  # (W,) int64
    n_texts: int

    @property
    def lengths(self) -> np.ndarray:
        return self.ends - self.starts

    def per_text(self, values: np.ndarray | None = None) -> np.ndarray:
        """Sum of `values` (default 1) over each text's words, int64 (n_texts,)."""
        return np.bincount(self.doc, weights=values, minlength=self.n_texts).astype(np.int64)

    def classes(self) -> np.ndarray:
        """(W,) OR of the class bits of each word's characters (SPACE set or not: ignore it)."""
        if not len(self.starts):
            return np.zeros(0, dtype=np.uint8)
        return np.bitwise_or.reduceat(self.cls, self.starts)  # each run ends at the next word: spaces only

    def hashes(self) -> np.ndarray:
        """(W,) uint64 hash of each word's code points; equal words have equal hashes."""
        pw, inv = _power_tables(len(self.cp))
        prefix = np.zeros(len(self.cp) + 1, dtype=np.uint64)
        np.cumsum(self.cp * pw[:len(self.cp)], out=prefix[1:])  # wraps mod 2^64
        return (prefix[self.ends] - prefix[self.starts]) * inv[self.starts]

    def select(self, keep_texts: np.ndarray) -> Words:
        """The words of the texts where `keep_texts` (n_texts,) is true, renumbered 0, 1, ..."""
        new_index = np.cumsum(keep_texts) - 1
        mask = keep_texts[self.doc]
        return Words(self.cp, self.cls, self.starts[mask], self.ends[mask], new_index[self.doc[mask]],
                     int(np.count_nonzero(keep_texts)))


def split_words(texts: list[str], pattern: str = "split") -> Words:
    """Words of each text: `text.split()` ("split") or `re.findall(r"\\w+", text)` (r"\\w+")."""
    cp, offsets = code_points(texts)
    cls = char_classes(cp)
    if pattern == "split":
        inside = (cls & SPACE) == 0
    elif pattern == r"\w+":
        inside = (cls & WORD_CHAR) != 0
    else:
        raise ValueError(f"split_words: pattern must be 'split' or r'\\w+', not {pattern!r}")
    edges = np.diff(inside.view(np.int8), prepend=np.int8(0))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)  # the final "\n" ends the last word
    first = np.searchsorted(starts, offsets)  # (T + 1,) the "\n" between texts ends every word
    doc = np.repeat(np.arange(len(texts)), np.diff(first))
    return Words(cp, cls, starts, ends, doc, len(texts))
