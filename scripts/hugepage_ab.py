"""Weights and K/V pools in transparent huge pages against torch's own 4 KB pages (`lmforge.engine.hugepages`), through
`LLM.generate` with default flags: two engines on MODEL in one process, one built under `LMFORGE_HUGEPAGES=0`, taking
turns on the same greedy requests, so that the VM's drift between sittings falls on both alike. Greedy tokens must
be equal (the same bytes at other addresses).

    python scripts/hugepage_ab.py runs/vs-openvino/gguf/random-llama-300m-q4_0.gguf                 # 1 sequence, depth 128
    python scripts/hugepage_ab.py runs/vs-openvino/random-llama-300m --batch 16 --depth 128          # 16 at once
    python scripts/hugepage_ab.py MODEL --prefill 512                                                # a 512-token prefill

Prints, per engine, decode tok/s (the tokens generated after every prompt has its first token, over that span; or
prefill tok/s) best and median over `--rounds`, and how many MiB of weights each engine holds in huge pages.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from typing import Annotated

import torch
import typer


def _engine(model: str, huge: bool, batch: int):
    from lmforge.engine import LLM

    os.environ["LMFORGE_HUGEPAGES"] = "1" if huge else "0"
    try:
        return LLM(model, max_num_seqs=max(batch, 1))
    finally:
        os.environ.pop("LMFORGE_HUGEPAGES", None)


def decode_rate(times: list[list[float]]) -> float:
    """Tokens a second once every sequence has its first token (all prompts prefilled), to the last: with several
    sequences, the window from the first sequence's first token counted the later prompts' prefills as decode time.
    One sequence: its tokens after the first over their span."""
    start, end = max(t[0] for t in times), max(t[-1] for t in times)
    return sum(1 for t in times for x in t if x > start) / (end - start)


def main(model: str, depth: int = 128, tokens: int = 128, batch: int = 1, rounds: int = 6, threads: int = 2,
         prefill: Annotated[int, typer.Option(help="Time a prefill of this many tokens instead of decode.")] = 0,
         huge_first: Annotated[bool, typer.Option(help="Build the huge-page engine first (the engine built first ran "
                                                       "~3% faster in a control with both on 4 KB pages: run both "
                                                       "orders).")] = False) -> None:
    from lmforge.engine import SamplingParams

    torch.set_num_threads(threads)
    order = [("huge pages", True), ("4 KB pages", False)] if huge_first else [("4 KB pages", False), ("huge pages", True)]
    engines = {name: _engine(model, huge, batch) for name, huge in order}
    vocab = engines["huge pages"].llm_engine.model_runner.model.config.vocab_size
    rng = random.Random(0)
    rates: dict[str, list[float]] = {k: [] for k in engines}
    outs: dict[str, list] = {k: [] for k in engines}
    for r in range(rounds + 1):  # round 0 warms both up and is not counted
        n = prefill or depth
        prompts = [[rng.randrange(5, vocab) for _ in range(n)] for _ in range(batch)]
        params = SamplingParams(max_tokens=1 if prefill else tokens + 1, temperature=0.0, ignore_eos=True)
        for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            t0 = time.perf_counter()
            res = engines[name].generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t0
            outs[name].append([o.outputs[0].token_ids for o in res])
            if r == 0:
                continue
            if prefill:
                rates[name].append(batch * prefill / wall)
            else:
                rates[name].append(decode_rate([o.outputs[0].token_times for o in res]))
    assert outs["4 KB pages"] == outs["huge pages"], "greedy tokens differ between the two engines"
    what = f"prefill {prefill} tokens" if prefill else f"decode {tokens} tokens at depth {depth}, {batch} sequence(s)"
    print(f"{model}: {what}, {threads} threads, {rounds} rounds in turns; greedy tokens equal; built first: {order[0][0]}")
    for name, eng in engines.items():
        mib = eng.llm_engine.memory_stats()["weight_hugepage_bytes"] / 2**20
        v = rates[name]
        print(f"  {name:11s} best {max(v):8.1f} tok/s, median {statistics.median(v):8.1f}  ({mib:.1f} MiB of weights in "
              f"huge pages)")


if __name__ == "__main__":
    typer.run(main)
