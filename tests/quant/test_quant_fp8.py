"""FP8 quantize/dequantize against hand-computed values, the formulas, and round trips."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from moeroute.quant import (
    QuantConfig,
    dequantize_experts,
    dequantize_fp8_block,
    dequantize_fp8_tensor,
    quantize_experts,
    quantize_fp8_activations,
    quantize_fp8_block,
    quantize_fp8_static,
    quantize_fp8_tensor,
)

E4M3 = torch.float8_e4m3fn
# Every finite e4m3 value, for grid tests.
GRID = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
GRID = GRID[torch.isfinite(GRID)]


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_block_hand_computed():
    w = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]])
    q, scale = quantize_fp8_block(w, (1, 2))
    # Block (0,0): amax 2 -> s = 2/448; (0,1): amax 0.5 -> s = 0.5/448; row 1: all zero -> 1e-10/448.
    assert torch.equal(scale, torch.tensor([[2 / 448, 0.5 / 448], [1e-10 / 448, 1e-10 / 448]]))
    assert torch.equal(q.float(), torch.tensor([[224.0, -448.0, 448.0], [0.0, 0.0, 0.0]]))


def test_block_ue8m0_hand_computed():
    w = torch.tensor([[1.0, -2.0]])
    q, scale = quantize_fp8_block(w, (1, 2), scale_fmt="ue8m0")
    # 2/448 = 2**-7.807 -> rounded up to 2**-7: 1 -> 128, -2 -> -256.
    assert scale.item() == 2.0**-7
    assert q.float().tolist() == [[128.0, -256.0]]


def test_block_rounds_to_nearest_e4m3():
    # s = 448/448 = 1: values are rounded to the e4m3 grid (spacing 32 in [256, 448]).
    w = torch.tensor([[448.0, 300.0, 17.0, 0.3]])
    q, scale = quantize_fp8_block(w, (1, 4))
    assert scale.item() == 1.0
    assert q.float().tolist() == [[448.0, 288.0, 16.0, 0.3125]]


@pytest.mark.parametrize(
    "rows, cols, block", [(200, 300, (128, 128)), (200, 300, (64, 128)), (7, 5, (4, 2)), (128, 256, (128, 128))]
)
def test_dequantize_formula_with_partial_blocks(rows, cols, block):
    w = _randn(rows, cols)
    q, scale = quantize_fp8_block(w, block)
    bn, bk = block
    assert scale.shape == (math.ceil(rows / bn), math.ceil(cols / bk))
    got = dequantize_fp8_block(q, scale, block)
    i = torch.arange(rows)[:, None] // bn
    j = torch.arange(cols)[None, :] // bk
    assert torch.equal(got, q.float() * scale[i, j])
    # Each block's scale is its own amax / 448.
    for bi, bj in itertools.product(range(scale.shape[0]), range(scale.shape[1])):
        amax = w[bi * bn : (bi + 1) * bn, bj * bk : (bj + 1) * bk].abs().max()
        assert scale[bi, bj].item() == pytest.approx(amax.item() / 448, rel=1e-6)


def test_round_trip_error_bound():
    w = _randn(3, 200, 300) * 0.05
    q, scale = quantize_fp8_block(w, (64, 128))
    back = dequantize_fp8_block(q, scale, (64, 128))
    per_elem_scale = scale.repeat_interleave(64, 1)[:, :200].repeat_interleave(128, 2)[..., :300]
    # Half an e4m3 step: 2**-4 relative for normals, 2**-10 * s in the subnormal range.
    assert bool(((back - w).abs() <= w.abs() * 2.0**-4 + per_elem_scale * 2.0**-10).all())


@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_round_trip_exact_on_grid(scale_fmt):
    # Blocks whose amax is 448 * s and whose values are e4m3 multiples of s come back exactly.
    gen = torch.Generator().manual_seed(1)
    q = GRID[torch.randint(len(GRID), (6, 8), generator=gen)]
    q[0::2, 0::4] = 448.0  # each (2, 4) block holds the max
    s = torch.tensor([[2.0**-8, 2.0**-6], [2.0**-3, 1.0], [4.0, 2.0**-10]])
    w = q * s.repeat_interleave(2, 0).repeat_interleave(4, 1)
    q2, s2 = quantize_fp8_block(w, (2, 4), scale_fmt)
    assert torch.equal(s2, s)
    assert torch.equal(q2.float(), q)
    assert torch.equal(dequantize_fp8_block(q2, s2, (2, 4)), w)


def test_leading_dims_are_independent_matrices():
    w = _randn(2, 3, 70, 40)
    q, scale = quantize_fp8_block(w, (32, 16))
    assert scale.shape == (2, 3, 3, 3)
    q11, s11 = quantize_fp8_block(w[1, 2], (32, 16))
    assert torch.equal(q[1, 2].float(), q11.float()) and torch.equal(scale[1, 2], s11)
    assert torch.equal(dequantize_fp8_block(q, scale, (32, 16))[1, 2], dequantize_fp8_block(q11, s11, (32, 16)))


def test_bfloat16_input():
    w = _randn(64, 64).bfloat16()
    q, scale = quantize_fp8_block(w, (32, 32))
    q32, scale32 = quantize_fp8_block(w.float(), (32, 32))
    assert torch.equal(q.float(), q32.float()) and torch.equal(scale, scale32)


def test_activations_hand_computed():
    x = torch.tensor([[3.0, -6.0, 1.0, 0.25, 0.0]])
    q, scales = quantize_fp8_activations(x, group_size=2)
    assert torch.equal(scales, torch.tensor([[6 / 448, 1 / 448, 1e-10 / 448]]))
    assert q.float().tolist() == [[224.0, -448.0, 448.0, 112.0, 0.0]]
    q, scales = quantize_fp8_activations(x, group_size=2, scale_fmt="ue8m0")
    # 6/448 -> 2**-6; 1/448 -> 2**-8; a zero group gets 2**ceil(log2(1e-10/448)) = 2**ceil(-42.03) = 2**-42.
    assert scales.tolist() == [[2.0**-6, 2.0**-8, 2.0**-42]]
    assert q.float().tolist() == [[192.0, -384.0, 256.0, 64.0, 0.0]]


def test_activations_per_token_and_leading_dims():
    x = _randn(2, 3, 10)
    q, scales = quantize_fp8_activations(x, group_size=None)
    assert scales.shape == (2, 3, 1)
    torch.testing.assert_close(scales[..., 0], x.abs().amax(-1) / 448, rtol=1e-6, atol=0)
    assert torch.equal(q.float(), (x / scales).to(E4M3).float())


def test_static_and_tensor():
    x = torch.tensor([[1.0, -1000.0]])
    assert quantize_fp8_static(x, 0.5).float().tolist() == [[2.0, -448.0]]  # saturates at 448
    w = torch.tensor([[[4.0, -1.0]], [[0.5, 0.25]]])
    q, scale = quantize_fp8_tensor(w)
    assert torch.equal(scale, torch.tensor([4 / 448, 0.5 / 448]))
    assert torch.equal(dequantize_fp8_tensor(q, scale), q.float() * scale[:, None, None])
    assert q.float().tolist() == [[[448.0, -112.0]], [[448.0, 224.0]]]


@pytest.mark.parametrize("config", [QuantConfig("fp8_block", block_size=(64, 128)), QuantConfig("fp8_tensor")])
def test_quantize_experts_keeps_gate_and_up_apart(config):
    n, h, inter = 3, 130, 100
    w_gate_up, w_down = _randn(n, 2 * inter, h), _randn(n, h, inter, seed=1)
    w_gate_up[:, inter:] *= 100  # up 100x the gate: a shared block would crush the gate
    q_gu, s_gu, q_d, s_d = quantize_experts(w_gate_up, w_down, config)
    assert (tuple(s_gu.shape), tuple(s_d.shape)) == config.scale_shapes(n, h, inter)
    gu, d = dequantize_experts(q_gu, s_gu, q_d, s_d, config)
    for got, want in ((gu[:, :inter], w_gate_up[:, :inter]), (gu[:, inter:], w_gate_up[:, inter:]), (d, w_down)):
        assert ((got - want).abs().max() / want.abs().max()).item() < 2**-4


def test_errors_name_the_argument():
    q, scale = quantize_fp8_block(_randn(10, 10), (4, 4))
    with pytest.raises(ValueError, match="scale_inv has shape"):
        dequantize_fp8_block(q, scale[:2], (4, 4))
    with pytest.raises(ValueError, match="scale_inv has dtype"):
        dequantize_fp8_block(q, scale.double(), (4, 4))
    with pytest.raises(ValueError, match="q must be float8_e4m3fn"):
        dequantize_fp8_block(q.float(), scale, (4, 4))
    with pytest.raises(ValueError, match="block_size"):
        quantize_fp8_block(_randn(4, 4), (0, 4))
    with pytest.raises(ValueError, match="w must be a float"):
        quantize_fp8_block(q, (4, 4))
    with pytest.raises(ValueError, match="scale_fmt"):
        quantize_fp8_activations(_randn(2, 4), scale_fmt="e8m0")
    with pytest.raises(ValueError, match="group_size"):
        quantize_fp8_activations(_randn(2, 4), group_size=0)


@pytest.mark.gpu
def test_cuda_matches_cpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    w, x = _randn(3, 200, 300), _randn(7, 300)
    q, s = quantize_fp8_block(w, (64, 128))
    qc, sc = quantize_fp8_block(w.cuda(), (64, 128))
    assert torch.equal(q.float(), qc.float().cpu()) and torch.equal(s, sc.cpu())
    assert torch.equal(dequantize_fp8_block(qc, sc, (64, 128)).cpu(), dequantize_fp8_block(q, s, (64, 128)))
    qa, sa = quantize_fp8_activations(x)
    qac, sac = quantize_fp8_activations(x.cuda())
    assert torch.equal(qa.float(), qac.float().cpu()) and torch.equal(sa, sac.cpu())
