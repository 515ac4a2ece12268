"""Mask personal data and secrets with typed placeholders, counting each type.

| type | placeholder | rule |
| --- | --- | --- |
| private_key | `<PRIVATE_KEY>` | a PEM private key block (detect-secrets' `PrivateKeyDetector` headers: `-----BEGIN [RSA / EC / DSA / OPENSSH / ENCRYPTED / PGP] PRIVATE KEY[ BLOCK]-----`), header to `END` line, or to the end of its body when the `END` line is missing |
| secret (AWS) | `<SECRET>` | an AWS secret access key (detect-secrets' `AWSKeyDetector` shape): 40 characters of `[A-Za-z0-9/+]` holding a lower-case letter, a capital and a digit, within 100 characters after an access key id (`AKIA...`, `ASIA...`) or an AWS word (`aws`, `secret access key`, `SecretAccessKey`) |
| api_key | `<API_KEY>` | known token shapes: OpenAI `sk-...`, GitHub `ghp_/gho_/ghu_/ghs_/ghr_...`, `github_pat_...`, AWS access key ids (`AKIA...`, `ASIA...`, detect-secrets' prefixes), Slack `xox?-...`, Google `AIza...`, Hugging Face `hf_...`, Stripe `sk_live_/pk_live_...`, JWTs, `Bearer <token>` |
| url_credentials | `<CREDENTIALS>` | the `user:password` of `scheme://user:password@host` (the scheme and host stay) |
| email | `<EMAIL>` | `local@domain.tld` |
| secret | `<SECRET>` | the value of a `password` / `passwd` / `pwd` / `secret` / `api_key` / `token` / `access_key` ... pair (`=`, `:` or ` is `; quoted or bare; values that read as code, prose, templates or `None` stay), and runs of 32+ hex digits holding a letter and a digit unless a hash word (`sha256`, `md5`, `commit`, `checksum` ...) is just before |
| ssn | `<SSN>` | US social security number `123-45-6789` (`python-stdnum`'s `us.ssn` rules: no area 000/666/9xx, group 00, serial 0000; its three publicly known numbers, such as 078-05-1120, count: people type them as their SSN); `123 45 6789` and `123456789` only right after "ssn" or "social security (number)" (and an optional `is` / `was` / `:`) |
| iban | `<IBAN>` | `CC00 ...` in groups of 4 or unspaced, valid by `python-stdnum`'s `iban` (the country's length and format, ISO 7064 mod 97-10), any country |
| cn_id | `<CN_ID>` | 18-character Chinese resident ID: area code, a valid birth date, checksum (GB 11643-1999, ISO 7064 MOD 11-2) |
| credit_card | `<CREDIT_CARD>` | 13-19 digits (spaces or dashes allowed) starting 3-6, or 16 starting 2221-2720 (Mastercard's 2-series), passing the Luhn check (`stdnum.luhn`) |
| ipv6 | `<IP_ADDRESS>` | parses as IPv6 (`ipaddress`) with at least three hex groups (so `a[1::2]` survives) |
| ipv4 | `<IP_ADDRESS>` | four dotted octets 0-255, not part of a longer dotted number |
| phone | `<PHONE>` | a digit run with separators, validated by Google's libphonenumber (`phonenumbers.PhoneNumberMatcher`, `STRICT_GROUPING`): `+CC` or `00CC` from any country; a national number with trunk `0` for the first of GB, DE, FR, NL, IT, AU, IN, JP, BR, CN that validates it; US (or Chinese mobile) otherwise. Digits and spaces alone (`4155550132`, `415 555 0132`, no `+`, `0`, dash, dot or bracket) count only after a phone word (phone, tel, call, mobile, cell, contact, fax, sms, whatsapp, 电话, 手机 ...), except an 11-digit Chinese mobile |

Patterns run in that order (the PEM block and the AWS secret first, before their pieces look like other
secrets and while the access key id beside a secret is still there to see), each over the text the previous ones left, so a card number is
never also counted as a phone, and an IBAN never as a card. Most documents hold no PII, so each
pattern first checks a cheap necessary condition (`_gate`) and runs only when it holds; the output
is the same as running every pattern (tests/test_data_prepare.py and tests/test_pii.py compare both
on fuzzed text). Scanning a text costs about as much for a gate as for its pattern, so `mask_pii_many` finds most
gates for a whole batch of texts in a few numpy calls over one array of code points (`words.py`),
each a shape every match has: for a key, its first characters at a word boundary with a long
enough run of `[A-Za-z0-9_-]` after them; for a cn_id, a run of 17 digits; for a card, 13 digits
in runs one space or dash apart; for an IPv4 address, 4 digit runs one dot apart; for an SSN, digit
runs of 3, 2 and 4 a dash or space apart; for an IBAN, two capitals and two digits, then 8 of
`[0-9A-Z ]`; for a hex secret, a run of 32 hex digits; for a key/value secret, the end of a key
word, up to 8 blanks and `:`, `=` or `is` (`_secret_hits`); for a phone, 8 digits in runs one
space, dot or dash apart, or `\\d{3}[ .-]\\d{4}` (or `+` and a digit). An email needs "@" and is
searched for only in the tokens around each "@" (`_tokens_around`), a key/value secret only around
each key word and separator of the lower-cased text (`_secret_windows`); URL credentials need
"://" and "@"; libphonenumber (~0.1 ms a region) sees only the candidates `_phone_possible`
lets through; an IPv6 address needs two colons one group apart in a run of hex digits and colons
long enough for 3 groups. A placeholder holds no
digit, space, dot or dash and starts and ends with `<` `>`, so masking never joins two runs: the
gates of the text as given hold for every later pattern's input. Years, versions (`3.11.2`),
dates (`2024-01-15`), times, port numbers, prices, token counts and numbers failing their checksum
or libphonenumber's validation are left alone; tests/test_pii.py measures recall and false
positives on a labelled set (tests/pii_labelled.jsonl). Pure functions of strings; it knows
nothing about documents or the pipeline.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import re
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import phonenumbers
from stdnum import iban as stdnum_iban
from stdnum import luhn
from stdnum.us import ssn as stdnum_ssn

from lmforge.data.config import PiiConfig
from lmforge.data.words import DIGIT, char_classes, code_points

PLACEHOLDERS = {"private_key": "<PRIVATE_KEY>", "api_key": "<API_KEY>", "url_credentials": "<CREDENTIALS>", "email": "<EMAIL>",
                "secret": "<SECRET>", "ssn": "<SSN>", "iban": "<IBAN>", "cn_id": "<CN_ID>",
                "credit_card": "<CREDIT_CARD>", "ipv6": "<IP_ADDRESS>", "ipv4": "<IP_ADDRESS>",
                "phone": "<PHONE>"}

_API_KEY = re.compile(
    r"\b(?:sk-(?:proj-)?[A-Za-z0-9_-]{20,}|gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{40,}"
    r"|(?:A3T[A-Z0-9]|ABIA|ACCA|AKIA|ASIA)[0-9A-Z]{16}|xox[abposr]-[A-Za-z0-9-]{10,}|AIza[0-9A-Za-z_-]{35}|hf_[A-Za-z0-9]{30,}"
    r"|[sr]k_live_[A-Za-z0-9]{20,}|pk_live_[A-Za-z0-9]{20,}"
    r"|eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,})"
    r"|(?<=Bearer )[A-Za-z0-9._~+/-]{20,}=*")
# The userinfo of a URL with a password (RFC 3986: no "/", "?", "#" or "@" in it unescaped).
_URL_CREDENTIALS = re.compile(r"://(?<=[A-Za-z0-9]://)[^\s/?#@:]*:[^\s/?#@]+(?=@)")  # "://" first: sre finds it fast
_EMAIL = re.compile(r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b")
# A key (ASCII, any case), the closing quote of a JSON/YAML key, a separator, then a quoted value or a
# bare one (which ends at a space, quote, bracket, ";", "," or "<>", the ends of a value in code and URLs).
_SECRET_PAIR = re.compile(
    r"(?<![A-Za-z0-9])(?P<key>(?ai:pass(?:word|wd|phrase)?|pwd|(?:client[_-]?)?secret|"
    r"(?:api|access|secret|private)[_-]?key|apikey|(?:access|auth|refresh|session|api|bearer)?[_-]?token))"
    r"(?![A-Za-z0-9])[\"']?(?P<sep>[ \t]{0,8}[:=][ \t]{0,8}|[ \t]{1,8}(?ai:is)[ \t]{1,8})"
    r"(?:\"(?P<dq>[^\"\n]{0,200})\"|'(?P<sq>[^'\n]{0,200})'|(?P<bare>[^\s\"'<>(){}\[\];,]{1,200}))")
_NOT_A_SECRET = frozenset({"none", "null", "nil", "true", "false", "undefined", "empty", "required", "optional",
                           "string", "str", "bytes", "int", "redacted", "hidden", "n/a", "..."})
_DOTTED_NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")  # `settings.SECRET_KEY`: code, not a value
# The ends of every `_SECRET_PAIR` key (pass, password, passwd, passphrase, pwd, (client_)secret, *key,
# *token), case-insensitive, in the gate; and, on the lower-cased text, a key's end, quote and
# separator, around which `_secret_windows` looks for pairs.
_SECRET_ENDS = ("pass", "word", "sswd", "rase", "pwd", "cret", "key", "oken")
_SECRET_WORDS = re.compile(r"(?:pass|word|wd|phrase|secret|key|token)[\"']?[ \t]{0,8}(?:[:=]|is[ \t])")
_SECRET_REACH = (16, 8 + 202)  # a key starts <= 16 characters before its word; a value ends <= 210 after its separator
_LOWER = np.array([c + 32 if 65 <= c <= 90 else c for c in range(256)], dtype=np.uint8)  # ASCII lower case
_HEX_SECRET = re.compile(r"[0-9A-Fa-f](?<![0-9A-Za-z_-][0-9A-Fa-f])[0-9A-Fa-f]{31,}(?![0-9A-Za-z_-])")
_HASH_WORD = re.compile(r"(?i)(?:sha-?\d*|md5|hash|digest|checksum|commit|etag|sum)\W{0,3}\Z")
_SSN = re.compile(r"\d(?<![\w-]\d)\d{2}(?:(?P<sep>[- ])\d{2}(?P=sep)\d{4}|\d{6})(?![\w-])")
_SSN_WORDS = re.compile(r"(?i)(?:ssn|social security(?: number| no\.?)?)(?:\W{0,3}(?:is|was)\W{1,3}|\W{0,4})\Z")
# detect-secrets' PrivateKeyDetector headers; the body is masked with them, to the END line or, when a paste
# was cut off, to the body's last base64 (or `Proc-Type:` style header) line
_PRIVATE_KEY = re.compile(
    r"-----BEGIN (?:(?:RSA|EC|DSA|OPENSSH|ENCRYPTED|PGP) )?PRIVATE KEY(?: BLOCK)?-----"
    r"(?:[\s\S]{0,20000}?-----END (?:(?:RSA|EC|DSA|OPENSSH|ENCRYPTED|PGP) )?PRIVATE KEY(?: BLOCK)?-----"
    r"|(?:\n[ \t]*[A-Za-z0-9+/=:, -]+)*)")
# detect-secrets' AWS secret access key: 40 of [A-Za-z0-9/+], near an access key id or an AWS word
_AWS_SECRET = re.compile(r"[A-Za-z0-9/+](?<![A-Za-z0-9/+=][A-Za-z0-9/+])[A-Za-z0-9/+]{39}(?![A-Za-z0-9/+=])")
_AWS_CONTEXT = re.compile(r"(?:AKIA|ASIA)[0-9A-Z]{16}|(?i:aws|secret[ _-]?access[ _-]?key)")
_AWS_REACH = 100  # characters before a secret where its id or an AWS word may be
_IBAN = re.compile(r"[A-Z](?<![0-9A-Za-z][A-Z])[A-Z][0-9]{2}(?: ?[0-9A-Z]{4}){2,7}(?: ?[0-9A-Z]{1,4})?(?![0-9A-Za-z])")
# A pattern that starts with a character set lets sre skip to candidate characters in C; the
# lookbehind comes after that first character: `[1-9](?<![0-9A-Za-z][1-9])` == `(?<![0-9A-Za-z])[1-9]`.
_CN_ID = re.compile(r"[1-9](?<![0-9A-Za-z][1-9])\d{5}(?:19|20)\d{2}(?:0[1-9]|1[0-2])(?:0[1-9]|[12]\d|3[01])\d{3}[0-9Xx]"
                    r"(?![0-9A-Za-z])")
_CARD = re.compile(r"[2-6](?<![\d.-][2-6])\d{3}(?:[ -]?\d){9,15}(?![\d.])")
_IPV6 = re.compile(r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}(?![\w:])")
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_IPV4 = re.compile(rf"(?<![\w.]){_OCTET}(?:\.{_OCTET}){{3}}(?![\w]|\.\d)")
# A phone candidate: `+`, `(` or a digit not inside a word, number or version, then digits, spaces,
# dots, dashes and brackets, ending on a digit or `)` that no word, number or time continues, with the
# gate's shape (`_PHONE_SHAPE`) near its start, so that most numbers cost no Python call.
# libphonenumber decides (`_phone_mask`); the shape below is the gate's condition, checked on each match.
_PHONE = re.compile(r"[+(\d](?<![0-9A-Za-z_.+-][+(\d])"
                    r"(?:(?<=\+)(?=\d)|(?<=\d)(?=\d{2}[ .-]\d{4}|(?:[ .-]?\d){7})"  # the shape from the first character
                    r"|(?=[\d ().-]{0,20}?(?:\d{3}[ .-]\d{4}|\d(?:[ .-]?\d){7})))"  # or from one of the next 21
                    r"[\d ().-]{6,26}(?<=[\d)])(?![0-9A-Za-z_]|[.:-]\d)")
_PHONE_SHAPE = re.compile(r"\+\d|\d{3}[ .-]\d{4}|\d(?:[ .-]?\d){7}")
_PHONE_WORDS = re.compile(r"(?i)(?:\b(?:phone|tel|call|mobil|cell|contact|fax|sms|text|whatsapp|ring|dial|reach|"
                          r"number is|my number)|电话|手机|联系)[^\n\d]{0,24}\Z")
_DIGIT_RUN = re.compile(r"\d+")
_NOT_DIGIT = re.compile(r"\D")
_PHONE_MARK = re.compile(r"[+(.-]|^0| 0")  # written as a phone number: `_phone_ok`
_CN_MOBILE = re.compile(r"(?<!\d)1[3-9]\d(?: ?\d){8}(?!\d)")
# a decimal, a version, a date, a range of years, a negative number
_NUMBERISH = re.compile(r"[-+]?\d+\.\d+|\d{1,2}(?:\.\d{1,3}){2,3}|(?:19|20)\d\d([-./])\d\d?\1\d\d?"
                        r"|(?:1[89]|20)\d\d-(?:1[89]|20)\d\d|-\d+")
_TRUNK_ZERO_REGIONS = ("GB", "DE", "FR", "NL", "IT", "AU", "IN", "JP", "BR", "CN")
_CONTEXT = 40  # characters before a match that `_SSN_WORDS`, `_PHONE_WORDS` and `_HASH_WORD` look at

_PLUS_DIGIT = re.compile(r"\+\d")
# Each key shape but `Bearer` is a run of [A-Za-z0-9_-] starting at a word boundary (a run start,
# or after "-", the one such character that is not a word character): its first characters and
# the least length of that run from there.
_KEY_STARTS = (("sk-", 23), ("ghp_", 40), ("gho_", 40), ("ghu_", 40), ("ghs_", 40), ("ghr_", 40),
               ("gith", 51), ("AKIA", 20), ("ASIA", 20), ("ABIA", 20), ("ACCA", 20), ("A3T", 20), ("xox", 15), ("AIza", 39), ("hf_", 33), ("sk_l", 28),
               ("rk_l", 28), ("pk_l", 28), ("eyJ", 11))
_KEY_WINDOW = 52  # longer than the longest least length above
_KEY_CHARS = "0123456789_-ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_B64_CHARS = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz/+"
# by code point: bit 1 an ASCII digit, 2 [A-Za-z0-9_-], 4 [A-Z], 8 [0-9A-Fa-f], 16 [0-9A-Z ], 32 ":" or "=", 64 i or I,
# 128 [A-Za-z0-9/+]
_FLAGS = bytes(1 * (chr(c) in "0123456789") | 2 * (chr(c) in _KEY_CHARS) | 4 * ("A" <= chr(c) <= "Z")
               | 8 * (chr(c) in "0123456789ABCDEFabcdef") | 16 * (chr(c) in "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ ")
               | 32 * (chr(c) in ":=") | 64 * (chr(c) in "iI") | 128 * (chr(c) in _B64_CHARS)
               for c in range(256))
_COLON_PAIR = re.compile(r":(?=[0-9A-Fa-f]{0,4}:)")  # two colons of an IPv6 match, one group apart
_HEX_COLONS_BEFORE = re.compile(r"[0-9A-Fa-f:]*\Z")
_HEX_COLONS = re.compile(r"[0-9A-Fa-f:]*")
_IPV6_LONGEST = 39  # 8 groups of 4 hex digits and 7 colons


class Gates(NamedTuple):
    """Necessary conditions of each pattern on one text (and on what the masks before it leave)."""

    api_key: bool  # a key shape's first characters at a word boundary, with a long enough run
    secret: bool  # a key word's end (`_SECRET_ENDS`), a quote, 8 blanks, then `:`, `=` or `is` and a blank
    hex_secret: bool  # a run of 32 hex digits
    ssn: bool  # digit runs of 3, 2 and 4, each a dash or space from the next, or a run of 9 digits
    iban: bool  # [A-Z][A-Z][0-9][0-9], then 8 of [0-9A-Z ]
    cn_id: bool  # a run of 17 digits
    credit_card: bool  # 13 digits, each run one space or dash from the next
    ipv4: bool  # 4 runs of digits, each a dot from the next
    phone: bool  # `\\d{3}[ .-]\\d{4}` or 8 digits in runs one space, dot or dash apart (`+CC` is checked on the text)
    aws_secret: bool  # a run of 40 of [A-Za-z0-9/+] (its context is checked on the text)


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
    digit, key, upper, hexd, iban_char, b64 = ((flags & bit).astype(bool) for bit in (1, 2, 4, 8, 16, 128))
    secret = _secret_hits(low, flags)
    hex32 = hexd  # hex32[p]: hexd[p:p + 32] all true
    for shift in (1, 2, 4, 8, 16):
        hex32 = hex32[:-shift] & hex32[shift:]
    run40 = b64  # run40[p]: b64[p:p + 40] all true
    for shift in (1, 2, 4, 8, 16, 8):
        run40 = run40[:-shift] & run40[shift:]
    run8 = iban_char  # run8[p]: iban_char[p:p + 8] all true
    for shift in (1, 2, 4):
        run8 = run8[:-shift] & run8[shift:]
    n_iban = max(len(run8) - 4, 0)  # positions p with p + 4 + 8 <= len(low)
    iban = (upper[:-3] & upper[1:-2] & digit[2:-1] & digit[3:])[:n_iban] & run8[4:4 + n_iban]
    digits = [texts_of(pos) for pos in _digit_gates(low, digit)]
    if cp.dtype != np.uint8:
        high = np.flatnonzero(cp > 255)
        other = texts_of(high[(char_classes(cp[high]) & DIGIT) != 0])
        digits = [d | other for d in digits]
    ssn, *rest = digits
    return list(map(Gates, texts_of(_key_hits(low, key)).tolist(), texts_of(secret).tolist(),
                    texts_of(np.flatnonzero(hex32)).tolist(),
                    ssn.tolist(), texts_of(np.flatnonzero(iban)).tolist(), *(d.tolist() for d in rest),
                    texts_of(np.flatnonzero(run40)).tolist()))


def _key_hits(low: np.ndarray, key: np.ndarray) -> np.ndarray:
    """Positions where a key shape's first characters start a long enough run of [A-Za-z0-9_-]."""
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
    return pos[left >= need]


