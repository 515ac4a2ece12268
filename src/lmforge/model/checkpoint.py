"""Hugging Face checkpoints in and out: `config.json` plus one or sharded `*.safetensors`.

Our parameter names are Hugging Face's, so loading is reading tensors and checking that every
expected name is present and nothing unknown is left over. Saving writes what
`transformers.AutoModelForCausalLM.from_pretrained` reads. `Transformer.from_pretrained` puts these
steps together for a float checkpoint; `lmforge.quant.load_pretrained` for one that may be quantized
(quantization is a layer above the model). This module knows nothing about the Transformer class,
quantization, training or the engine: it reads and checks tensors for any module with a `config`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ..track.io import atomic_write_json

DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
          "float64": torch.float64, "double": torch.float64, "fp64": torch.float64}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """`auto` = CUDA when present, else CPU."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, config_dtype: str | None = None) -> torch.dtype:
    """`auto` = the dtype the checkpoint was saved in (float32 when it says nothing)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        dtype = config_dtype or "float32"
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of auto, float32, bfloat16, float16, float64")
    return DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def read_hf_config(path: str | Path) -> dict:
    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path}: no config.json; is {path} a Hugging Face model directory?")
    try:
        return json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path}: invalid JSON at line {e.lineno}: {e.msg}") from e


def weight_files(path: Path) -> list[Path]:
    """The folder's safetensors files: the shards its index names, else every `*.safetensors`."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shards that are missing: {', '.join(missing)}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        hint = " (found pytorch_model.bin: convert it to safetensors first)" \
            if (path / "pytorch_model.bin").exists() else ""
        raise FileNotFoundError(f"{path}: no *.safetensors weights{hint}")
    return files


def weight_names(path: Path) -> set[str]:
    """Every tensor name the folder's safetensors files hold (no tensor is read)."""
    keys: set[str] = set()
    for file in weight_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            keys.update(f.keys())
    return keys


def refuse_quantized(hf: dict, path: Path) -> None:
    """The plain loader reads float checkpoints only; a quantized folder names the loader that reads it."""
    qc = hf.get("quantization_config")
    if qc:
        raise ValueError(f"{path}: a quantized checkpoint (quantization_config.quant_method="
                         f"{qc.get('quant_method')!r}); load it with lmforge.quant.load_pretrained(path, dtype, "
                         "device), which decompresses it")


def read_weights(path: Path, expected: set[str], stored: set[str], device: torch.device,
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The folder's tensors on `device`: floats cast to `dtype`, except the `stored` names (quantized
    codes and scales, kept as stored); a name neither expected nor stored is an error."""
    state: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # some old exports saved the RoPE table; we compute it
                if name not in expected and name not in stored:
                    raise ValueError(f"{file.name}: unexpected tensor {name!r}; "
                                     f"the checkpoint does not match its config.json")
                t = f.get_tensor(name)
                cast = t.is_floating_point() and name not in stored  # codes and scales stay as stored
                state[name] = t.to(device=device, dtype=dtype if cast else None)
    return state


def assign_weights(model: nn.Module, state: dict[str, torch.Tensor], path: Path) -> nn.Module:
    """Check `state` against the (meta-device) model's names and shapes, then assign it; ties lm_head."""
    expected = set(model.state_dict())
    tied = model.config.tie_word_embeddings
    if tied:
        state.pop("lm_head.weight", None)  # some exporters save the tied copy as well
        expected.discard("lm_head.weight")
    missing = sorted(expected - set(state))
    if missing:
        raise ValueError(f"{path}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    for name, t in state.items():
        want = shapes[name]
        if t.shape != want:
            raise ValueError(f"{path}: tensor {name} has shape {tuple(t.shape)}, config implies {tuple(want)}")
    model.load_state_dict(state, strict=False, assign=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def save_pretrained(model: nn.Module, path: str | Path, max_shard_bytes: int = 5 * 1024**3) -> Path:
    """Write config.json, generation_config.json and safetensors weights (sharded above `max_shard_bytes`)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = model.config
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight")
    dtype = dtype_name(next(iter(state.values())).dtype)

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.clone()  # no storage shared between tensors (safetensors refuses it)
        size += nbytes
    for old in list(path.glob("model*.safetensors")) + list(path.glob("model.safetensors.index.json")):
        old.unlink()
    if len(shards) == 1:
        _save_atomic(save_file, shards[0], path / "model.safetensors")
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            _save_atomic(save_file, shard, path / name)
            weight_map.update(dict.fromkeys(shard, name))
        total = sum(t.numel() * t.element_size() for t in state.values())
        atomic_write_json(path / "model.safetensors.index.json",
                          {"metadata": {"total_size": total}, "weight_map": weight_map})
    atomic_write_json(path / "config.json", config.to_hf(dtype=dtype))
    gen = {k: getattr(config, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")
           if getattr(config, k) is not None}
    atomic_write_json(path / "generation_config.json", gen)
    return path


def _save_atomic(save_file, tensors: dict, target: Path) -> None:
    tmp = target.with_name(f".{target.name}.tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(target)
