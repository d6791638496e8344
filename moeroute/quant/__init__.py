"""Quantized expert weights: the formats, their numerics, and the plain reference.

    from moeroute.quant import QuantConfig, quantize_experts

`QuantConfig` names a format ("fp8_block": DeepSeek-V3's block-scaled float8_e4m3fn;
"fp8_tensor": one scale per expert and projection; "mxfp4": gpt-oss's 4-bit e2m1 blocks of
32 with a power-of-two scale byte) and how activations are quantized around it.
`moeroute.quant.fp8` and `moeroute.quant.mxfp4` quantize and dequantize torch tensors (CPU or CUDA);
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
from moeroute.quant.mxfp4 import E2M1_VALUES, check_mxfp4, dequantize_mxfp4, quantize_mxfp4

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
    "E2M1_VALUES",
    "quantize_mxfp4",
    "dequantize_mxfp4",
    "check_mxfp4",
]
