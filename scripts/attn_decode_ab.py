"""Decode attention on a float32 or bf16 K/V pool (`lmf_paged_decode_any`: act float32, the AVX2 body where
the CPU has it) of this checkout's `cpu_ops.c` against another revision's, alternating in one process, outputs
equal to float32 rounding (bit-identical where the two bodies sum in the same order). The shapes are the random
300M Llama's (24 layers, 16 query / 8 kv heads of 64), its pool blocks in random order as a long-running
server's are, `--seqs` sequences decoding together, `--threads` threads; the best of `--repeats` steps for each
context length. Prints ms a step and the K/V GB/s it reads.

    python scripts/attn_decode_ab.py --old-rev d4c9797 --contexts 200,700,1400
    python scripts/attn_decode_ab.py --old-rev 1455d4a --kv bfloat16 --seqs 16 --contexts 300,700
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import typer

from lmforge.engine import kernels

LAYERS, BLOCK, KV_HEADS, HEAD, HEADS, BLOCKS = 24, 16, 8, 64, 16, 4096


def _library_at(rev: str, out: Path) -> kernels.CpuKernels:
    src = out / "cpu_ops.c"
    src.write_text(subprocess.run(["git", "show", f"{rev}:src/lmforge/engine/kernels/cpu_ops.c"], check=True,
                                  capture_output=True, text=True).stdout)
    here = kernels.SOURCE
    kernels.SOURCE = src
    try:
        return kernels._bind(kernels.build(out_dir=out))
    finally:
        kernels.SOURCE = here


def main(old_rev: str = typer.Option(..., help="The revision to compare against (its cpu_ops.c)."),
         contexts: str = "200,700,1400", repeats: int = 40, threads: int = 2,
         kv: str = typer.Option("float32", help="The pool's dtype: float32 or bfloat16."), seqs: int = 1) -> None:
    torch.set_num_threads(threads)
    libs = {"this checkout": kernels.load()}
    if libs["this checkout"] is None:
        raise typer.BadParameter("lmforge's CPU kernels did not build here (`lmforge doctor`)")
    libs[old_rev] = _library_at(old_rev, Path(tempfile.mkdtemp(prefix="attn-ab-")))
    if kv not in ("float32", "bfloat16"):
        raise typer.BadParameter("--kv: float32 or bfloat16")
    dtype, kind = getattr(torch, kv), int(kv == "float32")
    shape = (BLOCKS, BLOCK, KV_HEADS, HEAD)
    ks = [torch.randn(shape).to(dtype) for _ in range(LAYERS)]
    vs = [torch.randn(shape).to(dtype) for _ in range(LAYERS)]
    q = torch.randn(seqs, HEADS * HEAD)
    for L in (int(c) for c in contexts.split(",")):
        perm = np.random.default_rng(L).permutation(BLOCKS)[: seqs * ((L + BLOCK - 1) // BLOCK)]
        table = torch.tensor(perm, dtype=torch.int32).reshape(seqs, -1)
        lens, rows = torch.tensor([L] * seqs, dtype=torch.int32), torch.arange(seqs, dtype=torch.int64)
        outs = {name: torch.empty(seqs, HEADS * HEAD) for name in libs}
        best = {name: float("inf") for name in libs}
        for _ in range(repeats):
            for name, lib in libs.items():
                t = time.perf_counter()
                for k, v in zip(ks, vs):
                    rc = lib.decode_any(q.data_ptr(), k.data_ptr(), v.data_ptr(), None, None, table.data_ptr(),
                                        table.shape[1], lens.data_ptr(), rows.data_ptr(), seqs, HEADS, KV_HEADS, HEAD,
                                        BLOCK, HEAD ** -0.5, outs[name].data_ptr(), threads, 1, kind)
                    assert rc == 0, rc
                best[name] = min(best[name], time.perf_counter() - t)
        a, b = outs.values()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # the two libraries compute the same attention
        kv_bytes = LAYERS * L * seqs * KV_HEADS * HEAD * dtype.itemsize * 2
        print(f"context {L}: " + ", ".join(f"{name} {best[name] * 1e3:.2f} ms ({kv_bytes / best[name] / 1e9:.1f} GB/s)"
                                           for name in libs), flush=True)


if __name__ == "__main__":
    typer.run(main)