def _secret_hits(low: np.ndarray, flags: np.ndarray) -> np.ndarray:
    """Positions of a `:`, `=` or `is` + blank with, before it, up to 8 blanks, an optional quote and
    one of `_SECRET_ENDS` (case-insensitive): where a `_SECRET_PAIR` key meets its separator."""
    i = np.flatnonzero(flags[:-2] & 64)
    i = i[((low[i + 1] | 32) == ord("s")) & ((low[i + 2] == 32) | (low[i + 2] == 9))]  # "is" and a blank
    pos = np.concatenate([np.flatnonzero(flags & 32), i])
    before = _LOWER[low[np.maximum(pos[:, None] - np.arange(1, 14), 0)]]  # (seps, 13) lower-cased, nearest first
    blank = (before == 32) | (before == 9)
    rows = np.arange(len(pos))
    k = np.argmin(blank[:, :9], axis=1)  # the first of 9 that is not blank (0 when all are: never a key end)
    k += (before[rows, k] == ord('"')) | (before[rows, k] == ord("'"))
    ends = []  # ends[n]: the n + 1 characters before (nearest in the low byte), as an integer
    for n in range(4):
        ends.append((ends[-1] if n else 0) + (before[rows, k + n].astype(np.int64) << 8 * n))
    hit = np.zeros(len(pos), dtype=bool)
    for end in _SECRET_ENDS:
        hit |= ends[len(end) - 1] == int.from_bytes(end[::-1].encode(), "little")
    return pos[hit]


