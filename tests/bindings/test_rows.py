"""The row kernels of the CPU experts (`rows_expert_mlp`, gemm="rows") against a float64 reference."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch

from helpers.reference import dense_experts
from moeroute.experts.cpu import rows as cpu_rows
from moeroute.experts.activations import gated_activation
from moeroute.experts.choose import rows_bound
from moeroute.experts.formats.unquantized import cpu_experts, rows_expert_mlp

H, I, L = 96, 80, 6  # I and 2I not multiples of the row block, H not a multiple of 64


def _reference(x, ids, weights, w_gate_up, w_down, activation, b_gate_up=None, b_down=None):
    """sum_k w[t,k] * (W_down_e act(W_gate_up_e x_t + b) + b_down), float64 from the same values."""
    return dense_experts(x, weights, ids, w_gate_up, w_down, activation, b_gate_up, b_down)


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
        biases = (
            (torch.randn(L, 2 * I, generator=generator) * 0.5).to(dtype),
            (torch.randn(L, H, generator=generator) * 0.5).to(dtype),
        )
    return x, ids, weights, w_gate_up, w_down, biases


# float32: only summation order differs from float64; bfloat16: the output is rounded to
# bfloat16 once (relative 2**-8), all products are of the same bfloat16 values (with the dot
# instructions, AVX512-BF16, the intermediate is rounded to bfloat16 too).
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=8e-3, atol=8e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh", "swigluoai"])
@pytest.mark.parametrize("tokens,top_k,bias", [(1, 1, False), (3, 2, True), (7, 4, False), (33, 3, True)])
def test_rows_match_reference(dtype, activation, tokens, top_k, bias):
    x, ids, weights, w_gate_up, w_down, (b_gate_up, b_down) = _problem(tokens, top_k, dtype, tokens, bias)
    out = rows_expert_mlp(x, weights, ids, w_gate_up, w_down, activation, b_gate_up, b_down)
    assert out.dtype == dtype and tuple(out.shape) == (tokens, H)
    expected = _reference(x, ids, weights, w_gate_up, w_down, activation, b_gate_up, b_down)
    scale = float(expected.abs().max()) or 1.0  # all slots held elsewhere: zeros
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out.double() / scale, expected / scale, **tolerance)
    # The same sum through the strategy switch of the experts body.
    again = cpu_experts(x, weights, ids, w_gate_up, w_down, activation, "rows", b_gate_up, b_down)
    assert torch.equal(again, out)


@numba.njit
def _gate_up_then_down(xs, w_gate_up, acts, w_down, gate_up, sums):
    """The row kernels' two passes for one row of expert 0 (weight 2), without the activation."""
    tokens, offsets = np.zeros(1, np.int64), np.array([0, 1], np.int64)
    for b in range((w_gate_up.shape[1] + cpu_rows.ROW_BLOCK - 1) // cpu_rows.ROW_BLOCK):
        cpu_rows._gate_up_item(xs, tokens, offsets, 0, b, w_gate_up, w_gate_up, np.zeros((0, 0), np.float32), gate_up)
    for b in range((w_down.shape[1] + cpu_rows.ROW_BLOCK - 1) // cpu_rows.ROW_BLOCK):
        cpu_rows._down_block(
            acts,
            tokens,
            np.full(1, 2.0, np.float32),
            offsets,
            np.zeros(1, np.int64),
            w_down,
            w_down,
            np.zeros((0, 0), np.float32),
            sums,
            b,
            cpu_rows.ROW_BLOCK,
        )


def test_rows_widen_bfloat16_exactly():
    """One weight row and one-hot inputs: each output is one bfloat16 weight, exactly."""
    generator = torch.Generator().manual_seed(3)
    w_gate_up = torch.randn(1, 2 * I, H, generator=generator).to(torch.bfloat16)
    w_down = torch.eye(H, I, dtype=torch.bfloat16)[None]
    x = torch.zeros(1, H, dtype=torch.bfloat16)
    x[0, 5] = 1
    gate_up = torch.empty(1, 2 * I)
    sums = torch.zeros(1, H)
    acts = torch.arange(I, dtype=torch.float32)[None] + 1
    _gate_up_then_down(
        x.float().numpy(),
        w_gate_up.view(torch.uint16).numpy(),
        acts.numpy(),
        w_down.view(torch.uint16).numpy(),
        gate_up.numpy(),
        sums.numpy(),
    )
    assert torch.equal(gate_up[0], w_gate_up[0, :, 5].float())
    expected = torch.zeros(H)
    expected[:I] = 2 * (torch.arange(I, dtype=torch.float32) + 1)
    assert torch.equal(sums[0], expected)


def _special_floats() -> torch.Tensor:
    """Float32 values where activations and rounding have edges: signed zeros, infinities, NaN,
    the bfloat16 tie points, the largest finite values, subnormals and a dense grid."""
    ties = (
        torch.tensor(
            [
                0x3F808000,
                0x3F818000,
                0xBF808000,
                0x3F80C000,
                0x3F807FFF,
                0x7F7F8000,
                0x7F7FFFFF,
                0x00008000,
                0x00018000,
                0x80000001,
            ],
            dtype=torch.int64,
        )
        .to(torch.int32)
        .view(torch.float32)
    )
    edges = torch.tensor(
        [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 7.0, -7.0, 7.0001, 88.0, -88.0, -104.0, 1e-30, -1e-30]
    )
    grid = torch.linspace(-20, 20, 4001)
    return torch.cat([ties, edges, grid])


def test_every_activation_has_a_kernel_code():
    from moeroute.experts.activations import ACTIVATIONS

    assert set(cpu_rows.ACTIVATION_CODES) == set(ACTIVATIONS)
    assert sorted(cpu_rows.ACTIVATION_CODES.values()) == list(range(len(ACTIVATIONS)))


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh", "swigluoai"])
def test_fused_activation_matches_torch(activation):
    """The compiled activation against torch's float32 definition (`gated_activation`): within
    4 float32 ulps of the result plus 4 ulps of |gate * up| (the GELUs' 1 + erf / 1 + tanh cancel
    in the negative tail, where torch's vectorized erf and tanh and libm's differ by about one
    ulp of 1), NaN exactly where torch has it."""
    values = torch.cat(
        [
            torch.tensor([0.0, -0.0, 7.0, -7.0, 7.0001, 88.0, -88.0, -104.0, 1e-30, -1e-30, 1e4, -1e4, float("nan")]),
            torch.linspace(-20, 20, 4001),
        ]
    )
    if activation in ("silu", "swigluoai"):  # the GELUs' overflow at infinity differs (torch: NaN)
        values = torch.cat([values, torch.tensor([float("inf"), -float("inf")])])
    gate = values.repeat(9)
    up = values.roll(7).repeat(9)[torch.randperm(9 * values.numel(), generator=torch.Generator().manual_seed(1))]
    acts = torch.empty(1, gate.numel())
    cpu_rows.activate_rows(torch.cat([gate, up])[None].numpy(), cpu_rows.ACTIVATION_CODES[activation], acts.numpy())
    expected = gated_activation(gate.clone(), up.clone(), activation)
    got = acts[0]
    assert torch.equal(got.isnan(), expected.isnan())
    finite = expected.isfinite()
    assert torch.equal(got[~finite & ~expected.isnan()], expected[~finite & ~expected.isnan()])
    if activation == "swigluoai":  # the clamped operands
        gate, up = gate.clamp(max=7), up.clamp(-7, 7) + 1
    eps = 2.0**-23
    bound = 4 * eps * (expected[finite].abs() + (gate[finite] * up[finite]).abs()).double()
    assert bool(((got[finite].double() - expected[finite].double()).abs() <= bound).all())


@numba.njit
def _store(sums, out):
    cpu_rows.store_sums(sums, out)


def test_bfloat16_output_rounds_as_torch():
    """The float32 sums written as bfloat16: the same bits as torch's conversion (nearest, ties
    to even, overflow to infinity); NaN as the quiet NaN 0x7FC0 (torch's scalar conversion's;
    its vector one writes 0xFFFF)."""
    values = torch.cat(
        [
            _special_floats(),
            -torch.tensor([float("nan")]),
            torch.randn(4096, generator=torch.Generator().manual_seed(2)) * 1e3,
        ]
    )[None]
    out = torch.empty(values.shape, dtype=torch.bfloat16)
    _store(values.numpy(), out.view(torch.uint16).numpy())
    nan = values.isnan()
    assert torch.equal(out.view(torch.int16)[~nan], values.to(torch.bfloat16).view(torch.int16)[~nan])
    assert bool((out.view(torch.int16)[nan] == 0x7FC0).all()) and int(nan.sum()) == 2
    same = torch.empty(values.shape)
    _store(values.numpy(), same.numpy())
    assert torch.equal(same.view(torch.int32), values.view(torch.int32))


def test_auto_beyond_the_row_bound_takes_another_strategy():
    """float32 experts with more rows per expert than the bound: the fused kernel declines
    (False, output untouched) and "auto" serves the call with another strategy, same sums."""
    x, ids, weights, w_gate_up, w_down, _ = _problem(64, 4, torch.float32, 8)
    ids = ids.clamp(0, L - 1)
    out = torch.full((64, H), 5.0)
    served = cpu_rows.rows_experts_serial(
        x.numpy(),
        ids.numpy(),
        weights.numpy(),
        w_gate_up.numpy(),
        w_down.numpy(),
        np.zeros((0, 0), np.float32),
        np.zeros((0, 0), np.float32),
        0,
        16.0,
        out.numpy(),
    )
    assert served is False and bool((out == 5.0).all())
    assert 64 * 4 / L > rows_bound(torch.float32)
    auto = cpu_experts(x, weights, ids, w_gate_up, w_down, "silu", "auto")
    expected = _reference(x, ids, weights, w_gate_up, w_down, "silu")
    scale = float(expected.abs().max())
    torch.testing.assert_close(auto.double() / scale, expected / scale, **TOLERANCE[torch.float32])


def test_rows_same_bits_on_any_thread_count():
    """Each output column has one writer and experts add in one order: threads change nothing."""
    x, ids, weights, w_gate_up, w_down, _ = _problem(16, 4, torch.bfloat16, 5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_experts(x, weights, ids, w_gate_up, w_down, "silu", "rows")
        torch.set_num_threads(2)
        two = cpu_experts(x, weights, ids, w_gate_up, w_down, "silu", "rows")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_rows_empty_and_refused_dtypes():
    x, ids, weights, w_gate_up, w_down, _ = _problem(4, 2, torch.float32, 6)
    none_here = torch.full_like(ids, -1)
    out = cpu_experts(x, weights, none_here, w_gate_up, w_down, "silu", "rows")
    assert torch.equal(out, torch.zeros_like(x))
    with pytest.raises(ValueError, match="row kernels serve"):
        cpu_experts(x.half(), weights, ids, w_gate_up.half(), w_down.half(), "silu", "rows")


@pytest.mark.parametrize("tokens,top_k", [(1, 1), (5, 3), (64, 8)])
def test_plan_rows_is_the_stable_expert_sort(tokens, top_k):
    """tokens, weights and offsets as a stable sort of the flat slots by expert gives them."""
    generator = torch.Generator().manual_seed(tokens)
    ids = torch.randint(-1, L + 1, (tokens, top_k), generator=generator, dtype=torch.int32)
    weights = torch.rand(tokens, top_k, generator=generator)
    plan_tokens, slot_weights, offsets, hit, work = cpu_rows.plan_rows(ids.numpy(), weights.numpy(), L, 3)
    flat = ids.reshape(-1).long()
    valid = torch.nonzero((flat >= 0) & (flat < L)).flatten()
    order = valid[torch.sort(flat[valid], stable=True).indices]
    assert plan_tokens.tolist() == (order // top_k).tolist()
    assert slot_weights.tolist() == weights.reshape(-1)[order].tolist()
    counts = torch.bincount(flat[valid], minlength=L)
    assert offsets.tolist() == [0] + torch.cumsum(counts, 0).tolist()
    assert hit.tolist() == torch.nonzero(counts).flatten().tolist()
    assert work.tolist() == [[e, b] for e in hit.tolist() for b in range(3)]


BF16_DOT_REASON = "this CPU has no bfloat16 dot-product instructions (AVX512-BF16)"


@numba.njit
def _bf16_dots(w, w_rows, xs, x_rows, out):
    if len(w_rows) == 4:
        a = (w_rows[0], w_rows[1], w_rows[2], w_rows[3])
        if len(x_rows) == 4:
            cpu_rows._dots_bf16(w, a, xs, (x_rows[0], x_rows[1], x_rows[2], x_rows[3]), out)
        elif len(x_rows) == 3:
            cpu_rows._dots_bf16(w, a, xs, (x_rows[0], x_rows[1], x_rows[2]), out)
        elif len(x_rows) == 2:
            cpu_rows._dots_bf16(w, a, xs, (x_rows[0], x_rows[1]), out)
        else:
            cpu_rows._dots_bf16(w, a, xs, (x_rows[0],), out)
    else:
        b = (w_rows[0],)
        if len(x_rows) == 4:
            cpu_rows._dots_bf16(w, b, xs, (x_rows[0], x_rows[1], x_rows[2], x_rows[3]), out)
        elif len(x_rows) == 3:
            cpu_rows._dots_bf16(w, b, xs, (x_rows[0], x_rows[1], x_rows[2]), out)
        elif len(x_rows) == 2:
            cpu_rows._dots_bf16(w, b, xs, (x_rows[0], x_rows[1]), out)
        else:
            cpu_rows._dots_bf16(w, b, xs, (x_rows[0],), out)


@pytest.mark.skipif(not cpu_rows.BF16_DOT, reason=BF16_DOT_REASON)
@pytest.mark.parametrize("weight_rows", [1, 4])
@pytest.mark.parametrize("count", [1, 2, 3, 4])
@pytest.mark.parametrize("length", [1, 31, 32, 33, 127, 128, 129, 160, 1000])
def test_bf16_dot_instruction_matches_float64(length, count, weight_rows):
    """vdpbf16ps over whole 32-lane groups plus the widened rest, a tile of 1 or 4 weight rows
    against 1 to 4 activation rows (both picked out of order): the dots of the bfloat16 values
    (exact products, float32 sums), stored weight row by weight row."""
    generator = torch.Generator().manual_seed(length)
    w = (torch.randn(7, length, generator=generator) * 3).to(torch.bfloat16)
    xs = (torch.randn(6, length, generator=generator) * 3).to(torch.bfloat16)
    w_rows, x_rows = [5, 1, 6, 3][:weight_rows], [4, 0, 5, 2][:count]
    out = np.full(17, np.nan, np.float32)
    _bf16_dots(w.view(torch.uint16).numpy(), np.array(w_rows), xs.view(torch.uint16).numpy(), np.array(x_rows), out)
    for i, w_row in enumerate(w_rows):
        for j, x_row in enumerate(x_rows):
            products = w[w_row].double() * xs[x_row].double()
            bound = 4 * length * 2.0**-24 * float(products.abs().sum())
            assert abs(float(out[i * count + j]) - float(products.sum())) <= bound
    assert np.isnan(out[weight_rows * count :]).all()


@pytest.mark.parametrize("kernel", ["widened", "bf16_dot"])
@pytest.mark.parametrize("tokens,top_k,bias", [(1, 1, False), (3, 2, True), (9, 4, True)])
def test_both_bfloat16_kernels_match_reference(kernel, tokens, top_k, bias):
    """The kernel that widens bfloat16 to float32 and the one with the dot instructions, each
    against the float64 reference (the second rounds the intermediate to bfloat16)."""
    if kernel == "bf16_dot" and not cpu_rows.BF16_DOT:
        pytest.skip(BF16_DOT_REASON)
    x, ids, weights, w_gate_up, w_down, (b_gate_up, b_down) = _problem(tokens, top_k, torch.bfloat16, 11, bias)
    run = cpu_rows.rows_experts_serial if kernel == "widened" else cpu_rows.rows_experts_bf16_serial
    out = torch.empty(tokens, H, dtype=torch.bfloat16)
    no_bias = np.zeros((0, 0), np.float32)
    served = run(
        x.view(torch.uint16).numpy(),
        ids.numpy(),
        weights.numpy(),
        w_gate_up.view(torch.uint16).numpy(),
        w_down.view(torch.uint16).numpy(),
        no_bias if b_gate_up is None else b_gate_up.float().numpy(),
        no_bias if b_down is None else b_down.float().numpy(),
        cpu_rows.ACTIVATION_CODES["silu"],
        np.inf,
        out.view(torch.uint16).numpy(),
    )
    assert served
    expected = _reference(x, ids, weights, w_gate_up, w_down, "silu", b_gate_up, b_down)
    scale = float(expected.abs().max()) or 1.0
    torch.testing.assert_close(out.double() / scale, expected / scale, **TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernels", ["widened", "bf16_dot"])
def test_serial_and_parallel_kernels_give_the_same_bits(dtype, kernels):
    """One thread reads each expert's down weights as one stream, the parallel kernel splits the
    output columns: every sum still adds its experts in one order, so the bits are equal."""
    if kernels == "bf16_dot" and (dtype != torch.bfloat16 or not cpu_rows.BF16_DOT):
        pytest.skip(BF16_DOT_REASON if dtype == torch.bfloat16 else "the dot kernels serve bfloat16")
    x, ids, weights, w_gate_up, w_down, (b_gate_up, b_down) = _problem(24, 4, dtype, 13, bias=True)
    serial, parallel = (
        (cpu_rows.rows_experts_serial, cpu_rows.rows_experts)
        if kernels == "widened"
        else (cpu_rows.rows_experts_bf16_serial, cpu_rows.rows_experts_bf16)
    )

    def view(tensor):
        return tensor.view(torch.uint16).numpy() if tensor.dtype == torch.bfloat16 else tensor.numpy()

    outs = []
    for run in (serial, parallel):
        out = torch.empty(24, H, dtype=dtype)
        assert run(
            view(x),
            ids.numpy(),
            weights.numpy(),
            view(w_gate_up),
            view(w_down),
            b_gate_up.float().numpy(),
            b_down.float().numpy(),
            cpu_rows.ACTIVATION_CODES["gelu"],
            np.inf,
            view(out),
        )
        outs.append(out)
    assert torch.equal(
        outs[0].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
        outs[1].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
    )
