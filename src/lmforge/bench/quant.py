"""`lmforge bench quant`: one run, the same weights, the dense model against its W8A16 and W4A16
quantizations and against an int8 KV cache.

Measured, in this order (each variant loads through `LLM`, as users run it):
  * weight bytes (what the engine holds after it picked its linear backend) and their ratio to the
    dense model's bytes at bf16 (2 bytes a parameter, whatever dtype this CPU runs);
  * batch-1 decode tokens/s (one 32-token prompt, `--decode-tokens` greedy tokens; first token excluded)
    and batch-32 output tokens/s (32 prompts x 32 tokens), each the best of `--repeats`;
  * quality against the dense model: greedy agreement over the first 32 tokens of 16 prompts
    (mean common-prefix length / 32, and position-wise match);
  * KV int8 at a fixed `--kv-budget-tokens` (the dense cache's capacity in tokens): pool tokens, the
    most sequences running at once and output tokens/s on a high-variance workload (lmforge's
    `bench engine` generator), for auto and int8;
  * `--linears`: each linear backend alone on one projection shape at M = 1 and 32 (the figures behind
    `lmforge.quant.linear`'s choice of bf16 activations for the CPU kernels).
Without `--model` a random Llama is built under `--out` (`--hidden/--layers/--intermediate/--vocab`;
random weights are fine for speed and bytes; quality needs a trained model: pass `--model`). The
activation dtype is bf16 where the CPU has native bf16, else float32. Every figure is taken under the
load recorded in the report (`os.getloadavg()` at start and end); compare within one run only.

    lmforge bench quant --out runs/bench-quant
    python -m lmforge.bench.quant --model models/quickstart --out runs/bench-quant-qs
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import torch
import torch.nn.functional as F
import typer

from lmforge.model.reference import save_hf_model
from lmforge.quant import QuantScheme, quantize_rtn
from lmforge.quant.linear import Int4Linear, Int8Linear, QmmLinear, QuantizedLinear
from lmforge.track.short import shrink

from .engine import make_requests
from .linear import best_seconds
from .report import emit, loadavg, provenance


@dataclass
class BenchQuantConfig:
    model: str | None = None
    out: str = "runs/bench-quant"
    hidden: int = 768
    layers: int = 8
    intermediate: int = 2048
    vocab: int = 8192
    group_size: int = 128
    decode_tokens: int = 48
    repeats: int = 2
    kv_budget_tokens: int = 4096
    kv_requests: int = 48
    threads: int = 1  # under contention, intra-op threads are catastrophically slow (see bench engine)
    dtype: str = "auto"  # auto: bfloat16 with native bf16, else float32
    linears: bool = True
    lora_memory: bool = False  # peak RSS of LoRA training steps on a float32 / bf16 / int8 / int4 frozen base
    inference: bool = True  # the dense / w8 / w4 / KV sections (off: only --lora-memory)
    lora_batch: int = 4
    lora_seq: int = 256
    lora_checkpointing: bool = False


def _activation_dtype(name: str) -> str:
    if name != "auto":
        return name
    native = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return "bfloat16" if native else "float32"


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def _decode_tok_s(llm, prompt: list[int], n: int, repeats: int) -> float:
    # deferred: only when the benchmark runs; `lmforge --help` imports this module
    from lmforge.engine import SamplingParams

    best = 0.0
    for _ in range(repeats):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)[0]
        t = out.outputs[0].token_times
        best = max(best, (len(t) - 1) / (t[-1] - t[0]))
    return best


def _batch_tok_s(llm, prompts: list[list[int]], n: int, repeats: int) -> float:
    # deferred: only when the benchmark runs; `lmforge --help` imports this module
    from lmforge.engine import SamplingParams

    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        best = max(best, len(prompts) * n / (time.perf_counter() - t0))
    return best


def _greedy(llm, prompts: list[list[int]], n: int = 32) -> list[list[int]]:
    # deferred: only when the benchmark runs; `lmforge --help` imports this module
    from lmforge.engine import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def agreement(got: list[list[int]], want: list[list[int]]) -> dict[str, float]:
    """Mean common-prefix length / length, and the share of positions with the same token."""
    prefix, same, total = 0.0, 0, 0
    for g, w in zip(got, want):
        k = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
        prefix += k / len(w)
        same += sum(a == b for a, b in zip(g, w))
        total += len(w)
    return {"prefix": round(prefix / len(want), 4), "positions": round(same / total, 4)}


def _kv_run(model_dir: Path, dtype: str, kv_cache_dtype: str, budget_bytes: int, reqs) -> dict[str, Any]:
    """The high-variance requests through one engine at a fixed KV byte budget; the most sequences
    running at once, output tokens/s, preemptions."""
    # deferred: only when the benchmark runs; `lmforge --help` imports this module
    from lmforge.engine import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype=dtype, device="cpu", kv_cache_memory_bytes=budget_bytes,
              kv_cache_dtype=kv_cache_dtype, max_num_seqs=256)
    eng = llm.llm_engine
    for i, r in enumerate(reqs):
        eng.add_request(str(i), r.prompt, SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True,
                                                         output_kind="final_only"))
    most, t0 = 0, time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
        most = max(most, len(eng.scheduler.running))
    dt = time.perf_counter() - t0
    st = llm.stats()
    return {"kv_cache_dtype": kv_cache_dtype, "kv_bytes_per_token": st["kv_bytes_per_token"],
            "kv_pool_tokens": st["kv_pool_tokens"], "max_running_seqs": most, "preemptions": st["preemptions"],
            "output_tok_s": round(sum(r.output_len for r in reqs) / dt, 1), "seconds": round(dt, 2),
            "attention_backend": st["attention_backend"]}


def _args_after(verb: str) -> list[str]:
    """This process's arguments after the CLI's `... bench quant` (all of them under `python -m`)."""
    argv = sys.argv[1:]
    return argv[argv.index(verb) + 1:] if verb in argv else argv


def bench_linears(K: int, N: int, group_size: int) -> list[dict[str, Any]]:
    # deferred: only when the benchmark runs; `lmforge --help` imports this module
    from lmforge.engine import kernels

    lib = kernels.load()
    qmm = getattr(lib, "qmm_f32", None)

    w = torch.randn(N, K)
    rows = []
    layers = {}
    for scheme, cls in ((QuantScheme(8, None), Int8Linear), (QuantScheme(4, group_size), Int4Linear)):
        q = QuantizedLinear(K, N, scheme, scale_dtype=torch.bfloat16)
        qw, s = quantize_rtn(w, scheme, torch.bfloat16)
        q.qweight.copy_(qw)
        q.weight_scale.copy_(s)
        layers[cls.__name__] = (cls(q, torch.float32), q)
        if qmm is not None:
            layers[f"QmmLinear int{scheme.num_bits}"] = (QmmLinear(q, torch.float32, qmm=qmm), q)
    for M in (1, 4, 32):
        x32 = torch.randn(M, K)
        xbf = x32.bfloat16()
        wbf = w.bfloat16()
        cands = {"dense float32 (F.linear)": lambda: F.linear(x32, w),
                 "dense bf16 (F.linear)": lambda: F.linear(xbf, wbf)}
        for name, (layer, q) in layers.items():
            kind = "float32 activations" if name.startswith("Qmm") else "bf16 activations"
            cands[f"{name} ({kind})"] = lambda layer=layer: layer(x32)
        i8 = layers["Int8Linear"][0]
        cands["int8 kernel on float32 activations"] = lambda: torch.ops.aten._weight_int8pack_mm(
            x32, i8.qweight, i8.scale.float())
        i4 = layers["Int4Linear"][0]
        cands["int4 kernel on float32 activations"] = lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x32, i4.packed, i4.group_size, i4.scale_zeros.float())
        base = None
        for name, fn in cands.items():
            us = best_seconds(fn, calls=10, repeats=3) * 1e6
            base = base or us
            rows.append({"M": M, "N": N, "K": K, "backend": name, "us": round(us, 1),
                         "vs_dense_float32": round(base / us, 2)})
    return rows


LORA_STEP = """
import ctypes, gc, json, sys, threading, time, peft, psutil, torch
from lmforge.quant import load_pretrained
from lmforge.train.lora import LoraConfig, apply_lora, base_load_dtype
torch.set_num_threads(1)
model_dir, kind, batch, seq, ckpt = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
proc, peaks, phase, done = psutil.Process(), [0, 0], [0], threading.Event()  # peaks of: the load, the steps
def trim():
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap pages back to the OS, so RSS is what is held
    except (OSError, AttributeError):
        pass
