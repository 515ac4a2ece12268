"""`lmforge generate`: the command-line face of `lmforge.engine.batch` (batch inference over a
JSONL file, in one process or on Ray replicas). Parses options, calls `generate_file`, prints
the summary; the engine loads only when the verb runs.

    lmforge generate runs/model --input prompts.jsonl --out out.jsonl --max-tokens 64
    lmforge generate runs/model --input prompts.jsonl --out out.jsonl --executor ray --replicas 2
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console


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
    seed: Annotated[Optional[int], typer.Option(help="Default per-request seed.")] = None,
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
        summary = generate_file(model, input, out, defaults=defaults, executor=executor, replicas=replicas,
                                ray_address=ray_address, batch_size=batch_size, overwrite=overwrite,
                                engine_kwargs={"device": device, "dtype": dtype})
    except (FileNotFoundError, ValueError, ImportError) as e:
        Console(stderr=True, soft_wrap=True).print(f"[red]error:[/red] {e}")
        raise typer.Exit(code=2) from None
    Console().print(f"{summary['generated']} generated, {summary['resumed']} resumed -> {out}; "
                    f"{summary['completion_tokens']} completion tokens in {summary['seconds']:.2f} s "
                    f"({summary['completion_tokens_per_s']:.1f} tok/s, {executor}, {replicas} replica(s))",
                    highlight=False)


if __name__ == "__main__":  # until cli.py mounts it as `lmforge generate`
    typer.run(generate)
