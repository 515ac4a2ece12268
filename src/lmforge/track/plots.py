"""Loss curves as PNG (matplotlib, Agg backend: no display needed).

`plot_loss_curve(run)` draws a run's train loss per step and its val loss at each evaluation
from `metrics.jsonl` into `loss.png`; `plot_runs` overlays several runs. Knows nothing about
training; it reads the files every stage writes.

    python -c "from lmforge.track.plots import plot_loss_curve; plot_loss_curve('runs/tiny')"
"""

from __future__ import annotations

import os
from pathlib import Path

from lmforge.track.runs import read_metrics


def _pyplot():
    # deferred: matplotlib (~0.3 s) only when a plot is drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: after matplotlib.use("Agg"), which must come first

    return plt


def plot_runs(runs: list[str | os.PathLike], out: str | os.PathLike, title: str | None = None) -> Path:
    """Train (thin) and val (markers) loss against step for each run, in one PNG."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for i, run in enumerate(runs):
        metrics = read_metrics(run)
        color = f"C{i}"
        train = [(m["step"], m["loss"]) for m in metrics if "loss" in m]
        val = [(m["step"], m["val_loss"]) for m in metrics if m.get("val_loss") is not None]
        name = Path(run).name
        if train:
            ax.plot(*zip(*train), color=color, lw=1, alpha=0.6, label=f"{name} train")
        if val:
            ax.plot(*zip(*val), color=color, lw=2, marker="o", ms=3, label=f"{name} val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title or ", ".join(Path(r).name for r in runs))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(out)
    return out


def plot_loss_curve(run: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """`RUN/loss.png` (or `out`): the run's own loss curve."""
    return plot_runs([run], out or Path(run) / "loss.png")
