"""torch.ops.moeroute.experts with FP8 weights and scales (values against the w8a8 reference),
with MXFP4 blocks and scale bytes and with INT4 packed nibbles, group scales and zero points
(values against a float64 dense layer on the same bytes decoded from the format's
definition): opcheck (schema, fake kernel, AOT dispatch), and
quantized layers under torch.compile."""

from __future__ import annotations

import functools

import pytest
import torch

from helpers.reference import dense_experts, dequantize_mxfp4, randn, rel_error
from moeroute.bindings.torch import MoE, ops
from moeroute.config import RouterConfig
from moeroute.quant import QuantConfig, quantize_experts, quantize_int4, quantize_mxfp4
from moeroute.quant.reference import int4_dequantize_reference, moe_experts_reference

H, I, L, T, K = 128, 80, 4, 6, 2


_randn = functools.partial(randn, scale=0.1)


def _args(quant):
    q_gu, s_gu, q_d, s_d = quantize_experts(_randn(L, 2 * I, H, seed=0), _randn(L, H, I, seed=1), quant)
    x = _randn(T, H, seed=2, scale=1.0)
    ids = torch.tensor([[0, 3], [1, -1], [2, 2], [3, 0], [1, 2], [5, 0]], dtype=torch.int32)
    weights = torch.rand(T, K, generator=torch.Generator().manual_seed(3))
    kwargs = dict(
        gate_up_scale=s_gu,
        down_scale=s_d,
        quant_format=quant.format,
        block_size=None if quant.block_size is None else list(quant.block_size),
    )
    return (x, q_gu, q_d, weights, ids), kwargs


@pytest.mark.parametrize("quant", [QuantConfig("fp8_block", block_size=(32, 64)), QuantConfig("fp8_tensor")])
def test_experts_op_values_and_opcheck(quant):
    args, kwargs = _args(quant)
    out = torch.ops.moeroute.experts(*args, **kwargs)
    x, q_gu, q_d, weights, ids = args
    expected = moe_experts_reference(
        x, weights, ids.long(), q_gu, kwargs["gate_up_scale"], q_d, kwargs["down_scale"], quant.block_size
    )
    assert float((out - expected).abs().max() / expected.abs().max()) < 1e-4
    # opcheck's schema test compares inputs before and after with arithmetic torch lacks for
    # float8 on the CPU ("mul_cpu_reduced_float"); the fake-tensor and AOT tests run.
    results = torch.library.opcheck(
        ops.OPS["experts"], args, kwargs, test_utils=("test_faketensor", "test_aot_dispatch_dynamic")
    )
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


MXFP4_I = 96  # MXFP4 packs 32 input columns per scale: I must be a multiple of 32


def _mxfp4_args(bias=True):
    gate_up, down = quantize_mxfp4(_randn(L, 2 * MXFP4_I, H, seed=5)), quantize_mxfp4(_randn(L, H, MXFP4_I, seed=6))
    x = _randn(T, H, seed=7, scale=1.0)
    ids = torch.tensor([[0, 3], [1, -1], [2, 2], [3, 0], [1, 2], [5, 0]], dtype=torch.int32)
    weights = torch.rand(T, K, generator=torch.Generator().manual_seed(8))
    kwargs = dict(gate_up_scale=gate_up[1], down_scale=down[1], quant_format="mxfp4")
    if bias:
        kwargs.update(b_gate_up=_randn(L, 2 * MXFP4_I, seed=9), b_down=_randn(L, H, seed=10))
    return (x, gate_up[0], down[0], weights, ids), kwargs


@pytest.mark.parametrize("gemm", ["auto", "rows", "blocks"])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_mxfp4_experts_op_values(gemm, dtype, tolerance):
    """The op on packed bytes equals a float64 dense layer on the decoded weights; slot ids
    outside [0, L) (-1, 5) add nothing."""
    (x, gu_blocks, d_blocks, weights, ids), kwargs = _mxfp4_args()
    out = torch.ops.moeroute.experts(x.to(dtype), gu_blocks, d_blocks, weights, ids, "swigluoai", gemm, **kwargs)
    expected = dense_experts(
        x.to(dtype).double(),
        weights,
        ids,
        dequantize_mxfp4(gu_blocks, kwargs["gate_up_scale"]),
        dequantize_mxfp4(d_blocks, kwargs["down_scale"]),
        "swigluoai",
        kwargs["b_gate_up"],
        kwargs["b_down"],
    )
    assert out.dtype == dtype
    assert rel_error(out, expected) < tolerance


def test_mxfp4_experts_op_opcheck():
    args, kwargs = _mxfp4_args()
    results = torch.library.opcheck(ops.OPS["experts"], args, {**kwargs, "activation": "swigluoai"})
    assert set(results.values()) == {"SUCCESS"}, results


