"""Know the links: all-reduce and point-to-point bandwidth and latency between local processes.

`lmforge doctor --comm` starts `nproc` processes on this machine (gloo on CPU; NCCL, one GPU per
process, when at least two GPUs are visible) and times, per message size, the median of `reps`
calls after a warm-up:
- all-reduce (sum) of S bytes: algorithm bandwidth S / t and bus bandwidth S / t x 2(N-1)/N (the
  bytes each rank moves in a ring; the convention of nccl-tests, comparable across N);
- point-to-point between ranks 0 and 1: half a ping-pong round trip (latency at small S, one-way
  bandwidth S / t at large S).
The smallest size gives the latency alpha and the largest the bandwidth beta of the
alpha + S/beta model that `perf/estimate.py`'s communication formulas and the scan use. On GPUs,
`nvidia-smi topo -m` is recorded beside the figures. It knows nothing about models.

    lmforge doctor --comm              # table + comm.json in $LMFORGE_HOME (or --out's folder)
    python -m lmforge.bench.comm --nproc 4 --out runs/comm
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

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
    import torch
    import torch.distributed as dist

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
    import torch
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def topology() -> str | None:
    """`nvidia-smi topo -m` when present (which GPUs talk over NVLink, PCIe, or across sockets)."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        return subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def measure(nproc: int = 2, quick: bool = False, reps: int | None = None) -> dict:
    import torch

    from lmforge.parallel.launch import run_local

    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= nproc else "gloo"
    sizes, reps = (QUICK_SIZES, reps or 5) if quick else (SIZES, reps or 20)
    load = os.getloadavg()
    rows = run_local(comm_worker, nproc, sizes, reps, backend=backend)[0]
    return {"backend": backend, "nproc": nproc, "reps": reps, "rows": rows, "load_before": load,
            "load_after": os.getloadavg(), "latency_s": {"all_reduce": rows[0]["all_reduce_s"],
                                                          "p2p": rows[0]["p2p_one_way_s"]},
            "bandwidth_GBps": {"all_reduce_bus": rows[-1]["all_reduce_busbw_GBps"], "p2p": rows[-1]["p2p_GBps"]},
            "topology": topology()}


def to_markdown(r: dict) -> str:
    lines = [f"# comm: {r['backend']}, {r['nproc']} local processes (median of {r['reps']}; "
             f"load {r['load_before'][0]:.2f} before, {r['load_after'][0]:.2f} after)", "",
             "| bytes | all-reduce (µs) | algbw (GB/s) | busbw (GB/s) | p2p one-way (µs) | p2p (GB/s) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for x in r["rows"]:
        p2p = f"{x['p2p_GBps']:.3f}" if x["p2p_GBps"] is not None else "—"
        lines.append(f"| {x['bytes']:,} | {x['all_reduce_s'] * 1e6:,.1f} | {x['all_reduce_algbw_GBps']:.3f} | "
                     f"{x['all_reduce_busbw_GBps']:.3f} | {x['p2p_one_way_s'] * 1e6:,.1f} | {p2p} |")
    lines += ["", f"latency: all-reduce {r['latency_s']['all_reduce'] * 1e6:,.1f} µs, p2p "
              f"{r['latency_s']['p2p'] * 1e6:,.1f} µs; bandwidth at {r['rows'][-1]['bytes']:,} B: all-reduce bus "
              f"{r['bandwidth_GBps']['all_reduce_bus']:.3f} GB/s, p2p {r['bandwidth_GBps']['p2p'] or 0:.3f} GB/s"]
    if r.get("topology"):
        lines += ["", "```", r["topology"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def comm_doctor(out: Path | None = None, quick: bool = False, nproc: int = 2) -> int:
    """Measure, print, and write comm.json + comm.md into `out` (a folder; default $LMFORGE_HOME)."""
    from lmforge.track.io import atomic_write_json, atomic_write_text

    if nproc < 2:
        print("doctor --comm: needs at least 2 processes")
        return 2
    report = measure(nproc, quick)
    md = to_markdown(report)
    print(md)
    from lmforge.perf.hardware import lmforge_home

    folder = Path(out) if out is not None else lmforge_home()
    atomic_write_json(folder / "comm.json", report)
    atomic_write_text(folder / "comm.md", md)
    print(f"wrote {folder / 'comm.json'}")
    return 0


def main(nproc: Annotated[int, typer.Option(help="Local processes.")] = 2,
         quick: Annotated[bool, typer.Option(help="Three sizes, 5 repeats.")] = False,
         out: Annotated[Optional[Path], typer.Option(help="Folder for comm.json and comm.md.")] = None) -> None:
    raise typer.Exit(comm_doctor(out, quick, nproc))


if __name__ == "__main__":
    typer.run(main)
