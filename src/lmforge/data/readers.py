"""Read documents from the inputs a user names on the command line.

An input is a file (`.txt`/`.md`: the whole file is one document, or one per blank-line-separated
block with `txt_mode="blocks"`; `.jsonl`/`.jsonl.gz`: one JSON object per line with a text field;
`.parquet`: one row per document, when `pyarrow` is installed), a directory (searched recursively for those
extensions, in sorted order), a glob (`data/**/*.jsonl`), or a built-in source name
(`python-docs`). Every input is resolved before the first document is read, so a typo stops
the run at once with the path in the message instead of after an hour of work.

This module knows nothing about cleaning, deduplication or tokenizers; it only turns inputs
into `{id, text, meta}` documents in a deterministic order. A malformed JSONL line stops the
run with the file and line number, unless the caller passes `quarantine=` to `iter_records`,
which then receives `{path, line, error}` for the line and reading goes on (`data prepare`).
A document's id is its `id` field when present, else `path:line` (`path:row` for parquet,
`path#block` for text blocks): stable for the same inputs.

    from lmforge.data.readers import iter_documents, iter_texts
    for text in iter_texts(["python-docs", "notes/", "extra.jsonl.gz"]):
        ...
"""

from __future__ import annotations

import contextlib
import errno
import glob
import gzip
import hashlib
import io
import json
import logging
import os
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from lmforge.data.sources import BUILTIN_SOURCES, PYTHON_DOCS, iter_python_docs

log = logging.getLogger("lmforge.data")

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
PARQUET_SUFFIXES = (".parquet",)
SUPPORTED_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES


class ReaderError(ValueError):
    """An input that exists but cannot be read as documents (bad JSON, missing field, bad type)."""


@dataclass(frozen=True)
class Source:
    """One resolved input: a built-in source name or a single file (or, for a parallel reader, the
    lines of an uncompressed .jsonl file from byte `start` to `end`, `start` being line `first_line`)."""

    kind: str  # "builtin" | "text" | "jsonl" | "parquet"
    location: str  # the source name or the file path
    start: int = 0
    end: int | None = None
    first_line: int = 1


def is_uri(location: str) -> bool:
    """A `pyarrow.fs` URI (s3://bucket/key, gs://, hdfs://, file:///path) rather than a local path."""
    return "://" in location


def _filesystem(uri: str) -> tuple[Any, str]:
    try:
        import pyarrow.fs  # deferred: optional dependency, only for URI inputs
    except ImportError:
        raise ReaderError(f"{uri}: reading URIs needs pyarrow, which is not installed; run "
                          "`pip install pyarrow` (or copy the file to a local path)") from None
    try:
        return pyarrow.fs.FileSystem.from_uri(uri)
    except (ValueError, OSError) as e:  # ArrowInvalid is a ValueError: unknown scheme, bad URI
        raise ReaderError(f"{uri}: {e}") from None


def open_binary(location: str) -> BinaryIO:
    """A local file or a `pyarrow.fs` URI, open for reading (seekable, line-iterable)."""
    if not is_uri(location):
        return open(location, "rb")
    fs, path = _filesystem(location)
    return io.BufferedReader(fs.open_input_file(path))


def file_size(location: str) -> int:
    if not is_uri(location):
        return os.path.getsize(location)
    fs, path = _filesystem(location)
    return fs.get_file_info(path).size


