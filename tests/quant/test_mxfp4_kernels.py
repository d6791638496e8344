"""The MXFP4 row kernels (moeroute.experts.cpu.mxfp4, moeroute.experts.cpu.mxfp4_rows) against plain NumPy from the definition.

The reference decodes each nibble by table (low nibble = even element, bit 3 the sign),
multiplies by 2 ** (s - 127) and sums in float64; the kernels sum in float32 in their own
order, so values agree to 1e-5 of the largest reference value.
"""

from __future__ import annotations

import numpy as np
import pytest

from moeroute.experts.cpu import mxfp4_rows
from moeroute.experts.cpu import rows as cpu_rows
from moeroute.experts.cpu import mxfp4 as cpu_mxfp4

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
RTOL = 1e-5
DOTS = [
    pytest.param(cpu_mxfp4.dots_portable, id="portable"),
    pytest.param(
        cpu_mxfp4.dots_simd,
        id="simd",
        marks=pytest.mark.skipif(not cpu_mxfp4.SIMD, reason="no AVX2, FMA and F16C here"),
    ),
]
ROW_TUPLES = [(0,), (3, 1), (2, 2, 5), (5, 0, 4, 1)]
#: Rows per expert (0 = not hit): one, the 4-row tile with each remainder, an empty expert.
COUNTS = [(1, 0, 2, 3), (4, 5, 0, 9), (0, 0, 1, 0), (7, 1, 6, 2)]


def plain_weights(blocks, scales):
    """float64 [..., rows, G*32] straight from the definition."""
    values = np.stack([E2M1[blocks & 15], E2M1[blocks >> 4]], axis=-1).reshape(*blocks.shape[:-1], 32)
    return (values * 2.0 ** (scales.astype(np.float64)[..., None] - 127)).reshape(*scales.shape[:-1], -1)


def packed(rng, *shape):
    """Random blocks [*shape, 16] and scale bytes [*shape] around 127."""
    return rng.integers(0, 256, (*shape, 16), dtype=np.uint8), rng.integers(112, 136, shape).astype(np.uint8)


def split(x):
    out = np.empty_like(x)
    cpu_mxfp4.split_blocks(x, out)
    return out


def reference_outputs(packed_weights, x, acts, tokens, slot_weights, offsets, biases, gate_up_shape, sums_shape):
    """float64 from the definition: each sorted row's gate_up (x[tokens[m]] through its
    expert), and the weighted down outputs of ``acts`` summed per token."""
    gate_up_blocks, gate_up_scales, down_blocks, down_scales = packed_weights
    w_gate_up, w_down = plain_weights(gate_up_blocks, gate_up_scales), plain_weights(down_blocks, down_scales)
    expected_gate_up = np.empty(gate_up_shape)
    expected_sums = np.zeros(sums_shape)
    for e in range(offsets.shape[0] - 1):
        gate_up_bias, down_bias = (biases[0][e], biases[1][e]) if biases is not None else (0.0, 0.0)
        for m in range(offsets[e], offsets[e + 1]):
            expected_gate_up[m] = w_gate_up[e] @ x[tokens[m]] + gate_up_bias
            expected_sums[tokens[m]] += slot_weights[m] * (w_down[e] @ acts[m] + down_bias)
    return expected_gate_up, expected_sums


def assert_close(actual, expected):
    scale = max(np.abs(expected).max(), 1e-30)
    np.testing.assert_array_less(np.abs(actual - expected) / scale, RTOL)


def test_split_blocks_puts_even_then_odd_elements():
    x = np.arange(2 * 96, dtype=np.float32).reshape(2, 96)
    expected = x.reshape(2, 3, 16, 2).transpose(0, 1, 3, 2).reshape(2, 96)
    np.testing.assert_array_equal(split(x), expected)


#: Scale bytes of every block, with the activations' magnitude: the usual range, the
#: smallest scale (2 ** -127, a float32 subnormal) and the largest (2 ** 127, whose weights
#: exceed float32 unless the dot stays small).
SCALE_CASES = [
    pytest.param((112, 136), 1.0, id="usual"),
    pytest.param((0, 1), 1.0, id="byte_0"),
    pytest.param((254, 255), 2.0**-40, id="byte_254"),
]


@pytest.mark.parametrize("dots", DOTS)
@pytest.mark.parametrize("rows", ROW_TUPLES)
@pytest.mark.parametrize("scale_range, magnitude", SCALE_CASES)
def test_block_dots_match_the_definition(dots, rows, scale_range, magnitude):
    rng = np.random.default_rng(len(rows))
    blocks = rng.integers(0, 256, (9, 16), dtype=np.uint8)
    blocks[0] = np.arange(0, 256, 16) + np.arange(16)  # every nibble in both halves
    scales = rng.integers(*scale_range, 9).astype(np.uint8)
    x = (rng.standard_normal((6, 9 * 32)) * magnitude).astype(np.float32)
    out = np.full(4, np.nan, np.float32)
    dots(blocks, scales, split(x), rows, out)
    expected = x.astype(np.float64)[list(rows)] @ plain_weights(blocks, scales)
    assert_close(out[: len(rows)], expected)


