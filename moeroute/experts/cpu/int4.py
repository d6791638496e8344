"""Numba CPU decode of INT4 (w4a16) weights, for the MXFP4 row machinery.

INT4's packed bytes are MXFP4's blocks: byte j of a row holds element 2j in its low nibble,
so ``packed [L, N, K/2]`` viewed as ``[L, N, K/32, 16]`` is the 32-column block layout the
MXFP4 kernels walk, and the activations take the same `split_blocks` order (per block of 32
its 16 even then its 16 odd elements). Only the value of a nibble differs: MXFP4's is a
table entry times 2 ** e; INT4's is ``(q - z) * s``. The decoders here write one weight row
in that order, and `moeroute.experts.cpu.mxfp4_rows` (decode each row once, then the float32
row kernels of `moeroute.experts.cpu.rows`) picks them by the type of the scales it is given.

The kernels' INT4 parameters are one float32 array per weight, ``params [L, N, P, K/g]``:
``params[e, n, 0]`` the scales and, when asymmetric (P = 2), ``params[e, n, 1]`` the zero
points as floats; P = 1 means symmetric (z = 8). A group of g = 32, 64 or 128 columns is
g / 32 blocks that read the same scale (an index division, no repeated scales). Each value
is ``(float(q) - z) * s`` in float32: exact for bfloat16/float16 scales, one rounding of
the exact product for float32 ones, the definition's (`moeroute.quant.int4`).

Where `moeroute.experts.cpu.mxfp4.SIMD`, the row decode is MXFP4's vector decode with an
INT4 table and scale rule: ``pshufb`` looks up q - 8 (-8..7, each a float16 with a zero low
byte) for 16 nibbles at once, and each block adds 8 - z (asymmetric only) and multiplies by
its group's scale. q - 8 + 8 - z is an exact small integer, so the one rounding is the
product's, as in the definition: the same bits as the plain loop, which the generic path
runs.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types

from moeroute.experts.cpu import mxfp4 as cpu_mxfp4
from moeroute.experts.cpu import int4_dot, mxfp4_dot, tiles
from moeroute.quant.int4 import SYMMETRIC_ZERO

__all__ = [
    "BLOCK",
    "decode_row_split",
    "dequantize_rows_split",
    "dots_simd",
    "dots_portable",
    "gate_up_rows",
    "gate_up_rows_serial",
    "down_rows",
    "down_rows_serial",
    "tile_family",
    "tile_serves",
    "quad_tile_serves",
]

#: Columns per packed block (16 bytes): the MXFP4 kernels' block.
BLOCK = 32
_HALF = BLOCK // 2


@numba.njit(fastmath=True)
def _decode_row_split_portable(blocks_row, params_row, w):
    """w [G*32] float32 <- one INT4 row in `split_blocks` order, each value (q - z) * s (a
    plain loop, for any CPU).

    blocks_row [G, 16] uint8 (the packed row), params_row [P, G'] float32 (scales; zero
    points when P = 2, else z = 8), G a multiple of G'.
    """
    per = blocks_row.shape[0] // params_row.shape[1]
    zeros = params_row.shape[0] == 2
    for g in range(blocks_row.shape[0]):
        group = g // per
        s = params_row[0, group]
        z = params_row[1, group] if zeros else np.float32(SYMMETRIC_ZERO)
        base = g * BLOCK
        block = blocks_row[g]
        for j in range(_HALF):
            byte = np.int32(block[j])
            w[base + j] = (np.float32(byte & 0x0F) - z) * s
            w[base + _HALF + j] = (np.float32(byte >> 4) - z) * s


#: float16 high bytes of q - 8 by 4-bit code q: every integer -8..7 is a float16 whose low byte is zero.
_F16_HIGH_BYTES = [int(np.float16(q - SYMMETRIC_ZERO).view(np.uint16)) >> 8 for q in range(16)]


def _group_shift(builder, blocks, groups):
    """log2 of the blocks per group (blocks / groups: 1, 2 or 4 for groups of 32, 64 or 128
    columns, a power of two), so that a block's group is a shift, not a division per block."""
    per = builder.udiv(blocks, groups)
    cttz = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(per.type, [per.type, ir.IntType(1)]), f"llvm.cttz.i{per.type.width}"
    )
    return builder.call(cttz, [per, ir.Constant(ir.IntType(1), 0)])


#: The scales' element types the vector kernels read directly: float32, bfloat16 bits as uint16
#: and float16 bits as int16 (Numba has no CPU float16 arrays); each widens to float32 exactly.
SCALE_TYPES = (types.float32, types.uint16, types.int16)


