"""`lmforge convert FILE.gguf --out DIR`: a llama.cpp file as a Hugging Face model folder, so every stage
that reads folders (training, LoRA, DPO, eval, quantize, export) can start from a downloaded model.

The folder holds `config.json` (from the GGUF metadata), the weights in float32 or bfloat16 (every
block dequantized exactly as llama.cpp does: `gguf_types`; q/k rows back in Hugging Face's RoPE order),
`generation_config.json`, the tokenizer built from the file's vocabulary (`tokenizer.json`,
`tokenizer_config.json` with `model_max_length` = the model's context) and its chat template
(`chat_template.jinja`, which transformers reads), and `convert.json` (the source file, its sha256, the
tensor types and the lmforge version). transformers' `AutoModelForCausalLM` and `AutoTokenizer` load it;
its logits equal lmforge's on the same folder (`tests/test_real_model.py`). Nothing is requantized: a
4-bit file becomes a float folder of the 4-bit values. This module knows nothing about the engine.

    lmforge convert SmolLM2-135M-Instruct.Q4_1.gguf --out models/smollm2 --dtype bfloat16
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from lmforge.tokenizer.load import load_gguf_tokenizer
from lmforge.track.io import atomic_write_json, sha256_file

from .gguf_file import open_gguf
from .gguf_load import load_gguf

DTYPES = ("float32", "bfloat16")


def convert_gguf(path: str | os.PathLike, out: str | os.PathLike, dtype: str = "bfloat16",
                 overwrite: bool = False) -> dict:
    """Write the folder; returns what `convert.json` records. A folder that already holds a model is
    refused unless `overwrite`."""
    path, out = Path(path), Path(out)
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    if (out / "config.json").exists() and not overwrite:
        raise FileExistsError(f"{out}: already holds a model (config.json); pass --overwrite to replace it")
    f = open_gguf(path)
    model = load_gguf(path, dtype=dtype, device="cpu", keep_codes=False)
    tok = load_gguf_tokenizer(path, optional=True)
    if tok is not None:
        model.config.bos_token_id = tok.bos_token_id
        model.config.eos_token_id = tok.eos_token_id
        model.config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    if tok is not None:
        tok.model_max_length = model.config.max_position_embeddings
        tok.save_pretrained(str(out))
    record = {"source": str(path), "source_sha256": sha256_file(path), "dtype": dtype,
              "architecture": f.metadata.get("general.architecture"), "name": f.metadata.get("general.name"),
              "tensors": model.gguf_summary["tensors"], "tokenizer": tok is not None,
              "chat_template": bool(tok is not None and tok.chat_template),
              "lmforge": _version()}
    atomic_write_json(out / "convert.json", record)
    return record


def _version() -> str:
    try:
        return version("lmforge")
    except PackageNotFoundError:
        return "unknown"


def describe(record: dict) -> str:
    tensors = ", ".join(f"{n} {k}" for k, n in sorted(record["tensors"].items()))
    return (f"{record['architecture']} ({record.get('name') or 'unnamed'}), {record['dtype']}; tensors: {tensors}; "
            f"tokenizer {'yes' if record['tokenizer'] else 'no'}, chat template "
            f"{'yes' if record['chat_template'] else 'no'}")

