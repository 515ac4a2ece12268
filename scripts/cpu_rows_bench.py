"""Where rows go on a CPU without bf16 units (issue 25): the figures behind `QmmLinear.A8_PREFILL_ROWS` and
the prefill / long-context decode figures in docs/engine.md, as one script.

* `--linear`: the A8 kernel (`forward_a8`, all rows in one call) against dequantize + sgemm (the A16
  prefill path) on int8 / int4 g32 weights of the 300M's shapes, at 128 and 512 rows, GFLOP/s;
* for each MODEL (a GGUF or HF folder, `LLM(dtype="auto")`): prefill tok/s of one prompt of 64 / 128 /
  256 / 512 tokens (one output token, best of 3) with `A8_PREFILL_ROWS` at 64 (the old limit) and at its
  value, and decode tok/s over 256 tokens after a 768-token prompt (context 768-1024).

    python scripts/cpu_rows_bench.py --linear runs/vs-llamacpp/random-llama-300m/model-q8_0.gguf \\
        runs/vs-llamacpp/random-llama-300m/model-q4_0.gguf --quant-activations int8
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import torch
import typer


def _best(fn, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def linear_section(repeats: int) -> None:
    from lmforge.engine import kernels
    from lmforge.quant.linear import QmmLinear, QuantizedLinear
    from lmforge.quant.scheme import QuantScheme

    lib = kernels.load()
    for bits in (8, 4):
        for N, K in ((2816, 1024), (1024, 2816)):
            q = QuantizedLinear(K, N, QuantScheme(bits, 32), scale_dtype=torch.float32)
            q.qweight.copy_(torch.randint(-7, 8, (N, K), dtype=torch.int8))
            m = QmmLinear(q, torch.float32, qmm=lib.qmm_f32, a8=lib.a8())
            with torch.inference_mode():
                for rows in (128, 512):
                    x = torch.randn(rows, K)
                    a8 = _best(lambda: m.forward_a8(x), repeats)
                    sgemm = _best(lambda: torch.nn.functional.linear(x, m.dequantized()), repeats)
                    gf = 2 * N * K * rows / 1e9
                    print(f"int{bits} g32 {K}->{N}, {rows} rows: A8 {gf / a8:.0f} GFLOP/s, "
                          f"dequantize + sgemm {gf / sgemm:.0f} GFLOP/s ({lib.a8().isa})")


def model_section(model: str, quant_activations: str, repeats: int) -> None:
    from lmforge.engine import LLM, SamplingParams
    from lmforge.quant.linear import QmmLinear

    llm = LLM(model, dtype="auto", enable_prefix_caching=False, quant_activations=quant_activations,
              max_num_batched_tokens=512)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prompt = [3 + (i * 7919) % 8000 for i in range(768)]
    llm.generate([prompt[:16]], one, use_tqdm=False)  # warm-up
    name, limit = Path(model).name, QmmLinear.A8_PREFILL_ROWS
    try:
        for rows in (64, limit):
            QmmLinear.A8_PREFILL_ROWS = rows
            rates = [f"{n}: {n / _best(lambda: llm.generate([prompt[:n]], one, use_tqdm=False), repeats):.0f}"
                     for n in (64, 128, 256, 512)]
            print(f"{name}: prefill tok/s by prompt length, A8_PREFILL_ROWS={rows}: {' '.join(rates)}")
    finally:
        QmmLinear.A8_PREFILL_ROWS = limit
    dec = SamplingParams(max_tokens=257, temperature=0.0, ignore_eos=True)
    best = 0.0
    for _ in range(repeats):
        tt = llm.generate([prompt], dec, use_tqdm=False)[0].outputs[0].token_times
        best = max(best, 256 / (tt[-1] - tt[0]))
    print(f"{name}: decode tok/s at a context of 768-1024 tokens: {best:.1f} ({llm.stats().get('linear_backend')})")


def main(models: Annotated[Optional[list[str]], typer.Argument()] = None,
         linear: Annotated[bool, typer.Option(help="The A8 vs dequantize + sgemm section.")] = False,
         quant_activations: str = "int8", threads: int = 2, repeats: int = 3) -> None:
    torch.set_num_threads(threads)
    if linear:
        linear_section(repeats)
    for m in models or []:
        model_section(m, quant_activations if not m.endswith("bf16.gguf") else "none", repeats)


if __name__ == "__main__":
    typer.run(main)
