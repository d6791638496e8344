"""Numba CPU kernels of the MXFP4 (w4a16) expert GEMMs: the nibbles decoded in registers.

The row kernels (`gate_up_rows`, `down_rows` and their serial forms) read each packed weight
row once and dot it with up to four activation rows per pass, decoding 32 values per scale
byte on the fly. The activation rows are first split per block of 32 into their even and
odd elements (`split_blocks`: ``[x0, x2, .., x30, x1, x3, .., x31]``), so the low nibbles of
a block's 16 bytes pair with 16 contiguous even values and the high nibbles with 16 odd
ones; the block scale 2 ** (s - 127) multiplies the block's partial dot once, not each
value. Sums are float32; only their order differs from the definition's.

On x86 with AVX2, FMA and F16C (`SIMD`) the block dot is LLVM vector code, two blocks per
step: twice every e2m1 value is an integer (-12..12), so one ``pshufb`` looks up sixteen
codes' doubled values as signed bytes, ``vpmovsxbd`` and ``vcvtdq2ps`` widen eight at a time
to float32, exactly, they are multiplied into the rows' accumulators and each row's sum is
halved once (exact: a power of two). Widening
float16 values instead (``vcvtph2ps``) costs more shuffles, which bound the dot; the row
decode, which stores the values and keeps negative zero, does that (every e2m1 value is a
float16 whose low byte is zero, sign included). Elsewhere the same
kernels use a plain Numba loop (`dots_portable`), which the tests compare with the vector
block dot (`dots_simd`) and with the definition.

The prefill decode (`dequantize_rows`) writes whole float32 rows for BLAS GEMMs, each value
computed arithmetically from its code (a loop LLVM vectorizes).

Arrays are NumPy: blocks uint8 [L, R, G, 16], scales uint8 [L, R, G] (G = cols / 32),
activations and sums float32.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from moeroute.experts.cpu import tiles
from moeroute.experts.cpu.dot import splat
from moeroute import cpu_features
from moeroute.quant.mxfp4 import E2M1_VALUES, MXFP4_BLOCK, SCALE_BIAS

__all__ = [
    "SIMD",
    "ROW_BLOCK",
    "split_blocks",
    "gate_up_rows",
    "gate_up_rows_serial",
    "down_rows",
    "down_rows_serial",
    "dots_simd",
    "dots_portable",
    "dequantize_rows",
    "decode_row_split_intrinsic",
    "block_dots_intrinsic",
]

_E2M1 = np.array(E2M1_VALUES, dtype=np.float32)
#: 2 ** (s - 127) for every scale byte (255, e8m0's NaN, is refused at load).
_SCALES = np.array([2.0 ** (s - SCALE_BIAS) for s in range(255)] + [np.nan], dtype=np.float32)
#: Weight rows per unit of parallel work (gate_up) and output columns per thread block (down).
ROW_BLOCK = tiles.ROW_BLOCK
#: Activation rows dotted per pass over a weight row: one decode serves them all (four
#: accumulators and four decoded vectors fit the 16 AVX2 registers).
_ROW_TILE = tiles.ROW_TILE
#: Bytes per block (32 nibbles) and even values per block.
_BLOCK_BYTES = MXFP4_BLOCK // 2


#: Whether the row kernels use the AVX2 block dot (else the portable loop): every path of
#: `moeroute.cpu_features` but "generic".
SIMD = cpu_features.AVX2_SIMD


@numba.njit(fastmath=True, cache=True)
def split_blocks(x, out):
    """out[t] = x[t] with each block of 32 reordered as its 16 even then its 16 odd elements.

    x, out [T, C] float32 (C a multiple of 32).
    """
    for t in range(x.shape[0]):
        row, target = x[t], out[t]
        for base in range(0, x.shape[1], MXFP4_BLOCK):
            for j in range(_BLOCK_BYTES):
                target[base + j] = row[base + 2 * j]
                target[base + _BLOCK_BYTES + j] = row[base + 2 * j + 1]


#: The high byte of each e2m1 value as float16, by 4-bit code: every e2m1 value is a float16
#: whose low byte is zero.
_F16_HIGH_BYTES = [int(np.float16(value).view(np.uint16)) >> 8 for value in E2M1_VALUES]
#: Blocks per loop step of the vector code for one activation row: two blocks' chains of
#: multiply-adds overlap (with more rows, the rows' chains do, and more accumulators spill).
_UNROLL = 2


def _int8_table(table):
    """``table`` (16 float16 high bytes, by 4-bit code) as 16 signed bytes k * value and the
    power of two k that makes every value an integer in [-128, 127] (MXFP4's e2m1 values:
    k = 2, the integers -12..12; INT4's q - 8: k = 1)."""
    values = [float(np.array(byte << 8, np.uint16).view(np.float16)) for byte in table]
    k = 1
    while any(v * k != int(v * k) for v in values):
        k *= 2
    ints = [int(v * k) for v in values]
    if not all(-128 <= i <= 127 for i in ints):
        raise ValueError(f"table: values {values} are not small multiples of a power of two")
    return [i & 0xFF for i in ints], k


def _decode_block(builder, block, table=_F16_HIGH_BYTES):
    """A block's 16 bytes (<16 x i8>) -> (four <8 x float>, k): k times the values of the low
    nibbles of bytes 0-7 (the even elements 0-14), their high nibbles (odd 1-15), then the same
    of bytes 8-15.

    ``table`` holds each code's float16 high byte (16 bytes, by 4-bit code: e2m1 by default;
    any 16 float16 values whose low byte is zero and whose multiples by a power of two k are
    small integers, `_int8_table`). ``pshufb`` looks up k * value as a signed byte for 16
    codes at once, ``vpmovsxbd`` widens eight to 32 bits and ``vcvtdq2ps`` makes them
    float32, exactly: fewer shuffles than widening float16 values (``vcvtph2ps``), which
    bound the block dot. The caller divides by k (a power of two: exact).
    """
    i8, i32 = ir.IntType(8), ir.IntType(32)
    v16i8 = ir.VectorType(i8, 16)
    pshufb = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(v16i8, [v16i8, v16i8]), "llvm.x86.ssse3.pshuf.b.128"
    )
    ints, k = _int8_table(table)
    table = ir.Constant(v16i8, ints)
    low_mask = ir.Constant(v16i8, [0x0F] * 16)
    low = builder.and_(block, low_mask)
    high = builder.and_(builder.lshr(block, ir.Constant(v16i8, [4] * 16)), low_mask)
    values = {}
    for name, codes in (("low", low), ("high", high)):
        looked_up = builder.call(pshufb, [table, codes])
        for part in range(2):  # bytes 0-7, then 8-15
            eight = builder.shuffle_vector(
                looked_up, looked_up, ir.Constant(ir.VectorType(i32, 8), list(range(8 * part, 8 * part + 8)))
            )
            wide = builder.sext(eight, ir.VectorType(i32, 8))
            values[name, part] = builder.sitofp(wide, ir.VectorType(ir.FloatType(), 8))
    return [values["low", 0], values["high", 0], values["low", 1], values["high", 1]], k


