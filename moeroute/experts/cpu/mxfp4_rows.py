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

from moeroute.experts.cpu import tiles
from moeroute.experts.cpu import rows as cpu_rows
from moeroute.experts.cpu import mxfp4 as cpu_mxfp4
from moeroute.experts.cpu import int4 as cpu_int4

__all__ = ["gate_up_rows", "gate_up_rows_serial", "down_rows", "down_rows_serial"]

ROW_BLOCK = tiles.ROW_BLOCK


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


@numba.njit
def _scratch(blocks, scales, xs, rows):
    """Two decoded weight rows of the activations' width."""
    return np.empty((2, xs.shape[1]), np.float32)


@numba.njit(fastmath=True)
def _decoded_rows(blocks, scales, e, n, count, scratch):
    """The tiled loop's ``load``: weight rows n (and n + 1 when ``count`` is 2) of expert e
    decoded into ``scratch`` once, for all the expert's rows."""
    _decode_row(blocks[e, n], scales[e, n], scratch[0])
    if count == 2:
        _decode_row(blocks[e, n + 1], scales[e, n + 1], scratch[1])
    return scratch[0], scratch[1]


#: The tiled loop (`moeroute.experts.cpu.tiles`) around the float32 rows' dots, two decoded
#: weight rows by four activation rows per pass.
_kernels = tiles.row_kernels(__name__, "mxfp4_rows", _decoded_rows, cpu_rows.widened_dots, 2, scratch=_scratch)
gate_up_rows, gate_up_rows_serial, down_rows, down_rows_serial = (_kernels[name] for name in tiles.KERNELS)
