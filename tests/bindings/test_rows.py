"""The row kernels of the CPU experts (`rows_expert_mlp`, gemm="rows") against a float64 reference."""

from __future__ import annotations

import pytest
import torch

from helpers.reference import dense_experts
from moeroute.bindings.torch import _rows
from moeroute.bindings.torch.experts import cpu_experts, rows_expert_mlp

H, I, L = 96, 80, 6  # I and 2I not multiples of the row block, H not a multiple of 64


def _reference(x, ids, weights, w_gate_up, w_down, activation, b_gate_up=None, b_down=None):
    """sum_k w[t,k] * (W_down_e act(W_gate_up_e x_t + b) + b_down), float64 from the same values."""
    return dense_experts(x, ids, weights, w_gate_up, w_down, activation, b_gate_up, b_down)


def _problem(tokens, top_k, dtype, seed, bias=False):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=generator).to(dtype)
    w_gate_up = (torch.randn(L, 2 * I, H, generator=generator) * 0.2).to(dtype)
    w_down = (torch.randn(L, H, I, generator=generator) * 0.2).to(dtype)
    # ids in [-1, L]: -1 and L are held elsewhere and skipped
    ids = torch.randint(-1, L + 1, (tokens, top_k), generator=generator, dtype=torch.int32)
    weights = torch.rand(tokens, top_k, generator=generator)
    biases = (None, None)
    if bias:
        biases = ((torch.randn(L, 2 * I, generator=generator) * 0.5).to(dtype),
                  (torch.randn(L, H, generator=generator) * 0.5).to(dtype))
    return x, ids, weights, w_gate_up, w_down, biases


# float32: only summation order differs from float64; bfloat16: the output is rounded to
# bfloat16 once (relative 2**-8), all products are of the same bfloat16 values.
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=8e-3, atol=8e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh", "swigluoai"])
@pytest.mark.parametrize("tokens,top_k,bias", [(1, 1, False), (3, 2, True), (7, 4, False), (33, 3, True)])
def test_rows_match_reference(dtype, activation, tokens, top_k, bias):
    x, ids, weights, w_gate_up, w_down, (b_gate_up, b_down) = _problem(tokens, top_k, dtype, tokens, bias)
    out = rows_expert_mlp(x, ids, weights, w_gate_up, w_down, activation, b_gate_up, b_down)
    assert out.dtype == dtype and tuple(out.shape) == (tokens, H)
    expected = _reference(x, ids, weights, w_gate_up, w_down, activation, b_gate_up, b_down)
    scale = float(expected.abs().max()) or 1.0  # all slots held elsewhere: zeros
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out.double() / scale, expected / scale, **tolerance)
    # The same sum through the strategy switch of the experts body.
    again = cpu_experts(x, ids, weights, w_gate_up, w_down, activation, "rows", b_gate_up, b_down)
    assert torch.equal(again, out)


def test_rows_widen_bfloat16_exactly():
    """One weight row and one-hot inputs: each output is one bfloat16 weight, exactly."""
    generator = torch.Generator().manual_seed(3)
    w_gate_up = torch.randn(1, 2 * I, H, generator=generator).to(torch.bfloat16)
    w_down = torch.eye(H, I, dtype=torch.bfloat16)[None]
    x = torch.zeros(1, H, dtype=torch.bfloat16)
    x[0, 5] = 1
    xs = x.float().numpy()
    gate_up = torch.empty(1, 2 * I)
    work = torch.tensor([[0, b] for b in range(-(-2 * I // _rows.ROW_BLOCK))], dtype=torch.int64)
    _rows.gate_up_rows(xs, torch.zeros(1, dtype=torch.int64).numpy(), torch.tensor([0, 1]).numpy(),
                       work.numpy(), w_gate_up.view(torch.uint16).numpy(), torch.zeros(0, 0).numpy(),
                       gate_up.numpy())
    assert torch.equal(gate_up[0], w_gate_up[0, :, 5].float())
    sums = torch.zeros(1, H)
    acts = torch.arange(I, dtype=torch.float32)[None] + 1
    _rows.down_rows(acts.numpy(), torch.zeros(1, dtype=torch.int64).numpy(), torch.full((1,), 2.0).numpy(),
                    torch.tensor([0, 1]).numpy(), torch.zeros(1, dtype=torch.int64).numpy(),
                    w_down.view(torch.uint16).numpy(), torch.zeros(0, 0).numpy(), sums.numpy())
    expected = torch.zeros(H)
    expected[:I] = 2 * (torch.arange(I, dtype=torch.float32) + 1)
    assert torch.equal(sums[0], expected)


def test_rows_same_bits_on_any_thread_count():
    """Each output column has one writer and experts add in one order: threads change nothing."""
    x, ids, weights, w_gate_up, w_down, _ = _problem(16, 4, torch.bfloat16, 5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_experts(x, ids, weights, w_gate_up, w_down, "silu", "rows")
        torch.set_num_threads(2)
        two = cpu_experts(x, ids, weights, w_gate_up, w_down, "silu", "rows")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_rows_empty_and_refused_dtypes():
    x, ids, weights, w_gate_up, w_down, _ = _problem(4, 2, torch.float32, 6)
    none_here = torch.full_like(ids, -1)
    out = cpu_experts(x, none_here, weights, w_gate_up, w_down, "silu", "rows")
    assert torch.equal(out, torch.zeros_like(x))
    with pytest.raises(ValueError, match="row kernels serve"):
        cpu_experts(x.half(), ids, weights, w_gate_up.half(), w_down.half(), "silu", "rows")


@pytest.mark.parametrize("tokens,top_k", [(1, 1), (5, 3), (64, 8)])
def test_plan_rows_is_the_stable_expert_sort(tokens, top_k):
    """tokens, weights and offsets as a stable sort of the flat slots by expert gives them."""
    generator = torch.Generator().manual_seed(tokens)
    ids = torch.randint(-1, L + 1, (tokens, top_k), generator=generator, dtype=torch.int32)
    weights = torch.rand(tokens, top_k, generator=generator)
    plan_tokens, slot_weights, offsets, hit, work = _rows.plan_rows(ids.numpy(), weights.numpy(), L, 3)
    flat = ids.reshape(-1).long()
    valid = torch.nonzero((flat >= 0) & (flat < L)).flatten()
    order = valid[torch.sort(flat[valid], stable=True).indices]
    assert plan_tokens.tolist() == (order // top_k).tolist()
    assert slot_weights.tolist() == weights.reshape(-1)[order].tolist()
    counts = torch.bincount(flat[valid], minlength=L)
    assert offsets.tolist() == [0] + torch.cumsum(counts, 0).tolist()
    assert hit.tolist() == torch.nonzero(counts).flatten().tolist()
    assert work.tolist() == [[e, b] for e in hit.tolist() for b in range(3)]
