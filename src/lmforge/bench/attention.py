"""The engine's CPU attention: one decode step (the per-sequence SDPA loop over in-place pool views, the
torch path, against the compiled paged-decode kernel, at 1 and at all torch threads) and one prefill chunk
(causal SDPA over the chunk's own K/V, the torch path, against the paged prefill kernel over the pool),
with the outputs compared.

    python -m lmforge.bench.attention [--seqs 57] [--prefill-tokens 512] [--out DIR]   # bench_attention.json + .md

The prefill chunk has the random 300M Llama's attention shape (16 query heads and 8 kv heads of 64), float32
queries over a bf16 pool (what a quantized or bf16 checkpoint runs on CPU), at torch's threads, over 8 layers;
GFLOP/s counts the causal half (4 x T(T+1)/2 x heads x head dim).

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


def bench_prefill(tokens: int = 512, seed: int = 0) -> dict:
    """One prefill chunk of `tokens` tokens, nothing cached before it, every layer: causal SDPA over the chunk's
    float32 K/V (views, as the torch path hands them) against `lmf_paged_prefill` over the bf16 pool rows."""
    lib = kernels.load()
    if lib is None or lib.prefill is None:
        return {"skipped": f"engine kernels {kernels.status()}", "rows": []}
    heads, kv_heads, T = 16, 8, tokens
    g = torch.Generator().manual_seed(seed)
    q_T = torch.randn(T, heads, HEAD_DIM, generator=g)
    k_T, v_T = (torch.randn(T, kv_heads, HEAD_DIM, generator=g) for _ in range(2))
    blocks = -(-T // BLOCK)
    pools = [(torch.zeros(blocks * BLOCK, kv_heads, HEAD_DIM, dtype=torch.bfloat16),
              torch.zeros(blocks * BLOCK, kv_heads, HEAD_DIM, dtype=torch.bfloat16)) for _ in range(LAYERS)]
    for k_pool, v_pool in pools:  # the chunk's K/V written, as the engine writes them before attending
        k_pool[:T], v_pool[:T] = k_T, v_T
    kb, vb = k_T.bfloat16().float(), v_T.bfloat16().float()  # what the pool holds, for the torch path too
    tables = torch.arange(blocks, dtype=torch.int32)[None]
    chunks = torch.tensor([[0, T, 0]], dtype=torch.int64)
    out = torch.empty_like(q_T)

    def sdpa():
        for _ in pools:
            q1, k1, v1 = (t.transpose(0, 1)[None] for t in (q_T, kb, vb))
            o = F.scaled_dot_product_attention(q1, k1, v1, is_causal=True, enable_gqa=True)
        return o[0].transpose(0, 1)

    def kernel():
        for k_pool, v_pool in pools:
            lib.prefill(q_T.data_ptr(), heads * HEAD_DIM, HEAD_DIM, k_pool.data_ptr(), v_pool.data_ptr(), 0,
                        tables.data_ptr(), blocks, chunks.data_ptr(), 1, heads, kv_heads, HEAD_DIM, BLOCK,
                        HEAD_DIM ** -0.5, out.data_ptr(), torch.get_num_threads())
        return out

    flops = 4 * T * (T + 1) / 2 * heads * HEAD_DIM * LAYERS
    rows = []
    with torch.inference_mode():
        ref = sdpa()
        for name, fn in (("causal SDPA (torch)", sdpa), ("paged prefill kernel (C)", kernel)):
            ms = best_seconds(fn, calls=3) * 1e3
            rows.append({"path": name, "threads": torch.get_num_threads(), "ms_per_layer": round(ms / LAYERS, 3),
                         "gflops": round(flops / ms / 1e6, 1),
                         "max_abs_diff_vs_sdpa": (fn() - ref).abs().max().item()})
    return {"tokens": T, "heads": heads, "kv_heads": kv_heads, "layers": LAYERS, "rows": rows}


def prefill_markdown(p: dict) -> str:
    if p.get("skipped"):
        return f"\n# bench attention, prefill\n\nskipped: {p['skipped']}\n"
    lines = ["", f"# bench attention: one prefill chunk of {p['tokens']} tokens, {p['heads']} query / "
             f"{p['kv_heads']} kv heads of {HEAD_DIM}, float32 queries, bf16 pool, {p['layers']} layers", "",
             "| path | threads | ms / layer | GFLOP/s (causal) | max abs diff vs SDPA |",
             "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['path']} | {r['threads']} | {r['ms_per_layer']} | {r['gflops']} | "
              f"{r['max_abs_diff_vs_sdpa']:.2e} |" for r in p["rows"]]
    return "\n".join(lines) + "\n"


def to_markdown(report: dict) -> str:
    tail = prefill_markdown(report["prefill"]) if report.get("prefill") else ""
    if report.get("skipped"):
        return f"# bench attention\n\nskipped: {report['skipped']}\n" + tail
    lines = [f"# bench attention: one decode step, {report['seqs']} sequences, {report['context_tokens']} context "
             f"tokens, {report['layers']} layers ({report['kv_bytes'] / 1e6:.0f} MB of K/V), bf16", "",
             "| path | threads | ms / step | GB/s | max abs diff vs SDPA |", "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['path']} | {r['threads']} | {r['ms_per_step']} | {r['gb_per_s']} | {r['max_abs_diff_vs_sdpa']:.4f} |"
              for r in report["rows"]]
    return "\n".join(lines) + "\n" + tail


def main(seqs: Annotated[int, typer.Option(help="Decoding sequences in the step.")] = 57,
         prefill_tokens: Annotated[int, typer.Option(help="Tokens of the prefill chunk (0: none).")] = 512,
         out: Annotated[Optional[Path], typer.Option(help="Where bench_attention.json and .md go.")] = None) -> None:
    report = bench_attention(seqs)
    if prefill_tokens > 0:
        report["prefill"] = bench_prefill(prefill_tokens)
    emit(report, to_markdown, out, "bench_attention")


if __name__ == "__main__":
    typer.run(main)
