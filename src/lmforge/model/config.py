"""The model's configuration, and its translation to and from Hugging Face `config.json`.

One dataclass covers the Llama family we support: Llama (1/2/3), Mistral (without a sliding
window), Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm). Anything else a checkpoint asks
for (sliding windows, mixtures of experts, other RoPE scalings, quantized weights) is refused
here, by field and value, so a model is never silently run wrong. This module knows nothing
about tensors.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

# model_type -> (HF architecture class name, q/k/v bias, o bias, q/k norm).
ARCHITECTURES: dict[str, tuple[str, bool | None, bool | None, bool]] = {
    # None = read `attention_bias` from the config (Llama and Qwen3 apply it to q, k, v and o).
    "llama": ("LlamaForCausalLM", None, None, False),
    "mistral": ("MistralForCausalLM", False, False, False),
    "qwen2": ("Qwen2ForCausalLM", True, False, False),
    "qwen3": ("Qwen3ForCausalLM", None, None, True),
}
SUPPORTED_ROPE_TYPES = ("default", "llama3")


class UnsupportedConfigError(ValueError):
    """A checkpoint asks for something this model does not implement."""

    def __init__(self, field_name: str, value: Any, why: str):
        self.field = field_name
        self.value = value
        super().__init__(f"unsupported model config: {field_name}={value!r}: {why}")


@dataclass
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder. Field names follow Hugging Face's."""

    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 704
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None  # None = num_attention_heads (plain multi-head)
    head_dim: int | None = None  # None = hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3", "factor", "low_freq_factor", ...}
    tie_word_embeddings: bool = True
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    initializer_range: float = 0.02
    extra: dict = field(default_factory=dict, repr=False)  # HF keys we carry through untouched

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.validate()

    def validate(self) -> None:
        if self.model_type not in ARCHITECTURES:
            raise UnsupportedConfigError("model_type", self.model_type,
                                         f"supported: {', '.join(ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"model config: num_attention_heads={self.num_attention_heads} is not a "
                             f"multiple of num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"model config: head_dim={self.head_dim} must be even for RoPE")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedConfigError("rope_scaling.rope_type", rope_type,
                                         f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        if rope_type == "llama3":
            for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                if key not in self.rope_scaling:
                    raise ValueError(f"model config: rope_scaling of type llama3 needs {key!r}")

    @property
    def architecture(self) -> str:
        return ARCHITECTURES[self.model_type][0]

    def num_parameters(self, embedding: bool = True) -> int:
        """Parameter count computed from the shapes (equals `sum(p.numel())` of the model)."""
        D, F, L, H = self.hidden_size, self.intermediate_size, self.num_hidden_layers, self.head_dim
        q, kv = self.num_attention_heads * H, self.num_key_value_heads * H
        attn = D * q + 2 * D * kv + q * D + (q + 2 * kv) * self.qkv_bias + D * self.o_bias
        mlp = 3 * D * F + (2 * F + D) * self.mlp_bias
        norms = 2 * D + (2 * H if self.qk_norm else 0)
        n = L * (attn + mlp + norms) + D  # + final norm
        emb = self.vocab_size * D
        head = 0 if self.tie_word_embeddings else emb
        return n + head + (emb if embedding else 0)

    # ---- Hugging Face config.json -------------------------------------------------------------

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        """Build from a `config.json` dict, refusing what we do not implement."""
        model_type = hf.get("model_type")
        if model_type not in ARCHITECTURES:
            raise UnsupportedConfigError("model_type", model_type,
                                         f"lmforge runs {', '.join(ARCHITECTURES)} checkpoints")
        _refuse_unsupported(hf)
        _, qkv_bias, o_bias, qk_norm = ARCHITECTURES[model_type]
        attention_bias = bool(hf.get("attention_bias", False))
        rope_theta, rope_scaling = _read_rope(hf)
        known = {f.name for f in dataclasses.fields(cls)} | {
            "architectures", "rope_parameters", "attention_bias", "torch_dtype", "dtype", "layer_types",
            "quantization_config"}  # the weights' format, not the model's: a dequantized save must not carry it
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=hf["num_attention_heads"],
            num_key_value_heads=hf.get("num_key_value_heads"),
            head_dim=hf.get("head_dim"),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias if qkv_bias is None else qkv_bias,
            o_bias=attention_bias if o_bias is None else o_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=qk_norm,
            model_type=model_type,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
            initializer_range=hf.get("initializer_range", 0.02),
            extra={k: v for k, v in hf.items() if k not in known},
        )

    def to_hf(self, dtype: str | None = None) -> dict:
        """The `config.json` that `transformers.AutoConfig` reads back into the same model."""
        if self.model_type == "mistral" and (self.qkv_bias or self.o_bias or self.mlp_bias):
            raise UnsupportedConfigError("model_type", "mistral", "Mistral checkpoints have no biases")
        if self.model_type == "qwen2" and not self.qkv_bias:
            raise UnsupportedConfigError("qkv_bias", False, "Qwen2 checkpoints always have q/k/v bias")
        rope_parameters = {"rope_theta": self.rope_theta, "rope_type": "default", **(self.rope_scaling or {})}
        hf = dict(self.extra)
        hf.update({
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            # Both spellings: transformers >= 5 reads rope_parameters, older readers
            # (transformers 4.x, vLLM, llama.cpp converters) read rope_theta / rope_scaling.
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "rope_parameters": rope_parameters,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_dropout": 0.0,
            "initializer_range": self.initializer_range,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "use_cache": True,
        })
        if self.model_type in ("llama", "qwen3"):
            if self.qkv_bias != self.o_bias:
                raise UnsupportedConfigError("o_bias", self.o_bias,
                                             f"{self.model_type} uses one attention_bias for q, k, v and o")
            hf["attention_bias"] = self.qkv_bias
        if self.model_type == "llama":
            hf["mlp_bias"] = self.mlp_bias
        elif self.mlp_bias:
            raise UnsupportedConfigError("mlp_bias", True, f"{self.model_type} checkpoints have no MLP bias")
        if self.model_type in ("mistral", "qwen2", "qwen3"):
            hf["sliding_window"] = None
        if self.model_type in ("qwen2", "qwen3"):
            hf["use_sliding_window"] = False
        if dtype:
            hf["torch_dtype"] = dtype
        return hf


