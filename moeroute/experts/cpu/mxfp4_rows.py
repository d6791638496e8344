"""MXFP4 row kernels for experts that serve many rows: each packed weight row is decoded once
into a float32 buffer (`moeroute.experts.cpu.mxfp4`'s vector decode, in `split_blocks`
order) and dotted with all the expert's rows by the float32 row kernels of
`moeroute.experts.cpu.rows` (two weight rows by four activation rows per pass).

The same kernels serve INT4 weights (`moeroute.experts.cpu.int4`): the packed bytes have the
MXFP4 blocks' layout, and the decoder follows the scales' type (uint8 scale bytes: MXFP4;
float32 ``[P, K/g]`` parameters a row: INT4), chosen when Numba compiles the kernel.

The few-row kernels of `moeroute.experts.cpu.mxfp4` decode in registers for every tile of
four rows, which is cheapest when an expert serves one to a few rows; past that the decode
repeats per tile and these kernels, which decode once, win. Activations are float32 in
`split_blocks` order: a dot product does not depend on the order of its terms. Arguments as
in `moeroute.experts.cpu.mxfp4.gate_up_rows` / ``down_rows``.
"""

from __future__ import annotations

import numba
import numpy as np
from numba.extending import overload

from moeroute.experts.cpu.variants import parallel_and_serial
from moeroute.experts.cpu import rows as cpu_rows
from moeroute.experts.cpu import mxfp4 as cpu_mxfp4
from moeroute.experts.cpu import int4 as cpu_int4

__all__ = ["gate_up_rows", "gate_up_rows_serial", "down_rows", "down_rows_serial"]

ROW_BLOCK = cpu_mxfp4.ROW_BLOCK
_ROW_TILE = 4


def _decode_row(blocks_row, scales_row, out):
    """One weight row in `split_blocks` order (typed by `_decode_row_typed`)."""


@overload(_decode_row, jit_options={"fastmath": True})
def _decode_row_typed(blocks_row, scales_row, out):
    if scales_row.ndim == 2:  # INT4: float32 scales (and zero points) [P, K/g]

        def decode_int4(blocks_row, scales_row, out):
            cpu_int4.decode_row_split(blocks_row, scales_row, out)

        return decode_int4

    def decode_mxfp4(blocks_row, scales_row, out):
        cpu_mxfp4._decode_row_split(blocks_row, scales_row, out)

    return decode_mxfp4


@numba.njit(fastmath=True)
def _decode_pair(blocks, scales, e, n, pair, buffer):
    _decode_row(blocks[e, n], scales[e, n], buffer[0])
    if pair:
        _decode_row(blocks[e, n + 1], scales[e, n + 1], buffer[1])


@numba.njit(fastmath=True)
def _gate_up_item(xs, tokens, offsets, e, b, blocks, scales, bias, out):
    """Block ``b`` of expert ``e``'s gate_up rows for all its sorted rows."""
    buffer = np.empty((2, xs.shape[1]), np.float32)
    tile = np.empty(2 * _ROW_TILE, np.float32)
    start, stop = offsets[e], offsets[e + 1]
    last = min(blocks.shape[1], (b + 1) * ROW_BLOCK)
    for n in range(b * ROW_BLOCK, last, 2):
        pair = n + 1 < last
        _decode_pair(blocks, scales, e, n, pair, buffer)
        cpu_rows._rows_times_weights(xs, tokens, start, stop, buffer[0], buffer[1], pair, tile, out, n)
    if bias.shape[0] > 0:
        for m in range(start, stop):
            for n in range(b * ROW_BLOCK, last):
                out[m, n] += bias[e, n]


@parallel_and_serial(fastmath=True, cache=True)
def gate_up_rows(xs, tokens, offsets, work, blocks, scales, bias, out):
    """out[m, n] = xs[tokens[m]] . W_e[n] (+ bias[e, n]), each weight row decoded once."""
    for item in numba.prange(work.shape[0]):
        _gate_up_item(xs, tokens, offsets, work[item, 0], work[item, 1], blocks, scales, bias, out)


gate_up_rows_serial = gate_up_rows.serial


@numba.njit(fastmath=True)
def _down_block(acts, tokens, slot_weights, offsets, experts, blocks, scales, bias, sums, b):
    """Output columns of block ``b`` over every hit expert."""
    rows = np.arange(acts.shape[0])
    buffer = np.empty((2, acts.shape[1]), np.float32)
    tile = np.empty(2 * _ROW_TILE, np.float32)
    first, last = b * ROW_BLOCK, min(blocks.shape[1], (b + 1) * ROW_BLOCK)
    dots = np.empty((0, ROW_BLOCK), np.float32)
    for i in range(experts.shape[0]):
        e = experts[i]
        start, stop = offsets[e], offsets[e + 1]
        if dots.shape[0] < stop - start:
            dots = np.empty((stop - start, ROW_BLOCK), np.float32)
        for n in range(first, last, 2):
            pair = n + 1 < last
            _decode_pair(blocks, scales, e, n, pair, buffer)
            cpu_rows._rows_times_weights(
                acts[start:stop], rows, 0, stop - start, buffer[0], buffer[1], pair, tile, dots, n - first
            )
        for m in range(start, stop):
            t, weight = tokens[m], slot_weights[m]
            for n in range(first, last):
                add = bias[e, n] if bias.shape[0] > 0 else np.float32(0.0)
                sums[t, n] += weight * (dots[m - start, n - first] + add)


@parallel_and_serial(fastmath=True, cache=True)
def down_rows(acts, tokens, slot_weights, offsets, experts, blocks, scales, bias, sums):
    """sums[tokens[m], n] += slot_weights[m] * (acts[m] . W_e[n] (+ bias[e, n])), each weight
    row decoded once; threads split the output columns (one writer per sum)."""
    for b in numba.prange((blocks.shape[1] + ROW_BLOCK - 1) // ROW_BLOCK):
        _down_block(acts, tokens, slot_weights, offsets, experts, blocks, scales, bias, sums, b)


down_rows_serial = down_rows.serial
