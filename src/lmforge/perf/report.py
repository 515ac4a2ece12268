"""`lmforge report RUN_OR_BENCH ... --out report.md`: the optimisation report of the tutorial's template.

Sections: the goal; the baseline (model, hardware, measured tokens/s and MFU, roofline bound);
the optimisation steps (what changed, the figure, Δ, the physical reason), from an MFU ladder
(`bench_mfu.json`) or from training runs in the order given; the bottlenecks (data wait share,
memory estimate against the measured peak); "I expected ___, measured ___" rows generated from
every estimate-vs-measurement gap above 15%, with room for the user's own words; the roofline
headroom. It reads run directories and bench folders only; it measures nothing.

    lmforge report runs/bench-mfu runs/train-a runs/train-b --out report.md
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lmforge.perf.estimate import ModelShape, memory
from lmforge.track.io import atomic_write_text

GAP = 0.15  # an estimate this far from its measurement gets an "I expected" row


def _load(item: str | Path) -> tuple[str, dict]:
    """("mfu", bench_mfu.json) or ("run", record.json) for a folder or a file."""
    p = Path(item)
    for kind, name in (("mfu", "bench_mfu.json"), ("run", "record.json")):
        f = p / name if p.is_dir() else p
        if f.is_file() and f.name == name:
            return kind, json.loads(f.read_text())
    raise FileNotFoundError(f"{item}: neither a run directory (record.json) nor a `bench mfu` folder (bench_mfu.json)")


def _fmt(v: Any, pct: bool = False) -> str:
    if v is None:
        return "—"
    if pct:
        return f"{v:.1%}"
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v)


def _gflops(v: float | None) -> str:
    return "—" if not v else f"{v / 1e9:,.1f} GFLOP/s"


def run_memory_gap(rec: dict) -> dict | None:
    """The memory estimate of a training record against its measured peak (CUDA allocated, or CPU
    RSS, which also holds the framework: compared with the estimate plus its overhead)."""
    cfg, res = rec.get("config") or {}, rec.get("results") or {}
    peak, mc = res.get("peak_mem"), rec.get("model_config")
    if not peak or not mc:
        return None
    t = cfg.get("train", {})
    kind = "cuda" if str(rec.get("device", "")).startswith("cuda") else "cpu"
    pre = rec.get("memory_estimate")
    if pre:  # the pre-flight's own estimate, made with the run's real dtypes (train/guards.memory_args)
        total, overhead = pre["total_bytes"], pre["overhead_bytes"]
    else:  # a record from before the pre-flight kept its estimate: re-derived, a full-precision base assumed
        est = memory(ModelShape.from_config(mc), mode=t.get("method", "full"), dtype="float32",
                     batch=rec.get("batch_size", 1), seq_len=rec.get("seq_len", 1),
                     grad_ckpt=bool(t.get("gradient_checkpointing")), lora_rank=cfg.get("lora", {}).get("rank", 16),
                     fused_loss=bool(t.get("fused_loss", True)), compute_dtype=rec.get("dtype"), device_kind=kind)
        total, overhead = est.total, est.overhead
    expected = total + (overhead if kind == "cpu" else 0)
    return {"expected": expected, "measured": peak, "ratio": peak / expected,
            "what": "peak memory (" + ("RSS, with framework" if kind == "cpu" else "CUDA allocated") + ")"}


def build_report(items: list[str | Path], goal: str = "") -> str:
    loaded = [(str(i), *_load(i)) for i in items]
    mfu = [d for _, k, d in loaded if k == "mfu"]
    runs = [(n, d) for n, k, d in loaded if k == "run"]
    lines = [f"# Optimisation goal: {goal or '____'}", ""]
    lines += _baseline(mfu, runs)
    lines += _steps(mfu, runs)
    expected = _expected_rows(mfu, runs)
    lines += _bottlenecks(mfu, runs)
    lines += ["## I expected ___, actually ___", "",
              "Generated from every estimate-vs-measurement gap above 15% and every change that did not help; "
              "add your own below.", "", "| I expected | actually | gap |", "|---|---|---|"]
    lines += [f"| {e} | {a} | {g} |" for e, a, g in expected] or ["| — | — | — |"]
    lines += ["| ___ | ___ | |", ""]
    lines += _headroom(mfu)
    return "\n".join(lines) + "\n"


def _baseline(mfu: list[dict], runs: list[tuple[str, dict]]) -> list[str]:
    out = ["## Baseline", "", "| metric | value | config |", "|---|---|---|"]
    if mfu:
        b = mfu[0]["rungs"][0]
        hw = mfu[0].get("hardware", {})
        out += [f"| device | {hw.get('cpu') or hw.get('gpu') or mfu[0].get('device')} | {mfu[0].get('device')} |",
                f"| tokens/s | {_fmt(b['tokens_per_s'])} | {b['change']} |",
                f"| MFU | {_fmt(b['mfu'], pct=True)} | peak {_gflops(b.get('peak_flops'))} ({b['setting']['dtype']}) |",
                f"| command | `{mfu[0].get('command')}` | load {', '.join(f'{x:.2f}' for x in mfu[0].get('loadavg', []))} |"]
    for name, rec in runs[:1]:
        res = rec.get("results", {})
        mc = rec.get("model_config", {})
        out += [f"| model | {rec.get('num_parameters', '—'):,} params, {mc.get('num_hidden_layers')} layers × "
                f"{mc.get('hidden_size')} | {name} |" if isinstance(rec.get("num_parameters"), int) else
                f"| model | — | {name} |",
                f"| tokens/s | {_fmt(res.get('tokens_per_s'))} | {rec.get('dtype')}, batch {rec.get('batch_size')} × "
                f"{rec.get('seq_len')} |",
                f"| MFU | {_fmt(res.get('mfu'), pct=True)} | peak {_gflops(rec.get('peak_flops'))} |",
                f"| peak memory | {_fmt((res.get('peak_mem') or 0) / 1e6)} MB | {rec.get('device')} |"]
    return out + [""]


def _steps(mfu: list[dict], runs: list[tuple[str, dict]]) -> list[str]:
    out = ["## Optimisation steps", "", "| step | what changed | tokens/s (MFU) | Δ | physical reason |",
           "|---|---|---|---|---|"]
    for m in mfu:
        prev = None
        for r in m["rungs"]:
            if r["tokens_per_s"] is None:
                out.append(f"| {r['step']} | {r['change']} | — | — | {r['note']} |")
                continue
            ratio = r.get("speedup_vs_best") or (r["tokens_per_s"] / prev if prev else None)  # paired when measured so
            delta = f"{ratio - 1:+.0%}" if ratio and r["step"] != "0" else "—"
            kept = "" if r["kept"] or r["step"] == "0" else " (not kept)"
            out.append(f"| {r['step']} | {r['change']}{kept} | {_fmt(r['tokens_per_s'])} ({_fmt(r['mfu'], pct=True)}) "
                       f"| {delta} | {r['reason']} |")
            if r["kept"]:
                prev = r["tokens_per_s"]
    base = None
    for i, (name, rec) in enumerate(runs):
        tps = (rec.get("results") or {}).get("tokens_per_s")
        delta = f"{tps / base - 1:+.0%}" if base and tps else "—"
        out.append(f"| run {i} | {name} | {_fmt(tps)} ({_fmt((rec.get('results') or {}).get('mfu'), pct=True)}) "
                   f"| {delta} | ___ |")
        base = base or tps
    return out + [""]


def _bottlenecks(mfu: list[dict], runs: list[tuple[str, dict]]) -> list[str]:
    out = ["## Bottlenecks and how they were found", ""]
    for m in mfu:
        for r in m["rungs"]:
            if r["step_s"] and r["data_wait_s"] is not None and r["kept"]:
                share = r["data_wait_s"] / r["step_s"]
                out.append(f"- rung {r['step']}: waiting for the loader is {share:.1%} of the step "
                           f"({r['data_wait_s'] * 1e3:.1f} of {r['step_s'] * 1e3:.1f} ms)"
                           + (": the data pipeline is a bottleneck" if share > 0.1 else ": not the bottleneck"))
    for name, rec in runs:
        gap = run_memory_gap(rec)
        if gap:
            out.append(f"- {name}: {gap['what']} {gap['measured'] / 1e6:,.0f} MB, estimated "
                       f"{gap['expected'] / 1e6:,.0f} MB (`lmforge estimate memory`)")
        for w in (rec.get("results") or {}).get("warnings") or []:
            out.append(f"- {name}: {w}")
    return out + ["- ___", ""]


def _expected_rows(mfu: list[dict], runs: list[tuple[str, dict]]) -> list[tuple[str, str, str]]:
    rows = []
    for m in mfu:
        best = m["rungs"][0]["tokens_per_s"]  # each rung is measured against the best rung before it
        for r in m["rungs"][1:]:
            if r["tokens_per_s"] and best and not r["kept"]:
                ratio = r.get("speedup_vs_best") or r["tokens_per_s"] / best
                rows.append((f"{r['change']} to be faster ({r['reason']})",
                             f"{ratio - 1:+.0%} against the best rung before it; not kept", "—"))
            if r["kept"] and r["tokens_per_s"]:
                best = r["tokens_per_s"]
    for name, rec in runs:
        gap = run_memory_gap(rec)
        if gap and abs(gap["ratio"] - 1) > GAP:
            rows.append((f"{name}: {gap['what']} ≈ {gap['expected'] / 1e6:,.0f} MB",
                         f"{gap['measured'] / 1e6:,.0f} MB", f"{gap['ratio'] - 1:+.0%}"))
    return rows


def _headroom(mfu: list[dict]) -> list[str]:
    out = ["## How much room is left (roofline)", ""]
    for m in mfu:
        h = m.get("headroom") or {}
        if "headroom" in h:
            out.append(f"On {h['device']} the ridge point is {h['ridge']:.3g} FLOP/byte and the training step's "
                       f"intensity {h['intensity']:.3g} FLOP/byte, so the roofline allows "
                       f"{h['attainable_flops'] / 1e9:.3g} GFLOP/s; the best rung reaches {h['achieved_flops'] / 1e9:.3g} "
                       f"GFLOP/s: {h['headroom']:.1f}× headroom.")
    return out + (["___"] if len(out) == 2 else []) + [""]


def report(items: list[str], out: Path, goal: str = "") -> Path:
    return atomic_write_text(out, build_report(items, goal))
