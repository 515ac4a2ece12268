"""Tiny random `transformers` models, our reference for parity checks (tests, demo, benchmarks).

Built offline from a config: nothing is downloaded. Biases and norm weights are randomized too,
so a tensor that a converter forgets shows up in the logits. This module imports
`transformers` lazily and knows nothing about training or serving.

    hf = make_hf_model("qwen3")                  # transformers.Qwen3ForCausalLM, random weights
    save_hf_model("llama", "/tmp/tiny-llama")     # the same, saved in HF layout
"""

from __future__ import annotations

from pathlib import Path

import torch

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

# name -> (transformers config class, kwargs). Together they cover GQA, tied embeddings, Qwen2
# bias, Qwen3 q/k-norm with an explicit head_dim, and Llama-3 RoPE scaling.
VARIANTS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
    "llama3-rope": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
                                        rope_scaling=LLAMA3_ROPE, rope_theta=500000.0)),
    "llama-bias": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4, attention_bias=True,
                                       mlp_bias=True)),
    "mistral": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                  tie_word_embeddings=True)),
}


def hf_config(variant: str, vocab_size: int = 256, hidden_size: int = 64, layers: int = 2, **over):
    """A `transformers` config of one variant; keyword arguments override any field."""
    import transformers  # deferred: seconds to import; the benchmarks import this module, and the CLI them

    cls_name, kw = VARIANTS[variant]
    kw = {**dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                 num_hidden_layers=layers, max_position_embeddings=512, rms_norm_eps=1e-6,
                 bos_token_id=1, eos_token_id=2, pad_token_id=0), **kw, **over}
    return getattr(transformers, cls_name)(**kw)


def make_hf_model(variant: str, seed: int = 0, dtype: torch.dtype = torch.float32, **over):
    """A random HF model; biases and norms randomized too, so a missed tensor shows in the logits."""
    import transformers  # deferred: as in hf_config

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(variant, **over)).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def save_hf_model(variant: str, path: str | Path, seed: int = 0, dtype: torch.dtype = torch.float32,
                  **over) -> Path:
    return _save(make_hf_model(variant, seed=seed, dtype=dtype, **over), path)


def _save(model, path: str | Path) -> Path:
    from transformers.utils import logging as hf_logging  # deferred: as in hf_config

    hf_logging.disable_progress_bar()  # "Writing model shards" bars would flood test and demo output
    model.save_pretrained(path)
    return Path(path)