def _decode_block_half(builder, block, table=_F16_HIGH_BYTES):
    """A block's 16 bytes (<16 x i8>) -> four <8 x float>: the values of the low nibbles of
    bytes 0-7 (the even elements 0-14), their high nibbles (odd 1-15), then the same of bytes
    8-15; for the row decode, which stores them (negative zero included, which `_decode_block`'s
    integers lack and a dot does not need).

    ``pshufb`` looks up each code's float16 high byte in ``table`` (16 bytes, by 4-bit code:
    e2m1 by default; any 16 float16 values whose low byte is zero), interleaving with zero
    bytes makes the float16 values and ``vcvtph2ps`` widens them to float32, exactly.
    """
    i8, i32 = ir.IntType(8), ir.IntType(32)
    v16i8 = ir.VectorType(i8, 16)
    pshufb = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(v16i8, [v16i8, v16i8]), "llvm.x86.ssse3.pshuf.b.128"
    )
    table = ir.Constant(v16i8, list(table))
    low_mask = ir.Constant(v16i8, [0x0F] * 16)
    low = builder.and_(block, low_mask)
    high = builder.and_(builder.lshr(block, ir.Constant(v16i8, [4] * 16)), low_mask)
    zero = ir.Constant(v16i8, [0] * 16)
    halves = ir.VectorType(ir.HalfType(), 8)
    values = {}
    for name, codes in (("low", low), ("high", high)):
        high_bytes = builder.call(pshufb, [table, codes])
        for part in range(2):  # bytes 0-7, then 8-15; a float16's low byte first (little-endian)
            order = [k for j in range(8 * part, 8 * part + 8) for k in (16 + j, j)]
            wide = builder.shuffle_vector(high_bytes, zero, ir.Constant(ir.VectorType(i32, 16), order))
            values[name, part] = builder.fpext(builder.bitcast(wide, halves), ir.VectorType(ir.FloatType(), 8))
    return [values["low", 0], values["high", 0], values["low", 1], values["high", 1]]


