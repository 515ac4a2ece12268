"""Train a byte-level BPE tokenizer and write it in Hugging Face layout.

What is trained: GPT-4's pre-tokenization regex splits text into words, single digits (GPT-4
groups up to three; see GPT4_SPLIT_PATTERN), punctuation runs and whitespace; each piece is
mapped to bytes (GPT-2 `ByteLevel`, so all 256 bytes are in the vocabulary from the start)
and BPE merges are learned on those bytes. No normalizer: `decode(encode(s)) == s` for every
Unicode string. The five special tokens of `special.py` take ids 0..4; `<|reserved_N|>` pad
the vocabulary to the exact size when the corpus is too small for that many merges.

The output folder holds `tokenizer.json`, `tokenizer_config.json` (with the ChatML chat
template), `special_tokens_map.json`, `config.yaml` (resolved settings) and `record.json`
(provenance; written last, so its presence marks a finished tokenizer). It loads with
`transformers.AutoTokenizer.from_pretrained(out_dir)`.

This module knows nothing about models or packing. Its imports (`tokenizers`, yaml, the readers) are
light and at the top; `lmforge --help` does not import it.

    from lmforge.tokenizer.train import train_tokenizer
    result = train_tokenizer(["python-docs"], "runs/tok", vocab_size=8192)
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from lmforge.data.readers import iter_texts
from lmforge.tokenizer.chat import CHAT_TEMPLATE
from lmforge.tokenizer.special import (EOS, IM_END, SPECIAL_TOKENS, SPECIAL_TOKENS_MAP, STOP_TOKENS,
                                       min_vocab_size, reserved_token, round_vocab_size)
from lmforge.track.io import atomic_write_json, atomic_write_text, sha256_file
from lmforge.track.provenance import git_info, hardware_info, package_versions

# GPT-4's (cl100k_base) split pattern with one change: every digit is its own piece (`\p{N}`, as
# Qwen2's and Llama-1/2's tokenizers do; GPT-4 and Llama-3 group up to 3). Contractions, letter runs
# with one leading non-letter, punctuation runs, newlines, and whitespace that leaves the last space
# to the next word are GPT-4's. Why single digits: with groups, "347" and "85" are arbitrary merged
# tokens whose digits the model never sees, so column arithmetic ("7+5+0=12") cannot be learned from
# a few thousand examples; with one token per digit every number is spelled the same way and the
# same digit always has the same id (docs/tokenizer.md, docs/reasoning.md).
GPT4_SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*"""
    r"""|\s*[\r\n]|\s+(?!\S)|\s+"""
)

# Bytes/token is measured on at most this much of the training text, so the measurement costs
# about a second whatever the corpus size.
SAMPLE_BYTES = 8 << 20

FINISHED_MARKER = "record.json"


@dataclass
class TokenizerSettings:
    """Everything that decides the trained tokenizer; saved resolved as config.yaml."""

    inputs: list[str]
    vocab_size: int = 8192  # after rounding up to pad_to_multiple_of
    min_frequency: int = 2
    pad_to_multiple_of: int = 64
    model_max_length: int = 2048
    text_field: str = "text"
    requested_vocab_size: int | None = None
    notes: list[str] = field(default_factory=list)

    def resolve(self) -> TokenizerSettings:
        if self.min_frequency < 1:
            raise ValueError(f"min_frequency must be >= 1, got {self.min_frequency}")
        if self.model_max_length < 1:
            raise ValueError(f"model_max_length must be >= 1, got {self.model_max_length}")
        self.requested_vocab_size = self.requested_vocab_size or self.vocab_size
        rounded = round_vocab_size(self.requested_vocab_size, self.pad_to_multiple_of)
        if rounded != self.requested_vocab_size:
            self.notes.append(f"vocab_size {self.requested_vocab_size} rounded up to {rounded}, a "
                              f"multiple of {self.pad_to_multiple_of} (pass pad_to_multiple_of=1 to keep it)")
        self.vocab_size = rounded
        if self.vocab_size < min_vocab_size():
            raise ValueError(f"vocab_size {self.vocab_size} is too small: a byte-level tokenizer needs "
                             f"256 byte tokens + {len(SPECIAL_TOKENS)} specials = {min_vocab_size()}")
        return self


