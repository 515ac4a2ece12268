"""Eval suites: the file format, loading with validation, and the frozen built-ins with their lock.

A suite is one JSONL file. Line 1 is a header, every further line one item:

    {"suite": "arith", "version": 1, "kind": "generate", "metric": "regex", "description": "...", ...}
    {"id": "arith-0000", "prompt": "Question: ...\\nAnswer:", "answer": "8", ...}

Kinds and the item fields they need:

    perplexity  {id, text}                          bits per byte, token perplexity
    generate    {id, prompt, answer}                exact match, the answer a regex extracts, or the
                                                    reasoning format's answer line (metric "answer");
                                                    accuracy per `category`; pass@k / maj@k with samples
                                                    k > 1; `chat: true` applies the chat template
    choice      {id, prompt, choices, answer: int}  acc, acc_norm (log-likelihood of each choice)
    stability   {id, prompt, answer}                K samples at temperature T: agreement, spread

The header carries the kind's settings (max_tokens, stop, answer_regex, chat, samples, temperature,
seed, target_delimiter), so the file alone decides how it is scored; its sha256 is recorded with
every result. The built-in suites are made by this package's generators (`lmforge.eval.builtin`
lists them), frozen in `suites/*.jsonl` and listed with their hashes in `suites/suites.lock.json`;
`verify_builtin_suites` fails when a frozen file no longer matches its lock. To change a built-in
suite, bump its version in `lmforge/eval/builtin.py` and run `lmforge eval make-suite builtins`
(docs/eval.md). Writing suite files is `lmforge.eval.suites`'s job; `render_suite` gives the text.

This module knows nothing about models, metrics or writing files.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BUILTIN_DIR = Path(__file__).with_name("suites")  # the frozen built-in suites and their lock
LOCK_FILE = "suites.lock.json"
KINDS = ("perplexity", "generate", "choice", "stability")
# `answer`: the reasoning format's final answer line, through the shared extractor (reasoning.py).
METRICS = {"perplexity": ("bits_per_byte",), "generate": ("exact_match", "regex", "answer"),
           "choice": ("acc",), "stability": ("exact_match", "regex", "answer")}
ITEM_FIELDS = {"perplexity": ("id", "text"), "generate": ("id", "prompt", "answer"),
               "choice": ("id", "prompt", "choices", "answer"), "stability": ("id", "prompt", "answer")}
# Header settings each kind understands, with their defaults.
DEFAULTS: dict[str, dict[str, Any]] = {
    "perplexity": {},
    # chat: render prompts with the model's chat template; samples > 1: pass@k and maj@k with k = samples
    "generate": {"max_tokens": 32, "stop": ["\n"], "answer_regex": r"-?\d+", "chat": False, "samples": 1,
                 "temperature": 0.0, "seed": 0},
    "choice": {"target_delimiter": " "},
    "stability": {"max_tokens": 32, "stop": ["\n"], "answer_regex": r"-?\d+", "samples": 5,
                  "temperature": 0.8, "seed": 0},
}


class SuiteError(ValueError):
    """A suite file a person must fix; the message names the file, line and field."""


@dataclass
class Suite:
    name: str
    version: int
    kind: str
    metric: str
    description: str
    items: list[dict[str, Any]]
    sha256: str
    path: Path
    settings: dict[str, Any] = field(default_factory=dict)  # the kind's header settings, defaults filled in

    @property
    def n(self) -> int:
        return len(self.items)


def dumps_line(obj: dict[str, Any]) -> str:
    """The one canonical JSON form of a suite line, so regenerating a suite gives identical bytes."""
    return json.dumps(obj, ensure_ascii=False, separators=(", ", ": "))


def render_suite(header: dict[str, Any], items: list[dict[str, Any]], where: str) -> str:
    """The file text of a suite, validated first (errors name `where`, the file about to be written):
    nothing writes a file `load_suite` would refuse."""
    text = "".join(dumps_line(o) + "\n" for o in [header, *items])
    _parse(text, where)
    return text


def load_suite(ref: str | os.PathLike) -> Suite:
    """A built-in suite by name (`arith`) or a suite file by path, validated."""
    path = resolve_suite(ref)
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SuiteError(f"{path}: not UTF-8 text ({e})") from None
    suite = _parse(text, str(path))
    suite.sha256, suite.path = hashlib.sha256(data).hexdigest(), path  # the bytes read, hashed once
    return suite


def resolve_suite(ref: str | os.PathLike) -> Path:
    path = Path(ref)
    if path.is_file():
        return path
    builtin = BUILTIN_DIR / f"{ref}.jsonl"
    if builtin.is_file():
        return builtin
    raise SuiteError(f"suite {str(ref)!r} is neither a file nor a built-in suite; built-ins: "
                     f"{', '.join(builtin_names()) or '(none)'}")


def builtin_names() -> list[str]:
    lock = read_lock()
    return sorted(lock)


def read_lock(directory: Path = BUILTIN_DIR) -> dict[str, dict[str, Any]]:
    try:
        return json.loads((directory / LOCK_FILE).read_text())
    except FileNotFoundError:
        return {}


def lock_entry(suite: Suite) -> dict[str, Any]:
    return {"file": suite.path.name, "version": suite.version, "sha256": suite.sha256, "n": suite.n}


def verify_builtin_suites(directory: Path = BUILTIN_DIR) -> list[str]:
    """Problems with the frozen suites (empty when every file matches its lock entry)."""
    lock, problems = read_lock(directory), []
    if not lock:
        return [f"{directory / LOCK_FILE}: missing or empty"]
    for name, entry in lock.items():
        path = directory / entry["file"]
        if not path.is_file():
            problems.append(f"{name}: {path} is missing")
            continue
        suite = load_suite(path)
        actual = lock_entry(suite)
        if suite.name != name or actual != entry:
            problems.append(f"{name}: {path.name} no longer matches {LOCK_FILE} (lock {entry}, file {actual}); "
                            f"a frozen suite never changes in place: bump its version in builtin.py and run "
                            f"`lmforge eval make-suite builtins`")
    listed = {e["file"] for e in lock.values()}
    for path in sorted(directory.glob("*.jsonl")):
        if path.name not in listed:
            problems.append(f"{path.name}: not listed in {LOCK_FILE}")
    return problems


def parse_suite(text: str, where: str) -> Suite:
    """A suite from its file text (errors name `where`); sha256 and path are left for the caller to set."""
    return _parse(text, where)


def _parse(text: str, where: str) -> Suite:
    lines = text.splitlines()
    if not lines:
        raise SuiteError(f"{where}: empty file; line 1 must be a header "
                         '{"suite": NAME, "version": N, "kind": KIND, "metric": METRIC}')
    objs = []
    for i, line in enumerate(lines, 1):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise SuiteError(f"{where}:{i}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise SuiteError(f"{where}:{i}: each line must be a JSON object")
        objs.append(obj)
    header, items = objs[0], objs[1:]
    for key, typ in (("suite", str), ("version", int), ("kind", str), ("metric", str)):
        if not isinstance(header.get(key), typ):
            raise SuiteError(f"{where}:1: header field {key!r} must be a {typ.__name__}, got {header.get(key)!r}")
    kind, metric = header["kind"], header["metric"]
    if kind not in KINDS:
        raise SuiteError(f"{where}:1: kind {kind!r} is not one of {', '.join(KINDS)}")
    if metric not in METRICS[kind]:
        raise SuiteError(f"{where}:1: metric {metric!r} is not valid for kind {kind!r}; use one of {METRICS[kind]}")
    if not items:
        raise SuiteError(f"{where}: the suite has a header but no items")
    seen: set[str] = set()
    for i, item in enumerate(items, 2):
        _check_item(kind, item, f"{where}:{i}")
        if item["id"] in seen:
            raise SuiteError(f"{where}:{i}: duplicate id {item['id']!r}")
        seen.add(item["id"])
    settings = {**DEFAULTS[kind], **{k: header[k] for k in DEFAULTS[kind] if k in header}}
    return Suite(name=header["suite"], version=header["version"], kind=kind, metric=metric,
                 description=header.get("description", ""), items=items, sha256="", path=Path(where),
                 settings=settings)


def _check_item(kind: str, item: dict[str, Any], where: str) -> None:
    for key in ITEM_FIELDS[kind]:
        if key not in item:
            raise SuiteError(f"{where}: item lacks field {key!r} (a {kind} item needs {ITEM_FIELDS[kind]})")
    if not isinstance(item["id"], str) or not item["id"]:
        raise SuiteError(f"{where}: 'id' must be a non-empty string")
    if kind == "perplexity":
        if not isinstance(item["text"], str) or not item["text"]:
            raise SuiteError(f"{where}: 'text' must be a non-empty string")
        return
    if not isinstance(item["prompt"], str):
        raise SuiteError(f"{where}: 'prompt' must be a string")
    if kind == "choice":
        choices = item["choices"]
        if not (isinstance(choices, list) and len(choices) >= 2 and all(isinstance(c, str) and c for c in choices)):
            raise SuiteError(f"{where}: 'choices' must be a list of at least 2 non-empty strings")
        if not (isinstance(item["answer"], int) and 0 <= item["answer"] < len(choices)):
            raise SuiteError(f"{where}: 'answer' must be the index of the correct choice (0..{len(choices) - 1})")
    elif not isinstance(item["answer"], str):
        raise SuiteError(f"{where}: 'answer' must be a string")
