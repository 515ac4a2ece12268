"""Prefill tok/s of one prompt (512 random token ids, one output token; each prompt its own, so the prefix cache
finds nothing) through `LLM.generate` with default flags, for two or more checkouts' `src` folders taking turns in fresh processes (`PYTHONPATH`), so that
the VM's drift hits every side alike (issue 44: this VM moves ±10-20% between sittings; only alternating runs decide).
Each turn: a warm-up prompt, then `--prompts` timed prompts; a side's figure is its best over every turn.

    git worktree add /tmp/wt-head HEAD
    python scripts/prefill_revisions.py runs/vs-openvino/random-llama-300m --src /tmp/wt-head/src --src src
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import typer

CHILD = """
import json, random, sys, time, torch
from lmforge.engine import LLM, SamplingParams
model, length, prompts, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
llm = LLM(model)
vocab = llm.llm_engine.model_runner.model.config.vocab_size
rng = random.Random(0)
params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
ids = lambda: [rng.randrange(3, vocab) for _ in range(length)]
llm.generate([ids()], params, use_tqdm=False)
rates = []
for _ in range(prompts):
    x = ids()
    t = time.perf_counter()
    llm.generate([x], params, use_tqdm=False)
    rates.append(length / (time.perf_counter() - t))
print(json.dumps({"tok_s": rates, "attention": llm.stats()["attention_backend"],
                  "linears": llm.stats()["linear_backend"]}))
"""


def main(model: Annotated[str, typer.Argument(help="HF folder or GGUF file.")],
         src: Annotated[list[Path], typer.Option(help="A checkout's src folder (give two or more).")],
         rounds: int = 2, prompts: int = 5, length: int = 512, threads: int = 2) -> None:
    if len(src) < 2:
        raise typer.BadParameter("give --src at least twice: the checkouts to alternate")
    for s in src:
        if not (s / "lmforge").is_dir():
            raise typer.BadParameter(f"{s}: no lmforge package here (pass a checkout's src folder)")
    best: dict[Path, float] = {}
    for r in range(rounds):
        for s in src:
            env = {**os.environ, "PYTHONPATH": str(s.resolve())}
            out = subprocess.run([sys.executable, "-c", CHILD, model, str(length), str(prompts), str(threads)],
                                 env=env, capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"{s}: {out.stderr.strip()[-2000:]}")
            res = json.loads(out.stdout.strip().splitlines()[-1])
            best[s] = max(best.get(s, 0.0), max(res["tok_s"]))
            print(f"round {r + 1} {s}: {' '.join(f'{x:.1f}' for x in res['tok_s'])} tok/s; attention "
                  f"{res['attention']}", flush=True)
    base = best[src[0]]
    for s in src:
        print(f"{s}: best {best[s]:.1f} tok/s ({best[s] / base:.2f}x {src[0]})")


if __name__ == "__main__":
    typer.run(main)
