"""A Llama-family decoder in one file: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Module and parameter names are Hugging Face's (`model.layers.0.self_attn.q_proj.weight`), so a
checkpoint's state dict loads with no converter, and every operation follows `transformers`'
order (RMSNorm and RoPE tables in float32, then cast back) so logits agree to rounding error.
This file knows nothing about training loops, quantization or KV-cache paging: the attention math is a
pluggable `attn` callable. The default (`DenseAttention`) attends causally within the batch
row, optionally masked per document for packed rows; the inference engine passes its own paged
implementation with the same signature.

Shape legend: B batch, T tokens, D hidden, N query heads, K key/value heads, H head dim,
F MLP hidden, V vocabulary.
"""

from __future__ import annotations

import contextlib

import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from . import checkpoint
from .config import ModelConfig

# attn(layer_idx, q_BTNH, k_BTKH, v_BTKH) -> out_BTNH
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 as `transformers` does (Zhang & Sennrich 2019)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (H/2,) of RoPE (Su et al. 2021), with Llama 3's frequency-dependent scaling."""
    H = config.head_dim
    exponent = torch.arange(0, H, 2, dtype=torch.int64, device="cpu").float() / H
    inv_freq = 1.0 / (config.rope_theta ** exponent)
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") != "llama3":
        return inv_freq
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate in between.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given positions. `inv_freq` is a plain float32 tensor, not a buffer, so
    `model.to(bfloat16)` cannot round it (the angles of late positions would drift)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.inv_freq = rope_inv_freq(config)

    def forward(self, position_ids_BT: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != position_ids_BT.device:
            self.inv_freq = self.inv_freq.to(position_ids_BT.device)
        freqs_BTh = position_ids_BT[..., None].float() * self.inv_freq
        emb_BTH = torch.cat((freqs_BTh, freqs_BTh), dim=-1)
        return emb_BTH.cos().to(dtype), emb_BTH.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x_BTNH: torch.Tensor, cos_BTH: torch.Tensor, sin_BTH: torch.Tensor) -> torch.Tensor:
    cos, sin = cos_BTH.unsqueeze(2), sin_BTH.unsqueeze(2)  # broadcast over heads
    return x_BTNH * cos + rotate_half(x_BTNH) * sin


class DenseAttention:
    """Causal SDPA over the row; with `doc_ids_BT`, tokens attend only within their document."""

    def __init__(self, doc_ids_BT: torch.Tensor | None = None):
        self.mask_B1TT = None
        if doc_ids_BT is not None:
            T = doc_ids_BT.shape[1]
            causal_TT = torch.ones(T, T, dtype=torch.bool, device=doc_ids_BT.device).tril()
            same_doc_BTT = doc_ids_BT[:, :, None] == doc_ids_BT[:, None, :]
            self.mask_B1TT = (same_doc_BTT & causal_TT).unsqueeze(1)

    def __call__(self, layer_idx: int, q_BTNH, k_BTKH, v_BTKH) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q_BTNH, k_BTKH, v_BTKH))  # (B, heads, T, H)
        gqa = q.shape[1] != k.shape[1]
        if self.mask_B1TT is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask_B1TT, enable_gqa=gqa)
        return out.transpose(1, 2)  # (B, T, N, H)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        D, N, K, H = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.layer_idx, self.n_heads, self.n_kv_heads, self.head_dim = layer_idx, N, K, H
        self.q_proj = nn.Linear(D, N * H, bias=config.qkv_bias)
        self.k_proj = nn.Linear(D, K * H, bias=config.qkv_bias)
        self.v_proj = nn.Linear(D, K * H, bias=config.qkv_bias)
        self.o_proj = nn.Linear(N * H, D, bias=config.o_bias)
        if config.qk_norm:  # Qwen3: RMSNorm over each head's vector, before RoPE
            self.q_norm = RMSNorm(H, config.rms_norm_eps)
            self.k_norm = RMSNorm(H, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x_BTD: torch.Tensor, cos_BTH, sin_BTH, attn: AttentionFn) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q_BTNH, k_BTKH, v_BTKH = self.project(x_BTD)
        if self.q_norm is not None:
            q_BTNH, k_BTKH = self.q_norm(q_BTNH), self.k_norm(k_BTKH)
        q_BTNH, k_BTKH = self.rope(q_BTNH, k_BTKH, cos_BTH, sin_BTH)
        out_BTNH = attn(self.layer_idx, q_BTNH, k_BTKH, v_BTKH)
        return self.o_proj(out_BTNH.reshape(B, T, -1))

    def project(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, T, N, H), k and v (B, T, K, H) (the inference engine overrides this one step: one fused
        q/k/v matmul)."""
        B, T, _ = x_BTD.shape
        return (self.q_proj(x_BTD).view(B, T, self.n_heads, self.head_dim),
                self.k_proj(x_BTD).view(B, T, self.n_kv_heads, self.head_dim),
                self.v_proj(x_BTD).view(B, T, self.n_kv_heads, self.head_dim))

    def rope(self, q_BTNH, k_BTKH, cos_BTH, sin_BTH) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on q and k (the inference engine's CPU kernels override this one step)."""
        return apply_rope(q_BTNH, cos_BTH, sin_BTH), apply_rope(k_BTKH, cos_BTH, sin_BTH)


