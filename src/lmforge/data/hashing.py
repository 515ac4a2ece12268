"""Deterministic, vectorized hashes of words and word n-grams (for MinHash, repetition, contamination).

Each word is hashed once with CRC-32 (C speed, identical in every process, unlike `hash()`),
then every n-gram's 64-bit hash is a polynomial combination of its word hashes computed for
all positions at once with numpy (wrapping uint64 arithmetic). Collisions are ~2^-64 per pair.
It knows nothing about documents or steps.
"""

from __future__ import annotations

import zlib

import numpy as np

_MULTS = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x27D4EB2F165667C5,
                   0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0x94D049BB133111EB, 0xBF58476D1CE4E5B9,
                   0x85EBCA77C2B2AE63, 0xD6E8FEB86659FD93, 0xA0761D6478BD642F, 0xE7037ED1A0B428DB,
                   0x8EBC6AF09C88C6E3, 0x589965CC75374CC3, 0x1D8E4E27C47D124F, 0xB492B66FBE98F273],
                  dtype=np.uint64)


def word_hashes(words: list[str]) -> np.ndarray:
    """uint64 CRC-32 of each word's UTF-8 bytes (`map`, not a generator: no bytecode per word)."""
    return np.fromiter(map(zlib.crc32, map(str.encode, words)), dtype=np.uint64, count=len(words))


def ngram_hashes(hashes: np.ndarray, n: int) -> np.ndarray:
    """uint64 hash of each window of `n` consecutive word hashes (len(hashes) - n + 1 values)."""
    m = len(hashes) - n + 1
    if m <= 0:
        return np.zeros(0, dtype=np.uint64)
    # sum of (h[i + k] + k + 1) * M_k, as sum of h[i + k] * M_k plus the constant sum of (k + 1) * M_k
    # (the same values mod 2^64), in one reused temporary: a pass fewer and no allocation per k
    const = sum((k + 1) * int(_MULTS[k % len(_MULTS)]) for k in range(n)) & 0xFFFFFFFFFFFFFFFF
    out = np.full(m, const, dtype=np.uint64)
    tmp = np.empty(m, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in range(n):
            np.multiply(hashes[k:k + m], _MULTS[k % len(_MULTS)], out=tmp)
            out += tmp
        out ^= out >> np.uint64(29)
    return out


def mix(acc: np.ndarray) -> np.ndarray:
    """The final step of `ngram_hashes`, applied to a sum of weighted word hashes."""
    return acc ^ (acc >> np.uint64(29))


def add_word(acc: np.ndarray, hashes: np.ndarray, starts: np.ndarray, k: int) -> np.ndarray:
    """Extend the unmixed sums of the k-grams starting at `starts` by their (k+1)-th word.

    `mix(add_word(...))` for k = 0, 1, ..., n-1 equals `ngram_hashes(hashes, n)[starts]`, so the
    repetition rules get every n from 2 to 10 for one pass each instead of n passes each.
    """
    with np.errstate(over="ignore"):
        return acc + (hashes[starts + k] + np.uint64(k + 1)) * _MULTS[k % len(_MULTS)]
