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

import itertools
import re

import numpy as np

from lmforge.data.config import GopherQualityConfig, GopherRepetitionConfig, QualityConfig
from lmforge.data.hashing import add_word, mix, word_hashes

STOP_WORDS = frozenset({"the", "be", "to", "of", "and", "that", "have", "with"})
_PUNCT = frozenset("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~…“”‘’«»–—·•")
_PARAGRAPHS = re.compile(r"\n\n+")  # == \n{2,}, with a literal prefix sre finds in C


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


_P = "[" + re.escape("".join(sorted(_PUNCT))) + "]"
# (?<!\S)P+(?!\S), spelled P(?<!\S P)P*(?!\S) so sre skips to punctuation in C instead of trying every position
_PUNCT_ONLY = re.compile(_P + r"(?<!\S" + _P + ")" + _P + r"*(?!\S)")
_ALPHA_WORD = re.compile(r"\S*[^\W\d_]\S*")
_STOP = re.compile(r"\b(?:" + "|".join(sorted(STOP_WORDS)) + r")\b", re.IGNORECASE)
_BULLET_LINE = re.compile(r"^[ \t]*[•*-]", re.MULTILINE)
_ELLIPSIS_LINE = re.compile(r"(?:\.\.\.|…)[ \t]*$", re.MULTILINE)


def _alpha_words(text: str, words: list[str]) -> int:
    """Words holding at least one letter. In ASCII text the letters are exactly the cased
    characters, so comparing each word's lower and upper case (C loops) replaces the regex scan."""
    if text.isascii():
        return sum(map(str.__ne__, map(str.lower, words), map(str.upper, words)))
    return len(_ALPHA_WORD.findall(text))


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
    n_ellipses = text.count("...") + text.count("…")
    if n_ellipses / n_words > cfg.max_symbol_word_ratio:
        return "gopher_ellipsis_ratio"
    n_lines = text.count("\n") + 1
    if len(_BULLET_LINE.findall(text)) > cfg.max_bullet_lines_ratio * n_lines:
        return "gopher_bullet_lines"
    if n_ellipses and len(_ELLIPSIS_LINE.findall(text)) > cfg.max_ellipsis_lines_ratio * n_lines:
        return "gopher_ellipsis_lines"
    if _alpha_words(text, words) < cfg.min_alpha_words_ratio * n_words:
        return "gopher_alpha_words"
    if sum(1 for _ in itertools.islice(_STOP.finditer(text), cfg.min_stop_words)) < cfg.min_stop_words:
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


def _top_ngram_chars(h: np.ndarray, csum: np.ndarray, n: int, limit: float) -> int:
    """Characters covered by the most frequent n-gram (" "-joined length x count), 0 if none repeats.

    `h`: the hashes of every n-gram, in position order. Only its comparison with `limit`
    matters, so when even the longest n-gram times the top count stays within it, that bound is
    returned instead of finding which n-gram is the most frequent."""
    if len(h) < 2:
        return 0
    s = np.sort(h)
    starts = np.flatnonzero(np.concatenate(([True], s[1:] != s[:-1])))
    counts = np.diff(np.append(starts, len(s)))
    top = int(counts.max())
    if top < 2:
        return 0
    gram_chars = csum[n:n + len(h)] - csum[:len(h)] + n - 1
    bound = int(gram_chars.max()) * top
    if bound <= limit:
        return bound
    i = int(np.argmax(np.isin(h, s[starts[counts == top]])))  # ties: the earliest, as Counter.most_common
    return int(gram_chars[i]) * top


def _repeats(h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Masks over `h`: values seen at an earlier position; values occurring more than once."""
    order = np.argsort(h, kind="stable")  # stable: the first of equal values is the earliest
    s = h[order]
    same_prev = np.concatenate(([False], s[1:] == s[:-1]))
    same_next = np.concatenate((same_prev[1:], [False]))
    repeat, shared = np.empty(len(h), bool), np.empty(len(h), bool)
    repeat[order], shared[order] = same_prev, same_prev | same_next
    return repeat, shared


def _dup_scan(pos: np.ndarray, h: np.ndarray, gram_chars: np.ndarray, n: int) -> int:
    """The exact Gopher count: scan left to right, skip past each n-gram that repeats an earlier one.

    Only the positions `pos` whose n-gram occurs more than once (hashes `h`, characters
    `gram_chars`) are visited: a unique n-gram never matches, so it only moves the scan on."""
    seen: set[int] = set()
    chars = nxt = 0
    for p, g, c in zip(pos.tolist(), h.tolist(), gram_chars.tolist()):
        if p < nxt:  # inside the skipped span of the last repeat: not added to `seen`
            continue
        if g in seen:
            chars += c
            nxt = p + n
        else:
            seen.add(g)
            nxt = p + 1
    return chars


def _dup_ngram_reason(wh: np.ndarray, csum: np.ndarray, acc: np.ndarray, size: int,
                      fracs: list[float]) -> str | None:
    """Characters inside n-grams repeating an earlier one (non-overlapping scan, as in Gopher), n = 5..10.

    `acc`: unmixed sums of every 5-gram. An n-gram can repeat only where its (n-1)-gram occurs
    twice, so for n > 5 only those positions (`pos`, usually few) are hashed and sorted. The
    exact sequential scan runs only when the vectorized upper bound (all repeated occurrences,
    overlaps included) exceeds the limit, which is rare.
    """
    pos = np.arange(len(acc))
    for n, frac in zip(range(5, 11), fracs):
        if n > 5:
            keep = pos < len(wh) - n + 1
            pos = pos[keep]
            acc = add_word(acc[keep], wh, pos, n - 1)
        if len(pos) == 0:
            return None
        h = mix(acc)
        repeat, shared = _repeats(h)
        gram_chars = csum[pos + n] - csum[pos]
        if int(gram_chars[repeat].sum()) > frac * size and \
                _dup_scan(pos[shared], h[shared], gram_chars[shared], n) > frac * size:
            return f"gopher_dup_{n}gram"
        pos, acc = pos[shared], acc[shared]
    return None


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
    acc = np.zeros(len(wh), dtype=np.uint64)  # unmixed n-gram sums, extended one word per n
    for n, frac in zip((1, 2, 3, 4), [None, *cfg.top_ngram_char_fracs]):
        pos = np.arange(max(len(wh) - n + 1, 0))
        acc = add_word(acc[:len(pos)], wh, pos, n - 1)
        if frac is not None and _top_ngram_chars(mix(acc), csum, n, frac * size) > frac * size:
            return f"gopher_top_{n}gram"
    acc = add_word(acc[:max(len(wh) - 4, 0)], wh, np.arange(max(len(wh) - 4, 0)), 4)
    return _dup_ngram_reason(wh, csum, acc, size, cfg.dup_ngram_char_fracs)


def quality_reason(text: str, cfg: QualityConfig) -> str | None:
    """The first failed rule (length, then Gopher quality, then Gopher repetition), or None."""
    reason = length_reason(text, cfg)
    words = text.split()
    if reason is None and cfg.gopher_quality.enabled:
        reason = gopher_quality_reason(text, cfg.gopher_quality, words)
    if reason is None and cfg.gopher_repetition.enabled:
        reason = gopher_repetition_reason(text, cfg.gopher_repetition, words)
    return reason
