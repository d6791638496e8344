"""GPTQ act order's activation gather on the CPU: each routed row's hidden state in its
expert's column order (`moeroute.experts.formats.int4.act_order_rows`).

torch's column gathers (``index_select`` on the last dim, ``gather``) copy element by
element through strided iterators; this walks one source row and one permutation row per
output row, threads over the rows.
"""

from __future__ import annotations

import numba

from moeroute.experts.cpu.variants import parallel_and_serial

__all__ = ["gather_columns", "gather_columns_serial", "SERIAL_ELEMENTS"]

#: Below this many gathered elements the serial form runs (a thread launch costs more).
SERIAL_ELEMENTS = 1 << 16


@parallel_and_serial(cache=True)
def gather_columns(x, tokens, row_expert, perm, out):
    """out[m, j] = x[tokens[m], perm[row_expert[m], j]]; x [T, H] and out [M, H] of one dtype
    (16-bit values as their bits), tokens and row_expert [M] int64, perm [L, H] int32."""
    for m in numba.prange(tokens.shape[0]):
        source = x[tokens[m]]
        order = perm[row_expert[m]]
        target = out[m]
        for j in range(order.shape[0]):
            target[j] = source[order[j]]


gather_columns_serial = gather_columns.serial
