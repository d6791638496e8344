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
"""

from __future__ import annotations

import numba
import numpy as np

from moeroute.quant.int4 import SYMMETRIC_ZERO

__all__ = ["BLOCK", "decode_row_split", "dequantize_rows_split"]

#: Columns per packed block (16 bytes): the MXFP4 kernels' block.
BLOCK = 32
_HALF = BLOCK // 2


@numba.njit(fastmath=True, inline="always")
def decode_row_split(blocks_row, params_row, w):
    """w [G*32] float32 <- one INT4 row in `split_blocks` order, each value (q - z) * s.

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


@numba.njit(fastmath=True, cache=True)
def dequantize_rows_split(blocks, params, row_start, row_stop, out):
    """out[r - row_start] = row r's float32 values in `split_blocks` order, r in [row_start,
    row_stop): blocks [R, G, 16] uint8, params [R, P, G'] float32 (one matrix). Serial on
    purpose, as the other decodes of the "blocks" strategy: it runs between torch GEMMs."""
    for r in range(row_start, row_stop):
        decode_row_split(blocks[r], params[r], out[r - row_start])
