"""Numba CPU kernels of the FP8 expert GEMMs: e4m3 weights decoded in registers as they are read.

FP8 is a plug-in of the experts' one tiled loop (`moeroute.experts.cpu.tiles`): two families
of ``load`` / ``dots`` / ``segment``, each `tiles.row_kernels`' copies of the loop (`widened`,
`bf16_dot`: the standalone `gate_up_rows`, `down_rows` and their generated serial forms, and
the work item and column block of the one-call forwards of `moeroute.experts.cpu.quant_rows`).
Each weight row is read once and dotted with every row its expert serves, so memory
carries one byte per weight whatever the row count. The weights' block scales enter through
the loop's ``segment``: a tile of weight rows never straddles two weight block rows, and
the activation rows are prepared for the block row the tile is in.

`widened` (any CPU): an e4m3 weight byte is decoded with three integer SIMD instructions
(`_e4m3_times_2_pow_minus_120`: ``q * 2**-120``, exact; e4m3 subnormals become float32
subnormals, so a process that sets the CPU's denormals-are-zero mode would read those
weights, below 2**-6 of their block's largest, as zero); the activations come as their e4m3
values (float32) and scales. For each weight block row, the activation rows are scaled first
(`_scaled_rows`: the e4m3 value times ``s_a * s_w * 2**120`` of its group, a row with values
that large scaled down by a power of two that its dots then undo), so a dot runs over the
whole row with one set of vector accumulators: the definition's ``sum_g s_a * s_w * dot_g``
up to float32 rounding and summation order. Two weight rows by four activation rows at a
time (pairs and a plain pass for the last rows). The dequantizers (`dequantize_rows`) decode
whole rows into a float32 buffer (`_decode_row`) for the BLAS path.

`bf16_dot` (CPUs with AVX512-BF16, where `bf16_dot_serves`): the e4m3 values taken as
bfloat16, exactly, and multiplied with the bfloat16 dot instruction one group of bk columns
at a time, each group's sum times ``s_a * s_w`` (the definition's order): as dots of weight
rows for experts with few rows, as outer products of packed weight rows for experts with
many; see the sections at the end of this module.

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
from numba.extending import intrinsic, overload

from moeroute.experts.cpu import tiles
from moeroute.experts.cpu.dot import (
    BF16_DOT,
    LANES,
    BFloat16Type,
    accumulators,
    dot_function,
    prefetch,
    row_ahead,
    row_pointers,
    splat,
    sum_lanes,
)

__all__ = [
    "gate_up_rows",
    "gate_up_rows_serial",
    "down_rows",
    "down_rows_serial",
    "widened",
    "gate_up_rows_bf16",
    "gate_up_rows_bf16_serial",
    "down_rows_bf16",
    "down_rows_bf16_serial",
    "bf16_dot",
    "bf16_dot_serves",
    "dequantize_rows",
    "quantize_rows",
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
ROW_BLOCK = tiles.ROW_BLOCK
#: Activation rows dotted per pass over a decoded weight row.
_ROW_TILE = tiles.ROW_TILE


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
    """out[4i + j] = `_dot`(w_i, x_j) for two weight rows and four activation rows: eight
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
    out[0], out[1], out[2], out[3] = a0, a1, a2, a3
    out[4], out[5], out[6], out[7] = b0, b1, b2, b3


