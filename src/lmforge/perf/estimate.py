"""Back-of-the-envelope calculators: estimate a baseline by hand before measuring it.

Every function returns an `Estimate`: named terms, each with its value, unit and the arithmetic
with the numbers substituted ("7.00e9 params × 2 B = 14.0 GB"), plus the assumptions, so the
figure can be checked on paper and printed as is by `lmforge estimate`. The calculators work on
a `ModelShape` (the few numbers that size a Llama-family decoder) and, for the time-based ones,
a `Device` (peak FLOP/s, memory bandwidth, memory size, interconnect; see `device_spec`).

This module knows nothing about tensors or training loops: it imports no torch, so the parallelism
scan and the pre-flight checks can call it before anything is allocated. Measured checks live in
the tests and in `lmforge bench mfu`; peaks and bandwidths in `perf/hardware.py`.

The API (signatures are stable: `lmforge.parallel` calls `memory` and the comm functions):

    shape = ModelShape.from_config("llama3-8b")          # preset | ModelConfig | config.json dict/path | HF folder
    shape.params()                                        # parameter count (embedding included)
    memory(shape, mode="full"|"lora"|"qlora"|"inference", dtype="bfloat16", optimizer="adamw",
           batch=1, seq_len=2048, grad_ckpt=False, dp_shard=1, tp=1, pp=1, ...)  -> Estimate
           .total (bytes, overhead excluded), .overhead, ["weights"], ["activations"], ...
    kv_cache(shape, seq_len, batch=1, dtype="bfloat16", budget_bytes=None)        -> Estimate
    intensity(shape, batch, seq_len, dtype)                                        -> Estimate (per op)
    roofline(shape, device, batch, seq_len, dtype)                                 -> Estimate
    throughput(shape, device, batch, context, dtype)                               -> Estimate (decode ceiling)
    mfu_estimate(shape, tokens_per_s, device, seq_len, dtype, training=True)       -> Estimate
    dp_allreduce(shape, n, bandwidth, dtype)      ring all-reduce of the gradients, 2(n-1)/n · bytes
    fsdp_traffic(shape, n, bandwidth, dtype)      all-gather ×2 + reduce-scatter, 3(n-1)/n · bytes
    tp_allreduce(shape, t, batch, seq_len, bandwidth, dtype, training=True)   4 (train) or 2 all-reduces per layer
    pp_sends(shape, p, batch, seq_len, microbatches, bandwidth, dtype)        activations across p-1 boundaries
    comm(shape, dp=1, tp=1, pp=1, ...)            the three above together         -> Estimate
    quant_sizes(shape, group_size=128)            bf16 / int8 / int4 weight bytes  -> Estimate

    python -m lmforge.perf.estimate llama-7b        # the memory table of the 7B seed figures
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lmforge.perf import hardware
from lmforge.perf.mfu import flops_per_token, mfu

GB = 1e9  # decimal gigabytes, as datasheets and the seed's table use
GiB = 2**30

DTYPE_BYTES = {"float32": 4, "tf32": 4, "bfloat16": 2, "float16": 2, "float8": 1, "int8": 1, "int4": 0.5}
_DTYPE_ALIASES = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16", "fp16": "float16",
                  "half": "float16", "fp8": "float8", "torch.float32": "float32",
                  "torch.bfloat16": "bfloat16", "torch.float16": "float16"}

# Optimizer state in bytes per *trainable* parameter (fp32 states unless the name says otherwise).
OPTIMIZER_BYTES = {"adamw": 8, "adam": 8, "adamw8bit": 2, "lion": 4, "sgd-momentum": 4, "sgd": 0}

# Framework overhead, stated apart from the model's bytes: a CUDA context plus cuBLAS/cuDNN
# workspaces is ~0.5-1 GB on recent drivers; on CPU the torch libraries and the Python process
# measure ~0.3-0.5 GB RSS (this repo's `lmforge doctor` process). The allocator's fragmentation
# (5-10% of the peak) is counted here too.
OVERHEAD_BYTES = {"cuda": 0.75 * GB, "cpu": 0.4 * GB}
# lmforge's light LoRA base (`lora.base_dtype: bfloat16` / `lora.base_quant: int8|int4`, train/lora.py's
# FrozenLinear): float32 scales, the untied head held like the matmuls, each weight rebuilt per matmul into
# one reused buffer of at most `REBUILD_ELEMENTS` weights (tests/test_preflight.py checks they agree).
LIGHT_BASE = {"scale_bytes": 4, "light_head": True, "rebuild_elements": 1 << 23}
# Tokens per chunk of the fused loss (train/fused_ce.py's CHUNK_TOKENS; DPO's log-prob blocks are as large):
# one chunk's fp32 logits and log-softmax and their 16-bit copies exist at a time.
LOSS_CHUNK_TOKENS = 256
FRAGMENTATION = 0.05


def dtype_bytes(dtype: str) -> float:
    key = str(dtype).lower()
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[key]


def fmt_bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_num(x: float) -> str:
    if math.isfinite(x) and x == int(x) and abs(x) < 1e6:
        return f"{int(x):,}"
    return f"{x:.3g}"


# ---- model shape -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """The numbers that size a Llama-family decoder (HF names in comments)."""

    hidden: int  # hidden_size
    layers: int  # num_hidden_layers
    heads: int  # num_attention_heads
    kv_heads: int  # num_key_value_heads
    head_dim: int
    intermediate: int  # intermediate_size (SwiGLU: gate, up, down)
    vocab: int  # vocab_size
    tied: bool = False  # tie_word_embeddings
    qkv_bias: bool = False
    qk_norm: bool = False
    name: str = field(default="", compare=False)

    def layer_params(self) -> int:
        """One decoder layer: q, k, v, o, gate, up, down (+ biases) and the two RMSNorm weights."""
        D, F, H = self.hidden, self.intermediate, self.head_dim
        q, kv = self.heads * H, self.kv_heads * H
        attn = D * q + 2 * D * kv + q * D + (q + 2 * kv) * self.qkv_bias
        return attn + 3 * D * F + 2 * D + (2 * H if self.qk_norm else 0)

    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def head_params(self) -> int:
        return 0 if self.tied else self.vocab * self.hidden

    def params(self, embedding: bool = True) -> int:
        """All parameters (equals `ModelConfig.num_parameters()` and `sum(p.numel())`)."""
        n = self.layers * self.layer_params() + self.hidden + self.head_params()
        return n + (self.embedding_params() if embedding else 0)

    def linear_params(self) -> int:
        """Parameters inside matmuls of the layers (what int8/int4 quantization compresses)."""
        D, F, H = self.hidden, self.intermediate, self.head_dim
        q, kv = self.heads * H, self.kv_heads * H
        return self.layers * (2 * D * q + 2 * D * kv + 3 * D * F)

    def kv_bytes_per_token(self, dtype: str = "bfloat16") -> float:
        """K and V for every layer: 2 · L · kv_heads · head_dim · bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes(dtype)

    @classmethod
    def from_config(cls, source: Any) -> ModelShape:
        """A preset name, a `ModelConfig`, a HF `config.json` dict, a path to one, or a HF folder."""
        if isinstance(source, ModelShape):
            return source
        if isinstance(source, str) and source.lower() in PRESETS:
            return PRESETS[source.lower()]
        if isinstance(source, dict):
            return cls._from_hf(source, name=str(source.get("_name_or_path", "")))
        if isinstance(source, (str, os.PathLike)):
            path = Path(source)
            if path.is_dir():
                path = path / "config.json"
            if not path.is_file():
                raise ValueError(f"model {str(source)!r}: not a preset ({', '.join(PRESETS)}), "
                                 f"a config.json or a folder holding one")
            try:
                hf = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not valid JSON ({e})") from e
            return cls._from_hf(hf, name=str(Path(source)))
        if hasattr(source, "hidden_size"):  # ModelConfig, or a transformers PretrainedConfig
            return cls._from_hf(vars(source) if not hasattr(source, "to_dict") else source.to_dict(),
                                name=getattr(source, "model_type", ""),
                                qkv_bias=getattr(source, "qkv_bias", None),
                                qk_norm=getattr(source, "qk_norm", None))
        raise TypeError(f"cannot read a model shape from {type(source).__name__}")

    @classmethod
    def _from_hf(cls, hf: dict, name: str = "", qkv_bias: bool | None = None,
                 qk_norm: bool | None = None) -> ModelShape:
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                               "intermediate_size", "vocab_size") if hf.get(k) is None]
        if missing:
            raise ValueError(f"model config {name or ''}: missing {', '.join(missing)} "
                             f"(a Llama-family config.json has them)")
        heads = int(hf["num_attention_heads"])
        model_type = hf.get("model_type", "llama")
        if qkv_bias is None:
            qkv_bias = model_type == "qwen2" or bool(hf.get("attention_bias", False))
        return cls(hidden=int(hf["hidden_size"]), layers=int(hf["num_hidden_layers"]), heads=heads,
                   kv_heads=int(hf.get("num_key_value_heads") or heads),
                   head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
                   intermediate=int(hf["intermediate_size"]), vocab=int(hf["vocab_size"]),
                   tied=bool(hf.get("tie_word_embeddings", False)), qkv_bias=bool(qkv_bias),
                   qk_norm=bool(model_type == "qwen3" if qk_norm is None else qk_norm), name=name)


