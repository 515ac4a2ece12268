"""Built-in text sources that need no download.

`python-docs` is the default corpus of every demo: the running interpreter's standard-library
docstrings (read with `ast`, so nothing is imported or executed) plus pydoc's topic pages.
It is real English technical prose, identical on every machine with the same Python, and
about 2 MB on CPython 3.11. Parsing the library takes ~2.5 s of CPU, so the extracted documents
are cached as JSONL under `$LMFORGE_HOME/sources/` (default `~/.cache/lmforge`), keyed by the
Python version, the stdlib path and the size and mtime of every file read: a changed or
reinstalled library is a new key. A cache file appears only once an extraction ran to its end
(atomic rename), so a partial read never leaves a truncated cache behind. Delete the folder to
drop it. Next to it, `python_docs_snapshot` keeps a `marshal` file (same name, `.marshal`) of the
documents and of a digest the caller computed over them (named by a tag), tied to the JSONL's size
and mtime: a warm `lmforge data prepare python-docs` loads it instead of parsing 2 MB of JSON and
re-hashing every document for the manifest. This module knows nothing about tokenizers or models.

    from lmforge.data.sources import iter_python_docs
    docs = list(iter_python_docs())   # [{"id", "text", "meta"}, ...]
"""

from __future__ import annotations

import ast
import hashlib
import json
import marshal
import os
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from lmforge.perf.hardware import lmforge_home

PYTHON_DOCS = "python-docs"
BUILTIN_SOURCES = (PYTHON_DOCS,)

# Folders of the standard library that hold tests, GUI demos or vendored tools rather than
# documentation of the library itself.
_SKIP_DIRS = {"test", "tests", "idlelib", "turtledemo", "site-packages", "dist-packages",
              "__pycache__", "ensurepip", "lib2to3", "venv", "pydoc_data"}


def _module_docs(path: str, rel: str) -> str | None:
    """All docstrings of one module (module, classes, functions) joined as one document."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return None
    parts: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and doc.strip():
                parts.append(doc.strip())
    return "\n\n".join(parts) if parts else None


def _stdlib_files(stdlib: str) -> list[tuple[str, str]]:
    """(path, relative path) of every standard-library module read, in a fixed order."""
    found = []
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("config-"))
        rel = os.path.relpath(root, stdlib)  # once per folder: relpath costs ~4 us a call
        found += [(os.path.join(root, n), n if rel == os.curdir else os.path.join(rel, n))
                  for n in sorted(files) if n.endswith(".py")]
    return found


def _extract(files: list[tuple[str, str]], version: str) -> Iterator[dict]:
    for path, rel in files:
        text = _module_docs(path, rel)
        if text:
            yield {"id": f"python-docs/{rel}", "text": text,
                   "meta": {"source": PYTHON_DOCS, "python": version, "path": rel}}
    try:
        from pydoc_data.topics import topics  # deferred: optional (stripped by some distributions), 1 MB
    except ImportError:  # some distributions strip pydoc_data
        return
    for key in sorted(topics):
        text = topics[key].strip()
        if text:
            yield {"id": f"python-docs/topics/{key}", "text": text,
                   "meta": {"source": PYTHON_DOCS, "python": version, "topic": key}}


def _cache_path(stdlib: str, files: list[tuple[str, str]], version: str) -> Path:
    h = hashlib.sha256(f"python-docs v1\0{sys.version}\0{stdlib}\n".encode())
    for path in [p for p, _ in files] + [os.path.join(stdlib, "pydoc_data", "topics.py")]:
        try:
            st = os.stat(path)
            h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        except OSError:
            h.update(f"{path}\0-\n".encode())
    return lmforge_home() / "sources" / f"python-docs-{version}-{h.hexdigest()[:16]}.jsonl"


def _write_through(docs: Iterable[dict], cache: Path) -> Iterator[dict]:
    """Yield `docs`, writing them to `cache` (renamed into place only when all were yielded)."""
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{cache.name}.", suffix=".tmp", dir=cache.parent)
    except OSError:  # read-only home: extract without caching
        yield from docs
        return
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for doc in docs:
                f.write(json.dumps(doc, ensure_ascii=False) + "\n")
                yield doc
        os.replace(tmp, cache)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _locate() -> tuple[list[tuple[str, str]], str, Path]:
    """(stdlib files, Python version, cache path) of this interpreter."""
    stdlib = sysconfig.get_paths()["stdlib"]
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    files = _stdlib_files(stdlib)
    return files, version, _cache_path(stdlib, files, version)


def iter_python_docs() -> Iterator[dict]:
    """Yield the standard library's documentation as `{id, text, meta}` documents, in a fixed order."""
    yield from _iter_python_docs(*_locate())


def _iter_python_docs(files: list[tuple[str, str]], version: str, cache: Path) -> Iterator[dict]:
    if cache.is_file():
        with open(cache, encoding="utf-8") as f:
            yield from map(json.loads, f)
        return
    yield from _write_through(_extract(files, version), cache)


def _snapshot_path(cache: Path) -> Path:
    return cache.with_name(cache.name.removesuffix(".jsonl") + ".marshal")


def _load_snapshot(path: Path, stamp: list[int], tag: str) -> tuple[list[dict], Any] | None:
    try:
        with open(path, "rb") as f:
            saved = marshal.load(f)
        if saved["stamp"] == stamp and saved["tag"] == tag and isinstance(saved["docs"], list):
            return saved["docs"], saved["digest"]
    except (OSError, EOFError, ValueError, TypeError, KeyError):
        pass
    return None


def _save_snapshot(path: Path, stamp: list[int], tag: str, docs: list[dict], digest: Any) -> None:
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError:
        return
    try:
        with os.fdopen(fd, "wb") as f:
            marshal.dump({"stamp": stamp, "tag": tag, "docs": docs, "digest": digest}, f)
        os.replace(tmp, path)
    except (OSError, ValueError):
        pass
    finally:
        Path(tmp).unlink(missing_ok=True)


def python_docs_snapshot(tag: str, digest: Callable[[list[dict]], Any]) -> tuple[list[dict], Any]:
    """(every document of `iter_python_docs()`, `digest(documents)`), from the `.marshal` file next to
    the JSONL cache when it was written from that very cache file (its size and mtime) with a digest
    named `tag`; else computed, and saved there. `tag` must change whenever `digest` does."""
    files, version, cache = _locate()
    path = _snapshot_path(cache)
    try:
        st = os.stat(cache)
        stamp = [st.st_size, st.st_mtime_ns]
        loaded = _load_snapshot(path, stamp, tag)
        if loaded is not None:
            return loaded
    except OSError:
        pass
    docs = list(_iter_python_docs(files, version, cache))
    value = digest(docs)
    try:
        st = os.stat(cache)  # written by the call above when it was missing
    except OSError:  # no cache (read-only home): nothing to keep a snapshot of
        return docs, value
    _save_snapshot(path, [st.st_size, st.st_mtime_ns], tag, docs, value)
    return docs, value