def file_sha256(location: str) -> str:
    h = hashlib.sha256()
    with open_binary(location) as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def byte_ranges(source: Source, size: int) -> list[Source]:
    """An uncompressed .jsonl file as ranges of about `size` bytes cut at line starts (their
    `first_line` still 1: count each range's lines with `count_lines` and add them up); any other
    source as itself. Reading the ranges in order gives the documents of the whole file."""
    if source.kind != "jsonl" or source.location.lower().endswith(".gz"):
        return [source]
    total = file_size(source.location)
    cuts = [0]
    with open_binary(source.location) as f:
        for k in range(1, -(-total // size)):
            f.seek(max(k * size, cuts[-1]))
            f.readline()  # to the start of the next line
            if f.tell() < total and f.tell() > cuts[-1]:
                cuts.append(f.tell())
    return [Source("jsonl", source.location, a, b) for a, b in zip(cuts, cuts[1:] + [total])]


def count_lines(source: Source) -> int:
    """Newlines in a byte range of a file (`byte_ranges`)."""
    n, left = 0, (source.end if source.end is not None else file_size(source.location)) - source.start
    with open_binary(source.location) as f:
        f.seek(source.start)
        while left > 0:
            block = f.read(min(left, 1 << 22))
            if not block:
                break
            n += block.count(b"\n")
            left -= len(block)
    return n


def _kind_of(path: str) -> str | None:
    name = path.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    return None


def _files_under(directory: str) -> list[str]:
    found = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # skip .git, .cache and friends
        found += [os.path.join(root, f) for f in sorted(files)
                  if not f.startswith(".") and _kind_of(f) and _resolves(os.path.join(root, f))]
    return found


def _resolves(path: str) -> bool:
    """False (with a warning) for a symlink that leads nowhere: a loop or a missing target. Such an
    entry in a directory or glob is skipped and reported, not taken for a permissions problem."""
    if os.path.exists(path):
        return True
    why = "a symlink loop" if os.path.islink(path) and _is_loop(path) else "a symlink to a missing file"
    log.warning("skipping %s: %s", path, why)
    return False


def _is_loop(path: str) -> bool:
    try:
        os.stat(path)
    except OSError as e:
        return e.errno == errno.ELOOP
    return False


def canonical_path(path: str) -> str:
    """The one form a file's path takes in ids, `meta.path` and manifests: absolute, symlinks resolved,
    so `data/x.jsonl`, `./data/x.jsonl` and a link to it give the same documents and `data_hash`."""
    return os.path.realpath(path)


def _file_source(path: str) -> Source:
    kind = _kind_of(path)
    if kind is None:
        raise ReaderError(f"{path}: unsupported file type; expected one of "
                          f"{', '.join(SUPPORTED_SUFFIXES)} (or a directory, glob or '{PYTHON_DOCS}')")
    return Source(kind, path if is_uri(path) else canonical_path(path))


def _resolve_uri(uri: str) -> list[Source]:
    """The files a URI names: itself, or every supported file under it (sorted by path)."""
    import pyarrow.fs  # deferred: optional dependency (_filesystem says how to install it)

    fs, path = _filesystem(uri)
    scheme = uri.split("://", 1)[0]
    info = fs.get_file_info(path)
    if info.type == pyarrow.fs.FileType.NotFound:
        raise FileNotFoundError(f"{uri}: no such file or directory")
    if info.type == pyarrow.fs.FileType.File:
        return [_file_source(uri)]
    found = fs.get_file_info(pyarrow.fs.FileSelector(path, recursive=True))
    files = sorted(i.path for i in found if i.type == pyarrow.fs.FileType.File and _kind_of(i.path)
                   and not any(part.startswith(".") for part in i.path[len(path):].split("/")))
    if not files:
        raise FileNotFoundError(f"{uri}: directory holds no {', '.join(SUPPORTED_SUFFIXES)} files")
    return [Source(_kind_of(f) or "text", f"{scheme}://{f}") for f in files]


def _resolve_one(item: str) -> list[Source]:
    if item in BUILTIN_SOURCES:
        return [Source("builtin", item)]
    if is_uri(item):
        return _resolve_uri(item)
    if os.path.isdir(item):
        files = _files_under(item)
        if not files:
            raise FileNotFoundError(f"{item}: directory holds no {', '.join(SUPPORTED_SUFFIXES)} files")
        return [Source(_kind_of(f) or "text", canonical_path(f)) for f in files]
    if os.path.isfile(item):
        return [_file_source(item)]
    if os.path.islink(item):
        raise ReaderError(f"{item}: {'a symlink loop' if _is_loop(item) else 'a symlink to a missing file'} "
                          f"(it points at {os.readlink(item)}); fix the link or leave it out")
    if glob.has_magic(item):
        matches = sorted(m for m in glob.glob(item, recursive=True) if os.path.isfile(m) or os.path.islink(m))
        files = [m for m in matches if _kind_of(m) and _resolves(m)]
        if not files:
            raise FileNotFoundError(f"{item}: glob matches no {', '.join(SUPPORTED_SUFFIXES)} files")
        return [Source(_kind_of(f) or "text", canonical_path(f)) for f in files]
    raise FileNotFoundError(f"{item}: no such file or directory (and not a built-in source: "
                            f"{', '.join(BUILTIN_SOURCES)})")


def _check_readable(source: Source) -> None:
    if source.kind == "builtin":
        return
    if not is_uri(source.location) and not os.access(source.location, os.R_OK):
        raise ReaderError(f"{source.location}: file exists but is not readable (permissions); "
                          "fix its permissions or leave it out")
    if source.kind == "parquet":
        try:
            import pyarrow.parquet  # noqa: F401  # deferred: optional dependency, only for .parquet inputs
        except ImportError:
            raise ReaderError(f"{source.location}: reading .parquet needs pyarrow, which is not "
                              "installed; run `pip install pyarrow` (or convert the file to .jsonl)") from None


def resolve_inputs(inputs: list[str] | tuple[str, ...] | str) -> list[Source]:
    """Expand every input to the files it names; raise on the first one that is missing or unreadable."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    if not inputs:
        raise ValueError("no inputs given: name at least one file, directory, glob or "
                         f"built-in source ({', '.join(BUILTIN_SOURCES)})")
    sources = [source for item in inputs for source in _resolve_one(os.fspath(item))]
    for source in sources:
        _check_readable(source)
    return sources


Quarantine = Callable[[dict], None]


def _bad_line(path: str, lineno: int, error: str, quarantine: Quarantine | None) -> None:
    if quarantine is None:
        raise ReaderError(f"{path}:{lineno}: {error}")
    quarantine({"path": path, "line": lineno, "error": error})


def _jsonl_record(path: str, lineno: int, raw: bytes, text_field: str) -> dict | str:
    """The document of one line, or the error message that explains why there is none."""
    try:
        record = json.loads(raw)
    except UnicodeDecodeError as e:
        return f"invalid UTF-8 at byte {e.start}; re-encode the file as UTF-8"
    except json.JSONDecodeError as e:
        return f"malformed JSON ({e.msg} at column {e.colno}); fix or remove this line"
    if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
        return (f"expected an object with a string field '{text_field}' "
                "(choose another field with text_field)")
    meta = dict(record.get("meta") or {}) if isinstance(record.get("meta"), dict) else {}
    meta.setdefault("path", path)
    return {"id": str(record.get("id", f"{path}:{lineno}")), "text": record[text_field], "meta": meta}


def _read_jsonl(path: str, text_field: str, quarantine: Quarantine | None = None, start: int = 0,
                end: int | None = None, first_line: int = 1) -> Iterator[dict]:
    gz = path.lower().endswith(".gz")
    lineno = first_line - 1
    with open_binary(path) as raw, (gzip.GzipFile(fileobj=raw) if gz else contextlib.nullcontext(raw)) as f:
        f.seek(start)
        pos = start
        try:
            for lineno, raw in enumerate(f, start=first_line):
                if end is not None and pos >= end:
                    break
                pos += len(raw)
                if not raw.strip():
                    continue
                doc = _jsonl_record(path, lineno, raw, text_field)
                if isinstance(doc, str):
                    _bad_line(path, lineno, doc, quarantine)
                else:
                    yield doc
        except (EOFError, OSError, zlib.error) as e:  # truncated or corrupt gzip stream
            _bad_line(path, lineno + 1, f"file unreadable from here on ({type(e).__name__}: {e}); "
                      "the rest of the file is skipped; re-create it", quarantine)


def _read_parquet(path: str, text_field: str, quarantine: Quarantine | None = None) -> Iterator[dict]:
    import pyarrow.parquet as pq  # deferred: optional dependency, only for .parquet inputs

    table = pq.ParquetFile(open_binary(path) if is_uri(path) else path)
    if text_field not in table.schema_arrow.names:
        raise ReaderError(f"{path}: no column '{text_field}' (columns: {', '.join(table.schema_arrow.names)}); "
                          "choose one with read.text_field")
    columns = [c for c in (text_field, "id") if c in table.schema_arrow.names]
    row = 0
    for batch in table.iter_batches(columns=columns):
        data = batch.to_pydict()
        for i, text in enumerate(data[text_field]):
            row += 1
            if not isinstance(text, str):
                _bad_line(path, row, f"column '{text_field}' is {type(text).__name__}, not a string", quarantine)
                continue
            ident = data["id"][i] if "id" in data and data["id"][i] is not None else f"{path}:{row}"
            yield {"id": str(ident), "text": text, "meta": {"path": path}}


def _read_text(path: str, txt_mode: str, quarantine: Quarantine | None) -> Iterator[dict]:
    try:
        with io.TextIOWrapper(open_binary(path), encoding="utf-8") as f:  # universal newlines, as read_text
            text = f.read()
    except UnicodeDecodeError as e:
        _bad_line(path, 1, f"invalid UTF-8 at byte {e.start}; re-encode the file as UTF-8", quarantine)
        return
    if txt_mode == "file":
        yield {"id": path, "text": text, "meta": {"path": path}}
        return
    blocks = [b for b in re.split(r"\n[ \t]*\n", text.replace("\r\n", "\n")) if b.strip()]
    for k, block in enumerate(blocks):
        yield {"id": f"{path}#{k}", "text": block, "meta": {"path": path, "block": k}}


def _read_source(source: Source, text_field: str, txt_mode: str = "file",
                 quarantine: Quarantine | None = None) -> Iterator[dict]:
    if source.kind == "builtin":
        yield from iter_python_docs()  # the only built-in source today
    elif source.kind == "jsonl":
        yield from _read_jsonl(source.location, text_field, quarantine, source.start, source.end, source.first_line)
    elif source.kind == "parquet":
        yield from _read_parquet(source.location, text_field, quarantine)
    else:
        yield from _read_text(source.location, txt_mode, quarantine)


def iter_records(sources: list[Source], text_field: str = "text", txt_mode: str = "file",
                 quarantine: Quarantine | None = None) -> Iterator[dict]:
    """Documents of already-resolved sources; bad lines go to `quarantine` (or raise when None)."""
    for source in sources:
        yield from _read_source(source, text_field, txt_mode, quarantine)


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
