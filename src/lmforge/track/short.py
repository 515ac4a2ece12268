"""`LMFORGE_SHORT=1`: every benchmark (and every documented command) in a short mode, for CI.

The same command runs the same code on smaller sizes (fewer requests, steps, repeats, shorter
sequences), so a test can run what the README documents, as written, in seconds; the figures a
short run prints are not figures to quote. Each runner shrinks its own sizes through `shrink`.

    LMFORGE_SHORT=1 lmforge bench spec-decode --out runs/spec

In `track`, the bottom layer, so that any stage (training, eval, the benchmarks) can read it.
"""

from __future__ import annotations

import os


def short_mode() -> bool:
    return os.environ.get("LMFORGE_SHORT", "").strip() not in ("", "0")


def shrink(value, short_value):
    """`value`, or at most `short_value` in short mode (numbers; None counts as unbounded)."""
    if not short_mode():
        return value
    return short_value if value is None else min(value, short_value)
