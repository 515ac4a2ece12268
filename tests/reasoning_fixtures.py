"""A tiny reasoning setup shared by the reasoning/GRPO tests: synthetic tasks, a tokenizer trained on
them, and a random Llama-style model saved in HF layout with that tokenizer (chat template included)
and generation_config stopping on <|end_of_text|> / <|im_end|>, as `lmforge export` writes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from lmforge.tasks.arith_cot import synth_rows
from lmforge.model import ModelConfig, Transformer
from lmforge.tokenizer import train_tokenizer


def write_tasks(path: Path, task: str = "add", n: int = 64, seed: int = 7) -> Path:
    rows, _ = synth_rows(task, n, seed, categories=("add-2d",) if task == "add" else None)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tiny_model(root: Path, tasks: Path, hidden: int = 32, layers: int = 2, seed: int = 0) -> Path:
    tok_dir, model_dir = root / "tok", root / "model"
    if not (tok_dir / "record.json").is_file():
        train_tokenizer([str(tasks)], tok_dir, vocab_size=320, show_progress=False)
    vocab = json.loads((tok_dir / "record.json").read_text())["vocab_size"]
    cfg = ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=0, eos_token_id=1, pad_token_id=2)
    Transformer(cfg).init_weights(seed).save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(tok_dir / name, model_dir / name)
    gen = json.loads((model_dir / "generation_config.json").read_text())
    gen["eos_token_id"] = [1, 4]
    (model_dir / "generation_config.json").write_text(json.dumps(gen))
    return model_dir


def length_reward(completion: str, task: dict) -> float:
    """A reward a random model's samples differ on (format/correct are 0 for all of them)."""
    return len(completion) / 100
