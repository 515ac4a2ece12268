"""`lmforge data ...`: the command-line face of `lmforge.data` (verbs `prepare`, `pack`, `synth`).

Parses arguments, calls `prepare_dataset` / `pack_dataset` / `write_synth`, prints a summary. No logic of its
own lives here; the stage modules (numpy, tokenizers) load only when a verb runs, so `lmforge --help`
stays fast.

    lmforge data prepare python-docs --out runs/data
    lmforge data pack runs/data --tokenizer runs/tok --seq-len 512 --out runs/packed
    lmforge data synth mix --n 20000 --seed 1 --out runs/reasoning/train.jsonl
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from lmforge.config import ConfigError
from lmforge.data.readers import ReaderError

app = typer.Typer(help="Clean, deduplicate, split and pack text for training.", no_args_is_help=True)


@app.callback()
def _group() -> None:
    """Clean, deduplicate, split (prepare) and tokenize + pack (pack) training text."""


_EXECUTOR_HELP = ("local: worker processes on this machine; ray: Ray tasks on a cluster (pip install "
                  "'lmforge[ray]'), the same output bytes.")
_ADDRESS_HELP = ("Ray cluster to join with --executor ray (`ray start --head` prints it; 'auto' finds a local "
                 "one); default: start a local cluster.")


def _executor(name: str, address: str | None) -> object | None:
    """None for the local executor, else a RayExecutor joined to its cluster."""
    if name not in ("local", "ray"):
        raise ValueError(f"--executor {name!r}: choose 'local' or 'ray'")
    if name == "local":
        if address:
            raise ValueError("--ray-address is for --executor ray; add --executor ray or drop it")
        return None
    from lmforge.data.executor import RayExecutor  # deferred: Ray is an optional dependency

    return RayExecutor(address)


_PREPARE_HELP = (
    "Read INPUT... (.txt/.md files, .jsonl/.jsonl.gz with field 'text', .parquet with pyarrow, "
    "directories, globs, or the built-in source 'python-docs'), then normalize, strip boilerplate, "
    "filter by quality, mask PII, remove exact and near duplicates, split train/val/test and drop "
    "train documents that overlap val/test or --eval-set. Writes to --out: splits/{train,val,test}.jsonl, "
    "rejected.jsonl, quarantine.jsonl, stats.json, manifest.json (data_hash), report.md, config.yaml, "
    "record.json. KEY=VALUE arguments override the config (e.g. near_dedup.threshold=0.7)."
)


@app.command(help=_PREPARE_HELP)
def prepare(
    inputs: list[str] = typer.Argument(..., metavar="INPUT... [KEY=VALUE]...", help=(
        "Inputs, optionally followed by config overrides such as split.val=0.01.")),
    out: Path = typer.Option(..., "--out", "-o", help="Folder to write the prepared data into."),
    config: Path | None = typer.Option(None, "--config", "-c", help="YAML config file (PrepareConfig)."),
    eval_set: list[Path] = typer.Option([], "--eval-set", help=(
        "JSONL eval set (fields text/prompt/answer/target/choices/question) whose 13-grams must "
        "not appear in train; repeatable.")),
    workers: int | None = typer.Option(None, "--workers", "-j", help="Processes (default: all cores)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a finished run in --out."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show progress bars."),
    executor: str = typer.Option("local", "--executor", help=_EXECUTOR_HELP),
    ray_address: str | None = typer.Option(None, "--ray-address", help=_ADDRESS_HELP),
) -> None:
    from lmforge.data.prepare import prepare_dataset  # deferred: numpy and the pipeline, not for --help

    console = Console(stderr=True, soft_wrap=True)
    overrides = [i for i in inputs if "=" in i and "://" not in i and not Path(i).exists()]
    paths = [i for i in inputs if i not in overrides]
    try:
        stats = prepare_dataset(paths, out, config=config, eval_sets=[str(e) for e in eval_set],
                                overrides=overrides, workers=workers, overwrite=overwrite,
                                show_progress=progress, executor=_executor(executor, ray_address))
    except (FileNotFoundError, FileExistsError, ConfigError, ReaderError, ValueError, ImportError,
            ConnectionError) as e:  # ConnectionError: --ray-address with no cluster there
        console.print(f"[red]error:[/red] {e}", soft_wrap=True)
        raise typer.Exit(code=2) from None
    _print_prepare(stats, out)


def _print_prepare(stats: dict, out: Path) -> None:
    table = Table(title=f"data prepare -> {out}")
    for col in ("step", "in", "out", "dropped"):
        table.add_column(col, justify="right" if col != "step" else "left")
    for name, step in stats["steps"].items():
        dropped = ", ".join(f"{k} {v}" for k, v in step["dropped"].items()) or "-"
        table.add_row(name, str(step["in"]), str(step["out"]), dropped)
    Console().print(table)
    t = stats["totals"]
    Console().print(f"read {t['read']}  kept {t['kept']}  rejected {t['rejected']}  "
                    f"quarantined {t['quarantined']}  |  {stats['mb_per_s']:.2f} MB/s "
                    f"with {stats['workers']} worker(s)")


_PACK_HELP = (
    "Tokenize PREPARED_DIR/splits/{train,val,test}.jsonl with --tokenizer and pack each split into "
    "one token stream ([BOS] doc [EOS] per document) cut into memmap shards {split}_NNNNN.bin "
    "(uint16 when the vocabulary fits, else uint32). Writes to --out: the shards, manifest.json "
    "(format lmforge-packed-v1: seq_len, dtype, token ids, tokenizer_hash, data_hash, rows/tokens/"
    "documents per split), config.yaml and record.json. Read it with lmforge.data.loader.PackedLoader."
)


@app.command(help=_PACK_HELP)
def pack(
    prepared_dir: Path = typer.Argument(..., metavar="PREPARED_DIR", help="Output folder of `data prepare`."),
    tokenizer: Path = typer.Option(..., "--tokenizer", "-t", help="Tokenizer folder (tokenizer.json)."),
    seq_len: int = typer.Option(..., "--seq-len", help="Input positions per row."),
    out: Path = typer.Option(..., "--out", "-o", help="Folder to write the packed shards into."),
    workers: int | None = typer.Option(None, "--workers", "-j", help="Processes (default: all cores)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a finished pack in --out."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show progress bars."),
    executor: str = typer.Option("local", "--executor", help=_EXECUTOR_HELP),
    ray_address: str | None = typer.Option(None, "--ray-address", help=_ADDRESS_HELP),
) -> None:
    from lmforge.data.pack import pack_dataset  # deferred: numpy and tokenizers, not for --help

    console = Console(stderr=True, soft_wrap=True)
    try:
        manifest = pack_dataset(prepared_dir, tokenizer, seq_len, out, workers=workers,
                                overwrite=overwrite, show_progress=progress,
                                executor=_executor(executor, ray_address))
    except (FileNotFoundError, FileExistsError, ValueError, ImportError, ConnectionError) as e:
        console.print(f"[red]error:[/red] {e}", soft_wrap=True)
        raise typer.Exit(code=2) from None
    table = Table(title=f"data pack -> {out} (seq_len {seq_len}, {manifest['dtype']})")
    for col in ("split", "documents", "tokens", "rows", "shards"):
        table.add_column(col, justify="right" if col != "split" else "left")
    for split, s in manifest["splits"].items():
        table.add_row(split, f"{s['documents']:,}", f"{s['tokens']:,}", f"{s['rows']:,}", str(len(s["files"])))
    Console().print(table)


@app.command(help="Write N synthetic tasks with verifiable answers and written-out steps to --out (JSONL rows "
                  "prompt, answer, reasoning, category, difficulty, text) and OUT.record.json (seed, counts, "
                  "and the proof that no arith-cot eval prompt is in the file). TASK: add, sub, mul, word, mix.")
def synth(
    task: str = typer.Argument(..., help="add | sub | mul | word | mix (all categories)."),
    n: int = typer.Option(..., "--n", help="Rows to write."),
    seed: int = typer.Option(..., "--seed", help="Generator seed (any but arith-cot's eval seed)."),
    out: Path = typer.Option(..., "--out", "-o", help="JSONL file to write."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --out."),
) -> None:
    from lmforge.data.synth import write_synth  # deferred: the task generators, not for --help

    try:
        rec = write_synth(task, n, seed, out, overwrite=overwrite)
    except (FileExistsError, ValueError) as e:
        Console(stderr=True).print(f"[red]error:[/red] {e}", soft_wrap=True)
        raise typer.Exit(code=2) from None
    Console().print(f"{rec['rows']} rows ({', '.join(f'{k} {v}' for k, v in rec['categories'].items())}) -> {out}; "
                    f"{rec['dropped_eval_overlap']} eval prompts dropped, overlap with arith-cot "
                    f"{rec['eval_overlap_after']}", highlight=False)
