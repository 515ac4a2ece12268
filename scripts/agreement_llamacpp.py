"""Greedy agreement with llama.cpp on real GGUF files: the same token ids in, the generated ids compared (issue 41).

For each file, `llama-server` is started on it and each prompt (a chat question rendered with the file's own chat
template by lmforge's tokenizer, sent as token ids to llama-server's `/completion`, temperature 0, `n_predict`
tokens, EOS respected) is answered by both engines; lmforge runs `LLM.generate` on the same ids with its default
flags (`--quant-activations auto`: int8 activations, as llama.cpp's own q8_0 / q8_K) and, with `--exact`, with
`quant_activations="none"` too. Reported per file and lmforge path: prompts whose whole answer is identical, and
the mean share of leading tokens the two answers have in common (greedy decoding parts for good at its first
near-tie, so the prefix is the fairer measure of how close two engines' numbers are). A benchmark-only script:
llama.cpp is never a test dependency.

    python scripts/agreement_llamacpp.py FILE.gguf ... --llama-server PATH/llama-server --out runs/agreement
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Annotated

import typer

from lmforge.bench.report import emit, provenance
from lmforge.engine import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?", "What is the capital of Japan?", "Who wrote Romeo and Juliet?",
    "What is the chemical symbol for gold?", "How many days are in a week?", "Which ocean is the largest?",
    "What is the boiling point of water in Celsius?", "Name three primary colors.",
    "Explain photosynthesis in one sentence.", "What is 12 plus 7?", "Give me a synonym for happy.",
    "What language is spoken in Brazil?", "Write a haiku about the sea.", "What is the tallest mountain in the world?",
    "Why is the sky blue?", "List two uses of copper.",
]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def llama_answers(server: str, f: Path, prompts: list[list[int]], n: int, threads: int) -> list[list[int]]:
    port = _port()
    proc = subprocess.Popen([server, "-m", str(f), "--port", str(port), "-t", str(threads), "-c", "4096",
                             "--host", "127.0.0.1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(0.2)
        out = []
        for p in prompts:
            r = _post(f"http://127.0.0.1:{port}/completion", {"prompt": p, "n_predict": n, "temperature": 0,
                                                              "top_k": 1, "cache_prompt": False, "return_tokens": True,
                                                              "samplers": ["top_k"]})
            out.append(list(r["tokens"]))
        return out
    finally:
        proc.terminate()
        proc.wait()


def _prefix(a: list[int], b: list[int]) -> float:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n / max(len(a), len(b), 1)


def compare(f: Path, server: str, n: int, threads: int, exact: bool) -> list[dict]:
    rows = []
    for qa in (("auto", "none") if exact else ("auto",)):
        llm = LLM(str(f), quant_activations=qa, enable_prefix_caching=False)
        tok = llm.get_tokenizer()
        prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                      add_generation_prompt=True), add_special_tokens=False)
                   for q in QUESTIONS]
        ours = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n),
                                                             use_tqdm=False)]
        eos = set(llm.llm_engine.eos_token_ids)
        ours = [[t for t in a if t not in eos] for a in ours]
        theirs = llama_answers(server, f, prompts, n, threads) if not rows else rows[0]["_theirs"]
        theirs = [[t for t in a if t not in eos] for a in theirs]
        rows.append({"file": f.name, "lmforge": llm.stats()["linear_backend"], "quant_activations": qa,
                     "identical": sum(a == b for a, b in zip(ours, theirs)), "prompts": len(prompts),
                     "mean_common_prefix": round(sum(_prefix(a, b) for a, b in zip(ours, theirs)) / len(prompts), 3),
                     "_theirs": theirs})
        print(f"{f.name} {qa}: {rows[-1]['identical']}/{len(prompts)} identical, common prefix "
              f"{rows[-1]['mean_common_prefix']:.0%}", flush=True)
    for r in rows:
        r.pop("_theirs")
    return rows


def to_markdown(rep: dict) -> str:
    lines = ["# Greedy agreement with llama.cpp (same token ids in)", "",
             f"{rep['provenance']['machine']}, {rep['provenance']['date']}; {rep['tokens']} new tokens a prompt", "",
             "| file | lmforge activations | identical answers | mean common prefix |", "| --- | --- | ---: | ---: |"]
    for r in rep["rows"]:
        lines.append(f"| {r['file']} | {r['quant_activations']} | {r['identical']}/{r['prompts']} | "
                     f"{r['mean_common_prefix']:.0%} |")
    return "\n".join(lines) + "\n"


def main(files: list[Path],
         llama_server: Annotated[Path, typer.Option(help="A llama-server binary (docs/engine.md builds one).")],
         out: Annotated[Path, typer.Option(help="Folder for agreement.json and .md.")] = Path("runs/agreement"),
         tokens: int = 48, threads: int = 2,
         exact: Annotated[bool, typer.Option(help="Also lmforge's exact path (--quant-activations none).")] = True
         ) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = [r for f in files for r in compare(f, str(llama_server), tokens, threads, exact)]
    emit({"rows": rows, "tokens": tokens, "provenance": provenance("auto")}, to_markdown, out, "agreement")


if __name__ == "__main__":
    typer.run(main)
