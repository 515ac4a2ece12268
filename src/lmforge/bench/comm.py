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
`nvidia-smi topo -m` is recorded beside the figures. The timing worker (`comm_worker`) is in
`parallel/probes.py`, where the parallel self-test runs it too. It knows nothing about models.

    lmforge doctor --comm              # table + comm.json in $LMFORGE_HOME (or --out's folder)
    python -m lmforge.bench.comm --nproc 4 --out runs/comm
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Annotated, Optional

import typer

from lmforge.parallel.launch import run_local
from lmforge.perf.hardware import lmforge_home
from lmforge.bench.report import emit


def topology() -> str | None:
    """`nvidia-smi topo -m` when present (which GPUs talk over NVLink, PCIe, or across sockets)."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        return subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def measure(nproc: int = 2, quick: bool = False, reps: int | None = None) -> dict:
    import torch  # deferred: every `lmforge` verb imports this module, and a CLI verb starts without torch

    from lmforge.parallel.probes import QUICK_SIZES, SIZES, comm_worker  # deferred: torch, as above

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
    if nproc < 2:
        print("doctor --comm: needs at least 2 processes")
        return 2
    report = measure(nproc, quick)
    folder = Path(out) if out is not None else lmforge_home()
    emit(report, to_markdown, folder, "comm")
    print(f"wrote {folder / 'comm.json'}")
    return 0


def main(nproc: Annotated[int, typer.Option(help="Local processes.")] = 2,
         quick: Annotated[bool, typer.Option(help="Three sizes, 5 repeats.")] = False,
         out: Annotated[Optional[Path], typer.Option(help="Folder for comm.json and comm.md.")] = None) -> None:
    raise typer.Exit(comm_doctor(out, quick, nproc))


if __name__ == "__main__":
    typer.run(main)
