"""Numba CPU kernels of the FP8 expert GEMMs: e4m3 weights decoded in registers as they are read.

The GEMM kernels (`gate_up_rows`, `down_rows`, and their one-thread forms) read each weight
row once and dot it with every row of quantized activations its expert serves, so memory
carries one byte per weight whatever the row count; the structure is that of the bfloat16
row kernels of `moeroute.experts.cpu.rows` (one row a plain pass, two weight rows by four
activation rows at a time, serial forms for one thread). An e4m3 weight byte is decoded with
three integer SIMD instructions (`_e4m3_times_2_pow_minus_120`: ``q * 2**-120``, exact; e4m3
subnormals become float32 subnormals, so a process that sets the CPU's denormals-are-zero
mode would read those weights, below 2**-6 of their block's largest, as zero); the
activations come as their e4m3 values (float32) and scales. For each weight block row, the
activation rows are scaled first (`_scaled_rows`: the e4m3 value times ``s_a * s_w * 2**120``
of its group, a row with values that large scaled down by a power of two that its dots
then undo), so a dot runs over the whole row with one set of vector accumulators: the
definition's ``sum_g s_a * s_w * dot_g`` up to float32 rounding and summation order. The dequantizers (`dequantize_rows`)
decode whole rows into a float32 buffer (`_decode_row`) for the BLAS path.

On CPUs with AVX512-BF16, `gate_up_rows_bf16` / `down_rows_bf16` (and serial forms) take the
e4m3 values as bfloat16 instead, exactly, and multiply them with the bfloat16 dot
instruction one group of bk columns at a time, each group's sum times ``s_a * s_w`` (the
definition's order): as dots of weight rows for experts with few rows, as outer products
of packed weight rows for experts with many; see the sections at the end of this module.

Arrays are NumPy: weights as uint8 views of float8_e4m3fn tensors, scales float32, sums
float32. Block scales are indexed ``scale[e, row // bn, col // bk]``; per-tensor FP8 is the
same kernel with one block spanning each matrix (or each of gate and up).
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from moeroute.experts.cpu.variants import parallel_and_serial
from moeroute.experts.cpu.rows import (
    _bfloat16_bits_to_float32,
    _round_bfloat16,
    activate_rows,
    float32_rows,
    store_sums,
)
from moeroute.experts.cpu.dot import (
    BF16_DOT,
    LANES,
    BFloat16Type,
    accumulators,
    dot_function,
    row_pointers,
    splat,
    sum_lanes,
)

__all__ = [
    "gate_up_rows",
    "gate_up_rows_serial",
    "down_rows",
    "down_rows_serial",
    "rows_experts",
    "rows_experts_serial",
    "gate_up_rows_bf16",
    "gate_up_rows_bf16_serial",
    "down_rows_bf16",
    "down_rows_bf16_serial",
    "bf16_dot_serves",
    "dequantize_rows",
    "BF16_DOT",
    "ROW_BLOCK",
]

#: 2**120: a float32 holding e4m3 bits in its low exponent/mantissa bits is q * 2**-120.
_UNBIAS = np.float32(2.0**120)


@numba.njit(fastmath=True)
def _decode_row(q_row, bits):
    """bits (int32 [K]) <- the float32 bits of q_row * 2**-120 (exact, subnormals included)."""
    for k in range(q_row.shape[0]):
        b = np.int32(q_row[k])
        bits[k] = ((b & 0x7F) << 20) | ((b & 0x80) << 24)


@intrinsic
def _e4m3_times_2_pow_minus_120(typingctx, byte):
    """The float32 ``q * 2**-120`` of an e4m3 byte, exactly, in integer operations only.

    The byte sign-extended to 32 bits and shifted left by 20 puts e4m3's 4 exponent and 3
    mantissa bits at float32's exponent bits 23-26 and mantissa bits 20-22, and the sign at
    bit 31 (bits 27-30 hold copies of the sign, masked off): a float32 whose exponent field
    is e4m3's, so its value is ``q * 2**(7 - 127)``, e4m3 subnormals included (they land on
    float32 subnormals, exactly). Three vector instructions per eight weights on AVX2
    (``vpmovsxbd``, ``vpslld``, ``vpand``), and portable integer code on any CPU: no
    half-precision widening, which needs F16C and costs a two-uop conversion per eight
    weights. The 2**120 is folded into the activations' group factors (`_scaled_rows`).
    """

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        wide = builder.shl(builder.sext(args[0], i32), ir.Constant(i32, 20))
        bits = builder.and_(wide, ir.Constant(i32, _E4M3_FLOAT32_MASK))
        return builder.bitcast(bits, ir.FloatType())

    return types.float32(types.uint8), codegen


#: The sign bit and e4m3's seven exponent and mantissa bits once shifted left by 20 (as int32).
_E4M3_FLOAT32_MASK = 0x87F00000 - (1 << 32)
#: 2**120: undoes the 2**-120 of `_e4m3_times_2_pow_minus_120`; folded into the group factors.
_DECODE_UNSCALE = 2.0**120
#: The largest magnitude of a scaled activation (`_scaled_rows`): its products with decoded
#: weights (at most 448 * 2**-120) and their sums stay far from float32's overflow.
_SCALED_MAX = 2.0**125
#: Weight rows per unit of parallel work (gate_up) and output columns per thread block (down).
ROW_BLOCK = 64
#: Activation rows dotted per pass over a decoded weight row.
_ROW_TILE = 4


@numba.njit
def _rescale(top):
    """2**d, the power of two that brings ``top * 2**120`` (the largest scaled activation
    magnitude of a row at d = 0; finite) to at most `_SCALED_MAX`, or 1.0 where it already is."""
    if not top * _DECODE_UNSCALE > _SCALED_MAX:
        return 1.0
    return 2.0 ** (math.ceil(math.log2(top)) + 120 - 125)


#: float32 bits: the magnitude mask, and the smallest magnitude that is inf or NaN.
_MAGNITUDE_BITS = np.int32(0x7FFFFFFF)
_NONFINITE_BITS = np.int32(0x7F800000)


@numba.njit(fastmath=True)
def _row_shift(x, sa, scale_row, bk):
    """`_rescale` of activation row ``x``'s largest scaled magnitude, ``max_g s_a[g] *
    scale_row[g] * max(1, amax(|x_g|))``, or 1.0 where a value or scale is inf or NaN (the
    dots are then inf or NaN whatever the scale). The magnitudes are compared as integer
    bits, so that no inf or NaN reaches floating-point code that fastmath assumes free of
    them, and the loop still vectorizes."""
    bits, sa_bits, sw_bits = x.view(np.int32), sa.view(np.int32), scale_row.view(np.int32)
    cols = x.shape[0]
    top = 0.0
    for g in range(scale_row.shape[0]):
        k0 = g * bk
        group = bits[k0 : k0 + min(cols - k0, bk)]
        amax = np.int32(0)
        for k in range(group.shape[0]):  # int32 lanes (Numba widens ``&`` to int64)
            amax = max(amax, np.int32(group[k] & _MAGNITUDE_BITS))
        if max(amax, sa_bits[g] & _MAGNITUDE_BITS, sw_bits[g] & _MAGNITUDE_BITS) >= _NONFINITE_BITS:
            return 1.0
        magnitude = max(1.0, float(_float32_of_bits(amax)))
        top = max(top, float(sa[g] * scale_row[g]) * magnitude)
    return _rescale(top)


@intrinsic
def _float32_of_bits(typingctx, bits):
    """The float32 whose bits are the low 32 of integer ``bits``: a register move."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        low = builder.trunc(args[0], ir.IntType(32)) if bits.bitwidth > 32 else args[0]
        return builder.bitcast(low, ir.FloatType())

    return types.float32(bits), codegen


