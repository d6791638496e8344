"""Every expert forward takes (hidden, weights, ids), as the public ops do; the order before
0.2 (ids first) is refused by name instead of computed with the ids read as weights."""

import pytest
import torch

from moeroute.bindings.ep._base import _pack_metadata, _unpack_metadata
from moeroute.experts import LocalExperts, QuantizedExperts
from moeroute.experts.formats.fp8 import fp8_experts_forward
from moeroute.experts.formats.int4 import int4_experts_forward
from moeroute.experts.formats.mxfp4 import mxfp4_experts_forward
from moeroute.experts.formats.unquantized import cpu_experts, rows_expert_mlp
from moeroute.quant import QuantConfig
from tests.helpers.reference import dense_experts, generator, rel_error

H, I, N, K, T = 64, 64, 4, 2, 5
OLD_ORDER = r"weights must be a floating array, got dtype int32 \(weights come before ids since 0\.2"
QUANTS = {
    "fp8": QuantConfig("fp8_block", block_size=(32, 32)),
    "mxfp4": QuantConfig("mxfp4"),
    "int4": QuantConfig("int4", group_size=32),
}


def _routing(seed):
    g = generator(seed)
    ids = torch.randint(-1, N, (T, K), generator=g, dtype=torch.int32)
    return torch.randn(T, H, generator=g), torch.rand(T, K, generator=g), ids


def _format_calls(quant_name):
    """(module, the format forward called with the module's tensors in the given order)."""
    experts = QuantizedExperts(N, H, I, quant=QUANTS[quant_name])
    g = generator(7)
    with torch.no_grad():  # any packed byte is a weight of MXFP4 and INT4; FP8 from normal draws
        for weight in (experts.w_gate_up, experts.w_down):
            if weight.dtype == torch.uint8:
                weight.copy_(torch.randint(0, 256, weight.shape, generator=g, dtype=torch.uint8))
            else:
                weight.copy_((torch.randn(weight.shape, generator=g) * 0.5).to(weight.dtype))
    if quant_name == "fp8":
        tensors = (experts.w_gate_up, experts.gate_up_scale, experts.w_down, experts.down_scale, experts.quant)
        return experts, lambda x, a, b: fp8_experts_forward(x, a, b, *tensors)
    if quant_name == "mxfp4":
        tensors = (experts.w_gate_up, experts.gate_up_scale, experts.w_down, experts.down_scale)
        return experts, lambda x, a, b: mxfp4_experts_forward(x, a, b, *tensors)
    gate_up = (experts.w_gate_up, experts.gate_up_scale, experts.gate_up_zero)
    down = (experts.w_down, experts.down_scale, experts.down_zero)
    return experts, lambda x, a, b: int4_experts_forward(x, a, b, gate_up, down, 32)


@pytest.mark.parametrize("gemm", ["rows", "loop"])
def test_local_experts_weights_then_ids(gemm):
    experts = LocalExperts(N, H, I, gemm=gemm)
    g = generator(3)
    with torch.no_grad():
        experts.w_gate_up.copy_(torch.randn(N, 2 * I, H, generator=g) * 0.3)
        experts.w_down.copy_(torch.randn(N, H, I, generator=g) * 0.3)
    x, weights, ids = _routing(4)
    expected = dense_experts(x, weights, ids, experts.w_gate_up, experts.w_down)
    assert rel_error(experts(x, weights, ids), expected) < 1e-5
    assert rel_error(cpu_experts(x, weights, ids, experts.w_gate_up, experts.w_down, gemm=gemm), expected) < 1e-5
    assert rel_error(rows_expert_mlp(x, weights, ids, experts.w_gate_up, experts.w_down), expected) < 1e-5
    with pytest.raises(TypeError, match=OLD_ORDER):
        experts(x, ids, weights)
    with pytest.raises(TypeError, match=OLD_ORDER):
        cpu_experts(x, ids, weights, experts.w_gate_up, experts.w_down, gemm=gemm)
    with pytest.raises(TypeError, match="topk_" + OLD_ORDER):
        rows_expert_mlp(x, ids, weights, experts.w_gate_up, experts.w_down)


@pytest.mark.parametrize("quant_name", sorted(QUANTS))
def test_quantized_forwards_refuse_ids_first(quant_name):
    experts, forward = _format_calls(quant_name)
    x, weights, ids = _routing(5)
    with pytest.raises(TypeError, match=OLD_ORDER):
        experts(x, ids, weights)
    with pytest.raises(TypeError, match=OLD_ORDER):
        forward(x, ids, weights)
    # Float ids (weights passed twice): the ids' own check names them.
    with pytest.raises(TypeError, match=r"local_ids must be an integer array, got dtype float32"):
        forward(x, weights, weights)
    # The order the forwards take: the module and its format forward agree.
    out = experts(x, weights, ids)
    assert out.abs().max() > 0 and torch.equal(out, forward(x, weights, ids))


def test_dispatch_metadata_round_trip():
    _, weights, ids = _routing(6)
    meta = _pack_metadata(weights, ids)
    assert meta.dtype == torch.int32 and tuple(meta.shape) == (T, 2 * K)
    back_weights, back_ids = _unpack_metadata(meta, K)
    assert back_weights.dtype == torch.float32 and back_ids.dtype == torch.int32
    assert torch.equal(back_weights, weights) and torch.equal(back_ids, ids)