def _digit_gates(low: np.ndarray, digit: np.ndarray) -> list[np.ndarray]:
    """Start positions of the digit-run shapes of the ssn, cn_id, credit_card, ipv4 and phone gates."""
    edges = np.flatnonzero(np.diff(digit.view(np.int8), prepend=np.int8(0)))  # the final "\n" ends the last run
    d_start, d_end = edges[0::2], edges[1::2]
    d_len = d_end - d_start
    gap = np.where(d_start[1:] == d_end[:-1] + 1, low[d_end[:-1]], 0)  # (runs - 1,) the one character between
    space_dash = (gap == 32) | (gap == 45)
    ssn = (d_len[:-2] == 3) & (d_len[1:-1] == 2) & (d_len[2:] == 4) & space_dash[:-1] & space_dash[1:]
    ssn_starts = np.concatenate([d_start[:-2][ssn], d_start[d_len == 9]])  # 3-2-4, or 9 digits in a row
    us = (d_len[:-1] >= 3) & (d_len[1:] >= 4) & (space_dash | (gap == 46))

    def chained(joined: np.ndarray, least: int) -> np.ndarray:  # runs in a chain of `least` digits, links `joined`
        chain = np.cumsum(np.concatenate([d_len[:1] > 0, ~joined])) - 1
        return (np.bincount(chain, d_len) >= least)[chain]

    dot = gap == 46
    ipv4 = dot[:-2] & dot[1:-1] & dot[2:]
    return [ssn_starts, d_start[d_len >= 17], d_start[chained(space_dash, 13)], d_start[:-3][ipv4],
            np.concatenate([d_start[:-1][us], d_start[chained(space_dash | dot, 8)]])]


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


