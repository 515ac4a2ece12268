"""The layering of docs/architecture.md, checked on the source: no import circle, no arrow up the
layers, `tasks/` a leaf, the engine below everything that uses it, short functions in the hot paths
and imports at module top. `python -m lmforge.tools.imports` prints the same findings."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lmforge.tools import imports as arch


@pytest.fixture(scope="module")
def mods():
    return arch.load()


def test_no_import_circle(mods):
    assert arch.cycles(mods) == []


def test_no_arrow_points_up_the_layers(mods):
    assert arch.upward_arrows(mods) == []


def test_tasks_is_a_leaf_and_the_engine_knows_nothing_above_it(mods):
    def imported(package: str) -> set[str]:
        return {mods[t].package for m in mods.values() if m.package == package for t in m.imports} - {package}

    assert imported("tasks") == set()
    assert imported("engine") <= {"model", "quant", "tokenizer", "data", "perf", "track", "config", "tools"}
    assert not {m.package for m in mods.values() if any(mods[t].package == "bench" for t in m.imports)} - \
        {"bench", "cli", "quickstart"}


def test_hot_paths_have_no_function_over_60_lines(mods):
    s = arch.stats(mods)
    long = [(name, n) for name, n in s.long_functions if arch.in_hot_path(name)]
    assert long == []


def test_fewer_than_10_percent_of_imports_inside_functions(mods):
    s = arch.stats(mods)
    assert s.imports_inside_functions < 0.10 * s.imports, f"{s.imports_inside_functions} of {s.imports}"


def test_the_checker_finds_a_circle_and_an_upward_arrow(tmp_path):
    """On a made-up package: the checks above could not pass by finding nothing."""
    root = tmp_path / "lmforge"
    for rel, body in {
        "__init__.py": "",
        # a body of 61 lines (the signature, however long, is not counted), in a package's __init__
        "engine/__init__.py": "def long(\n" + "    a=1,\n" * 80 + "):\n" + "    x = 1\n" * 61
                              + "def flags(\n" + "    a=1,\n" * 80 + "):\n" + "    x = 1\n" * 60,
        "engine/a.py": "from lmforge.engine import b\nfrom lmforge.serve import app\n",
        "engine/b.py": "def f():\n    from lmforge.engine import a  # deferred, still an arrow\n",
        "serve/__init__.py": "",
        "serve/app.py": "",
        "tasks/__init__.py": "import lmforge.model\n",
        "model/__init__.py": "",
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(body))
    mods = arch.load(root)
    assert arch.cycles(mods) == [["lmforge.engine.a", "lmforge.engine.b"]]
    bad = arch.upward_arrows(mods)
    assert any("engine.a -> lmforge.serve.app" in b for b in bad)
    assert any(b.startswith("lmforge.tasks -> lmforge.model") and "leaf" in b for b in bad)
    s = arch.stats(mods)
    assert s.imports_inside_functions == 1
    assert s.long_functions == [("lmforge.engine:long", 61)] and arch.in_hot_path("lmforge.engine:long")
    assert not arch.in_hot_path("lmforge.tasks.suite:f") and not arch.in_hot_path("lmforge:f")


def test_the_command_prints_the_graph_and_exits_zero():
    proc = subprocess.run([sys.executable, "-m", "lmforge.tools.imports"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "engine -> " in proc.stdout and "0 import circle(s), 0 upward arrow(s)" in proc.stdout


def test_the_picture_in_docs_is_the_graph_of_today(mods):
    """docs/architecture.md carries `python -m lmforge.tools.imports --mermaid`; a new arrow updates it."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    block = doc.split("```mermaid\n", 1)[1].split("```", 1)[0]
    assert block == arch.to_mermaid(mods), "rerun: python -m lmforge.tools.imports --mermaid"


def redefined(source: str) -> list[str]:
    """Names a module or class body defines twice with def/class (a property's setter is not one): a
    botched edit that pasted a second copy of a class leaves the first dead and every test green."""
    import ast

    found = []

    def walk(body, where):
        seen = set()
        for n in body:
            if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            decos = {ast.unparse(d) for d in getattr(n, "decorator_list", [])}
            if n.name in seen and not any(d.endswith((".setter", ".deleter", "overload")) for d in decos):
                found.append(f"{where}{n.name}")
            seen.add(n.name)
            if isinstance(n, ast.ClassDef):
                walk(n.body, f"{where}{n.name}.")

    walk(ast.parse(source).body, "")
    return found


def test_no_module_defines_a_function_or_class_twice():
    root = Path(__file__).resolve().parents[1]
    bad = {str(p.relative_to(root)): r for d in ("src", "scripts", "tests") for p in sorted((root / d).rglob("*.py"))
           if (r := redefined(p.read_text()))}
    assert bad == {}
    assert redefined("class A:\n    def f(self): ...\nclass B: ...\nclass A: ...\n") == ["A"]
    assert redefined("class A:\n    @property\n    def x(self): ...\n    @x.setter\n    def x(self, v): ...\n"
                     "    def g(self): ...\n    def g(self): ...\n") == ["A.g"]
