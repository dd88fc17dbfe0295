"""Quantized weights for the decoder layers' linear modules: `int8_wo`, `int4_wo`, `int4_awq` and `fp8`.

`formats` says how a weight is stored and holds the torch reference of (de)quantizing it; `kernels` runs the
products (fused Triton kernels on CUDA, dequantize + `F.linear` elsewhere); `linear.QuantLinear` is the module the
decoder builds; `calibrate` searches AWQ's activation-aware scales; `convert` quantizes a decoder's weights at export.
"""

from .formats import QUANTIZED_LINEARS, QuantLayout, dequantize, quantize
from .linear import QuantLinear

__all__ = ["QUANTIZED_LINEARS", "QuantLayout", "QuantLinear", "dequantize", "quantize"]
