"""The `lmforge` command: one verb per stage. Each verb parses its options and calls one
function of a package; no stage logic lives here. Verbs with sub-verbs (tokenizer, data, runs,
eval, bench) are Typer apps owned by their package's `commands.py`. Heavy libraries (torch,
transformers) load only when a verb runs, so `lmforge --help` stays fast.

    lmforge --help
    lmforge doctor
    lmforge tokenizer train python-docs --vocab-size 8192 --out runs/tok
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from lmforge.tokenizer.commands import app as tokenizer_app

app = typer.Typer(
    name="lmforge",
    help="From an empty directory to a trained, evaluated, served and monitored language model.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(tokenizer_app, name="tokenizer",
              help="Train a byte-level BPE tokenizer (reads text/JSONL/python-docs; writes a HF tokenizer dir).")


@app.command("doctor")
def doctor_cmd(
    out: Annotated[Optional[Path], typer.Option(
        "--out", help="Where to write the hardware profile JSON [default: $LMFORGE_HOME/hardware.json].")] = None,
    quick: Annotated[bool, typer.Option(
        "--quick", help="Small matrices and short timing (tests); still measured.")] = False,
) -> None:
    """Check Python, torch, transformers and the accelerator; measure matmul peaks (GFLOP/s) for
    float32 and bfloat16; write the hardware profile that MFU figures use. Exits non-zero with a
    reason when something is broken."""
    from lmforge.perf.doctor import doctor

    raise typer.Exit(doctor(out, quick))


@app.command("demo")
def demo_cmd(
    out: Annotated[Path, typer.Option("--out", help="Run directory for the demo's products.")] = Path("runs/demo"),
) -> None:
    """Run what exists end to end: doctor, tokenizer training on python-docs, and model parity
    against transformers for every supported architecture. Writes OUT/report.md."""
    from lmforge.demo import run_demo

    raise typer.Exit(run_demo(out))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
