"""Normalize text: Unicode NFC, line endings, control characters, whitespace.

Rules, in order: `\r\n` and `\r` become `\n`; Unicode NFC; control characters (category Cc)
other than `\n` and `\t` are removed; every other Unicode space (NBSP, thin space, ideographic
space, ...) becomes ' '; runs of spaces between two non-space characters become one (leading
indentation is kept); trailing whitespace is stripped from each line; runs of 3+ newlines
become one blank line; the document is stripped. Tabs are kept.
It knows nothing about documents or the pipeline; a pure function of a string.
"""

from __future__ import annotations

import re
import unicodedata

_CONTROL = "".join(chr(c) for c in range(0x20) if chr(c) not in "\n\t") + "\x7f" + \
    "".join(chr(c) for c in range(0x80, 0xa0))
_SPACES = "\u00a0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u202f\u205f\u3000"
_TABLE = {**{ord(c): None for c in _CONTROL}, **{ord(c): " " for c in _SPACES}}
# Spelled so sre can skip ahead in C (a literal or character-set prefix) instead of trying every
# position, and each step runs only when the text holds what it rewrites: most texts are clean.
_TRANSLATED = re.compile("[" + re.escape(_CONTROL + _SPACES) + "]")
_TRAILING = re.compile(r"[ \t]+\n")
_BLANKS = re.compile(r"\n\n\n+")
_INNER_SPACES = re.compile(r"  (?<=\S  ) *(?=\S)")  # == (?<=\S) {2,}(?=\S), with the prefix "  "


_ASCII_CONTROL = _CONTROL[:_CONTROL.index("\x7f") + 1].encode("ascii")


def _has_translated(text: str) -> bool:
    """== `_TRANSLATED.search(text) is not None`; for ASCII text (`isascii` is O(1)) a C-level
    byte deletion, ~6x faster than sre's character-set scan."""
    if text.isascii():
        data = text.encode("ascii")
        return len(data.translate(None, _ASCII_CONTROL)) != len(data)
    return _TRANSLATED.search(text) is not None


def normalize_text(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if not text.isascii():
        text = unicodedata.normalize("NFC", text)
    if _has_translated(text):
        text = text.translate(_TABLE)
    if " \n" in text or "\t\n" in text:  # == _TRAILING.sub("\n", text); linear in runs of spaces
        lines = text.split("\n")
        text = "\n".join([*(line.rstrip(" \t") for line in lines[:-1]), lines[-1]])
    if "  " in text:
        text = _INNER_SPACES.sub(" ", text)
    return _BLANKS.sub("\n\n", text).strip()
