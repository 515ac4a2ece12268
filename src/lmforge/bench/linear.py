"""The engine's bf16 linear layers on CPU: `F.linear` (oneDNN reorders the weight on every call)
against `PackedLinear` (reordered once), per shape and row count, with the outputs compared.

    python -m lmforge.bench.linear [--out DIR]     # bench_linear.json + bench_linear.md

Shapes are the ~30M bench model's projections (hidden 512, MLP 1376, vocabulary 8192); rows are
a decode step's batch. One thread, best of 5 timings of 50 calls each.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import torch
import torch.nn.functional as F
import typer

from lmforge.bench.report import emit

SHAPES = ((512, 512), (512, 1376), (1376, 512), (512, 8192))  # (in, out)
ROWS = (1, 8, 32, 128)


def best_seconds(fn, calls: int = 50, repeats: int = 5) -> float:
    """Seconds per call of `fn`: one warm-up call, then the best of `repeats` timings of `calls` calls."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return best


def bench_linear() -> dict:
    # deferred: only when the benchmark runs; `lmforge --help` imports this module
    from lmforge.engine.model_runner import PackedLinear, can_pack_linear

    if not can_pack_linear(torch.device("cpu"), torch.bfloat16):
        return {"skipped": "this CPU has no native bf16 in oneDNN: the engine does not pack", "rows": []}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    try:
        with torch.inference_mode():
            for k, n in SHAPES:
                linear = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
                packed = PackedLinear(linear)
                for m in ROWS:
                    x = torch.randn(m, k, dtype=torch.bfloat16)
                    plain_us = best_seconds(lambda: F.linear(x, linear.weight)) * 1e6
                    packed_us = best_seconds(lambda: packed(x)) * 1e6
                    same = torch.equal(F.linear(x, linear.weight), packed(x))
                    rows.append({"in": k, "out": n, "rows": m, "plain_us": round(plain_us, 1),
                                 "packed_us": round(packed_us, 1), "speedup": round(plain_us / packed_us, 2),
                                 "same_bits": same})
    finally:
        torch.set_num_threads(threads)
    return {"threads": 1, "dtype": "bfloat16", "rows": rows}


def to_markdown(report: dict) -> str:
    if report.get("skipped"):
        return f"# bench linear\n\nskipped: {report['skipped']}\n"
    lines = ["# bench linear: bf16 `F.linear` vs `PackedLinear`, 1 thread", "",
             "| in → out | rows | plain (µs) | packed (µs) | speed-up | same bits |", "| --- | ---: | ---: | ---: | ---: | --- |"]
    lines += [f"| {r['in']} → {r['out']} | {r['rows']} | {r['plain_us']} | {r['packed_us']} | {r['speedup']}× | "
              f"{r['same_bits']} |" for r in report["rows"]]
    return "\n".join(lines) + "\n"


def main(out: Annotated[Optional[Path], typer.Option(help="Where bench_linear.json and .md go.")] = None) -> None:
    emit(bench_linear(), to_markdown, out, "bench_linear")


if __name__ == "__main__":
    typer.run(main)
