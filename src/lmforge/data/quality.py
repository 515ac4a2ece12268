"""Quality filters: length bounds, over-long documents, Gopher quality and repetition rules.

Gopher rules follow Rae et al. 2021 ("Scaling Language Models: Methods, Analysis & Insights
from Training Gopher", appendix A.1.1) as implemented in datatrove's `GopherQualityFilter` and
`GopherRepetitionFilter`, with the paper's thresholds as defaults (see `config.py`). Each
function returns the name of the first failed rule (the rejection reason) or None.
Over-long documents are split at paragraph, then line, then character boundaries into parts of
at most `max_chars`, or dropped (`quality.long_docs`). Pure functions of a string; it knows
nothing about documents, readers or the pipeline.
"""

from __future__ import annotations

import re

import numpy as np

from lmforge.data.config import GopherQualityConfig, GopherRepetitionConfig, QualityConfig
from lmforge.data.hashing import ngram_hashes, word_hashes

STOP_WORDS = frozenset({"the", "be", "to", "of", "and", "that", "have", "with"})
_PUNCT = frozenset("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~…“”‘’«»–—·•")
_PARAGRAPHS = re.compile(r"\n{2,}")


def split_long(text: str, max_chars: int) -> list[str]:
    """Parts of at most `max_chars`, cut at the last paragraph, line or space break that fits."""
    parts = []
    while len(text) > max_chars:
        window = text[:max_chars + 1]
        cut = max(window.rfind("\n\n"), 0) or max(window.rfind("\n"), 0) or max(window.rfind(" "), 0) \
            or max_chars
        parts.append(text[:cut].strip())
        text = text[cut:].strip()
    parts.append(text)
    return [p for p in parts if p]


def length_reason(text: str, cfg: QualityConfig) -> str | None:
    if len(text) < cfg.min_chars:
        return "too_short"
    return None


_PUNCT_ONLY = re.compile("(?<!\\S)[" + re.escape("".join(sorted(_PUNCT))) + "]+(?!\\S)")
_ALPHA_WORD = re.compile(r"\S*[^\W\d_]\S*")
_STOP = re.compile(r"\b(?:" + "|".join(sorted(STOP_WORDS)) + r")\b", re.IGNORECASE)
_BULLET_LINE = re.compile(r"^[ \t]*[•*-]", re.MULTILINE)
_ELLIPSIS_LINE = re.compile(r"(?:\.\.\.|…)[ \t]*$", re.MULTILINE)


def gopher_quality_reason(text: str, cfg: GopherQualityConfig, words: list[str] | None = None) -> str | None:
    words = text.split() if words is None else words
    n_words = len(words)
    if n_words == 0:
        return "gopher_word_count"
    punct_only = _PUNCT_ONLY.findall(text)  # words made only of punctuation do not count as words
    n_content = n_words - len(punct_only)
    if not cfg.min_words <= n_content <= cfg.max_words:
        return "gopher_word_count"
    mean_len = (sum(map(len, words)) - sum(map(len, punct_only))) / max(n_content, 1)
    if not cfg.min_mean_word_length <= mean_len <= cfg.max_mean_word_length:
        return "gopher_mean_word_length"
    if text.count("#") / n_words > cfg.max_symbol_word_ratio:
        return "gopher_hash_ratio"
    if (text.count("...") + text.count("…")) / n_words > cfg.max_symbol_word_ratio:
        return "gopher_ellipsis_ratio"
    n_lines = text.count("\n") + 1
    if len(_BULLET_LINE.findall(text)) > cfg.max_bullet_lines_ratio * n_lines:
        return "gopher_bullet_lines"
    if len(_ELLIPSIS_LINE.findall(text)) > cfg.max_ellipsis_lines_ratio * n_lines:
        return "gopher_ellipsis_lines"
    if len(_ALPHA_WORD.findall(text)) < cfg.min_alpha_words_ratio * n_words:
        return "gopher_alpha_words"
    if len(_STOP.findall(text)) < cfg.min_stop_words:
        return "gopher_stop_words"
    return None