# Published config.json values (Hugging Face model cards of each family).
PRESETS: dict[str, ModelShape] = {s.name: s for s in (
    ModelShape(4096, 32, 32, 32, 128, 11008, 32000, name="llama-7b"),       # Llama 1/2 7B
    ModelShape(4096, 32, 32, 32, 128, 11008, 32000, name="llama2-7b"),
    ModelShape(5120, 40, 40, 40, 128, 13824, 32000, name="llama2-13b"),
    ModelShape(4096, 32, 32, 8, 128, 14336, 128256, name="llama3-8b"),      # Llama 3 / 3.1 8B
    ModelShape(8192, 80, 64, 8, 128, 28672, 128256, name="llama3-70b"),
    ModelShape(2048, 16, 32, 8, 64, 8192, 128256, tied=True, name="llama3.2-1b"),
    ModelShape(4096, 32, 32, 8, 128, 14336, 32000, name="mistral-7b"),
    ModelShape(896, 24, 14, 2, 64, 4864, 151936, tied=True, qkv_bias=True, name="qwen2.5-0.5b"),
    ModelShape(1536, 28, 12, 2, 128, 8960, 151936, tied=True, qkv_bias=True, name="qwen2.5-1.5b"),
    ModelShape(3584, 28, 28, 4, 128, 18944, 152064, qkv_bias=True, name="qwen2.5-7b"),
    ModelShape(4096, 36, 32, 8, 128, 12288, 151936, qk_norm=True, name="qwen3-8b"),
)}


# ---- the result type -------------------------------------------------------------------------


@dataclass
class Term:
    name: str
    value: float
    unit: str  # "B" (bytes), "FLOP", "FLOP/s", "s", "tok/s", "FLOP/B", "" (a count or ratio)
    formula: str  # the arithmetic, numbers substituted

    def pretty(self) -> str:
        if self.unit == "B":
            return fmt_bytes(self.value)
        if self.unit in ("FLOP/s", "B/s"):
            return f"{self.value / 1e12:.3g} T{self.unit}" if self.value >= 1e11 else f"{self.value / 1e9:.3g} G{self.unit}"
        if self.unit == "s":
            return f"{self.value * 1e3:.3g} ms" if self.value < 1 else f"{self.value:.3g} s"
        if self.unit == "%":
            return f"{self.value:.1%}"
        return f"{fmt_num(self.value)} {self.unit}".strip()


@dataclass
class Estimate:
    title: str
    terms: list[Term] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)

    def add(self, name: str, value: float, unit: str, formula: str) -> float:
        self.terms.append(Term(name, float(value), unit, formula))
        return value

    def __getitem__(self, name: str) -> float:
        for t in self.terms:
            if t.name == name:
                return t.value
        raise KeyError(f"{name!r} not in estimate {self.title!r}: {[t.name for t in self.terms]}")

    def get(self, name: str, default: float | None = None) -> float | None:
        try:
            return self[name]
        except KeyError:
            return default

    @property
    def total(self) -> float:
        return self["total"]

    @property
    def overhead(self) -> float:
        return self.get("framework overhead", 0.0) or 0.0

    def to_dict(self) -> dict:
        return {"title": self.title, "terms": [asdict(t) for t in self.terms],
                "assumptions": list(self.assumptions)}

    def to_text(self) -> str:
        width = max((len(t.name) for t in self.terms), default=0)
        lines = [self.title, ""]
        lines += [f"  {t.name:<{width}}  {t.pretty():>16}   {t.formula}" for t in self.terms]
        if self.assumptions:
            lines += ["", "assumptions:"] + [f"  - {a}" for a in self.assumptions]
        return "\n".join(lines)


# ---- memory ----------------------------------------------------------------------------------

MODES = ("full", "lora", "qlora", "inference")


ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_params(shape: ModelShape, rank: int = 16, targets: tuple[str, ...] = ALL_TARGETS) -> int:
    """A and B of every targeted matmul: rank · (in + out) per module per layer (Hu et al. 2021)."""
    D, F, H = shape.hidden, shape.intermediate, shape.head_dim
    q, kv = shape.heads * H, shape.kv_heads * H
    dims = {"q_proj": (D, q), "k_proj": (D, kv), "v_proj": (D, kv), "o_proj": (q, D),
            "gate_proj": (D, F), "up_proj": (D, F), "down_proj": (F, D), "lm_head": (D, shape.vocab)}
    unknown = [t for t in targets if t not in dims]
    if unknown:
        raise ValueError(f"lora targets {unknown} unknown; choose from {', '.join(dims)}")
    per_layer = sum(rank * sum(dims[t]) for t in targets if t != "lm_head")
    return shape.layers * per_layer + (rank * sum(dims["lm_head"]) if "lm_head" in targets else 0)


