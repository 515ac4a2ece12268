"""Read documents from the inputs a user names on the command line.

An input is a file (`.txt`/`.md`: the whole file is one document; `.jsonl`/`.jsonl.gz`: one
JSON object per line with a text field), a directory (searched recursively for those
extensions, in sorted order), a glob (`data/**/*.jsonl`), or a built-in source name
(`python-docs`). Every input is resolved before the first document is read, so a typo stops
the run at once with the path in the message instead of after an hour of work.

This module knows nothing about cleaning, deduplication or tokenizers; it only turns inputs
into `{id, text, meta}` documents in a deterministic order. A malformed JSONL line stops the
run with the file and line number (a later data stage may quarantine such lines instead).

    from lmforge.data.readers import iter_documents, iter_texts
    for text in iter_texts(["python-docs", "notes/", "extra.jsonl.gz"]):
        ...
"""

from __future__ import annotations

import glob
import gzip
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lmforge.data.sources import BUILTIN_SOURCES, PYTHON_DOCS, iter_python_docs

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
SUPPORTED_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES


class ReaderError(ValueError):
    """An input that exists but cannot be read as documents (bad JSON, missing field, bad type)."""


@dataclass(frozen=True)
class Source:
    """One resolved input: a built-in source name or a single file."""

    kind: str  # "builtin" | "text" | "jsonl"
    location: str  # the source name or the file path


def _kind_of(path: str) -> str | None:
    name = path.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    return None


def _files_under(directory: str) -> list[str]:
    found = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # skip .git, .cache and friends
        found += [os.path.join(root, f) for f in sorted(files)
                  if not f.startswith(".") and _kind_of(f)]
    return found


def _file_source(path: str) -> Source:
    kind = _kind_of(path)
    if kind is None:
        raise ReaderError(f"{path}: unsupported file type; expected one of "
                          f"{', '.join(SUPPORTED_SUFFIXES)} (or a directory, glob or '{PYTHON_DOCS}')")
    return Source(kind, path)


def _resolve_one(item: str) -> list[Source]:
    if item in BUILTIN_SOURCES:
        return [Source("builtin", item)]
    if os.path.isdir(item):
        files = _files_under(item)
        if not files:
            raise FileNotFoundError(f"{item}: directory holds no {', '.join(SUPPORTED_SUFFIXES)} files")
        return [Source(_kind_of(f) or "text", f) for f in files]
    if os.path.isfile(item):
        return [_file_source(item)]
    if glob.has_magic(item):
        matches = sorted(m for m in glob.glob(item, recursive=True) if os.path.isfile(m))
        files = [m for m in matches if _kind_of(m)]
        if not files:
            raise FileNotFoundError(f"{item}: glob matches no {', '.join(SUPPORTED_SUFFIXES)} files")
        return [Source(_kind_of(f) or "text", f) for f in files]
    raise FileNotFoundError(f"{item}: no such file or directory (and not a built-in source: "
                            f"{', '.join(BUILTIN_SOURCES)})")


def resolve_inputs(inputs: list[str] | tuple[str, ...] | str) -> list[Source]:
    """Expand every input to the files it names; raise on the first one that is missing."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    if not inputs:
        raise ValueError("no inputs given: name at least one file, directory, glob or "
                         f"built-in source ({', '.join(BUILTIN_SOURCES)})")
    return [source for item in inputs for source in _resolve_one(os.fspath(item))]


def _read_jsonl(path: str, text_field: str) -> Iterator[dict]:
    opener = gzip.open if path.lower().endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ReaderError(f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno}); "
                                  "fix or remove this line") from None
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                raise ReaderError(f"{path}:{lineno}: expected an object with a string field "
                                  f"'{text_field}' (choose another field with text_field)")
            meta = dict(record.get("meta") or {})
            meta.setdefault("path", path)
            yield {"id": str(record.get("id", f"{path}:{lineno}")), "text": record[text_field],
                   "meta": meta}


def _read_source(source: Source, text_field: str) -> Iterator[dict]:
    if source.kind == "builtin":
        yield from iter_python_docs()  # the only built-in source today
    elif source.kind == "jsonl":
        yield from _read_jsonl(source.location, text_field)
    else:
        text = Path(source.location).read_text(encoding="utf-8")
        yield {"id": source.location, "text": text, "meta": {"path": source.location}}


def iter_documents(inputs: list[str] | tuple[str, ...] | str, text_field: str = "text") -> Iterator[dict]:
    """Yield `{id, text, meta}` documents from all inputs, in order; every input is checked first."""
    sources = resolve_inputs(inputs)  # eager: fail before any work starts

    def generate() -> Iterator[dict]:
        for source in sources:
            yield from _read_source(source, text_field)

    return generate()


def iter_texts(inputs: list[str] | tuple[str, ...] | str, text_field: str = "text") -> Iterator[str]:
    """Yield only the text of each document from `iter_documents`."""
    documents = iter_documents(inputs, text_field)
    return (doc["text"] for doc in documents)
