"""Which weights of a checkpoint are quantized: the decoder projections, by their Hugging Face names.

Shared by the quantize verb (RTN) and GPTQ's calibration hooks. This module knows nothing about the
scheme's math, files or the model class: only parameter names.
"""

from __future__ import annotations

LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_quantizable(name: str) -> bool:
    """A decoder projection's weight (HF names): `model.layers.3.mlp.up_proj.weight`."""
    parts = name.split(".")
    return name.startswith("model.layers.") and len(parts) >= 3 and parts[-1] == "weight" and parts[-2] in LINEAR_NAMES