def _gate(name: str, text: str, g: Gates) -> bool:
    """False only when rule `name` cannot match `text` (a necessary condition of its pattern)."""
    if name == "api_key":
        return g.api_key or "Bearer " in text
    if name == "email":
        return "@" in text
    if name == "url_credentials":
        return "://" in text and "@" in text
    if name == "ipv6":
        return _ipv6_possible(text)
    if name == "phone":
        return g.phone or _PLUS_DIGIT.search(text) is not None
    if name == "private_key":
        return "PRIVATE KEY" in text
    if name == "aws_secret":  # a 40-character run, and somewhere an id or an AWS word (the regex checks where)
        return g.aws_secret and ("AKIA" in text or "ASIA" in text or "aws" in text or "AWS" in text or "Aws" in text
                                 or (("ccess" in text or "CCESS" in text) and ("ecret" in text or "ECRET" in text)))
    return getattr(g, name)


_CN_WEIGHTS = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)


def cn_id_ok(value: str) -> bool:
    try:
        dt.date(int(value[6:10]), int(value[10:12]), int(value[12:14]))
    except ValueError:
        return False
    check = "10X98765432"[sum(int(c) * w for c, w in zip(value[:17], _CN_WEIGHTS)) % 11]
    return value[17].upper() == check


def _card_ok(match: str) -> bool:
    digits = re.sub(r"[ -]", "", match)
    if digits[0] == "2" and not (len(digits) == 16 and 2221 <= int(digits[:4]) <= 2720):
        return False  # the 2-series is Mastercard's alone
    return 13 <= len(digits) <= 19 and luhn.is_valid(digits)