@numba.njit(fastmath=True)
def _scaled_rows(q_a, s_a, rows, start, stop, scale_row, bk, dst, unscale):
    """dst[i, k] = q_a[r, k] * (s_a[r, g] * scale_row[g] * 2**120 / unscale[i]) for r =
    rows[start + i] and g = k // bk: activation row r with the factor of its group g
    against one weight block row folded in, so that the dots below are plain dots over every
    column, and the 2**120 of the weights' decode (`_e4m3_times_2_pow_minus_120`) undone.

    unscale[i] (float64) is 1.0 unless the row's scaled values would exceed `_SCALED_MAX`
    (large activations times large scales, e.g. unquantized rows of w8a16): then a power of
    two (`_row_shift`) by which the row's dots must be multiplied; exact either way. Returns
    whether any row has one."""
    cols = q_a.shape[1]
    groups = scale_row.shape[0]
    rescaled = False
    for i in range(stop - start):
        r = rows[start + i]
        x, sa, d = q_a[r], s_a[r], dst[i]
        shift = _row_shift(x, sa, scale_row, bk)
        unscale[i] = shift
        rescaled = rescaled or shift != 1.0
        up = _DECODE_UNSCALE / shift
        for g in range(groups):
            k0 = g * bk
            count = min(cols - k0, bk)
            factor = np.float32(float(sa[g] * scale_row[g]) * up)
            xg, dg = x[k0 : k0 + count], d[k0 : k0 + count]
            for k in range(count):
                dg[k] = xg[k] * factor
    return rescaled


@numba.njit(fastmath=True)
def _unscale_dots(out, count, first, last, unscale):
    """out[i, first:last] *= unscale[i] for i < count (the dots of rows `_scaled_rows` rescaled)."""
    for i in range(count):
        if unscale[i] != 1.0:
            row = out[i]
            for n in range(first, last):
                row[n] = np.float32(row[n] * unscale[i])


# The dots below run over every column of a weight row at once: each e4m3 weight decoded
# (times 2**-8) and multiplied by the scaled activation (`_scaled_rows`). One loop over the
# row keeps LLVM's vector accumulators from the first column to the last, with one
# horizontal sum per dot; a sum per group of bk columns, then times the group's factor (the
# definition's order), would close the vectors every bk columns.


@numba.njit(fastmath=True)
def _dot(w, x):
    """dot(decoded w, x): w an e4m3 row (uint8), decoded in registers as it is read, x a
    scaled activation row (float32)."""
    acc = np.float32(0.0)
    for k in range(w.shape[0]):
        acc += _e4m3_times_2_pow_minus_120(w[k]) * x[k]
    return acc


@numba.njit(fastmath=True)
def _dot2(w, x0, x1):
    """(`_dot`(w, x0), `_dot`(w, x1)), w read and decoded once for the two."""
    a0 = a1 = np.float32(0.0)
    for k in range(w.shape[0]):
        wk = _e4m3_times_2_pow_minus_120(w[k])
        a0 += wk * x0[k]
        a1 += wk * x1[k]
    return a0, a1


@numba.njit(fastmath=True)
def _dot4(w, x0, x1, x2, x3, out):
    """out[i] = `_dot`(w, x_i) for four rows (w read and decoded once for the four)."""
    a0 = a1 = a2 = a3 = np.float32(0.0)
    for k in range(w.shape[0]):
        wk = _e4m3_times_2_pow_minus_120(w[k])
        a0 += wk * x0[k]
        a1 += wk * x1[k]
        a2 += wk * x2[k]
        a3 += wk * x3[k]
    out[0], out[1], out[2], out[3] = a0, a1, a2, a3


@numba.njit(fastmath=True)
def _dot2x4(w0, w1, x0, x1, x2, x3, out):
    """out[2i + j] = `_dot`(w_j, x_i) for two weight rows and four activation rows: eight
    sums in registers for six loads a step."""
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
    for k in range(w0.shape[0]):
        u, v = _e4m3_times_2_pow_minus_120(w0[k]), _e4m3_times_2_pow_minus_120(w1[k])
        p = x0[k]
        a0 += u * p
        b0 += v * p
        p = x1[k]
        a1 += u * p
        b1 += v * p
        p = x2[k]
        a2 += u * p
        b2 += v * p
        p = x3[k]
        a3 += u * p
        b3 += v * p
    out[0], out[1], out[2], out[3] = a0, b0, a1, b1
    out[4], out[5], out[6], out[7] = a2, b2, a3, b3


