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
cheap necessary condition (`_GATES`: a substring, or a regex sre can scan with memchr or a
character-set skip) and runs only when it holds; the output is the same as running every pattern
(tests/test_data_prepare.py compares both on fuzzed text). Years, versions (`3.11.2`), dates (`2024-01-15`), times, port
numbers and numbers failing their checksum are left alone. A pure function of a string; it
knows nothing about documents or the pipeline.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import re
from collections.abc import Callable

from lmforge.data.config import PiiConfig

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

_API_KEY_PREFIXES = ("sk-", "ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_", "AKIA", "xox", "AIza", "hf_",
                     "k_live_", "eyJ", "Bearer ")
_FOUR_DIGITS = re.compile(r"\d{4}")  # in every cn_id, card and non-international phone match
_IPV6_GATE = re.compile(r":[0-9A-Fa-f]{0,4}:")
_IPV4_GATE = re.compile(r"\.\d{1,3}\.\d")
_PLUS_DIGIT = re.compile(r"\+\d")


def _gate(kind: str, text: str, four_digits: bool) -> bool:
    """False only when `kind` cannot match `text` (a necessary condition of its pattern)."""
    if kind == "api_key":
        return any(prefix in text for prefix in _API_KEY_PREFIXES)
    if kind == "email":
        return "@" in text
    if kind in ("cn_id", "credit_card"):
        return four_digits
    if kind == "ipv6":
        return _IPV6_GATE.search(text) is not None
    if kind == "ipv4":
        return _IPV4_GATE.search(text) is not None
    return four_digits or _PLUS_DIGIT.search(text) is not None  # phone


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
    counts: dict[str, int] = {}
    # Masks replace digits by digit-free placeholders, so a text without 4 digits in a row keeps none.
    four_digits = _FOUR_DIGITS.search(text) is not None
    for kind, pattern, valid in _RULES:
        if not getattr(cfg, _CONFIG_NAME.get(kind, kind)) or not _gate(kind, text, four_digits):
            continue
        n = 0

        def replace(m: re.Match) -> str:
            nonlocal n
            if valid is not None and not valid(m.group(0)):
                return m.group(0)
            n += 1
            return PLACEHOLDERS[kind]

        text = pattern.sub(replace, text)
        if n:
            counts[kind] = n
    return text, counts
