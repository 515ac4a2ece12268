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