# Tensor cores (and CPU vector units) work on tiles: bf16/fp16 matmuls reach their peak when every
# dimension is a multiple of 8 (NVIDIA's "Matrix Multiplication Background" guide),
# and 64 for the vocabulary, whose matmul is the largest (Karpathy reported nanoGPT
# ~25% faster at vocab 50304 than at 50257).
ALIGNMENT = {"hidden_size": 8, "intermediate_size": 8, "head_dim": 8, "vocab_size": 64}


def alignment_warnings(config: ModelConfig) -> list[str]:
    """One warning per dimension that is not a multiple of its alignment, with the nearest good sizes."""
    out = []
    for name, k in ALIGNMENT.items():
        v = int(getattr(config, name))
        if v % k:
            lo, hi = v - v % k, v - v % k + k
            nearest = f"{lo} or {hi}" if lo > 0 else f"{hi}"
            out.append(f"model {name}={v} is not a multiple of {k}: matmuls on tensor cores / vector units run "
                       f"slower at odd sizes; nearest good sizes {nearest}")
    return out


def _read_rope(hf: dict) -> tuple[float, dict | None]:
    """RoPE base and scaling from either spelling (transformers 5 `rope_parameters`, or 4.x keys)."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = dict(hf.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = {**legacy, **params}
    if "type" in scaling and "rope_type" not in scaling:  # transformers < 4.45 wrote "type"
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("type", None)
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedConfigError("rope_scaling.rope_type", rope_type,
                                     f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None
    return theta, scaling


def _refuse_unsupported(hf: dict) -> None:
    """Fields whose presence would change the computation in ways we do not implement."""
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedConfigError("hidden_act", act, "only SwiGLU (silu) MLPs are implemented")
    window = hf.get("sliding_window")
    max_pos = hf.get("max_position_embeddings", math.inf)
    uses_window = hf.get("use_sliding_window", hf.get("model_type") == "mistral")
    if uses_window and window is not None and window < max_pos:
        raise UnsupportedConfigError("sliding_window", window,
                                     "sliding-window attention is not implemented; "
                                     "set sliding_window to null only if you accept full attention")
    for lt in hf.get("layer_types") or []:
        if lt != "full_attention":
            raise UnsupportedConfigError("layer_types", lt, "only full_attention layers are implemented")
    for key in ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size"):
        if hf.get(key):
            raise UnsupportedConfigError(key, hf[key], "mixture-of-experts models are not implemented")
    if hf.get("quantization_config"):  # the checkpoint loader validates compressed-tensors (lmforge.quant)
        method = hf["quantization_config"].get("quant_method", "?")
        if method not in ("compressed-tensors", "gptq", "awq"):
            raise UnsupportedConfigError("quantization_config.quant_method", method,
                                         "lmforge loads compressed-tensors W8A16/W4A16 folders (`lmforge quantize` "
                                         "writes them), GPTQ/AWQ int4/int8 folders whose layout maps, or "
                                         "unquantized (bf16/fp16/fp32) checkpoints")
    scaling = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type", "default")) == "llama3" and \
            scaling.get("attention_factor") not in (None, 1.0):
        raise UnsupportedConfigError("rope_scaling.attention_factor", scaling["attention_factor"],
                                     "llama3 RoPE scaling with an attention factor is not implemented")