def test_mxfp4_experts_op_errors():
    args, kwargs = _mxfp4_args()
    x, gu_blocks, d_blocks, weights, ids = args
    with pytest.raises(ValueError, match="not an MXFP4 strategy"):
        torch.ops.moeroute.experts(*args, gemm="padded", **kwargs)
    with pytest.raises(ValueError, match="w_gate_up scales has shape"):
        torch.ops.moeroute.experts(*args, **{**kwargs, "gate_up_scale": kwargs["gate_up_scale"][:, :1]})
    with pytest.raises(ValueError, match="w_down blocks has dtype torch.float32"):
        torch.ops.moeroute.experts(x, gu_blocks, d_blocks.float(), weights, ids, **kwargs)
    with pytest.raises(ValueError, match="blocks"):
        torch.ops.moeroute.experts(x, gu_blocks.flatten(-2), d_blocks, weights, ids, **kwargs)
    with pytest.raises(ValueError, match=r"b_down must be \[4, 128\]"):
        torch.ops.moeroute.experts(*args, **{**kwargs, "b_down": kwargs["b_down"][:, :64]})
    with pytest.raises(ValueError, match="activation"):
        torch.ops.moeroute.experts(*args, quant_activation="dynamic", **kwargs)
    with pytest.raises(ValueError, match="input_scale"):
        torch.ops.moeroute.experts(*args, input_scale=torch.ones(L, 2), **kwargs)


def test_mxfp4_experts_op_compiles_fullgraph():
    args, kwargs = _mxfp4_args()

    def layer(x, *rest):
        return torch.ops.moeroute.experts(x * 2, *rest, activation="swigluoai", **kwargs)

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(*args), layer(*args))


def test_mxfp4_layer_compiles_fullgraph():
    module = MoE(RouterConfig(L, K), H, MXFP4_I, activation="swigluoai", expert_bias=True, quant=QuantConfig("mxfp4"))
    (_, gu_blocks, d_blocks, _, _), kwargs = _mxfp4_args()
    module.load_routed_weights(
        (gu_blocks, kwargs["gate_up_scale"]),
        (d_blocks, kwargs["down_scale"]),
        gate_up_bias=kwargs["b_gate_up"],
        down_bias=kwargs["b_down"],
    )
    x = _randn(T, H, seed=11, scale=1.0).bfloat16()
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        assert torch.equal(compiled(x), module(x))


INT4_I = 128  # INT4 groups run along the input columns: H and I multiples of the group size


def _int4_args(group_size, symmetric):
    gate_up = quantize_int4(_randn(L, 2 * INT4_I, H, seed=12), group_size=group_size, symmetric=symmetric)
    down = quantize_int4(_randn(L, H, INT4_I, seed=13), group_size=group_size, symmetric=symmetric)
    x = _randn(T, H, seed=14, scale=1.0)
    ids = torch.tensor([[0, 3], [1, -1], [2, 2], [3, 0], [1, 2], [5, 0]], dtype=torch.int32)
    weights = torch.rand(T, K, generator=torch.Generator().manual_seed(15))
    kwargs = dict(
        gate_up_scale=gate_up[1], down_scale=down[1], quant_format="int4", group_size=group_size, symmetric=symmetric
    )
    if not symmetric:
        kwargs.update(gate_up_zero=gate_up[2], down_zero=down[2])
    return (x, gate_up[0], down[0], weights, ids), kwargs


def _int4_dense(packed, scales, zeros, group_size):
    """[L, N, K] float64 from the element-by-element reference decode."""
    return torch.stack(
        [
            int4_dequantize_reference(packed[e], scales[e], None if zeros is None else zeros[e], group_size)
            for e in range(packed.shape[0])
        ]
    )


@pytest.mark.parametrize("gemm", ["rows", "blocks"])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_int4_experts_op_values(gemm, symmetric, group_size, dtype, tolerance):
    """The op on packed nibbles equals a float64 dense layer on the weights decoded from the
    format's formula (w = (q - z) * s, z = 8 when symmetric); ids outside [0, L) add nothing.
    bfloat16: the layer rounds the activations and the intermediate to bfloat16, the
    reference does not (2e-2 of the output's max); float32: float32 sums (1e-5)."""
    (x, gu_packed, d_packed, weights, ids), kwargs = _int4_args(group_size, symmetric)
    out = torch.ops.moeroute.experts(x.to(dtype), gu_packed, d_packed, weights, ids, "silu", gemm, **kwargs)
    expected = dense_experts(
        x.to(dtype).double(),
        weights,
        ids,
        _int4_dense(gu_packed, kwargs["gate_up_scale"], kwargs.get("gate_up_zero"), group_size),
        _int4_dense(d_packed, kwargs["down_scale"], kwargs.get("down_zero"), group_size),
    )
    assert out.dtype == dtype
    assert rel_error(out, expected) < tolerance


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_experts_op_opcheck(symmetric):
    args, kwargs = _int4_args(32, symmetric)
    results = torch.library.opcheck(ops.OPS["experts"], args, kwargs)
    assert set(results.values()) == {"SUCCESS"}, results


