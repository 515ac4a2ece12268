"""What the documentation tells a user to run: the commands of README's status table and the first example of
each docs page, collected from the Markdown itself (so a new row or a changed example is picked up), and the
scratch folder they run in. Shared by `tests/test_documented_commands.py` (README) and
`tests/test_documented_examples.py` (docs).

A docs page's first example is its first fenced block that is one: a Python block that imports something, or
the first command line of a shell block (`lmforge`, `python`, `torchrun`; `\\` continuations joined, a trailing
`# comment` dropped, a synopsis's `[optional ...]` groups dropped, so `lmforge doctor [--quick]` runs as
`lmforge doctor`). Diagrams and data formats are not examples.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
COMMAND = re.compile(r"^(\$ )?(lmforge|python3?|torchrun|make|scripts/)\b")
OPTIONAL = re.compile(r"\s*\[[^\[\]]*\]")  # an innermost [optional group] of a synopsis


def status_commands(readme: Path = ROOT / "README.md") -> list[tuple[str, str]]:
    """(stage, command) for every command in the status table's last column (backtick spans)."""
    text = readme.read_text()
    table = text[text.index("## Status"):text.index("\n## ", text.index("## Status") + 3)]
    out = []
    for line in table.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if len(cells) < 3 or cells[0] in ("stage", "---"):
            continue
        out += [(cells[0], span) for span in re.findall(r"`([^`]+)`", cells[-1]) if COMMAND.match(span)]
    return out


def status_rows(readme: Path = ROOT / "README.md") -> list[list[str]]:
    text = readme.read_text()
    table = text[text.index("## Status"):text.index("\n## ", text.index("## Status") + 3)]
    rows = [[c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]] for line in table.splitlines()
            if line.startswith("| ")]
    return [r for r in rows if r and r[0] not in ("stage", "---")]


def shell_commands(block: str) -> list[str]:
    """The command lines of a shell block, continuations joined, comments and `$ ` prompts dropped."""
    out, cur = [], ""
    for line in block.splitlines():
        line = line.strip()
        if not cur and not COMMAND.match(line):
            continue
        cur = f"{cur} {line}".strip()
        if cur.endswith("\\"):
            cur = cur[:-1].rstrip()
            continue
        out.append(re.sub(r"\s+#.*$", "", cur).removeprefix("$ ").strip())
        cur = ""
    return out


def first_example(page: Path) -> tuple[str, str] | None:
    """("python", code) or ("shell", command) for the page's first example; None when it has none."""
    for lang, body in FENCE.findall(page.read_text()):
        if lang == "python" and re.search(r"^(from|import) \w", body, re.M):
            return "python", body
        if lang in ("", "bash", "sh", "shell", "console"):
            for command in shell_commands(body):
                if re.search(r"\S\s{2,}\S", command):  # columns: a diagram's line, not a command
                    break
                while OPTIONAL.search(command):
                    command = OPTIONAL.sub("", command)
                return "shell", command
    return None


# ---- the folder the commands run in --------------------------------------------------------------


@dataclass
class Scratch:
    """A folder laid out as the docs assume (runs/model, runs/packed, configs/, scripts/, ...) and the
    environment the commands run under (LMFORGE_SHORT=1, a private LMFORGE_HOME)."""

    path: Path
    env: dict[str, str]


def make_scratch(root: Path, model: Path, packed: Path) -> Scratch:
    links = {"runs/model": model, "runs/my-model": model, "models/tiny": model, "path/to/hf-dir": model,
             "runs/packed": packed, "configs": ROOT / "configs", "scripts": ROOT / "scripts"}
    for name, target in links.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).symlink_to(target)
    home = root / "home"
    home.mkdir()
    cache = Path(os.environ.get("LMFORGE_HOME", Path.home() / ".cache" / "lmforge")) / "sources"
    if cache.is_dir():  # python-docs, already extracted: the commands need not parse the stdlib again
        (home / "sources").symlink_to(cache)
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p, "max_tokens": 4}) + "\n"
                                                for p in ("The city of", "A river", "def f(")))
    words = "the river city model token data server school new years world first state later".split()
    (root / "chat.jsonl").write_text("".join(json.dumps({"messages": [  # ~40k tokens: eight rows of 2048, packed
        {"role": "user", "content": " ".join(words[(i + k) % len(words)] for k in range(60)) + "?"},
        {"role": "assistant", "content": " ".join(words[(i * k) % len(words)] for k in range(90)) + "."}]}) + "\n"
        for i in range(200)))
    env = {**os.environ, "LMFORGE_SHORT": "1", "LMFORGE_HOME": str(home), "LMFORGE_PROGRESS_S": "5",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return Scratch(root, env)


def run_shell(scratch: Scratch, command: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`command` as a user types it, from the scratch folder, `lmforge` and `python` from this venv.
    `lmforge VERB ...` runs in this process (`lmforge.cli.app`, as the console script calls it): the same
    code without a second torch import per command; torch's process-wide settings are restored after."""
    words = command.split()
    if words[0] == "lmforge":
        return run_lmforge(scratch, [w.strip("'\"") for w in words[1:]])
    head = {"lmforge": [str(Path(sys.executable).with_name("lmforge"))], "python": [sys.executable],
            "python3": [sys.executable], "torchrun": [str(Path(sys.executable).with_name("torchrun"))]}
    argv = [*head.get(words[0], [words[0]]), *[w.strip("'\"") for w in words[1:]]]
    return subprocess.run(argv, cwd=scratch.path, env=scratch.env, capture_output=True, text=True, timeout=timeout)


def run_lmforge(scratch: Scratch, args: list[str]) -> subprocess.CompletedProcess:
    import torch
    from typer.testing import CliRunner

    from lmforge.cli import app

    threads, deterministic, cwd = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(), os.getcwd()
    os.chdir(scratch.path)
    try:
        r = CliRunner().invoke(app, args, env=scratch.env, catch_exceptions=True)
    finally:
        os.chdir(cwd)
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    err = r.stderr
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        import traceback

        err += "".join(traceback.format_exception(r.exception))
    return subprocess.CompletedProcess(["lmforge", *args], r.exit_code, r.stdout, err)


def run_server_command(scratch: Scratch, command: str, port: int, timeout: float = 120) -> str:
    """A `lmforge serve ...` example: start it (on `port`), wait until ready, one completion, SIGTERM, exit 0.
    Returns the server's stderr."""
    words = [w for w in command.split()]
    if "--port" in words:
        words[words.index("--port") + 1] = str(port)
    else:
        words += ["--port", str(port)]
    argv = [str(Path(sys.executable).with_name("lmforge")), *words[1:]]
    proc = subprocess.Popen(argv, cwd=scratch.path, env=scratch.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            assert time.time() < deadline, "the server never became ready"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return err


def run_python(scratch: Scratch, code: str, prelude: str = "", timeout: float = 300) -> subprocess.CompletedProcess:
    """A Python example as a script, after `prelude` (the names the example assumes, e.g. `input_ids`)."""
    return subprocess.run([sys.executable, "-c", prelude + "\n" + code], cwd=scratch.path, env=scratch.env,
                          capture_output=True, text=True, timeout=timeout)


def clean(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
