"""LoRA adapters on an lmforge `Transformer`, through `peft`, and merging them back.

LoRA (Hu et al. 2021) freezes a linear layer's weight W and learns a low-rank update:
y = x W^T + (alpha / rank) * dropout(x) A^T B^T, with A (rank, in) random and B (out, rank)
zero, so training starts from exactly the base model. `apply_lora` injects peft's LoRA layers in
place with `peft.inject_adapter_in_model`: the returned object is still the same `Transformer`
(same `forward(input_ids, position_ids, doc_ids)`, same `.config`), only its targeted
`nn.Linear`s became `peft` LoRA layers, the base weights frozen and only `lora_A`/`lora_B`
trainable. `merge_lora` folds W + (alpha / rank) B A back into plain `nn.Linear`s, so the state
dict has Hugging Face names again and `save_pretrained` writes an ordinary checkpoint.

A light frozen base (`lora.base_dtype`, `lora.base_quant`): after injection every frozen linear (the
adapted layers' base and the untargeted ones) is replaced by a `FrozenLinear` holding its weight as
bf16, or as int8 (per channel) / int4 (per group) codes and scales (QLoRA-style, Dettmers et al. 2023,
with our RTN schemes instead of NF4). Its autograd function dequantizes the weight in forward and
again in backward, so no full-precision copy of a weight is ever kept for the backward pass: the
activations' dtype is unchanged, only the base's bytes shrink. Merging folds the adapter into the
dequantized base (`merge_lora`), so the export is a plain float checkpoint.

This module knows nothing about data, optimizers or the training loop.

    from lmforge.train.lora import LoraConfig, apply_lora, merge_lora
    model = apply_lora(Transformer.from_pretrained("base"), LoraConfig(rank=16, alpha=32))
    ...train...
    merge_lora(model).save_pretrained("runs/sft/merged")
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from torch import nn

from lmforge.model import Transformer
from lmforge.model.checkpoint import read_hf_config
from lmforge.quant import QuantScheme, pack_int32, quantize_rtn, scale_groups_, scratch, unpack_int32_into
from lmforge.train.config import LoraConfig  # the public LoRA API: `from lmforge.train.lora import LoraConfig`

ADAPTER_NAME = "default"  # peft's; we keep one adapter per model


def apply_lora(model: Transformer, cfg: LoraConfig) -> Transformer:
    """Inject LoRA adapters into `model` in place and return it; base weights are frozen."""
    import peft  # deferred: peft (and transformers under it) is heavy and only LoRA runs need it

    if is_lora(model):
        raise ValueError("model already has LoRA adapters; merge_lora() it first")
    cfg.validate(model)
    peft_cfg = peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                               target_modules=list(cfg.target_modules), bias="none")
    model = peft.inject_adapter_in_model(peft_cfg, model, adapter_name=ADAPTER_NAME)
    # peft already froze everything but the adapters; say so here rather than rely on it silently
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    kind = base_kind(cfg, next(model.parameters()).device)
    if kind != "float32":
        lighten_base(model, kind)
    with torch.no_grad():  # a base loaded in 16 bits (`base_load_dtype`): what trains or stays float is float32
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != torch.float32:
                p.data = p.data.float()
    return model


def base_load_dtype(path, cfg: LoraConfig, device: torch.device) -> str:
    """The dtype to load a LoRA base in: float32, except when the base will be held lighter than that
    and the checkpoint stores 16-bit floats; then its own dtype, exactly as stored. The light base
    is then built from the same values it would get from a float32 load (bf16 is held as is; int8/int4
    codes come from the stored values), but the whole model never exists in float32: on the 0.5B
    model the load peak falls from 3.2 GiB to 1.5 (bf16) or 1.8 (int4) GiB (docs/quantization.md).
    Non-linear parameters (embeddings, norms) and the adapters are cast to float32 by `apply_lora`."""
    if base_kind(cfg, device) == "float32":
        return "float32"
    hf = read_hf_config(path)
    stored = hf.get("torch_dtype") or hf.get("dtype")
    return stored if stored in ("bfloat16", "float16") else "float32"


def base_kind(cfg: LoraConfig, device: torch.device) -> str:
    """float32 | bfloat16 | int8 | int4: how the frozen base linears are held."""
    if cfg.base_quant not in (None, "none"):
        return cfg.base_quant
    if cfg.base_dtype != "auto":
        return cfg.base_dtype
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    native = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return "bfloat16" if native else "float32"


class _FrozenMatmul(torch.autograd.Function):
    """y = x W^T with W rebuilt from its stored form in forward and again in backward (not saved),
    block of rows by block of rows (`FrozenLinear.blocks`): a rebuilt block is never larger than
    `REBUILD_ELEMENTS`, however wide the layer (an lm_head over a large vocabulary)."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        blocks = layer.blocks(x.dtype)
        if len(blocks) == 1:
            return x @ layer.rebuilt(x.dtype).t()
        y = x.new_empty(*x.shape[:-1], layer.out_features)
        for r0, r1 in blocks:
            y[..., r0:r1] = x @ layer.rebuilt(x.dtype, r0, r1).t()
        return y

    @staticmethod
    def backward(ctx, grad_out):
        layer = ctx.layer
        blocks = layer.blocks(grad_out.dtype)
        if len(blocks) == 1:
            return grad_out @ layer.rebuilt(grad_out.dtype), None
        g_MN = grad_out.reshape(-1, layer.out_features)
        gx_MK = g_MN.new_zeros(g_MN.shape[0], layer.in_features)
        for r0, r1 in blocks:
            gx_MK.addmm_(g_MN[:, r0:r1], layer.rebuilt(grad_out.dtype, r0, r1))
        return gx_MK.view(*grad_out.shape[:-1], layer.in_features), None


