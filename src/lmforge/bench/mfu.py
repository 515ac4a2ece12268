"""`lmforge bench mfu CONFIG`: the MFU ladder on the user's own training config.

Each rung changes one thing on top of the best rung so far and is a short measured run of the
real training step (the config's data, model, AdamW, loss): float32 → bf16 autocast → fused
LM-head loss → data pipeline (loader wait timed apart from compute; a prefetch thread, and
pinned memory on CUDA) → packed documents through a variable-length attention path (one causal
SDPA per document, FlashAttention-class kernels, instead of a dense T×T boolean mask) →
`torch.compile` of the blocks → a larger micro-batch. A rung that makes things slower is
measured, reported and not kept; a rung that cannot apply on this device says why. The table
(step, change, tokens/s, MFU, Δ, physical reason) and the roofline headroom go to
`OUT/bench_mfu.json` and `OUT/bench_mfu.md`.

It knows the training step's pieces (`train.loop.build_data`, `build_model`, `fused_ce`), not the
trainer's bookkeeping (no checkpoints, evaluation or run records of its own).

    lmforge bench mfu configs/quickstart.yaml data.path=runs/quickstart/packed --steps 6 --out runs/bench-mfu
"""

from __future__ import annotations

import os
import queue
import statistics
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lmforge.bench.doctor import cpu_bf16_flags
from lmforge.bench.report import emit
from lmforge.config import load_config
from lmforge.model.transformer import DenseAttention
from lmforge.parallel.distributed import Dist
from lmforge.perf.estimate import ModelShape, device_spec, roofline
from lmforge.perf.hardware import NoPeakError, peak_flops
from lmforge.perf.mfu import mfu, model_flops_per_token
from lmforge.track.provenance import hardware_info, package_versions
from lmforge.track.short import short_mode
from lmforge.train.config import TrainConfig
from lmforge.train.fused_ce import chunked_lm_loss
from lmforge.train.loop import build_data, build_model
from lmforge.train.optim import build_optimizer

# ---- the variable-length attention path ------------------------------------------------------


class VarlenAttention:
    """Causal attention within each packed document, one SDPA call per document span (as
    FlashAttention's varlen kernels take cu_seqlens): no (B, 1, T, T) mask is built, no score
    outside a document is computed, and SDPA can pick its fused kernel (`is_causal=True`)."""

    def __init__(self, doc_ids_BT: torch.Tensor):
        B, T = doc_ids_BT.shape
        starts_BT = torch.ones_like(doc_ids_BT, dtype=torch.bool)
        starts_BT[:, 1:] = doc_ids_BT[:, 1:] != doc_ids_BT[:, :-1]
        self.spans = []  # (row, start, end), from one host sync
        for b, row in enumerate(starts_BT.cpu().tolist()):
            cuts = [i for i, s in enumerate(row) if s] + [T]
            self.spans += [(b, s, e) for s, e in zip(cuts, cuts[1:])]

    def __call__(self, layer_idx: int, q_BTNH, k_BTKH, v_BTKH) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q_BTNH, k_BTKH, v_BTKH))  # (B, heads, T, H)
        gqa = q.shape[1] != k.shape[1]
        out = torch.empty_like(q)
        for b, s, e in self.spans:
            out[b, :, s:e] = F.scaled_dot_product_attention(q[b:b + 1, :, s:e], k[b:b + 1, :, s:e],
                                                            v[b:b + 1, :, s:e], is_causal=True, enable_gqa=gqa)[0]
        return out.transpose(1, 2)  # (B, T, N, H)


# ---- one rung ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    dtype: str = "float32"
    fused_loss: bool = False
    prefetch: bool = False
    varlen: bool = False
    compile: bool = False
    batch_size: int = 8


