"""Numba CPU kernels of the FP8 expert GEMMs: dequantize one weight row at a time, in cache.

The GEMM kernels decode an e4m3 weight in registers as they read it, with integer SIMD (no
table): the byte's 7 magnitude bits moved into a float32's exponent and mantissa make
``q * 2**-120`` exactly (e4m3 subnormals land on float32 subnormals), and the row's block
scale times 2**120 restores ``q * s_w``. Each weight row is dotted with every row of
fake-quantized activations that expert serves (``q_a * s_a``, float32), so memory reads
one byte per weight, whatever the row count. The dequantizers (`dequantize_rows`) decode
whole rows into a float32 buffer the same way (`_decode_row`).

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

__all__ = ["gate_up_rows", "down_rows", "dequantize_rows"]

#: 2**120: a float32 holding e4m3 bits in its low exponent/mantissa bits is q * 2**-120.
_UNBIAS = np.float32(2.0 ** 120)


@numba.njit(fastmath=True)
def _decode_row(q_row, bits):
    """bits (int32 [K]) <- the float32 bits of q_row * 2**-120 (exact, subnormals included)."""
    for k in range(q_row.shape[0]):
        b = np.int32(q_row[k])
        bits[k] = ((b & 0x7F) << 20) | ((b & 0x80) << 24)


@intrinsic
def _e4m3_unbiased(typingctx, byte):
    """The float32 q * 2**-120 of an e4m3 byte: its 7 magnitude bits moved into a float32's
    exponent and mantissa, the sign bit to the sign (the `_decode_row` bits, in registers;
    LLVM vectorizes the zero-extend, masks, shifts and bitcast)."""
    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        b = builder.zext(args[0], i32)
        magnitude = builder.shl(builder.and_(b, ir.Constant(i32, 0x7F)), ir.Constant(i32, 20))
        sign = builder.shl(builder.and_(b, ir.Constant(i32, 0x80)), ir.Constant(i32, 24))
        return builder.bitcast(builder.or_(magnitude, sign), ir.FloatType())

    return types.float32(types.uint8), codegen


@numba.njit(fastmath=True)
def _dot_groups(q, x, scale_row, bk):
    """sum_g scale_row[g] * 2**120 * dot(decoded q[group g], x[group g]); q an e4m3 row
    (uint8), decoded in registers as it is read."""
    cols = q.shape[0]
    acc = np.float32(0.0)
    for g in range((cols + bk - 1) // bk):
        k0 = g * bk
        count = min(cols - k0, bk)
        # Slices with a zero-based count: LLVM vectorizes this form (a range(k0, k1) loop it
        # left scalar, 15x slower).
        q_group, x_group = q[k0:k0 + count], x[k0:k0 + count]
        part = np.float32(0.0)
        for k in range(count):
            part += _e4m3_unbiased(q_group[k]) * x_group[k]
        acc += part * (scale_row[g] * _UNBIAS)
    return acc


@numba.njit(fastmath=True)
def _dot_groups4(q, x0, x1, x2, x3, scale_row, bk, out):
    """`_dot_groups` of four activation rows at once (q read and decoded once for the four)."""
    cols = q.shape[0]
    a0 = a1 = a2 = a3 = np.float32(0.0)
    for g in range((cols + bk - 1) // bk):
        k0 = g * bk
        count = min(cols - k0, bk)
        qg = q[k0:k0 + count]
        g0, g1, g2, g3 = x0[k0:k0 + count], x1[k0:k0 + count], x2[k0:k0 + count], x3[k0:k0 + count]
        p0 = p1 = p2 = p3 = np.float32(0.0)
        for k in range(count):
            wk = _e4m3_unbiased(qg[k])
            p0 += wk * g0[k]
            p1 += wk * g1[k]
            p2 += wk * g2[k]
            p3 += wk * g3[k]
        c = scale_row[g] * _UNBIAS
        a0 += p0 * c
        a1 += p1 * c
        a2 += p2 * c
        a3 += p3 * c
    out[0], out[1], out[2], out[3] = a0, a1, a2, a3


#: Activation rows dotted per pass over a decoded weight row (`_dot_groups4`).
_ROW_TILE = 4


@numba.njit(parallel=True, fastmath=True, cache=True)
def gate_up_rows(xs, tokens, offsets, work, q_gate_up, gate_up_scale, inter, bn, bk, out):
    """out[m, :] = xs[tokens[m]] @ W_e^T for each expert e's sorted rows m (first GEMM).

    xs [T, H] float32 (fake-quantized activations), tokens [M] int64, offsets [L + 1] int64,
    work [W, 2] int64 (expert, block row) pairs (block rows 0..nb-1 the gate's, nb..2nb-1
    the up's, nb = ceil(I / bn)), q_gate_up [L, 2I, H] uint8, gate_up_scale [L, 2nb, G]
    float32, out [M, 2I] float32.
    """
    nb = (inter + bn - 1) // bn
    for item in numba.prange(work.shape[0]):
        e, b = work[item, 0], work[item, 1]
        half, rb = (0, b) if b < nb else (1, b - nb)
        tile = np.empty(_ROW_TILE, np.float32)
        start, stop = offsets[e], offsets[e + 1]
        tiled = start + (stop - start) // _ROW_TILE * _ROW_TILE
        scale_row = gate_up_scale[e, b]
        weights = q_gate_up[e]
        for r in range(rb * bn, min(inter, (rb + 1) * bn)):
            n = half * inter + r
            w = weights[n]
            for m in range(start, tiled, _ROW_TILE):
                _dot_groups4(w, xs[tokens[m]], xs[tokens[m + 1]], xs[tokens[m + 2]], xs[tokens[m + 3]],
                             scale_row, bk, tile)
                for i in range(_ROW_TILE):
                    out[m + i, n] = tile[i]
            for m in range(tiled, stop):
                out[m, n] = _dot_groups(w, xs[tokens[m]], scale_row, bk)


@numba.njit(parallel=True, fastmath=True, cache=True)
def down_rows(acts, tokens, slot_weights, offsets, experts, q_down, down_scale, bn, bk, sums):
    """sums[tokens[m], n] += slot_weights[m] * (acts[m] @ W_e^T)[n] (second GEMM + combine).

    Threads split the output columns (block rows of W_down), so each sum has one writer,
    and experts are added in ``experts`` order (deterministic). acts [M, I] float32
    (fake-quantized), experts [E'] int64 (hit experts), q_down [L, H, I] uint8, down_scale
    [L, ceil(H/bn), G] float32, sums [T, H] float32.
    """
    hidden = q_down.shape[1]
    for b in numba.prange((hidden + bn - 1) // bn):
        tile = np.empty(_ROW_TILE, np.float32)
        for i in range(experts.shape[0]):
            e = experts[i]
            start, stop = offsets[e], offsets[e + 1]
            tiled = start + (stop - start) // _ROW_TILE * _ROW_TILE
            scale_row = down_scale[e, b]
            weights = q_down[e]
            for n in range(b * bn, min(hidden, (b + 1) * bn)):
                w = weights[n]
                for m in range(start, tiled, _ROW_TILE):
                    _dot_groups4(w, acts[m], acts[m + 1], acts[m + 2], acts[m + 3], scale_row, bk, tile)
                    for j in range(_ROW_TILE):
                        sums[tokens[m + j], n] += slot_weights[m + j] * tile[j]
                for m in range(tiled, stop):
                    sums[tokens[m], n] += slot_weights[m] * _dot_groups(w, acts[m], scale_row, bk)


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
