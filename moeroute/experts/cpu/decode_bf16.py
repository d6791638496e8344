"""Numba CPU decode of INT4 weight rows into bfloat16, for oneDNN's bfloat16 GEMMs.

The "blocks" strategy of INT4 (`moeroute.experts.formats.int4`) with bfloat16 activations on
CPUs with bfloat16 dot instructions decodes each hit expert's weights a chunk of rows at a
time and multiplies the chunk with torch (oneDNN's blocked bfloat16 GEMM, far faster at
prefill sizes than the row kernels). Each row is decoded by the row kernels' decode
(`moeroute.experts.cpu.int4.decode_row_split`: ``(q - z) * s`` in float32, `split_blocks`
column order) into a float32 row in the cache, then rounded once to bfloat16 (to nearest,
ties to even) and stored as its bits, so the decoded weight is the value a bfloat16
dequantization (as GPU engines' w4a16 kernels take it) gives. The caller puts the
activations in the same column order once per call: a dot product does not depend on it.
"""

from __future__ import annotations

import numba
import numpy as np

from moeroute.experts.cpu import int4 as cpu_int4

__all__ = ["dequantize_rows_bf16"]


@numba.njit(fastmath=True)
def _round_rows(values, out):
    """out [K] uint16 <- float32 ``values`` [K] rounded to bfloat16 (to nearest, ties to even;
    the decoded values are finite), a loop the compiler vectorizes."""
    bits = values.view(np.uint32)
    for k in range(bits.shape[0]):
        b = bits[k]
        out[k] = np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@numba.njit(fastmath=True, parallel=True)
def dequantize_rows_bf16(blocks, params, row_start, row_stop, out):
    """out[r - row_start] = row r's values rounded to bfloat16 (uint16 bits) in `split_blocks`
    order, r in [row_start, row_stop): blocks [R, G, 16] uint8, params the kernels' INT4
    parameters of one matrix (`cpu_int4.decode_row_split`), out [>= row_stop - row_start, G*32]
    uint16. Parallel over rows: each thread decodes its share into its own float32 row."""
    rows = row_stop - row_start
    threads = min(numba.get_num_threads(), max(1, rows))
    share = -(-rows // threads)
    for t in numba.prange(threads):
        row = np.empty(out.shape[1], np.float32)
        for r in range(row_start + t * share, min(row_stop, row_start + (t + 1) * share)):
            cpu_int4.decode_row_split(blocks[r], params[r], row)
            _round_rows(row, out[r - row_start])