@dataclass
class Rung:
    step: str
    change: str
    setting: Setting
    reason: str  # the physical reason the change should help
    tokens_per_s: float | None = None
    mfu: float | None = None
    step_s: float | None = None
    data_wait_s: float | None = None
    kept: bool = False
    note: str = ""
    speedup_vs_best: float | None = None  # median of paired step-time ratios against the best rung before it
    speedup_vs_base: float | None = None
    extra: dict = field(default_factory=dict)


class Prefetcher:
    """Draws the next batches on a thread while the step computes (the loader is numpy + memmap,
    which releases the GIL); on CUDA it pins them and copies with non_blocking=True."""

    def __init__(self, it: Any, device: torch.device, depth: int = 2):
        self.it, self.device = it, device
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self) -> None:
        while True:
            batch = next(self.it)
            if self.device.type == "cuda":
                batch = {k: v.pin_memory().to(self.device, non_blocking=True) for k, v in batch.items()}
            self.q.put(batch)

    def __next__(self) -> dict:
        return self.q.get()


def _loss(model: Any, batch: dict, s: Setting) -> torch.Tensor:
    doc = batch.get("doc_ids")
    attn = VarlenAttention(doc) if s.varlen and doc is not None else DenseAttention(doc)
    h = model.hidden_states(batch["input_ids"], batch.get("position_ids"), doc, attn)
    if s.fused_loss:
        return chunked_lm_loss(h, model.lm_head.weight, batch["labels"])
    logits = model.lm_head(h).float()
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), batch["labels"].view(-1), ignore_index=-100,
                           reduction="sum")


class StepRunner:
    """One setting's training step, built once: `step()` runs one and returns (seconds, loader wait)."""

    def __init__(self, cfg: Any, s: Setting):
        cfg = replace(cfg, train=replace(cfg.train, batch_size=s.batch_size, dtype=s.dtype, fused_loss=s.fused_loss))
        self.s = s
        self.device = torch.device("cuda" if torch.cuda.is_available() and cfg.train.device in ("auto", "cuda") else "cpu")
        torch.manual_seed(cfg.train.seed)
        data = build_data(cfg, Dist(), torch.device("cpu") if s.prefetch else self.device)
        self.seq_len, self.tokens = data.seq_len, s.batch_size * data.seq_len
        self.model = build_model(cfg, data).to(self.device)
        self.opt = build_optimizer(self.model, cfg.train, self.device)
        if s.compile:
            for layer in self.model.model.layers:  # elementwise chains (norms, SwiGLU) fuse; attention stays eager
                layer.mlp.compile()
                layer.input_layernorm.compile()
                layer.post_attention_layernorm.compile()
        self.it = Prefetcher(iter(data.train), self.device) if s.prefetch else iter(data.train)
        self.amp = getattr(torch, s.dtype)
        self.sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)

    def step(self) -> tuple[float, float]:
        self.sync()
        t0 = time.perf_counter()
        batch = next(self.it)
        t1 = time.perf_counter()
        with torch.autocast(self.device.type, dtype=self.amp, enabled=self.amp != torch.float32):
            loss = _loss(self.model, batch, self.s)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sync()
        return time.perf_counter() - t0, t1 - t0


def measure(cfg: Any, s: Setting, steps: int, warmup: int = 2, against: StepRunner | None = None) -> dict[str, Any]:
    """Median seconds per step (and of waiting for the loader) over `steps` timed steps.

    With `against` (the best rung so far), its steps and this setting's alternate (A, B, A, B, ...)
    and `speedup` is the median of the paired tokens/s ratios: load that comes and goes on a shared machine
    slows both halves of a pair alike and cancels out of the ratio.
    """
    run = StepRunner(cfg, s)
    for _ in range(warmup):
        run.step()
        if against is not None:
            against.step()
    times, waits, ratios = [], [], []
    for _ in range(steps):
        ref = against.step()[0] if against is not None else None
        dt, wait = run.step()
        times.append(dt)
        waits.append(wait)
        if ref is not None:  # tokens/s over tokens/s: a rung that changes the batch changes tokens per step
            ratios.append((run.tokens / dt) / (against.tokens / ref))
    step_s = statistics.median(times)
    return {"step_s": step_s, "data_wait_s": statistics.median(waits), "tokens_per_s": run.tokens / step_s,
            "speedup": statistics.median(ratios) if ratios else None, "seq_len": run.seq_len,
            "model_config": run.model.config, "runner": run}


