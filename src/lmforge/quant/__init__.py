"""Weight-only quantization (W8A16, W4A16) and its checkpoint formats.

    lmforge quantize models/tiny --scheme w4a16 --group-size 128 --out models/tiny-w4a16
    from lmforge.quant import QuantScheme, quantize_rtn, dequantize, pack_int32
    from lmforge.quant import load_pretrained      # a checkpoint folder, quantized or not

`scheme` holds the math (RTN, scales, int32 packing), `compressed_tensors` the layout `transformers`
and vLLM read, `quantize` the verb, `linear` the layers a quantized checkpoint loads into and the
engine's linear backends, `load` the loader every caller uses for a folder that may be quantized.
This package knows nothing about scheduling, serving or training loops.
"""

from .load import load_pretrained
from .scheme import (QuantScheme, dequantize, pack_int32, quantize_rtn, scale_groups_, scratch, unpack_int32,
                     unpack_int32_into)

__all__ = ["QuantScheme", "dequantize", "load_pretrained", "pack_int32", "quantize_rtn", "unpack_int32"]
