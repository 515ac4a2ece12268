"""The scan's prediction beside a measurement, on the layouts this machine can run.

On a machine with a few CPU cores, "2 GPUs" are 2 gloo processes. For one model and one global
batch this trains 1 process (the reference) and the 2-process layouts the trainer runs (DDP, FSDP,
TP=2, PP=2 with 1F1B) for a few steps each through `torchrun`, and keeps each run's median step
time. It predicts the same layouts with `scan.evaluate`, with this machine's numbers in place of a
datasheet's: the compute rate is calibrated on the 1-process run (its measured step = FLOPs / rate),
the link's bandwidth and latency come from `bench/comm.py` (measured now, 2 processes), so the
prediction of the 2-process layouts is out of sample. It reports both orderings and the ratios.
What the scan's model does not know (Python per-call overhead, gloo's own threads competing for 2
cores) shows up as the gap. Random tokens; nothing is downloaded.

    python -m lmforge.bench.scan --out runs/scan-check [--reuse]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from lmforge.model import ModelConfig
from lmforge.parallel.launch import free_port
from lmforge.parallel.probes import random_packed
from lmforge.parallel.scan import ScanSpec, evaluate
from lmforge.perf import estimate as E
from lmforge.track.runs import read_metrics

from .comm import measure
from .report import emit

ROOT = Path(__file__).resolve().parents[3]
MODEL = ["model.hidden_size=256", "model.intermediate_size=688", "model.num_hidden_layers=4",
         "model.num_attention_heads=4", "model.num_key_value_heads=4", "model.tie_word_embeddings=false"]
LAYOUTS = {  # name -> (processes, dp, tp, pp, fsdp, overrides); global batch 8 rows in every one
    "1 process": (1, 1, 1, 1, False, ["train.batch_size=8"]),
    "dp2 (DDP)": (2, 2, 1, 1, False, ["train.batch_size=4"]),
    "dp2-fsdp": (2, 2, 1, 1, True, ["train.batch_size=4", "train.parallel.fsdp=true"]),
    "tp2": (2, 1, 2, 1, False, ["train.batch_size=8", "train.parallel.tp=2"]),
    "pp2 M=4 (1f1b)": (2, 1, 1, 2, False, ["train.batch_size=8", "train.parallel.pp=2",
                                            "train.parallel.microbatches=4"]),
}


def _train(name: str, nproc: int, overrides: list[str], packed: Path, out: Path, steps: int,
           reuse: bool = False) -> float:
    if reuse and (out / "record.json").is_file() and json.loads((out / "record.json").read_text()).get(
            "status") == "finished":
        return _median_step(out)
    args = [str(ROOT / "configs" / "parallel-tiny.yaml"), f"data.path={packed}", f"train.max_steps={steps}",
            "train.eval_every=0", "train.ckpt_every=0", "train.eval_batches=1", "train.log_every=0",
            *MODEL, *overrides, "--out", str(out), "--overwrite"]
    cmd = [sys.executable, "-m", "lmforge.train"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
        "--master-port", str(free_port()), "-m", "lmforge.train"]
    proc = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        raise RuntimeError(f"{name}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    return _median_step(out)


def _median_step(out: Path) -> float:
    rows = read_metrics(out)
    return statistics.median(r["dt_s"] for r in rows[2:])  # the first two steps warm up


def check(out: Path, steps: int = 8, reuse: bool = False) -> dict:
    packed = random_packed(out / "packed", seq_len=64, vocab=512, train_tokens=64 * 8 * (steps + 4) + 1)
    load = os.getloadavg()
    measured = {name: _train(name, n, ov, packed, out / name.split()[0], steps, reuse)
                for name, (n, *_x, ov) in LAYOUTS.items()}
    comm = measure(2, reps=10)
    cfg = json.loads((out / "1" / "record.json").read_text())["model_config"]
    shape = E.ModelShape.from_config(ModelConfig.from_hf(cfg))
    big = comm["rows"][-1]
    # no separate memory-bandwidth bound: the calibrated rate already includes what memory costs
    dev = E.Device(name="this machine (calibrated)", peaks={"float32": 1.0}, bandwidth=float("inf"), memory=None,
                   interconnect=big["all_reduce_busbw_GBps"] * 1e9, kind="cpu")
    spec = ScanSpec(gpus=2, nodes=1, global_batch=8, seq_len=64, dtype="float32",
                    intra_latency_s=comm["latency_s"]["all_reduce"], p2p_latency_s=comm["latency_s"]["p2p"],
                    efficiency=1.0)
    rate_dev = _rate(dev, spec, shape, measured["1 process"])
    one = evaluate(spec, shape, 1, 1, 1, 8, False, False, dev=rate_dev)
    rows = []
    for name, (n, dp, tp, pp, fsdp, ov) in LAYOUTS.items():
        b = 4 if dp == 2 else (2 if pp == 2 else 8)  # micro-batch rows per process
        lay = evaluate(spec, shape, dp, tp, pp, b, fsdp, False, dev=rate_dev) if n > 1 else one
        rows.append({"layout": name, "processes": n, "predicted_s": lay.step_s, "measured_s": measured[name],
                     "ratio": measured[name] / lay.step_s, "compute_s": lay.compute_s, "tp_s": lay.tp_s,
                     "dp_s": lay.dp_s, "bubble": lay.bubble})
    two = [r for r in rows if r["processes"] == 2]
    pred_order = [r["layout"] for r in sorted(two, key=lambda r: r["predicted_s"])]
    meas_order = [r["layout"] for r in sorted(two, key=lambda r: r["measured_s"])]
    return {"rows": rows, "predicted_order": pred_order, "measured_order": meas_order,
            "same_order": pred_order == meas_order, "best_agrees": pred_order[0] == meas_order[0],
            "comm": {k: comm[k] for k in ("latency_s", "bandwidth_GBps")}, "load_before": load,
            "load_after": os.getloadavg(), "cores": os.cpu_count(), "steps": steps,
            "flops_rate": rate_dev.peaks["float32"], "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def _rate(dev, spec, shape, single_s: float):
    """The device with its float32 'peak' set so that the 1-process step is predicted as measured."""
    flops = 3 * E.forward_flops_per_token(shape, spec.seq_len / 2) * spec.global_batch * spec.seq_len
    return replace(dev, peaks={"float32": flops / single_s})


def to_markdown(r: dict) -> str:
    lines = [f"# scan prediction vs measurement on this machine ({r['cores']} cores, {r['when']}; load "
             f"{r['load_before'][0]:.1f} before, {r['load_after'][0]:.1f} after)", "",
             f"Compute rate calibrated on the 1-process run: {r['flops_rate'] / 1e9:.2f} GFLOP/s; link measured now: "
             f"all-reduce latency {r['comm']['latency_s']['all_reduce'] * 1e3:.2f} ms, p2p latency "
             f"{r['comm']['latency_s']['p2p'] * 1e3:.2f} ms, all-reduce bus bandwidth "
             f"{r['comm']['bandwidth_GBps']['all_reduce_bus']:.3f} GB/s. Median step of steps 3-{r['steps']}.", "",
             "| layout | predicted step (s) | measured step (s) | measured / predicted | compute | TP comm | DP comm | bubble |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {x['layout']} | {x['predicted_s']:.3f} | {x['measured_s']:.3f} | {x['ratio']:.2f} | "
              f"{x['compute_s']:.3f} | {x['tp_s']:.3f} | {x['dp_s']:.3f} | {x['bubble']:.0%} |" for x in r["rows"]]
    lines += ["", f"- predicted order (2 processes): {' < '.join(r['predicted_order'])}",
              f"- measured order: {' < '.join(r['measured_order'])}",
              f"- same order: {r['same_order']}; same best: {r['best_agrees']}"]
    return "\n".join(lines) + "\n"


def main(out: Annotated[Path, typer.Option(help="Run directory.")] = Path("runs/scan-check"),
         steps: Annotated[int, typer.Option(help="Steps per layout (the first two are not timed).")] = 8,
         reuse: Annotated[bool, typer.Option(help="Keep finished layout runs in --out (recompute the rest).")] = False,
         ) -> None:
    report = check(out, steps, reuse)
    emit(report, to_markdown, out, "scan_check")


if __name__ == "__main__":
    typer.run(main)