def block_dots_intrinsic(table, block_scale):
    """A Numba intrinsic ``(blocks_row, scales_row, xs, rows)`` -> (W . xs[rows[0]], ..) for one
    packed weight row W (blocks_row [G, 16], its scales ``scales_row``) and a tuple of 1 to 4
    rows of ``xs`` [*, G*32] (float32, `split_blocks` order): x86 vector code (AVX2, FMA,
    F16C; use it where `SIMD`), two blocks per step for one row.

    ``table`` and ``block_scale`` as `decode_row_split_intrinsic` takes them (the table's
    values times some power of two k must be integers in [-128, 127], `_int8_table`): each
    block's partial dot is ``sum((code value + offset) * x)`` over its 32 values, multiplied by
    its scale once (computed k times over and divided by k at the end). MXFP4 and INT4
    (`moeroute.experts.cpu.int4`) share it.
    """

    @intrinsic
    def block_dots(typingctx, blocks_row, scales_row, xs, rows):
        if not (
            isinstance(rows, types.UniTuple)
            and 1 <= rows.count <= _ROW_TILE
            and all(isinstance(a, types.Array) and a.layout == "C" for a in (blocks_row, scales_row, xs))
        ):
            return None
        count = rows.count
        unroll = _UNROLL if count == 1 else 1

        def codegen(context, builder, signature, args):
            i8, i32, f32 = ir.IntType(8), ir.IntType(32), ir.FloatType()
            v16i8, v8f = ir.VectorType(i8, 16), ir.VectorType(f32, 8)
            blocks = context.make_array(signature.args[0])(context, builder, args[0])
            xs_array = context.make_array(signature.args[2])(context, builder, args[2])
            groups = builder.extract_value(blocks.shape, 0)
            width = builder.extract_value(xs_array.shape, 1)
            index_type = groups.type
            block_ptr = builder.bitcast(blocks.data, v16i8.as_pointer())
            x_ptrs = [
                builder.bitcast(builder.gep(xs_array.data, [builder.mul(row, width)]), v8f.as_pointer())
                for row in cgutils.unpack_tuple(builder, args[3], count)
            ]
            fma = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(v8f, [v8f, v8f, v8f]), "llvm.fma.v8f32"
            )
            at = block_scale(context, builder, signature.args[1], args[1], groups)
            zero = ir.Constant(v8f, [0.0] * 8)
            # one accumulator per row and unrolled block: independent chains
            accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(count)] for _ in range(unroll)]

            def block_dots(g, accs_g):
                block = builder.load(builder.gep(block_ptr, [g]), align=1)
                offset, scale = at(g)
                scale = splat(builder, scale, 8)
                values, k = _decode_block(builder, block, table)
                if offset is not None:
                    if k != 1:
                        offset = builder.fmul(offset, ir.Constant(f32, float(k)))
                    offset = splat(builder, offset, 8)
                    values = [builder.fadd(value, offset) for value in values]
                base = builder.mul(g, ir.Constant(index_type, 4))  # a block's 32 floats are 4 vectors
                for r in range(count):
                    # even elements 0-7, 8-15 at vectors 0, 1; odd elements at 2, 3
                    loads = [
                        builder.load(builder.gep(x_ptrs[r], [builder.add(base, ir.Constant(index_type, k))]), align=4)
                        for k in range(4)
                    ]
                    partial = builder.fmul(values[0], loads[0])
                    partial = builder.call(fma, [values[1], loads[2], partial])
                    partial = builder.call(fma, [values[2], loads[1], partial])
                    partial = builder.call(fma, [values[3], loads[3], partial])
                    builder.store(builder.call(fma, [partial, scale, builder.load(accs_g[r])]), accs_g[r])

            steps = builder.udiv(groups, ir.Constant(index_type, unroll))
            with cgutils.for_range(builder, steps) as loop:
                first = builder.mul(loop.index, ir.Constant(index_type, unroll))
                for u in range(unroll):
                    block_dots(builder.add(first, ir.Constant(index_type, u)), accs[u])
            with cgutils.for_range_slice(
                builder, builder.mul(steps, ir.Constant(index_type, unroll)), groups, ir.Constant(index_type, 1)
            ) as (g, _):
                block_dots(g, accs[0])
            sums = []
            for r in range(count):
                acc = builder.load(accs[0][r])
                for u in range(1, unroll):
                    acc = builder.fadd(acc, builder.load(accs[u][r]))
                lanes = [builder.extract_element(acc, ir.Constant(i32, k)) for k in range(8)]
                while len(lanes) > 1:
                    lanes = [builder.fadd(lanes[k], lanes[k + 1]) for k in range(0, len(lanes), 2)]
                # the decode's values were k times the table's (a power of two: exact)
                _, k = _int8_table(table)
                sums.append(lanes[0] if k == 1 else builder.fmul(lanes[0], ir.Constant(f32, 1.0 / k)))
            return context.make_tuple(builder, signature.return_type, sums)

        return types.UniTuple(types.float32, count)(blocks_row, scales_row, xs, rows), codegen

    return block_dots


