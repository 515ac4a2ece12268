"""lmforge's module import graph: circles, arrows that point up the layers, and two code-shape
figures (imports inside functions, long functions).

    python -m lmforge.tools.imports            # the package graph, then any problem; exit 1 on one
    python -m lmforge.tools.imports --modules  # every module's lmforge imports
    python -m lmforge.tools.imports --dot      # Graphviz source of the package graph (docs/architecture.png)
    python -m lmforge.tools.imports --mermaid  # the same graph as a Mermaid block (docs/architecture.md)
    python -m lmforge.tools.imports --stats    # imports inside functions, functions over 60 lines

Reads source files with `ast` and imports none of them, so it knows nothing about what the modules do.
Every `import` counts, at module top or inside a function: a deferred import is still an arrow.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

PKG = "lmforge"
ROOT = Path(__file__).resolve().parents[1]

# The layers, top to bottom (docs/architecture.md). A package may import packages of its own layer or
# below, never above. `tasks` and `tools` are leaves: they import nothing else from lmforge.
LAYERS: list[tuple[str, ...]] = [
    ("cli", "launch", "quickstart", "__main__"),
    ("bench",),
    ("serve", "registry"),
    ("train", "eval", "parallel"),
    ("engine",),
    ("data", "tokenizer", "quant"),
    ("model", "tasks", "perf", "track", "config", "tools", ""),
]
LAYER_NAMES = ["verbs", "benchmarks", "serving and operations", "stages", "inference engine",
               "documents, tokens, quantized weights", "foundations"]
LEAVES = ("tasks", "tools")
LONG_FUNCTION = 60  # lines
HOT_PATHS = ("engine", "serve", "train", "quant")


def layer_of(package: str) -> int:
    for i, names in enumerate(LAYERS):
        if package in names:
            return i
    raise KeyError(f"package {package!r} is in no layer of lmforge.tools.imports.LAYERS: add it there")


@dataclass
class Module:
    name: str  # lmforge.engine.llm_engine
    path: Path
    tree: ast.Module
    imports: set[str] = field(default_factory=set)  # lmforge modules it imports

    @property
    def package(self) -> str:  # engine; "" for lmforge/__init__.py
        parts = self.name.split(".")
        return parts[1] if len(parts) > 1 else ""


def _raw_targets(mod: Module):
    base = mod.name.split(".") if mod.path.name == "__init__.py" else mod.name.split(".")[:-1]
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            head = ".".join(base[: len(base) - node.level + 1]) if node.level else ""
            target = ".".join(x for x in (head, node.module or "") if x)
            yield target
            yield from (f"{target}.{a.name}" for a in node.names)


def load(root: Path = ROOT) -> dict[str, Module]:
    """Every module under `root` (the lmforge package folder) with the lmforge modules it imports."""
    mods = {}
    for path in sorted(root.rglob("*.py")):
        name = ".".join((PKG, *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
        mods[name] = Module(name, path, ast.parse(path.read_text(), str(path)))
    for mod in mods.values():
        for t in _raw_targets(mod):
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t and t != mod.name and not mod.name.startswith(t + "."):  # importing one's own parent package
                mod.imports.add(t)
    return mods


def cycles(mods: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), largest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in mods[v].imports:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in mods:
        if v not in index:
            visit(v)
    return sorted(found, key=len, reverse=True)


def upward_arrows(mods: dict[str, Module]) -> list[str]:
    """Each import that points to a higher layer, or out of a leaf package."""
    bad = []
    for mod in mods.values():
        for t in sorted(mod.imports):
            target = mods[t].package
            if mod.package in LEAVES and target != mod.package:
                bad.append(f"{mod.name} -> {t}: {mod.package}/ is a leaf and imports nothing else from lmforge")
            elif layer_of(target) < layer_of(mod.package):
                bad.append(f"{mod.name} -> {t}: {mod.package or 'lmforge'} may not import {target}/, a layer above it")
    return bad


def package_graph(mods: dict[str, Module]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for mod in mods.values():
        graph.setdefault(mod.package or PKG, set()).update(
            mods[t].package or PKG for t in mod.imports if mods[t].package != mod.package)
    return graph


def to_dot(mods: dict[str, Module]) -> str:
    graph = package_graph(mods)
    lines = ["digraph lmforge {", "  rankdir=TB; node [shape=box, fontname=Helvetica];"]
    for names in LAYERS:
        present = [n or PKG for n in names if (n or PKG) in graph]
        if present:
            lines.append("  { rank=same; " + " ".join(f'"{n}";' for n in present) + " }")
    lines += [f'  "{a}" -> "{b}";' for a in sorted(graph) for b in sorted(graph[a])]
    return "\n".join(lines + ["}"]) + "\n"


def to_mermaid(mods: dict[str, Module]) -> str:
    """The package graph as a Mermaid flowchart, one subgraph per layer, top layer first."""
    graph = package_graph(mods)
    lines = ["flowchart TB"]
    for i, names in enumerate(LAYERS):
        present = [n or PKG for n in names if (n or PKG) in graph]
        if present:
            lines.append(f"  subgraph L{i}[\"{LAYER_NAMES[i]}\"]")
            lines += [f"    {n.replace('_', '')}[{n}]" for n in present]
            lines.append("  end")
    lines += [f"  {a.replace('_', '')} --> {b.replace('_', '')}" for a in sorted(graph) for b in sorted(graph[a])]
    return "\n".join(lines) + "\n"


@dataclass
class Stats:
    imports: int = 0
    imports_inside_functions: int = 0
    long_functions: list[tuple[str, int]] = field(default_factory=list)  # (module:function, body lines)


def stats(mods: dict[str, Module]) -> Stats:
    s = Stats()
    for mod in mods.values():
        for node in ast.walk(mod.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                # the body, from its first statement: a CLI verb's signature is its list of flags, not logic
                n = node.end_lineno - node.body[0].lineno + 1
                if n > LONG_FUNCTION:
                    s.long_functions.append((f"{mod.name}:{node.name}", n))
                inner = sum(isinstance(x, (ast.Import, ast.ImportFrom)) for x in ast.walk(node))
                s.imports_inside_functions += inner
        s.imports += sum(isinstance(x, (ast.Import, ast.ImportFrom)) and not _is_future(x) for x in ast.walk(mod.tree))
    s.long_functions.sort(key=lambda x: -x[1])
    return s


def in_hot_path(name: str) -> bool:
    """Whether `module:function` (as in `Stats.long_functions`) lives in a HOT_PATHS package, its
    `__init__.py` included."""
    parts = name.partition(":")[0].split(".")
    return len(parts) > 1 and parts[1] in HOT_PATHS


def _is_future(node: ast.AST) -> bool:
    return isinstance(node, ast.ImportFrom) and node.module == "__future__"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lmforge.tools.imports", description=__doc__.split("\n")[0])
    ap.add_argument("--modules", action="store_true", help="every module's lmforge imports")
    ap.add_argument("--dot", action="store_true", help="Graphviz source of the package graph")
    ap.add_argument("--mermaid", action="store_true", help="the package graph as a Mermaid flowchart")
    ap.add_argument("--stats", action="store_true", help="imports inside functions, long functions")
    args = ap.parse_args(argv)
    mods = load()
    if args.dot:
        print(to_dot(mods), end="")
        return 0
    if args.mermaid:
        print(to_mermaid(mods), end="")
        return 0
    if args.stats:
        s = stats(mods)
        print(f"{s.imports_inside_functions} of {s.imports} imports inside functions "
              f"({100 * s.imports_inside_functions / max(s.imports, 1):.1f}%)")
        print(f"{len(s.long_functions)} functions over {LONG_FUNCTION} lines:")
        for name, n in s.long_functions:
            hot = " (hot path)" if in_hot_path(name) else ""
            print(f"  {n:4d}  {name}{hot}")
        return 0
    if args.modules:
        for name, mod in mods.items():
            print(f"{name.removeprefix(PKG + '.')}: " + ", ".join(sorted(t.removeprefix(PKG + ".") for t in mod.imports)))
    else:
        for pkg, targets in sorted(package_graph(mods).items(), key=lambda kv: layer_of(kv[0] if kv[0] != PKG else "")):
            print(f"{pkg} -> {', '.join(sorted(targets)) or '(nothing)'}")
    found, bad = cycles(mods), upward_arrows(mods)
    for c in found:
        print(f"circle of {len(c)}: " + " <-> ".join(x.removeprefix(PKG + ".") for x in c))
    for line in bad:
        print(f"upward: {line}")
    print(f"{len(found)} import circle(s), {len(bad)} upward arrow(s) among {len(mods)} modules")
    return 1 if found or bad else 0


if __name__ == "__main__":
    sys.exit(main())
