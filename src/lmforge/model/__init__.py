"""The Llama-family transformer and its Hugging Face checkpoint I/O.

    from lmforge.model import Transformer, ModelConfig
    model = Transformer.from_pretrained("path/to/hf-dir", dtype="bfloat16", device="auto")
    logits = model(input_ids)                      # (B, T, V)
    model.save_pretrained("out/")                  # loads in transformers.AutoModelForCausalLM

A quantized folder loads with `lmforge.quant.load_pretrained` (quantization sits above the model). This
package imports nothing above it.
"""

from .checkpoint import resolve_device, resolve_dtype, save_pretrained
from .config import ModelConfig, UnsupportedConfigError
from .transformer import DenseAttention, Transformer, positions_from_doc_ids

__all__ = ["DenseAttention", "ModelConfig", "Transformer", "UnsupportedConfigError",
           "positions_from_doc_ids", "resolve_device", "resolve_dtype", "save_pretrained"]
