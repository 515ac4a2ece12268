"""The engine's CPU decode attention, one step of it: the per-sequence SDPA loop over in-place pool
views (the torch path) against the compiled paged-decode kernel, at 1 and at all torch threads,
with the outputs compared.

    python -m lmforge.bench.attention [--seqs 57] [--out DIR]   # bench_attention.json + .md

The step is a mid-run decode step of `lmforge bench engine`'s high-variance workload: `--seqs`
sequences with contexts drawn uniformly from 50-600 tokens, the ~30M bench model's attention
shape (8 heads of 64, 8 kv heads), bfloat16, block size 16, over 8 layers' pools (so the K/V read
does not sit in cache between repeats). GB/s = K and V bytes that must be read / time.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Annotated, Optional

import torch
import torch.nn.functional as F
import typer

from lmforge.engine import kernels

from .linear import best_seconds
from .report import emit

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 8, 8, 64, 16


def bench_attention(seqs: int = 57, seed: int = 0) -> dict:
    lib = kernels.load()
    if lib is None:
        return {"skipped": f"engine kernels {kernels.status()}", "rows": []}
    rng = random.Random(seed)
    lens = [rng.randint(50, 600) for _ in range(seqs)]
    blocks = [-(-n // BLOCK) for n in lens]
    P = sum(blocks)
    shape = (P * BLOCK, KV_HEADS, HEAD_DIM)
    k_pools = [torch.randn(shape).bfloat16() for _ in range(LAYERS)]
    v_pools = [torch.randn(shape).bfloat16() for _ in range(LAYERS)]
    firsts, nxt = [], 0
    for b in blocks:  # each sequence's blocks one run, so the SDPA loop can read them in place
        firsts.append(nxt * BLOCK)
        nxt += b
    M = max(blocks)
    tables = torch.tensor([list(range(f // BLOCK, f // BLOCK + b)) + [0] * (M - b) for f, b in zip(firsts, blocks)],
                          dtype=torch.int32)
    lens_S, rows_S = torch.tensor(lens, dtype=torch.int32), torch.arange(seqs)
    q = torch.randn(seqs, HEADS, HEAD_DIM).bfloat16()
    out = torch.empty_like(q)

    def sdpa_loop():
        for k, v in zip(k_pools, v_pools):
            q1, k1, v1 = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
            o = [F.scaled_dot_product_attention(q1[:, :, s:s + 1], k1[:, :, f:f + n], v1[:, :, f:f + n])
                 for s, (f, n) in enumerate(zip(firsts, lens))]
        return torch.cat(o, 2)[0].transpose(0, 1)

    def kernel(threads):
        def run():
            for k, v in zip(k_pools, v_pools):
                lib.decode(q.data_ptr(), k.data_ptr(), v.data_ptr(), tables.data_ptr(), M, lens_S.data_ptr(),
                           rows_S.data_ptr(), seqs, HEADS, KV_HEADS, HEAD_DIM, BLOCK, HEAD_DIM ** -0.5,
                           out.data_ptr(), threads)
            return out
        return run

    nbytes = sum(lens) * KV_HEADS * HEAD_DIM * 2 * 2 * LAYERS  # K and V, bf16, every layer
    threads0 = torch.get_num_threads()
    rows = []
    try:
        with torch.inference_mode():
            ref = sdpa_loop().float()
            for threads in sorted({1, threads0}):
                torch.set_num_threads(threads)
                for name, fn in (("SDPA per sequence (torch)", sdpa_loop), ("paged-decode kernel (C)", kernel(threads))):
                    ms = best_seconds(fn, calls=5) * 1e3
                    diff = (fn().float() - ref).abs().max().item()
                    rows.append({"path": name, "threads": threads, "ms_per_step": round(ms, 2),
                                 "gb_per_s": round(nbytes / ms / 1e6, 2), "max_abs_diff_vs_sdpa": diff})
    finally:
        torch.set_num_threads(threads0)
    return {"seqs": seqs, "context_tokens": sum(lens), "layers": LAYERS, "kv_bytes": nbytes, "dtype": "bfloat16",
            "kernels": kernels.status(), "rows": rows}


def to_markdown(report: dict) -> str:
    if report.get("skipped"):
        return f"# bench attention\n\nskipped: {report['skipped']}\n"
    lines = [f"# bench attention: one decode step, {report['seqs']} sequences, {report['context_tokens']} context "
             f"tokens, {report['layers']} layers ({report['kv_bytes'] / 1e6:.0f} MB of K/V), bf16", "",
             "| path | threads | ms / step | GB/s | max abs diff vs SDPA |", "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['path']} | {r['threads']} | {r['ms_per_step']} | {r['gb_per_s']} | {r['max_abs_diff_vs_sdpa']:.4f} |"
              for r in report["rows"]]
    return "\n".join(lines) + "\n"


def main(seqs: Annotated[int, typer.Option(help="Decoding sequences in the step.")] = 57,
         out: Annotated[Optional[Path], typer.Option(help="Where bench_attention.json and .md go.")] = None) -> None:
    emit(bench_attention(seqs), to_markdown, out, "bench_attention")


if __name__ == "__main__":
    typer.run(main)
