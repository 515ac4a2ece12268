"""`lmforge bench parallel`: the real pipeline (pipeline.py) over a grid of stages P, micro-batches M
and both schedules, measured bubble beside the formula's and the simulator's.

Per P, one process per stage (gloo, `threads` torch threads each) builds the same random model.
First each stage is timed alone (the others wait in a barrier): its forward and backward of one
micro-batch (median of `calib_reps`), and the one-way send time of one activation between two
ranks (ping-pong). The simulator gets exactly these figures. Then each cell runs 1 warm-up step
and `steps` timed steps; from every stage's timestamps,
    measured bubble = 1 - sum over stages of compute seconds / (P x step window),
the window running from the first forward's start to the last backward's end on any stage
(CLOCK_MONOTONIC is one clock for every process of a machine). The median step is kept.

Faithfulness: each compute action records its thread CPU time beside its wall time; when P
processes share fewer cores, busy stages are time-sliced and CPU/wall falls below 1. A cell counts
as faithful when that ratio is >= 0.9; the 20% target applies to faithful cells with M >= P.

    lmforge bench parallel --out runs/bench-parallel                 # P 2,4 x M 1..16 x gpipe/1f1b
    lmforge bench parallel --stages 2 --microbatches 4 --steps 2     # a small slice

The per-rank worker (`bench_worker`: calibration, timed steps, one cell) is in `parallel/probes.py`,
where the parallel self-test runs it too; this module launches it and writes the report.
It knows nothing about training loops; the same command runs on any machine (CPU processes).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict

from lmforge.parallel.launch import run_local
from lmforge.parallel.parity import Spec, reference, tp_worker
from lmforge.parallel.probes import BenchSpec, bench_worker


def bench_parallel(bspec: BenchSpec) -> dict:
    report: dict = {"spec": asdict(bspec), "cores": os.cpu_count(), "load_before": os.getloadavg(),
                    "calibration": {}, "cells": []}
    t0 = time.perf_counter()
    for P in bspec.stages:
        if P > bspec.num_hidden_layers:
            raise ValueError(f"--stages {P} > num_hidden_layers {bspec.num_hidden_layers}")
        calib, *cells = run_local(bench_worker, P, bspec, threads=bspec.threads)[0]
        report["calibration"][str(P)] = calib["calibration"]
        report["cells"] += cells
    report["load_after"] = os.getloadavg()
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    return report


def to_markdown(report: dict) -> str:
    s = report["spec"]
    lines = [f"# bench parallel: measured pipeline bubble vs (P-1)/(M+P-1) and the simulator", "",
             f"{s['num_hidden_layers']} layers, hidden {s['hidden_size']}, {s['microbatch_rows']} x {s['seq_len']} "
             f"tokens per micro-batch, float32, gloo, {s['threads']} thread(s) per stage, {report['cores']} cores; "
             f"load {report['load_before'][0]:.2f} before, {report['load_after'][0]:.2f} after; "
             f"{s['steps']} timed steps per cell (median).", ""]
    for P, c in report["calibration"].items():
        lines.append(f"- P={P} calibration (ms): fwd {', '.join(f'{x * 1e3:.2f}' for x in c['fwd_s'])}; "
                     f"bwd {', '.join(f'{x * 1e3:.2f}' for x in c['bwd_s'])}; send {c['send_s'] * 1e3:.3f}")
    lines += ["", "| schedule | P | M | formula | simulator | measured | err formula | err sim | step sim (ms) | "
              "step meas (ms) | CPU/wall | target <20% |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for c in report["cells"]:
        target = {True: "yes", False: "NO", None: "n/a" if c["faithful"] else "n/a (oversubscribed)"}[c["in_target"]]
        lines.append(f"| {c['schedule']} | {c['stages']} | {c['microbatches']} | {c['bubble_formula']:.3f} | "
                     f"{c['bubble_sim']:.3f} | {c['bubble_measured']:.3f} | {c['err_formula']:.0%} | "
                     f"{c['err_sim']:.0%} | {c['step_sim_s'] * 1e3:.1f} | {c['step_measured_s'] * 1e3:.1f} | "
                     f"{c['cpu_over_wall']:.2f} | {target} |")
    return "\n".join(lines) + "\n"


def tp_bytes(degrees: tuple[int, ...] = (1, 2, 4), dtype: str = "float32") -> list[dict]:
    """All-reduce payload bytes per layer (forward + backward of one batch) and the largest logit and
    gradient differences from one process, per TP degree (N > 1 runs N processes)."""
    spec = Spec(dtype=dtype, num_attention_heads=4, num_key_value_heads=4)
    want = reference(spec)
    rows = []
    for n in degrees:
        got = tp_worker(0, 1, spec) if n == 1 else run_local(tp_worker, n, spec)[0]
        per_layer = sorted(set(got["bytes_per_layer"].values()))
        rows.append({"tp": n, "bytes_per_layer": per_layer[0] if len(per_layer) == 1 else per_layer,
                     "ring_wire_bytes_per_rank": round(per_layer[0] * 2 * (n - 1) / n) if n > 1 else 0,
                     "all_reduces_per_layer": sum(got["calls_by_kind"].values()) // spec.num_hidden_layers,
                     "loss_diff": abs(got["loss"] - want["loss"]),
                     "max_grad_diff": max(float((got["grads"][k] - want["grads"][k]).abs().max()) for k in want["grads"]),
                     "b_T_D": [spec.batch, spec.seq_len, spec.hidden_size]})
    return rows


def tp_markdown(rows: list[dict], dtype: str = "float32") -> str:
    b, T, D = rows[0]["b_T_D"]
    lines = [f"## tensor parallelism: all-reduce bytes per layer ({dtype}, b={b} T={T} D={D}; fwd + bwd)", "",
             "| TP | payload bytes / layer | all-reduces / layer | ring wire bytes / rank | loss diff vs 1 process | "
             "max grad diff |", "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['tp']} | {r['bytes_per_layer']:,} | {r['all_reduces_per_layer']} | {r['ring_wire_bytes_per_rank']:,} | "
              f"{r['loss_diff']:.1e} | {r['max_grad_diff']:.1e} |" for r in rows]
    return "\n".join(lines) + "\n"