# ---- the ladder ------------------------------------------------------------------------------

KEEP_ABOVE = 1.02  # a change is kept when it is at least 2% faster: less is within the paired noise


def _peak(device: str, dtype: str) -> float | None:
    try:
        return peak_flops(device, dtype)
    except NoPeakError:
        return None


def plan(base: Setting, device: str, cpu_bf16_native: bool, max_batch: int) -> list[Rung]:
    """The rungs, in the seed's order; each says what it changes and why it should be faster."""
    bf16_reason = ("bf16 matmuls run on tensor cores (16× the fp32 CUDA-core rate on A100)" if device == "cuda" else
                   "bf16 halves the bytes and, with AVX512-BF16/AMX, doubles the matmul rate" if cpu_bf16_native else
                   "this CPU has no bf16 instructions: bf16 matmuls are emulated (expected slower)")
    return [
        Rung("0", "baseline: float32, full logits, dense T×T mask, synchronous loader", base,
             "the reference every rung is measured against"),
        Rung("1", "bf16 autocast", replace(base, dtype="bfloat16"), bf16_reason),
        Rung("2", "fused LM head + cross-entropy (no full logits)", replace(base, fused_loss=True),
             "the (tokens × vocab) fp32 logits, softmax and gradient are never materialised: less memory traffic"),
        Rung("3", "data pipeline: prefetch thread" + (" + pinned memory" if device == "cuda" else ""),
             replace(base, prefetch=True), "the next batch is read while the step computes"),
        Rung("4", "packed documents: per-document causal SDPA (varlen) instead of a dense T×T mask",
             replace(base, varlen=True), "no B×T×T mask; no scores across documents; the fused causal kernel applies"),
        Rung("5", "torch.compile (norms, SwiGLU)", replace(base, compile=True),
             "elementwise chains fuse into one kernel: fewer passes over activations"),
        Rung("6", f"micro-batch ×{max_batch // base.batch_size}", replace(base, batch_size=max_batch),
             "bigger matmuls amortise per-op overhead and weight reads"),
    ]