@numba.njit(fastmath=True)
def dots_simd(blocks_row, scales_row, xs, rows, out):
    """out[i] = W . xs[rows[i]] for a tuple of 1 to 4 ``rows``: `split_blocks` activations
    [*, G*32] float32, a packed row blocks_row [G, 16] / scales_row [G] uint8 (needs `SIMD`)."""
    sums = _block_dots_simd(blocks_row, scales_row, xs, rows)
    for i in range(len(rows)):
        out[i] = sums[i]


@numba.njit(fastmath=True)
def dots_portable(blocks_row, scales_row, xs, rows, out):
    """`dots_simd` as a plain loop (a table lookup per nibble), for any CPU."""
    for i in range(len(rows)):
        x = xs[rows[i]]
        acc = np.float32(0.0)
        for g in range(blocks_row.shape[0]):
            base = g * MXFP4_BLOCK
            partial = np.float32(0.0)
            for j in range(_BLOCK_BYTES):
                byte = blocks_row[g, j]
                partial += _E2M1[byte & 0x0F] * x[base + j] + _E2M1[byte >> 4] * x[base + _BLOCK_BYTES + j]
            acc += _SCALES[scales_row[g]] * partial
        out[i] = acc


_dots = dots_simd if SIMD else dots_portable


@numba.njit(fastmath=True)
def _row_dots(operand, n, count, xs, x_rows, out):
    """The tiled loop's dots (`moeroute.experts.cpu.tiles`): one weight row n of the expert's
    (blocks, scales) in registers against up to four activation rows."""
    _dots(operand[0][n], operand[1][n], xs, x_rows, out)


_kernels = tiles.row_kernels(__name__, "mxfp4", tiles.expert_weights, _row_dots, 1)
gate_up_rows, gate_up_rows_serial, down_rows, down_rows_serial = (_kernels[name] for name in tiles.KERNELS)


def decode_row_split_intrinsic(table, block_scale):
    """A Numba intrinsic ``(blocks_row, scales_row, out)``: out [G*32] float32 <- one packed
    row's values in `split_blocks` order (per block its 16 even then its 16 odd elements),
    the `_decode_block_half` vectors of ``table`` scaled per block and stored (x86 vector code:
    AVX2, F16C; use it where `SIMD`).

    ``block_scale(context, builder, scales_type, scales_value, groups)`` emits what runs once
    a row and returns ``at(g)``, which emits block g's ``(offset, scale)`` as float32 scalars
    (offset None: no addition); each value is ``(code value + offset) * scale``. MXFP4 and
    INT4 (`moeroute.experts.cpu.int4`) share it with their own tables and scale rules.
    """

    @intrinsic
    def decode(typingctx, blocks_row, scales_row, out):
        if not all(isinstance(a, types.Array) and a.layout == "C" for a in (blocks_row, scales_row, out)):
            return None

        def codegen(context, builder, signature, args):
            v16i8, v8f = ir.VectorType(ir.IntType(8), 16), ir.VectorType(ir.FloatType(), 8)
            blocks = context.make_array(signature.args[0])(context, builder, args[0])
            target = context.make_array(signature.args[2])(context, builder, args[2])
            groups = builder.extract_value(blocks.shape, 0)
            index_type = groups.type
            block_ptr = builder.bitcast(blocks.data, v16i8.as_pointer())
            out_ptr = builder.bitcast(target.data, v8f.as_pointer())
            at = block_scale(context, builder, signature.args[1], args[1], groups)

            with cgutils.for_range(builder, groups) as loop:
                g = loop.index
                block = builder.load(builder.gep(block_ptr, [g]), align=1)
                offset, scale = at(g)
                scale = splat(builder, scale, 8)
                offset = None if offset is None else splat(builder, offset, 8)
                values = _decode_block_half(builder, block, table)
                base = builder.mul(g, ir.Constant(index_type, 4))
                # split order: even bytes 0-7, even bytes 8-15, odd bytes 0-7, odd bytes 8-15
                for k, vector in enumerate((values[0], values[2], values[1], values[3])):
                    if offset is not None:
                        vector = builder.fadd(vector, offset)
                    builder.store(
                        builder.fmul(vector, scale),
                        builder.gep(out_ptr, [builder.add(base, ir.Constant(index_type, k))]),
                        align=4,
                    )
            return context.get_dummy_value()

        return types.none(blocks_row, scales_row, out), codegen

    return decode


