"""This checkout's CPU kernels against another revision's (or one engine form against another), alternating
in one process, so that the machine's drift between sittings cancels out. Best of `--repeats` each.

    attention  decode attention (`lmf_paged_decode_any`, float32 queries over a float32 or bf16 pool) on the
               random 300M Llama's shapes (24 layers, 16 query / 8 kv heads of 64), pool blocks in random order
               as a long-running server's are; outputs equal to float32 rounding
    matmuls    a decode step's 96 layer matmuls of the same model (int4 groups of 32, int8 activations,
               `lmf_qmm_a8`), distinct weights streamed from memory, at `--rows` activation rows; outputs equal
    stack      a real engine on MODEL: one C call a decode step for the whole decoder stack against a call a
               layer (`lmf_decode_stack_q` / `lmf_decode_layer_q`), the same engine toggled between steps

    python scripts/kernels_ab.py attention --old-rev 1455d4a --contexts 200,700,1400 [--kv bfloat16] [--seqs 16]
    python scripts/kernels_ab.py matmuls --old-rev efd2024 --rows 1,4,16
    python scripts/kernels_ab.py stack runs/vs-llamacpp/random-llama-300m/model-q4_0.gguf
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

app = typer.Typer(add_completion=False)
LAYERS, BLOCK, KV_HEADS, HEAD, HEADS, BLOCKS = 24, 16, 8, 64, 16, 4096
# the 300M's layer linears (out, in): fused q/k/v, o, fused gate/up, down
LINEARS = [(HEADS * HEAD + 2 * KV_HEADS * HEAD, 1024), (1024, HEADS * HEAD), (2 * 2816, 1024), (1024, 2816)]


def _library_at(rev: str) -> kernels.CpuKernels:
    out = Path(tempfile.mkdtemp(prefix="kernels-ab-"))
    src = out / "cpu_ops.c"
    src.write_text(subprocess.run(["git", "show", f"{rev}:src/lmforge/engine/kernels/cpu_ops.c"], check=True,
                                  capture_output=True, text=True).stdout)
    here = kernels.SOURCE
    kernels.SOURCE = src
    try:
        return kernels._bind(kernels.build(out_dir=out))
    finally:
        kernels.SOURCE = here


def _libraries(old_rev: str, threads: int) -> dict[str, kernels.CpuKernels]:
    torch.set_num_threads(threads)
    here = kernels.load()
    if here is None:
        raise typer.BadParameter("lmforge's CPU kernels did not build here (`lmforge doctor`)")
    return {"this checkout": here, old_rev: _library_at(old_rev)}


def _alternate(names: list[str], run, repeats: int) -> dict[str, float]:
    best = dict.fromkeys(names, float("inf"))
    for _ in range(repeats):
        for name in names:
            t = time.perf_counter()
            run(name)
            best[name] = min(best[name], time.perf_counter() - t)
    return best


@app.command()
def attention(old_rev: str = typer.Option(..., help="The revision to compare against (its cpu_ops.c)."),
              contexts: str = "200,700,1400", repeats: int = 40, threads: int = 2,
              kv: str = typer.Option("float32", help="The pool's dtype: float32 or bfloat16."),
              seqs: int = 1) -> None:
    """Decode attention, ms a step (24 layers) and the K/V GB/s read."""
    if kv not in ("float32", "bfloat16"):
        raise typer.BadParameter("--kv: float32 or bfloat16")
    libs = _libraries(old_rev, threads)
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

        def run(name: str) -> None:
            for k, v in zip(ks, vs):
                rc = libs[name].decode_any(q.data_ptr(), k.data_ptr(), v.data_ptr(), None, None, table.data_ptr(),
                                           table.shape[1], lens.data_ptr(), rows.data_ptr(), seqs, HEADS, KV_HEADS,
                                           HEAD, BLOCK, HEAD ** -0.5, outs[name].data_ptr(), threads, 1, kind)
                assert rc == 0, rc
        best = _alternate(list(libs), run, repeats)
        a, b = outs.values()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # the two libraries compute the same attention
        kv_bytes = LAYERS * L * seqs * KV_HEADS * HEAD * dtype.itemsize * 2
        print(f"context {L}: " + ", ".join(f"{name} {best[name] * 1e3:.2f} ms ({kv_bytes / best[name] / 1e9:.1f} GB/s)"
                                           for name in libs), flush=True)


@app.command()
def matmuls(old_rev: str = typer.Option(..., help="The revision to compare against (its cpu_ops.c)."),
            rows: str = "1,4,16", repeats: int = 12, threads: int = 2) -> None:
    """A decode step's 96 int4 g32 matmuls on int8 activations, ms and weight GB/s."""
    libs = _libraries(old_rev, threads)
    a8 = {name: lib.a8() for name, lib in libs.items()}
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen),
                torch.rand(n, k // 32, generator=gen)) for _ in range(LAYERS) for n, k in LINEARS]
    nbytes = sum(c.numel() + s.numel() * 4 for c, s in weights)
    for M in (int(r) for r in rows.split(",")):
        x = torch.randn(M, max(k for _, k in LINEARS), generator=gen)
        outs = {name: [torch.empty(M, c.shape[0]) for c, _ in weights] for name in libs}

        def run(name: str) -> None:
            for (c, s), out in zip(weights, outs[name]):
                K = c.shape[1] * 2
                rc = a8[name](x.data_ptr(), 1, c.data_ptr(), s.data_ptr(), out.data_ptr(), M, c.shape[0], K, 4, 32,
                              threads)
                assert rc == 0, rc
        best = _alternate(list(libs), run, repeats)
        assert all(torch.equal(a, b) for a, b in zip(*outs.values())), "the two libraries' outputs differ"
        print(f"{M} rows: " + ", ".join(f"{name} {best[name] * 1e3:.2f} ms ({nbytes / best[name] / 1e9:.1f} GB/s)"
                                        for name in libs), flush=True)


@app.command()
def stack(model: str, steps: int = 64, repeats: int = 12, threads: int = 2,
          quant_activations: str = "int8") -> None:
    """Batch-1 decode ms a step with the whole stack in one C call against a call a layer."""
    from lmforge.engine import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(model, enable_prefix_caching=False, quant_activations=quant_activations)
    layers = llm.llm_engine.model_runner.model.model.layers
    whole = getattr(layers[0], "stack", None)
    if whole is None:
        raise typer.BadParameter(f"{model}: its layers are not one C stack here "
                                 f"({llm.llm_engine.model_runner.decode_layers_why or 'LMFORGE_DECODE_STACK=0?'})")
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    tokens = {}

    def run(name: str) -> None:
        for m in layers:
            m.stack = whole if name == "one call a step" else None
        out = llm.generate([[5]], params, use_tqdm=False)[0].outputs[0]
        tokens[name] = out.token_ids
        times[name] = min(times.get(name, float("inf")), (out.token_times[-1] - out.token_times[0]) / steps)
    times: dict[str, float] = {}
    _alternate(["a call a layer", "one call a step"], run, repeats)
    assert tokens["a call a layer"] == tokens["one call a step"], "the two forms' tokens differ"
    print(", ".join(f"{name} {t * 1e3:.2f} ms a step" for name, t in times.items()))


if __name__ == "__main__":
    app()
