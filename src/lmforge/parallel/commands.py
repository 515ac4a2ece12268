"""`lmforge parallel ...`: the command-line face of `lmforge.parallel` (`lmforge bench parallel` is in
`lmforge.bench.commands`).

    lmforge parallel simulate --schedule 1f1b --stages 4 --microbatches 8 --fwd 1 --bwd 2 --out runs/sim
    lmforge parallel simulate --stages 4 --microbatches 1 --microbatches 8 --fwd 1,1,1,1.5 --bwd 2 --send 0.1

Parses options and calls one function; torch loads only when a verb that needs it runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from lmforge.track.io import atomic_write_json, atomic_write_text
from lmforge.track.run import RunDir

from .plots import plot_heatmap, plot_timeline
from .scan import ScanSpec, heatmap_grid, scan
from .scan import to_markdown as scan_markdown
from .simulate import simulate
from .simulate import to_markdown as simulate_markdown

app = typer.Typer(no_args_is_help=True, help="Pipeline-schedule simulator, strategy scan.")


@app.callback()
def _group() -> None:
    """Pipeline-schedule simulator and parallelism strategy scan."""


def _floats(text: str, name: str) -> float | list[float]:
    try:
        vals = [float(v) for v in text.split(",")]
    except ValueError:
        raise typer.BadParameter(f"{text!r}: give one number or comma-separated numbers, one per stage",
                                 param_hint=name) from None
    return vals[0] if len(vals) == 1 else vals


@app.command("simulate")
def simulate_cmd(
    schedule: Annotated[list[str], typer.Option("--schedule", help="gpipe and/or 1f1b; repeat.")] = ["gpipe", "1f1b"],
    stages: Annotated[int, typer.Option("--stages", "-p", help="Pipeline stages P.")] = 4,
    microbatches: Annotated[list[int], typer.Option("--microbatches", "-m", help="Micro-batches M; repeat.")] = [8],
    fwd: Annotated[str, typer.Option(help="Forward time of one micro-batch per stage (one value or P values).")] = "1",
    bwd: Annotated[str, typer.Option(help="Backward time per stage (one value or P values).")] = "2",
    send: Annotated[float, typer.Option(help="Time of one activation/gradient hop between stages.")] = 0.0,
    act_bytes: Annotated[str, typer.Option(help="Activation bytes one micro-batch holds per stage.")] = "0",
    out: Annotated[Optional[Path], typer.Option(help="Run directory for simulate.json/.md and timelines.")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace a finished run in --out.")] = False,
) -> None:
    """Predict bubble fraction, step time and peak activation memory of GPipe and 1F1B with a
    discrete-event simulation; prints a table beside the (P-1)/(M+P-1) formula."""
    try:
        results = [simulate(s, stages, m, _floats(fwd, "--fwd"), _floats(bwd, "--bwd"), send,
                            _floats(act_bytes, "--act-bytes")) for s in schedule for m in microbatches]
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    md = simulate_markdown(results)
    print(md)
    if out is None:
        return

    run = RunDir(out, overwrite=overwrite)
    run.write_config({"schedule": schedule, "stages": stages, "microbatches": microbatches, "fwd": fwd,
                      "bwd": bwd, "send": send, "act_bytes": act_bytes})
    atomic_write_json(run.path / "simulate.json", [r.to_dict(events=True) for r in results])
    atomic_write_text(run.path / "simulate.md", md)
    for r in results:
        plot_timeline(r.events, run.path / f"timeline-{r.schedule}-P{r.stages}-M{r.microbatches}.png",
                      title=f"{r.schedule} P={r.stages} M={r.microbatches} (simulated)", unit="units")
    run.finish(cells=[r.to_dict() for r in results])
    print(f"wrote {run.path}")


@app.command("scan")
def scan_cmd(
    model: Annotated[str, typer.Option(help="Preset (llama-7b, llama3-8b, ...), config.json or HF folder.")] = "llama-7b",
    gpus: Annotated[int, typer.Option(help="GPUs in all.")] = 8,
    nodes: Annotated[int, typer.Option(help="Nodes they sit in (GPUs per node = gpus / nodes).")] = 1,
    gpu: Annotated[str, typer.Option(help="GPU from the datasheet table (peaks, memory, NVLink).")] = "H100 SXM",
    intra_bw: Annotated[Optional[float], typer.Option(help="GB/s per GPU inside a node [default: datasheet].")] = None,
    inter_bw: Annotated[float, typer.Option(help="GB/s per GPU between nodes.")] = 25.0,
    global_batch: Annotated[int, typer.Option(help="Sequences per optimizer step.")] = 64,
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence.")] = 2048,
    efficiency: Annotated[float, typer.Option(help="Achieved fraction of peak FLOP/s.")] = 0.5,
    out: Annotated[Optional[Path], typer.Option(help="Run directory for scan.json/.md and heatmap.png.")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace a finished run in --out.")] = False,
) -> None:
    """Enumerate DP x TP x PP x micro-batch x sharding (DDP/FSDP) x activation checkpointing, drop what
    does not fit (perf/estimate.py's memory), predict step time (roofline + communication model +
    pipeline simulator), rank; show the gain over the naive layouts and why TP across nodes loses."""
    spec = ScanSpec(model=model, gpus=gpus, nodes=nodes, gpu=gpu, intra_bw_GBps=intra_bw, inter_bw_GBps=inter_bw,
                    global_batch=global_batch, seq_len=seq_len, efficiency=efficiency)
    try:
        report = scan(spec)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    md = scan_markdown(report)
    print(md)
    if out is None:
        return

    run = RunDir(out, overwrite=overwrite)
    run.write_config(spec)
    atomic_write_json(run.path / "scan.json", report)
    atomic_write_text(run.path / "scan.md", md)
    rows, cols, grid = heatmap_grid(report)
    plot_heatmap(rows, cols, grid, run.path / "heatmap.png", label="predicted step (s), best over b/sharding/ckpt",
                 title=f"{model} on {gpus} GPUs in {nodes} node(s); dp = gpus / (tp x pp)")
    run.finish(best=report["best"]["name"] if report["best"] else None,
               gain_over_best_naive=report["gain_over_best_naive"])
    print(f"wrote {run.path}")

