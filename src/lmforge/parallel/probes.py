"""What the parallel self-test and the benchmarks run on every rank: one pipeline bench cell per
schedule (stage calibration, measured bubble beside the formula's and the simulator's), the all-reduce
and point-to-point timings of the comm benchmark, and a random packed dataset for the trainer runs.

They live here, below `bench/`, because `parallel/selftest.py` runs them under the same torchrun
line as training; `bench/parallel.py` and `bench/comm.py` launch them and write the reports.
Each worker takes (rank, world, ...) in an initialised process group and returns its rows on
rank 0 (None elsewhere). It knows nothing about reports, plots or the CLI.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
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


# ---- the comm benchmark's timings ----

SIZES = (8, 1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 23)  # bytes: 8 B .. 8 MiB
QUICK_SIZES = (8, 1 << 12, 1 << 18)


def _time(fn, reps: int) -> float:
    fn()  # warm-up (connections, buffers)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def comm_worker(rank: int, world: int, sizes: tuple[int, ...], reps: int) -> list[dict] | None:
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    for size in sizes:
        buf = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)
        nbytes = buf.numel() * 4

        def all_reduce():
            dist.all_reduce(buf)
            sync()

        def ping_pong():
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            sync()

        dist.barrier()
        t_ar = _time(all_reduce, reps)
        dist.barrier()
        t_pp = _time(ping_pong, reps) / 2 if world > 1 else float("nan")
        t_ar = max(_gather_max(t_ar), 1e-9)  # an all-reduce is done when the slowest rank is
        rows.append({"bytes": nbytes, "all_reduce_s": t_ar, "all_reduce_algbw_GBps": nbytes / t_ar / 1e9,
                     "all_reduce_busbw_GBps": nbytes / t_ar * 2 * (world - 1) / world / 1e9,
                     "p2p_one_way_s": t_pp, "p2p_GBps": nbytes / t_pp / 1e9 if world > 1 else None})
    return rows if rank == 0 else None


def _gather_max(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def random_packed(path: Path, seq_len: int = 32, vocab: int = 128, train_tokens: int = 4001,
                  val_tokens: int = 641, seed: int = 0) -> Path:
    """A packed folder in `lmforge-packed-v1` layout with random tokens (no tokenizer: no bits per byte)."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    splits = {}
    for split, n in (("train", train_tokens), ("val", val_tokens)):
        toks = rng.integers(3, vocab, n).astype(np.uint16)
        toks[::40] = 1  # a document boundary (eos) every 40 tokens
        toks.tofile(path / f"{split}_00000.bin")
        splits[split] = {"files": [f"{split}_00000.bin"], "file_tokens": [n], "rows": (n - 1) // seq_len,
                         "tokens": n}
    (path / "manifest.json").write_text(json.dumps({
        "format": "lmforge-packed-v1", "seq_len": seq_len, "dtype": "uint16", "vocab_size": vocab,
        "eos_token_id": 1, "bos_token_id": 0, "splits": splits, "data_hash": f"random-{seed}"}))
    return path