def activation_bytes_per_token_layer(shape: ModelShape, act_bytes: float, resid_bytes: float,
                                     seq_len: int, dense_attention: bool = False, tp: int = 1) -> tuple[float, str]:
    """Bytes one decoder layer keeps for backward per token, and the arithmetic.

    Counted from what autograd saves in our block (Korthikanti et al. 2022 do the same for GPT):
    both RMSNorm inputs (residual dtype) and outputs (matmul inputs), q/k/v after RoPE and the
    attention output, the SwiGLU gate, up, silu(gate) and their product (the down input).
    A dense (math) attention also keeps the N·T probabilities per token; FlashAttention-class
    kernels keep only a log-sum-exp. Tensor parallelism splits everything but the norms.
    """
    D, F, H = shape.hidden, shape.intermediate, shape.head_dim
    q, kv = shape.heads * H, shape.kv_heads * H
    norms = 2 * D * (resid_bytes + act_bytes)
    attn = (2 * q + 2 * kv) * act_bytes / tp
    mlp = 4 * F * act_bytes / tp
    scores = shape.heads * seq_len * act_bytes / tp if dense_attention else 0
    total = norms + attn + mlp + scores
    text = (f"norms 2·{D}·({fmt_num(resid_bytes)}+{fmt_num(act_bytes)}) + attn (2·{q}+2·{kv})·{fmt_num(act_bytes)}"
            f"{'/' + str(tp) if tp > 1 else ''} + mlp 4·{F}·{fmt_num(act_bytes)}{'/' + str(tp) if tp > 1 else ''}"
            + (f" + scores {shape.heads}·{seq_len}·{fmt_num(act_bytes)}" if dense_attention else "")
            + f" = {fmt_num(total)} B")
    return total, text