def run_ladder(cfg: Any, steps: int = 6, max_batch: int | None = None, skip: tuple[str, ...] = (),
               progress: Any = print) -> dict[str, Any]:
    """Measure every rung, keeping a change only when it is faster; returns the table and headroom."""
    device = "cuda" if torch.cuda.is_available() and cfg.train.device in ("auto", "cuda") else "cpu"
    base = Setting(batch_size=cfg.train.batch_size)
    rungs = plan(base, device, bool(cpu_bf16_flags()), max_batch or 2 * cfg.train.batch_size)
    best: Rung | None = None
    best_runner: StepRunner | None = None
    model_config = None
    for rung in rungs:
        # each rung changes one field of the best setting so far
        changed = {k: v for k, v in vars(rung.setting).items() if v != getattr(base, k)}
        rung.setting = replace(best.setting, **changed) if best else rung.setting
        why_not = _not_applicable(rung, device)
        if rung.step in skip or why_not:
            rung.note = "skipped (--skip)" if rung.step in skip else why_not
            progress(f"rung {rung.step}: {rung.note}")
            continue
        progress(f"rung {rung.step}: {rung.change} ...")
        try:
            m = measure(cfg, rung.setting, steps, against=best_runner)
        except Exception as e:  # noqa: BLE001 - a rung that fails here is a finding, not a crash
            rung.note = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
            progress(f"  {rung.note}")
            continue
        model_config = m["model_config"]
        fpt = model_flops_per_token(model_config, m["seq_len"])
        peak = _peak(device, rung.setting.dtype)
        rung.tokens_per_s, rung.step_s, rung.data_wait_s = m["tokens_per_s"], m["step_s"], m["data_wait_s"]
        rung.mfu = _mfu(rung, fpt, m["tokens_per_s"], peak)
        # speed-up over the best rung so far: paired ratios (load-robust); vs the baseline: their product
        rung.speedup_vs_best = m["speedup"] or 1.0
        rung.speedup_vs_base = (best.speedup_vs_base if best else 1.0) * rung.speedup_vs_best
        rung.extra = {"flops_per_token": fpt, "peak_flops": peak, "seq_len": m["seq_len"]}
        if best is None or rung.speedup_vs_best > KEEP_ABOVE:
            rung.kept, best, best_runner = True, rung, m["runner"]
        else:
            rung.note = ("slower: not kept" if rung.speedup_vs_best < 1.0 else f"within {KEEP_ABOVE - 1:.0%}: not kept") \
                + (f"; {rung.note}" if rung.note else "")
        progress(f"  {rung.tokens_per_s:,.0f} tok/s, {rung.speedup_vs_best:.2f}× the best rung before it (paired), "
                 f"data wait {rung.data_wait_s * 1e3:.1f} ms of {rung.step_s * 1e3:.1f} ms"
                 + (f", MFU {rung.mfu:.1%}" if rung.mfu else "") + f" {rung.note}")
    headroom = _headroom(best, model_config, device) if best is not None else {}
    return {"device": device, "steps": steps, "rungs": [_rung_dict(r) for r in rungs],
            "best": best.step if best else None, "speedup": best.speedup_vs_base if best else None,
            "headroom": headroom}


def _headroom(best: Rung, model_config: Any, device: str) -> dict[str, Any]:
    """How far the best rung is below the roofline: attainable = min(peak, intensity × bandwidth)."""
    try:
        dev = device_spec("cpu" if device == "cpu" else torch.cuda.get_device_name(0))
        rl = roofline(ModelShape.from_config(model_config), dev, best.setting.batch_size, best.extra["seq_len"],
                      best.setting.dtype)
    except (ValueError, KeyError) as e:
        return {"error": str(e)}
    achieved = best.extra["flops_per_token"] * best.tokens_per_s
    attainable = rl["prefill attainable"]
    if achieved > attainable:  # the same error as MFU > 100%: the measured peak is too low
        return {"error": f"achieved {achieved / 1e9:.3g} GFLOP/s exceeds the roofline's {attainable / 1e9:.3g}: "
                         f"the doctor's peak is too low (measured on a busy machine?); rerun `lmforge doctor` idle"}
    return {"attainable_flops": attainable, "achieved_flops": achieved, "headroom": attainable / achieved,
            "ridge": rl["ridge point"], "intensity": rl["prefill intensity"], "device": dev.name}


def _mfu(rung: Rung, fpt: float, tokens_per_s: float, peak: float | None) -> float | None:
    """MFU through `perf.mfu.mfu`, so above 100% stays an error: noted on the rung, no figure."""
    if not peak:
        return None
    try:
        return mfu(fpt, tokens_per_s, peak)
    except ValueError as e:
        rung.note = (f"MFU > 100%: the peak {peak / 1e9:.3g} GFLOP/s is too low (a doctor run on a busy machine?); "
                     f"rerun `lmforge doctor` idle. {str(e).split(';')[0]}")
        return None


def _not_applicable(rung: Rung, device: str) -> str:
    """Why a rung cannot help on this device, from measurements (the doctor's profile), or ""."""
    if rung.step == "1" and device == "cpu" and not cpu_bf16_flags():
        fp32, bf16 = _peak("cpu", "float32"), _peak("cpu", "bfloat16")
        rates = f": doctor measured bf16 matmuls at {bf16 / 1e9:.2g} vs fp32 {fp32 / 1e9:.3g} GFLOP/s" if fp32 and bf16 else ""
        return f"not applicable: this CPU has no AVX512-BF16/AMX, bf16 is emulated{rates}"
    if rung.step == "5" and not hasattr(torch, "compile"):
        return "not applicable: torch.compile unavailable"
    return ""


