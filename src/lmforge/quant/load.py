"""Load a checkpoint folder that may be quantized: compressed-tensors W8A16/W4A16 or an AutoGPTQ /
AutoAWQ layout that maps onto ours, else a plain float folder through `Transformer.from_pretrained`;
or a llama.cpp `.gguf` file (`gguf_load`: Q8_0 / Q4_0 codes kept, other types dequantized).

Every caller that loads a folder a user names (engine, eval, training init, export, benchmarks)
calls this; the model package's own loader reads float checkpoints only (the model sits below
quantization), so it refuses a quantized folder and names this function. This module knows nothing
about the engine or training: it builds the model on the meta device, swaps each quantized
`nn.Linear` for a `QuantizedLinear`, reads the stored codes and scales as they are and assigns them.

    from lmforge.quant import load_pretrained
    model = load_pretrained("models/tiny-w4a16", dtype="float32", device="cpu")
"""

from __future__ import annotations

from pathlib import Path

import torch

from lmforge.model import ModelConfig, Transformer
from lmforge.model import checkpoint

from . import compressed_tensors, gguf_load, gptq_awq


def load_pretrained(path: str | Path, dtype: str | torch.dtype = "auto",
                    device: str | torch.device = "auto") -> Transformer:
    """The folder's model, quantized layers installed where its `quantization_config` says so (a
    `.gguf` file: its tensors, `gguf_load.load_gguf`)."""
    path = Path(path)
    if is_gguf(path):
        return gguf_load.load_gguf(path, dtype=dtype, device=device)
    hf = checkpoint.read_hf_config(path)
    if not hf.get("quantization_config"):
        return Transformer.from_pretrained(path, dtype=dtype, device=device)
    config = ModelConfig.from_hf(hf)
    torch_dtype = checkpoint.resolve_dtype(dtype, hf.get("torch_dtype") or hf.get("dtype"))
    device = checkpoint.resolve_device(device)
    model = Transformer.on_meta(config)
    if hf["quantization_config"].get("quant_method") in ("gptq", "awq"):  # where they map onto ours
        state = _load_gptq_awq(model, hf, path, torch_dtype, device)
    else:  # compressed-tensors W8A16/W4A16 (refused otherwise, naming the field)
        state = _load_compressed_tensors(model, hf, path, torch_dtype, device)
    return checkpoint.assign_weights(model, state, path)


def checkpoint_info(path: str | Path) -> tuple[str | None, bool]:
    """(the dtype the weights were saved in or None, whether linear weights are int8/int4 codes), read
    from config.json or the GGUF header without loading tensors: what `--dtype auto` decides on."""
    path = Path(path)
    if is_gguf(path):
        return gguf_load.file_dtype(path)
    hf = checkpoint.read_hf_config(path)
    return hf.get("torch_dtype") or hf.get("dtype"), bool(hf.get("quantization_config"))


def is_gguf(path: str | Path) -> bool:
    """A path naming a GGUF file (what `LLM(model=...)` and `lmforge serve` accept beside a folder)."""
    return Path(path).suffix.lower() == ".gguf"


def _load_gptq_awq(model: Transformer, hf: dict, path: Path, torch_dtype: torch.dtype,
                   device: torch.device) -> dict[str, torch.Tensor]:
    """AutoGPTQ / AutoAWQ tensors converted to our codes and scales (scales in the model's dtype, as a
    compressed-tensors folder's are)."""
    scheme, layout = gptq_awq.read_scheme(hf)
    wanted = set(gptq_awq.quantized_modules(checkpoint.weight_names(path)))
    ignore = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n not in wanted]
    quantized = compressed_tensors.install_quantized_linears(model, scheme, ignore, torch_dtype)
    stored = {f"{m}.{s}" for m in quantized for s in gptq_awq.STORED}
    state = checkpoint.read_weights(path, set(model.state_dict()), stored, device, torch_dtype)
    if not quantized:
        return state
    state = gptq_awq.convert(state, quantized, scheme, layout, str(path))
    for m in quantized:
        state[f"{m}.weight_scale"] = state[f"{m}.weight_scale"].to(torch_dtype)
    return state


def _load_compressed_tensors(model: Transformer, hf: dict, path: Path, torch_dtype: torch.dtype,
                             device: torch.device) -> dict[str, torch.Tensor]:
    """compressed-tensors `pack-quantized` tensors unpacked to our int8 codes; scales kept as stored."""
    scheme, ignore = compressed_tensors.read_scheme(hf)
    quantized = compressed_tensors.install_quantized_linears(model, scheme, ignore, torch_dtype)
    stored = {f"{m}.{s}" for m in quantized for s in compressed_tensors.SUFFIXES}
    state = checkpoint.read_weights(path, set(model.state_dict()), stored, device, torch_dtype)
    return compressed_tensors.decompress_names(state, quantized, scheme, str(path)) if quantized else state
