"""Numba CPU kernels of the MXFP4 (w4a16) expert GEMMs: decode one weight row at a time, in cache.

A weight row is decoded 32 values at a time: the block's scale byte gives 2 ** (s - 127),
which scales the 16 e2m1 values into a small table, and each byte's two nibbles index it
(low nibble the even element). The decoded row (float32, cache-resident) is then dotted
with every activation row the expert serves, so memory reads about half a byte per weight
whatever the row count. The values are exact in float32 and in bfloat16 (an e2m1 value
times a power of two), so the bfloat16 decode is the float32 bits' upper half.

Arrays are NumPy: blocks uint8 [L, R, G, 16], scales uint8 [L, R, G] (G = cols / 32),
activations and sums float32.
"""

from __future__ import annotations

import numba
import numpy as np

from moeroute.quant.mxfp4 import E2M1_VALUES, SCALE_BIAS

__all__ = ["gate_up_rows", "down_rows", "dequantize_rows", "dequantize_rows_bf16"]

_E2M1 = np.array(E2M1_VALUES, dtype=np.float32)
#: 2 ** (s - 127) for every scale byte (255, e8m0's NaN, is refused at load).
_SCALES = np.array([2.0 ** (s - SCALE_BIAS) for s in range(255)] + [np.nan], dtype=np.float32)
#: Weight rows per parallel work item (one decoded row buffer each).
ROWS_PER_ITEM = 64


@numba.njit(fastmath=True)
def _decode_row(blocks_row, scales_row, table, w):
    """w [G*32] float32 <- the row's values: per block, a 16-entry table scaled by its byte."""
    for g in range(blocks_row.shape[0]):
        scale = _SCALES[scales_row[g]]
        for c in range(16):
            table[c] = _E2M1[c] * scale
        base = g * 32
        block = blocks_row[g]
        for j in range(16):
            byte = block[j]
            w[base + 2 * j] = table[byte & 0x0F]
            w[base + 2 * j + 1] = table[byte >> 4]


@numba.njit(fastmath=True)
def _dot(w, x):
    acc = np.float32(0.0)
    for k in range(w.shape[0]):
        acc += w[k] * x[k]
    return acc


@numba.njit(fastmath=True)
def _dot4(w, x0, x1, x2, x3, out):
    """`_dot` of four activation rows at once (w read once for the four)."""
    a0 = a1 = a2 = a3 = np.float32(0.0)
    for k in range(w.shape[0]):
        wk = w[k]
        a0 += wk * x0[k]
        a1 += wk * x1[k]
        a2 += wk * x2[k]
        a3 += wk * x3[k]
    out[0], out[1], out[2], out[3] = a0, a1, a2, a3


#: Activation rows dotted per pass over a decoded weight row (`_dot4`).
_ROW_TILE = 4


@numba.njit(parallel=True, fastmath=True, cache=True)
def gate_up_rows(xs, tokens, offsets, work, blocks, scales, rows_per_item, out):
    """out[m, n] = xs[tokens[m]] . W_e[n] for each expert e's sorted rows m (first GEMM).

    xs [T, H] float32, tokens [M] int64, offsets [L + 1] int64, work [W, 2] int64 (expert,
    chunk of ``rows_per_item`` weight rows), blocks [L, 2I, H/32, 16] uint8, scales
    [L, 2I, H/32] uint8, out [M, 2I] float32.
    """
    hidden = xs.shape[1]
    total_rows = blocks.shape[1]
    for item in numba.prange(work.shape[0]):
        e, c = work[item, 0], work[item, 1]
        w = np.empty(hidden, np.float32)
        table = np.empty(16, np.float32)
        tile = np.empty(_ROW_TILE, np.float32)
        start, stop = offsets[e], offsets[e + 1]
        tiled = start + (stop - start) // _ROW_TILE * _ROW_TILE
        for n in range(c * rows_per_item, min(total_rows, (c + 1) * rows_per_item)):
            _decode_row(blocks[e, n], scales[e, n], table, w)
            for m in range(start, tiled, _ROW_TILE):
                _dot4(w, xs[tokens[m]], xs[tokens[m + 1]], xs[tokens[m + 2]], xs[tokens[m + 3]], tile)
                for i in range(_ROW_TILE):
                    out[m + i, n] = tile[i]
            for m in range(tiled, stop):
                out[m, n] = _dot(w, xs[tokens[m]])


@numba.njit(parallel=True, fastmath=True, cache=True)
def down_rows(acts, tokens, slot_weights, offsets, experts, blocks, scales, rows_per_item, sums):
    """sums[tokens[m], n] += slot_weights[m] * (acts[m] . W_e[n]) (second GEMM + combine).

    Threads split the output columns (chunks of W_down rows), so each sum has one writer,
    and experts are added in ``experts`` order (deterministic). acts [M, I] float32,
    experts [E'] int64 (hit experts), blocks [L, H, I/32, 16], scales [L, H, I/32], sums
    [T, H] float32.
    """
    hidden, inter = blocks.shape[1], blocks.shape[2] * 32
    for c in numba.prange((hidden + rows_per_item - 1) // rows_per_item):
        w = np.empty(inter, np.float32)
        table = np.empty(16, np.float32)
        tile = np.empty(_ROW_TILE, np.float32)
        for i in range(experts.shape[0]):
            e = experts[i]
            start, stop = offsets[e], offsets[e + 1]
            tiled = start + (stop - start) // _ROW_TILE * _ROW_TILE
            for n in range(c * rows_per_item, min(hidden, (c + 1) * rows_per_item)):
                _decode_row(blocks[e, n], scales[e, n], table, w)
                for m in range(start, tiled, _ROW_TILE):
                    _dot4(w, acts[m], acts[m + 1], acts[m + 2], acts[m + 3], tile)
                    for j in range(_ROW_TILE):
                        sums[tokens[m + j], n] += slot_weights[m + j] * tile[j]
                for m in range(tiled, stop):
                    sums[tokens[m], n] += slot_weights[m] * _dot(w, acts[m])


# Serial on purpose, as the FP8 decode: it runs between torch GEMMs, next to torch's threads.
@numba.njit(fastmath=True, cache=True)
def dequantize_rows(blocks, scales, row_start, row_stop, out):
    """out[r - row_start] = the float32 values of row r, r in [row_start, row_stop).

    blocks [R, G, 16] uint8 and scales [R, G] uint8 (one matrix), out [rows, G*32] float32.
    """
    table = np.empty(16, np.float32)
    for r in range(row_start, row_stop):
        _decode_row(blocks[r], scales[r], table, out[r - row_start])


@numba.njit(fastmath=True, cache=True)
def dequantize_rows_bf16(blocks, scales, row_start, row_stop, work, out):
    """`dequantize_rows` as bfloat16 bits: the values are exact in bfloat16, so a float32's
    upper 16 bits. work [G*32] float32 scratch; out [rows, G*32] int16 (a bfloat16 view)."""
    table = np.empty(16, np.float32)
    bits = work.view(np.int32)
    for r in range(row_start, row_stop):
        _decode_row(blocks[r], scales[r], table, work)
        target = out[r - row_start]
        for k in range(work.shape[0]):
            target[k] = np.int16(bits[k] >> 16)
