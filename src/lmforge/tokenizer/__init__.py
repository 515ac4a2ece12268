"""lmforge.tokenizer: byte-level BPE training, special tokens, ChatML chat template.

Importing this package loads `tokenizers` (light); `transformers` loads only when a tokenizer is opened.
It knows nothing about models, packing or the engine.
"""

from lmforge.tokenizer.chat import CHAT_TEMPLATE, render_chat
from lmforge.tokenizer.load import load_tokenizer, tokenizer_hash
from lmforge.tokenizer.special import SPECIAL_TOKENS, STOP_TOKENS
from lmforge.tokenizer.train import train_tokenizer

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "STOP_TOKENS", "load_tokenizer", "render_chat",
           "tokenizer_hash", "train_tokenizer"]
