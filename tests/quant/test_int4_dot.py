"""INT4's tiles without a table (`moeroute.experts.cpu.int4_dot`): 16 + q decoded by shifts and
masks, the zero point applied through per-lane sums of the activations, multiplied with the
bfloat16 dot instruction (AVX512-BF16) or with float32 FMAs (every other vector path).

References are plain NumPy from the definitions: `split_quads`' and `split_quads_float`'s
orders and sums from their formulas; each tile's dots against float64 sums of x * (q - z) * s
over the same bfloat16 activations. The FMA tile is portable LLVM vector code, so it runs
here on any CPU (on the AVX512-BF16 path too, which does not pick it). Tolerance of a dot: a chunk lane's float32 partial sums stay within
((16 + z) + 31) * sum |x| <= 62 * sum |x| over its eight activations (the start and the eight
products), each of its nine roundings within 2^-24 of that, then the scale's multiply-add and
the lane sums: |error| <= 2^-24 * (9 * 62 + 64) * s_max * sum |x| (< 4e-5 * s_max * sum |x|),
asserted, and below 1e-5 of the largest dot in practice, asserted too. The FMA tile's lane
takes the same start and eight products, one FMA each: the same bound.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch

from moeroute import cpu_features
from moeroute.experts.cpu import int4 as cpu_int4
from moeroute.experts.cpu import int4_dot
from moeroute.experts.formats.int4 import int4_experts_forward
from moeroute.quant import quantize_int4
from moeroute.quant.reference import int4_moe_experts_reference

from helpers.reference import randn, rel_error

needs_bf16_dot = pytest.mark.skipif(not int4_dot.BF16_DOT, reason="no AVX512-BF16 here")

#: The stated bound's factor of s_max * sum |x| (module docstring).
BOUND = 2.0**-24 * (9 * 62 + 64)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) of float32 ``x``, rounded to nearest even."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_values(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def test_split_quads_order_and_sums():
    rng = np.random.default_rng(1)
    cols = 384
    bits = bf16_bits(rng.standard_normal((3, cols)).astype(np.float32))
    for bias in (24.0, 1.0):
        out = np.zeros((3, cols // 128 * int4_dot.CHUNK_WORDS), np.uint16)
        int4_dot.split_quads(bits, bias, out)
        values = bf16_values(bits).astype(np.float64)
        for c in range(cols // 128):
            chunk = out[:, c * 160 : (c + 1) * 160]
            for k in range(4):
                for lane in range(4):
                    for w in range(8):
                        want = bits[:, 128 * c + 32 * lane + 4 * w + k]
                        np.testing.assert_array_equal(chunk[:, 32 * k + 8 * lane + w], want)
            sums = np.ascontiguousarray(chunk[:, 128:]).view(np.float32)
            want = (-bias * values[:, 128 * c : 128 * (c + 1)].reshape(3, 16, 8).sum(axis=2)).astype(np.float32)
            np.testing.assert_array_equal(sums, want)


def test_split_quads_float_order_and_sums():
    rng = np.random.default_rng(2)
    cols = 384
    bits = bf16_bits(rng.standard_normal((3, cols)).astype(np.float32))
    values = bf16_values(bits)
    for bias in (24.0, 1.0):
        out = np.full((3, cols // 128 * int4_dot.CHUNK_FLOATS), np.nan, np.float32)
        int4_dot.split_quads_float(bits, bias, out)
        for c in range(cols // 128):
            chunk = out[:, c * 144 : (c + 1) * 144]
            for h in range(2):
                for k in range(4):
                    for p in range(2):
                        for d in range(8):
                            column = 128 * c + 32 * (2 * h + d // 4) + 8 * (d % 4) + 4 * p + k
                            np.testing.assert_array_equal(chunk[:, 64 * h + 16 * k + 8 * p + d], values[:, column])
            want = -bias * values[:, 128 * c : 128 * (c + 1)].astype(np.float64).reshape(3, 16, 8).sum(axis=2)
            np.testing.assert_array_equal(chunk[:, 128:], want.astype(np.float32))


@numba.njit
def _tile(blocks, w_rows, params, xs, x_rows, out):
    int4_dot._int4_quad_tile(blocks, w_rows, params, xs, x_rows, out)


@numba.njit
def _tile_fma(blocks, w_rows, params, xs, x_rows, out):
    int4_dot._int4_quad_tile_fma(blocks, w_rows, params, xs, x_rows, out)


#: (tile, the activations' order, its row width per chunk of 128, its dtype) by variant.
VARIANTS = {
    "bf16_dot": (_tile, int4_dot.split_quads, int4_dot.CHUNK_WORDS, np.uint16),
    "fma": (_tile_fma, int4_dot.split_quads_float, int4_dot.CHUNK_FLOATS, np.float32),
}


def _params(rng, rows, groups, scale_dtype, symmetric):
    """(kernel params [R, P, G'], float64 scales, float64 zero points) as the layer passes them."""
    scales = (rng.random((rows, groups)) * 0.02 + 0.001).astype(np.float32)
    scales[0, 0] = -scales[0, 0]
    if scale_dtype == "bfloat16":
        bits = bf16_bits(scales)
        s = bf16_values(bits).astype(np.float64)
        params = bits[:, None, :].copy()
    elif scale_dtype == "float16":
        half = scales.astype(np.float16)
        s = half.astype(np.float64)
        params = half.view(np.int16)[:, None, :].copy()
    else:
        s = scales.astype(np.float64)
        params = scales[:, None, :].copy()
    z = np.full((rows, groups), 8.0)
    if not symmetric:
        z = rng.integers(0, 16, (rows, groups)).astype(np.float64)
        z[0, 0], z[-1, -1] = 0.0, 15.0
        params = np.ascontiguousarray(np.stack([scales, z.astype(np.float32)], axis=1))
    return params, s, z


@pytest.mark.parametrize(
    "variant",
    [pytest.param("bf16_dot", marks=needs_bf16_dot), "fma"],
)
@pytest.mark.parametrize("w_count, x_count", [(1, 1), (2, 3), (3, 2), (4, 4), (4, 1), (1, 4)])
@pytest.mark.parametrize(
    "scale_dtype, symmetric",
    [("bfloat16", True), ("float16", True), ("float32", True), ("float32", False)],
)
def test_tile_matches_the_float64_dots(variant, w_count, x_count, scale_dtype, symmetric):
    """Every group size on an odd number of groups of 128 (384 columns) and on a longer row
    (2560 columns: 20 chunks, every tile order over many chunks); every code in both nibbles."""
    tile, split, chunk_width, x_dtype = VARIANTS[variant]
    rng = np.random.default_rng(w_count * 10 + x_count)
    for cols in (384, 2560):
        for group in (32, 64, 128):
            rows, groups = 6, cols // group
            blocks = rng.integers(0, 256, (rows, cols // 32, 16), dtype=np.uint8)
            blocks[:, 0] = np.arange(0, 256, 16) + np.arange(16)
            params, s, z = _params(rng, rows, groups, scale_dtype, symmetric)
            bits = bf16_bits(rng.standard_normal((5, cols)).astype(np.float32))
            xs = np.empty((5, cols // 128 * chunk_width), x_dtype)
            split(bits, int4_dot.sums_bias(not symmetric), xs)
            w_rows = tuple(int(r) for r in rng.choice(rows, w_count, replace=False))
            x_rows = tuple(int(r) for r in rng.choice(5, x_count, replace=False))
            out = np.full(16, np.nan, np.float32)
            tile(blocks, w_rows, params, xs, x_rows, out)
            q = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(rows, cols).astype(np.float64)
            w = (q - np.repeat(z, group, axis=1)) * np.repeat(s, group, axis=1)
            x = bf16_values(bits).astype(np.float64)
            expected = w[list(w_rows)] @ x[list(x_rows)].T  # [w_count, x_count]
            got = out[: w_count * x_count].reshape(w_count, x_count)
            bound = BOUND * np.abs(s).max() * np.abs(x[list(x_rows)]).sum(axis=1)
            assert np.all(np.abs(got - expected) <= bound[None, :]), (cols, group)
            assert np.abs(got - expected).max() / np.abs(expected).max() < 1e-5, (cols, group)


def test_serves():
    vector = int4_dot.BF16_DOT or int4_dot.FMA_TILE
    assert int4_dot.FMA_TILE == (cpu_features.AVX2_SIMD and not int4_dot.BF16_DOT)
    assert int4_dot.serves(True, 256, 128) == vector
    assert not int4_dot.serves(True, 256, 192) and not int4_dot.serves(False, 256, 128)
    # many rows per expert: the decode-once kernels where the tile is the FMA one
    many = int4_dot.FMA_MAX_MEAN_ROWS
    assert int4_dot.serves(True, 256, 128, many) == int4_dot.BF16_DOT
    assert int4_dot.serves(True, 256, 128, many - 0.5) == vector
    # symmetric weights whose widths are whole pairs of blocks only: the table tile
    assert cpu_int4.tile_serves(True, 256, 192, True) == int4_dot.BF16_DOT
    assert not cpu_int4.tile_serves(True, 256, 192, False)
    assert cpu_int4.tile_serves(True, 256, 128, False) == vector
    # the activations' order follows the tile
    assert int4_dot.split is (int4_dot.split_quads_float if int4_dot.FMA_TILE else int4_dot.split_quads)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group, inter", [(32, 128), (64, 192), (128, 384)])
def test_forward_on_the_tiles_matches_the_float64_reference(group, inter, symmetric):
    """The one-call forward with bfloat16 activations: the path's tile here (I = 128, 384), the
    table tile or, asymmetric, the row kernels (I = 192); 1e-2 as the layer's bfloat16 tests."""
    hidden, n, k = 256, 8, 2
    gate_up = quantize_int4(randn(n, 2 * inter, hidden, seed=group, scale=0.1), group_size=group, symmetric=symmetric)
    down = quantize_int4(randn(n, hidden, inter, seed=group + 1, scale=0.1), group_size=group, symmetric=symmetric)
    x = randn(7, hidden, seed=3).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(group)
    ids = torch.randint(0, n, (7, k), generator=gen, dtype=torch.int32)
    weights = torch.rand(7, k, generator=gen)
    out = int4_experts_forward(x, weights, ids, gate_up, down, group, strategy="rows")
    expected = int4_moe_experts_reference(
        x.float(), weights, ids, gate_up, down, group, intermediate_dtype=torch.bfloat16
    )
    assert out.dtype == torch.bfloat16 and rel_error(out.float(), expected) < 1e-2
