"""The plain w8a8 reference against hand-computed values and the algebraic identity
``sum_g s_a s_w dot(q_a, q_w) == dequant(q_a) @ dequant(q_w)^T``."""

from __future__ import annotations

import pytest
import torch

from moeroute.quant import QuantConfig, dequantize_fp8_block, quantize_experts, quantize_fp8_block
from moeroute.quant.reference import expert_mlp_reference, fp8_linear_reference, moe_experts_reference


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_linear_hand_computed():
    # x = [[3, -6 | 1, 0.25]], groups of 2: s_a = [6/448, 1/448], q_a = [224, -448 | 448, 112].
    x = torch.tensor([[3.0, -6.0, 1.0, 0.25]])
    # Weight rows in blocks of (1, 2): q_w row 0 = [1, 2 | 4, 8] with s_w = [0.5, 0.25];
    # row 1 = [-1, 0 | 0, 2] with s_w = [2, 1].
    q_w = torch.tensor([[1.0, 2.0, 4.0, 8.0], [-1.0, 0.0, 0.0, 2.0]]).to(torch.float8_e4m3fn)
    s_w = torch.tensor([[0.5, 0.25], [2.0, 1.0]])
    y = fp8_linear_reference(x, q_w, s_w, block_size=(1, 2))
    row0 = (6 / 448) * 0.5 * (224 * 1 - 448 * 2) + (1 / 448) * 0.25 * (448 * 4 + 112 * 8)
    row1 = (6 / 448) * 2.0 * (224 * -1) + (1 / 448) * 1.0 * (112 * 2)
    torch.testing.assert_close(y, torch.tensor([[row0, row1]]), rtol=1e-6, atol=0)


def test_linear_static_per_tensor_hand_computed():
    x = torch.tensor([[1.0, -3.0]])
    q_w = torch.tensor([[2.0, 1.0]]).to(torch.float8_e4m3fn)
    # static input scale 0.5: q_a = [2, -6]; y = 0.5 * 0.25 * (2*2 - 6*1) = -0.25
    y = fp8_linear_reference(x, q_w, torch.tensor(0.25), block_size=None, input_scale=0.5)
    assert y.item() == -0.25


@pytest.mark.parametrize("block", [(128, 128), (64, 128), (32, 64)])
@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_linear_equals_dequantized_product(block, scale_fmt):
    x, w = _randn(5, 300), _randn(200, 300, seed=1) * 0.02
    q_w, s_w = quantize_fp8_block(w, block)
    y = fp8_linear_reference(x, q_w, s_w, block, scale_fmt)
    # Fake-quantized activations, per token group of bk columns, by hand.
    bk = block[1]
    xq = torch.empty_like(x)
    for g in range(0, 300, bk):
        amax = x[:, g : g + bk].abs().amax(1, keepdim=True).clamp(min=1e-10)
        s = amax / 448 if scale_fmt == "float" else torch.exp2(torch.ceil(torch.log2(amax / 448)))
        xq[:, g : g + bk] = (x[:, g : g + bk] / s).to(torch.float8_e4m3fn).float() * s
    expected = xq.double() @ dequantize_fp8_block(q_w, s_w, block).double().T
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-6)


def test_expert_and_moe_reference_compose():
    n, h, inter, t = 3, 64, 40, 6
    config = QuantConfig("fp8_block", block_size=(16, 32))
    w_gu, w_d = _randn(n, 2 * inter, h) * 0.1, _randn(n, h, inter, seed=1) * 0.1
    q_gu, s_gu, q_d, s_d = quantize_experts(w_gu, w_d, config)
    x = _randn(t, h, seed=2)
    ids = torch.tensor([[0, 2], [1, -1], [2, 0], [5, 1], [0, 1], [2, 2]])
    weights = torch.rand(t, 2, generator=torch.Generator().manual_seed(3))
    got = moe_experts_reference(x, weights, ids, q_gu, s_gu, q_d, s_d, config.block_size)
    expected = torch.zeros(t, h)
    for row in range(t):
        for k in range(2):
            e = int(ids[row, k])
            if 0 <= e < n:
                y = expert_mlp_reference(x[row : row + 1], q_gu[e], s_gu[e], q_d[e], s_d[e], config.block_size)
                expected[row] += weights[row, k] * y[0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # The expert is w8a8 of the SwiGLU: gate and up from their own block rows.
    e, nbr = 1, s_gu.shape[1] // 2
    gate = fp8_linear_reference(x, q_gu[e, :inter], s_gu[e, :nbr], config.block_size)
    up = fp8_linear_reference(x, q_gu[e, inter:], s_gu[e, nbr:], config.block_size)
    act = torch.nn.functional.silu(gate) * up
    down = fp8_linear_reference(act, q_d[e], s_d[e], config.block_size)
    torch.testing.assert_close(
        expert_mlp_reference(x, q_gu[e], s_gu[e], q_d[e], s_d[e], config.block_size), down, rtol=1e-5, atol=1e-6
    )


def test_layer_references_refuse_ids_first():
    """The routing pair comes weights then ids; the order before 0.2 is refused by name
    instead of summing ids read as weights."""
    from moeroute.quant import quantize_int4
    from moeroute.quant.reference import int4_moe_experts_reference

    x = _randn(2, 64)
    ids = torch.tensor([[0, 1], [1, 0]], dtype=torch.int32)
    weights = torch.full((2, 2), 0.5)
    q_gu, s_gu, q_d, s_d = quantize_experts(
        _randn(2, 64, 64, seed=1), _randn(2, 64, 32, seed=2), QuantConfig("fp8_tensor")
    )
    with pytest.raises(TypeError, match="topk_weights must be a floating array, got dtype int32"):
        moe_experts_reference(x, ids, weights, q_gu, s_gu, q_d, s_d)
    gate_up = quantize_int4(_randn(2, 64, 64, seed=1), group_size=32)
    down = quantize_int4(_randn(2, 64, 32, seed=2), group_size=32)
    with pytest.raises(TypeError, match="topk_weights must be a floating array, got dtype int32"):
        int4_moe_experts_reference(x, ids, weights, gate_up, down, 32)
    # The order taken: one expert at weight 1 is that expert's MLP.
    one = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    assert torch.equal(
        int4_moe_experts_reference(x, one, ids, gate_up, down, 32)[0],
        int4_moe_experts_reference(x[:1], one[:1, :1], ids[:1, :1], gate_up, down, 32)[0],
    )