def _ipv6_ok(match: str) -> bool:
    if sum(1 for g in match.split(":") if g) < 3:
        return False
    try:
        ipaddress.IPv6Address(match)
    except ValueError:
        return False
    return True


def _before(m: re.Match, pattern: re.Pattern, start: int | None = None) -> bool:
    """`pattern` (anchored with `\\Z`) ends right before the match (or before `start` in its text)."""
    start = m.start() if start is None else start
    return pattern.search(m.string, max(0, start - _CONTEXT), start) is not None


def _secret_value(m: re.Match) -> tuple[int, int] | None:
    """The span of a key/value pair's value to mask, or None when the value is no secret: empty,
    a template (`${X}`, `{{ x }}`, `<...>`), a mask (`****`), `None`/`null`..., code (`os.environ[...]`,
    `getpass.getpass()`, `settings.KEY`), prose after `:` or ` is ` (letters only), or too short for its key."""
    group = "bare" if m["bare"] is not None else "dq" if m["dq"] is not None else "sq"
    a, b = m.span(group)
    text = m.string
    if group == "bare" and text[m.start() - 1:m.start()] in ("?", "&"):  # a URL query: the value ends at "&"
        b = text.find("&", a, b) if "&" in text[a:b] else b
    value = text[a:b].strip()
    if (not value or value.lower() in _NOT_A_SECRET or value[0] in "$%{<" or "{{" in value
            or set(value) <= set("*xX•.-_ ") or ">" in value):
        return None
    if group == "bare" and (text[b:b + 1] in ("(", "[") or _DOTTED_NAME.fullmatch(value)):
        return None
    if group == "bare" and m["sep"].strip() != "=" and value.isalpha():
        return None
    key = m["key"].lower()
    least = 3 if key.startswith(("pass", "pwd")) else 6 if key.endswith("secret") else 8
    return (a, b) if len(value) >= least else None