def _mxfp4_block_scale(context, builder, scales_type, scales_value, groups):
    """MXFP4's block scale: 2 ** (s - 127) of the block's scale byte (a table), no offset."""
    i32, f32 = ir.IntType(32), ir.FloatType()
    scales = context.make_array(scales_type)(context, builder, scales_value)
    scale_table = cgutils.global_constant(
        builder, "mxfp4_scales", ir.Constant(ir.ArrayType(f32, 256), [float(v) for v in _SCALES])
    )

    def at(g):
        byte = builder.zext(builder.load(builder.gep(scales.data, [g])), i32)
        return None, builder.load(builder.gep(scale_table, [ir.Constant(i32, 0), byte]))

    return at


_decode_row_split_simd = decode_row_split_intrinsic(_F16_HIGH_BYTES, _mxfp4_block_scale)
_block_dots_simd = block_dots_intrinsic(_F16_HIGH_BYTES, _mxfp4_block_scale)


@numba.njit(fastmath=True)
def _decode_row_split_portable(blocks_row, scales_row, w):
    """`_decode_row_split_simd` as a plain loop, for any CPU."""
    for g in range(blocks_row.shape[0]):
        half_scale = _SCALES[scales_row[g]] * np.float32(0.5)
        base = g * MXFP4_BLOCK
        block = blocks_row[g]
        for j in range(_BLOCK_BYTES):
            byte = np.int32(block[j])
            w[base + j] = _e2m1_value(byte & 0x0F, half_scale)
            w[base + _BLOCK_BYTES + j] = _e2m1_value(byte >> 4, half_scale)


@numba.njit(fastmath=True)
def _decode_row_split_vector(blocks_row, scales_row, w):
    _decode_row_split_simd(blocks_row, scales_row, w)


_decode_row_split = _decode_row_split_vector if SIMD else _decode_row_split_portable


@numba.njit(fastmath=True, cache=True)
def dequantize_rows_split(blocks, scales, row_start, row_stop, out):
    """`dequantize_rows` in `split_blocks` order (to multiply with `split_blocks` activations:
    a dot product does not depend on the order of its terms)."""
    for r in range(row_start, row_stop):
        _decode_row_split(blocks[r], scales[r], out[r - row_start])


@numba.njit(fastmath=True, inline="always")
def _e2m1_value(code, half_scale):
    """e2m1[code] * 2 * half_scale by arithmetic (no table: the loop vectorizes): twice the
    magnitude is the integer 0, 1, 2, 3, 4, 6, 8, 12; bit 3 is the sign."""
    m = np.int32(code & 7)
    twice = m if m < 4 else (2 + (m & 1)) << ((m >> 1) - 1)
    value = np.float32(twice) * half_scale
    return -value if code & 8 else value


@numba.njit(fastmath=True)
def _decode_row(blocks_row, scales_row, w):
    """w [G*32] float32 <- the row's values (low nibble the even element)."""
    for g in range(blocks_row.shape[0]):
        half_scale = _SCALES[scales_row[g]] * np.float32(0.5)  # exact: a power of two
        base = g * MXFP4_BLOCK
        block = blocks_row[g]
        for j in range(_BLOCK_BYTES):
            byte = np.int32(block[j])
            w[base + 2 * j] = _e2m1_value(byte & 0x0F, half_scale)
            w[base + 2 * j + 1] = _e2m1_value(byte >> 4, half_scale)


# Serial on purpose, as the FP8 decode: it runs between torch GEMMs, next to torch's threads.
@numba.njit(fastmath=True, cache=True)
def dequantize_rows(blocks, scales, row_start, row_stop, out):
    """out[r - row_start] = the float32 values of row r, r in [row_start, row_stop).

    blocks [R, G, 16] uint8 and scales [R, G] uint8 (one matrix), out [rows, G*32] float32.
    """
    for r in range(row_start, row_stop):
        _decode_row(blocks[r], scales[r], out[r - row_start])
