"""Export a training run as a Hugging Face model folder: weights (LoRA merged) + tokenizer.

Reads a verified checkpoint (`last`, `best` or `step-N`), rebuilds the model from the
checkpoint's own model config, merges LoRA adapters into the base weights, and writes
`config.json`, `model.safetensors`, `generation_config.json` (stopping on the tokenizer's `<|end_of_text|>`
and `<|im_end|>`: `eos_token_id: [1, 4]` for lmforge's own tokenizers, `[2]` for SmolLM2's) and the tokenizer
files with the chat template (`chat_template.jinja` when the tokenizer folder has one: a model converted by
`lmforge convert` or pulled from the Hub keeps its own template), so the folder loads in
`transformers.AutoModelForCausalLM` / `AutoTokenizer` and in the lmforge engine. It knows
nothing about the training loop.

    lmforge export runs/tiny --out models/tiny
    lmforge export runs/tiny --out models/tiny --format gguf --type q8_0   # + models/tiny/model-q8_0.gguf
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from lmforge.model import ModelConfig, Transformer, resolve_dtype
from lmforge.track.io import atomic_write_json, sha256_dir

from . import checkpoint as ckpt
from .lora import LoraConfig, apply_lora, merge_lora

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json")
STOP_IDS = [1, 4]  # <|end_of_text|>, <|im_end|> in lmforge's own tokenizers (tokenizer/special.py)
STOP_TOKENS = ("<|end_of_text|>", "<|im_end|>")


def load_run_model(run: str | os.PathLike, checkpoint: str = "last") -> tuple[Transformer, dict]:
    """The run's model at `checkpoint` as a plain `Transformer` (LoRA merged), and the checkpoint meta."""
    path, meta = ckpt.resolve_checkpoint(run, checkpoint)
    config = ModelConfig.from_hf(meta["model_config"])
    model = Transformer(config)  # every weight is overwritten by the checkpoint below
    state = ckpt.load_state(path)["model"]
    if meta.get("method") == "lora":
        peft_model = apply_lora(model, LoraConfig(**meta["config"]["lora"]))
        peft_model.load_state_dict(state)
        model = merge_lora(peft_model)
    else:
        model.load_state_dict(state)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval(), meta


def _set_model_max_length(out: Path, positions: int) -> None:
    """tokenizer_config.json's `model_max_length` = the model's positions: the tokenizer was trained before
    the model had a length (its 2048 is a placeholder), and clients size requests from it (lm-eval does)."""
    path = out / "tokenizer_config.json"
    if path.is_file():
        cfg = json.loads(path.read_text())
        cfg["model_max_length"] = int(positions)
        atomic_write_json(path, cfg)


def stop_ids(tok_dir: str | os.PathLike | None) -> list[int]:
    """The ids generation stops on: `<|end_of_text|>` and `<|im_end|>` where the tokenizer has them, else its EOS
    token; lmforge's own ids (`STOP_IDS`) without a tokenizer. A downloaded model's vocabulary puts them
    elsewhere (SmolLM2: 1 is `<|im_start|>`, 2 `<|im_end|>`), so they are looked up, never assumed."""
    if not tok_dir or not (Path(tok_dir) / "tokenizer.json").is_file():
        return list(STOP_IDS)
    from tokenizers import Tokenizer  # deferred: only for export, and light

    tok = Tokenizer.from_file(str(Path(tok_dir) / "tokenizer.json"))
    ids = [i for i in (tok.token_to_id(t) for t in STOP_TOKENS) if i is not None]
    if not ids:
        cfg_path = Path(tok_dir) / "tokenizer_config.json"
        eos = json.loads(cfg_path.read_text()).get("eos_token") if cfg_path.is_file() else None
        eos = eos.get("content") if isinstance(eos, dict) else eos
        ids = [tok.token_to_id(eos)] if eos and tok.token_to_id(eos) is not None else []
    return ids or list(STOP_IDS)


def export_run(run: str | os.PathLike, out: str | os.PathLike, checkpoint: str = "last",
               dtype: str = "float32", fmt: str = "hf", gguf_type: str = "bf16") -> Path:
    """The HF folder in `out`; with `fmt="gguf"` also `out/model-<gguf_type>.gguf` (`lmforge.quant.gguf_export`)."""
    if fmt not in ("hf", "gguf"):
        raise ValueError(f"--format {fmt!r}: use hf or gguf")
    run, out = Path(run), Path(out)
    model, meta = load_run_model(run, checkpoint)
    model = model.to(resolve_dtype(dtype))
    tok_dir = meta.get("tokenizer_dir")
    stops = stop_ids(tok_dir)
    model.config.eos_token_id = stops[0]
    model.save_pretrained(out)
    gen_path = out / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen["eos_token_id"] = stops  # a base model ends on EOS, a chat reply on <|im_end|>
    atomic_write_json(gen_path, gen)
    if tok_dir and (Path(tok_dir) / "tokenizer.json").is_file():
        for name in TOKENIZER_FILES:
            if (Path(tok_dir) / name).is_file():
                shutil.copyfile(Path(tok_dir) / name, out / name)
        _set_model_max_length(out, model.config.max_position_embeddings)
    else:
        print(f"warning: {run}: no tokenizer folder recorded; exported weights only", flush=True)
    atomic_write_json(out / "export.json", {
        "run": str(run), "checkpoint": f"step-{meta['step']:08d}", "step": meta["step"], "method": meta.get("method"),
        "git": meta.get("git"), "val_loss": meta.get("val_loss"), "weights_sha256": sha256_dir(out, "*.safetensors")})
    if fmt == "gguf":
        from lmforge.quant.gguf_export import export_gguf  # deferred: the optional gguf package, GGUF only

        info = export_gguf(out, out / f"model-{gguf_type}.gguf", gguf_type)
        print(f"gguf: {info['file']} ({info['bytes'] / 2**20:.1f} MiB, {info['tensors']})", flush=True)
    return out
