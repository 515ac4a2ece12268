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

It knows nothing about training loops; the same command runs on any machine (CPU processes).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from lmforge.parallel.parity import Spec, make_model, split_microbatches
from lmforge.parallel.pipeline import IGNORE, PipelineExecutor, PipelineStageModule, loss_sum, tied_group
from lmforge.parallel.schedules import SCHEDULES, bubble_formula, schedule
from lmforge.parallel.simulate import simulate

FAITHFUL_CPU_RATIO = 0.9
TARGET = 0.20


@dataclass(frozen=True)
class BenchSpec:
    stages: tuple[int, ...] = (2, 4)
    microbatches: tuple[int, ...] = (1, 2, 4, 8, 16)
    schedules: tuple[str, ...] = SCHEDULES
    hidden_size: int = 128
    intermediate_size: int = 344
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    vocab_size: int = 512
    seq_len: int = 64
    microbatch_rows: int = 2
    steps: int = 3
    calib_reps: int = 7
    threads: int = 1
    seed: int = 0

    def model_spec(self, microbatches: int) -> Spec:
        return Spec(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                    num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
                    num_key_value_heads=self.num_attention_heads, vocab_size=self.vocab_size,
                    tie_word_embeddings=False, batch=self.microbatch_rows * microbatches, seq_len=self.seq_len,
                    microbatches=microbatches, dtype="float32", seed=self.seed)


@dataclass
class Cell:
    schedule: str
    stages: int
    microbatches: int
    bubble_formula: float
    bubble_sim: float
    bubble_measured: float
    err_formula: float  # |measured - formula| / measured
    err_sim: float
    step_sim_s: float
    step_measured_s: float
    cpu_over_wall: float  # compute actions' thread CPU time / wall time
    faithful: bool
    in_target: bool | None  # None where the target does not apply (M < P or not faithful)
    bubbles_measured: list[float] = field(default_factory=list)
    # + "timeline": the last timed step's (stage, op, micro-batch, start, end) compute events


def _random_batch(spec: Spec, g: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, spec.vocab_size, (spec.batch, spec.seq_len + 1), generator=g)
    return {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}


def _calibrate(stage: PipelineStageModule, mb: dict, rank: int, world: int, reps: int) -> tuple[float, float]:
    """Median forward and backward seconds of one micro-batch on this stage, run while others wait."""
    fwd, bwd = [], []
    b, T = mb["input_ids"].shape
    for s in range(world):
        dist.barrier()
        if s != rank:
            continue
        for _ in range(reps + 1):  # the first is a warm-up
            x = mb["input_ids"] if stage.first else torch.randn(b, T, stage.hidden_size, requires_grad=True)
            t = time.perf_counter()
            out = stage(x)
            if stage.last:
                out = loss_sum(out, mb["labels"]) / out.shape[0]
            t1 = time.perf_counter()
            torch.autograd.backward(out, None if stage.last else torch.randn_like(out))
            t2 = time.perf_counter()
            fwd.append(t1 - t)
            bwd.append(t2 - t1)
        stage.zero_grad(set_to_none=True)
    return statistics.median(fwd[1:]), statistics.median(bwd[1:])


def _send_seconds(shape: tuple[int, ...], rank: int, reps: int = 20) -> float:
    """One-way time of one activation between ranks 0 and 1: half the median ping-pong round trip."""
    buf = torch.randn(shape)
    times = []
    dist.barrier()
    if rank in (0, 1):
        for _ in range(reps):
            t = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            times.append(time.perf_counter() - t)
    dist.barrier()
    out = [statistics.median(times) / 2 if times else 0.0]
    dist.broadcast_object_list(out, src=0)
    return out[0]


def measured_bubble(events_by_stage: list[list]) -> tuple[float, float, float]:
    """(bubble, step window seconds, compute CPU/wall) from every stage's events of one step."""
    compute = [[e for e in evs if e.op in ("F", "B")] for evs in events_by_stage]
    start = min(e.start for evs in compute for e in evs)
    end = max(e.end for evs in compute for e in evs)
    busy = sum(e.end - e.start for evs in compute for e in evs)
    cpu = sum(e.cpu_s for evs in compute for e in evs)
    window = end - start
    return 1 - busy / (len(compute) * window), window, cpu / busy if busy else 1.0


def bench_worker(rank: int, world: int, bspec: BenchSpec) -> list[dict] | None:
    """All cells for P = world; rank 0 returns them."""
    g = torch.Generator().manual_seed(bspec.seed + 7)
    base = bspec.model_spec(1)
    model = make_model(base)
    stage = PipelineStageModule(model, rank, world)
    ranks = list(range(world))
    ex = PipelineExecutor(stage, ranks, tied_group(world, ranks, stage.tied))
    f_s, b_s = _calibrate(stage, _random_batch(base, g), rank, world, bspec.calib_reps)
    fb = [None] * world
    dist.all_gather_object(fb, (f_s, b_s))
    send_s = _send_seconds((bspec.microbatch_rows, bspec.seq_len, bspec.hidden_size), rank)
    cells = []
    for name in bspec.schedules:
        for M in bspec.microbatches:
            spec = bspec.model_spec(M)
            plan = schedule(name, world, M)[rank]
            runs = []
            for i in range(1 + bspec.steps):
                batch = _random_batch(spec, g)
                n = int((batch["labels"] != IGNORE).sum())
                mbs = split_microbatches(batch, M)
                dist.barrier()
                res = ex.step(plan, mbs, 1.0 / n, torch.float32)
                model.zero_grad(set_to_none=True)
                evs = [None] * world
                dist.all_gather_object(evs, res.events)
                if i:  # step 0 warms up
                    runs.append(measured_bubble(evs))
                    timeline = [(s, e.op, e.mb, e.start, e.end) for s, stage_evs in enumerate(evs)
                                for e in stage_evs if e.op in ("F", "B")]
            if rank == 0:
                cells.append({**_cell(name, world, M, runs, fb, send_s), "timeline": timeline})
    if rank == 0:
        return [{"calibration": {"fwd_s": [x[0] for x in fb], "bwd_s": [x[1] for x in fb], "send_s": send_s}},
                *cells]
    return None


def _cell(name: str, P: int, M: int, runs: list[tuple[float, float, float]], fb: list, send_s: float) -> dict:
    sim = simulate(name, P, M, [x[0] for x in fb], [x[1] for x in fb], send_s)
    bubble, window, ratio = sorted(runs, key=lambda r: r[1])[len(runs) // 2]  # the median step
    formula = bubble_formula(P, M)
    faithful = ratio >= FAITHFUL_CPU_RATIO
    err_sim = abs(bubble - sim.bubble) / bubble if bubble > 0 else float("inf")
    return asdict(Cell(name, P, M, formula, sim.bubble, bubble,
                       abs(bubble - formula) / bubble if bubble > 0 else float("inf"), err_sim,
                       sim.step_s, window, ratio, faithful,
                       (err_sim < TARGET) if faithful and M >= P else None, [r[0] for r in runs]))


def bench_parallel(bspec: BenchSpec) -> dict:
    from lmforge.parallel.launch import run_local

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
    from lmforge.parallel.launch import run_local
    from lmforge.parallel.parity import reference, tp_worker

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
