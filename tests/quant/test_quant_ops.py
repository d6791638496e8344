"""torch.ops.moeroute.experts with FP8 weights and scales: values against the w8a8 reference,
opcheck (schema, fake kernel, AOT dispatch), and an FP8 layer under torch.compile."""

from __future__ import annotations

import functools

import pytest
import torch

from helpers.reference import randn
from moeroute.bindings.torch import MoE, ops
from moeroute.config import RouterConfig
from moeroute.quant import QuantConfig, quantize_experts
from moeroute.quant.reference import moe_experts_reference

H, I, L, T, K = 128, 80, 4, 6, 2


_randn = functools.partial(randn, scale=0.1)


def _args(quant):
    q_gu, s_gu, q_d, s_d = quantize_experts(_randn(L, 2 * I, H, seed=0), _randn(L, H, I, seed=1), quant)
    x = _randn(T, H, seed=2, scale=1.0)
    ids = torch.tensor([[0, 3], [1, -1], [2, 2], [3, 0], [1, 2], [5, 0]], dtype=torch.int32)
    weights = torch.rand(T, K, generator=torch.Generator().manual_seed(3))
    kwargs = dict(gate_up_scale=s_gu, down_scale=s_d, quant_format=quant.format,
                  block_size=None if quant.block_size is None else list(quant.block_size))
    return (x, q_gu, q_d, ids, weights), kwargs


@pytest.mark.parametrize("quant", [QuantConfig("fp8_block", block_size=(32, 64)), QuantConfig("fp8_tensor")])
def test_experts_op_values_and_opcheck(quant):
    args, kwargs = _args(quant)
    out = torch.ops.moeroute.experts(*args, **kwargs)
    x, q_gu, q_d, ids, weights = args
    expected = moe_experts_reference(x, ids.long(), weights, q_gu, kwargs["gate_up_scale"], q_d,
                                     kwargs["down_scale"], quant.block_size)
    assert float((out - expected).abs().max() / expected.abs().max()) < 1e-4
    # opcheck's schema test compares inputs before and after with arithmetic torch lacks for
    # float8 on the CPU ("mul_cpu_reduced_float"); the fake-tensor and AOT tests run.
    results = torch.library.opcheck(ops.OPS["experts"], args, kwargs,
                                    test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    assert set(results.values()) == {"SUCCESS"}, results


def test_experts_op_errors():
    quant = QuantConfig("fp8_block", block_size=(32, 64))
    args, kwargs = _args(quant)
    with pytest.raises(ValueError, match="gate_up_scale has shape"):
        torch.ops.moeroute.experts(*args, **{**kwargs, "gate_up_scale": kwargs["gate_up_scale"][:, :1]})
    with pytest.raises(ValueError, match="down_scale is missing"):
        torch.ops.moeroute.experts(*args, **{**kwargs, "down_scale": None})
    with pytest.raises(ValueError, match="format='fp9'"):
        torch.ops.moeroute.experts(*args, **{**kwargs, "quant_format": "fp9"})


def test_fp8_layer_compiles_fullgraph():
    module = MoE(RouterConfig(L, K), H, I, quant=QuantConfig("fp8_block", block_size=(32, 64)))
    q_gu, s_gu, q_d, s_d = quantize_experts(_randn(L, 2 * I, H, seed=0), _randn(L, H, I, seed=1), module.quant)
    module.load_routed_weights(q_gu, q_d, gate_up_scale=s_gu, down_scale=s_d)
    x = _randn(T, H, seed=4, scale=1.0).bfloat16()
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        assert torch.equal(compiled(x), module(x))
