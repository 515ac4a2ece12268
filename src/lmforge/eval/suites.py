"""Writing eval suites: `write_suite`, the lock of the frozen built-ins, and `make-suite` from a
prepared corpus (`make_perplexity_suite`).

The suite format itself (header, kinds, validation, loading, the built-in folder) is
`lmforge.tasks.suite`; this module only writes files in it, atomically.

This module knows nothing about models or metrics.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from lmforge.tasks.suite import LOCK_FILE, Suite, SuiteError, load_suite, lock_entry, render_suite
from lmforge.track.io import atomic_write_json, atomic_write_text, sha256_file


def write_suite(path: str | os.PathLike, header: dict[str, Any], items: list[dict[str, Any]]) -> Path:
    """Validate, then write header + items atomically; returns the path."""
    return atomic_write_text(path, render_suite(header, items, str(path)))


def write_lock(directory: Path, suites: list[Suite]) -> Path:
    return atomic_write_json(directory / LOCK_FILE, {s.name: lock_entry(s) for s in sorted(suites, key=lambda s: s.name)})


def make_perplexity_suite(prepared_dir: str | os.PathLike, out: str | os.PathLike, name: str | None = None,
                          version: int = 1, max_docs: int = 500, max_chars: int = 4000) -> Suite:
    """A frozen perplexity suite from `PREPARED_DIR/splits/val.jsonl` ({id, text, meta} lines).

    Deterministic: the first `max_docs` non-empty documents in file order, each cut to at most
    `max_chars` characters; the source file's sha256 goes into the header."""
    src = Path(prepared_dir) / "splits" / "val.jsonl"
    if not src.is_file():
        raise SuiteError(f"{src}: not found; PREPARED_DIR must be the output of `lmforge data prepare` "
                         f"(with splits/val.jsonl)")
    items = []
    with open(src, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if len(items) >= max_docs:
                break
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as e:
                raise SuiteError(f"{src}:{i}: not valid JSON ({e.msg})") from None
            if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
                raise SuiteError(f"{src}:{i}: expected an object with a string 'text' field")
            if doc["text"].strip():
                items.append({"id": str(doc.get("id", f"val-{i}")), "text": doc["text"][:max_chars]})
    if not items:
        raise SuiteError(f"{src}: no non-empty documents")
    name = name or f"val-{Path(prepared_dir).resolve().name}"
    header = {"suite": name, "version": version, "kind": "perplexity", "metric": "bits_per_byte",
              "description": f"first {len(items)} documents of {src.name} (<= {max_chars} chars each)",
              "source_sha256": sha256_file(src)}
    write_suite(out, header, items)
    return load_suite(out)
