"""`lmforge generate`: the command-line face of `lmforge.engine.batch` (batch inference over a
JSONL file, in one process or on Ray replicas). Parses options, calls `generate_file`, prints
the summary; the engine loads only when the verb runs. Progress (records written of the input's
lines, rate, ETA; `lmforge.track.progress`) is read from --out as it grows: `generate_file` appends
and fsyncs each batch's records, so the file is the truth about what is done, resumed runs included.

    lmforge generate runs/model --input prompts.jsonl --out out.jsonl --max-tokens 64
    lmforge generate runs/model --input prompts.jsonl --out out.jsonl --executor ray --replicas 2
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from lmforge.track.progress import Progress


def generate(
    model: Annotated[Path, typer.Argument(help="Model folder (Hugging Face layout, with its tokenizer).")],
    input: Annotated[Path, typer.Option("--input", "-i", help=(
        "JSONL, one request per line: prompt (text or token ids) or messages, optional custom_id and "
        "sampling fields (temperature, max_tokens, seed, stop, n, ...) overriding the defaults below."))],
    out: Annotated[Path, typer.Option("--out", "-o", help=(
        "JSONL of OpenAI completion records, one per input line, in input order; an existing file is "
        "resumed (its records must match the input's custom_ids)."))],
    max_tokens: Annotated[Optional[int], typer.Option(help="Default max_tokens.")] = None,
    temperature: Annotated[Optional[float], typer.Option(help="Default temperature (0: greedy).")] = None,
    top_p: Annotated[Optional[float], typer.Option(help="Default top_p.")] = None,
    seed: Annotated[Optional[int], typer.Option(help=(
        "Default per-request seed (without one, each line samples with a seed derived from its custom_id)."))] = None,
    executor: Annotated[str, typer.Option(help="local: one engine here; ray: --replicas engines on Ray actors "
                                                "(pip install 'lmforge[ray]').")] = "local",
    replicas: Annotated[int, typer.Option(help="Engines (Ray actors) with --executor ray.")] = 1,
    ray_address: Annotated[Optional[str], typer.Option(help="Ray cluster to join ('auto': the local one); "
                                                            "default: start one.")] = None,
    batch_size: Annotated[int, typer.Option(help="Requests per engine call (and per resume point).")] = 64,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda.")] = "auto",
    dtype: Annotated[str, typer.Option(help="auto | float32 | bfloat16 | float16.")] = "auto",
    overwrite: Annotated[bool, typer.Option(help="Start --out afresh instead of resuming it.")] = False,
) -> None:
    """Generate a completion for every line of --input into --out (resumable), in one process or on
    Ray replicas; greedy outputs are the same either way."""
    from lmforge.engine.batch import generate_file  # deferred: torch and the engine, not for --help

    defaults = {k: v for k, v in dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                      seed=seed).items() if v is not None}
    try:
        with _watch_records(input, out, overwrite):
            summary = generate_file(model, input, out, defaults=defaults, executor=executor, replicas=replicas,
                                    ray_address=ray_address, batch_size=batch_size, overwrite=overwrite,
                                    engine_kwargs={"device": device, "dtype": dtype})
    except (FileNotFoundError, ValueError, ImportError, ConnectionError) as e:  # ConnectionError: no Ray cluster there
        Console(stderr=True, soft_wrap=True).print(f"[red]error:[/red] {e}")
        raise typer.Exit(code=2) from None
    Console().print(f"{summary['generated']} generated, {summary['resumed']} resumed -> {out}; "
                    f"{summary['completion_tokens']} completion tokens in {summary['seconds']:.2f} s "
                    f"({summary['completion_tokens_per_s']:.1f} tok/s, {executor}, {replicas} replica(s))",
                    highlight=False)


def _lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return 0


class _Records:
    """Complete lines of a file that only grows (or is truncated once, by --overwrite), read incrementally."""

    def __init__(self, path: Path):
        self.path, self.offset, self.count = path, 0, 0

    def __call__(self) -> int:
        try:
            with open(self.path, "rb") as f:
                if f.seek(0, 2) < self.offset:  # truncated (--overwrite): count afresh
                    self.offset = self.count = 0
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return self.count
        self.offset += data.rfind(b"\n") + 1
        self.count += data.count(b"\n")
        return self.count


@contextlib.contextmanager
def _watch_records(input: Path, out: Path, overwrite: bool, every_s: float = 0.5) -> Iterator[None]:
    """A progress line for `generate_file`: records in `out` of the input's lines, polled every `every_s`."""
    stop, records = threading.Event(), _Records(out)
    with Progress("generate", total=_lines(input) or None, unit="records",
                  initial=0 if overwrite else records()) as bar:

        def watch() -> None:
            while not stop.wait(every_s):
                bar.update(records())

        thread = threading.Thread(target=watch, name="generate-progress", daemon=True)
        thread.start()
        try:
            yield
            bar.update(records())
        finally:
            stop.set()
            thread.join()


if __name__ == "__main__":  # until cli.py mounts it as `lmforge generate`
    typer.run(generate)
