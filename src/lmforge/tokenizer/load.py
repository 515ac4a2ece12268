"""Open a trained tokenizer folder: as `transformers` sees it, and by its content hash.

The hash (sha256 of `tokenizer.json`) is what later stages record as their tokenizer input,
so two runs can tell whether they tokenized the same way. A llama.cpp `.gguf` file is opened too
(`lmforge.tokenizer.gguf` builds the tokenizer from its `tokenizer.ggml.*` fields; the chat template
is its `tokenizer.chat_template`). This module knows nothing about training or models.

    from lmforge.tokenizer.load import load_tokenizer, tokenizer_hash
    tok = load_tokenizer("runs/tok"); tok.apply_chat_template(messages, tokenize=False)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from lmforge.quant.gguf_file import open_gguf
from lmforge.tokenizer.gguf import gguf_tokenizer
from lmforge.track.io import sha256_file


# any of these makes a folder loadable by AutoTokenizer (a Hugging Face model may ship only the slow files)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _tokenizer_json(directory: str | os.PathLike) -> Path:
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(_missing(directory))
    return path


def _missing(directory: str | os.PathLike, also: tuple[str, ...] = ()) -> str:
    nor = f" (nor {', '.join(also)})" if also else ""
    return f"{directory}: no tokenizer.json{nor}; train one with `lmforge tokenizer train INPUT... --out {directory}`"


# `tokenizer_class` values that AutoTokenizer opens as transformers' generic `TokenizersBackend`, for the
# model types below (and for a folder without config.json): no model-specific tokenizer class replaces them
_GENERIC_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
_GENERIC_MODEL_TYPES = ("llama", "mistral", "qwen3")


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def generic_backend(directory: str | os.PathLike) -> bool:
    """Whether AutoTokenizer would open this folder as `TokenizersBackend` anyway: a `tokenizer.json`, a
    `tokenizer_config.json` naming a generic class with no `auto_map`, a config of a model type listed above
    (or none) with no hub `_name_or_path`. Opening that class directly skips AutoTokenizer's import of the
    model's config module, which pulls in torch.distributed.tensor: 0.55 s instead of 2.3 s in a process that
    has torch (`tests/test_tokenizer.py` holds the two equal)."""
    d = Path(directory)
    if not (d / "tokenizer.json").is_file():
        return False
    tok_config, config = _json(d / "tokenizer_config.json"), _json(d / "config.json")
    if tok_config.get("tokenizer_class") not in _GENERIC_CLASSES or "auto_map" in tok_config:
        return False
    if (d / "config.json").is_file() and config.get("model_type") not in _GENERIC_MODEL_TYPES:
        return False
    return not config.get("_name_or_path") and "auto_map" not in config


def load_tokenizer(directory: str | os.PathLike, optional: bool = False) -> Any:
    """The folder as a `transformers` tokenizer, the class AutoTokenizer picks (fast when it has
    `tokenizer.json`; `generic_backend` folders without AutoTokenizer's imports).

    A folder with none of `TOKENIZER_FILES` raises FileNotFoundError, or gives None when `optional`
    (the engine serves token-id prompts from a model folder without a tokenizer). A `.gguf` file:
    `load_gguf_tokenizer`."""
    if Path(directory).suffix.lower() == ".gguf":
        return load_gguf_tokenizer(directory, optional)
    if not any((Path(directory) / f).is_file() for f in TOKENIZER_FILES):
        if optional:
            return None
        raise FileNotFoundError(_missing(directory, TOKENIZER_FILES[1:]))
    if generic_backend(directory):
        from transformers import PreTrainedTokenizerFast  # `TokenizersBackend` in transformers 5

        return PreTrainedTokenizerFast.from_pretrained(os.fspath(directory))
    from transformers import AutoTokenizer  # deferred: transformers takes seconds to import

    return AutoTokenizer.from_pretrained(os.fspath(directory))


def load_gguf_tokenizer(path: str | os.PathLike, optional: bool = False) -> Any:
    """The vocabulary, merges, special tokens and chat template of a GGUF file (`tokenizer.ggml.*`,
    `tokenizer.chat_template`) as a `transformers` fast tokenizer (`lmforge.tokenizer.gguf`), from the
    parse the weights share (`open_gguf`). A file without `tokenizer.ggml.tokens` raises ValueError
    naming it, or gives None when `optional`."""
    return gguf_tokenizer(open_gguf(path), optional)


def tokenizer_hash(directory: str | os.PathLike) -> str:
    """sha256 of the folder's `tokenizer.json` (the same value as record.json's tokenizer_hash)."""
    return sha256_file(_tokenizer_json(directory))
