"""Built-in text sources that need no download.

`python-docs` is the default corpus of every demo: the running interpreter's standard-library
docstrings (read with `ast`, so nothing is imported or executed) plus pydoc's topic pages.
It is real English technical prose, identical on every machine with the same Python, and
about 2 MB on CPython 3.11. This module knows nothing about tokenizers or models.

    from lmforge.data.sources import iter_python_docs
    docs = list(iter_python_docs())   # [{"id", "text", "meta"}, ...]
"""

from __future__ import annotations

import ast
import os
import sys
import sysconfig
from collections.abc import Iterator

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


def iter_python_docs() -> Iterator[dict]:
    """Yield the standard library's documentation as `{id, text, meta}` documents, in a fixed order."""
    stdlib = sysconfig.get_paths()["stdlib"]
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("config-"))
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            rel = os.path.relpath(path, stdlib)
            text = _module_docs(path, rel)
            if text:
                yield {"id": f"python-docs/{rel}", "text": text,
                       "meta": {"source": PYTHON_DOCS, "python": version, "path": rel}}
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data
        return
    for key in sorted(topics):
        text = topics[key].strip()
        if text:
            yield {"id": f"python-docs/topics/{key}", "text": text,
                   "meta": {"source": PYTHON_DOCS, "python": version, "topic": key}}