def _secret_pair_mask(m: re.Match) -> str:
    span = _secret_value(m)
    if span is None:
        return m.group(0)
    start = m.start()
    return m.string[start:span[0]] + PLACEHOLDERS["secret"] + m.string[span[1]:m.end()]


def _hex_secret_ok(m: re.Match) -> bool:
    run = m.group(0)
    return not run.isdigit() and not run.isalpha() and not _before(m, _HASH_WORD)


def _ssn_ok(m: re.Match) -> bool:
    """python-stdnum's rules, its blacklist of publicly known numbers aside; spaced or unseparated digits only
    right after an SSN word."""
    if m["sep"] != "-" and not _before(m, _SSN_WORDS):
        return False
    digits = m.group(0).replace(" ", "").replace("-", "")
    return stdnum_ssn.is_valid(digits) or digits in _KNOWN_SSNS


_KNOWN_SSNS = frozenset(("078051120", "457555462", "219099999"))  # stdnum refuses them as never someone's own


def _aws_secret_ok(m: re.Match) -> bool:
    value = m.group(0)
    if value.isalpha() or value.isdigit() or value.islower() or value.isupper() or not any(c.isdigit() for c in value):
        return False
    start = m.start()
    return _AWS_CONTEXT.search(m.string, max(0, start - _AWS_REACH), start) is not None