def memory(shape: ModelShape | Any, mode: str = "full", dtype: str = "bfloat16", optimizer: str = "adamw",
           batch: int = 1, seq_len: int = 2048, grad_ckpt: bool = False, dp_shard: int = 1, tp: int = 1,
           pp: int = 1, *, master_weights: bool | None = None, lora_rank: int = 16,
           lora_targets: tuple[str, ...] | None = None, fused_loss: bool = True,
           dense_attention: bool = False, kv_dtype: str | None = None, quant_bits: int | None = None,
           group_size: int | None = None, compute_dtype: str | None = None, device_kind: str = "cuda",
           reference_model: bool = False) -> Estimate:
    """Bytes per device for training (`full`, `lora`, `qlora`) or serving (`inference`).

    - `dtype`: the weights' storage dtype. 16-bit `full` training keeps fp32 master weights
      (`master_weights`, default on for 16-bit full training), so AdamW costs 2 (weights) + 2
      (grads) + 4 (master) + 8 (m, v) = 16 bytes per parameter: the seed's 7B ≈ 112 GB.
      With `dtype=float32` (lmforge's trainer: fp32 weights under bf16 autocast) it is 4+4+8 = 16 too.
    - `batch` is the micro-batch per device; `seq_len` tokens per row.
    - `dp_shard`: FSDP/ZeRO-3 degree (weights, grads and optimizer state divided by it).
    - `tp`: tensor-parallel degree (layers' weights and most activations divided by it).
    - `pp`: pipeline degree (layers per device ÷ pp; 1F1B keeps pp micro-batches in flight on the
      first stage, so activations stay those of L layers for one micro-batch).
    - `inference`: weights (int8/int4 with `quant_bits`, default 4 for qlora and none for
      inference) + KV cache of `batch` sequences of `seq_len` tokens + the largest transient.
    - `lora` / `qlora` count the frozen base as lmforge's trainer holds it (train/lora.py): `dtype` is the
      base's matmul weights (`lora.base_dtype`: float32 or bfloat16; `qlora`: int8/int4 codes with
      `quant_bits`, default 4, with float32 scales per channel / per `group_size` (64) weights), the
      untied head held like them; embeddings, norms and the fp32 adapters stay float32, so the residual
      stream is float32. A plain float32 base under 16-bit autocast keeps the 16-bit cast of each frozen
      matmul weight for backward; a light base (bf16 under float32 compute, int8, int4) is rebuilt per
      matmul into one reused buffer instead (`LIGHT_BASE`). `train.guards.memory_args` maps a training
      config to these arguments, so the pre-flight and `lmforge estimate memory` compute the same bytes.
    - `quant_bits` with `inference`: 8 or 4 bit matmuls (bf16 scales per channel / group of 128), the rest
      in `dtype`.
    - `reference_model`: DPO's frozen reference, a second copy of the weights (no gradients, no states).
    The `total` excludes the framework overhead (CUDA context, allocator), given as its own term.
    """
    shape = ModelShape.from_config(shape)
    _check_memory_args(mode, optimizer, batch=batch, seq_len=seq_len, dp_shard=dp_shard, tp=tp, pp=pp)
    wb = dtype_bytes(dtype)
    # Training computes in 16 bit: the weights' dtype, or bf16 autocast over fp32 weights (lmforge's
    # trainer); pass compute_dtype="float32" for a run without autocast.
    act_b = dtype_bytes(compute_dtype) if compute_dtype else min(wb, 2.0)
    est = Estimate(f"memory: {shape.name or 'model'}, mode={mode}, dtype={dtype}"
                   + (f", optimizer={optimizer}" if mode != "inference" else "")
                   + f", batch={batch}, seq_len={seq_len}" + (", grad_ckpt" if grad_ckpt else "")
                   + (f", dp_shard={dp_shard}" if dp_shard > 1 else "") + (f", tp={tp}" if tp > 1 else "")
                   + (f", pp={pp}" if pp > 1 else ""))
    light = dict(scale_bytes=2, light_head=False, rebuild_elements=None)
    rest_dtype = dtype
    if mode in ("lora", "qlora"):  # lmforge's LoRA layout (see above)
        quant_bits = quant_bits or (4 if mode == "qlora" else 16 if wb < 4 else None)
        light = dict(LIGHT_BASE) if quant_bits else {**light, "light_head": True}
        rest_dtype, group_size = "float32", group_size or 64
    weights, n_here, layers_here = _weight_terms(est, shape, rest_dtype, dp_shard, tp, pp, quant_bits,
                                                 group_size or 128, light["scale_bytes"], light["light_head"])
    if mode == "inference":
        return _inference_terms(est, shape, weights, batch, seq_len, kv_dtype or ("bfloat16" if wb < 4 else dtype),
                                tp, pp, device_kind)
    trainable = n_here if mode == "full" else lora_params(shape, lora_rank, lora_targets or
                                                          ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj")) * layers_here / shape.layers / tp
    _optimizer_terms(est, mode, trainable, wb, optimizer, dp_shard, master_weights, lora_rank)
    acts, loss_b = _activation_terms(est, shape, batch * seq_len, seq_len, act_b,
                                     4.0 if dtype_bytes(rest_dtype) == 4 else 2.0, tp, grad_ckpt, fused_loss,
                                     dense_attention, head_trainable=mode == "full")
    if mode in ("lora", "qlora") and act_b < 4:
        acts += _lora_cast_terms(est, shape, lora_targets or ALL_TARGETS, batch * seq_len, act_b, tp, grad_ckpt)
    # Autocast keeps a 16-bit copy of each fp32 weight it casts, for the backward's matmuls.
    if mode == "full" and wb == 4 and act_b == 2:
        est.add("autocast weight copies", n_here * 2 / dp_shard, "B", f"{fmt_num(n_here)} × 2 B (bf16 casts, kept for backward)")
    elif mode != "full":
        _frozen_base_terms(est, shape, wb, act_b, quant_bits, light["light_head"], light["rebuild_elements"], tp,
                           layers_here)
    if reference_model:
        est.add("reference model", weights, "B", "a second, frozen copy of the weights (DPO's reference)")
    _training_totals(est, acts, loss_b, device_kind)
    est.assumptions += [
        "the sum is conservative: gradients grow while activations are freed during backward",
        "activations: bytes saved for backward by our Llama block, attention through SDPA "
        + ("(dense T×T mask: scores kept)" if dense_attention else "(flash/efficient kernel: no T×T scores)"),
    ]
    return est


def _lora_cast_terms(est: Estimate, shape: ModelShape, targets: tuple[str, ...], tokens: int, act_b: float,
                     tp: int, grad_ckpt: bool) -> float:
    """peft casts a LoRA layer's input to the adapter's dtype (float32) and autocast casts it back for lora_A,
    which saves that 16-bit copy: one per targeted matmul, of its input width, per token."""
    D, F = shape.hidden, shape.intermediate
    width = {"q_proj": D, "k_proj": D, "v_proj": D, "o_proj": shape.heads * shape.head_dim, "gate_proj": D,
             "up_proj": D, "down_proj": F}
    per = sum(width.get(t, 0) for t in targets) * act_b / tp
    layers = 1 if grad_ckpt else shape.layers
    return est.add("activations (LoRA input casts)", layers * per * tokens, "B",
                   f"{layers} layer(s) × {fmt_num(tokens)} tokens × Σ input widths of {len(targets)} targets × "
                   f"{fmt_num(act_b)} B = {fmt_num(per)} B per token and layer")


def _frozen_base_terms(est: Estimate, shape: ModelShape, wb: float, act_b: float, quant_bits: int | None,
                       light_head: bool, rebuild_elements: int | None, tp: int, layers_here: int) -> None:
    """What a frozen (LoRA) base adds for backward: 16-bit casts of fp32 matmul weights saved by autocast,
    or, for a base rebuilt per matmul (lmforge's light base), the one buffer it is rebuilt into."""
    lin = shape.linear_params() * layers_here / shape.layers / tp
    if quant_bits is None:
        if wb == 4 and act_b == 2:
            est.add("autocast weight copies", lin * 2, "B",
                    f"{fmt_num(lin)} frozen matmul weights × 2 B (bf16 casts, kept for backward)")
        return
    if rebuild_elements is None or (quant_bits == 16 and act_b == 2):
        return  # bf16 weights used as stored under bf16 compute: nothing rebuilt
    D, F = shape.hidden, shape.intermediate
    largest = max(D * F, D * shape.heads * shape.head_dim, shape.vocab * D if light_head and not shape.tied else 0)
    n = min(largest, rebuild_elements)
    per = 4 + (act_b if act_b < 4 else 0)  # float32 rebuild, then its 16-bit copy under autocast
    est.add("rebuild buffer", n * per, "B", f"min(largest matmul {fmt_num(largest)}, {fmt_num(rebuild_elements)}) "
            f"weights × {fmt_num(per)} B (dequantized per matmul, one buffer reused)")


def _check_memory_args(mode: str, optimizer: str, **sizes: int) -> None:
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: choose one of {', '.join(MODES)}")
    if optimizer not in OPTIMIZER_BYTES:
        raise ValueError(f"optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZER_BYTES)}")
    for name, v in sizes.items():
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")


def _weight_terms(est: Estimate, shape: ModelShape, dtype: str, dp_shard: int, tp: int, pp: int,
                  quant_bits: int | None, group_size: int, scale_bytes: float = 2,
                  light_head: bool = False) -> tuple[float, float, int]:
    """The `parameters` and `weights` terms; returns (weight bytes, parameters and layers on one device)."""
    wb = dtype_bytes(dtype)
    n = shape.params()
    # What one device holds of the weights: layers split over tp and pp, embeddings/head over tp.
    layers_here = math.ceil(shape.layers / pp)
    n_here = (layers_here * shape.layer_params() + shape.hidden + shape.embedding_params() + shape.head_params()) / tp
    split = f" / tp {tp}" if tp > 1 else ""
    est.add("parameters", n, "", f"{fmt_num(shape.layers)} layers × {fmt_num(shape.layer_params())} + "
            f"embedding {fmt_num(shape.embedding_params())}" + ("" if shape.tied else f" + head {fmt_num(shape.head_params())}"))
    shard = f" / dp_shard {dp_shard}" if dp_shard > 1 else ""
    layer_txt = f"({layers_here} of {shape.layers} layers)" if pp > 1 else ""
    if quant_bits:
        if quant_bits not in (16, 8, 4):
            raise ValueError(f"quant_bits must be 16, 8 or 4, got {quant_bits}")
        q = quant_sizes(shape, group_size=group_size, scale_bytes=scale_bytes)
        head = shape.head_params() if light_head else 0  # an untied head held like the matmuls
        lin_b = {16: shape.linear_params() * 2, 8: q["int8 linears"], 4: q["int4 linears"]}[quant_bits]
        lin_b *= (shape.linear_params() + head) / shape.linear_params()
        rest = shape.params() - shape.linear_params() - head
        key = {16: "bf16", 8: "int8", 4: "int4"}[quant_bits]
        weights = (lin_b + rest * wb) * (layers_here / shape.layers) / tp / dp_shard
        est.add("weights", weights, "B", f"{key} matmuls{' and head' if head else ''} {fmt_bytes(lin_b)} + "
                f"{fmt_num(rest)} other params (embeddings, norms) × {fmt_num(wb)} B ({dtype}) {layer_txt}{split}{shard}")
    else:
        weights = est.add("weights", n_here * wb / dp_shard, "B",
                          f"{fmt_num(n_here)} params {layer_txt} × {fmt_num(wb)} B ({dtype}){split}{shard}")
    return weights, n_here, layers_here


def _optimizer_terms(est: Estimate, mode: str, trainable: float, wb: float, optimizer: str, dp_shard: int,
                     master_weights: bool | None, lora_rank: int) -> None:
    """Trainable parameters' gradients, fp32 master copy and optimizer state (and LoRA's adapters)."""
    shard = f" / dp_shard {dp_shard}" if dp_shard > 1 else ""
    if mode != "full":
        est.add("trainable parameters", trainable, "", f"LoRA rank {lora_rank}: r·(in+out) per targeted matmul")
    grad_b = wb
    if mode != "full":
        grad_b = 4.0  # adapters are kept in fp32 (as lmforge's LoRA and PEFT's defaults do)
        est.add("adapter weights", trainable * 4 / dp_shard, "B", f"{fmt_num(trainable)} × 4 B (fp32){shard}")
    est.add("gradients", trainable * grad_b / dp_shard, "B", f"{fmt_num(trainable)} × {fmt_num(grad_b)} B{shard}")
    master = master_weights if master_weights is not None else (mode == "full" and wb < 4)
    if master:
        est.add("master weights", trainable * 4 / dp_shard, "B", f"{fmt_num(trainable)} × 4 B (fp32 copy){shard}")
    ob = OPTIMIZER_BYTES[optimizer]
    est.add("optimizer state", trainable * ob / dp_shard, "B", f"{fmt_num(trainable)} × {ob} B ({optimizer}){shard}")


def _activation_terms(est: Estimate, shape: ModelShape, tokens: int, seq_len: int, act_b: float, resid_b: float,
                      tp: int, grad_ckpt: bool, fused_loss: bool, dense_attention: bool,
                      head_trainable: bool = True) -> tuple[float, float]:
    """Activations with and without checkpointing, the loss's logits and backward's transient;
    returns (activation bytes, loss bytes). `resid_b`: the residual stream is fp32 when the weights
    are (autocast), else 16-bit."""
    per_layer, per_layer_txt = activation_bytes_per_token_layer(shape, act_b, resid_b, seq_len, dense_attention, tp)
    full_acts = shape.layers * per_layer * tokens  # pp > 1, 1F1B: L/pp layers × pp micro-batches in flight
    # Checkpointing keeps each layer's input and recomputes one layer at a time in backward.
    ckpt_acts = shape.layers * resid_b * shape.hidden * tokens + per_layer * tokens
    est.add("activations (no checkpointing)", full_acts, "B",
            f"{shape.layers} layers × {fmt_num(tokens)} tokens × ({per_layer_txt})")
    est.add("activations (checkpointing)", ckpt_acts, "B",
            f"{shape.layers} layer inputs × {fmt_num(tokens)} tokens × {shape.hidden}·{fmt_num(resid_b)} B"
            f" + one layer recomputed ({fmt_num(per_layer)} B × {fmt_num(tokens)})")
    acts = est.add("activations", ckpt_acts if grad_ckpt else full_acts, "B",
                   "with checkpointing" if grad_ckpt else "without checkpointing (train.gradient_checkpointing=false)")
    # The loss: full logits (16-bit) + fp32 log-softmax saved for backward, or one chunk when fused.
    if fused_loss:  # the head's gradient only when the head trains (not under LoRA)
        head = shape.vocab * shape.hidden * 4 / tp if head_trainable else 0
        chunk = min(tokens, LOSS_CHUNK_TOKENS)
        loss_b = est.add("logits / loss", tokens * shape.hidden * 4 + head + chunk * shape.vocab * 12 / tp, "B",
                         f"fused LM head + CE: saved grad of hidden {fmt_num(tokens)}×{shape.hidden}×4 B"
                         + (f" + head grad {shape.vocab}×{shape.hidden}×4 B" if head else "")
                         + f" + one chunk's logits {chunk}×{shape.vocab}×(4+4+2+2) B")
    else:
        loss_b = est.add("logits / loss", tokens * shape.vocab * (2 + 4 + 4) / tp, "B",
                         f"{fmt_num(tokens)} tokens × {shape.vocab} vocab × (2 logits + 4 fp32 log-softmax + 4 its grad)")
    # Backward starts with every activation alive and adds the gradients of one layer's saved
    # tensors before the layer's inputs are freed; a checkpointed layer is freed as it goes.
    if not grad_ckpt:
        est.add("backward transient", per_layer * tokens, "B",
                f"one layer's activation gradients: {fmt_num(per_layer)} B × {fmt_num(tokens)} tokens")
    return acts, loss_b


def _training_totals(est: Estimate, acts: float, loss_b: float, device_kind: str) -> None:
    """Model states, the total, and the framework overhead beside it."""
    transient = est.get("backward transient", 0.0)
    states = sum(t.value for t in est.terms if t.unit == "B" and not t.name.startswith("activations")
                 and t.name not in ("logits / loss", "backward transient"))
    est.add("model states", states, "B", "weights + gradients + optimizer (+ master, adapters, casts)")
    total = est.add("total", states + acts + loss_b + transient, "B",
                    "model states + activations + logits/loss" + (" + backward transient" if transient else ""))
    est.add("framework overhead", OVERHEAD_BYTES[device_kind] + FRAGMENTATION * total, "B",
            f"{fmt_bytes(OVERHEAD_BYTES[device_kind])} {device_kind} runtime + {FRAGMENTATION:.0%} allocator fragmentation")


def _inference_terms(est: Estimate, shape: ModelShape, weights: float, batch: int, seq_len: int, kv_dtype: str,
                     tp: int, pp: int, device_kind: str) -> Estimate:
    kv = kv_cache(shape, seq_len, batch, kv_dtype)
    kv_here = kv["per batch"] / tp / pp
    est.add("kv cache", kv_here, "B", f"{batch} seq × {seq_len} tokens × {fmt_bytes(kv['per token'])}/token"
            + (f" / tp {tp}" if tp > 1 else "") + (f" / pp {pp}" if pp > 1 else ""))
    # The largest transient of a prefill chunk: the logits of the last tokens and an MLP hidden.
    act = est.add("activations", batch * (shape.vocab * 4 + 2 * shape.intermediate * 2 / tp + 4 * shape.hidden * 2), "B",
                  f"{batch} seq × (logits {shape.vocab}×4 B + MLP 2·{shape.intermediate}×2 B + hidden 4·{shape.hidden}×2 B)")
    total = est.add("total", weights + kv_here + act, "B", "weights + kv cache + activations")
    est.add("framework overhead", OVERHEAD_BYTES[device_kind] + FRAGMENTATION * total, "B",
            f"{fmt_bytes(OVERHEAD_BYTES[device_kind])} {device_kind} runtime + {FRAGMENTATION:.0%} allocator fragmentation")
    est.assumptions.append("KV cache allocated for the full seq_len of every sequence (as a paged pool sized for it)")
    return est


# ---- KV cache --------------------------------------------------------------------------------


def kv_cache(shape: ModelShape | Any, seq_len: int, batch: int = 1, dtype: str = "bfloat16",
             budget_bytes: float | None = None, block_size: int | None = None) -> Estimate:
    """Bytes per token (2 · L · kv_heads · head_dim · bytes), per sequence, per batch, and the
    most concurrent sequences of `seq_len` a `budget_bytes` holds (whole blocks when `block_size`)."""
    shape = ModelShape.from_config(shape)
    b = dtype_bytes(dtype)
    est = Estimate(f"kv cache: {shape.name or 'model'}, {dtype}, seq_len={seq_len}")
    per_token = est.add("per token", shape.kv_bytes_per_token(dtype), "B",
                        f"2 (K,V) × {shape.layers} layers × {shape.kv_heads} kv heads × {shape.head_dim} head_dim × {fmt_num(b)} B")
    if shape.kv_heads != shape.heads:
        est.add("GQA saving", shape.heads / shape.kv_heads, "×",
                f"{shape.heads} query heads share {shape.kv_heads} kv heads (MHA would be {fmt_bytes(per_token * shape.heads / shape.kv_heads)}/token)")
    tokens = seq_len if block_size is None else math.ceil(seq_len / block_size) * block_size
    per_seq = est.add("per sequence", per_token * tokens, "B", f"{fmt_bytes(per_token)} × {tokens} tokens"
                      + (f" ({math.ceil(seq_len / block_size)} blocks of {block_size})" if block_size else ""))
    est.add("per batch", per_seq * batch, "B", f"{fmt_bytes(per_seq)} × {batch} sequences")
    if budget_bytes is not None:
        est.add("budget", budget_bytes, "B", "memory left for the KV cache")
        est.add("max sequences", math.floor(budget_bytes / per_seq), "",
                f"floor({fmt_bytes(budget_bytes)} / {fmt_bytes(per_seq)})")
        est.add("max tokens", math.floor(budget_bytes / per_token), "", f"floor({fmt_bytes(budget_bytes)} / {fmt_bytes(per_token)})")
    return est


# ---- FLOPs, intensity, roofline --------------------------------------------------------------


def _ops(shape: ModelShape) -> list[tuple[str, int, int]]:
    """The matmuls of one token through the model: (name, in, out), per layer unless noted."""
    D, F, H = shape.hidden, shape.intermediate, shape.head_dim
    q, kv = shape.heads * H, shape.kv_heads * H
    return [("qkv_proj", D, q + 2 * kv), ("o_proj", q, D), ("gate_up_proj", D, 2 * F), ("down_proj", F, D),
            ("lm_head", D, shape.vocab)]


def intensity(shape: ModelShape | Any, batch: int = 1, seq_len: int = 2048, dtype: str = "bfloat16",
              context: int | None = None) -> Estimate:
    """Arithmetic intensity (FLOP per byte moved) of each matmul at prefill (M = batch·seq_len rows)
    and decode (M = batch rows): 2·M·K·N / ((M·K + K·N + M·N) · bytes); and attention's, whose
    decode reads the whole KV cache of `context` tokens for 4·heads·head_dim FLOPs per token."""
    shape = ModelShape.from_config(shape)
    b = dtype_bytes(dtype)
    est = Estimate(f"arithmetic intensity: {shape.name or 'model'}, {dtype}, batch={batch}, seq_len={seq_len}")
    for phase, m in (("prefill", batch * seq_len), ("decode", batch)):
        for name, k, n in _ops(shape):
            flops = 2 * m * k * n
            moved = (m * k + k * n + m * n) * b
            est.add(f"{phase} {name}", flops / moved, "FLOP/B",
                    f"2·{m}·{k}·{n} / (({m}·{k} + {k}·{n} + {m}·{n}) × {fmt_num(b)} B)")
    ctx = context or seq_len
    # Decode attention per sequence and layer: QKᵀ and AV over ctx tokens, reading K and V once.
    flops = 4 * shape.heads * shape.head_dim * ctx
    moved = 2 * shape.kv_heads * shape.head_dim * ctx * b
    est.add("decode attention", flops / moved, "FLOP/B",
            f"4·{shape.heads}·{shape.head_dim}·{ctx} / (2·{shape.kv_heads}·{shape.head_dim}·{ctx} × {fmt_num(b)} B)"
            f" = 2·heads/kv_heads/bytes (batch-independent: each sequence has its own KV)")
    est.assumptions.append("each operand read once and the output written once (perfect on-chip reuse)")
    return est


def forward_flops_per_token(shape: ModelShape, context: int) -> float:
    """2·N (matmul weights, embedding excluded) + 4·L·heads·head_dim·context (QKᵀ and AV)."""
    n = shape.params(embedding=False) + (shape.embedding_params() if shape.tied else 0)  # tied head is a matmul
    return 2 * n + 4 * shape.layers * shape.heads * shape.head_dim * context


def weight_bytes(shape: ModelShape, dtype: str) -> float:
    """Bytes read per forward step: every weight except the embedding table (a lookup reads B rows)."""
    n = shape.params(embedding=False) + (shape.embedding_params() if shape.tied else 0)
    return n * dtype_bytes(dtype)


def roofline(shape: ModelShape | Any, device: Device | str | None = None, batch: int = 1, seq_len: int = 2048,
             dtype: str = "bfloat16", context: int | None = None) -> Estimate:
    """Ridge point (peak ÷ bandwidth), each phase's intensity, attainable FLOP/s = min(peak,
    intensity × bandwidth), and the prefill/decode bounds in tokens/s at `batch`."""
    shape = ModelShape.from_config(shape)
    dev = device_spec(device)
    peak, bw = dev.peak(dtype), dev.require_bandwidth()
    est = Estimate(f"roofline: {shape.name or 'model'} on {dev.name}, {dtype}, batch={batch}, seq_len={seq_len}")
    ridge = est.add("ridge point", peak / bw, "FLOP/B", f"{peak / 1e12:.4g} TFLOP/s / {bw / 1e12:.4g} TB/s [{dev.source}]")
    ctx = context or seq_len
    wbytes = weight_bytes(shape, dtype)
    # Prefill: batch·seq_len tokens share one read of the weights.
    tokens = batch * seq_len
    f_pre = forward_flops_per_token(shape, seq_len / 2) * tokens  # causal: average context T/2
    b_pre = wbytes + tokens * shape.kv_bytes_per_token(dtype)
    i_pre = est.add("prefill intensity", f_pre / b_pre, "FLOP/B",
                    f"{f_pre:.3g} FLOP / ({fmt_bytes(wbytes)} weights + {fmt_bytes(tokens * shape.kv_bytes_per_token(dtype))} KV written)")
    a_pre = est.add("prefill attainable", min(peak, i_pre * bw), "FLOP/s", f"min(peak, {i_pre:.4g} × {bw / 1e12:.4g} TB/s)")
    est.add("prefill bound", a_pre / (f_pre / tokens), "tok/s", f"{a_pre:.3g} FLOP/s / {f_pre / tokens:.3g} FLOP/token"
            + (" (compute-bound)" if i_pre >= ridge else " (memory-bound)"))
    # Decode: one token per sequence, weights read once per step, each sequence's KV read once.
    f_dec = forward_flops_per_token(shape, ctx) * batch
    b_dec = wbytes + batch * ctx * shape.kv_bytes_per_token(dtype)
    i_dec = est.add("decode intensity", f_dec / b_dec, "FLOP/B",
                    f"{f_dec:.3g} FLOP / ({fmt_bytes(wbytes)} weights + {batch}×{ctx} tokens × {fmt_bytes(shape.kv_bytes_per_token(dtype))} KV)")
    a_dec = est.add("decode attainable", min(peak, i_dec * bw), "FLOP/s", f"min(peak, {i_dec:.4g} × {bw / 1e12:.4g} TB/s)")
    est.add("decode bound", a_dec / (f_dec / batch), "tok/s", f"{a_dec:.3g} FLOP/s / {f_dec / batch:.3g} FLOP/token"
            + (" (compute-bound)" if i_dec >= ridge else " (memory-bound)"))
    # B·FLOP/token = ridge × (weights + B·ctx·KV)  ⇒  B = ridge·weights / (FLOP/token − ridge·ctx·KV)
    per_seq_bytes = ctx * shape.kv_bytes_per_token(dtype)
    fpt = forward_flops_per_token(shape, ctx)
    est.add("decode batch at ridge", ridge * wbytes / (fpt - ridge * per_seq_bytes) if fpt > ridge * per_seq_bytes
            else math.inf, "", "B = ridge × weights / (FLOP/token − ridge × ctx × KV/token): above it decode is "
            "compute-bound" + ("" if fpt > ridge * per_seq_bytes else
                               "; inf: reading each sequence's own KV keeps decode below the ridge at any batch"))
    est.assumptions.append("weights read once per forward step; the embedding lookup reads only B rows")
    return est


def throughput(shape: ModelShape | Any, device: Device | str | None = None, batch: int = 1, context: int = 1024,
               dtype: str = "bfloat16", weight_dtype: str | None = None) -> Estimate:
    """Decode ceiling: tokens/s ≤ bandwidth ÷ bytes read per step × batch (weights once + each
    sequence's KV), and the compute ceiling peak ÷ FLOP per token; the smaller one binds."""
    shape = ModelShape.from_config(shape)
    dev = device_spec(device)
    bw = dev.require_bandwidth()
    wbytes = weight_bytes(shape, weight_dtype or dtype)
    kv = batch * context * shape.kv_bytes_per_token(dtype)
    est = Estimate(f"decode throughput ceiling: {shape.name or 'model'} on {dev.name}, batch={batch}, context={context}")
    step = est.add("bytes per step", wbytes + kv, "B", f"weights {fmt_bytes(wbytes)} + KV {batch}×{context}×{fmt_bytes(shape.kv_bytes_per_token(dtype))}")
    mem_ceiling = est.add("memory ceiling", bw / step * batch, "tok/s", f"{bw / 1e9:.4g} GB/s / {fmt_bytes(step)} × {batch} [{dev.source}]")
    fpt = forward_flops_per_token(shape, context)
    try:
        peak = dev.peak(dtype)
        compute = est.add("compute ceiling", peak / fpt, "tok/s", f"{peak / 1e12:.4g} TFLOP/s / {fpt:.3g} FLOP/token")
    except ValueError:
        compute = math.inf
    est.add("ceiling", min(mem_ceiling, compute), "tok/s", "min(memory, compute)")
    est.add("step time floor", step / bw, "s", f"{fmt_bytes(step)} / {bw / 1e9:.4g} GB/s")
    return est


def decode_ceiling(model: Any, device: Device | str | None = None, batch: int = 1, context: int = 1024,
                   dtype: str = "bfloat16") -> float:
    """The bandwidth ceiling of decode: bandwidth ÷ bytes read per step × batch, in tokens/s.
    For `bench engine`: `100 * measured / decode_ceiling(model_dir, "cpu", batch, ctx)` is decode
    as a percentage of it. Memory only, on purpose: the compute term uses torch's matmul peak,
    which the engine's own kernels can beat (on a CPU without bf16 instructions by far); and a
    model whose weights and KV fit in the caches is not bound by DRAM at all (then the
    percentage is small and says so)."""
    return throughput(model, device, batch, context, dtype)["memory ceiling"]


def mfu_estimate(shape: ModelShape | Any, tokens_per_s: float, device: Device | str | None = None,
                 seq_len: int = 2048, dtype: str = "bfloat16", training: bool = True, n_devices: int = 1) -> Estimate:
    """MFU = FLOP/token × tokens/s ÷ (peak × devices), with the training formula 6·N + 12·L·H·Q·T
    (`perf/mfu.py`) or, for inference, 2·N + 4·L·H·Q·T. Above 100% is an error naming the formula."""
    shape = ModelShape.from_config(shape)
    dev = device_spec(device)
    peak = dev.peak(dtype) * n_devices
    n = shape.params(embedding=False)
    est = Estimate(f"mfu: {shape.name or 'model'} on {n_devices}× {dev.name}, {dtype}, {tokens_per_s:g} tok/s")
    if training:
        fpt = est.add("FLOP per token", flops_per_token(n, shape.layers, shape.heads, shape.head_dim, seq_len), "FLOP",
                      f"6·{fmt_num(n)} + 12·{shape.layers}·{shape.heads}·{shape.head_dim}·{seq_len} (PaLM appendix B)")
    else:
        fpt = est.add("FLOP per token", 2 * n + 4 * shape.layers * shape.heads * shape.head_dim * seq_len, "FLOP",
                      f"2·{fmt_num(n)} + 4·{shape.layers}·{shape.heads}·{shape.head_dim}·{seq_len}")
    est.add("peak", peak, "FLOP/s", f"{n_devices} × {dev.peak(dtype) / 1e12:.4g} TFLOP/s {dtype} [{dev.source}]")
    est.add("achieved", fpt * tokens_per_s, "FLOP/s", f"{fpt:.3g} × {tokens_per_s:g} tok/s")
    est.add("mfu", mfu(fpt, tokens_per_s, peak), "%", f"{fpt * tokens_per_s:.3g} / {peak:.3g}")
    return est


# ---- communication ---------------------------------------------------------------------------


def _ring(n: int, bytes_: float, factor: float) -> float:
    """Bytes each device sends in a ring collective over `n` devices: factor·(n−1)/n · bytes
    (all-reduce: factor 2 = reduce-scatter + all-gather; all-gather or reduce-scatter: 1)."""
    return factor * (n - 1) / n * bytes_ if n > 1 else 0.0


def dp_allreduce(shape: ModelShape | Any, n: int, bandwidth: float, dtype: str = "float32",
                 trainable: float | None = None) -> tuple[float, float]:
    """(bytes sent per device, seconds) of one gradient all-reduce over `n` data-parallel ranks:
    2·(n−1)/n · params · bytes, at `bandwidth` bytes/s per device (bus bandwidth)."""
    shape = ModelShape.from_config(shape)
    sent = _ring(n, (trainable if trainable is not None else shape.params()) * dtype_bytes(dtype), 2)
    return sent, sent / bandwidth


def fsdp_traffic(shape: ModelShape | Any, n: int, bandwidth: float, dtype: str = "bfloat16") -> tuple[float, float]:
    """(bytes, seconds) per step of FSDP/ZeRO-3: all-gather the weights in forward and again in
    backward, reduce-scatter the gradients: 3·(n−1)/n · params · bytes (1.5× DDP's all-reduce)."""
    shape = ModelShape.from_config(shape)
    sent = _ring(n, shape.params() * dtype_bytes(dtype), 3)
    return sent, sent / bandwidth


def tp_allreduce(shape: ModelShape | Any, t: int, batch: int, seq_len: int, bandwidth: float,
                 dtype: str = "bfloat16", training: bool = True) -> tuple[float, float]:
    """(bytes, seconds) per step of Megatron tensor parallelism: two all-reduces of the
    (batch·seq_len × hidden) activations per layer in forward (after attention, after the MLP)
    and two more in backward; each sends 2·(t−1)/t of its size. The volume depends on the
    activations, not on t (beyond the (t−1)/t factor): why TP stays inside a node."""
    shape = ModelShape.from_config(shape)
    size = batch * seq_len * shape.hidden * dtype_bytes(dtype)
    count = (4 if training else 2) * shape.layers
    sent = count * _ring(t, size, 2)
    return sent, sent / bandwidth


def pp_sends(shape: ModelShape | Any, p: int, batch: int, seq_len: int, microbatches: int, bandwidth: float,
             dtype: str = "bfloat16", training: bool = True) -> tuple[float, float]:
    """(bytes, seconds) per step a pipeline stage sends: each micro-batch's activations
    (batch·seq_len × hidden) forward to the next stage and their gradient back, for each of the
    `microbatches` (point-to-point, no ring factor). `batch` is the micro-batch size."""
    shape = ModelShape.from_config(shape)
    if p <= 1:
        return 0.0, 0.0
    size = batch * seq_len * shape.hidden * dtype_bytes(dtype)
    sent = size * microbatches * (2 if training else 1)
    return sent, sent / bandwidth


def pipeline_bubble(p: int, microbatches: int) -> float:
    """Idle fraction of a 1F1B/GPipe schedule: (p−1)/(m+p−1) (Narayanan et al. 2021)."""
    return (p - 1) / (microbatches + p - 1)


def comm(shape: ModelShape | Any, dp: int = 1, tp: int = 1, pp: int = 1, batch: int = 1, seq_len: int = 2048,
         microbatches: int = 1, bandwidth: float | None = None, device: Device | str | None = None,
         grad_dtype: str = "float32", act_dtype: str = "bfloat16", fsdp: bool = False,
         inter_bandwidth: float | None = None) -> Estimate:
    """Per-step communication of a dp × tp × pp layout, bytes and seconds per device.

    `bandwidth` (bytes/s, per device, one direction) defaults to the device's interconnect from
    the datasheet table; `inter_bandwidth` (between nodes) is used for the DP and PP traffic when
    given, as those cross nodes first.
    """
    shape = ModelShape.from_config(shape)
    if bandwidth is None:
        dev = device_spec(device)
        if not dev.interconnect:
            raise ValueError(f"no interconnect bandwidth known for {dev.name}; pass --bandwidth in GB/s")
        bandwidth, src = dev.interconnect, f"{dev.name} interconnect [{dev.source}]"
    else:
        src = "given"
    outer = inter_bandwidth or bandwidth
    est = Estimate(f"communication per step: {shape.name or 'model'}, dp={dp} tp={tp} pp={pp}, "
                   f"micro-batch {batch}×{seq_len}, {microbatches} micro-batches")
    est.add("bandwidth", bandwidth, "B/s", src)
    shard_params = shape.params() / tp / pp  # each DP group reduces its own shard of the model
    sub = shape
    if dp > 1:
        if fsdp:
            b, s = fsdp_traffic(sub, dp, outer, act_dtype)
            b, s = b / tp / pp, s / tp / pp
            est.add("FSDP bytes", b, "B", f"3·({dp}−1)/{dp} × {fmt_num(shard_params)} params × {fmt_num(dtype_bytes(act_dtype))} B")
        else:
            b, s = dp_allreduce(sub, dp, outer, grad_dtype, trainable=shard_params)
            est.add("DP all-reduce bytes", b, "B", f"2·({dp}−1)/{dp} × {fmt_num(shard_params)} params × {fmt_num(dtype_bytes(grad_dtype))} B ({grad_dtype} grads)")
        est.add("DP seconds", s, "s", f"{fmt_bytes(b)} / {outer / 1e9:.4g} GB/s")
    if tp > 1:
        tokens = batch * seq_len * microbatches
        b, s = tp_allreduce(shape, tp, tokens, 1, bandwidth, act_dtype)
        b, s = b / pp, s / pp
        est.add("TP all-reduce bytes", b, "B", f"4 × {math.ceil(shape.layers / pp)} layers × 2·({tp}−1)/{tp} × {fmt_num(tokens)} tokens × {shape.hidden} × {fmt_num(dtype_bytes(act_dtype))} B")
        est.add("TP seconds", s, "s", f"{fmt_bytes(b)} / {bandwidth / 1e9:.4g} GB/s")
    if pp > 1:
        b, s = pp_sends(shape, pp, batch, seq_len, microbatches, outer, act_dtype)
        est.add("PP send bytes", b, "B", f"{microbatches} micro-batches × 2 (act + grad) × {batch}·{seq_len}·{shape.hidden} × {fmt_num(dtype_bytes(act_dtype))} B")
        est.add("PP seconds", s, "s", f"{fmt_bytes(b)} / {outer / 1e9:.4g} GB/s")
        est.add("pipeline bubble", pipeline_bubble(pp, microbatches), "%", f"({pp}−1)/({microbatches}+{pp}−1)")
    est.add("total seconds", sum(t.value for t in est.terms if t.unit == "s"), "s", "sum (no overlap with compute)")
    est.assumptions += ["ring collectives at the stated per-device bandwidth; no overlap with compute",
                        "TP: Megatron column/row split, 2 all-reduces per layer forward, 2 backward"]
    return est


# ---- quantized sizes -------------------------------------------------------------------------


def quant_sizes(shape: ModelShape | Any, group_size: int = 128, scale_bytes: float = 2, zero_point: bool = False,
                keep_16bit_embeddings: bool = True) -> Estimate:
    """Weight bytes in bf16, int8 (one scale per output channel) and int4 (one scale per group
    of `group_size` weights, plus a zero point when asymmetric). Only the layers' matmuls are
    quantized; embeddings, LM head and norms stay 16-bit (as GPTQ/AWQ checkpoints keep them)."""
    shape = ModelShape.from_config(shape)
    est = Estimate(f"quantized sizes: {shape.name or 'model'}, int4 group {group_size}")
    lin = shape.linear_params()
    rest = shape.params() - lin
    rest_b = est.add("16-bit rest", rest * 2, "B", f"{fmt_num(rest)} params (embeddings, head, norms, biases) × 2 B")
    est.add("bf16 total", shape.params() * 2, "B", f"{fmt_num(shape.params())} × 2 B")
    rows = shape.layers * (shape.heads * shape.head_dim + 2 * shape.kv_heads * shape.head_dim + shape.hidden
                           + 2 * shape.intermediate + shape.hidden)  # output channels of every matmul
    i8 = lin * 1 + rows * scale_bytes
    est.add("int8 linears", i8, "B", f"{fmt_num(lin)} × 1 B + {fmt_num(rows)} channel scales × {fmt_num(scale_bytes)} B")
    est.add("int8 total", i8 + rest_b, "B", "int8 linears + 16-bit rest")
    per_group = scale_bytes * (2 if zero_point else 1)
    i4 = lin * 0.5 + lin / group_size * per_group
    est.add("int4 linears", i4, "B", f"{fmt_num(lin)} × 0.5 B + {fmt_num(lin)}/{group_size} groups × {fmt_num(per_group)} B"
            f" = {8 * i4 / lin:.3g} bits/weight")
    est.add("int4 total", i4 + rest_b, "B", "int4 linears + 16-bit rest")
    return est


# ---- devices ---------------------------------------------------------------------------------


@dataclass
class Device:
    """What the time-based calculators need from a device; each figure names its source."""

    name: str
    peaks: dict[str, float]  # dtype -> FLOP/s
    bandwidth: float | None  # memory bytes/s
    memory: float | None  # bytes
    interconnect: float | None = None  # bytes/s per device per direction (NVLink, or PCIe)
    source: str = ""
    kind: str = "cuda"

    def peak(self, dtype: str) -> float:
        d = hardware.canonical_dtype(dtype)
        if not self.peaks.get(d):
            raise ValueError(f"{self.name}: no {d} peak (known: {sorted(k for k, v in self.peaks.items() if v)}); "
                             f"run `lmforge doctor` or pick another dtype")
        return self.peaks[d]

    def require_bandwidth(self) -> float:
        if not self.bandwidth:
            raise ValueError(f"{self.name}: no memory bandwidth known; run `lmforge doctor` (it measures a "
                             f"STREAM-like copy/triad) or name a GPU from the datasheet table")
        return self.bandwidth


def device_spec(device: Device | str | None = None, profile: dict | None = None) -> Device:
    """A `Device` from a datasheet GPU name ("A100", "H100 SXM", "RTX 4090"), or "cpu"/"this"/None
    for this machine's `lmforge doctor` profile (measured peaks and bandwidth)."""
    if isinstance(device, Device):
        return device
    if device in (None, "", "this", "cpu", "local"):
        prof = profile if profile is not None else hardware.load_profile()
        if prof is None:
            raise ValueError(f"no hardware profile at {hardware.default_profile_path()}: run `lmforge doctor` "
                             f"once, or name a GPU ({', '.join(hardware.DATASHEET_TFLOPS)})")
        cpu = prof.get("devices", {}).get("cpu", {})
        bw = (cpu.get("mem_bandwidth") or {}).get("triad")
        return Device(name=cpu.get("name", "cpu"), peaks=dict(cpu.get("peak_flops", {})), bandwidth=bw,
                      memory=cpu.get("memory_bytes"), source="measured by `lmforge doctor`", kind="cpu")
    spec = hardware.datasheet_spec(str(device))
    if spec is None:
        raise ValueError(f"unknown device {device!r}: use 'cpu' (this machine's doctor profile) or one of "
                         f"{', '.join(hardware.DATASHEET_TFLOPS)}")
    return Device(**spec)


def main() -> None:  # python -m lmforge.perf.estimate [MODEL]
    model = sys.argv[1] if len(sys.argv) > 1 else "llama-7b"
    for mode, kw in (("full", {}), ("lora", {"batch": 4, "grad_ckpt": True}), ("inference", {"quant_bits": 4, "seq_len": 4096})):
        print(memory(model, mode=mode, **kw).to_text(), end="\n\n")


if __name__ == "__main__":
    main()
