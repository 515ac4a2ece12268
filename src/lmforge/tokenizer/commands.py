"""`lmforge tokenizer ...`: the command-line face of `lmforge.tokenizer`.

Parses arguments, calls `train_tokenizer`, prints a summary. No logic of its own lives here;
heavy libraries load only when a verb runs, so `lmforge --help` stays fast.

    lmforge tokenizer train python-docs --vocab-size 8192 --out runs/tok
"""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(help="Train byte-level BPE tokenizers (Hugging Face format, ChatML template).",
                  no_args_is_help=True)


@app.callback()
def _group() -> None:
    """Train byte-level BPE tokenizers (Hugging Face format, ChatML chat template)."""


_TRAIN_HELP = (
    "Train a byte-level BPE tokenizer on INPUT... and write it to --out: tokenizer.json, "
    "tokenizer_config.json (special tokens, ChatML chat template), special_tokens_map.json, "
    "config.yaml (resolved settings) and record.json (provenance, timings). The folder loads "
    "with transformers.AutoTokenizer.from_pretrained(OUT)."
)


@app.command(help=_TRAIN_HELP)
def train(
    inputs: list[str] = typer.Argument(..., metavar="INPUT", help=(
        "Text to train on: .txt/.md files (one document each), .jsonl/.jsonl.gz files (field "
        "'text'), directories (searched recursively), globs, or the built-in source 'python-docs'.")),
    out: Path = typer.Option(..., "--out", "-o", help="Folder to write the tokenizer into."),
    vocab_size: int = typer.Option(8192, "--vocab-size", "-v",
                                   help="Vocabulary size, rounded up to a multiple of 64."),
    min_frequency: int = typer.Option(2, "--min-frequency", help="Merge only pairs seen this often."),
    text_field: str = typer.Option("text", "--text-field", help="JSONL field that holds the text."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a finished tokenizer in --out."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show the trainer's progress bar."),
) -> None:
    # deferred: rich's table and the trainer (tokenizers, readers), imported when the verb runs, not by --help
    from rich.console import Console
    from rich.table import Table

    from lmforge.tokenizer.train import train_tokenizer

    console = Console(stderr=True)
    try:
        record = train_tokenizer(inputs, out, vocab_size=vocab_size, min_frequency=min_frequency,
                                 show_progress=progress, text_field=text_field, overwrite=overwrite)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        console.print(f"[red]error:[/red] {e}", soft_wrap=True)
        raise typer.Exit(code=2) from None

    table = Table(title=f"tokenizer -> {out}", show_header=False)
    rows = [("vocab size", f"{record['vocab_size']:,} ({record['reserved_tokens']:,} reserved)"),
            ("documents", f"{record['docs']:,}"),
            ("bytes", f"{record['bytes']:,} ({record['bytes'] / 1e6:.2f} MB)"),
            ("seconds", f"{record['seconds']:.2f} ({record['read_seconds']:.2f} reading inputs)"),
            ("MB/s", f"{record['mb_per_s']:.2f}"),
            ("bytes per token", f"{record['bytes_per_token']:.3f}"),
            ("tokenizer hash", record["tokenizer_hash"][:16])]
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)
    for note in record["notes"]:
        console.print(f"[yellow]note:[/yellow] {note}")
