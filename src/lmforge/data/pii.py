"""Mask personal data and secrets with typed placeholders, counting each type.

| type | placeholder | rule |
| --- | --- | --- |
| api_key | `<API_KEY>` | known token shapes: OpenAI `sk-...`, GitHub `ghp_/gho_/ghu_/ghs_/ghr_...`, `github_pat_...`, AWS `AKIA...`, Slack `xox?-...`, Google `AIza...`, Hugging Face `hf_...`, Stripe `sk_live_/pk_live_...`, JWTs, `Bearer <token>` |
| email | `<EMAIL>` | `local@domain.tld` |
| cn_id | `<CN_ID>` | 18-character Chinese resident ID: area code, a valid birth date, checksum (GB 11643-1999, ISO 7064 MOD 11-2) |
| credit_card | `<CREDIT_CARD>` | 13-19 digits (spaces or dashes allowed) starting 3-6, passing the Luhn check |
| ipv6 | `<IP_ADDRESS>` | parses as IPv6 (`ipaddress`) with at least three hex groups (so `a[1::2]` survives) |
| ipv4 | `<IP_ADDRESS>` | four dotted octets 0-255, not part of a longer dotted number |
| phone | `<PHONE>` | `+CC ...` international (8-15 digits), `(555) 123-4567` / `555-123-4567`, Chinese mobile `1[3-9]` + 9 digits (optional `+86`) |

Patterns run in that order, each over the text the previous ones left, so a card number is
never also counted as a phone. Most documents hold no PII, so each pattern first checks a
cheap necessary condition (`_gate`) and runs only when it holds; the output is the same as
running every pattern (tests/test_data_prepare.py compares both on fuzzed text). Scanning a
text costs about as much for a gate as for its pattern, so `mask_pii_many` finds most gates for
a whole batch of texts in a few numpy calls over one array of code points (`words.py`), each a
shape every match has: for a key, its first characters at a word boundary with a long enough run
of `[A-Za-z0-9_-]` after them; for a cn_id, a run of 17 digits; for a card, 13 digits in runs one
space or dash apart; for an IPv4 address, 4 digit runs one dot apart; for a phone, a run of 11
digits or `\\d{3}[ .-]\\d{4}` (or `+` and a digit). An email needs "@" and is searched for only in
the tokens around each "@" (`_tokens_around`); an IPv6 address needs two colons one group apart
in a run of hex digits and colons long enough for 3 groups. Masks only cut digit runs (a
placeholder holds no digit, space, dot or dash), so the gates of the text as given hold for every
later pattern's input. Years, versions (`3.11.2`), dates (`2024-01-15`), times, port numbers
and numbers failing their checksum are left alone. Pure functions of strings; it knows nothing
about documents or the pipeline.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import re
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from lmforge.data.config import PiiConfig
from lmforge.data.words import DIGIT, char_classes, code_points

PLACEHOLDERS = {"api_key": "<API_KEY>", "email": "<EMAIL>", "cn_id": "<CN_ID>",
                "credit_card": "<CREDIT_CARD>", "ipv6": "<IP_ADDRESS>", "ipv4": "<IP_ADDRESS>",
                "phone": "<PHONE>"}

_API_KEY = re.compile(
    r"\b(?:sk-(?:proj-)?[A-Za-z0-9_-]{20,}|gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{40,}"
    r"|AKIA[0-9A-Z]{16}|xox[abposr]-[A-Za-z0-9-]{10,}|AIza[0-9A-Za-z_-]{35}|hf_[A-Za-z0-9]{30,}"
    r"|[sr]k_live_[A-Za-z0-9]{20,}|pk_live_[A-Za-z0-9]{20,}"
    r"|eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,})"
    r"|(?<=Bearer )[A-Za-z0-9._~+/-]{20,}=*")
_EMAIL = re.compile(r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b")
# A pattern that starts with a character set lets sre skip to candidate characters in C; the
# lookbehind comes after that first character: `[1-9](?<![0-9A-Za-z][1-9])` == `(?<![0-9A-Za-z])[1-9]`.
_CN_ID = re.compile(r"[1-9](?<![0-9A-Za-z][1-9])\d{5}(?:19|20)\d{2}(?:0[1-9]|1[0-2])(?:0[1-9]|[12]\d|3[01])\d{3}[0-9Xx]"
                    r"(?![0-9A-Za-z])")
_CARD = re.compile(r"[3-6](?<![\d.-][3-6])\d{3}(?:[ -]?\d){9,15}(?![\d.])")
_IPV6 = re.compile(r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}(?![\w:])")
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_IPV4 = re.compile(rf"(?<![\w.]){_OCTET}(?:\.{_OCTET}){{3}}(?![\w]|\.\d)")
# Four alternatives: `+CC ...`, `(555) 123-4567`, `555-123-4567`, Chinese mobile `(86)1[3-9]...`, each
# behind its own lookbehind. Spelled charset-first like _CN_ID: the first character is consumed by
# `[+(\d]` and each alternative re-checks it and its left neighbour with a two-character lookbehind,
# in the original order (the Chinese mobile split by its first character, 8 or 1).
_PHONE = re.compile(
    r"[+(\d](?:"
    r"(?<=\+)(?<![\w+]\+)\d{1,3}[ .-]?(?:\(\d{1,4}\)[ .-]?)?\d{1,4}(?:[ .-]?\d{2,4}){1,4}(?![\w])"
    r"|(?<=\()(?<![\w(]\()\d{3}\) ?\d{3}[ .-]\d{4}(?!\d)"
    r"|(?<=\d)(?<![\w.-]\d)\d{2}[-.]\d{3}[-.]\d{4}(?![\w.-])"
    r"|(?<=8)(?<![0-9A-Za-z_+]8)6[ -]?1[3-9]\d{9}(?![0-9A-Za-z_])"
    r"|(?<=1)(?<![0-9A-Za-z_+]1)[3-9]\d{9}(?![0-9A-Za-z_]))")

_PLUS_DIGIT = re.compile(r"\+\d")
# Each key shape but `Bearer` is a run of [A-Za-z0-9_-] starting at a word boundary (a run start,
# or after "-", the one such character that is not a word character): its first characters and
# the least length of that run from there.
_KEY_STARTS = (("sk-", 23), ("ghp_", 40), ("gho_", 40), ("ghu_", 40), ("ghs_", 40), ("ghr_", 40),
               ("gith", 51), ("AKIA", 20), ("xox", 15), ("AIza", 39), ("hf_", 33), ("sk_l", 28),
               ("rk_l", 28), ("pk_l", 28), ("eyJ", 11))
_KEY_WINDOW = 52  # longer than the longest least length above
_KEY_CHARS = "0123456789_-ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_FLAGS = bytes(1 * (chr(c) in "0123456789") | 2 * (chr(c) in _KEY_CHARS)
               for c in range(256))  # by code point: bit 1 an ASCII digit, bit 2 [A-Za-z0-9_-]
_COLON_PAIR = re.compile(r":(?=[0-9A-Fa-f]{0,4}:)")  # two colons of an IPv6 match, one group apart
_HEX_COLONS_BEFORE = re.compile(r"[0-9A-Fa-f:]*\Z")
_HEX_COLONS = re.compile(r"[0-9A-Fa-f:]*")
_IPV6_LONGEST = 39  # 8 groups of 4 hex digits and 7 colons


class Gates(NamedTuple):
    """Necessary conditions of each pattern on one text (and on what the masks before it leave)."""

    api_key: bool  # a key shape's first characters at a word boundary, with a long enough run
    cn_id: bool  # a run of 17 digits
    credit_card: bool  # 13 digits, each run one space or dash from the next
    ipv4: bool  # 4 runs of digits, each a dot from the next
    phone: bool  # `\\d{3}[ .-]\\d{4}` or a run of 11 digits (the `+CC` form is checked on the text)


def gates(texts: list[str]) -> list[Gates]:
    """The `Gates` of each text, found for all of them at once over one array of code points
    (uint8: every character above 255 counts as 255, which no gate looks for).

    Digits here are ASCII; a text holding another `\\d` character opens every digit gate."""
    cp, offsets = code_points(texts)
    n = len(texts)
    low = cp if cp.dtype == np.uint8 else np.minimum(cp, 255).astype(np.uint8)

    def texts_of(pos: np.ndarray) -> np.ndarray:  # (n,) bool: the texts holding any of the positions
        out = np.zeros(n, dtype=bool)
        out[np.searchsorted(offsets, pos, side="right") - 1] = True
        return out

    flags = np.frombuffer(low.tobytes().translate(_FLAGS), dtype=np.uint8)  # C-level, faster than numpy ops
    digit, key = (flags & 1).view(bool), (flags & 2).view(bool)
    run11 = key  # run11[p]: key[p:p + 11] all true
    for shift in (1, 2, 4, 3):
        run11 = run11[:-shift] & run11[shift:]
    boundary = np.empty(len(low), dtype=bool)  # a key run starts here, or a dash is just before
    boundary[0] = True
    np.logical_or(~key[:-1], low[:-1] == ord("-"), out=boundary[1:])
    pos = np.flatnonzero(run11 & boundary[:len(run11)])
    head = low[pos].astype(np.uint32) | low[pos + 1].astype(np.uint32) << 8 | \
        low[pos + 2].astype(np.uint32) << 16 | low[pos + 3].astype(np.uint32) << 24
    need = np.full(len(pos), _KEY_WINDOW + 1)  # least run length of a key shape starting here (none: unreachable)
    for prefix, least in _KEY_STARTS:
        match = (head & np.uint32((1 << 8 * len(prefix)) - 1)) == int.from_bytes(prefix.encode(), "little")
        need[match] = np.minimum(need[match], least)
    hit = need <= _KEY_WINDOW
    pos, need = pos[hit], need[hit]
    window = key[np.minimum(pos[:, None] + np.arange(_KEY_WINDOW), len(key) - 1)]  # (hits, _KEY_WINDOW)
    left = np.where(window.all(axis=1), _KEY_WINDOW, np.argmin(window, axis=1))  # run length from each hit
    api_key = left >= need

    edges = np.flatnonzero(np.diff(digit.view(np.int8), prepend=np.int8(0)))  # the final "\n" ends the last run
    d_start, d_end = edges[0::2], edges[1::2]
    d_len = d_end - d_start
    gap = np.where(d_start[1:] == d_end[:-1] + 1, low[d_end[:-1]], 0)  # (runs - 1,) the one character between
    us = (d_len[:-1] >= 3) & (d_len[1:] >= 4) & ((gap == 32) | (gap == 46) | (gap == 45))
    chain = np.cumsum(np.concatenate([d_len[:1] > 0, (gap != 32) & (gap != 45)])) - 1  # runs joined by a space or dash
    card = (np.bincount(chain, d_len) >= 13)[chain]
    dot = gap == 46
    ipv4 = np.concatenate([dot[:-2] & dot[1:-1] & dot[2:], np.zeros(min(len(d_start), 3), dtype=bool)])
    digits = [texts_of(d_start[d_len >= 17]), texts_of(d_start[card]), texts_of(d_start[ipv4]),
              texts_of(np.concatenate([d_start[:-1][us], d_start[d_len >= 11]]))]
    if cp.dtype != np.uint8:
        high = np.flatnonzero(cp > 255)
        other = texts_of(high[(char_classes(cp[high]) & DIGIT) != 0])
        digits = [d | other for d in digits]
    return list(map(Gates, texts_of(pos[api_key]).tolist(), *(d.tolist() for d in digits)))


def _ipv6_possible(text: str) -> bool:
    """Two colons one group apart, in a run of [0-9A-Fa-f:] with 2 colons and 3 hex digits (within
    the longest match either side): what every IPv6 match that `_ipv6_ok` accepts holds."""
    for m in _COLON_PAIR.finditer(text):
        c = m.start()
        run = _HEX_COLONS_BEFORE.search(text, max(0, c - _IPV6_LONGEST), c).group() + \
            _HEX_COLONS.match(text, c, c + _IPV6_LONGEST).group()
        colons = run.count(":")
        if colons >= 2 and len(run) - colons >= 3:
            return True
    return False


def _gate(kind: str, text: str, g: Gates) -> bool:
    """False only when `kind` cannot match `text` (a necessary condition of its pattern)."""
    if kind == "api_key":
        return g.api_key or "Bearer " in text
    if kind == "email":
        return "@" in text
    if kind == "ipv6":
        return _ipv6_possible(text)
    if kind == "phone":
        return g.phone or _PLUS_DIGIT.search(text) is not None
    return getattr(g, kind)


_CN_WEIGHTS = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)


def luhn_ok(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch)
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def cn_id_ok(value: str) -> bool:
    try:
        dt.date(int(value[6:10]), int(value[10:12]), int(value[12:14]))
    except ValueError:
        return False
    check = "10X98765432"[sum(int(c) * w for c, w in zip(value[:17], _CN_WEIGHTS)) % 11]
    return value[17].upper() == check


def _card_ok(match: str) -> bool:
    digits = re.sub(r"[ -]", "", match)
    return 13 <= len(digits) <= 19 and luhn_ok(digits)


def _ipv6_ok(match: str) -> bool:
    if sum(1 for g in match.split(":") if g) < 3:
        return False
    try:
        ipaddress.IPv6Address(match)
    except ValueError:
        return False
    return True


def _phone_ok(match: str) -> bool:
    n = sum(c.isdigit() for c in match)
    return 8 <= n <= 15


_RULES: tuple[tuple[str, re.Pattern, Callable[[str], bool] | None], ...] = (
    ("api_key", _API_KEY, None), ("email", _EMAIL, None), ("cn_id", _CN_ID, cn_id_ok),
    ("credit_card", _CARD, _card_ok), ("ipv6", _IPV6, _ipv6_ok), ("ipv4", _IPV4, None),
    ("phone", _PHONE, _phone_ok))
_CONFIG_NAME = {"ipv4": "ip_address", "ipv6": "ip_address"}


def mask_pii(text: str, cfg: PiiConfig) -> tuple[str, dict[str, int]]:
    """The text with PII replaced by placeholders, and the count per type (only types found)."""
    return mask_pii_many([text], cfg)[0]


def mask_pii_many(texts: list[str], cfg: PiiConfig) -> list[tuple[str, dict[str, int]]]:
    """`mask_pii` of each text; the gates found for all of them at once."""
    return [_mask(text, cfg, g) for text, g in zip(texts, gates(texts))] if texts else []


def _mask(text: str, cfg: PiiConfig, g: Gates) -> tuple[str, dict[str, int]]:
    counts: dict[str, int] = {}
    for kind, pattern, valid in _RULES:
        if not getattr(cfg, _CONFIG_NAME.get(kind, kind)) or not _gate(kind, text, g):
            continue
        n = 0

        def replace(m: re.Match) -> str:
            nonlocal n
            if valid is not None and not valid(m.group(0)):
                return m.group(0)
            n += 1
            return PLACEHOLDERS[kind]

        spans = _tokens_around(text, "@") if kind == "email" else None
        if spans is None:
            text = pattern.sub(replace, text)
        else:  # only the tokens holding an "@": the same matches, without scanning every position
            pieces, done = [], 0
            for a, b in spans:
                pieces += [text[done:a], pattern.sub(replace, text[a:b])]
                done = b
            text = "".join(pieces) + text[done:]
        if n:
            counts[kind] = n
    return text, counts


_REACH = 256  # how far `_tokens_around` looks for the ends of a token


def _tokens_around(text: str, char: str) -> list[tuple[int, int]] | None:
    """Spans [a, b) around each `char`, from after the space, newline or tab before it to the one
    after it (or the text's ends). An email holds none of those, so each match lies inside the
    span of its "@", and `\\b` at a span's ends sees the same as in the text: substituting in the
    spans alone gives the same text. None when an end is further than _REACH away."""
    spans = []
    i = text.find(char)
    while i != -1:
        lo = max(0, i - _REACH)
        a = max(text.rfind(" ", lo, i), text.rfind("\n", lo, i), text.rfind("\t", lo, i)) + 1
        ends = [e for e in (text.find(" ", i, i + _REACH), text.find("\n", i, i + _REACH),
                            text.find("\t", i, i + _REACH)) if e != -1]
        if (a == 0 and lo > 0) or (not ends and i + _REACH < len(text)):
            return None
        b = min(ends) if ends else len(text)
        spans.append((a, b))
        i = text.find(char, b)
    return spans
