"""Model FLOPs utilisation: the share of the device's peak a training run actually spends on the model.

    flops_per_token = 6·N + 12·L·H·Q·T

(PaLM, Chowdhery et al. 2022, appendix B; the same estimate as nanoGPT's `estimate_mfu`).
6·N is forward (2·N) plus backward (4·N) for every weight used in a matmul; 12·L·H·Q·T is the
attention score and value matmuls (QKᵀ and AV), which have no weights. N excludes the token
embedding, because a lookup is not a matmul. An *untied* LM head is a matmul with its own
weights and counts in N; with tied embeddings the head's matmul is not counted (the estimate
as specified; it makes MFU slightly conservative, by 6·d·V per token).
The attention term counts full T×T scores (no causal halving), as PaLM and nanoGPT do.

It knows nothing about devices (peaks come from `perf/hardware.py`) or training loops.

    python -c "from lmforge.perf.mfu import flops_per_token; print(flops_per_token(85e6, 12, 12, 64, 1024))"
"""

from __future__ import annotations

from typing import Any


def flops_per_token(n_params_non_embedding: float, n_layers: int, n_heads: int, head_dim: int,
                    seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) = 6·N + 12·L·H·Q·T."""
    return 6 * n_params_non_embedding + 12 * n_layers * n_heads * head_dim * seq_len


def non_embedding_params(config: Any) -> int:
    """N for a Llama-family config (HF attribute names): attention q,k,v,o + SwiGLU gate/up/down
    + two RMSNorms per layer, the final norm, and the LM head when it is not tied."""
    d, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads  # None in HF means MHA
    head_dim = getattr(config, "head_dim", None) or d // heads
    attention = d * heads * head_dim + 2 * d * kv_heads * head_dim + heads * head_dim * d  # q, k+v, o
    mlp = 3 * d * config.intermediate_size  # gate, up, down
    norms = 2 * d  # input and post-attention RMSNorm weights
    n = layers * (attention + mlp + norms) + d  # + final norm
    if not getattr(config, "tie_word_embeddings", False):
        n += d * config.vocab_size  # untied LM head
    return n


def model_flops_per_token(config: Any, seq_len: int) -> float:
    """`flops_per_token` for a Llama-family config at context length `seq_len`."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return flops_per_token(non_embedding_params(config), config.num_hidden_layers,
                           config.num_attention_heads, head_dim, seq_len)


def mfu(flops_per_token: float, tokens_per_s: float, peak: float) -> float:
    """Achieved model FLOP/s over the device peak, in [0, 1].

    An MFU above 100% is an error, not a figure: the token count, the timing or the peak is
    wrong (a CPU profile used for a GPU run, fp32 peak for a bf16 run, tokens counted twice...).
    """
    if peak <= 0:
        raise ValueError(f"peak must be > 0 FLOP/s, got {peak}; run `lmforge doctor` to measure it")
    if flops_per_token < 0 or tokens_per_s < 0:
        raise ValueError(f"flops_per_token and tokens_per_s must be >= 0, got {flops_per_token}, {tokens_per_s}")
    value = flops_per_token * tokens_per_s / peak
    if value > 1.0:
        raise ValueError(f"MFU = {value:.1%} > 100%: an MFU above 100% is an error, not a figure. "
                         f"{flops_per_token:.3g} FLOP/token × {tokens_per_s:.3g} token/s exceeds the peak "
                         f"{peak:.3g} FLOP/s; check the token count, the timing and which dtype's peak is used")
    return value