@intrinsic
def _prefetch_row(typingctx, array, row):
    """Ask the CPU to bring row ``row`` of the 2-D C-contiguous ``array`` into its caches
    (``llvm.prefetch`` of each 64-byte line); a row past the end is skipped."""
    if not (isinstance(array, types.Array) and array.ndim == 2 and isinstance(row, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        view = context.make_array(signature.args[0])(context, builder, value=args[0])
        i64, byte_ptr = ir.IntType(64), ir.IntType(8).as_pointer()
        strides = cgutils.unpack_tuple(builder, view.strides, 2)
        shape = cgutils.unpack_tuple(builder, view.shape, 2)
        row_index = context.cast(builder, args[1], signature.args[1], types.int64)
        inside = builder.icmp_unsigned("<", row_index, shape[0])
        with builder.if_then(inside):
            start = builder.add(builder.ptrtoint(view.data, i64), builder.mul(row_index, strides[0]))
            nbytes = builder.mul(shape[1], strides[1])
            with cgutils.for_range_slice(builder, ir.Constant(i64, 0), nbytes, ir.Constant(i64, 64)) as (offset, _):
                prefetch(builder, builder.inttoptr(builder.add(start, offset), byte_ptr))
        return context.get_dummy_value()

    return types.none(array, row), codegen


#: Weight rows asked for ahead of the one being dotted (`_prefetch_row`).
_PREFETCH_ROWS = 2


@numba.njit
def _block_row(s, n, last):
    """(b, end): the weight block row b of weight row n of ``s = (scale, split, bn, bk)`` and
    the row where it ends (at most ``last``); rows from ``split`` on (gate_up's up rows: I;
    down: H, none) count their block rows from row ``split``, after the first rows' ones."""
    split, bn = s[1], s[2]
    if n < split:
        b = n // bn
        return b, min(last, (b + 1) * bn, split)
    rb = (n - split) // bn
    return (split + bn - 1) // bn + rb, min(last, split + (rb + 1) * bn)


@numba.njit
def _scaled_scratch(w, s, xs, rows):
    """The float kernels' scratch: the expert's activation rows scaled for one weight block
    row (`_scaled_rows`), their power-of-two shifts, and their positions 0, 1, ..."""
    return np.empty((rows, w.shape[2]), np.float32), np.empty(rows, np.float64), np.arange(rows)


@numba.njit(fastmath=True)
def _scaled_segment(xs, rows, w, s, e, n, last, scratch):
    """The tiled loop's ``segment`` (`moeroute.experts.cpu.tiles`) of the float kernels: the
    weight rows of one weight block row, and the expert's activation rows ``xs = (q_a, s_a)``
    scaled for it (`_scaled_rows`), read by position."""
    b, end = _block_row(s, n, last)
    scaled, unscale, positions = scratch
    count = rows.shape[0]
    _scaled_rows(xs[0], xs[1], rows, 0, count, s[0][e, b], s[3], scaled, unscale)
    return end, (scaled, unscale), positions[:count]


@numba.njit
def _expert_rows(w, s, e, n, count, scratch):
    """The float kernels' ``load``: expert e's e4m3 weights (a view); the dots read rows n ..
    n + count - 1 from it as they go (`_e4m3_dots`)."""
    return w[e]


def _e4m3_dots(operand, n, count, xs, x_rows, out):  # pragma: no cover - replaced by the overload inside Numba code
    raise NotImplementedError


@overload(_e4m3_dots, jit_options={"fastmath": True})
def _e4m3_dots_impl(operand, n, count, xs, x_rows, out):
    """The float kernels' dots of e4m3 weight rows n .. n + count - 1 of ``operand`` (the
    expert's weights) with activation rows of ``xs = (scaled, unscale)``: two weight rows by
    four activation rows in one pass (`_dot2x4`), a last weight row by four (`_dot4`); fewer
    activation rows by pairs (`_dot2`) and one plain pass (one row: one weight row at a
    time); then the dots of rows that `_scaled_rows` shifted multiplied back. One call runs a
    whole tile of weight rows (`_WIDENED_TILE`), the rows `_PREFETCH_ROWS` ahead asked for
    as it goes: a call per weight row or pair would cost the dots of a decode step as much
    as a third of their time."""
    if isinstance(x_rows, types.UniTuple) and x_rows.count == _ROW_TILE:

        def four(operand, n, count, xs, x_rows, out):
            scaled = xs[0]
            x0, x1, x2, x3 = scaled[x_rows[0]], scaled[x_rows[1]], scaled[x_rows[2]], scaled[x_rows[3]]
            paired = count // 2 * 2
            for i in range(0, paired, 2):
                r = n + i
                _prefetch_row(operand, r + _PREFETCH_ROWS)
                _prefetch_row(operand, r + _PREFETCH_ROWS + 1)
                _dot2x4(operand[r], operand[r + 1], x0, x1, x2, x3, out[4 * i :])
            if paired < count:
                _dot4(operand[n + paired], x0, x1, x2, x3, out[4 * paired :])
            _unshift(xs[1], x_rows, count, out)

        return four

    def fewer(operand, n, count, xs, x_rows, out):
        scaled = xs[0]
        rows = len(x_rows)
        if rows == 1:
            x = scaled[x_rows[0]]
            for i in range(count):
                _prefetch_row(operand, n + i + _PREFETCH_ROWS)
                out[i] = _dot(operand[n + i], x)
        else:
            paired = rows // 2 * 2
            for i in range(count):
                r = n + i
                if i % 2 == 0:
                    _prefetch_row(operand, r + _PREFETCH_ROWS)
                    _prefetch_row(operand, r + _PREFETCH_ROWS + 1)
                w = operand[r]
                for j in range(0, paired, 2):
                    out[i * rows + j], out[i * rows + j + 1] = _dot2(w, scaled[x_rows[j]], scaled[x_rows[j + 1]])
                if paired < rows:
                    out[i * rows + paired] = _dot(w, scaled[x_rows[paired]])
        _unshift(xs[1], x_rows, count, out)

    return fewer


@numba.njit(fastmath=True, inline="always")
def _unshift(unscale, x_rows, count, out):
    """out[i * len(x_rows) + j] *= unscale[x_rows[j]] where a row was shifted (`_scaled_rows`)."""
    for j in range(len(x_rows)):
        u = unscale[x_rows[j]]
        if u != 1.0:
            for i in range(count):
                k = i * len(x_rows) + j
                out[k] = np.float32(out[k] * u)


#: The float kernels' weight tile: a block of `tiles.ROW_BLOCK` rows in one ``dots`` call
#: (a segment's shorter rest, one call too: its rows paired from its first, as in a whole tile).
_WIDENED_TILE = tiles.ROW_BLOCK


#: The tiled loop (`moeroute.experts.cpu.tiles`) around the float kernels' dots, a block of
#: e4m3 weight rows by four scaled activation rows. Arguments: ``xs = (q_a, s_a)``, the
#: activations' e4m3 values (float32 [T, K], or the rows as they are for w8a16) and their
#: scales [T, G] per weight column block; ``s = (scale, split, bn, bk)``, the weight's block
#: scales [L, nb', G], the row from which block rows count apart (gate_up: I, down: H) and
#: the block (bn, bk); ``bias`` [0, 0] (none).
widened = tiles.row_kernels(
    __name__,
    "fp8",
    _expert_rows,
    _e4m3_dots,
    _WIDENED_TILE,
    scratch=_scaled_scratch,
    segment=_scaled_segment,
    partial_tiles=True,
)
gate_up_rows, gate_up_rows_serial, down_rows, down_rows_serial = (widened[name] for name in tiles.KERNELS)


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
#: Weight rows ahead of the one being dotted whose lines `_dot_e4m3_tile` asks for
#: (``llvm.prefetch``): the next tile's (`_WEIGHT_TILE` rows on), whose short streams would
#: otherwise start cold.
_DOT_PREFETCH_ROWS = _WEIGHT_TILE


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
        # each weight row's lines are asked for `_DOT_PREFETCH_ROWS` rows on as it is read
        w_view = context.make_array(signature.args[0])(context, builder, args[0])
        ahead_ptrs = [
            row_ahead(
                builder,
                w_view.data,
                context.cast(builder, row, w_rows.dtype, types.intp),
                _DOT_PREFETCH_ROWS,
                builder.extract_value(w_view.shape, 0),
                cols,
                v64i8,
            )
            for row in cgutils.unpack_tuple(builder, args[1], w_rows.count)
        ]
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
            prefetch(builder, builder.gep(ahead_ptrs[i], [step]))
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


@numba.njit
def _dot_scratch(w, s, xs, rows):
    """The dot kernels' scratch: the group factors of a tile's activation rows, the packed
    weight rows (allocated only where an expert of ``rows`` rows takes them), their dots,
    and whether the current expert's rows take them (set by `_block_segment`)."""
    packs = rows > _DECODE_ROWS_ABOVE and s[2] % _PACKED_ROWS == 0
    return (
        np.empty((_ROW_TILE, s[0].shape[2]), np.float32),
        np.empty((w.shape[2] // 2 if packs else 0, _PACKED_ROWS), np.uint32),
        np.empty(_ROW_TILE * _PACKED_ROWS, np.float32),
        np.zeros(1, np.bool_),
    )


@numba.njit
def _block_segment(xs, rows, w, s, e, n, last, scratch):
    """The tiled loop's ``segment`` of the dot kernels: the weight rows of one weight block
    row; the activations ``xs = (bits, s_a)`` with that block row's scales. Marks in the
    scratch whether the expert's rows take the packed tiles (more than `_DECODE_ROWS_ABOVE`
    rows, block rows of whole packs)."""
    b, end = _block_row(s, n, last)
    scratch[3][0] = rows.shape[0] > _DECODE_ROWS_ABOVE and s[2] % _PACKED_ROWS == 0
    return end, (xs[0], xs[1], s[0][e, b]), rows


@numba.njit
def _e4m3_rows(w, s, e, n, count, scratch):
    """The dot kernels' ``load``: expert e's e4m3 weights (a view), with a whole tile of
    `_PACKED_ROWS` rows decoded and packed once (`_decode_e4m3_packed`) where the expert's
    rows take the packed tiles."""
    if count == _PACKED_ROWS and scratch[3][0]:
        _decode_e4m3_packed(w[e], n, scratch[1])
    return w[e], scratch, s[3]


@numba.njit(fastmath=True)
def _e4m3_tile_dots(operand, n, count, xs, x_rows, out):
    """The dot kernels' dots of weight rows n .. n + count - 1 (`_PACKED_ROWS` or 1) with the
    activation rows ``x_rows`` of ``xs = (bits, s_a, scale_row)``: each row's group factors
    against the block row (`_group_factors`), then the packed outer products
    (`_dot_packed_tile`, its dots put in the tile's order) or `_dot_e4m3_tile` four weight
    rows at a time. A dot's sum does not depend on the tile it is computed in."""
    weights, scratch, bk = operand
    factors, packed, packed_dots, packs = scratch
    bits, s_a, scale_row = xs
    _group_factors(s_a, x_rows, scale_row, factors)
    rows = len(x_rows)
    if count == 1:
        _dot_e4m3_tile(weights, (n,), bits, x_rows, factors, bk, out)
    elif packs[0]:
        _dot_packed_tile(packed, bits, x_rows, factors, bk, packed_dots)
        for i in range(_PACKED_ROWS):
            for j in range(rows):
                out[i * rows + j] = packed_dots[j * _PACKED_ROWS + i]
    else:
        for i in range(0, count, _WEIGHT_TILE):
            r = n + i
            _dot_e4m3_tile(weights, (r, r + 1, r + 2, r + 3), bits, x_rows, factors, bk, out[i * rows :])


#: The tiled loop around the dot instructions: tiles of `_PACKED_ROWS` weight rows (packed,
#: or `_WEIGHT_TILE` at a time) by four activation rows (bfloat16 bits of their e4m3 values,
#: or of the rows themselves for w8a16). Arguments as `widened`'s, ``xs = (bits, s_a)``. Only
#: where `bf16_dot_serves` (never call them elsewhere).
bf16_dot = tiles.row_kernels(
    __name__, "fp8_dot", _e4m3_rows, _e4m3_tile_dots, _PACKED_ROWS, scratch=_dot_scratch, segment=_block_segment
)
gate_up_rows_bf16, gate_up_rows_bf16_serial, down_rows_bf16, down_rows_bf16_serial = (
    bf16_dot[name] for name in tiles.KERNELS
)


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
