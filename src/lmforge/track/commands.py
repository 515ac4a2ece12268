"""`lmforge runs list|show|compare`: look at run directories from the terminal.

    lmforge runs list runs/
    lmforge runs show runs/tiny
    lmforge runs compare runs/a runs/b --plot compare.png
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from lmforge.track.plots import plot_runs
from lmforge.track.runs import (HEADLINE, config_diff, list_runs, metrics_side_by_side, provenance_diff, read_record,
                                summarize)

app = typer.Typer(help="List, show and compare run directories.", no_args_is_help=True)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


@app.command("list", help="Every run below DIR (default: runs/) with its headline numbers.")
def list_(root: Path = typer.Argument(Path("runs"), help="Folder to search for record.json files.")) -> None:
    try:
        runs = list_runs(root)
    except FileNotFoundError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=2) from None
    table = Table(title=f"runs in {root}")
    cols = ("run", "status", "stage", "method", *HEADLINE)
    for c in cols:
        table.add_column(c)
    for run in runs:
        row = summarize(run)
        table.add_row(*(_fmt(row.get(c)) for c in cols))
    Console(width=200).print(table)


@app.command("show", help="A run's record (provenance and results) as JSON.")
def show(run: Path = typer.Argument(..., help="Run directory.")) -> None:
    try:
        typer.echo(json.dumps(read_record(run), indent=2))
    except FileNotFoundError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=2) from None


@app.command("compare", help="Config differences and metrics side by side for two runs.")
def compare(
    a: Path = typer.Argument(..., help="First run directory."),
    b: Path = typer.Argument(..., help="Second run directory."),
    key: str = typer.Option("loss", "--key", help="Metric to align by step (loss, val_loss, tokens_per_s...)."),
    every: int = typer.Option(1, "--every", help="Show every N-th step."),
    plot: Path = typer.Option(None, "--plot", help="Also write both loss curves into this PNG."),
) -> None:
    console = Console(width=200)
    try:
        sa, sb = summarize(a), summarize(b)
    except FileNotFoundError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=2) from None
    diff = Table(title="config differences")
    for c in ("key", str(a), str(b)):
        diff.add_column(c)
    for k, va, vb in config_diff(a, b):
        diff.add_row(k, _fmt(va), _fmt(vb))
    console.print(diff)
    head = Table(title="results")
    for c in ("field", str(a), str(b)):
        head.add_column(c)
    for k in HEADLINE:
        head.add_row(k, _fmt(sa.get(k)), _fmt(sb.get(k)))
    console.print(head)
    side = Table(title=f"{key} by step")
    for c in ("step", str(a), str(b)):
        side.add_column(c)
    for step, va, vb in metrics_side_by_side(a, b, key, every):
        side.add_row(str(step), _fmt(va), _fmt(vb))
    console.print(side)
    if plot:
        console.print(f"plot -> {plot_runs([a, b], plot)}")


@app.command("diff", help="What differs between two runs: config, packages, git, data hashes, hardware, determinism.")
def diff(
    a: Path = typer.Argument(..., help="First run directory."),
    b: Path = typer.Argument(..., help="Second run directory."),
    as_json: bool = typer.Option(False, "--json", help="Print the differences as JSON."),
) -> None:
    try:
        sections = provenance_diff(a, b)
    except FileNotFoundError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=2) from None
    if as_json:
        typer.echo(json.dumps({s: [{"key": k, "a": va, "b": vb} for k, va, vb in rows] for s, rows in sections.items()},
                              indent=2, default=str))
        return
    for section, rows in sections.items():
        typer.echo(f"{section}: " + ("identical" if not rows else f"{len(rows)} difference(s)"))
        for key, va, vb in rows:
            typer.echo(f"  {key}: {_fmt(va)}  ->  {_fmt(vb)}")
