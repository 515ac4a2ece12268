"""The tokenizer a llama.cpp `.gguf` file describes, built from its metadata without reading the file again.

A GGUF file has no `tokenizer.json`: its vocabulary, merges, token types, special ids and chat template
are metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`). `gguf_tokenizer(f)` takes the parsed file
(`lmforge.quant.gguf_file.open_gguf`, the one parse the weights and config share) and returns a
`transformers` fast tokenizer:

  * `tokenizer.ggml.model == "gpt2"` (byte-level BPE: Llama 3, Qwen, SmolLM, Mistral Nemo, ...) is built
    here with `tokenizers`: the vocabulary and merges as stored, and the pre-tokenizer llama.cpp applies
    for the file's `tokenizer.ggml.pre` (`PRE_SPLITS`, the regex lists of llama.cpp's `llama-vocab.cpp`;
    e.g. `smollm` splits every digit apart before GPT-2's pattern, as SmolLM's own tokenizer.json does),
    so token ids equal llama.cpp's and the model's Hugging Face tokenizer's;
  * any other model type (`llama`: SentencePiece, `t5`, ...) goes through transformers' own GGUF
    converter, handed the metadata we already read.

Control tokens (type 3) become special added tokens and user-defined ones (type 4) plain added tokens,
as llama.cpp matches them whole; BOS is prepended when `tokenizer.ggml.add_bos_token` says so. The chat
template is the file's `tokenizer.chat_template`, rendered by transformers' `apply_chat_template` (Jinja).
This module knows nothing about models or weights.
"""

from __future__ import annotations

import logging
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

log = logging.getLogger("lmforge.tokenizer")

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
         r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
         r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
         r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
         r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# `tokenizer.ggml.pre` -> the regexes llama.cpp splits with, in order (each splits the pieces the last left)
PRE_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("default", "gpt2", "gpt-2", "mpt", "olmo", "jais"), (GPT2,)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"),
                    (r"\p{N}", GPT2)),
    **dict.fromkeys(("llama3", "llama-bpe", "llama-v3", "falcon3", "pixtral", "dbrx", "smaug-bpe"), (LLAMA3,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), (QWEN2,)),
    "tekken": (TEKKEN,),
    **dict.fromkeys(("gpt-4o", "llama4"), (GPT4O,)),
}
CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types


def _byte_alphabet() -> set[str]:
    """The 256 characters GPT-2's byte-level BPE spells bytes with."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    extra = [b for b in range(256) if b not in keep]
    return {chr(c) for c in keep} | {chr(256 + i) for i in range(len(extra))}


def _pre_tokenizer(pre: str | None, path) -> pre_tokenizers.PreTokenizer:
    splits = PRE_SPLITS.get(pre or "default")
    if splits is None:
        log.warning("%s: tokenizer.ggml.pre=%r is not one lmforge knows; splitting as GPT-2 does (llama.cpp's "
                    "'default'), so token ids may differ from the model's own tokenizer", path, pre)
        splits = (GPT2,)
    steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
    return pre_tokenizers.Sequence([*steps, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def byte_level_bpe(meta: dict, path) -> Tokenizer:
    """A `tokenizers` BPE over the file's byte-level vocabulary and merges (tokenizer.ggml.model gpt2)."""
    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", ())]
    tk = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False, ignore_merges=False))
    tk.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"), path)
    tk.decoder = decoders.ByteLevel()
    alphabet = _byte_alphabet()
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    # a token marked control that is not spelled in the byte alphabet is a llama.cpp mislabel: adding it
    # would grow the vocabulary past the model's (transformers' converter skips them too)
    tk.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types)
                           if k == CONTROL and set(t) <= alphabet])
    tk.add_tokens([AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types)
                   if k == USER_DEFINED])
    return tk


def _via_transformers(meta: dict) -> Tokenizer:
    """transformers' GGUF converter (SentencePiece and other non-byte-level vocabularies) on our metadata."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (GGUF_TOKENIZER_MAPPING,
                                                                      convert_gguf_tokenizer)

    renames = GGUF_TOKENIZER_MAPPING["tokenizer"]
    tokenizer_dict = {name: meta[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in meta}
    backend, _ = convert_gguf_tokenizer(meta["general.architecture"], tokenizer_dict)
    return backend


def _special(meta: dict, key: str) -> str | None:
    i = meta.get(f"tokenizer.ggml.{key}")
    tokens = meta["tokenizer.ggml.tokens"]
    return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None


def gguf_tokenizer(f: Any, optional: bool = False) -> Any:
    """The file's tokenizer (`f`: a `GGUFFile`) as a `transformers.PreTrainedTokenizerFast`, its chat
    template and `model_max_length` (the model's context) set. No vocabulary: ValueError naming the
    file, or None when `optional`."""
    meta = f.metadata
    if "tokenizer.ggml.tokens" not in meta:
        if optional:
            return None
        raise ValueError(f"{f.path}: no tokenizer.ggml.tokens in the GGUF metadata; pass prompts as token ids "
                         "or re-export the file with its tokenizer")
    from transformers import PreTrainedTokenizerFast  # deferred: transformers loads only when a tokenizer opens

    kind = meta.get("tokenizer.ggml.model", "gpt2")
    backend = byte_level_bpe(meta, f.path) if kind == "gpt2" else _via_transformers(meta)
    bos, add_bos = _special(meta, "bos_token_id"), meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
    if add_bos and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, meta["tokenizer.ggml.bos_token_id"])])
    arch = meta.get("general.architecture")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=_special(meta, "eos_token_id"),
        unk_token=_special(meta, "unknown_token_id"), pad_token=_special(meta, "padding_token_id"),
        model_max_length=meta.get(f"{arch}.context_length", 2048), clean_up_tokenization_spaces=False)
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        tok.chat_template = template
    return tok