def test_int4_experts_op_expert_map():
    """Physical ids through ``expert_map``: the held experts' partial sum, as the local ids give."""
    (x, gu_packed, d_packed, weights, ids), kwargs = _int4_args(32, False)
    expert_map = torch.tensor([2, -1, 0, 3, 1, -1], dtype=torch.int32)
    out = torch.ops.moeroute.experts(x, gu_packed, d_packed, weights, ids, expert_map=expert_map, **kwargs)
    local = torch.where((ids >= 0) & (ids < 6), expert_map[ids.clamp(0, 5).long()], -1)
    expected = dense_experts(
        x.double(),
        weights,
        local,
        _int4_dense(gu_packed, kwargs["gate_up_scale"], kwargs["gate_up_zero"], 32),
        _int4_dense(d_packed, kwargs["down_scale"], kwargs["down_zero"], 32),
    )
    assert rel_error(out, expected) < 1e-5


def test_int4_experts_op_errors():
    args, kwargs = _int4_args(32, False)
    x, gu_packed, d_packed, weights, ids = args
    call = torch.ops.moeroute.experts
    with pytest.raises(ValueError, match="gate_up_zero is missing"):
        call(*args, **{**kwargs, "gate_up_zero": None})
    with pytest.raises(ValueError, match="down_zero is given with symmetric=True"):
        call(*args, **{**kwargs, "symmetric": True, "gate_up_zero": None})
    with pytest.raises(ValueError, match="gate_up_zero is given but quant_format='mxfp4'"):
        call(*args, **{**kwargs, "quant_format": "mxfp4", "group_size": None, "symmetric": None})
    with pytest.raises(ValueError, match="group_size=48 is not an INT4 group size"):
        call(*args, **{**kwargs, "group_size": 48})
    with pytest.raises(ValueError, match=r"w_gate_up scales has shape \(4, 256, 2\)"):
        call(*args, **{**kwargs, "gate_up_scale": kwargs["gate_up_scale"][..., :2]})
    with pytest.raises(ValueError, match=r"down zeros\[0, 0, 0\] is 16; an INT4 zero point is 0..15"):
        call(*args, **{**kwargs, "down_zero": torch.full_like(kwargs["down_zero"], 16)})
    with pytest.raises(ValueError, match="w_down packed must be uint8"):
        call(x, gu_packed, d_packed.view(torch.int8), weights, ids, **kwargs)
    with pytest.raises(ValueError, match=r"w_down packed has shape \(4, 128, 32\)"):
        call(
            x,
            gu_packed,
            d_packed[:, :, :32],
            weights,
            ids,
            **{**kwargs, "down_scale": kwargs["down_scale"][..., :2], "down_zero": kwargs["down_zero"][..., :2]},
        )
    with pytest.raises(ValueError, match="INT4 experts carry no biases"):
        call(*args, b_down=torch.zeros(L, H), **kwargs)
    with pytest.raises(ValueError, match="input_scale"):
        call(*args, input_scale=torch.ones(L, 2), **kwargs)
    with pytest.raises(ValueError, match="not an INT4 strategy"):
        call(*args, gemm="padded", **kwargs)
    with pytest.raises(TypeError, match="topk_weights must be a floating array"):
        call(x, gu_packed, d_packed, ids, weights, **kwargs)


def test_int4_experts_op_reads_zero_points_when_they_change(monkeypatch):
    """A layer's forward passes the same zero points every call: their values are read on the
    first call and after a change torch sees, not on every call; the answer stays the same."""
    from moeroute.quant import int4 as int4_module

    scans = []
    scan = int4_module._scan_zeros
    monkeypatch.setattr(int4_module, "_scan_zeros", lambda zeros, name: scans.append(name) or scan(zeros, name))
    args, kwargs = _int4_args(32, False)
    first = torch.ops.moeroute.experts(*args, **kwargs)
    assert scans == ["gate_up", "down"]
    assert torch.equal(torch.ops.moeroute.experts(*args, **kwargs), first)
    assert scans == ["gate_up", "down"]
    kwargs["down_zero"][0, 0, 0] = 16
    with pytest.raises(ValueError, match=r"down zeros\[0, 0, 0\] is 16"):
        torch.ops.moeroute.experts(*args, **kwargs)
    assert scans == ["gate_up", "down", "down"]


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_experts_op_compiles_fullgraph(symmetric):
    args, kwargs = _int4_args(32, symmetric)

    def layer(x, *rest):
        return torch.ops.moeroute.experts(x * 2, *rest, **kwargs)

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(*args), layer(*args))
