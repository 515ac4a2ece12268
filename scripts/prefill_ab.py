"""Prefill time by prompt length with lmforge's panel GEMM (`lmf_gemm_f32`) on and off, in one process,
alternating (issue 25): two `LLM`s of one model, one built with `LMFORGE_GEMM=0` (bf16 weights: widen +
sgemm above 32 rows; float32 layers: oneDNN above 16; int8/int4: dequantize + sgemm above 32 rows, or with
`--quant-activations int8` the A8 kernel up to 256 rows), prefix cache off, one prompt of each length with
one output token, `--repeats` rounds taking turns, so a noisy neighbour hits both sides alike. Writes
OUT.json and OUT.md.

    python scripts/prefill_ab.py runs/vs-llamacpp/random-llama-300m/model-bf16.gguf --out runs/prefill-ab/bf16
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Annotated

import torch
import typer


def main(model: Annotated[str, typer.Argument(help="GGUF file or HF folder.")],
         out: Annotated[Path, typer.Option(help="Writes OUT.json and OUT.md.")],
         dtype: str = "auto", lengths: str = "27,130,250,512", repeats: int = 4, threads: int = 2,
         quant_activations: str = "none") -> None:
    from lmforge.engine import LLM, SamplingParams
    from lmforge.bench.report import provenance
    from lmforge.engine import kernels

    torch.set_num_threads(threads)
    llms, backends = {}, {}
    for side, env in (("gemm", "1"), ("old", "0")):
        os.environ["LMFORGE_GEMM"] = env
        llms[side] = LLM(model, dtype=dtype, enable_prefix_caching=False, quant_activations=quant_activations)
        backends[side] = llms[side].llm_engine.model_runner.linear_backend
    os.environ.pop("LMFORGE_GEMM")
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for llm in llms.values():  # warm-up: kernels built, allocator settled
        llm.generate([[5] * 16], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    rng, rows = random.Random(0), []
    for n in (int(x) for x in lengths.split(",")):
        prompt = [3 + rng.randrange(7000) for _ in range(n)]
        ms = {side: [] for side in llms}
        for _ in range(repeats):
            for side, llm in llms.items():
                t0 = time.perf_counter()
                llm.generate([prompt], one, use_tqdm=False)
                ms[side].append(1000 * (time.perf_counter() - t0))
        rows.append({"tokens": n, "ms": ms, "best": {s: min(v) for s, v in ms.items()}})
        print(f"{n} tokens: best {rows[-1]['best']['gemm']:.0f} ms with the GEMM, {rows[-1]['best']['old']:.0f} "
              f"without", flush=True)
    rep = {"model": model, "dtype": dtype, "quant_activations": quant_activations, "threads": threads, "repeats": repeats, "backends": backends,
           "kernels": kernels.status(), "rows": rows, "provenance": provenance(dtype)}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(rep, indent=2))
    tmp.replace(out.with_suffix(".json"))
    lines = [f"# Prefill with and without lmf_gemm_f32: {model}", "",
             f"{threads} threads, dtype {dtype}, quant_activations {quant_activations}, best of {repeats} alternating "
             "rounds; "
             f"{rep['provenance']['machine']}; load before {rep['provenance']['load_average']}; "
             f"{rep['provenance']['date']}", "",
             f"- with: {backends['gemm']}", f"- without (`LMFORGE_GEMM=0`): {backends['old']}", "",
             "| prompt tokens | with (ms) | without (ms) | without / with | all rounds, with | all rounds, without |",
             "| ---: | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        b = r["best"]
        lines.append(f"| {r['tokens']} | {b['gemm']:.0f} | {b['old']:.0f} | {b['old'] / b['gemm']:.2f}x | "
                     f"{', '.join(f'{x:.0f}' for x in r['ms']['gemm'])} | {', '.join(f'{x:.0f}' for x in r['ms']['old'])} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    typer.run(main)