def _iban_mask(m: re.Match) -> str:
    """The longest valid IBAN the match starts with, dropping its trailing groups one at a time. Valid:
    the country's length and format and the mod 97 check digits; not `check_country`, which also
    asks for the bank in python-stdnum's own (incomplete) registry (it refuses `BE68 5390 0754 7034`)."""
    value = m.group(0)
    groups = value.split(" ")
    for k in range(len(groups), 0, -1):
        head = " ".join(groups[:k])
        if len(head.replace(" ", "")) < 15:
            break
        if stdnum_iban.is_valid(head, check_country=False):
            return PLACEHOLDERS["iban"] + value[len(head):]
    return value


def _phone_regions(candidate: str) -> tuple[str, ...]:
    """Where to read a candidate: international as it says, `0...` for the countries with a trunk 0,
    the rest as US numbers or Chinese mobiles."""
    s = candidate.lstrip("(")
    if s.startswith("+"):
        return ("ZZ",)
    if s.startswith("00"):
        return ("GB",)  # any region whose international prefix is 00
    if s.startswith("0"):
        return _TRUNK_ZERO_REGIONS
    return ("US", "CN")


def _phone_ok(m: re.Match, raw: str, start: int) -> bool:
    """A number libphonenumber found at `start` of the candidate `m` is a phone: not the tail of a
    longer number (`3.0244754248`), shaped as the gate requires, not a decimal (one dot), at most two
    one-digit groups (so `1 2 3 4 5 6 7 8 9 10` is none), and written as a phone number (`+`, a
    leading `0`, brackets, dashes or dots) or after a phone word."""
    if start and m.group(0)[start - 1] not in " (":
        return False
    if (_PHONE_SHAPE.search(raw) is None or raw.count(".") == 1
            or sum(len(g) == 1 for g in _DIGIT_RUN.findall(raw)) > 2):
        return False
    if _PHONE_MARK.search(raw):
        return True
    return _CN_MOBILE.fullmatch(raw) is not None or _before(m, _PHONE_WORDS, m.start() + start)


def _phone_possible(m: re.Match) -> bool:
    """Whether libphonenumber is worth asking (it costs ~0.1 ms a region): a number of digits and
    spaces alone needs a Chinese mobile's 11 digits or a phone word before it (the only place a
    phone word can be for such a number: `_phone_ok`); any other needs the gate's shape once its
    decimals, versions, dates and negative numbers are left out, and 10 digits unless it starts with
    `+` or `0` (a US or Chinese number has at least 10)."""
    candidate = m.group(0)
    if _PHONE_MARK.search(candidate) is None:
        return _CN_MOBILE.search(candidate) is not None or _before(m, _PHONE_WORDS)
    rest = " ".join(t for t in candidate.split(" ") if not _NUMBERISH.fullmatch(t.strip("()")))
    if _PHONE_SHAPE.search(rest) is None or _PHONE_MARK.search(rest) is None:
        return False
    return rest.lstrip("(")[:1] in ("+", "0") or len(_NOT_DIGIT.sub("", rest)) >= 10  # US and CN: 10 digits or more


def _phone_mask(m: re.Match) -> str:
    candidate = m.group(0)
    if not _phone_possible(m):
        return candidate
    for region in _phone_regions(candidate):
        spans = [(p.start, p.end) for p in phonenumbers.PhoneNumberMatcher(
            candidate, region, leniency=phonenumbers.Leniency.STRICT_GROUPING) if _phone_ok(m, p.raw_string, p.start)]
        if spans:
            pieces, done = [], 0
            for a, b in spans:
                pieces += [candidate[done:a], PLACEHOLDERS["phone"]]
                done = b
            return "".join(pieces) + candidate[done:]
    return candidate


def _whole(kind: str, valid: Callable[[str], bool] | None = None) -> Callable[[re.Match], str]:
    """Mask a whole match (that `valid` accepts)."""
    return lambda m: PLACEHOLDERS[kind] if valid is None or valid(m.group(0)) else m.group(0)


