"""Open a trained tokenizer folder: as `transformers` sees it, and by its content hash.

The hash (sha256 of `tokenizer.json`) is what later stages record as their tokenizer input,
so two runs can tell whether they tokenized the same way. This module knows nothing about
training or models.

    from lmforge.tokenizer.load import load_tokenizer, tokenizer_hash
    tok = load_tokenizer("runs/tok"); tok.apply_chat_template(messages, tokenize=False)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def _tokenizer_json(directory: str | os.PathLike) -> Path:
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: no tokenizer.json; train one with "
                                f"`lmforge tokenizer train INPUT... --out {directory}`")
    return path


def load_tokenizer(directory: str | os.PathLike) -> Any:
    """The folder as a `transformers` fast tokenizer (`PreTrainedTokenizerFast`) via AutoTokenizer."""
    from transformers import AutoTokenizer

    _tokenizer_json(directory)
    return AutoTokenizer.from_pretrained(os.fspath(directory))


def tokenizer_hash(directory: str | os.PathLike) -> str:
    """sha256 of the folder's `tokenizer.json` (the same value as record.json's tokenizer_hash)."""
    from lmforge.track.io import sha256_file

    return sha256_file(_tokenizer_json(directory))
