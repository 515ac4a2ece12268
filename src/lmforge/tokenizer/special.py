"""The special tokens every lmforge tokenizer carries, and the vocabulary-size rule.

Names follow ChatML (`<|im_start|>`/`<|im_end|>`, as in Qwen) plus Llama-3-style document
markers, so chat data written for those models renders the same way here. The specials take
the first ids (0..4) in this order; `<|reserved_N|>` fill the vocabulary when BPE runs out of
merges on a small corpus. This module knows nothing about training or models.
"""

from __future__ import annotations

BOS = "<|begin_of_text|>"  # starts a document in pretraining data
EOS = "<|end_of_text|>"  # ends a document; a base model stops on it
PAD = "<|pad|>"  # padding only; never trained on (losses mask it)
IM_START = "<|im_start|>"  # opens a chat message: <|im_start|>role\n
IM_END = "<|im_end|>"  # closes a chat message; a chat model stops on it

SPECIAL_TOKENS = (BOS, EOS, PAD, IM_START, IM_END)
SPECIAL_TOKENS_MAP = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
                      "additional_special_tokens": [IM_START, IM_END]}
# Generation stops on either: base-model text ends with EOS, a chat reply ends with IM_END.
STOP_TOKENS = (EOS, IM_END)

BYTE_ALPHABET_SIZE = 256


def reserved_token(i: int) -> str:
    return f"<|reserved_{i}|>"


def round_vocab_size(vocab_size: int, multiple: int = 64) -> int:
    """Round up to a multiple of `multiple`: embedding and LM-head matmuls then tile evenly on
    tensor cores (nanoGPT pads GPT-2's 50257 to 50304 for the same reason)."""
    if multiple < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {multiple}")
    return -(-vocab_size // multiple) * multiple


def min_vocab_size() -> int:
    """Every byte plus the specials: below this a byte-level BPE cannot encode all text."""
    return BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)
