"""Pictures of the parallelism lab (matplotlib, Agg): a pipeline timeline (one row per stage,
forwards and backwards as bars, idle time blank) and the scan's heatmap. Reads plain lists; knows
nothing about how they were produced (simulated or measured).

    from lmforge.parallel.plots import plot_timeline
    plot_timeline(result.events, "timeline.png", title="1f1b P=4 M=8")
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from lmforge.track.plots import _pyplot


def plot_timeline(events: list[tuple[int, str, int, float, float]], out: str | os.PathLike,
                  title: str = "", unit: str = "s") -> Path:
    """Gantt chart of (stage, op, micro-batch, start, end) events: F blue, B orange, labelled by micro-batch."""
    plt = _pyplot()
    stages = 1 + max(e[0] for e in events)
    t0 = min(e[3] for e in events)
    fig, ax = plt.subplots(figsize=(9, 0.55 * stages + 1.2), dpi=110)
    for s, op, m, start, end in events:
        ax.barh(s, end - start, left=start - t0, color="C0" if op == "F" else "C1", edgecolor="white", lw=0.5)
        if end - start > 0:
            ax.text((start + end) / 2 - t0, s, str(m), ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(stages), [f"stage {s}" for s in range(stages)])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit}); blue forward, orange backward, blank idle")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return Path(out)


def plot_heatmap(rows: list[str], cols: list[str], values: list[list[float | str | None]], out: str | os.PathLike,
                 title: str = "", label: str = "") -> Path:
    """A labelled heatmap; None cells (configurations that do not fit) are grey and marked 'OOM',
    string cells (configurations that do not exist) grey with that text."""
    plt = _pyplot()
    data = np.array([[np.nan if v is None or isinstance(v, str) else v for v in r] for r in values], dtype=float)
    fig, ax = plt.subplots(figsize=(1.1 * len(cols) + 2.5, 0.5 * len(rows) + 1.8), dpi=110)
    cmap = plt.get_cmap("viridis_r").with_extremes(bad="#dddddd")
    im = ax.imshow(np.ma.masked_invalid(data), cmap=cmap, aspect="auto")
    ax.set_xticks(range(len(cols)), cols, rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    for i in range(len(rows)):
        for j in range(len(cols)):
            v = data[i, j]
            text = values[i][j] if isinstance(values[i][j], str) else "OOM" if np.isnan(v) else f"{v:.3g}"
            ax.text(j, i, text, ha="center", va="center", fontsize=7)
    fig.colorbar(im, ax=ax, label=label)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return Path(out)
