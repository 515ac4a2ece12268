"""`lmforge demo`: run every stage that exists, end to end, and print what each measured.

Today: doctor (environment + measured matmul peaks), tokenizer training on `python-docs`, and
logit parity of our model against `transformers` for each supported architecture. It writes
OUT/report.md. It knows nothing of how each stage works; it calls their public functions.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from lmforge.track.io import atomic_write_text


def _table(title: str, header: list[str], rows: list[list[str]]) -> tuple[Table, str]:
    table = Table(title=title)
    for h in header:
        table.add_column(h)
    for r in rows:
        table.add_row(*r)
    md = [f"| {' | '.join(header)} |", f"|{'---|' * len(header)}"] + [f"| {' | '.join(r)} |" for r in rows]
    return table, "\n".join(md)


def run_demo(out: Path) -> int:
    from lmforge.model.reference import VARIANTS, logit_parity
    from lmforge.perf.doctor import doctor
    from lmforge.perf.hardware import load_profile
    from lmforge.tokenizer import train_tokenizer

    console = Console()
    out.mkdir(parents=True, exist_ok=True)
    sections = ["# lmforge demo\n"]

    console.rule("[bold]1. doctor")
    profile_path = out / "hardware.json"
    if doctor(profile_path) != 0:
        console.print("[red]doctor found a problem; fix it first[/]")
        return 1
    profile = load_profile(profile_path) or {}
    peaks = {k: v for k, v in (profile.get("peak_flops") or {}).items()}
    rows = [[dtype, f"{flops / 1e9:,.1f}"] for dtype, flops in peaks.items()]
    _, md = _table("matmul peak", ["dtype", "GFLOP/s"], rows)
    sections.append(f"## Doctor\n\n{md}\n")

    console.rule("[bold]2. tokenizer on python-docs")
    tok_dir = out / "tokenizer"
    if tok_dir.exists():
        shutil.rmtree(tok_dir)
    record = train_tokenizer(["python-docs"], tok_dir, vocab_size=8192, show_progress=True)
    rows = [["vocab size", f"{record['vocab_size']:,}"], ["documents", f"{record['docs']:,}"],
            ["text", f"{record['bytes'] / 1e6:.2f} MB"], ["seconds", f"{record['seconds']:.2f}"],
            ["bytes per token", f"{record['bytes_per_token']:.2f}"]]
    table, md = _table("tokenizer", ["", "value"], rows)
    console.print(table)
    sections.append(f"## Tokenizer\n\n{md}\n")

    console.rule("[bold]3. model parity against transformers (float32)")
    rows = []
    t0 = time.perf_counter()
    for variant in VARIANTS:
        r = logit_parity(variant, out / "parity" / variant)
        rows.append([variant, r["architecture"], f"{r['params']:,}", f"{r['max_abs_err']:.2e}",
                     f"{r['argmax_agree']:.0%}"])
    table, md = _table("logit parity", ["variant", "architecture", "params", "max |Δlogit|", "argmax agree"],
                       rows)
    console.print(table)
    sections.append(f"## Model parity\n\nTiny random `transformers` models, saved, loaded by lmforge, "
                    f"compared on 2×64 random tokens ({time.perf_counter() - t0:.1f} s).\n\n{md}\n")

    report = atomic_write_text(out / "report.md", "\n".join(sections))
    console.print(f"\nreport: {report}")
    return 0
