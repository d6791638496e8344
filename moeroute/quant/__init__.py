"""Quantized expert weights: the formats, their numerics, and the plain reference.

    from moeroute.quant import QuantConfig, quantize_experts

`QuantConfig` names a format ("fp8_block": DeepSeek-V3's block-scaled float8_e4m3fn;
"fp8_tensor": one scale per expert and projection) and how activations are quantized
around it. `moeroute.quant.fp8` quantizes and dequantizes torch tensors (CPU or CUDA);
`moeroute.quant.reference` holds the w8a8 expert MLP the tests compare every backend
against. docs/quant.md writes the formulas down.
"""

from moeroute.quant.config import ACTIVATION_SCHEMES, FORMATS, SCALE_FORMATS, QuantConfig
from moeroute.quant.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    check_scale,
    dequantize_experts,
    dequantize_fp8_block,
    dequantize_fp8_tensor,
    quantize_experts,
    quantize_fp8_activations,
    quantize_fp8_block,
    quantize_fp8_static,
    quantize_fp8_tensor,
)

__all__ = [
    "QuantConfig",
    "FORMATS",
    "ACTIVATION_SCHEMES",
    "SCALE_FORMATS",
    "FP8_DTYPE",
    "FP8_MAX",
    "quantize_fp8_block",
    "dequantize_fp8_block",
    "quantize_fp8_tensor",
    "dequantize_fp8_tensor",
    "quantize_fp8_activations",
    "quantize_fp8_static",
    "quantize_experts",
    "dequantize_experts",
    "check_scale",
]