@intrinsic
def _prefetch_row(typingctx, array, row):
    """Ask the CPU to bring row ``row`` of the 2-D C-contiguous ``array`` into its caches
    (``llvm.prefetch`` of each 64-byte line); a row past the end is skipped."""
    if not (isinstance(array, types.Array) and array.ndim == 2 and isinstance(row, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        view = context.make_array(signature.args[0])(context, builder, value=args[0])
        i64, i32, byte_ptr = ir.IntType(64), ir.IntType(32), ir.IntType(8).as_pointer()
        strides = cgutils.unpack_tuple(builder, view.strides, 2)
        shape = cgutils.unpack_tuple(builder, view.shape, 2)
        row_index = context.cast(builder, args[1], signature.args[1], types.int64)
        inside = builder.icmp_unsigned("<", row_index, shape[0])
        with builder.if_then(inside):
            start = builder.add(builder.ptrtoint(view.data, i64), builder.mul(row_index, strides[0]))
            nbytes = builder.mul(shape[1], strides[1])
            prefetch = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [byte_ptr, i32, i32, i32]), "llvm.prefetch.p0"
            )
            with cgutils.for_range_slice(builder, ir.Constant(i64, 0), nbytes, ir.Constant(i64, 64)) as (offset, _):
                address = builder.inttoptr(builder.add(start, offset), byte_ptr)
                builder.call(prefetch, [address, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.none(array, row), codegen


#: Weight rows asked for ahead of the one being dotted (`_prefetch_row`).
_PREFETCH_ROWS = 2


@numba.njit(fastmath=True)
def _weight_rows_dots(xs, count, weights, first, last, tile, out, column):
    """out[i, column + n - first] = `_dot`(weights[n], xs[i]) for i < count, n in [first,
    last): one activation row a plain pass; else two weight rows by four activation rows at a
    time, the last one to three activation rows by pairs (`_dot2`) and one plain pass."""
    if count == 1:
        x, row = xs[0], out[0]
        for n in range(first, last):
            _prefetch_row(weights, n + _PREFETCH_ROWS)
            row[column + n - first] = _dot(weights[n], x)
        return
    tiled = count // _ROW_TILE * _ROW_TILE
    paired = tiled + (count - tiled) // 2 * 2
    for n in range(first, last, 2):
        pair = n + 1 < last
        _prefetch_row(weights, n + _PREFETCH_ROWS)
        _prefetch_row(weights, n + _PREFETCH_ROWS + 1)
        w0, w1 = weights[n], weights[n + 1 if pair else n]
        col = column + n - first
        for i in range(0, tiled, _ROW_TILE):
            x0, x1, x2, x3 = xs[i], xs[i + 1], xs[i + 2], xs[i + 3]
            if pair:
                _dot2x4(w0, w1, x0, x1, x2, x3, tile)
                for j in range(_ROW_TILE):
                    out[i + j, col] = tile[2 * j]
                    out[i + j, col + 1] = tile[2 * j + 1]
            else:
                _dot4(w0, x0, x1, x2, x3, tile)
                for j in range(_ROW_TILE):
                    out[i + j, col] = tile[j]
        for i in range(tiled, paired, 2):
            x0, x1 = xs[i], xs[i + 1]
            out[i, col], out[i + 1, col] = _dot2(w0, x0, x1)
            if pair:
                out[i, col + 1], out[i + 1, col + 1] = _dot2(w1, x0, x1)
        if paired < count:
            x = xs[paired]
            out[paired, col] = _dot(w0, x)
            if pair:
                out[paired, col + 1] = _dot(w1, x)


@numba.njit(fastmath=True)
def _gate_up_item(q_a, s_a, tokens, offsets, e, chunk, q_gate_up, gate_up_scale, inter, bn, bk, out):
    """Weight rows [chunk * ROW_BLOCK, ..) of expert ``e``'s gate_up for all its sorted rows,
    one weight block row at a time (its scaled activation rows: `_scaled_rows`)."""
    two_inter = q_gate_up.shape[1]
    nb = (inter + bn - 1) // bn
    start, stop = offsets[e], offsets[e + 1]
    scaled = np.empty((stop - start, q_a.shape[1]), np.float32)
    unscale = np.empty(stop - start, np.float64)
    tile = np.empty(2 * _ROW_TILE, np.float32)
    rows_out = out[start:stop]
    weights = q_gate_up[e]
    n, last = chunk * ROW_BLOCK, min(two_inter, (chunk + 1) * ROW_BLOCK)
    while n < last:
        if n < inter:  # gate rows: block rows 0..nb-1
            b = n // bn
            segment_end = min(last, (b + 1) * bn, inter)
        else:  # up rows: block rows nb..2nb-1, counted from row I
            rb = (n - inter) // bn
            b = nb + rb
            segment_end = min(last, inter + (rb + 1) * bn)
        rescaled = _scaled_rows(q_a, s_a, tokens, start, stop, gate_up_scale[e, b], bk, scaled, unscale)
        _weight_rows_dots(scaled, stop - start, weights, n, segment_end, tile, rows_out, n)
        if rescaled:
            _unscale_dots(rows_out, stop - start, n, segment_end, unscale)
        n = segment_end


@parallel_and_serial(fastmath=True, cache=True)
def gate_up_rows(q_a, s_a, tokens, offsets, work, q_gate_up, gate_up_scale, inter, bn, bk, out):
    """out[m, :] = x[tokens[m]] @ W_e^T for each expert e's sorted rows m (first GEMM), with
    x = q_a * s_a per group of bk columns (the quantized activations).

    q_a [T, H] float32 (e4m3 values), s_a [T, G] float32 (G = ceil(H / bk)), tokens [M] int64,
    offsets [L + 1] int64, work [W, 2] int64 (expert, block of `ROW_BLOCK` weight rows of
    gate_up), q_gate_up [L, 2I, H] uint8, gate_up_scale [L, 2nb, G] float32 (block rows
    0..nb-1 the gate's, nb..2nb-1 the up's, nb = ceil(I / bn)), out [M, 2I] float32.
    """
    for item in numba.prange(work.shape[0]):
        _gate_up_item(
            q_a, s_a, tokens, offsets, work[item, 0], work[item, 1], q_gate_up, gate_up_scale, inter, bn, bk, out
        )


gate_up_rows_serial = gate_up_rows.serial


@numba.njit(fastmath=True)
def _down_block(q_a, s_a, tokens, slot_weights, offsets, experts, q_down, down_scale, bn, bk, sums, block):
    """Output columns [block * ROW_BLOCK, ..) over every hit expert (`down_rows`)."""
    hidden = q_down.shape[1]
    rows = np.arange(q_a.shape[0])
    tile = np.empty(2 * _ROW_TILE, np.float32)
    first, last = block * ROW_BLOCK, min(hidden, (block + 1) * ROW_BLOCK)
    scaled = np.empty((0, q_a.shape[1]), np.float32)
    unscale = np.empty(0, np.float64)
    dots = np.empty((0, ROW_BLOCK), np.float32)
    for i in range(experts.shape[0]):
        e = experts[i]
        start, stop = offsets[e], offsets[e + 1]
        count = stop - start
        if scaled.shape[0] < count:
            scaled = np.empty((count, q_a.shape[1]), np.float32)
            unscale = np.empty(count, np.float64)
            dots = np.empty((count, ROW_BLOCK), np.float32)
        weights = q_down[e]
        n = first
        while n < last:
            b = n // bn
            segment_end = min(last, (b + 1) * bn)
            rescaled = _scaled_rows(q_a, s_a, rows, start, stop, down_scale[e, b], bk, scaled, unscale)
            _weight_rows_dots(scaled, count, weights, n, segment_end, tile, dots, n - first)
            if rescaled:
                _unscale_dots(dots, count, n - first, segment_end - first, unscale)
            n = segment_end
        for m in range(start, stop):
            t, weight = tokens[m], slot_weights[m]
            d = dots[m - start]
            for n in range(first, last):
                sums[t, n] += weight * d[n - first]


@parallel_and_serial(fastmath=True, cache=True)
def down_rows(q_a, s_a, tokens, slot_weights, offsets, experts, q_down, down_scale, bn, bk, sums):
    """sums[tokens[m], n] += slot_weights[m] * (a[m] @ W_e^T)[n] (second GEMM + combine), with
    a = q_a * s_a per group of bk columns (the quantized intermediate).

    Threads split the output columns (blocks of `ROW_BLOCK`), so each sum has one writer,
    and experts are added in ``experts`` order (deterministic). q_a [M, I] float32 (e4m3
    values), s_a [M, ceil(I/bk)] float32, experts [E'] int64 (hit experts), q_down
    [L, H, I] uint8, down_scale [L, ceil(H/bn), ceil(I/bk)] float32, sums [T, H] float32.
    """
    for block in numba.prange((q_down.shape[1] + ROW_BLOCK - 1) // ROW_BLOCK):
        _down_block(q_a, s_a, tokens, slot_weights, offsets, experts, q_down, down_scale, bn, bk, sums, block)


down_rows_serial = down_rows.serial


@numba.njit
def _quantized(x, group, round_bf16, min_amax, groups):
    """(e4m3 values [M, K] float32, scales [M, groups] float32) of float32 rows ``x`` quantized
    per ``group`` columns (`quantize_rows`); one scale per row (``group`` >= K) is repeated
    over the ``groups`` weight column blocks."""
    rows, cols = x.shape
    q = np.empty((rows, cols), np.float32)
    scales = np.empty((rows, (cols + group - 1) // group), np.float32)
    quantize_rows(x, group, round_bf16, min_amax, q, scales)
    if scales.shape[1] == groups:
        return q, scales
    repeated = np.empty((rows, groups), np.float32)
    for m in range(rows):
        for g in range(groups):
            repeated[m, g] = scales[m, 0]
    return q, repeated


@numba.njit
def _unquantized(x, round_bf16, groups):
    """(``x`` [M, K] float32, rounded to bfloat16 values where ``round_bf16``, unit scales
    [M, groups]): the w8a16 operand."""
    if round_bf16:
        rounded = np.empty(x.shape, np.float32)
        for m in range(x.shape[0]):
            for k in range(x.shape[1]):
                rounded[m, k] = _bfloat16_bits_to_float32(_round_bfloat16(x[m, k]))
        x = rounded
    return x, np.ones((x.shape[0], groups), np.float32)


@parallel_and_serial(cache=True)
def rows_experts(
    x,
    tokens,
    slot_weights,
    offsets,
    hit,
    work,
    q_gate_up,
    gate_up_scale,
    q_down,
    down_scale,
    gate_up_block,
    down_block,
    groups,
    round_intermediate,
    min_amax,
    code,
    quantize,
    out,
):
    """out[t] = sum_k weights[t, k] * expert_{ids[t, k]}(x[t]), the w8a8 (or with ``quantize``
    False, w8a16) expert MLP with the float row kernels (`gate_up_rows`, `down_rows`), in one
    call: the steps of the torch-level "rows" forward between its kernel calls, so that a
    decode step enters compiled code once. The activation is computed by Numba
    (`moeroute.experts.cpu.rows.activate_rows`: torch's formulas in float32, within a few ulps).

    x [T, H] and out [T, H] uint16 (bfloat16 bits) or float32; tokens, slot_weights, offsets,
    hit, work: `moeroute.experts.cpu.rows.plan_rows`' plan; q_gate_up, gate_up_scale, q_down,
    down_scale as `gate_up_rows` / `down_rows`, gate_up_block / down_block (bn, bk);
    ``groups`` the activation group sizes of the two GEMMs' inputs (each a weight column
    block, or the row length: one scale per row); ``round_intermediate``: the intermediate
    rounded to bfloat16 first (bfloat16 activations); ``code`` the activation
    (`moeroute.experts.cpu.rows.ACTIVATION_CODES`); ``quantize``: False for w8a16 (the rows
    and the intermediate as they are, unit scales; ``groups`` and ``min_amax`` unused).
    """
    inter = q_gate_up.shape[1] // 2
    xs = float32_rows(x)
    if quantize:
        q_x, s_x = _quantized(xs, groups[0], False, min_amax, gate_up_scale.shape[2])
    else:
        q_x, s_x = _unquantized(xs, False, gate_up_scale.shape[2])
    gate_up = np.empty((tokens.shape[0], 2 * inter), np.float32)
    for item in numba.prange(work.shape[0]):
        _gate_up_item(
            q_x,
            s_x,
            tokens,
            offsets,
            work[item, 0],
            work[item, 1],
            q_gate_up,
            gate_up_scale,
            inter,
            gate_up_block[0],
            gate_up_block[1],
            gate_up,
        )
    acts = np.empty((tokens.shape[0], inter), np.float32)
    activate_rows(gate_up, code, acts)
    if quantize:
        q_a, s_a = _quantized(acts, groups[1], round_intermediate, min_amax, down_scale.shape[2])
    else:
        q_a, s_a = _unquantized(acts, round_intermediate, down_scale.shape[2])
    sums = np.zeros((x.shape[0], q_down.shape[1]), np.float32)
    for block in numba.prange((q_down.shape[1] + ROW_BLOCK - 1) // ROW_BLOCK):
        _down_block(
            q_a, s_a, tokens, slot_weights, offsets, hit, q_down, down_scale, down_block[0], down_block[1], sums, block
        )
    store_sums(sums, out)


rows_experts_serial = rows_experts.serial


# Serial on purpose: it runs between torch GEMMs, where starting Numba's thread pool next to
# torch's spinning OpenMP workers costs far more than the decoding itself.
@numba.njit(fastmath=True, cache=True)
def dequantize_rows(q, scale, row_start, row_stop, scale_row_offset, bn, bk, out):
    """out[r - row_start] = q[r] * scale[(r - scale_row_offset) // bn, k // bk] for r in
    [row_start, row_stop).

    q [R, K] uint8 (one matrix), scale [nb, G] float32 (gate and up count their block rows
    from their own first row: ``scale_row_offset``), out [row_stop - row_start, K] float32.
    """
    cols = q.shape[1]
    for r in range(row_start, row_stop):
        bits = out[r - row_start].view(np.int32)
        _decode_row(q[r], bits)
        values = out[r - row_start]
        scale_row = scale[(r - scale_row_offset) // bn]
        for g in range((cols + bk - 1) // bk):
            c = scale_row[g] * _UNBIAS
            group = values[g * bk : min(cols, (g + 1) * bk)]
            for k in range(group.shape[0]):
                group[k] *= c


# Not fastmath: the scale is an IEEE division, as torch computes it (fastmath would let LLVM
# multiply by a reciprocal), so the values match `moeroute.quant.quantize_fp8_activations`
# bit for bit.
@numba.njit(cache=True)
def quantize_rows(x, group, round_bf16, min_amax, q_out, s_out):
    """q_out, s_out <- the dynamic e4m3 quantization of float32 rows ``x [M, K]`` per group of
    ``group`` columns, ``quantize_fp8_activations``' numerics with ``scale_fmt="float"``.

    ``s = max(amax(|x_group|), min_amax) / 448``, ``q = e4m3(clamp(x / s, -448, 448))``
    rounded to nearest, ties to even; q_out [M, K] float32 holds the e4m3 values, s_out
    [M, ceil(K/group)] float32 the scales. ``round_bf16``: ``x`` is first rounded to
    bfloat16 (nearest, ties to even), as the cast to the activation dtype does. A NaN in a
    group makes its scale and every value NaN (torch's amax and clamp propagate it), so that
    token's output is NaN on every path. Serial: it runs between other calls on small
    batches, where a parallel region costs more.
    """
    rows, cols = x.shape
    for m in range(rows):
        row, q_row = x[m], q_out[m]
        q_bits = q_row.view(np.int32)
        if round_bf16:
            bits = q_row.view(np.int32)
            source = row.view(np.int32)
            for k in range(cols):
                b = source[k]
                if (b & 0x7FFFFFFF) > 0x7F800000:  # NaN stays NaN (rounding could carry it to inf)
                    bits[k] = np.int32(0x7FC00000)
                else:
                    bits[k] = (b + 0x7FFF + ((b >> 16) & 1)) & np.int32(-65536)
            row = q_row
        for g in range((cols + group - 1) // group):
            k0 = g * group
            k1 = min(cols, k0 + group)
            amax = np.float32(0.0)
            for k in range(k0, k1):
                a = abs(row[k])
                if not a <= amax:  # NaN included: torch's amax propagates it
                    amax = a
                    if a != a:
                        break
            scale = amax / np.float32(448.0) if amax != amax else max(amax, min_amax) / np.float32(448.0)
            s_out[m, g] = scale
            for k in range(k0, k1):
                v = row[k] / scale
                if v != v:  # a NaN scale or element (or inf / inf): NaN, as torch's clamp keeps it
                    q_row[k] = v
                    continue
                v = min(max(v, np.float32(-448.0)), np.float32(448.0))
                a = abs(v)
                if a < np.float32(2.0**-6):  # e4m3 subnormals: multiples of 2**-9
                    r = np.float32(np.rint(a * np.float32(512.0)) / np.float32(512.0))
                    q_row[k] = -r if v < 0 else r
                else:  # keep 3 mantissa bits (nearest, ties to even), in q_row's bits
                    q_row[k] = a
                    b = q_bits[k]
                    q_bits[k] = ((b + 0x7FFFF + ((b >> 20) & 1)) & np.int32(-1048576)) | (
                        np.int32(-2147483648) if v < 0 else np.int32(0)
                    )


# ---------------------------------------------------------------- bfloat16 dot-product instructions
#
# On CPUs with AVX512-BF16 (`moeroute.experts.cpu.dot.BF16_DOT`) the dots take the e4m3 values as
# bfloat16, both sides exactly: an e4m3 weight byte is rebuilt as bfloat16 bits in registers
# from byte tables (`_E4M3Decoder`), the activations' e4m3 values are bfloat16 already. ``vdpbf16ps`` then forms the
# exact products and float32 sums of each group of bk columns, and the group's sum times
# ``s_a * s_w`` is added to the row's total: the definition's order, one group at a time.

#: Weight rows per call of `_dot_e4m3_tile` (the tuples of four rows below).
_WEIGHT_TILE = 4


def _e4m3_bfloat16_bytes() -> tuple[list[int], list[int]]:
    """The high and low bytes of the bfloat16 bits of each e4m3 magnitude code (0..127),
    exact (the NaN code 0x7F as 480, as the float path's decoder reads it: NaN weight bytes
    are refused at load, `moeroute.quant.fp8.check_fp8_weight`)."""
    codes = np.arange(128, dtype=np.uint8)
    values = np.array([_e4m3_magnitude(int(c)) for c in codes], np.float32)
    bits = values.view(np.uint32)
    assert not (bits & 0xFFFF).any()  # every e4m3 value is a bfloat16
    words = bits >> 16
    return [int(w) >> 8 for w in words], [int(w) & 0xFF for w in words]


def _e4m3_magnitude(code: int) -> float:
    """The value of an e4m3 magnitude code (sign bit clear): 2**(e - 7) * (1 + m / 8), or
    m * 2**-9 for e = 0; code 0x7F (NaN in e4m3fn) read by the same formula (480)."""
    exponent, mantissa = code >> 3, code & 7
    if exponent == 0:
        return mantissa * 2.0**-9
    return 2.0 ** (exponent - 7) * (1 + mantissa / 8)


_HIGH_BYTES, _LOW_BYTES = _e4m3_bfloat16_bytes()
#: Weights decoded per step: one 64-byte load, two 32-lane bfloat16 vectors.
_STEP = 2 * LANES
#: Activation values (16 KB of bfloat16) a tile's activation rows may span whole: the weight
#: rows are then read whole, one after the other (one stream through memory), while the
#: activation rows stay in L1.
_CHUNK_VALUES = 8192
#: Longer activation rows: chunks of whole groups of columns, 512 values over the activation
#: rows (at least one group), a chunk of each weight row in turn: the activation rows never
#: leave L1, and the four weight rows are four sequential streams the prefetchers keep up
#: with. Activation rows that fit `_CHUNK_VALUES` are read whole instead: one weight stream
#: is then the faster read.
_STREAM_CHUNK_VALUES = 512


class _E4M3Decoder:
    """Rebuilds 64 e4m3 bytes (<64 x i8>) as two <32 x bfloat> (weights 0-31, 32-63), exactly.

    Two 128-entry byte tables (``vpermi2b``, indexed by the low 7 bits) give each code's
    bfloat16 high and low bytes, the sign bit is or-ed into the high byte, and a two-source
    byte permutation (``vpermt2b``) interleaves low and high bytes into words: five
    instructions per 64 weights. The tables and the sign mask are made once, ahead of the
    loops, and hidden from LLVM behind an empty inline-asm statement, so that they stay in
    registers: as constants LLVM folds them into the loop's instructions as memory operands
    (extra loads per step).
    """

    def __init__(self, builder):
        self.builder = builder
        v64i8 = ir.VectorType(ir.IntType(8), _STEP)
        self.type = v64i8
        opaque = ir.FunctionType(v64i8, [v64i8])

        def register(values):
            return builder.asm(opaque, "", "=v,0", [ir.Constant(v64i8, values)], side_effect=False)

        self.high = (register(_HIGH_BYTES[:64]), register(_HIGH_BYTES[64:]))
        self.low = (register(_LOW_BYTES[:64]), register(_LOW_BYTES[64:]))
        self.sign = register([0x80] * _STEP)
        self.lookup = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(v64i8, [v64i8, v64i8, v64i8]), "llvm.x86.avx512.vpermi2var.qi.512"
        )

    def __call__(self, raw):
        builder, i32 = self.builder, ir.IntType(32)
        high = builder.call(self.lookup, [self.high[0], raw, self.high[1]])
        high = builder.or_(high, builder.and_(raw, self.sign))
        low = builder.call(self.lookup, [self.low[0], raw, self.low[1]])
        halves = []
        for first in (0, LANES):
            order = [i for k in range(first, first + LANES) for i in (k, _STEP + k)]  # little-endian words
            words = builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(i32, _STEP), order))
            halves.append(builder.bitcast(words, ir.VectorType(BFloat16Type(), LANES)))
        return halves


@intrinsic
def _dot_e4m3_tile(typingctx, w, w_rows, xs, x_rows, factors, bk, out):
    """out[i * len(x_rows) + j] = sum_g factors[j, g] * (w[w_rows[i]] . xs[x_rows[j]] over
    group g of bk columns), for 1 to 4 weight rows, e4m3 bytes (``w`` uint8 [*, K], decoded in
    registers), and 1 to 4 rows of e4m3 activations as bfloat16 bits (``xs`` uint16 [*, K]); both
    C-contiguous, K and bk multiples of 64 (`_STEP`), ``factors`` float32 [>= len(x_rows), G]
    C-contiguous (G = ceil(K / bk)), ``out`` float32 [>= the tile's size]. Each weight row is
    read once for the activation rows, in chunks of whole groups (`_CHUNK_VALUES`,
    `_STREAM_CHUNK_VALUES`). Each group's sum is two sums (the first and second 32 columns of
    each 64-column step) added at the group's end: one summation order whatever the tile's
    shape, so a dot's bits do not depend on it."""
    tuples_ok = all(
        isinstance(t, types.UniTuple) and 1 <= t.count <= _WEIGHT_TILE and isinstance(t.dtype, types.Integer)
        for t in (w_rows, x_rows)
    )
    arrays_ok = (
        isinstance(w, types.Array)
        and w.ndim == 2
        and w.dtype == types.uint8
        and w.layout == "C"
        and isinstance(xs, types.Array)
        and xs.ndim == 2
        and xs.dtype == types.uint16
        and xs.layout == "C"
        and isinstance(factors, types.Array)
        and factors.ndim == 2
        and factors.dtype == types.float32
        and factors.layout == "C"
        and isinstance(out, types.Array)
        and out.ndim == 1
        and out.dtype == types.float32
    )
    if not (tuples_ok and arrays_ok and isinstance(bk, types.Integer)):
        return None
    count = x_rows.count

    def codegen(context, builder, signature, args):
        v64i8, v32i16 = ir.VectorType(ir.IntType(8), _STEP), ir.VectorType(ir.IntType(16), LANES)
        v16f = ir.VectorType(ir.FloatType(), 16)
        v32bf = ir.VectorType(BFloat16Type(), LANES)
        dot = dot_function(builder)
        w_ptrs, cols = row_pointers(context, builder, signature.args[0], args[0], w_rows, args[1], v64i8)
        x_ptrs, _ = row_pointers(context, builder, signature.args[2], args[2], x_rows, args[3], v32i16)
        index_type = cols.type
        one, two = ir.Constant(index_type, 1), ir.Constant(index_type, 2)
        factor_view = context.make_array(signature.args[4])(context, builder, args[4])
        groups = builder.extract_value(factor_view.shape, 1)
        per_group_columns = context.cast(builder, args[5], signature.args[5], types.intp)
        per_group = builder.udiv(per_group_columns, ir.Constant(index_type, _STEP))
        steps = builder.udiv(cols, ir.Constant(index_type, _STEP))
        zero = ir.Constant(v16f, [0.0] * 16)
        fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(v16f, [v16f, v16f, v16f]), "llvm.fma.v16f32"
        )
        decode = _E4M3Decoder(builder)
        # Per (weight row, activation row): a group's sum in two parts (the first and the
        # second 32 columns of each step), added at the group's end, then times the group's
        # factor fused into the row's total (one rounding). The same order whatever the
        # tile's shape, so results do not depend on it.
        parts = {(i, j): accumulators(builder, 2, v16f) for i in range(len(w_ptrs)) for j in range(count)}
        totals = {(i, j): accumulators(builder, 1, v16f)[0] for i in range(len(w_ptrs)) for j in range(count)}

        def step_dots(i, step):  # weight row i's 64 columns at ``step`` against every activation row
            halves = decode(builder.load(builder.gep(w_ptrs[i], [step]), align=1))
            for h in range(2):
                at = builder.add(builder.mul(step, two), ir.Constant(index_type, h))
                for j, x_ptr in enumerate(x_ptrs):
                    x = builder.bitcast(builder.load(builder.gep(x_ptr, [at]), align=2), v32bf)
                    part = parts[i, j][h]
                    builder.store(builder.call(dot, [builder.load(part), halves[h], x]), part)

        def group(i, g, steps_of_group):
            for j in range(count):
                for part in parts[i, j]:
                    builder.store(zero, part)
            steps_of_group(i, g)
            for j in range(count):
                at = builder.add(builder.mul(ir.Constant(index_type, j), groups), g)
                factor = splat(builder, builder.load(builder.gep(factor_view.data, [at])), 16)
                low, high = (builder.load(part) for part in parts[i, j])
                total = totals[i, j]
                builder.store(builder.call(fma, [builder.fadd(low, high), factor, builder.load(total)]), total)

        def two_steps(i, g):  # bk = 128, the checkpoints' block: the group unrolled
            first = builder.mul(g, two)
            step_dots(i, first)
            step_dots(i, builder.add(first, one))

        def any_steps(i, g):
            begin = builder.mul(g, per_group)
            end = builder.add(begin, per_group)
            end = builder.select(builder.icmp_unsigned("<", end, steps), end, steps)
            with cgutils.for_range_slice(builder, begin, end, one) as (step, _):
                step_dots(i, step)

        # Columns in chunks of whole groups, every weight row's chunk in turn (`_CHUNK_VALUES`,
        # `_STREAM_CHUNK_VALUES`).
        fits = builder.icmp_unsigned(
            "<=", builder.mul(cols, ir.Constant(index_type, count)), ir.Constant(index_type, _CHUNK_VALUES)
        )
        chunk_columns = builder.select(fits, cols, ir.Constant(index_type, _STREAM_CHUNK_VALUES // count))
        chunk_groups = builder.udiv(chunk_columns, per_group_columns)
        chunk_groups = builder.select(
            builder.icmp_unsigned("==", chunk_groups, ir.Constant(index_type, 0)), one, chunk_groups
        )
        chunks = builder.udiv(builder.add(groups, builder.sub(chunk_groups, one)), chunk_groups)
        # A whole last group where the columns end on one (the kernels' shapes: K and bk
        # multiples of 64, and in practice bk = 128).
        whole_pairs = builder.and_(
            builder.icmp_unsigned("==", per_group, two), builder.icmp_unsigned("==", builder.mul(groups, two), steps)
        )
        with builder.if_else(whole_pairs) as (unrolled, looped):
            for steps_of_group, block in ((two_steps, unrolled), (any_steps, looped)):
                with block:
                    with cgutils.for_range(builder, chunks) as chunk:
                        g_first = builder.mul(chunk.index, chunk_groups)
                        g_last = builder.add(g_first, chunk_groups)
                        g_last = builder.select(builder.icmp_unsigned("<", g_last, groups), g_last, groups)
                        for i in range(len(w_ptrs)):  # one after the other: one stream where whole
                            with cgutils.for_range_slice(builder, g_first, g_last, one) as (g, _):
                                group(i, g, steps_of_group)
        values = [builder.load(totals[i, j]) for i in range(len(w_ptrs)) for j in range(count)]
        out_view = context.make_array(signature.args[6])(context, builder, args[6])
        for k, value in enumerate(sum_lanes(builder, values)):
            builder.store(value, builder.gep(out_view.data, [ir.Constant(index_type, k)]))
        return context.get_dummy_value()

    return types.none(w, w_rows, xs, x_rows, factors, bk, out), codegen


# The many-row path: an expert with more than `_DECODE_ROWS_ABOVE` rows has its weight rows
# decoded and packed 32 at a time, each pair of columns of 16 rows one vector
# (`_decode_e4m3_packed`), and the dots run as outer products (`_dot_packed_tile`): each
# ``vdpbf16ps`` multiplies one activation pair, broadcast, by the pair of 16 weight rows, so
# a vector lane is one output and a group of bk columns is bk / 2 instructions into the same
# accumulators before its factor is applied; the dot kernels above close theirs every four
# instructions.

#: Weight rows per packed buffer (two vectors of 16).
_PACKED_ROWS = 32


def _transpose_16x16(builder, vectors):
    """The 16 x 16 transpose of 16 vectors of 16 lanes: four stages, each swapping the
    off-diagonal blocks of b x b lanes between rows i and i + b (b = 8, 4, 2, 1)."""
    i32 = ir.IntType(32)
    rows = list(vectors)
    for b in (8, 4, 2, 1):
        low = [lane if not lane & b else 16 + lane - b for lane in range(16)]
        high = [lane + b if not lane & b else 16 + lane for lane in range(16)]
        for i in range(16):
            if i & b:
                continue
            a, c = rows[i], rows[i + b]
            rows[i] = builder.shuffle_vector(a, c, ir.Constant(ir.VectorType(i32, 16), low))
            rows[i + b] = builder.shuffle_vector(a, c, ir.Constant(ir.VectorType(i32, 16), high))
    return rows


@intrinsic
def _decode_e4m3_packed(typingctx, w, first, packed):
    """packed[p, r] = the bfloat16 bits of (w[first + r, 2p], w[first + r, 2p + 1]) as one
    uint32 (low half first) for r < 32: 32 e4m3 rows (``w`` uint8 [*, K], C-contiguous, K a
    multiple of 64) decoded and packed column pair by column pair (``packed`` uint32
    [K / 2, 32], C-contiguous), through 16 x 16 transposes in registers."""
    if not (
        isinstance(w, types.Array)
        and w.ndim == 2
        and w.dtype == types.uint8
        and w.layout == "C"
        and isinstance(packed, types.Array)
        and packed.ndim == 2
        and packed.dtype == types.uint32
        and packed.layout == "C"
        and isinstance(first, types.Integer)
    ):
        return None

    def codegen(context, builder, signature, args):
        v64i8, v16i32 = ir.VectorType(ir.IntType(8), _STEP), ir.VectorType(ir.IntType(32), 16)
        source = context.make_array(signature.args[0])(context, builder, args[0])
        target = context.make_array(signature.args[2])(context, builder, args[2])
        cols = builder.extract_value(source.shape, 1)
        index_type = cols.type
        start = context.cast(builder, args[1], signature.args[1], types.intp)
        steps = builder.udiv(cols, ir.Constant(index_type, _STEP))
        src = builder.bitcast(source.data, v64i8.as_pointer())
        dst = builder.bitcast(target.data, v16i32.as_pointer())
        decode = _E4M3Decoder(builder)
        two = ir.Constant(index_type, 2)
        for half_block in range(_PACKED_ROWS // 16):
            with cgutils.for_range(builder, steps) as loop:
                halves = [[], []]
                for r in range(16):
                    row = builder.add(start, ir.Constant(index_type, 16 * half_block + r))
                    raw = builder.load(builder.gep(src, [builder.add(builder.mul(row, steps), loop.index)]), align=1)
                    for h, half in enumerate(decode(raw)):
                        halves[h].append(builder.bitcast(half, v16i32))
                for h in range(2):
                    for p, vector in enumerate(_transpose_16x16(builder, halves[h])):
                        pair = builder.add(
                            builder.mul(loop.index, ir.Constant(index_type, LANES)), ir.Constant(index_type, 16 * h + p)
                        )
                        at = builder.add(builder.mul(pair, two), ir.Constant(index_type, half_block))
                        builder.store(vector, builder.gep(dst, [at]), align=4)
        return context.get_dummy_value()

    return types.none(w, first, packed), codegen


@intrinsic
def _dot_packed_tile(typingctx, packed, xs, x_rows, factors, bk, out):
    """out[j * 32 + n] = sum_g factors[j, g] * (packed row n . xs[x_rows[j]] over group g of
    bk columns) for the 32 weight rows of ``packed`` (uint32 [K / 2, 32], `_decode_e4m3_packed`)
    and 1 to 4 rows of e4m3 activations as bfloat16 bits (``xs`` uint16 [*, K], C-contiguous),
    K and bk multiples of 64, ``factors`` float32 [>= len(x_rows), G] C-contiguous, ``out``
    float32 [>= 32 len(x_rows)]. Each lane sums its group in column order, pair by pair."""
    if not (
        isinstance(x_rows, types.UniTuple)
        and 1 <= x_rows.count <= _ROW_TILE
        and isinstance(x_rows.dtype, types.Integer)
        and isinstance(packed, types.Array)
        and packed.ndim == 2
        and packed.dtype == types.uint32
        and packed.layout == "C"
        and isinstance(xs, types.Array)
        and xs.ndim == 2
        and xs.dtype == types.uint16
        and xs.layout == "C"
        and isinstance(factors, types.Array)
        and factors.ndim == 2
        and factors.dtype == types.float32
        and factors.layout == "C"
        and isinstance(out, types.Array)
        and out.ndim == 1
        and out.dtype == types.float32
        and isinstance(bk, types.Integer)
    ):
        return None
    count = x_rows.count

    def codegen(context, builder, signature, args):
        v16i32, v16f = ir.VectorType(ir.IntType(32), 16), ir.VectorType(ir.FloatType(), 16)
        v32bf = ir.VectorType(BFloat16Type(), LANES)
        dot = dot_function(builder)
        fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(v16f, [v16f, v16f, v16f]), "llvm.fma.v16f32"
        )
        x_ptrs, cols = row_pointers(context, builder, signature.args[1], args[1], x_rows, args[2], ir.IntType(32))
        index_type = cols.type
        one = ir.Constant(index_type, 1)
        pairs = builder.udiv(cols, ir.Constant(index_type, 2))
        weights = builder.bitcast(
            context.make_array(signature.args[0])(context, builder, args[0]).data, v16i32.as_pointer()
        )
        factor_view = context.make_array(signature.args[3])(context, builder, args[3])
        groups = builder.extract_value(factor_view.shape, 1)
        group_pairs = builder.udiv(
            context.cast(builder, args[4], signature.args[4], types.intp), ir.Constant(index_type, 2)
        )
        zero = ir.Constant(v16f, [0.0] * 16)
        sums = {(j, t): accumulators(builder, 1, v16f)[0] for j in range(count) for t in range(2)}
        totals = {(j, t): accumulators(builder, 1, v16f)[0] for j in range(count) for t in range(2)}
        with cgutils.for_range(builder, groups) as group:
            g = group.index
            for acc in sums.values():
                builder.store(zero, acc)
            begin = builder.mul(g, group_pairs)
            end = builder.add(begin, group_pairs)
            end = builder.select(builder.icmp_unsigned("<", end, pairs), end, pairs)
            with cgutils.for_range_slice(builder, begin, end, one) as (p, _):
                row = builder.mul(p, ir.Constant(index_type, 2))
                w = [
                    builder.bitcast(
                        builder.load(builder.gep(weights, [builder.add(row, ir.Constant(index_type, t))]), align=4),
                        v32bf,
                    )
                    for t in range(2)
                ]
                for j, x_ptr in enumerate(x_ptrs):
                    x = builder.bitcast(splat(builder, builder.load(builder.gep(x_ptr, [p]), align=2), 16), v32bf)
                    for t in range(2):
                        acc = sums[j, t]
                        builder.store(builder.call(dot, [builder.load(acc), x, w[t]]), acc)
            for j in range(count):
                at = builder.add(builder.mul(ir.Constant(index_type, j), groups), g)
                factor = splat(builder, builder.load(builder.gep(factor_view.data, [at])), 16)
                for t in range(2):
                    total = totals[j, t]
                    builder.store(builder.call(fma, [builder.load(sums[j, t]), factor, builder.load(total)]), total)
        out = builder.bitcast(context.make_array(signature.args[5])(context, builder, args[5]).data, v16f.as_pointer())
        for (j, t), total in totals.items():
            builder.store(builder.load(total), builder.gep(out, [ir.Constant(index_type, 2 * j + t)]), align=4)
        return context.get_dummy_value()

    return types.none(packed, xs, x_rows, factors, bk, out), codegen


@numba.njit(fastmath=True, inline="always")
def _group_factors(s_a, rows, scale_row, factors):
    """factors[j, g] = s_a[rows[j], g] * scale_row[g]: activation row j's factor for group g
    against one weight block row."""
    for j in range(len(rows)):
        for g in range(scale_row.shape[0]):
            factors[j, g] = s_a[rows[j], g] * scale_row[g]


#: Experts with more rows than this take the packed outer-product path (`_decode_e4m3_packed`,
#: `_dot_packed_tile`); others read the e4m3 bytes for each group of four rows, from memory,
#: then from cache. Past this row count the packed tile wins (on the DeepSeek-V3 and
#: Qwen3-30B-A3B gate_up shapes): its decode is amortised over more rows.
_DECODE_ROWS_ABOVE = 8


@numba.njit(fastmath=True)
def _gate_up_rows_e4m3(weights, first, last, xs, x_rows, s_a, scale, inter, bn, bk, m, factors, dots, out):
    """out[m + j, n] for n in [first, last): gate_up rows n of one expert (``weights[n]``, its
    e4m3 rows) against the activation rows
    ``x_rows``; gate and up count their block rows apart."""
    nb = (inter + bn - 1) // bn
    count = len(x_rows)
    n = first
    while n < last:
        if n < inter:  # gate rows: block rows 0..nb-1
            b = n // bn
            segment_end = min(last, (b + 1) * bn, inter)
        else:  # up rows: block rows nb..2nb-1, counted from row I
            rb = (n - inter) // bn
            b = nb + rb
            segment_end = min(last, inter + (rb + 1) * bn)
        _group_factors(s_a, x_rows, scale[b], factors)
        while n + _WEIGHT_TILE <= segment_end:
            r = n
            _dot_e4m3_tile(weights, (r, r + 1, r + 2, r + 3), xs, x_rows, factors, bk, dots)
            for i in range(_WEIGHT_TILE):
                for j in range(count):
                    out[m + j, n + i] = dots[i * count + j]
            n += _WEIGHT_TILE
        while n < segment_end:
            _dot_e4m3_tile(weights, (n,), xs, x_rows, factors, bk, dots)
            for j in range(count):
                out[m + j, n] = dots[j]
            n += 1


@numba.njit(fastmath=True)
def _gate_up_groups(weights, first, last, xs, tokens, start, stop, s_a, scale, inter, bn, bk, factors, dots, out):
    """`_gate_up_rows_e4m3` for the expert's sorted rows [start, stop), four at a time."""
    for m in range(start, stop, _ROW_TILE):
        count = min(_ROW_TILE, stop - m)
        if count == 4:
            rows = (tokens[m], tokens[m + 1], tokens[m + 2], tokens[m + 3])
            _gate_up_rows_e4m3(weights, first, last, xs, rows, s_a, scale, inter, bn, bk, m, factors, dots, out)
        elif count == 3:
            rows3 = (tokens[m], tokens[m + 1], tokens[m + 2])
            _gate_up_rows_e4m3(weights, first, last, xs, rows3, s_a, scale, inter, bn, bk, m, factors, dots, out)
        elif count == 2:
            rows2 = (tokens[m], tokens[m + 1])
            _gate_up_rows_e4m3(weights, first, last, xs, rows2, s_a, scale, inter, bn, bk, m, factors, dots, out)
        else:
            _gate_up_rows_e4m3(weights, first, last, xs, (tokens[m],), s_a, scale, inter, bn, bk, m, factors, dots, out)


@numba.njit(fastmath=True, inline="always")
def _packed_rows(packed, xs, x_rows, s_a, scale_row, bk, factors, dots):
    """dots[j * 32 + n] for the activation rows ``x_rows`` (a tuple) against the 32 packed
    weight rows of one weight block row (``scale_row``): `_dot_packed_tile` with the rows'
    group factors."""
    _group_factors(s_a, x_rows, scale_row, factors)
    _dot_packed_tile(packed, xs, x_rows, factors, bk, dots)


@numba.njit(fastmath=True)
def _gate_up_packed(packed, n0, xs, tokens, start, stop, s_a, scale_row, bk, factors, dots, out):
    """out[m, n0 + n] for the expert's sorted rows m in [start, stop) and the 32 packed gate_up
    rows n (one weight block row: ``scale_row``), four rows m at a time."""
    for m in range(start, stop, _ROW_TILE):
        count = min(_ROW_TILE, stop - m)
        if count == 4:
            _packed_rows(
                packed, xs, (tokens[m], tokens[m + 1], tokens[m + 2], tokens[m + 3]), s_a, scale_row, bk, factors, dots
            )
        elif count == 3:
            _packed_rows(packed, xs, (tokens[m], tokens[m + 1], tokens[m + 2]), s_a, scale_row, bk, factors, dots)
        elif count == 2:
            _packed_rows(packed, xs, (tokens[m], tokens[m + 1]), s_a, scale_row, bk, factors, dots)
        else:
            _packed_rows(packed, xs, (tokens[m],), s_a, scale_row, bk, factors, dots)
        for j in range(count):
            for n in range(_PACKED_ROWS):
                out[m + j, n0 + n] = dots[j * _PACKED_ROWS + n]


@numba.njit(fastmath=True)
def _down_packed(packed, n0, acts, start, stop, s_a, scale_row, bk, tokens, slot_weights, factors, dots, sums):
    """sums[tokens[m], n0 + n] += slot_weights[m] * (row m of the intermediate) . (packed down
    row n) for m in [start, stop), four at a time."""
    for m in range(start, stop, _ROW_TILE):
        count = min(_ROW_TILE, stop - m)
        if count == 4:
            _packed_rows(packed, acts, (m, m + 1, m + 2, m + 3), s_a, scale_row, bk, factors, dots)
        elif count == 3:
            _packed_rows(packed, acts, (m, m + 1, m + 2), s_a, scale_row, bk, factors, dots)
        elif count == 2:
            _packed_rows(packed, acts, (m, m + 1), s_a, scale_row, bk, factors, dots)
        else:
            _packed_rows(packed, acts, (m,), s_a, scale_row, bk, factors, dots)
        for j in range(count):
            t, weight = tokens[m + j], slot_weights[m + j]
            for n in range(_PACKED_ROWS):
                sums[t, n0 + n] += weight * dots[j * _PACKED_ROWS + n]


@numba.njit(fastmath=True)
def _gate_up_item_bf16(xs, s_a, tokens, offsets, e, chunk, q_gate_up, gate_up_scale, inter, bn, bk, out):
    """`_gate_up_item` with the dot instructions: four weight rows at a time against up to
    four of the expert's rows (`_dot_e4m3_tile`); past `_DECODE_ROWS_ABOVE` rows, where the
    weight block rows are whole packs, the chunk's weight rows packed 32 at a time
    (`_decode_e4m3_packed`) for outer products (`_dot_packed_tile`)."""
    start, stop = offsets[e], offsets[e + 1]
    weights, scale = q_gate_up[e], gate_up_scale[e]
    first, last = chunk * ROW_BLOCK, min(q_gate_up.shape[1], (chunk + 1) * ROW_BLOCK)
    factors = np.empty((_ROW_TILE, gate_up_scale.shape[2]), np.float32)
    dots = np.empty(_WEIGHT_TILE * _ROW_TILE, np.float32)
    if stop - start > _DECODE_ROWS_ABOVE and bn % _PACKED_ROWS == 0:  # inter: a multiple of 64
        packed = np.empty((q_gate_up.shape[2] // 2, _PACKED_ROWS), np.uint32)
        packed_dots = np.empty(_ROW_TILE * _PACKED_ROWS, np.float32)
        nb = (inter + bn - 1) // bn
        for sub in range(first, last, _PACKED_ROWS):
            _decode_e4m3_packed(weights, sub, packed)
            b = sub // bn if sub < inter else nb + (sub - inter) // bn
            _gate_up_packed(packed, sub, xs, tokens, start, stop, s_a, scale[b], bk, factors, packed_dots, out)
    else:
        _gate_up_groups(weights, first, last, xs, tokens, start, stop, s_a, scale, inter, bn, bk, factors, dots, out)


@parallel_and_serial(fastmath=True, cache=True)
def gate_up_rows_bf16(xs, s_a, tokens, offsets, work, q_gate_up, gate_up_scale, inter, bn, bk, out):
    """`gate_up_rows` with the dot instructions (`BF16_DOT`; never call it elsewhere, and only
    where `bf16_dot_serves`): ``xs`` [T, H] uint16, the activations' e4m3 values as bfloat16
    bits; the other arguments as `gate_up_rows`."""
    for item in numba.prange(work.shape[0]):
        _gate_up_item_bf16(
            xs, s_a, tokens, offsets, work[item, 0], work[item, 1], q_gate_up, gate_up_scale, inter, bn, bk, out
        )


gate_up_rows_bf16_serial = gate_up_rows_bf16.serial


@numba.njit(fastmath=True)
def _down_rows_e4m3(weights, first, last, acts, a_rows, s_a, scale, bn, bk, tokens, slot_weights, factors, dots, sums):
    """sums[tokens[m], n] += slot_weights[m] * (row m of the intermediate) . (down row n,
    ``weights[n]``), for the rows m of ``a_rows`` and n in [first, last)."""
    count = len(a_rows)
    n = first
    while n < last:
        b = n // bn
        segment_end = min(last, (b + 1) * bn)
        _group_factors(s_a, a_rows, scale[b], factors)
        while n + _WEIGHT_TILE <= segment_end:
            r = n
            _dot_e4m3_tile(weights, (r, r + 1, r + 2, r + 3), acts, a_rows, factors, bk, dots)
            for i in range(_WEIGHT_TILE):
                for j in range(count):
                    m = a_rows[j]
                    sums[tokens[m], n + i] += slot_weights[m] * dots[i * count + j]
            n += _WEIGHT_TILE
        while n < segment_end:
            _dot_e4m3_tile(weights, (n,), acts, a_rows, factors, bk, dots)
            for j in range(count):
                m = a_rows[j]
                sums[tokens[m], n] += slot_weights[m] * dots[j]
            n += 1


@numba.njit(fastmath=True)
def _down_groups(
    weights, first, last, acts, start, stop, s_a, scale, bn, bk, tokens, slot_weights, factors, dots, sums
):
    """`_down_rows_e4m3` for the expert's sorted rows [start, stop), four at a time."""
    for m in range(start, stop, _ROW_TILE):
        count = min(_ROW_TILE, stop - m)
        if count == 4:
            _down_rows_e4m3(
                weights,
                first,
                last,
                acts,
                (m, m + 1, m + 2, m + 3),
                s_a,
                scale,
                bn,
                bk,
                tokens,
                slot_weights,
                factors,
                dots,
                sums,
            )
        elif count == 3:
            _down_rows_e4m3(
                weights,
                first,
                last,
                acts,
                (m, m + 1, m + 2),
                s_a,
                scale,
                bn,
                bk,
                tokens,
                slot_weights,
                factors,
                dots,
                sums,
            )
        elif count == 2:
            _down_rows_e4m3(
                weights, first, last, acts, (m, m + 1), s_a, scale, bn, bk, tokens, slot_weights, factors, dots, sums
            )
        else:
            _down_rows_e4m3(
                weights, first, last, acts, (m,), s_a, scale, bn, bk, tokens, slot_weights, factors, dots, sums
            )


@numba.njit(fastmath=True)
def _down_block_bf16(
    acts, s_a, tokens, slot_weights, offsets, experts, q_down, down_scale, bn, bk, sums, block, columns
):
    """Output columns [block * columns, ..) over every hit expert, with the dot instructions
    (`_dot_e4m3_tile`); an expert with more than `_DECODE_ROWS_ABOVE` rows, where the weight
    block rows are whole packs, has its weight rows packed 32 at a time
    (`_decode_e4m3_packed`) for outer products (`_dot_packed_tile`)."""
    first, last = block * columns, min(q_down.shape[1], (block + 1) * columns)
    factors = np.empty((_ROW_TILE, down_scale.shape[2]), np.float32)
    dots = np.empty(_WEIGHT_TILE * _ROW_TILE, np.float32)
    packed = np.empty((q_down.shape[2] // 2, _PACKED_ROWS), np.uint32)
    packed_dots = np.empty(_ROW_TILE * _PACKED_ROWS, np.float32)
    for i in range(experts.shape[0]):
        e = experts[i]
        weights, scale = q_down[e], down_scale[e]
        start, stop = offsets[e], offsets[e + 1]
        if stop - start > _DECODE_ROWS_ABOVE and bn % _PACKED_ROWS == 0:  # first, last: multiples of 64
            for sub in range(first, last, _PACKED_ROWS):
                _decode_e4m3_packed(weights, sub, packed)
                _down_packed(
                    packed,
                    sub,
                    acts,
                    start,
                    stop,
                    s_a,
                    scale[sub // bn],
                    bk,
                    tokens,
                    slot_weights,
                    factors,
                    packed_dots,
                    sums,
                )
        else:
            _down_groups(
                weights, first, last, acts, start, stop, s_a, scale, bn, bk, tokens, slot_weights, factors, dots, sums
            )


@parallel_and_serial(fastmath=True, cache=True)
def down_rows_bf16(acts, s_a, tokens, slot_weights, offsets, experts, q_down, down_scale, bn, bk, sums, threaded=True):
    """`down_rows` with the dot instructions (`BF16_DOT`, where `bf16_dot_serves`): ``acts``
    [M, I] uint16, the intermediate's e4m3 values as bfloat16 bits; the other arguments as
    `down_rows`. Threads split the output columns; the serial form (``threaded=False``) takes
    them as one block, each expert's down weights read as one stream (the same sums, bit for bit)."""
    columns = ROW_BLOCK if threaded else max(1, q_down.shape[1])
    for block in numba.prange((q_down.shape[1] + columns - 1) // columns):
        _down_block_bf16(
            acts, s_a, tokens, slot_weights, offsets, experts, q_down, down_scale, bn, bk, sums, block, columns
        )


down_rows_bf16_serial = down_rows_bf16.serial


def bf16_dot_serves(hidden: int, inter: int, gate_up_block, down_block) -> bool:
    """Whether the bfloat16-dot kernels run these shapes: `BF16_DOT`, and every row length
    (H for gate_up, I for down) and column block a whole number of 64-weight steps."""
    return (
        BF16_DOT
        and hidden % _STEP == 0
        and inter % _STEP == 0
        and gate_up_block[1] % _STEP == 0
        and down_block[1] % _STEP == 0
    )
