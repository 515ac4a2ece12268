"""LoRA adapters on an lmforge `Transformer`, through `peft`, and merging them back.

LoRA (Hu et al. 2021) freezes a linear layer's weight W and learns a low-rank update:
y = x W^T + (alpha / rank) * dropout(x) A^T B^T, with A (rank, in) random and B (out, rank)
zero, so training starts from exactly the base model. `apply_lora` injects peft's LoRA layers in
place with `peft.inject_adapter_in_model`: the returned object is still the same `Transformer`
(same `forward(input_ids, position_ids, doc_ids)`, same `.config`), only its targeted
`nn.Linear`s became `peft` LoRA layers, the base weights frozen and only `lora_A`/`lora_B`
trainable. `merge_lora` folds W + (alpha / rank) B A back into plain `nn.Linear`s, so the state
dict has Hugging Face names again and `save_pretrained` writes an ordinary checkpoint.

This module knows nothing about data, optimizers or the training loop.

    from lmforge.train.lora import LoraConfig, apply_lora, merge_lora
    model = apply_lora(Transformer.from_pretrained("base"), LoraConfig(rank=16, alpha=32))
    ...train...
    merge_lora(model).save_pretrained("runs/sft/merged")
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from lmforge.model import Transformer
from lmforge.train.config import LoraConfig  # the public LoRA API: `from lmforge.train.lora import LoraConfig`

ADAPTER_NAME = "default"  # peft's; we keep one adapter per model


def apply_lora(model: Transformer, cfg: LoraConfig) -> Transformer:
    """Inject LoRA adapters into `model` in place and return it; base weights are frozen."""
    import peft

    if is_lora(model):
        raise ValueError("model already has LoRA adapters; merge_lora() it first")
    cfg.validate(model)
    peft_cfg = peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                               target_modules=list(cfg.target_modules), bias="none")
    model = peft.inject_adapter_in_model(peft_cfg, model, adapter_name=ADAPTER_NAME)
    # peft already froze everything but the adapters; say so here rather than rely on it silently
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    return model


def _lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from peft.tuners.lora import LoraLayer

    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]


def is_lora(model: nn.Module) -> bool:
    return bool(_lora_layers(model))


def merge_lora(model: Transformer, inplace: bool = False) -> Transformer:
    """A plain `Transformer` with W += (alpha / rank) B A in every adapted layer.

    By default `model` keeps its adapters (training can go on after exporting a merged copy);
    `inplace=True` avoids the copy's memory at the end of a run and consumes the adapters.
    """
    if not inplace:
        model = copy.deepcopy(model)
    for name, layer in _lora_layers(model):
        layer.merge(safe_merge=True)  # safe_merge: refuse NaN/inf weights instead of writing them
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, layer.get_base_layer())
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapter tensors (`...q_proj.lora_A.default.weight`), detached, for small checkpoints."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items() if ".lora_" in k}
    if not sd:
        raise ValueError("model has no LoRA adapters; call apply_lora() first")
    return sd


def load_lora_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy adapter tensors into a model made by `apply_lora` with the same LoraConfig."""
    expected = {k for k in model.state_dict() if ".lora_" in k}
    missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
    if missing or unexpected:
        raise ValueError(f"LoRA state dict does not match the model (same target_modules and rank?): "
                         f"missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.load_state_dict(state_dict, strict=False)  # strict=False: base weights are not in it


def trainable_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; tied weights count once."""
    params = list(model.parameters())  # parameters() already yields a tied tensor once
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)
