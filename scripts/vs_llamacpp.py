"""lmforge against llama.cpp on one CPU, the engines alone (issue 25).

The issue's random 300M Llama (hidden 1024, 24 layers, GQA 16/8, intermediate 2816, vocab 8192) is
written once as a Hugging Face folder and as bf16, Q8_0 and Q4_0 GGUF files (`lmforge export
--format gguf`'s writer). For each file, with the same thread count:

* llama.cpp: `llama-bench -p 512 -n 128 -r R` (prefill 512 tokens; decode 128 tokens at batch 1);
* lmforge: `LLM(model=file)` with `--dtype auto`, prefix cache off: one 512-token prompt with one
  output token (prefill tok/s = 512 / its time), then one 1-token prompt decoding 128 tokens with
  `ignore_eos` (decode tok/s from the token times), R times each, the best kept; for Q8_0 / Q4_0 once
  with exact A16 kernels and once with `quant_activations="int8"` (A8, llama.cpp's own scheme). The
  decode run's `step_profile()` says where a step's milliseconds went.

Writes vs_llamacpp.json and vs_llamacpp.md (ratios lmforge ÷ llama.cpp, machine, CPU flags, load
average, llama.cpp's build). A benchmark-only script: llama.cpp is never a test dependency
(docs/engine.md has the build commands).

    python scripts/vs_llamacpp.py --out runs/vs-llamacpp --threads 2 \
        --llama-bench /opt/llamacpp/src/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-bench
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Annotated, Optional

import torch
import typer

from lmforge.bench.report import emit, loadavg, provenance
from lmforge.engine import kernels

SHAPE = dict(vocab_size=8192, hidden_size=1024, layers=24, num_attention_heads=16, num_key_value_heads=8,
             intermediate_size=2816, max_position_embeddings=4096, tie_word_embeddings=False,
             bos_token_id=0, eos_token_id=1, pad_token_id=2)
TYPES = ("bf16", "q8_0", "q4_0")
PREFILL, DECODE = 512, 128


def build_model(out: Path, tokenizer: Path) -> Path:
    """The random 300M Llama as an HF folder (bf16) with a byte-level BPE tokenizer of 8,192 ids."""
    from lmforge.model.reference import save_hf_model

    path = out / "random-llama-300m"
    if not (path / "config.json").is_file():
        save_hf_model("llama", path, dtype=torch.bfloat16, **SHAPE)
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (tokenizer / f).is_file():
                shutil.copy(tokenizer / f, path / f)
    return path


def gguf_files(model: Path) -> dict[str, Path]:
    from lmforge.quant.gguf_export import export_gguf

    files = {}
    for t in TYPES:
        f = model / f"model-{t}.gguf"
        if not f.is_file():
            export_gguf(model, f, t)
        files[t] = f
    return files


def llama_bench(exe: Path, f: Path, threads: int, repeats: int) -> dict:
    cmd = [str(exe), "-m", str(f), "-t", str(threads), "-p", str(PREFILL), "-n", str(DECODE), "-r", str(repeats),
           "-o", "json"]
    rows = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    res = {"command": " ".join(cmd)}
    for r in rows:
        key = "prefill_tok_s" if r.get("n_prompt") else "decode_tok_s"
        res[key] = r["avg_ts"]
        res[key.replace("tok_s", "stdev")] = r.get("stddev_ts")
        res.update(build=f"{r.get('build_number')} ({r.get('build_commit')})", cpu_info=r.get("cpu_info"),
                   backends=r.get("backends"), type_k=r.get("type_k"))
    return res


def lmforge_run(f: Path, threads: int, repeats: int, quant_activations: str) -> dict:
    from lmforge.engine import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(str(f), dtype="auto", enable_prefix_caching=False, quant_activations=quant_activations,
              max_num_batched_tokens=PREFILL)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    dec = SamplingParams(max_tokens=DECODE + 1, temperature=0.0, ignore_eos=True)
    vocab = llm.llm_engine.vocab_size
    prompt = [3 + (i * 7919) % (min(vocab, 8192) - 3) for i in range(PREFILL)]
    llm.generate([prompt[:16]], dec, use_tqdm=False)  # warm-up: kernels packed, allocator settled
    prefill, decode = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        llm.generate([prompt], one, use_tqdm=False)
        prefill.append(PREFILL / (time.perf_counter() - t0))
    eng = llm.llm_engine
    before = dict(eng.step_profile())
    for _ in range(repeats):
        out = llm.generate([[5]], dec, use_tqdm=False)[0].outputs[0]
        tt = out.token_times
        decode.append(DECODE / (tt[-1] - tt[0]))  # the 128 tokens after the first
    after = eng.step_profile()
    steps = repeats * (DECODE + 1)
    profile_ms = {k: 1000 * (after[k] - before.get(k, 0.0)) / steps for k in after}
    stats = llm.stats()
    return {"prefill_tok_s": max(prefill), "decode_tok_s": max(decode), "prefill_all": prefill, "decode_all": decode,
            "step_ms": profile_ms, "dtype": stats.get("dtype"), "linear": stats.get("linear_backend"),
            "attention": stats.get("attention_backend"), "quant_activations": quant_activations}


def run(out: Path, threads: int, repeats: int, exe: Path | None, tokenizer: Path | None,
        ggufs: list[Path] | None = None) -> dict:
    """The random 300M's three files, each lmforge path (A16 and A8 for int types); or given `ggufs` (any
    type, e.g. `scripts/gguf_files.py`'s), each with lmforge's defaults (what a user gets)."""
    out.mkdir(parents=True, exist_ok=True)
    files = {f.stem: f for f in ggufs} if ggufs else gguf_files(build_model(out, tokenizer))
    rows = []
    for t, f in files.items():
        ref = llama_bench(exe, f, threads, repeats) if exe else None
        for qa in (("auto",) if ggufs else ("none",) if t == "bf16" else ("none", "int8")):
            load = loadavg()
            r = lmforge_run(f, threads, repeats, qa)
            row = {"type": t, "file": str(f), "bytes": f.stat().st_size, "load_before": load, "lmforge": r,
                   "llama_cpp": ref}
            if ref:
                row["prefill_ratio"] = r["prefill_tok_s"] / ref["prefill_tok_s"]
                row["decode_ratio"] = r["decode_tok_s"] / ref["decode_tok_s"]
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "llama_cpp"}, default=str)[:400], flush=True)
    prov = provenance("auto")
    prov["threads"] = threads
    lib = kernels.load()
    return {"rows": rows, "provenance": prov, "kernels": kernels.status(),
            "a8_isa": kernels.a8_isa(lib) if lib is not None else None, "cpu_bf16": kernels.cpu_has_bf16()}


def to_markdown(rep: dict) -> str:
    p = rep["provenance"]
    lines = ["# lmforge vs llama.cpp, engines alone, batch 1", "",
             f"{p['machine']}; {p['threads']} threads; torch {p['packages'].get('torch')}; "
             f"load before first run {rep['rows'][0]['load_before'] if rep['rows'] else '?'}; {p['date']}", ""]
    ref = next((r["llama_cpp"] for r in rep["rows"] if r["llama_cpp"]), None)
    if ref:
        lines += [f"llama.cpp build {ref['build']}, backends {ref['backends']}, `{ref['cpu_info']}`", ""]
    lines += ["| GGUF | MB | lmforge path | prefill 512 tok/s llama.cpp / lmforge | ratio | decode tok/s llama.cpp / "
              "lmforge | ratio | lmforge decode step ms: forward / sample / rest |", "|---|---:|---|---|---:|---|---:|---|"]
    for r in rep["rows"]:
        lm, lc = r["lmforge"], r["llama_cpp"] or {}
        ms = r["lmforge"]["step_ms"]
        rest = sum(v for k, v in ms.items() if k not in ("forward", "sample"))
        path = "A8 (int8 activations)" if lm["quant_activations"] == "int8" else (
            "defaults: " + (lm["linear"] or "")[:60] if lm["quant_activations"] == "auto" else
            "A16 exact" if r["type"] != "bf16" else f"{lm['dtype']}")
        lines.append(f"| {r['type']} | {r['bytes'] / 1e6:.0f} | {path} | {lc.get('prefill_tok_s', float('nan')):.1f} / "
                     f"{lm['prefill_tok_s']:.1f} | {r.get('prefill_ratio', float('nan')):.2f}x | "
                     f"{lc.get('decode_tok_s', float('nan')):.1f} / {lm['decode_tok_s']:.1f} | "
                     f"{r.get('decode_ratio', float('nan')):.2f}x | {ms.get('forward', 0):.1f} / "
                     f"{ms.get('sample', 0):.2f} / {rest:.2f} |")
    return "\n".join(lines) + "\n"


def main(out: Annotated[Path, typer.Option(help="Folder for the model, the GGUF files and the report.")],
         threads: int = 2, repeats: int = 3,
         llama_bench_exe: Annotated[Optional[Path], typer.Option("--llama-bench", help="llama-bench binary.")] = None,
         tokenizer: Path = Path("runs/quickstart/tokenizer"),
         gguf: Annotated[Optional[list[Path]], typer.Option(help="Run on these GGUF files (any type, lmforge's "
                                                                 "default flags) instead of the random 300M's.")] = None
         ) -> None:
    if not gguf and not (tokenizer / "tokenizer.json").is_file():
        raise typer.BadParameter(f"{tokenizer}/tokenizer.json missing: run `make demo` (or `lmforge tokenizer "
                                 "train ... --vocab-size 8192`) and pass --tokenizer DIR", param_hint="--tokenizer")
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    rep = run(out, threads, repeats, llama_bench_exe, tokenizer, gguf)
    emit(rep, to_markdown, out, "vs_llamacpp")


if __name__ == "__main__":
    typer.run(main)
