"""SplitMix64, the one random generator of every seeded task and built-in suite.

Ours, not `random`: Steele et al.'s SplitMix64 is tiny, well mixed and gives the same numbers on
every platform and Python version, so the same seed writes the same bytes everywhere (the frozen
eval suites and `lmforge data synth` depend on it). Knows nothing about tasks.
"""

from __future__ import annotations

from typing import Any

MASK64 = 2**64 - 1


class SplitMix64:
    """Steele et al.'s SplitMix64: tiny, well mixed, and identical on every platform."""

    def __init__(self, seed: int):
        self.state = seed & MASK64

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
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
