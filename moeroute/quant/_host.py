"""Numba CPU kernels of the FP8 expert GEMMs: e4m3 weights decoded in registers as they are read.

The GEMM kernels (`gate_up_rows`, `down_rows`, and their one-thread forms) read each weight
row once and dot it with every row of quantized activations its expert serves, so memory
carries one byte per weight whatever the row count; the structure is that of the bfloat16
row kernels of `moeroute.bindings.torch._rows` (one row a plain pass, two weight rows by four
activation rows at a time, serial forms for one thread). An e4m3 weight byte is decoded with
integer SIMD and the float16 widening (`_e4m3_times_2_pow_minus_8`: ``q * 2**-8``, exact,
never a float32 subnormal); the activations come as their e4m3 values (float32) and scales.
For each weight block row, the activation rows are scaled first (`_scaled_rows`: the e4m3
value times ``s_a * s_w * 2**8`` of its group), so a dot runs over the whole row with one set
of vector accumulators: the definition's ``sum_g s_a * s_w * dot_g`` up to float32 rounding
and summation order. The dequantizers (`dequantize_rows`)
decode whole rows into a float32 buffer (`_decode_row`) for the BLAS path.

Arrays are NumPy: weights as uint8 views of float8_e4m3fn tensors, scales float32, sums
float32. Block scales are indexed ``scale[e, row // bn, col // bk]``; per-tensor FP8 is the
same kernel with one block spanning each matrix (or each of gate and up).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

__all__ = ["gate_up_rows", "gate_up_rows_serial", "down_rows", "down_rows_serial", "dequantize_rows",
           "dequantize_rows_bf16", "ROW_BLOCK"]

#: 2**120: a float32 holding e4m3 bits in its low exponent/mantissa bits is q * 2**-120.
_UNBIAS = np.float32(2.0 ** 120)


@numba.njit(fastmath=True)
def _decode_row(q_row, bits):
    """bits (int32 [K]) <- the float32 bits of q_row * 2**-120 (exact, subnormals included)."""
    for k in range(q_row.shape[0]):
        b = np.int32(q_row[k])
        bits[k] = ((b & 0x7F) << 20) | ((b & 0x80) << 24)


@intrinsic
def _e4m3_times_2_pow_minus_8(typingctx, byte):
    """The float32 ``q * 2**-8`` of an e4m3 byte, exactly, by way of a float16.

    The byte moved into a 16-bit word's high half (``b << 8``: sign at bit 15, exponent and
    mantissa at bits 8-14), shifted right arithmetically by one and masked to clear the
    copy of the sign at bit 14, is a float16 with e4m3's 4 exponent and 3 mantissa bits on
    top of float16's 5 and 10: its value is ``q * 2**(7 - 15)``, e4m3 subnormals included
    (they land on float16 subnormals). The widening to float32 (``vcvtph2ps``) is exact and
    gives a normal float32 for every finite e4m3 value, so no float32 subnormal reaches the
    multiplies (x86 takes slow assists on those). LLVM vectorizes the shift, mask and widening.
    """
    def codegen(context, builder, signature, args):
        i16 = ir.IntType(16)
        high = builder.shl(builder.zext(args[0], i16), ir.Constant(i16, 8))
        half = builder.and_(builder.ashr(high, ir.Constant(i16, 1)), ir.Constant(i16, 0xBFFF))
        return builder.fpext(builder.bitcast(half, ir.HalfType()), ir.FloatType())

    return types.float32(types.uint8), codegen


#: 2**8: undoes the 2**-8 of `_e4m3_times_2_pow_minus_8`; folded into the group scales.
_DECODE_UNSCALE = np.float32(2.0 ** 8)
#: Weight rows per unit of parallel work (gate_up) and output columns per thread block (down).
ROW_BLOCK = 64
#: Activation rows dotted per pass over a decoded weight row.
_ROW_TILE = 4


@numba.njit(fastmath=True)
def _scaled_rows(q_a, s_a, rows, start, stop, scale_row, bk, dst):
    """dst[i, k] = q_a[r, k] * (s_a[r, g] * scale_row[g] * 2**8) for r = rows[start + i] and
    g = k // bk: activation row r with the factor of its group g against one weight block
    row folded in, so that the dots below are plain dots over every column."""
    cols = q_a.shape[1]
    for i in range(stop - start):
        r = rows[start + i]
        x, sa, d = q_a[r], s_a[r], dst[i]
        for g in range(scale_row.shape[0]):
            k0 = g * bk
            count = min(cols - k0, bk)
            factor = sa[g] * scale_row[g] * _DECODE_UNSCALE
            xg, dg = x[k0:k0 + count], d[k0:k0 + count]
            for k in range(count):
                dg[k] = xg[k] * factor


# The dots below run over every column of a weight row at once: each e4m3 weight decoded
# (times 2**-8) and multiplied by the scaled activation (`_scaled_rows`). One loop over the
# row keeps LLVM's vector accumulators from the first column to the last, with one
# horizontal sum per dot; a sum per group of bk columns, then times the group's factor (the
# definition's order), closed the vectors every bk columns and took 1.4x the time.


@numba.njit(fastmath=True)
def _dot(w, x):
    """dot(decoded w, x): w an e4m3 row (uint8), decoded in registers as it is read, x a
    scaled activation row (float32)."""
    acc = np.float32(0.0)
    for k in range(w.shape[0]):
        acc += _e4m3_times_2_pow_minus_8(w[k]) * x[k]
    return acc


@numba.njit(fastmath=True)
def _dot2(w, x0, x1):
    """(`_dot`(w, x0), `_dot`(w, x1)), w read and decoded once for the two."""
    a0 = a1 = np.float32(0.0)
    for k in range(w.shape[0]):
        wk = _e4m3_times_2_pow_minus_8(w[k])
        a0 += wk * x0[k]
        a1 += wk * x1[k]
    return a0, a1


@numba.njit(fastmath=True)
def _dot4(w, x0, x1, x2, x3, out):
    """out[i] = `_dot`(w, x_i) for four rows (w read and decoded once for the four)."""
    a0 = a1 = a2 = a3 = np.float32(0.0)
    for k in range(w.shape[0]):
        wk = _e4m3_times_2_pow_minus_8(w[k])
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
        u, v = _e4m3_times_2_pow_minus_8(w0[k]), _e4m3_times_2_pow_minus_8(w1[k])
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


@numba.njit(fastmath=True)
def _weight_rows_dots(xs, count, weights, first, last, tile, out, column):
    """out[i, column + n - first] = `_dot`(weights[n], xs[i]) for i < count, n in [first,
    last): one activation row a plain pass; else two weight rows by four activation rows at a
    time, the last one to three activation rows by pairs (`_dot2`) and one plain pass."""
    if count == 1:
        x, row = xs[0], out[0]
        for n in range(first, last):
            row[column + n - first] = _dot(weights[n], x)
        return
    tiled = count // _ROW_TILE * _ROW_TILE
    paired = tiled + (count - tiled) // 2 * 2
    for n in range(first, last, 2):
        pair = n + 1 < last
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
        _scaled_rows(q_a, s_a, tokens, start, stop, gate_up_scale[e, b], bk, scaled)
        _weight_rows_dots(scaled, stop - start, weights, n, segment_end, tile, rows_out, n)
        n = segment_end


@numba.njit(parallel=True, fastmath=True, cache=True)
def gate_up_rows(q_a, s_a, tokens, offsets, work, q_gate_up, gate_up_scale, inter, bn, bk, out):
    """out[m, :] = x[tokens[m]] @ W_e^T for each expert e's sorted rows m (first GEMM), with
    x = q_a * s_a per group of bk columns (the quantized activations).

    q_a [T, H] float32 (e4m3 values), s_a [T, G] float32 (G = ceil(H / bk)), tokens [M] int64,
    offsets [L + 1] int64, work [W, 2] int64 (expert, block of `ROW_BLOCK` weight rows of
    gate_up), q_gate_up [L, 2I, H] uint8, gate_up_scale [L, 2nb, G] float32 (block rows
    0..nb-1 the gate's, nb..2nb-1 the up's, nb = ceil(I / bn)), out [M, 2I] float32.
    """
    for item in numba.prange(work.shape[0]):
        _gate_up_item(q_a, s_a, tokens, offsets, work[item, 0], work[item, 1], q_gate_up, gate_up_scale,
                      inter, bn, bk, out)


@numba.njit(fastmath=True, cache=True)
def gate_up_rows_serial(q_a, s_a, tokens, offsets, work, q_gate_up, gate_up_scale, inter, bn, bk, out):
    """`gate_up_rows` on the calling thread (no parallel region to start: one thread)."""
    for item in range(work.shape[0]):
        _gate_up_item(q_a, s_a, tokens, offsets, work[item, 0], work[item, 1], q_gate_up, gate_up_scale,
                      inter, bn, bk, out)


@numba.njit(fastmath=True)
def _down_block(q_a, s_a, tokens, slot_weights, offsets, experts, q_down, down_scale, bn, bk, sums, block):
    """Output columns [block * ROW_BLOCK, ..) over every hit expert (`down_rows`)."""
    hidden = q_down.shape[1]
    rows = np.arange(q_a.shape[0])
    tile = np.empty(2 * _ROW_TILE, np.float32)
    first, last = block * ROW_BLOCK, min(hidden, (block + 1) * ROW_BLOCK)
    scaled = np.empty((0, q_a.shape[1]), np.float32)
    dots = np.empty((0, ROW_BLOCK), np.float32)
    for i in range(experts.shape[0]):
        e = experts[i]
        start, stop = offsets[e], offsets[e + 1]
        count = stop - start
        if scaled.shape[0] < count:
            scaled = np.empty((count, q_a.shape[1]), np.float32)
            dots = np.empty((count, ROW_BLOCK), np.float32)
        weights = q_down[e]
        n = first
        while n < last:
            b = n // bn
            segment_end = min(last, (b + 1) * bn)
            _scaled_rows(q_a, s_a, rows, start, stop, down_scale[e, b], bk, scaled)
            _weight_rows_dots(scaled, count, weights, n, segment_end, tile, dots, n - first)
            n = segment_end
        for m in range(start, stop):
            t, weight = tokens[m], slot_weights[m]
            d = dots[m - start]
            for n in range(first, last):
                sums[t, n] += weight * d[n - first]


@numba.njit(parallel=True, fastmath=True, cache=True)
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


@numba.njit(fastmath=True, cache=True)
def down_rows_serial(q_a, s_a, tokens, slot_weights, offsets, experts, q_down, down_scale, bn, bk, sums):
    """`down_rows` on the calling thread."""
    for block in range((q_down.shape[1] + ROW_BLOCK - 1) // ROW_BLOCK):
        _down_block(q_a, s_a, tokens, slot_weights, offsets, experts, q_down, down_scale, bn, bk, sums, block)


# Serial on purpose: it runs between torch GEMMs, where starting Numba's thread pool next to
# torch's spinning OpenMP workers cost 14 ms a call against 0.6 ms of decoding (3.7M weights).
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
            group = values[g * bk:min(cols, (g + 1) * bk)]
            for k in range(group.shape[0]):
                group[k] *= c


@numba.njit(fastmath=True, cache=True)
def dequantize_rows_bf16(q, scale, row_start, row_stop, scale_row_offset, bn, bk, work, out):
    """`dequantize_rows` rounded to bfloat16 (nearest, ties to even) and written as its bits.

    work [K] float32 scratch; out [row_stop - row_start, K] int16 (a view of a bfloat16 tensor).
    """
    cols = q.shape[1]
    bits = work.view(np.int32)
    for r in range(row_start, row_stop):
        _decode_row(q[r], bits)
        scale_row = scale[(r - scale_row_offset) // bn]
        for g in range((cols + bk - 1) // bk):
            c = scale_row[g] * _UNBIAS
            group = work[g * bk:min(cols, (g + 1) * bk)]
            for k in range(group.shape[0]):
                group[k] *= c
        target = out[r - row_start]
        for k in range(cols):
            b = bits[k]
            # Round the float32 to its upper 16 bits: add 0x7fff plus the kept LSB (ties to even).
            target[k] = np.int16((b + 0x7FFF + ((b >> 16) & 1)) >> 16)


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
    bfloat16 (nearest, ties to even), as the cast to the activation dtype does. Serial: it
    runs between other calls on small batches, where a parallel region costs more.
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
                bits[k] = (b + 0x7FFF + ((b >> 16) & 1)) & np.int32(-65536)
            row = q_row
        for g in range((cols + group - 1) // group):
            k0 = g * group
            k1 = min(cols, k0 + group)
            amax = np.float32(0.0)
            for k in range(k0, k1):
                amax = max(amax, abs(row[k]))
            scale = max(amax, min_amax) / np.float32(448.0)
            s_out[m, g] = scale
            for k in range(k0, k1):
                v = min(max(row[k] / scale, np.float32(-448.0)), np.float32(448.0))
                a = abs(v)
                if a < np.float32(2.0 ** -6):  # e4m3 subnormals: multiples of 2**-9
                    r = np.float32(np.rint(a * np.float32(512.0)) / np.float32(512.0))
                    q_row[k] = -r if v < 0 else r
                else:  # keep 3 mantissa bits (nearest, ties to even), in q_row's bits
                    q_row[k] = a
                    b = q_bits[k]
                    q_bits[k] = ((b + 0x7FFFF + ((b >> 20) & 1)) & np.int32(-1048576)) | (
                        np.int32(-2147483648) if v < 0 else np.int32(0))
