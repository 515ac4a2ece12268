"""Quality filters: length bounds, over-long documents, Gopher quality and repetition rules.

Gopher rules follow Rae et al. 2021 ("Scaling Language Models: Methods, Analysis & Insights
from Training Gopher", appendix A.1.1) as implemented in datatrove's `GopherQualityFilter` and
`GopherRepetitionFilter`, with the paper's thresholds as defaults (see `config.py`). Each
function returns the name of the first failed rule (the rejection reason) or None.
Over-long documents are split at paragraph, then line, then character boundaries into parts of
at most `max_chars`, or dropped (`quality.long_docs`). Pure functions of strings; it knows
nothing about documents, readers or the pipeline.

`quality_reasons(texts)` is the fast path: the per-word work of a whole batch of texts is a few
numpy calls over one array (`words.py`), the per-text rest is a handful of C-level string
counts. tests/test_data_prepare.py checks the
word counts, the repetition rules and the whole quality decision against plain reference code.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator

import numpy as np

from lmforge.data.config import GopherQualityConfig, GopherRepetitionConfig, QualityConfig
from lmforge.data.hashing import add_word, mix
from lmforge.data.words import LETTER, NOT_PUNCT, Words, split_words

STOP_WORDS = frozenset({"the", "be", "to", "of", "and", "that", "have", "with"})
_PARAGRAPHS = re.compile(r"\n\n+")  # == \n{2,}, with a literal prefix sre finds in C
_STOP = re.compile(r"\b(?:" + "|".join(sorted(STOP_WORDS)) + r")\b", re.IGNORECASE)
_BULLET_LINE = re.compile(r"^[ \t]*[•*-]", re.MULTILINE)
_ELLIPSIS_LINE = re.compile(r"(?:\.\.\.|…)[ \t]*$", re.MULTILINE)
_BATCH_CHARS = 1 << 20  # code points per numpy batch: ~40 MB of temporaries at most


def _text_salts(text: np.ndarray) -> np.ndarray:
    """(W,) uint64 salt of each word's text index: splitmix64 of index + 1. It must not be linear in
    the index: with salt = (index + 1) * M0 (M0 = the first word's weight in `hashing`), an n-gram
    starting with a word of hash h in text t equalled one starting with hash h - 1 in text t + 1
    ("1 apple" / "0 apple": single-character words hash to their code point), so a document's
    repetition counts, and whether it was dropped, depended on its neighbours in the batch."""
    with np.errstate(over="ignore"):
        z = (text.astype(np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


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


def gopher_quality_reasons(texts: list[str], cfg: GopherQualityConfig, words: Words | None = None) -> list[str | None]:
    """The Gopher quality rules of each text. Words are `text.split()`; a word made only of
    punctuation (`words.PUNCTUATION`) does not count for the word count and mean length; a word
    "contains a letter" when one of its characters matches `[^\\W\\d_]`."""
    words = split_words(texts) if words is None else words
    lengths, classes = words.lengths, words.classes()
    punct = (classes & NOT_PUNCT) == 0
    n_words, n_punct = words.per_text().tolist(), words.per_text(punct).tolist()
    chars, punct_chars = words.per_text(lengths).tolist(), words.per_text(np.where(punct, lengths, 0)).tolist()
    n_alpha = words.per_text((classes & LETTER) != 0).tolist()
    return [_quality_reason(t, cfg, *counts) for t, *counts in zip(texts, n_words, n_punct, chars, punct_chars, n_alpha)]


def _quality_reason(text: str, cfg: GopherQualityConfig, n_words: int, n_punct: int, chars: int,
                    punct_chars: int, n_alpha: int) -> str | None:
    if n_words == 0:
        return "gopher_word_count"
    n_content = n_words - n_punct
    if not cfg.min_words <= n_content <= cfg.max_words:
        return "gopher_word_count"
    mean_len = (chars - punct_chars) / max(n_content, 1)
    if not cfg.min_mean_word_length <= mean_len <= cfg.max_mean_word_length:
        return "gopher_mean_word_length"
    if text.count("#") / n_words > cfg.max_symbol_word_ratio:
        return "gopher_hash_ratio"
    n_ellipses = text.count("...") + text.count("…")
    if n_ellipses / n_words > cfg.max_symbol_word_ratio:
        return "gopher_ellipsis_ratio"
    n_lines = text.count("\n") + 1
    max_bullets = cfg.max_bullet_lines_ratio * n_lines
    # every bullet line holds one of these characters: the regex runs only when there are enough
    if text.count("-") + text.count("*") + text.count("•") > max_bullets and \
            len(_BULLET_LINE.findall(text)) > max_bullets:
        return "gopher_bullet_lines"
    if n_ellipses and len(_ELLIPSIS_LINE.findall(text)) > cfg.max_ellipsis_lines_ratio * n_lines:
        return "gopher_ellipsis_lines"
    if n_alpha < cfg.min_alpha_words_ratio * n_words:
        return "gopher_alpha_words"
    if sum(1 for _ in itertools.islice(_STOP.finditer(text), cfg.min_stop_words)) < cfg.min_stop_words:
        return "gopher_stop_words"
    return None


def _duplicates(elements: list[str]) -> tuple[int, int]:
    """(number, characters) of elements that repeat an earlier one: all but the first of each."""
    distinct = set(elements)
    if len(distinct) == len(elements):
        return 0, 0
    return len(elements) - len(distinct), sum(map(len, elements)) - sum(map(len, distinct))


def _line_paragraph_reason(text: str, cfg: GopherRepetitionConfig) -> str | None:
    size = max(len(text), 1)
    # == filter(str.strip, ...) without a stripped copy of each
    paragraphs = list(itertools.filterfalse(str.isspace, filter(None, _PARAGRAPHS.split(text))))
    n, chars = _duplicates(paragraphs)
    if n > cfg.dup_para_frac * len(paragraphs):
        return "gopher_dup_paragraph_frac"
    if chars > cfg.dup_para_char_frac * size:
        return "gopher_dup_paragraph_chars"
    lines = list(itertools.filterfalse(str.isspace, filter(None, text.split("\n"))))
    n, chars = _duplicates(lines)
    if n > cfg.dup_line_frac * len(lines):
        return "gopher_dup_line_frac"
    if chars > cfg.dup_line_char_frac * size:
        return "gopher_dup_line_chars"
    return None


def _per_text_max(values: np.ndarray, text: np.ndarray, n_texts: int) -> np.ndarray:
    """Max of non-negative `values` per text; `text` is ascending (0 where a text has none)."""
    out = np.zeros(n_texts, dtype=values.dtype)
    if len(values):
        starts = np.flatnonzero(np.diff(text, prepend=-1))
        out[text[starts]] = np.maximum.reduceat(values, starts)
    return out


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


def _sort_groups(h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(order, new): `order` sorts `h` (W,) so that equal values are adjacent and, within a group,
    in index order; `new` (W,) marks the first of each group in sorted order.

    A value sort is ~3x faster than `argsort` here (numpy's vectorized sort), so the index rides
    in the low bits of each key, under the hash's high bits. Two different hashes sharing those
    high bits would make the groups wrong: when any adjacent pair does, `argsort` decides."""
    bits = max(1, (len(h) - 1).bit_length())
    low = np.uint64((1 << bits) - 1)
    key = np.sort((h & ~low) | np.arange(len(h), dtype=np.uint64))
    order = (key & low).astype(np.intp)
    h_sorted = h[order]
    new = np.empty(len(h), dtype=bool)
    new[0] = True
    np.not_equal(h_sorted[1:], h_sorted[:-1], out=new[1:])
    if np.any(new[1:] & ((key[1:] ^ key[:-1]) <= low)):  # a new hash with the same high bits
        order = np.argsort(h, kind="stable")
        h_sorted = h[order]
        np.not_equal(h_sorted[1:], h_sorted[:-1], out=new[1:])
    return order, new


def _ngram_reasons(words: Words, size: np.ndarray, cfg: GopherRepetitionConfig) -> list[str | None]:
    """Top 2/3/4-gram char share and duplicated 5..10-gram char share of each text of `words`.

    n-grams are hashed for every position of every text at once: `acc` holds the unmixed sum of
    each n-gram's word hashes and grows by one word per n (`hashing.add_word`), starting from a
    salt per text that keeps texts apart in one sort. An n-gram can repeat only where its
    (n-1)-gram does, so after each n only those positions (usually few) go on. The top n-gram
    check compares an upper bound (longest n-gram x top count) first, and the duplicated n-gram
    check runs the exact left-to-right scan (`_dup_scan`) only when an upper bound exceeds the
    limit: the characters of the words covered by any repeated occurrence (the scan counts each
    character at most once, and only inside repeated occurrences).
    """
    reasons: list[str | None] = [None] * words.n_texts
    wh, text = words.hashes(), words.doc
    csum = np.zeros(len(wh) + 1, dtype=np.int64)
    np.cumsum(words.lengths, out=csum[1:])
    text_end = np.searchsorted(text, np.arange(words.n_texts), side="right")[text]  # (W,) end of each word's text
    salt = _text_salts(text)  # the sums start from a salt per text: equal n-grams of two texts differ
    limits = dict(zip(range(2, 11), [*cfg.top_ngram_char_fracs, *cfg.dup_ngram_char_fracs]))
    pos = np.arange(len(wh))
    acc = add_word(salt, wh, pos, 0)
    for n in range(2, 11):
        keep = pos + n - 1 < text_end[pos]
        pos, acc = pos[keep], acc[keep]
        if not len(pos):
            break
        acc = add_word(acc, wh, pos, n - 1)
        h = mix(acc)
        order, new = _sort_groups(h)
        sizes = np.diff(np.flatnonzero(new), append=len(h))
        count = np.empty(len(h), dtype=np.int64)
        count[order] = np.repeat(sizes, sizes)
        tpos, limit = text[pos], limits[n] * size
        if n <= 4:  # share of the most frequent n-gram, counted with overlaps ("the the the")
            _top_ngram(reasons, n, pos, tpos, count, csum, limit)
        else:  # characters inside n-grams that repeat an earlier one
            repeat = np.empty(len(h), dtype=bool)
            repeat[order] = ~new  # all but the first (in position order) of each group
            _dup_ngram(reasons, n, pos, tpos, text, h, count, repeat, csum, limit)
        shared = count > 1
        pos, acc = pos[shared], acc[shared]
    return reasons


def _top_ngram(reasons: list[str | None], n: int, pos: np.ndarray, tpos: np.ndarray, count: np.ndarray,
               csum: np.ndarray, limit: np.ndarray) -> None:
    """Mark each text whose most frequent n-gram covers more than `limit` characters: an upper
    bound (longest n-gram x top count) first, the exact count only where the bound exceeds it."""
    n_texts = len(reasons)
    gram_chars = csum[pos + n] - csum[pos] + n - 1
    top = _per_text_max(count, tpos, n_texts)
    bound = _per_text_max(gram_chars, tpos, n_texts) * top
    for t in np.flatnonzero((top > 1) & (bound > limit)).tolist():
        lo = np.searchsorted(tpos, t)  # ties: the earliest n-gram, as Counter.most_common
        i = lo + int(np.argmax(count[lo:np.searchsorted(tpos, t, side="right")] == top[t]))
        if reasons[t] is None and int(gram_chars[i]) * int(top[t]) > limit[t]:
            reasons[t] = f"gopher_top_{n}gram"


def _dup_ngram(reasons: list[str | None], n: int, pos: np.ndarray, tpos: np.ndarray, text: np.ndarray,
               h: np.ndarray, count: np.ndarray, repeat: np.ndarray, csum: np.ndarray, limit: np.ndarray) -> None:
    """Mark each text whose repeated n-grams cover more than `limit` characters (`_dup_scan`, run
    only where an upper bound exceeds the limit)."""
    n_texts = len(reasons)
    # upper bound of the scan: the characters of the words inside any repeated n-gram,
    # once. Repeats [p, p + n) are ascending and equally long, so the part of one that
    # the next does not cover is [p, min(p + n, next p)); those parts add up to the union.
    rp = pos[repeat]
    covered_end = np.minimum(rp + n, np.append(rp[1:], len(csum) - 1))
    over = np.bincount(text[rp], weights=csum[covered_end] - csum[rp], minlength=n_texts) > limit
    for t in np.flatnonzero(over).tolist():
        lo, hi = np.searchsorted(tpos, t), np.searchsorted(tpos, t, side="right")
        m = count[lo:hi] > 1
        p = pos[lo:hi][m]
        if reasons[t] is None and _dup_scan(p, h[lo:hi][m], csum[p + n] - csum[p], n) > limit[t]:
            reasons[t] = f"gopher_dup_{n}gram"


def gopher_repetition_reasons(texts: list[str], cfg: GopherRepetitionConfig,
                              words: Words | None = None) -> list[str | None]:
    """The Gopher repetition rules of each text: duplicate paragraphs and lines, then n-grams."""
    reasons = [_line_paragraph_reason(t, cfg) for t in texts]
    keep = np.array([r is None for r in reasons], dtype=bool)
    if keep.any():
        words = split_words(texts) if words is None else words
        size = np.array([max(len(t), 1) for t, k in zip(texts, keep) if k], dtype=np.float64)
        found = iter(_ngram_reasons(words.select(keep), size, cfg))
        reasons = [next(found) if k else r for r, k in zip(reasons, keep.tolist())]
    return reasons


def gopher_repetition_reason(text: str, cfg: GopherRepetitionConfig) -> str | None:
    return gopher_repetition_reasons([text], cfg)[0]


def _batches(indices: list[int], texts: list[str]) -> Iterator[list[int]]:
    """Runs of `indices` whose texts hold at most _BATCH_CHARS code points together (or one text)."""
    batch, chars = [], 0
    for i in indices:
        if batch and chars + len(texts[i]) > _BATCH_CHARS:
            yield batch
            batch, chars = [], 0
        batch.append(i)
        chars += len(texts[i]) + 1
    if batch:
        yield batch


def quality_reasons(texts: list[str], cfg: QualityConfig) -> list[str | None]:
    """The first failed rule of each text (length, then Gopher quality, then Gopher repetition), or None."""
    reasons = [length_reason(t, cfg) for t in texts]
    gq, gr = cfg.gopher_quality, cfg.gopher_repetition
    if not (gq.enabled or gr.enabled):
        return reasons
    for batch in _batches([i for i, r in enumerate(reasons) if r is None], texts):
        batch_texts = [texts[i] for i in batch]
        words = split_words(batch_texts)
        found = gopher_quality_reasons(batch_texts, gq, words) if gq.enabled else [None] * len(batch)
        keep = np.array([r is None for r in found], dtype=bool)
        if gr.enabled and keep.any():
            kept = [t for t, k in zip(batch_texts, keep.tolist()) if k]
            more = iter(gopher_repetition_reasons(kept, gr, words.select(keep)))
            found = [next(more) if k else r for r, k in zip(found, keep.tolist())]
        for i, r in zip(batch, found):
            reasons[i] = r
    return reasons