class _CountingTexts:
    """Wraps the text stream: counts documents and UTF-8 bytes, keeps the first SAMPLE_BYTES,
    and times the reading itself (for python-docs, parsing the stdlib is most of the run)."""

    def __init__(self, texts: Iterator[str]):
        self.texts, self.docs, self.bytes, self.sample, self._sample_bytes = texts, 0, 0, [], 0
        self.read_seconds = 0.0

    def __iter__(self) -> Iterator[str]:
        while True:
            started = time.perf_counter()
            text = next(self.texts, None)
            self.read_seconds += time.perf_counter() - started
            if text is None:
                return
            n = len(text.encode("utf-8"))
            self.docs, self.bytes = self.docs + 1, self.bytes + n
            if self._sample_bytes < SAMPLE_BYTES:
                self.sample.append(text)
                self._sample_bytes += n
            yield text


def _new_tokenizer():
    tok = Tokenizer(models.BPE(byte_fallback=False))  # ByteLevel makes every byte a token already
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GPT4_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def _fill_reserved(tok, vocab_size: int) -> int:
    """Add `<|reserved_N|>` specials until the vocabulary is exactly `vocab_size`; return how many."""
    missing = vocab_size - tok.get_vocab_size(with_added_tokens=True)
    tok.add_special_tokens([AddedToken(reserved_token(i), special=True, normalized=False)
                            for i in range(missing)])
    return max(missing, 0)


def _tokenizer_config(settings: TokenizerSettings, reserved: list[str]) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **{k: v for k, v in SPECIAL_TOKENS_MAP.items() if k != "additional_special_tokens"},
        # `additional_special_tokens` is read by transformers 4.x and converted by 5.x.
        "additional_special_tokens": SPECIAL_TOKENS_MAP["additional_special_tokens"] + reserved,
        "model_max_length": settings.model_max_length,
        "clean_up_tokenization_spaces": False,  # it would change text and break round-trips
        "add_bos_token": False,  # the packer adds <|begin_of_text|>; encode() never does
        "add_eos_token": False,
        "padding_side": "right",
        "chat_template": CHAT_TEMPLATE,
    }


def _check_out_dir(out: Path, overwrite: bool) -> None:
    marker = out / FINISHED_MARKER
    if marker.exists():
        if not overwrite:
            raise FileExistsError(f"{out} already holds a finished tokenizer ({marker}); "
                                  "pass overwrite=True (--overwrite) or choose another --out")
        marker.unlink()  # a crash from here on must not leave an old record over new files


def train_tokenizer(inputs: list[str] | str, out_dir: str | os.PathLike, vocab_size: int = 8192,
                    min_frequency: int = 2, show_progress: bool = True, *, pad_to_multiple_of: int = 64,
                    model_max_length: int = 2048, text_field: str = "text",
                    overwrite: bool = False) -> dict[str, Any]:
    """Train a byte-level BPE on `inputs` and write a Hugging Face tokenizer folder to `out_dir`.

    Returns the record written to `record.json` (vocab size, docs, bytes, seconds, MB/s, mean
    bytes per token, tokenizer hash, notes). Raises FileNotFoundError naming a missing input
    before any work, and FileExistsError if `out_dir` is finished and `overwrite` is False.
    """
    inputs = [inputs] if isinstance(inputs, (str, os.PathLike)) else [os.fspath(i) for i in inputs]
    settings = TokenizerSettings(inputs, vocab_size, min_frequency, pad_to_multiple_of,
                                 model_max_length, text_field).resolve()
    texts = _CountingTexts(iter_texts(settings.inputs, text_field))  # validates every input now
    out = Path(out_dir)
    _check_out_dir(out, overwrite)
    tok, seconds = _train_bpe(texts, settings, show_progress)
    learned = tok.get_vocab_size(with_added_tokens=True)
    reserved = _pad_vocab(tok, settings, learned)
    _write_folder(out, tok, settings, reserved)
    record = _record(out, tok, settings, texts, seconds, learned, len(reserved))
    atomic_write_json(out / FINISHED_MARKER, record)  # last: its presence means "finished"
    return record