def plan(counts, seed):
    """Routing with ``counts[e]`` rows per expert over enough tokens (top-2, distinct experts)."""
    rng = np.random.default_rng(seed)
    num_tokens = max(counts) + 1
    ids = np.full((num_tokens, len(counts)), -1, np.int32)
    for e, count in enumerate(counts):
        ids[rng.choice(num_tokens, count, replace=False), e] = e
    weights = rng.random(ids.shape).astype(np.float32)
    return ids, weights


@pytest.mark.parametrize("kernels", [cpu_mxfp4, mxfp4_rows], ids=["tiles", "decoded_once"])
@pytest.mark.parametrize("serial", [False, True], ids=["parallel", "serial"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("counts", COUNTS)
def test_row_kernels_match_the_definition(counts, with_bias, serial, kernels):
    hidden, inter, num_experts = 96, 160, len(counts)  # 2I = 320: five weight-row blocks, the last partial
    rng = np.random.default_rng(sum(counts))
    ids, weights = plan(counts, sum(counts))
    num_tokens = ids.shape[0]
    gate_up_blocks, gate_up_scales = packed(rng, num_experts, 2 * inter, hidden // 32)
    down_blocks, down_scales = packed(rng, num_experts, hidden, inter // 32)
    gate_up_bias = rng.standard_normal((num_experts, 2 * inter)).astype(np.float32)
    down_bias = rng.standard_normal((num_experts, hidden)).astype(np.float32)
    no_bias = np.zeros((0, 0), np.float32)
    x = rng.standard_normal((num_tokens, hidden)).astype(np.float32)
    blocks_per_expert = -(-2 * inter // cpu_mxfp4.ROW_BLOCK)
    tokens, slot_weights, offsets, hit, work = cpu_rows.plan_rows(ids, weights, num_experts, blocks_per_expert)
    gate_up_rows = kernels.gate_up_rows_serial if serial else kernels.gate_up_rows
    down_rows = kernels.down_rows_serial if serial else kernels.down_rows

    gate_up = np.full((tokens.shape[0], 2 * inter), np.nan, np.float32)
    gate_up_rows(
        split(x), tokens, offsets, work, gate_up_blocks, gate_up_scales, gate_up_bias if with_bias else no_bias, gate_up
    )
    acts = rng.standard_normal((tokens.shape[0], inter)).astype(np.float32)
    sums = np.zeros((num_tokens, hidden), np.float32)
    down_rows(
        split(acts),
        tokens,
        slot_weights,
        offsets,
        hit,
        down_blocks,
        down_scales,
        down_bias if with_bias else no_bias,
        sums,
    )

    expected_gate_up, expected_sums = reference_outputs(
        (gate_up_blocks, gate_up_scales, down_blocks, down_scales),
        x,
        acts,
        tokens,
        slot_weights,
        offsets,
        (gate_up_bias, down_bias) if with_bias else None,
        gate_up.shape,
        sums.shape,
    )
    assert_close(gate_up, expected_gate_up)
    assert_close(sums, expected_sums)


def test_dequantize_rows_matches_the_definition():
    rng = np.random.default_rng(7)
    blocks, scales = packed(rng, 5, 3)
    blocks[0, 0] = np.arange(0, 256, 16) + np.arange(16)  # every code in both nibbles
    scales[1] = (0, 252, 127)  # the smallest scale (a subnormal 2 ** -127) and a large one
    out = np.full((3, 96), np.nan, np.float32)
    cpu_mxfp4.dequantize_rows(blocks, scales, 1, 4, out)
    np.testing.assert_array_equal(out, plain_weights(blocks, scales)[1:4].astype(np.float32))


@pytest.mark.parametrize(
    "decode",
    [
        pytest.param("simd", marks=pytest.mark.skipif(not cpu_mxfp4.SIMD, reason="no AVX2, FMA and F16C here")),
        "portable",
    ],
)
def test_dequantize_rows_split_is_the_definition_in_split_order(decode):
    rng = np.random.default_rng(8)
    blocks, scales = packed(rng, 6, 3)
    blocks[0, 0] = np.arange(0, 256, 16) + np.arange(16)  # every code in both nibbles
    scales[1] = (0, 252, 127)  # the smallest scale (a subnormal 2 ** -127) and a large one
    out = np.full((4, 96), np.nan, np.float32)
    if decode == "simd":
        cpu_mxfp4.dequantize_rows_split(blocks, scales, 1, 5, out)
    else:
        for r in range(1, 5):
            cpu_mxfp4._decode_row_split_portable(blocks[r], scales[r], out[r - 1])
    want = split(plain_weights(blocks, scales)[1:5].astype(np.float32))
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))


# ------------------------------------------------------------------ bfloat16 dot instructions

BF16_DOT_REASON = "this CPU has no bfloat16 dot-product instructions (AVX512-BF16)"


def split_pairs(bits):
    from moeroute.experts.cpu import mxfp4_dot

    out = np.empty_like(bits)
    mxfp4_dot.split_pairs(bits, out)
    return out


def bfloat16_bits(x):
    """float32 rows rounded to bfloat16: (their bits as uint16, their values as float64)."""
    import torch

    rounded = torch.from_numpy(x).to(torch.bfloat16)
    return rounded.view(torch.uint16).numpy(), rounded.double().numpy()


def test_split_pairs_puts_each_pair_of_blocks_even_then_odd():
    x = np.arange(2 * 128, dtype=np.uint16).reshape(2, 128)
    # per pair of blocks A, B: A even, B even, A odd, B odd
    expected = x.reshape(2, 2, 2, 16, 2).transpose(0, 1, 4, 2, 3).reshape(2, 128)
    np.testing.assert_array_equal(split_pairs(x), expected)


@pytest.mark.parametrize("serial", [False, True], ids=["parallel", "serial"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("scale_range, magnitude", SCALE_CASES)
def test_bf16_dot_row_kernels_match_the_definition(counts, with_bias, serial, scale_range, magnitude):
    # The e2m1 values and the bfloat16 activations multiplied by vdpbf16ps (exact products,
    # float32 sums), each block's sum times its scale: every tile shape (1 to 4 weight rows,
    # 1 to 4 activation rows), 2I = 384 in six weight-row blocks, the smallest and largest
    # scale bytes included.
    from moeroute.experts.cpu import mxfp4_dot

    if not mxfp4_dot.BF16_DOT:
        pytest.skip(BF16_DOT_REASON)
    hidden, inter, num_experts = 128, 192, len(counts)
    assert mxfp4_dot.serves(True, hidden, inter) and not mxfp4_dot.serves(True, 96, inter)
    rng = np.random.default_rng(sum(counts) + scale_range[0])
    ids, weights = plan(counts, sum(counts))
    num_tokens = ids.shape[0]
    gate_up_blocks = rng.integers(0, 256, (num_experts, 2 * inter, hidden // 32, 16), dtype=np.uint8)
    gate_up_scales = rng.integers(*scale_range, (num_experts, 2 * inter, hidden // 32)).astype(np.uint8)
    down_blocks = rng.integers(0, 256, (num_experts, hidden, inter // 32, 16), dtype=np.uint8)
    down_scales = rng.integers(*scale_range, (num_experts, hidden, inter // 32)).astype(np.uint8)
    gate_up_bias = rng.standard_normal((num_experts, 2 * inter)).astype(np.float32)
    down_bias = rng.standard_normal((num_experts, hidden)).astype(np.float32)
    no_bias = np.zeros((0, 0), np.float32)
    x_bits, x = bfloat16_bits((rng.standard_normal((num_tokens, hidden)) * magnitude).astype(np.float32))
    tokens, slot_weights, offsets, hit, work = cpu_rows.plan_rows(
        ids, weights, num_experts, -(-2 * inter // mxfp4_dot.ROW_BLOCK)
    )
    gate_up_rows = mxfp4_dot.gate_up_rows_serial if serial else mxfp4_dot.gate_up_rows
    down_rows = mxfp4_dot.down_rows_serial if serial else mxfp4_dot.down_rows

    gate_up = np.full((tokens.shape[0], 2 * inter), np.nan, np.float32)
    gate_up_rows(
        split_pairs(x_bits),
        tokens,
        offsets,
        work,
        gate_up_blocks,
        gate_up_scales,
        gate_up_bias if with_bias else no_bias,
        gate_up,
    )
    acts_bits, acts = bfloat16_bits((rng.standard_normal((tokens.shape[0], inter)) * magnitude).astype(np.float32))
    sums = np.zeros((num_tokens, hidden), np.float32)
    down_rows(
        split_pairs(acts_bits),
        tokens,
        slot_weights,
        offsets,
        hit,
        down_blocks,
        down_scales,
        down_bias if with_bias else no_bias,
        sums,
    )

    expected_gate_up, expected_sums = reference_outputs(
        (gate_up_blocks, gate_up_scales, down_blocks, down_scales),
        x,
        acts,
        tokens,
        slot_weights,
        offsets,
        (gate_up_bias, down_bias) if with_bias else None,
        gate_up.shape,
        sums.shape,
    )
    if offsets[-1]:
        assert_close(gate_up, expected_gate_up)
    assert_close(sums, expected_sums)
