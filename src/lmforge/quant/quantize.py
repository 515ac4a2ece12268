"""`lmforge quantize`: a Hugging Face model folder in, a compressed-tensors W8A16 / W4A16 folder out.

Reads the source tensors as stored (names unchanged), quantizes the decoder's linear weights
(`model.layers.*.{q,k,v,o,gate,up,down}_proj`; embeddings, norms and `lm_head` are kept), writes
`model.safetensors`, `config.json` with `quantization_config`, and copies the tokenizer and
generation config, so the folder loads in lmforge's engine, `transformers` and vLLM. The folder is
also a run directory: `config.yaml`, `record.json` (weight bytes before and after, the worst
relative reconstruction error per projection kind). It knows nothing about the engine.

    lmforge quantize models/tiny --scheme w4a16 --group-size 128 --out models/tiny-w4a16
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from lmforge.model.checkpoint import read_hf_config, weight_files
from lmforge.model.config import ModelConfig
from lmforge.track.io import atomic_write_bytes, atomic_write_json, sha256_dir
from lmforge.track.run import RunDir

from .compressed_tensors import compress_linear, quantization_config
from .gptq import gptq_codes
from .scheme import QuantScheme, dequantize, quantize_rtn
from .targets import is_quantizable

COPY_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
              "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt")


@dataclass
class QuantizeConfig:
    model: str
    out: str
    scheme: str = "w4a16"  # w8a16 | w4a16
    group_size: int = 128  # w4a16 only
    method: str = "rtn"  # rtn | gptq
    calibration: str | None = None  # gptq: python-docs or a JSONL with a "text" field
    calibration_samples: int = 64  # gptq: sequences
    calibration_seq_len: int = 256  # gptq: tokens per sequence (cut)


def read_state(path: Path) -> dict[str, torch.Tensor]:
    state = {}
    for file in weight_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                state[name] = f.get_tensor(name)
    return state


def quantize_state(state: dict[str, torch.Tensor], scheme: QuantScheme, codes: dict | None = None,
                   progress=None) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Every quantizable weight replaced by its packed codes, scales and shape. `codes` may map a weight
    name to precomputed (codes, scales) (for a GPTQ pass); the rest are RTN. Returns the new state and,
    per projection kind, the worst relative Frobenius error ||W - W'|| / ||W||."""
    out, worst = {}, {}
    names = list(state)
    for i, name in enumerate(names):
        t = state[name]
        if not is_quantizable(name):
            out[name] = t
            continue
        scheme.check_shape(name, t.shape[1])
        q, s = (codes or {}).get(name) or quantize_rtn(t, scheme, scale_dtype=t.dtype)
        out.update(compress_linear(name.removesuffix(".weight"), q, s, scheme))
        err = ((dequantize(q, s) - t.float()).norm() / t.float().norm().clamp_min(1e-12)).item()
        kind = name.split(".")[-2]
        worst[kind] = max(worst.get(kind, 0.0), err)
        if progress:
            progress(i + 1, len(names))
    return out, worst


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def quantize_model(cfg: QuantizeConfig, overwrite: bool = False) -> dict:
    src, out = Path(cfg.model), Path(cfg.out)
    hf = read_hf_config(src)
    if hf.get("quantization_config"):
        raise ValueError(f"{src / 'config.json'}: already quantized "
                         f"(quantization_config.quant_method={hf['quantization_config'].get('quant_method')!r}); "
                         "quantize the unquantized model instead")
    ModelConfig.from_hf(hf)  # refuse architectures we cannot run before spending any time
    scheme = QuantScheme.from_name(cfg.scheme, cfg.group_size)
    if cfg.method not in ("rtn", "gptq"):
        raise ValueError(f"--method {cfg.method!r}: use rtn or gptq")
    if cfg.method == "gptq" and not cfg.calibration:
        raise ValueError("--method gptq needs --calibration (python-docs, or a JSONL file with a 'text' field)")
    run = RunDir(out, overwrite=overwrite)
    with run:
        run.write_config(cfg)
        state = read_state(src)
        codes = None
        if cfg.method == "gptq":
            codes = gptq_codes(src, state, scheme, cfg.calibration, cfg.calibration_samples, cfg.calibration_seq_len)
        qstate, worst = quantize_state(state, scheme, codes)
        atomic_write_bytes(out / "model.safetensors", save(qstate, metadata={"format": "pt"}))
        for old in out.glob("model-*.safetensors"):
            old.unlink()
        (out / "model.safetensors.index.json").unlink(missing_ok=True)
        hf["quantization_config"] = quantization_config(scheme, ["lm_head"])
        atomic_write_json(out / "config.json", hf)
        for name in COPY_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, out / name)
        linear_before = sum(nbytes({k: v}) for k, v in state.items() if is_quantizable(k))
        linear_after = nbytes({k: v for k, v in qstate.items() if k.rsplit(".", 1)[-1] in
                               ("weight_packed", "weight_scale", "weight_shape")})
        results = {"scheme": scheme.name, "group_size": scheme.group_size, "method": cfg.method,
                   "weight_bytes_before": nbytes(state), "weight_bytes_after": nbytes(qstate),
                   "linear_bytes_before": linear_before, "linear_bytes_after": linear_after,
                   "weight_bytes_ratio": round(nbytes(qstate) / nbytes(state), 4),
                   "worst_relative_error": {k: round(v, 5) for k, v in sorted(worst.items())},
                   "source": str(src), "weights_sha256": sha256_dir(out, "*.safetensors")}
        run.log_metrics({"event": "quantized", **results})
        run.finish(**results)
    return results