def _train_bpe(texts: _CountingTexts, settings: TokenizerSettings, show_progress: bool):
    """BPE merges learned over the texts' bytes, the specials first; (tokenizer, seconds)."""
    tok = _new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=settings.vocab_size, min_frequency=settings.min_frequency,
        special_tokens=list(SPECIAL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress)
    started = time.perf_counter()
    tok.train_from_iterator(texts, trainer=trainer)
    seconds = time.perf_counter() - started
    if texts.docs == 0:
        raise ValueError(f"inputs {settings.inputs} hold no documents; nothing to train on")
    return tok, seconds


def _pad_vocab(tok, settings: TokenizerSettings, learned: int) -> list[str]:
    """`<|reserved_N|>` up to the exact vocab size (noted in the settings); returns their texts."""
    n_reserved = _fill_reserved(tok, settings.vocab_size)
    if n_reserved:
        settings.notes.append(f"BPE learned only {learned - 256 - len(SPECIAL_TOKENS)} merges at "
                              f"min_frequency={settings.min_frequency}; added {n_reserved} "
                              f"<|reserved_N|> tokens to reach vocab_size {settings.vocab_size}")
    assert tok.get_vocab_size(with_added_tokens=True) == settings.vocab_size
    return [reserved_token(i) for i in range(n_reserved)]


def _write_folder(out: Path, tok, settings: TokenizerSettings, reserved: list[str]) -> None:
    """tokenizer.json, tokenizer_config.json, special_tokens_map.json and config.yaml, each atomically."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "tokenizer.json", tok.to_str(pretty=True))
    atomic_write_json(out / "tokenizer_config.json", _tokenizer_config(settings, reserved))
    atomic_write_json(out / "special_tokens_map.json",
                      {**SPECIAL_TOKENS_MAP, "additional_special_tokens":
                       SPECIAL_TOKENS_MAP["additional_special_tokens"] + reserved})
    resolved = {k: v for k, v in asdict(settings).items() if k != "notes"}  # notes go to record.json
    atomic_write_text(out / "config.yaml", yaml.safe_dump(resolved, sort_keys=False))


def _record(out: Path, tok, settings: TokenizerSettings, texts: _CountingTexts, seconds: float, learned: int,
            n_reserved: int) -> dict[str, Any]:
    """record.json: sizes, special ids, throughput, bytes per token on the sample, hash, provenance."""
    sample_tokens = sum(len(e.ids) for e in tok.encode_batch(texts.sample, add_special_tokens=False))
    sample_bytes = sum(len(t.encode("utf-8")) for t in texts.sample)
    vocab = tok.get_vocab(with_added_tokens=True)
    return {
        "stage": "tokenizer",
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "inputs": settings.inputs,
        "vocab_size": settings.vocab_size,
        "requested_vocab_size": settings.requested_vocab_size,
        "learned_vocab_size": learned,
        "reserved_tokens": n_reserved,
        "special_tokens": {t: vocab[t] for t in SPECIAL_TOKENS},
        # A base model stops on <|end_of_text|>, a chat reply on <|im_end|>; `export` copies
        # both ids into generation_config.json's eos_token_id.
        "eos_token": EOS,
        "chat_eos_token": IM_END,
        "stop_token_ids": [vocab[t] for t in STOP_TOKENS],
        "docs": texts.docs,
        "bytes": texts.bytes,
        "seconds": round(seconds, 3),  # reading the inputs + counting pairs + merging
        "read_seconds": round(texts.read_seconds, 3),
        "mb_per_s": round(texts.bytes / 1e6 / max(seconds, 1e-9), 3),
        "bytes_per_token": round(sample_bytes / max(sample_tokens, 1), 4),
        "bytes_per_token_sample_bytes": sample_bytes,
        "tokenizer_hash": sha256_file(out / "tokenizer.json"),
        "notes": settings.notes,
        "git": git_info(),
        "packages": package_versions(),
        "hardware": hardware_info(),
    }