def sample():
    while not done.is_set():
        p, rss = phase[0], proc.memory_info().rss  # a sample taken in one phase counts for that phase
        peaks[p] = max(peaks[p], rss); time.sleep(0.002)
trim()
baseline = proc.memory_info().rss  # the interpreter with torch and lmforge imported, no model yet
threading.Thread(target=sample, daemon=True).start()
cfg = LoraConfig(rank=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                 base_dtype="bfloat16" if kind == "bfloat16" else "float32",
                 base_quant=kind if kind in ("int8", "int4") else None)
load_dtype = base_load_dtype(model_dir, cfg, torch.device("cpu"))  # as the trainer loads it
m = apply_lora(load_pretrained(model_dir, dtype=load_dtype, device="cpu"), cfg)
m.model.gradient_checkpointing = ckpt
m.train()
for b in list(m.buffers()) + list(m.parameters()):  # fault in every page: a bf16 base can still be a lazy
    float(b.detach().reshape(-1)[::1024].float().sum())  # view of the checkpoint's file, not yet resident
trim()
phase[0] = 1
start = proc.memory_info().rss
opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
V = m.config.vocab_size
t0 = time.perf_counter()
for _ in range(3):
    ids = torch.randint(3, V, (batch, seq))
    loss = torch.nn.functional.cross_entropy(m(ids)[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
    loss.backward(); opt.step(); opt.zero_grad()
seconds = time.perf_counter() - t0
done.set(); time.sleep(0.01)
print(json.dumps({"baseline": baseline, "load_dtype": load_dtype, "load_peak": peaks[0], "start": start,
                  "peak": max(peaks[1], proc.memory_info().rss), "step_seconds": seconds / 3}))
"""


def lora_peak_memory(model_dir: Path, batch: int = 4, seq: int = 256, checkpointing: bool = False
                     ) -> list[dict[str, Any]]:
    """Per frozen-base kind, one process: load the model as the trainer does (`base_load_dtype`:
    float32, or the checkpoint's own 16 bits for a light base), put LoRA (rank 16, every projection) on
    a base of that kind, then sample its resident memory every 2 ms through 3 AdamW steps on `batch` x
    `seq` tokens (optionally with activation checkpointing). Reported: RSS of the bare interpreter
    (torch and lmforge imported, no model), the peak while loading (the load, then the lightening),
    RSS when training starts (the model as held), and the peak during the steps; `peak_vs_float32`
    divides the step peaks, `above_baseline_vs_float32` the same
    peaks less the bare interpreter (what the model and its training cost), `held_vs_float32` the
    model as held when training starts. Each kind runs twice: with glibc's default allocator settings
    and with a fixed mmap threshold (see the comment below)."""
    rows = []
    for malloc in ("default", "fixed"):
        # glibc raises its mmap threshold after large frees and then keeps freed blocks on the heap;
        # `fixed` pins it (MALLOC_MMAP_THRESHOLD_=128 KiB), so big blocks go back to the OS when freed:
        # the peak then shows what training holds rather than what the allocator kept
        env = {**os.environ, **({"MALLOC_MMAP_THRESHOLD_": "131072"} if malloc == "fixed" else {})}
        for kind in ("float32", "bfloat16", "int8", "int4"):
            print(f"[bench quant] LoRA on the {kind} base (malloc {malloc})", file=sys.stderr, flush=True)
            out = subprocess.run([sys.executable, "-c", LORA_STEP, str(model_dir), kind, str(batch), str(seq),
                                  "1" if checkpointing else "0"], capture_output=True, text=True, env=env)
            if out.returncode != 0:
                raise RuntimeError(f"the LoRA memory step on a {kind} base failed: {out.stderr.strip()[-2000:]}")
            m = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append({"base": kind, "malloc": malloc, "loaded_as": m["load_dtype"],
                         "rss_baseline_bytes": m["baseline"], "load_peak_rss_bytes": m["load_peak"],
                         "rss_at_start_bytes": m["start"], "peak_rss_bytes": m["peak"],
                         "step_seconds": round(m["step_seconds"], 2)})
    for r in rows:
        f32 = next(x for x in rows if x["malloc"] == r["malloc"] and x["base"] == "float32")
        r["peak_vs_float32"] = round(r["peak_rss_bytes"] / f32["peak_rss_bytes"], 3)
        r["above_baseline_vs_float32"] = round((r["peak_rss_bytes"] - r["rss_baseline_bytes"])
                                               / (f32["peak_rss_bytes"] - f32["rss_baseline_bytes"]), 3)
        r["held_vs_float32"] = round((r["rss_at_start_bytes"] - r["rss_baseline_bytes"])
                                     / (f32["rss_at_start_bytes"] - f32["rss_baseline_bytes"]), 3)
    return rows


def _base_model(cfg: BenchQuantConfig, out: Path) -> Path:
    """`--model`, or a random Llama of the configured shape built once under `out`."""
    if cfg.model:
        return Path(cfg.model)
    base = out / f"random-llama-h{cfg.hidden}-l{cfg.layers}"
    if not (base / "config.json").exists():
        print(f"[bench quant] building {base}", file=sys.stderr, flush=True)
        save_hf_model("llama", base, vocab_size=cfg.vocab, hidden_size=cfg.hidden, layers=cfg.layers,
                      intermediate_size=cfg.intermediate, num_attention_heads=cfg.hidden // 64,
                      num_key_value_heads=max(1, cfg.hidden // 256), max_position_embeddings=2048,
                      dtype=torch.bfloat16)
    return base


def _new_report(cfg: BenchQuantConfig, base: Path, dtype: str) -> dict[str, Any]:
    return {
        "config": asdict(cfg), "command": " ".join(["lmforge bench quant"] + _args_after("quant")), "model": str(base),
        "provenance": provenance(dtype),
        "variants": [], "kv": [],
    }


def _quantized_folders(cfg: BenchQuantConfig, base: Path, out: Path) -> dict[str, Path]:
    """dense, w8a16 and w4a16 model folders; a quantization already under `out` is reused."""
    # deferred: only when the benchmark runs; `lmforge --help` imports this module
    from lmforge.quant.quantize import QuantizeConfig, quantize_model

    folders = {"dense": base}
    for scheme in ("w8a16", "w4a16"):
        folders[scheme] = out / f"{base.name}-{scheme}"
        if not (folders[scheme] / "record.json").exists():
            print(f"[bench quant] quantizing {scheme}", file=sys.stderr, flush=True)
            quantize_model(QuantizeConfig(model=str(base), out=str(folders[scheme]), scheme=scheme,
                                          group_size=cfg.group_size), overwrite=True)
    return folders


def _variant_row(llm, name: str, path: Path, cfg: BenchQuantConfig, prompts: tuple, n_params: int,
                 greedy: list, reference: list) -> dict[str, Any]:
    """Bytes, batch-1 and batch-32 speed and greedy agreement of one loaded variant."""
    one, batch = prompts
    st = llm.stats()
    rec = json.loads((path / "record.json").read_text())["results"] if name != "dense" else {}
    emb = llm.llm_engine.model.model.embed_tokens.weight  # one row of it is read per token, unless tied
    tied = emb.data_ptr() in {t.data_ptr() for t in llm.llm_engine.model.lm_head.parameters()}
    return {"variant": name, "linear_backend": st["linear_backend"], "weight_bytes": st["weight_bytes"],
            "bytes_read_per_token": st["weight_bytes"] - (0 if tied else emb.numel() * emb.element_size()),
            "weight_bytes_vs_bf16": round(st["weight_bytes"] / (2 * n_params), 4),
            "checkpoint_bytes_ratio": rec.get("weight_bytes_ratio", 1.0),
            "decode_tok_s_batch1": round(_decode_tok_s(llm, one, cfg.decode_tokens, cfg.repeats), 2),
            "output_tok_s_batch32": round(_batch_tok_s(llm, batch, 32, cfg.repeats), 1),
            "greedy_agreement_32": agreement(greedy, reference)}


def _measure_variants(report: dict, folders: dict[str, Path], cfg: BenchQuantConfig, dtype: str, vocab: int,
                      quality: list, save: Callable[[], None]) -> list:
    """One row per variant (saved after each), then the speedups against dense; returns dense's greedy tokens."""
    # deferred: only when the benchmark runs; `lmforge --help` imports this module
    from lmforge.engine import LLM

    prompts = (_prompts(1, 32, vocab, 1)[0], _prompts(32, 32, vocab, 2))
    n_params = None
    reference = None
    for name, path in folders.items():
        print(f"[bench quant] {name}", file=sys.stderr, flush=True)
        llm = LLM(str(path), dtype=dtype, device="cpu", max_num_seqs=64)
        if n_params is None:
            n_params = sum(p.numel() for p in llm.llm_engine.model.parameters())
        greedy = _greedy(llm, quality)
        reference = reference or greedy
        report["variants"].append(_variant_row(llm, name, path, cfg, prompts, n_params, greedy, reference))
        save()
        del llm
    d = report["variants"][0]
    for row in report["variants"]:
        # every weight is read once per decoded token: against doctor's STREAM figure, how bandwidth-bound
        row["weight_gb_s_batch1"] = round(row["decode_tok_s_batch1"] * row["bytes_read_per_token"] / 1e9, 2)
        row["decode_speedup"] = round(row["decode_tok_s_batch1"] / d["decode_tok_s_batch1"], 2)
        row["batch32_speedup"] = round(row["output_tok_s_batch32"] / d["output_tok_s_batch32"], 2)
    return reference


def _measure_kv(report: dict, base: Path, cfg: BenchQuantConfig, dtype: str, vocab: int, quality: list,
                reference: list, save: Callable[[], None]) -> None:
    """KV auto vs int8 at the dense cache's budget for kv_budget_tokens tokens, and int8's greedy agreement."""
    # deferred: only when the benchmark runs; `lmforge --help` imports this module
    from lmforge.engine import LLM

    probe = LLM(str(base), dtype=dtype, device="cpu", num_kv_blocks=1)
    budget = cfg.kv_budget_tokens * probe.stats()["kv_bytes_per_token"]
    del probe
    reqs = make_requests("high-variance", cfg.kv_requests, 0, vocab, 1024)
    for kv in ("auto", "int8"):
        print(f"[bench quant] KV {kv} at {budget} bytes", file=sys.stderr, flush=True)
        report["kv"].append(_kv_run(base, dtype, kv, budget, reqs))
        save()
    llm = LLM(str(base), dtype=dtype, device="cpu", kv_cache_dtype="int8")
    report["kv_int8_greedy_agreement_32"] = agreement(_greedy(llm, quality), reference)
    del llm
    a, b = report["kv"]
    report["kv_ratios"] = {"pool_tokens": round(b["kv_pool_tokens"] / a["kv_pool_tokens"], 3),
                           "max_running_seqs": round(b["max_running_seqs"] / max(a["max_running_seqs"], 1), 3),
                           "output_tok_s": round(b["output_tok_s"] / a["output_tok_s"], 3)}


def bench_quant_run(cfg: BenchQuantConfig) -> dict[str, Any]:
    torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = _activation_dtype(cfg.dtype)
    base = _base_model(cfg, out)
    report = _new_report(cfg, base, dtype)

    def save() -> None:
        emit(report, to_markdown, out, "bench_quant")

    if not cfg.inference:
        report["lora_memory"] = lora_peak_memory(base, cfg.lora_batch, cfg.lora_seq, cfg.lora_checkpointing)
        report["provenance"]["load_average_end"] = loadavg()
        save()
        return report
    folders = _quantized_folders(cfg, base, out)
    vocab = json.loads((base / "config.json").read_text())["vocab_size"]
    quality = _prompts(16, 16, vocab, 3)
    reference = _measure_variants(report, folders, cfg, dtype, vocab, quality, save)
    _measure_kv(report, base, cfg, dtype, vocab, quality, reference, save)
    if cfg.linears:
        print("[bench quant] linears", file=sys.stderr, flush=True)
        report["linears"] = bench_linears(cfg.hidden, cfg.intermediate, cfg.group_size)
    if cfg.lora_memory:
        report["lora_memory"] = lora_peak_memory(base, cfg.lora_batch, cfg.lora_seq, cfg.lora_checkpointing)
    report["provenance"]["load_average_end"] = loadavg()
    save()
    return report


def to_markdown(r: dict[str, Any]) -> str:
    p = r["provenance"]
    lines = [f"# bench quant: `{r['model']}`", "", f"`{r['command']}`", "",
             f"{p['date']} on {p['machine']}, {p['dtype']} activations, {p['threads']} thread(s), load average at "
             f"start {p['load_average']}" + (f", at end {p['load_average_end']}." if p.get("load_average_end")
                                               else " (run in progress)."), ""]
    if r.get("lora_memory"):
        c = r["config"]
        ckpt = "with" if c.get("lora_checkpointing") else "without"
        shape = f"{c.get('lora_batch', 4)} x {c.get('lora_seq', 256)}"
        lines += [f"LoRA (rank 16, all projections), 3 AdamW steps on {shape} "
                  f"tokens {ckpt} activation checkpointing, resident memory (MiB; the bare interpreter with torch: "
                  f"{r['lora_memory'][0]['rss_baseline_bytes'] / 2**20:.0f}):", "",
                  "| frozen base | malloc | loaded as | load peak | RSS at start | held x float32 | peak in steps | "
                  "peak x float32 | peak above interpreter x float32 | s/step |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {x['base']} | {x.get('malloc', 'default')} | {x.get('loaded_as', 'float32')} | "
                  f"{x['load_peak_rss_bytes'] / 2**20:.0f} | {x['rss_at_start_bytes'] / 2**20:.0f} | "
                  f"{x.get('held_vs_float32', '')} | {x['peak_rss_bytes'] / 2**20:.0f} | {x['peak_vs_float32']} | "
                  f"{x['above_baseline_vs_float32']} | {x['step_seconds']} |" for x in r["lora_memory"]]
        lines.append("")
    if r["variants"]:
        lines += [
             "| variant | linear backend | weight MiB held | vs bf16 bytes | checkpoint bytes vs dense | "
             "batch-1 decode tok/s | weights GB/s | x dense | batch-32 tok/s | x dense | "
             "greedy agreement (prefix / positions) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for v in r["variants"]:
        ag = v["greedy_agreement_32"]
        lines.append(f"| {v['variant']} | {v['linear_backend']} | {v['weight_bytes'] / 2**20:.1f} | "
                     f"{v['weight_bytes_vs_bf16']:.3f} | {v['checkpoint_bytes_ratio']:.3f} | "
                     f"{v['decode_tok_s_batch1']} | {v.get('weight_gb_s_batch1', '')} | "
                     f"{v.get('decode_speedup', '')} | {v['output_tok_s_batch32']} | "
                     f"{v.get('batch32_speedup', '')} | {ag['prefix']} / {ag['positions']} |")
    if r["kv"]:
        lines += ["", "KV cache at a fixed byte budget (high-variance requests):", "",
                  "| KV dtype | bytes/token | pool tokens | most running | preemptions | output tok/s |",
                  "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {k['kv_cache_dtype']} | {k['kv_bytes_per_token']} | {k['kv_pool_tokens']} | "
                  f"{k['max_running_seqs']} | {k['preemptions']} | {k['output_tok_s']} |" for k in r["kv"]]
        if "kv_ratios" in r:
            lines += ["", f"int8 / auto: {r['kv_ratios']}; KV int8 greedy agreement: "
                          f"{r.get('kv_int8_greedy_agreement_32')}"]
    if r.get("linears"):
        lines += ["", "One projection alone (best of 3 x 10 calls):", "",
                  "| M | N x K | backend | us | x dense fp32 |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {x['M']} | {x['N']} x {x['K']} | {x['backend']} | {x['us']} | {x['vs_dense_float32']} |"
                  for x in r["linears"]]
    return "\n".join(lines) + "\n"


def bench_quant(
    model: Annotated[Optional[Path], typer.Option(help="A dense HF model folder (default: a random Llama).")] = None,
    out: Annotated[Path, typer.Option(help="Where bench_quant.json/.md and the quantized folders go.")] = Path(
        "runs/bench-quant"),
    hidden: Annotated[int, typer.Option(help="Random model: hidden size (heads of 64).")] = 768,
    layers: Annotated[int, typer.Option(help="Random model: layers.")] = 8,
    intermediate: Annotated[int, typer.Option(help="Random model: MLP width.")] = 2048,
    vocab: Annotated[int, typer.Option(help="Random model: vocabulary.")] = 8192,
    group_size: Annotated[int, typer.Option(help="W4A16 group size.")] = 128,
    decode_tokens: Annotated[int, typer.Option(help="Batch-1 decode length.")] = 48,
    repeats: Annotated[int, typer.Option(help="Timed repeats (best kept).")] = 2,
    kv_budget_tokens: Annotated[int, typer.Option(help="KV budget, in tokens of the dense cache.")] = 4096,
    kv_requests: Annotated[int, typer.Option(help="High-variance requests for the KV comparison.")] = 48,
    threads: Annotated[int, typer.Option(help="torch.set_num_threads (1 is fastest on a shared CPU).")] = 1,
    dtype: Annotated[str, typer.Option(help="auto (bf16 with native bf16, else float32) | float32 | bfloat16.")]
    = "auto",
    linears: Annotated[bool, typer.Option(help="Also time each linear backend alone.")] = True,
    lora_memory: Annotated[bool, typer.Option(help="Also measure LoRA peak memory per frozen-base kind.")] = False,
    lora_batch: Annotated[int, typer.Option(help="LoRA memory: sequences per step.")] = 4,
    lora_seq: Annotated[int, typer.Option(help="LoRA memory: tokens per sequence.")] = 256,
    lora_checkpointing: Annotated[bool, typer.Option(help="LoRA memory: activation checkpointing.")] = False,
    inference: Annotated[bool, typer.Option(help="The dense/w8/w4/KV sections (--no-inference: LoRA only).")] = True,
) -> None:
    """Dense vs W8A16 vs W4A16 (weight bytes, batch-1 and batch-32 decode, greedy agreement) and KV int8
    at a fixed budget, one run, same weights. Writes bench_quant.json and bench_quant.md."""
    # LMFORGE_SHORT (CI): the same sections on a random model of hidden 128, 2 layers, 8 decode tokens, one repeat
    bench_quant_run(BenchQuantConfig(
        model=str(model) if model else None, out=str(out), hidden=shrink(hidden, 128), layers=shrink(layers, 2),
        intermediate=shrink(intermediate, 256), vocab=shrink(vocab, 512), group_size=shrink(group_size, 64),
        decode_tokens=shrink(decode_tokens, 8), repeats=shrink(repeats, 1),
        kv_budget_tokens=shrink(kv_budget_tokens, 1024), kv_requests=shrink(kv_requests, 4), threads=threads,
        dtype=dtype, linears=linears,
        lora_memory=lora_memory, inference=inference, lora_batch=lora_batch, lora_seq=lora_seq,
        lora_checkpointing=lora_checkpointing))


if __name__ == "__main__":
    typer.run(bench_quant)