REBUILD_ELEMENTS = 1 << 23  # 32 MiB of float32: the 0.5B model's MLP weights whole, its lm_head in 6 blocks
# Rebuilt weights go into `lmforge.quant.scratch`, one buffer every layer shares: a fresh weight-sized
# block per rebuild makes glibc raise its mmap threshold and keep the freed blocks (on the 0.5B model,
# +1,055 MiB of step peak on a bf16 base: `lmforge bench quant ... --lora-memory`, docs/quantization.md).


class FrozenLinear(nn.Module):
    """A frozen linear held as bf16 (`kind="bfloat16"`) or as int8/int4 codes + scales."""

    def __init__(self, linear: nn.Linear, kind: str):
        super().__init__()

        w = linear.weight.detach()
        self.in_features, self.out_features, self.kind = linear.in_features, linear.out_features, kind
        if kind == "bfloat16":
            self.register_buffer("weight_bf16", w.to(torch.bfloat16))
        else:
            gs = next((g for g in (64, 32, 16, 8) if w.shape[1] % g == 0), None) if kind == "int4" else None
            if kind == "int4" and gs is None:
                raise ValueError(f"lora.base_quant=int4: in_features {w.shape[1]} is not a multiple of 8")
            q, scale = quantize_rtn(w.float(), QuantScheme(8 if kind == "int8" else 4, gs), torch.float32)
            # int4: two codes a byte (compressed-tensors' int32 packing), unpacked on use
            self.register_buffer("qweight", q if kind == "int8" else pack_int32(q, 4))
            self.register_buffer("weight_scale", scale)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def weight_for(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as a new tensor of `dtype` (merging, export)."""
        return self._rebuild_into(torch.empty(self.out_features, self.in_features, dtype=torch.float32,
                                              device=self._stored().device)).to(dtype)

    def blocks(self, dtype: torch.dtype) -> list[tuple[int, int]]:
        """Row ranges rebuilt one at a time (one range when the weight is used as stored)."""
        N, K = self.out_features, self.in_features
        if self.kind == "bfloat16" and dtype == torch.bfloat16:
            return [(0, N)]
        rows = max(1, REBUILD_ELEMENTS // K)
        return [(r, min(r + rows, N)) for r in range(0, N, rows)]

    def rebuilt(self, dtype: torch.dtype, r0: int = 0, r1: int | None = None) -> torch.Tensor:
        """Rows r0:r1 of the weight in `dtype`, in the shared scratch buffer: valid until the next rebuild."""
        r1 = self.out_features if r1 is None else r1
        if self.kind == "bfloat16" and dtype == torch.bfloat16:
            return self.weight_bf16[r0:r1]
        n, K = r1 - r0, self.in_features
        device = self._stored().device
        w_nK = self._rebuild_into(scratch(n * K, torch.float32, device).view(n, K), r0, r1)
        if dtype == torch.float32:
            return w_nK
        return scratch(n * K, dtype, device).view(n, K).copy_(w_nK)  # float32 math, one rounding

    def _stored(self) -> torch.Tensor:
        return self.weight_bf16 if self.kind == "bfloat16" else self.qweight

    def _rebuild_into(self, out_NK: torch.Tensor, r0: int = 0, r1: int | None = None) -> torch.Tensor:
        """Dequantize rows r0:r1 into `out_NK` in place, allocating nothing (rows are independent:
        scales are per row, or per group along K)."""
        rows = slice(r0, self.out_features if r1 is None else r1)
        if self.kind == "bfloat16":
            return out_NK.copy_(self.weight_bf16[rows])
        if self.kind == "int8":
            out_NK.copy_(self.qweight[rows])
        else:
            unpack_int32_into(self.qweight[rows], 4, out_NK)
        return scale_groups_(out_NK, self.weight_scale[rows])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _FrozenMatmul.apply(x, self)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def lighten_base(model: nn.Module, kind: str) -> int:
    """Every frozen `nn.Linear` (adapted layers' bases included; the lm_head too unless tied to the
    embedding) becomes a `FrozenLinear`; returns how many."""
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    todo = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if type(child) is nn.Linear and not child.weight.requires_grad and not (tied and name == "lm_head")]
    for parent, name, child in todo:
        setattr(parent, name, FrozenLinear(child, kind))
    return len(todo)


def _lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from peft.tuners.lora import LoraLayer  # deferred: as in apply_lora

    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]


def is_lora(model: nn.Module) -> bool:
    return bool(_lora_layers(model))


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """`model` computing as its base alone (every adapter off), e.g. DPO's reference; adapters back on after."""
    layers = [m for _, m in _lora_layers(model)]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield model
    finally:
        for m in layers:
            m.enable_adapters(True)


def merge_lora(model: Transformer, inplace: bool = False) -> Transformer:
    """A plain `Transformer` with W += (alpha / rank) B A in every adapted layer.

    By default `model` keeps its adapters (training can go on after exporting a merged copy);
    `inplace=True` avoids the copy's memory at the end of a run and consumes the adapters.
    """
    if not inplace:
        model = copy.deepcopy(model)
    for name, layer in _lora_layers(model):
        parent_name, _, child = name.rpartition(".")
        base = layer.get_base_layer()
        if isinstance(base, FrozenLinear):  # light base: W' = dequantized W + (alpha / rank) B A, in float32
            plain = nn.Linear(base.in_features, base.out_features, bias=base.bias is not None)
            w = base.weight_for(torch.float32) + layer.get_delta_weight(ADAPTER_NAME).float()
            if not torch.isfinite(w).all():
                raise ValueError(f"merging {name}: non-finite weights")
            plain.weight.data = w
            if base.bias is not None:
                plain.bias.data = base.bias.detach().float()
            base = plain
        else:
            layer.merge(safe_merge=True)  # safe_merge: refuse NaN/inf weights instead of writing them
        setattr(model.get_submodule(parent_name), child, base)
    for name, m in list(model.named_modules()):  # untargeted light layers: back to plain float32
        if isinstance(m, FrozenLinear):
            plain = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
            plain.weight.data = m.weight_for(torch.float32)
            if m.bias is not None:
                plain.bias.data = m.bias.detach().float()
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, plain)
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
