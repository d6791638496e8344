"""Quantized expert weights: the formats, their numerics, and the plain reference.

    from moeroute.quant import QuantConfig, quantize_experts

`QuantConfig` names a format ("fp8_block": DeepSeek-V3's block-scaled float8_e4m3fn;
"fp8_tensor": one scale per expert and projection; "mxfp4": gpt-oss's 4-bit e2m1 blocks of
32 with a power-of-two scale byte; "int4": 4-bit integers with a scale and zero point per
group of 32/64/128 input columns, as compressed-tensors, GPTQ and AWQ checkpoints ship them)
and how activations are quantized around it. `moeroute.quant.fp8`, `moeroute.quant.mxfp4`
and `moeroute.quant.int4` quantize and dequantize torch tensors (CPU or CUDA);
`moeroute.quant.int4_checkpoint` unpacks INT4 checkpoint tensors into moeroute's layout;
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
from moeroute.quant.int4 import INT4_GROUP_SIZES, check_int4, dequantize_int4, quantize_int4
from moeroute.quant.int4_checkpoint import (
    Int4Weight,
    fold_act_order,
    pack_awq,
    pack_compressed_tensors,
    pack_gptq,
    pack_int4_checkpoint,
    unpack_awq,
    unpack_compressed_tensors,
    unpack_gptq,
    unpack_int4_checkpoint,
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
    "INT4_GROUP_SIZES",
    "quantize_int4",
    "dequantize_int4",
    "check_int4",
    "Int4Weight",
    "fold_act_order",
    "pack_compressed_tensors",
    "pack_gptq",
    "pack_awq",
    "pack_int4_checkpoint",
    "unpack_compressed_tensors",
    "unpack_gptq",
    "unpack_awq",
    "unpack_int4_checkpoint",
]