def _rung_dict(r: Rung) -> dict[str, Any]:
    return {"step": r.step, "change": r.change, "tokens_per_s": r.tokens_per_s, "mfu": r.mfu,
            "speedup_vs_best": r.speedup_vs_best, "speedup_vs_base": r.speedup_vs_base,
            "step_s": r.step_s, "data_wait_s": r.data_wait_s, "kept": r.kept, "reason": r.reason, "note": r.note,
            "setting": vars(r.setting), **r.extra}


def to_markdown(result: dict[str, Any], command: str, load: tuple[float, float, float]) -> str:
    lines = [f"# MFU ladder ({result['device']})", "", f"`{command}` — {result['steps']} timed steps per rung "
             f"(median), load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}", "",
             "Δ is the median of paired tokens/s ratios against the best rung before it (steps of the two "
             "alternate, so load drift cancels); × baseline is the product of the kept Δs.", "",
             "| step | change | tokens/s | MFU | Δ vs best before | × baseline | data wait | kept | physical reason |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rungs"]:
        tps = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "—"
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "—"
        delta = f"{r['speedup_vs_best'] - 1:+.0%}" if r["speedup_vs_best"] is not None and r["step"] != "0" else "—"
        base = f"{r['speedup_vs_base']:.2f}×" if r["speedup_vs_base"] is not None else "—"
        wait = f"{r['data_wait_s'] * 1e3:.1f} ms" if r["data_wait_s"] is not None else "—"
        kept = ("✓" + (f" ({r['note']})" if r["note"] else "")) if r["kept"] else (r["note"] or "—")
        lines.append(f"| {r['step']} | {r['change']} ({r['setting']['dtype']}, batch {r['setting']['batch_size']}) "
                     f"| {tps} | {mfu} | {delta} | {base} | {wait} | {kept} | {r['reason']} |")
    if result.get("speedup"):
        lines += ["", f"Best rung {result['best']}: {result['speedup']:.2f}× the float32 baseline."]
    h = result.get("headroom") or {}
    if "error" in h:
        lines += [f"Roofline headroom: not computed: {h['error']}."]
    if "headroom" in h:
        lines += [f"Roofline on {h['device']}: ridge {h['ridge']:.3g} FLOP/B, the step's intensity {h['intensity']:.3g} "
                  f"FLOP/B, attainable {h['attainable_flops'] / 1e9:.3g} GFLOP/s, achieved "
                  f"{h['achieved_flops'] / 1e9:.3g} GFLOP/s: {h['headroom']:.1f}× headroom."]
    return "\n".join(lines) + "\n"


def bench_mfu(config: str, overrides: list[str], steps: int, out: Path, max_batch: int | None,
              skip: tuple[str, ...]) -> dict[str, Any]:
    cfg = load_config(TrainConfig, config, overrides)
    if short_mode():  # CI: one timed step a rung; compiling (rung 5) alone would take longer than the rest
        steps, skip = 1, (*skip, "5")
        print("LMFORGE_SHORT: one step a rung, rung 5 (torch.compile) skipped", flush=True)
    result = run_ladder(cfg, steps, max_batch, skip)
    load = os.getloadavg()
    command = "lmforge bench mfu " + " ".join([config, *overrides, f"--steps {steps}"])
    result.update(command=command, loadavg=load, hardware=hardware_info(), packages=package_versions(),
                  measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    out.mkdir(parents=True, exist_ok=True)
    emit(result, lambda r: to_markdown(r, command, load), out, "bench_mfu")
    return result
