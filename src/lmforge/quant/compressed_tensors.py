"""The compressed-tensors checkpoint layout: what `quantization_config` says and which tensors a
quantized linear layer stores, read and written without the `compressed-tensors` package (tests use
the package as the reference).

A quantized `model.layers.0.mlp.up_proj` is stored as
  * `...up_proj.weight_packed`  int32 (N, K * bits / 32): the codes, `scheme.pack_int32`;
  * `...up_proj.weight_scale`   (N, G) in the model's dtype;
  * `...up_proj.weight_shape`   int64 [N, K];
and `config.json` gains `quantization_config` with `quant_method: compressed-tensors`, `format:
pack-quantized`, one config group targeting `Linear`, and `ignore: [lm_head]`. That is what
llm-compressor writes for W8A16 / W4A16 (symmetric, static, weight-only), which `transformers`
(with `compressed-tensors`) and vLLM load. Anything else naming `quant_method` is refused with the
field that differs. This module knows nothing about the engine or kernels.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from lmforge.model.config import UnsupportedConfigError

from .linear import QuantizedLinear
from .scheme import QuantScheme, pack_int32, unpack_int32

SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")


def quantization_config(scheme: QuantScheme, ignore: list[str]) -> dict[str, Any]:
    weights = {"num_bits": scheme.num_bits, "type": "int", "symmetric": True, "strategy": scheme.strategy,
               "group_size": scheme.group_size, "dynamic": False, "actorder": None, "observer": "minmax",
               "block_structure": None, "observer_kwargs": {}}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": list(ignore), "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {},
            "global_compression_ratio": None}


def _refuse(field: str, value: Any, why: str) -> None:
    raise UnsupportedConfigError(f"quantization_config.{field}", value, why)


def read_scheme(hf: dict) -> tuple[QuantScheme, list[str]]:
    """The scheme and ignore list of a config.json's `quantization_config`; refuses what we do not run."""
    qc = hf["quantization_config"]
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        _refuse("quant_method", method, "lmforge loads compressed-tensors pack-quantized W8A16/W4A16 folders "
                "(`lmforge quantize` writes them) and GPTQ/AWQ folders (lmforge.quant.gptq_awq)")
    fmt = qc.get("format")
    if fmt != "pack-quantized":
        _refuse("format", fmt, "only pack-quantized (int weights packed into int32) is implemented")
    if qc.get("quantization_status", "compressed") != "compressed":
        _refuse("quantization_status", qc.get("quantization_status"), "only compressed checkpoints are loaded")
    if qc.get("kv_cache_scheme"):
        _refuse("kv_cache_scheme", qc["kv_cache_scheme"], "a quantized KV cache is chosen at run time "
                "(kv_cache_dtype=int8), not read from the checkpoint")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        _refuse("config_groups", sorted(groups), "exactly one config group is implemented")
    (gname, group), = groups.items()
    if group.get("targets") != ["Linear"]:
        _refuse(f"config_groups.{gname}.targets", group.get("targets"), "only ['Linear'] is implemented")
    for act in ("input_activations", "output_activations"):
        if group.get(act):
            _refuse(f"config_groups.{gname}.{act}", group[act], "weight-only schemes (W8A16, W4A16) only")
    w = group.get("weights") or {}
    checks = [("type", w.get("type") == "int", "int weights only"),
              ("num_bits", w.get("num_bits") in (4, 8), "4 or 8 bits only"),
              ("symmetric", w.get("symmetric") is True, "symmetric quantization only (no zero points)"),
              ("dynamic", not w.get("dynamic"), "static weight scales only"),
              ("strategy", w.get("strategy") in ("channel", "group"), "channel or group strategy only"),
              ("actorder", w.get("actorder") in (None, "static", "weight"),
               "activation reordering with a g_idx is not implemented")]
    for key, ok, why in checks:
        if not ok:
            _refuse(f"config_groups.{gname}.weights.{key}", w.get(key), why)
    gs = w.get("group_size") if w["strategy"] == "group" else None
    if w["strategy"] == "group" and not (isinstance(gs, int) and gs > 0):
        _refuse(f"config_groups.{gname}.weights.group_size", gs, "a positive group size is required")
    return QuantScheme(w["num_bits"], gs), list(qc.get("ignore") or [])


def is_ignored(module_name: str, ignore: list[str]) -> bool:
    """compressed-tensors' ignore entries: exact module names, or `re:PATTERN` matched against the name."""
    for entry in ignore:
        if entry.startswith("re:") and re.match(entry[3:], module_name):
            return True
        if entry == module_name:
            return True
    return False


def compress_linear(prefix: str, q_NK: torch.Tensor, scale_NG: torch.Tensor,
                    scheme: QuantScheme) -> dict[str, torch.Tensor]:
    return {f"{prefix}.weight_packed": pack_int32(q_NK, scheme.num_bits),
            f"{prefix}.weight_scale": scale_NG.contiguous(),
            f"{prefix}.weight_shape": torch.tensor(list(q_NK.shape), dtype=torch.int64)}


def install_quantized_linears(model: torch.nn.Module, scheme: QuantScheme, ignore: list[str],
                              scale_dtype: torch.dtype) -> list[str]:
    """Replace each `nn.Linear` not in `ignore` (built on the meta device) by a `QuantizedLinear`
    of the same shape; returns the replaced module names."""
    todo = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
            and not is_ignored(name, ignore)]
    for name, m in todo:
        scheme.check_shape(name, m.in_features)
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        setattr(parent, name.rpartition(".")[2],
                QuantizedLinear(m.in_features, m.out_features, scheme, m.bias is not None, scale_dtype,
                                device=m.weight.device))
    return [name for name, _ in todo]


def decompress_names(tensors: dict[str, torch.Tensor], modules: list[str], scheme: QuantScheme,
                     where: str) -> dict[str, torch.Tensor]:
    """Stored tensors -> our module state: `weight_packed` + `weight_shape` become `qweight` (int8 codes),
    `weight_scale` is kept; a quantized module without its three tensors is an error naming it."""
    out = {k: v for k, v in tensors.items() if k.rpartition(".")[2] not in SUFFIXES}
    for m in modules:
        missing = [s for s in SUFFIXES if f"{m}.{s}" not in tensors]
        if missing:
            raise ValueError(f"{where}: quantized module {m} lacks {', '.join(missing)}; "
                             "the folder does not match its quantization_config")
        N, K = (int(x) for x in tensors[f"{m}.weight_shape"].tolist())
        out[f"{m}.qweight"] = unpack_int32(tensors[f"{m}.weight_packed"], scheme.num_bits, K)
        out[f"{m}.weight_scale"] = tensors[f"{m}.weight_scale"]
    return out
