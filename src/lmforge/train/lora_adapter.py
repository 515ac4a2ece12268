"""A LoRA model's adapters as a peft folder: `adapter_config.json` + `adapter_model.safetensors`, the
layout `peft.PeftModel.from_pretrained`, vLLM's `--lora-modules` and `lmforge serve --lora-modules`
read. The base weights are not written (serve the base folder beside it).

Tensor names are peft's (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`: the adapter
name dropped, the `PeftModel` prefix added); the config holds rank, alpha, dropout and target modules.
Knows nothing about the training loop or the engine.

    from lmforge.train.lora_adapter import save_adapter, export_adapter
    save_adapter(model, LoraConfig(rank=8, alpha=16), "runs/sft/adapter", base="models/base")
    export_adapter("runs/sft", "runs/sft/adapter")     # from a LoRA run's checkpoint
"""

from __future__ import annotations

import os
from pathlib import Path

from safetensors.torch import save as safetensors_bytes
from torch import nn

from lmforge.model import ModelConfig, Transformer
from lmforge.track.io import atomic_write_bytes, atomic_write_json

from . import checkpoint as ckpt
from .config import LoraConfig
from .lora import ADAPTER_NAME, apply_lora, lora_state_dict

PEFT_PREFIX = "base_model.model."  # what PeftModel's state dict prepends to the wrapped model's names


def peft_config(cfg: LoraConfig, base: str | None) -> dict:
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank, "lora_alpha": cfg.alpha,
            "lora_dropout": cfg.dropout, "target_modules": sorted(cfg.target_modules), "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True,
            "modules_to_save": None, "base_model_name_or_path": base}


def save_adapter(model: nn.Module, cfg: LoraConfig, out: str | os.PathLike, base: str | None = None) -> Path:
    """Write `model`'s adapters (made by `apply_lora` with `cfg`) to the folder `out`; files written atomically."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {PEFT_PREFIX + k.replace(f".{ADAPTER_NAME}.", "."): v.contiguous()
               for k, v in lora_state_dict(model).items()}
    atomic_write_bytes(out / "adapter_model.safetensors", safetensors_bytes(tensors, {"format": "pt"}))
    atomic_write_json(out / "adapter_config.json", peft_config(cfg, base))
    return out


def export_adapter(run: str | os.PathLike, out: str | os.PathLike, checkpoint: str = "last") -> Path:
    """A LoRA run's adapters at `checkpoint` as a peft folder (its base: the run's `model.init`, if recorded)."""
    path, meta = ckpt.resolve_checkpoint(run, checkpoint)
    if meta.get("method") != "lora":
        raise ValueError(f"{run}: the checkpoint {path.name} is a {meta.get('method', 'full')} run, not LoRA; "
                         "export the whole model with `lmforge export` instead")
    cfg = LoraConfig(**meta["config"]["lora"])
    model = apply_lora(Transformer(ModelConfig.from_hf(meta["model_config"])), cfg)
    model.load_state_dict(ckpt.load_state(path)["model"])
    base = (meta.get("config", {}).get("model") or {}).get("init")
    return save_adapter(model, cfg, out, str(base) if base else None)
