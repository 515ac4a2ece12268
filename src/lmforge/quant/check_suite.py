"""The frozen `quant-check` suite: 240 texts in three categories a quantized model must not lose,
for per-category perplexity and greedy-continuation agreement (`lmforge eval diff`).

  * prose — English paragraphs from a fixed grammar (names, numbers, subordinate clauses), so the
    category does not depend on the interpreter;
  * code  — Python source from the interpreter's standard-library `.py` files: 24-line windows of
    function bodies with docstrings stripped (comments kept), from a fixed list of modules;
  * math  — arithmetic with written-out reasoning that ends in `Answer: N`; the `prompt` field (the
    text up to `Answer:`) and `answer` let a comparison count newly wrong / newly right items.

Generated once with a fixed seed and frozen in `lmforge/quant/suites/quant-check.jsonl`, its sha256
pinned below (`SUITE_PATH`, `SHA256`; a test checks the generator still reproduces the bytes). It is
an ordinary perplexity suite, so `lmforge eval MODEL --suite PATH` scores it too. Regenerate only by
bumping VERSION (then update SHA256):

    python -m lmforge.quant.check_suite        # writes the file, prints its sha256

The suite format is `lmforge.tasks.suite`. This module knows nothing about models.
"""

from __future__ import annotations

import ast
import random
import sysconfig
from pathlib import Path

from lmforge.tasks.suite import Suite, SuiteError, load_suite, render_suite
from lmforge.track.io import atomic_write_text, sha256_file

NAME, VERSION = "quant-check", 1
SUITE_PATH = Path(__file__).with_name("suites") / f"{NAME}.jsonl"
SHA256 = "44bd60a55e0139825ba4d12499130232f7845dff78b34fe4c3f4b63869486449"
PER_CATEGORY = 80
CODE_MODULES = ("textwrap", "shlex", "fnmatch", "glob", "heapq", "bisect", "statistics", "fractions", "colorsys",
                "difflib", "string", "calendar", "csv", "json/encoder", "json/decoder", "argparse", "dataclasses",
                "functools", "gettext", "ipaddress", "netrc", "pprint", "queue", "sched", "secrets", "tokenize",
                "tracemalloc", "uuid", "zipfile/__init__", "configparser")

NOUNS = ["river", "teacher", "engine", "garden", "library", "harbor", "station", "window", "market", "bridge",
         "student", "village", "machine", "letter", "forest", "doctor", "kitchen", "signal", "mountain", "museum"]
ADJS = ["quiet", "old", "bright", "narrow", "careful", "distant", "small", "heavy", "gentle", "sudden"]
VERBS = ["follows", "opens", "watches", "repairs", "crosses", "visits", "describes", "measures", "carries", "finds"]
NAMES = ["Ada", "Grace", "Linus", "Guido", "Barbara", "Ken", "Margaret", "Dennis", "Frances", "Alan"]


def _prose(rng: random.Random, i: int) -> dict:
    def sentence() -> str:
        kind = rng.randrange(4)
        a, b = rng.sample(NOUNS, 2)
        if kind == 0:
            return f"The {rng.choice(ADJS)} {a} {rng.choice(VERBS)} the {b} near the {rng.choice(NOUNS)}."
        if kind == 1:
            n = rng.randrange(2, 40)
            return f"{rng.choice(NAMES)} counted {n} {a}s before the {b} closed for the evening."
        if kind == 2:
            return (f"Because the {a} was {rng.choice(ADJS)}, {rng.choice(NAMES)} wrote a letter "
                    f"about the {rng.choice(ADJS)} {b}.")
        return f"In {rng.randrange(1900, 2030)}, the {a} of the {b} {rng.choice(VERBS)} a {rng.choice(ADJS)} {a}."
    return {"id": f"{NAME}-prose-{i:03d}", "category": "prose", "text": " ".join(sentence() for _ in range(5))}


def _math(rng: random.Random, i: int) -> dict:
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randrange(3, 30), rng.randrange(3, 13)
        steps = f"{a} * {b} = {a} * {b // 2 * 2} + {a} * {b % 2} = {a * (b // 2 * 2)} + {a * (b % 2)}"
        ans = a * b
    else:
        a, b = rng.randrange(10, 999), rng.randrange(10, 999)
        if op == "-" and b > a:
            a, b = b, a
        ans = a + b if op == "+" else a - b
        t = (a // 10 * 10, a % 10)
        steps = f"{a} {op} {b} = {t[0]} {op} {b} + {t[1]} = {t[0] + b if op == '+' else t[0] - b} + {t[1]}"
    prompt = f"Question: what is {a} {op} {b}? Reasoning: {steps} = {ans}. Answer:"
    return {"id": f"{NAME}-math-{i:03d}", "category": "math", "text": f"{prompt} {ans}", "prompt": prompt,
            "answer": str(ans)}


def _strip_docstrings(src: str) -> list[str]:
    """Lines of `src` with every docstring's lines removed (comments and code kept)."""
    tree = ast.parse(src)
    drop: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant) \
                    and isinstance(first.value.value, str):
                drop.update(range(first.lineno, first.end_lineno + 1))
    return [line for n, line in enumerate(src.splitlines(), 1) if n not in drop]


def _code_items(rng: random.Random) -> list[dict]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    windows = []
    for mod in CODE_MODULES:
        path = stdlib / f"{mod}.py"
        if not path.is_file():
            continue
        lines = [ln for ln in _strip_docstrings(path.read_text(encoding="utf-8")) if ln.strip()]
        for start in range(0, max(0, len(lines) - 24), 24):
            block = lines[start:start + 24]
            if sum(ln.lstrip().startswith(("def ", "return", "if ", "for ")) for ln in block) >= 2:
                windows.append((f"{mod}.py:{start}", "\n".join(block)))
    picked = rng.sample(windows, min(PER_CATEGORY, len(windows)))
    return [{"id": f"{NAME}-code-{i:03d}", "category": "code", "source": src, "text": text}
            for i, (src, text) in enumerate(picked)]


def build_items(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    prose = [_prose(rng, i) for i in range(PER_CATEGORY)]
    math = [_math(rng, i) for i in range(PER_CATEGORY)]
    return prose + _code_items(rng) + math


def header() -> dict:
    return {"suite": NAME, "version": VERSION, "kind": "perplexity", "metric": "bits_per_byte",
            "description": "quantization check: prose (fixed grammar), code (stdlib .py, docstrings stripped), "
                           "math (arithmetic with reasoning, 'Answer: N'); per-category perplexity and greedy "
                           "agreement with `lmforge eval diff`"}


def load() -> Suite:
    """The frozen suite, refused when its bytes no longer match SHA256."""
    suite = load_suite(SUITE_PATH)
    if suite.sha256 != SHA256:
        raise SuiteError(f"{SUITE_PATH}: sha256 {suite.sha256[:12]} != pinned {SHA256[:12]}; a frozen suite never "
                         "changes in place: bump VERSION in lmforge/quant/check_suite.py and regenerate")
    return suite


def write(path: Path = SUITE_PATH) -> Path:
    """Generate the suite and write it atomically (validated first, as `lmforge.eval.suites.write_suite` does)."""
    return atomic_write_text(path, render_suite(header(), build_items(), str(path)))


def main() -> None:
    path = write()
    print(f"{path}: sha256 {sha256_file(path)}")


if __name__ == "__main__":
    main()
