"""INT4 scales held in their own dtype: the CPU kernels read bfloat16 and float16 scales as
the layer holds them (no float32 copy), on every instruction-set path this CPU runs, and the
layer keeps the dtype its scales are loaded in.

The reference is moeroute.quant.reference's float64 layer on the same packed integers and
scales. Bound (max abs diff / max abs reference): 1e-2 with bfloat16 activations (the output
and the intermediate rounded to bfloat16), 1e-5 with float32 ones.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch

from helpers.isa import on_avx2
from helpers.reference import randn, rel_error
from moeroute.bindings.torch import MoE
from moeroute.config import RouterConfig
from moeroute.experts.cpu import mxfp4 as cpu_mxfp4
from moeroute.experts.formats.int4 import int4_experts_forward, kernel_params
from moeroute.quant import QuantConfig, quantize_int4
from moeroute.quant.reference import int4_moe_experts_reference

H, I, N, K = 256, 128, 8, 2
RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _weights(group, scale_dtype, seed):
    gate_up = quantize_int4(randn(N, 2 * I, H, seed=seed, scale=0.1), group_size=group, scale_dtype=scale_dtype)
    down = quantize_int4(randn(N, H, I, seed=seed + 1, scale=0.1), group_size=group, scale_dtype=scale_dtype)
    return gate_up, down


def _path_errors() -> dict:
    """Relative error against the reference of symmetric INT4 experts with 16-bit scales, per
    scale dtype, group, activation dtype and row count."""
    errors = {}
    for scale_dtype in (torch.bfloat16, torch.float16):
        for group in (32, 64, 128):
            gate_up, down = _weights(group, scale_dtype, seed=group)
            for dtype in (torch.bfloat16, torch.float32):
                for tokens in (1, 8):
                    gen = torch.Generator().manual_seed(tokens)
                    ids = torch.randint(0, N, (tokens, K), generator=gen, dtype=torch.int32)
                    weights = torch.rand(tokens, K, generator=gen)
                    x = randn(tokens, H, seed=tokens + group).to(dtype)
                    out = int4_experts_forward(x, weights, ids, gate_up, down, group, strategy="rows")
                    expected = int4_moe_experts_reference(
                        x.float(), weights, ids, gate_up, down, group, intermediate_dtype=dtype
                    )
                    errors[f"{scale_dtype} g={group} {dtype} T={tokens}"] = (
                        rel_error(out.float(), expected),
                        str(dtype),
                    )
    return {"simd": bool(cpu_mxfp4.SIMD), "errors": errors}


@pytest.mark.slow
def test_16_bit_scales_on_every_cpu_path_match_the_reference():
    """The default path (the bfloat16-dot tiles where the CPU has AVX512-BF16) and the AVX2 path
    (the float32 block dots) with bfloat16 and float16 scales read as held."""
    avx2 = on_avx2("quant.test_int4_scales", "_path_errors")
    failures = [
        f"{path} {case}: {error:.2e}"
        for path, report in (("default", _path_errors()), ("avx2", avx2))
        for case, (error, dtype) in report["errors"].items()
        if not error < RTOL[getattr(torch, dtype.split(".")[-1])]
    ]
    assert not failures, failures


@pytest.mark.skipif(not cpu_mxfp4.SIMD, reason="the generic path converts 16-bit scales to float32")
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernels_take_symmetric_scales_as_held(scale_dtype):
    scales = torch.rand(3, 4, 2).to(scale_dtype) + 0.5
    params = kernel_params(scales, None, [0, 2])
    assert params.shape == (3, 4, 1, 2) and np.shares_memory(params, scales.view(torch.uint8).numpy())
    if scale_dtype == torch.bfloat16:  # the bits: widened by a shift
        params = (params.astype(np.uint32) << 16).view(np.float32)
    elif scale_dtype == torch.float16:  # the bits, as int16
        params = params.view(np.float16)
    np.testing.assert_array_equal(params.astype(np.float32), scales.float().unsqueeze(2).numpy())


def test_layer_holds_the_scales_in_the_dtype_they_are_loaded_in():
    quant = QuantConfig("int4", group_size=32)
    module = MoE(RouterConfig(N, K, "softmax"), H, I, quant=quant)
    assert module.experts.gate_up_scale.dtype == torch.bfloat16  # quantize_int4's default
    half = _weights(32, torch.float16, seed=3)
    module.load_routed_weights(*half)
    assert module.experts.gate_up_scale.dtype == torch.float16 and module.experts.down_scale.dtype == torch.float16
    assert torch.equal(module.experts.gate_up_scale, half[0][1]) and torch.equal(module.experts.down_scale, half[1][1])
    # float32 scales that float16 does not hold: the layer's scales become float32, values kept
    wide = _weights(32, torch.float32, seed=4)
    module.load_routed_weights(*wide)
    assert module.experts.down_scale.dtype == torch.float32 and torch.equal(module.experts.down_scale, wide[1][1])
    x = randn(5, H, seed=2)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [1, 6]], dtype=torch.int32)
    weights = torch.rand(5, K, generator=torch.Generator().manual_seed(0))
    out = int4_experts_forward(x, weights, ids, *wide, 32)
    expected = int4_moe_experts_reference(x, weights, ids, *wide, 32)
    assert rel_error(out, expected) < RTOL[torch.float32]
    # a state dict carries the dtype: a fresh layer loads it as it is
    other = MoE(RouterConfig(N, K, "softmax"), H, I, quant=quant)
    other.load_state_dict(module.state_dict())
    assert other.experts.down_scale.dtype == torch.float32
    assert torch.equal(other.experts.down_scale, module.experts.down_scale)