class MLP(nn.Module):
    """SwiGLU (Shazeer 2020): down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        D, Fh, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(D, Fh, bias=bias)
        self.up_proj = nn.Linear(D, Fh, bias=bias)
        self.down_proj = nn.Linear(Fh, D, bias=bias)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x_BTD)) * self.up_proj(x_BTD))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x_BTD, cos_BTH, sin_BTH, attn: AttentionFn) -> torch.Tensor:
        x_BTD = x_BTD + self.self_attn(self.input_layernorm(x_BTD), cos_BTH, sin_BTH, attn)
        return x_BTD + self.mlp(self.post_attention_layernorm(x_BTD))


class Backbone(nn.Module):
    """Embeddings, decoder layers and the final norm: `model.*` in HF's checkpoint names."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        self.gradient_checkpointing = False

    def forward(self, input_ids_BT, position_ids_BT, attn: AttentionFn) -> torch.Tensor:
        x_BTD = self.embed_tokens(input_ids_BT)
        cos_BTH, sin_BTH = self.rotary_emb(position_ids_BT, x_BTD.dtype)
        return self.norm(self.run_layers(x_BTD, cos_BTH, sin_BTH, attn))

    def run_layers(self, x_BTD: torch.Tensor, cos_BTH, sin_BTH, attn: AttentionFn) -> torch.Tensor:
        """The decoder layers in order (the engine's C stack replaces this loop on a step it runs whole)."""
        for layer in self.layers:
            if self.gradient_checkpointing and self.training:
                x_BTD = torch.utils.checkpoint.checkpoint(layer, x_BTD, cos_BTH, sin_BTH, attn,
                                                          use_reentrant=False)
            else:
                x_BTD = layer(x_BTD, cos_BTH, sin_BTH, attn)
        return x_BTD


def positions_from_doc_ids(doc_ids_BT: torch.Tensor) -> torch.Tensor:
    """Position of each token within its document, for packed rows (documents are contiguous)."""
    B, T = doc_ids_BT.shape
    idx_BT = torch.arange(T, device=doc_ids_BT.device).expand(B, T)
    starts_BT = torch.ones_like(doc_ids_BT, dtype=torch.bool)
    starts_BT[:, 1:] = doc_ids_BT[:, 1:] != doc_ids_BT[:, :-1]
    # index of the most recent document start at or before each token
    start_idx_BT = torch.where(starts_BT, idx_BT, torch.zeros_like(idx_BT)).cummax(dim=1).values
    return idx_BT - start_idx_BT


@contextlib.contextmanager
def _skip_init():
    """torch.nn.init's in-place initialisers as no-ops for the block (modules built to be overwritten)."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "zeros_", "ones_")
    saved = {n: getattr(nn.init, n) for n in names}
    try:
        for n in names:
            setattr(nn.init, n, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for n, fn in saved.items():
            setattr(nn.init, n, fn)


class Transformer(nn.Module):
    """A Llama/Mistral/Qwen2/Qwen3 causal LM. `forward(input_ids)` returns logits (B, T, V)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None, attn: AttentionFn | None = None) -> torch.Tensor:
        """Logits (B, T, V). `doc_ids` (B, T): packed documents neither see each other nor share
        positions (positions restart at 0 per document unless `position_ids` is given)."""
        return self.lm_head(self.hidden_states(input_ids, position_ids, doc_ids, attn))

    def hidden_states(self, input_ids_BT, position_ids_BT=None, doc_ids_BT=None,
                      attn: AttentionFn | None = None) -> torch.Tensor:
        """Final normed hidden states (B, T, D); the engine applies `lm_head` to the rows it samples."""
        if position_ids_BT is None:
            if doc_ids_BT is not None:
                position_ids_BT = positions_from_doc_ids(doc_ids_BT)
            else:
                T = input_ids_BT.shape[1]
                position_ids_BT = torch.arange(T, device=input_ids_BT.device).expand_as(input_ids_BT)
        return self.model(input_ids_BT, position_ids_BT, attn or DenseAttention(doc_ids_BT))

    # ---- construction ---------------------------------------------------------------------------

    def init_weights(self, seed: int | None = None) -> Transformer:
        """Normal(0, initializer_range) for linear and embedding weights, zeros for biases, ones for norms.
        The projections that write into the residual stream (`o_proj`, `down_proj`) get
        std / sqrt(2 * layers), so the stream's variance does not grow with depth (GPT-2, nanoGPT)."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        std = self.config.initializer_range
        residual_std = std / math.sqrt(2 * self.config.num_hidden_layers)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                s = residual_std if name.endswith(("o_proj", "down_proj")) else std
                with torch.no_grad():
                    module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * s)
                    if getattr(module, "bias", None) is not None:
                        module.bias.zero_()
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        return self

    def num_parameters(self, embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        table = self.model.embed_tokens
        return n if embedding or not hasattr(table, "weight") else n - table.weight.numel()

    @classmethod
    def on_meta(cls, config: ModelConfig) -> Transformer:
        """The module tree on the meta device with no initialisation run, for a loader that assigns every
        tensor next: torch initialises a meta embedding through its Python reference ops, which import
        `torch._dynamo` (1.4 s of a 2 s GGUF load)."""
        with torch.device("meta"), _skip_init():
            return cls(config)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: str | torch.dtype = "auto",
                        device: str | torch.device = "auto") -> Transformer:
        """Read a float LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM
        directory. A quantized one is refused, naming `lmforge.quant.load_pretrained`."""
        path = Path(path)
        hf = checkpoint.read_hf_config(path)
        config = ModelConfig.from_hf(hf)
        checkpoint.refuse_quantized(hf, path)
        torch_dtype = checkpoint.resolve_dtype(dtype, hf.get("torch_dtype") or hf.get("dtype"))
        model = cls.on_meta(config)
        state = checkpoint.read_weights(path, set(model.state_dict()), set(), checkpoint.resolve_device(device),
                                        torch_dtype)
        return checkpoint.assign_weights(model, state, path)

    def save_pretrained(self, path: str | Path, max_shard_bytes: int = 5 * 1024**3) -> Path:
        return checkpoint.save_pretrained(self, path, max_shard_bytes=max_shard_bytes)
