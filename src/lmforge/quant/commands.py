"""`lmforge quantize`: the command-line face of `lmforge.quant.quantize`; parses options, calls one function.

    lmforge quantize models/tiny --scheme w8a16 --out models/tiny-w8a16
    lmforge quantize models/tiny --scheme w4a16 --group-size 128 --method gptq --calibration python-docs --out DIR
"""

from __future__ import annotations

from pathlib import Path

import typer

QUANTIZE_HELP = ("Quantize MODEL's linear weights (W8A16: int8 per channel; W4A16: int4 per group) into a "
                 "compressed-tensors folder that lmforge, transformers and vLLM load.")


def quantize(
    model: Path = typer.Argument(..., help="Hugging Face model folder (config.json + *.safetensors)."),
    out: Path = typer.Option(..., "--out", "-o", help="Folder to write the quantized model (and its record) into."),
    scheme: str = typer.Option("w4a16", "--scheme", help="w8a16 | w4a16."),
    group_size: int = typer.Option(128, "--group-size", help="Input columns per int4 scale (w4a16)."),
    method: str = typer.Option("rtn", "--method", help="rtn (round to nearest) | gptq (needs --calibration)."),
    calibration: str = typer.Option(None, "--calibration", help="gptq: python-docs or a JSONL file with 'text'."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a finished quantization in --out."),
) -> None:
    # deferred: torch and the quantizer, imported when the verb runs, not by `lmforge --help`
    from lmforge.model import UnsupportedConfigError
    from lmforge.track.run import RunExistsError

    from .quantize import QuantizeConfig, quantize_model

    cfg = QuantizeConfig(model=str(model), out=str(out), scheme=scheme, group_size=group_size, method=method,
                         calibration=calibration)
    try:
        res = quantize_model(cfg, overwrite=overwrite)
    except (ValueError, FileNotFoundError, RunExistsError, UnsupportedConfigError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=2) from None
    typer.echo(f"done: {res['scheme']} ({res['method']}), weights {res['weight_bytes_before'] / 2**20:.1f} -> "
               f"{res['weight_bytes_after'] / 2**20:.1f} MiB ({res['weight_bytes_ratio']:.3f}x) -> {out}")


CONVERT_HELP = ("Convert a llama.cpp .gguf file into a Hugging Face model folder (config, float weights, tokenizer, "
                "chat template) that training, eval and transformers read.")
PULL_HELP = ("Fetch a model from the Hugging Face Hub into its cache (huggingface_hub; HF_HUB_OFFLINE=1 reads the "
             "cache only) and print its local path.")


def convert(
    source: Path = typer.Argument(..., help="A .gguf file."),
    out: Path = typer.Option(..., "--out", "-o", help="Folder to write the Hugging Face model into."),
    dtype: str = typer.Option("bfloat16", "--dtype", help="Weights in the folder: bfloat16 | float32 (exact for "
                                                         "every GGUF block type)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a model already in --out."),
) -> None:
    from .convert import convert_gguf, describe  # deferred: torch, when the verb runs

    if source.suffix.lower() != ".gguf":
        typer.echo(f"error: {source}: convert reads .gguf files (a Hugging Face folder needs no conversion)", err=True)
        raise typer.Exit(code=2)
    try:
        record = convert_gguf(source, out, dtype=dtype, overwrite=overwrite)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=2) from None
    typer.echo(f"done: {describe(record)} -> {out}")


def pull(
    repo_id: str = typer.Argument(..., help="A Hugging Face model id, e.g. HuggingFaceTB/SmolLM2-135M-Instruct."),
    revision: str = typer.Option(None, "--revision", help="Branch, tag or commit (default: main)."),
    include: list[str] = typer.Option(None, "--include", help="Only files matching this pattern (repeatable), "
                                                              "e.g. '*Q4_K_M.gguf'; default: what lmforge reads."),
    cache_dir: Path = typer.Option(None, "--cache-dir", help="huggingface_hub's cache (default $HF_HUB_CACHE)."),
    offline: bool = typer.Option(False, "--offline", help="Resolve from the cache only (as HF_HUB_OFFLINE=1)."),
) -> None:
    from .hub import PullError, pull as pull_model

    try:
        path = pull_model(repo_id, revision=revision, include=include or None, cache_dir=cache_dir, offline=offline)
    except PullError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=2) from None
    typer.echo(str(path))