def _load_scale(builder, dtype, pointer):
    """float32 of the scale at ``pointer``: a float32 as it is; bfloat16 bits (uint16)
    zero-extended and shifted to a float32's high half; float16 bits (int16) widened (both
    exact)."""
    f32 = ir.FloatType()
    value = builder.load(pointer)
    if dtype == types.uint16:
        bits = builder.shl(builder.zext(value, ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(bits, f32)
    if dtype == types.int16:
        return builder.fpext(builder.bitcast(value, ir.HalfType()), f32)
    return value


def _int4_block_scale(context, builder, params_type, params_value, groups):
    """INT4's block rule for `cpu_mxfp4.decode_row_split_intrinsic`: block g reads group
    g // (G / G') of params_row [P, G'] (C order): scale s = params_row[0, group], offset
    8 - z with z = params_row[1, group] when P = 2, else no addition (z = 8)."""
    f32 = ir.FloatType()
    params = context.make_array(params_type)(context, builder, params_value)
    parts, width = cgutils.unpack_tuple(builder, params.shape, 2)
    # a row of no columns has no groups: divide by one, not zero (the loop never runs)
    empty = builder.icmp_unsigned("==", width, ir.Constant(width.type, 0))
    shift = _group_shift(builder, groups, builder.select(empty, ir.Constant(width.type, 1), width))
    zeros = builder.icmp_unsigned("==", parts, ir.Constant(parts.type, 2))
    eight = ir.Constant(f32, float(SYMMETRIC_ZERO))

    dtype = params_type.dtype

    def at(g):
        group = builder.lshr(g, shift)
        scale = _load_scale(builder, dtype, builder.gep(params.data, [group]))
        if dtype != types.float32:  # 16-bit scales come without zero points (symmetric only)
            return None, scale
        # the zero point's index only when there is one (P = 1 has no second part to read)
        zero_index = builder.select(zeros, builder.add(width, group), group)
        zero = builder.select(zeros, builder.load(builder.gep(params.data, [zero_index])), eight)
        return builder.fsub(eight, zero), scale

    return at


_decode_row_split_simd = cpu_mxfp4.decode_row_split_intrinsic(_F16_HIGH_BYTES, _int4_block_scale)
_block_dots_simd = cpu_mxfp4.block_dots_intrinsic(_F16_HIGH_BYTES, _int4_block_scale)


@numba.njit(fastmath=True)
def _decode_row_split_vector(blocks_row, params_row, w):
    _decode_row_split_simd(blocks_row, params_row, w)


#: The row decode of the kernels: the vector one where the MXFP4 kernels have theirs.
decode_row_split = _decode_row_split_vector if cpu_mxfp4.SIMD else _decode_row_split_portable


@numba.njit(fastmath=True)
def dots_simd(blocks_row, params_row, xs, rows, out):
    """out[i] = W . xs[rows[i]] for a tuple of 1 to 4 ``rows`` of `split_blocks` activations
    [*, G*32] float32 and one INT4 row (blocks_row [G, 16] uint8, params_row [P, G']
    float32): MXFP4's in-register block dot with INT4's table and scale rule (needs `SIMD`)."""
    sums = _block_dots_simd(blocks_row, params_row, xs, rows)
    for i in range(len(rows)):
        out[i] = sums[i]


@numba.njit(fastmath=True)
def dots_portable(blocks_row, params_row, xs, rows, out):
    """`dots_simd` as a plain loop, for any CPU: per block ``s * sum((q - z) * x)``."""
    per = blocks_row.shape[0] // max(1, params_row.shape[1])
    zeros = params_row.shape[0] == 2
    for i in range(len(rows)):
        x = xs[rows[i]]
        acc = np.float32(0.0)
        for g in range(blocks_row.shape[0]):
            group = g // per
            z = params_row[1, group] if zeros else np.float32(SYMMETRIC_ZERO)
            base = g * BLOCK
            partial = np.float32(0.0)
            for j in range(_HALF):
                byte = np.int32(blocks_row[g, j])
                partial += (np.float32(byte & 0x0F) - z) * x[base + j] + (np.float32(byte >> 4) - z) * x[
                    base + _HALF + j
                ]
            acc += params_row[0, group] * partial
        out[i] = acc


#: The few-row kernels (`moeroute.experts.cpu.tiles`): each packed row decoded in registers
#: for every tile of up to four activation rows, cheapest at one to a few rows per expert.
_dots = dots_simd if cpu_mxfp4.SIMD else dots_portable


@numba.njit(fastmath=True)
def _row_dots(operand, n, count, xs, x_rows, out):
    """The tiled loop's dots: one weight row n of the expert's (blocks, params)."""
    _dots(operand[0][n], operand[1][n], xs, x_rows, out)


_kernels = tiles.row_kernels(__name__, "int4", tiles.expert_weights, _row_dots, 1)
gate_up_rows, gate_up_rows_serial, down_rows, down_rows_serial = (_kernels[name] for name in tiles.KERNELS)


#: bfloat16 bits of q - 8 by 4-bit code q, twice: the table of `mxfp4_dot.tile_intrinsic`
#: (every integer -8..7 is a bfloat16, exactly).
_BF16_WORDS = [int(np.array(q - SYMMETRIC_ZERO, np.float32).view(np.uint32)) >> 16 for q in range(16)] * 2


def _int4_tile_scale(context, builder, params_type, params_value, groups):
    """Symmetric INT4's scales in a tile of `mxfp4_dot.tile_intrinsic`: block g of weight row
    ``row`` reads ``params[row, 0, g // (G / G')]`` of the expert's params [R, 1, G'] (the
    offset 8 - z is zero: symmetric only, see `tile_serves`), float32, bfloat16 bits or
    float16 (`SCALE_TYPES`)."""
    params = context.make_array(params_type)(context, builder, params_value)
    _, parts, width = cgutils.unpack_tuple(builder, params.shape, 3)
    empty = builder.icmp_unsigned("==", width, ir.Constant(width.type, 0))
    shift = _group_shift(builder, groups, builder.select(empty, ir.Constant(width.type, 1), width))
    row_stride = builder.mul(parts, width)
    dtype = params_type.dtype

    def row_at(row):
        base = builder.gep(params.data, [builder.mul(row, row_stride)])

        def at(g):
            return _load_scale(builder, dtype, builder.gep(base, [builder.lshr(g, shift)]))

        # blocks a scale, as a shift: the tile sums a whole group's dots before one multiply
        at.group_shift = shift
        return at

    return row_at


_int4_tile = mxfp4_dot.tile_intrinsic(_BF16_WORDS, _int4_tile_scale, 3, SCALE_TYPES)


@numba.njit(fastmath=True)
def _tile_dots(operand, n, count, xs, x_rows, out):
    """The tiled loop's dots with the bfloat16-dot tile: weight rows n .. n + count - 1."""
    blocks, params = operand
    if count == mxfp4_dot.ROW_TILE:
        _int4_tile(blocks, (n, n + 1, n + 2, n + 3), params, xs, x_rows, out)
    else:
        _int4_tile(blocks, (n,), params, xs, x_rows, out)


#: The tiled loop around the bfloat16-dot tile, for symmetric weights where `tile_serves`
#: (run by `moeroute.experts.cpu.quant_rows.rows_experts_int4`).
tile_family = tiles.row_kernels(
    __name__, "int4_dot", tiles.expert_weights, _tile_dots, mxfp4_dot.ROW_TILE, standalone=False
)


def tile_serves(dtype_is_bfloat16: bool, hidden: int, inter: int, symmetric: bool, mean_rows: float = 1.0) -> bool:
    """Whether the one-call forward's tiles run at ``mean_rows`` rows per hit expert:
    `int4_dot.serves` (bfloat16 activations, whole chunks of 128 columns; symmetric or
    asymmetric weights: AVX512-BF16 at any row count, AVX2 at few rows per expert), else the
    table tile here where `mxfp4_dot.serves` (AVX512-BF16, whole pairs of blocks) and the
    weights are symmetric (z = 8: a block's dot is s times the dot of its q - 8, bfloat16
    values that the instruction multiplies exactly)."""
    return quad_tile_serves(dtype_is_bfloat16, hidden, inter, mean_rows) or (
        symmetric and mxfp4_dot.serves(dtype_is_bfloat16, hidden, inter)
    )


def quad_tile_serves(dtype_is_bfloat16: bool, hidden: int, inter: int, mean_rows: float = 1.0) -> bool:
    """Whether the tiles of `int4_dot` (shifts and masks, no table; symmetric and asymmetric)
    run rather than the table tile here."""
    return int4_dot.serves(dtype_is_bfloat16, hidden, inter, mean_rows)


@numba.njit(fastmath=True, cache=True)
def dequantize_rows_split(blocks, params, row_start, row_stop, out):
    """out[r - row_start] = row r's float32 values in `split_blocks` order, r in [row_start,
    row_stop): blocks [R, G, 16] uint8, params [R, P, G'] float32 (one matrix). Serial on
    purpose, as the other decodes of the "blocks" strategy: it runs between torch GEMMs."""
    for r in range(row_start, row_stop):
        decode_row_split(blocks[r], params[r], out[r - row_start])