def _duplicates(elements: list[str]) -> tuple[int, int]:
    """(number, characters) of elements that repeat an earlier one."""
    seen: set[str] = set()
    n = chars = 0
    for e in elements:
        if e in seen:
            n, chars = n + 1, chars + len(e)
        else:
            seen.add(e)
    return n, chars


def _top_ngram_chars(wh: np.ndarray, csum: np.ndarray, n: int) -> int:
    """Characters covered by the most frequent n-gram (" "-joined length x count), 0 if none repeats."""
    h = ngram_hashes(wh, n)
    if len(h) == 0:
        return 0
    _, first, counts = np.unique(h, return_index=True, return_counts=True)
    top = counts.max()
    if top < 2:
        return 0
    i = int(first[counts == top].min())  # ties: the earliest n-gram, as Counter.most_common would
    return int(csum[i + n] - csum[i] + n - 1) * int(top)


def _dup_ngram_chars(wh: np.ndarray, csum: np.ndarray, n: int, limit: float) -> int:
    """Characters inside n-grams repeating an earlier one (non-overlapping scan, as in Gopher).

    The exact scan is sequential; it runs only when a vectorized upper bound (all repeated
    occurrences, overlaps included) exceeds `limit`, which is rare.
    """
    h = ngram_hashes(wh, n)
    if len(h) == 0:
        return 0
    _, first = np.unique(h, return_index=True)
    if len(first) == len(h):
        return 0
    repeat = np.ones(len(h), dtype=bool)
    repeat[first] = False
    gram_chars = csum[n:n + len(h)] - csum[:len(h)]
    if int(gram_chars[repeat].sum()) <= limit:
        return int(gram_chars[repeat].sum())
    seen: set[int] = set()
    chars, i, grams = 0, 0, h.tolist()
    while i < len(grams):
        if grams[i] in seen:
            chars += int(gram_chars[i])
            i += n
        else:
            seen.add(grams[i])
            i += 1
    return chars


def gopher_repetition_reason(text: str, cfg: GopherRepetitionConfig, words: list[str] | None = None) -> str | None:
    size = max(len(text), 1)
    paragraphs = [p for p in _PARAGRAPHS.split(text) if p.strip()]
    n, chars = _duplicates(paragraphs)
    if n > cfg.dup_para_frac * len(paragraphs):
        return "gopher_dup_paragraph_frac"
    if chars > cfg.dup_para_char_frac * size:
        return "gopher_dup_paragraph_chars"
    lines = [line for line in text.split("\n") if line.strip()]
    n, chars = _duplicates(lines)
    if n > cfg.dup_line_frac * len(lines):
        return "gopher_dup_line_frac"
    if chars > cfg.dup_line_char_frac * size:
        return "gopher_dup_line_chars"
    words = text.split() if words is None else words
    wh = word_hashes(words)
    csum = np.concatenate([[0], np.cumsum(np.fromiter(map(len, words), dtype=np.int64, count=len(words)))])
    for n, frac in zip((2, 3, 4), cfg.top_ngram_char_fracs):
        if _top_ngram_chars(wh, csum, n) > frac * size:
            return f"gopher_top_{n}gram"
    for n, frac in zip(range(5, 11), cfg.dup_ngram_char_fracs):
        if _dup_ngram_chars(wh, csum, n, frac * size) > frac * size:
            return f"gopher_dup_{n}gram"
    return None


def quality_reason(text: str, cfg: QualityConfig) -> str | None:
    """The first failed rule (length, then Gopher quality, then Gopher repetition), or None."""
    reason = length_reason(text, cfg)
    words = text.split()
    if reason is None and cfg.gopher_quality.enabled:
        reason = gopher_quality_reason(text, cfg.gopher_quality, words)
    if reason is None and cfg.gopher_repetition.enabled:
        reason = gopher_repetition_reason(text, cfg.gopher_repetition, words)
    return reason