class _Rule(NamedTuple):
    name: str  # of its gate and its switch
    kind: str  # counted, and its placeholder
    pattern: re.Pattern
    mask: Callable[[re.Match], str]  # the match's replacement (the match itself to keep it)


_RULES = (
    _Rule("private_key", "private_key", _PRIVATE_KEY, _whole("private_key")),
    _Rule("aws_secret", "secret", _AWS_SECRET, lambda m: PLACEHOLDERS["secret"] if _aws_secret_ok(m) else m.group(0)),
    _Rule("api_key", "api_key", _API_KEY, _whole("api_key")),
    _Rule("url_credentials", "url_credentials", _URL_CREDENTIALS, lambda m: "://" + PLACEHOLDERS["url_credentials"]),
    _Rule("email", "email", _EMAIL, _whole("email")),
    _Rule("secret", "secret", _SECRET_PAIR, _secret_pair_mask),
    _Rule("hex_secret", "secret", _HEX_SECRET, lambda m: PLACEHOLDERS["secret"] if _hex_secret_ok(m) else m.group(0)),
    _Rule("ssn", "ssn", _SSN, lambda m: PLACEHOLDERS["ssn"] if _ssn_ok(m) else m.group(0)),
    _Rule("iban", "iban", _IBAN, _iban_mask),
    _Rule("cn_id", "cn_id", _CN_ID, _whole("cn_id", cn_id_ok)),
    _Rule("credit_card", "credit_card", _CARD, _whole("credit_card", _card_ok)),
    _Rule("ipv6", "ipv6", _IPV6, _whole("ipv6", _ipv6_ok)),
    _Rule("ipv4", "ipv4", _IPV4, _whole("ipv4")),
    _Rule("phone", "phone", _PHONE, _phone_mask))
# PiiConfig's switch of each rule; `ssn`, `iban` and `secret` are on where PiiConfig has no such field
_SWITCH = {"ipv4": "ip_address", "ipv6": "ip_address", "url_credentials": "secret", "hex_secret": "secret",
           "private_key": "secret", "aws_secret": "secret"}


def mask_pii(text: str, cfg: PiiConfig) -> tuple[str, dict[str, int]]:
    """The text with PII replaced by placeholders, and the count per type (only types found)."""
    return mask_pii_many([text], cfg)[0]


def mask_pii_many(texts: list[str], cfg: PiiConfig) -> list[tuple[str, dict[str, int]]]:
    """`mask_pii` of each text; the gates found for all of them at once."""
    return [_mask(text, cfg, g) for text, g in zip(texts, gates(texts))] if texts else []


def _mask(text: str, cfg: PiiConfig, g: Gates) -> tuple[str, dict[str, int]]:
    counts: dict[str, int] = {}
    for rule in _RULES:
        if not getattr(cfg, _SWITCH.get(rule.name, rule.name), True) or not _gate(rule.name, text, g):
            continue
        placeholder, n = PLACEHOLDERS[rule.kind], 0

        def replace(m: re.Match) -> str:
            nonlocal n
            old = m.group(0)
            new = rule.mask(m)
            if new != old:
                n += new.count(placeholder) - old.count(placeholder)
            return new

        spans = _tokens_around(text, "@") if rule.name == "email" else \
            _secret_windows(text) if rule.name == "secret" else None
        if spans is None:
            text = rule.pattern.sub(replace, text)
        elif spans:  # only where a match can be: the same matches, without scanning every position
            pieces, done = [], 0
            for a, b in spans:  # finditer from a to b sees the text before a, as sub on the whole text does
                for m in rule.pattern.finditer(text, a, b):
                    pieces += [text[done:m.start()], replace(m)]
                    done = m.end()
            text = "".join(pieces) + text[done:]
        if n:
            counts[rule.kind] = counts.get(rule.kind, 0) + n
    return text, counts


def _secret_windows(text: str) -> list[tuple[int, int]] | None:
    """Disjoint spans, in order, holding every `_SECRET_PAIR` match: around each `_SECRET_WORDS` hit
    in the lower-cased text. None (scan it all) when lower-casing changes the text's length."""
    low = text.lower()
    if len(low) != len(text):
        return None
    spans: list[tuple[int, int]] = []
    for hit in _SECRET_WORDS.finditer(low):
        a, b = max(0, hit.start() - _SECRET_REACH[0]), min(len(text), hit.end() + _SECRET_REACH[1])
        if spans and a <= spans[-1][1]:
            spans[-1] = (spans[-1][0], b)
        else:
            spans.append((a, b))
    return spans


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
