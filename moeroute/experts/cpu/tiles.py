"""The tiled loop of the CPU row kernels, written once for every weight format.

A row kernel computes, for each hit expert e and the rows m it serves (sorted by expert:
`moeroute.experts.cpu.rows.plan_rows`), the first GEMM ``out[m, n] = xs[tokens[m]] . W_e[n]
(+ bias[e, n])`` and the second with the combine, ``sums[tokens[m], n] += slot_weights[m] *
(acts[m] . W_e[n] (+ bias[e, n]))``. The loop is the same for every format:

* gate_up: the parallel work items are (expert, block of `ROW_BLOCK` weight rows) pairs
  (``work [W, 2]``); down: threads split the output columns in blocks (`ROW_BLOCK`; the
  serial form takes them all as one block, each expert's weights one stream), so each sum
  has one writer and experts add in ``experts`` order (deterministic, the same sums bit for
  bit at any block size);
* within a block, a tile of ``WEIGHT_TILE`` weight rows (the block's last rows one at a time)
  is loaded once, then dotted with the expert's rows a tile of up to `ROW_TILE` at a time.

A format plugs in three Numba functions and a constant (`row_kernels`), and may add a fourth:

* ``load(w, s, e, n, count, scratch)`` -> ``operand``: weight rows n .. n + count - 1 of
  expert e as its ``dots`` reads them (views of the weights, or rows decoded into
  ``scratch``, what ``scratch(w, s, xs, rows)`` allocated once per work item for experts
  of at most ``rows`` rows);
* ``dots(operand, n, count, xs, x_rows, out)``: ``out[i * len(x_rows) + j] = W_e[n + i] .
  xs[x_rows[j]]`` for a tuple ``x_rows`` of 1 to `ROW_TILE` activation rows;
* ``WEIGHT_TILE``: the weight rows of a whole tile (``count`` is it or 1; with
  ``partial_tiles``, a segment's rest after its last whole tile is one shorter tile);
* ``segment(xs, rows, w, s, e, n, last, scratch)`` -> ``(end, xs', rows')``: where the
  weight rows n .. end - 1 (end <= last) read the activation rows as ``xs'[rows'[i]]``
  instead of ``xs[rows[i]]`` (``rows``: the expert's activation rows, in order). The
  default (`whole_block`) is one segment and the rows as given; block-scaled formats end
  a segment where the weight scales' block row ends, and hand the dots activations with
  that block row's scales folded in (`moeroute.experts.cpu.fp8`). A weight tile never
  straddles two segments.

The float formats (`moeroute.experts.cpu.rows`: widened rows, or the bfloat16 dot
instruction), MXFP4 and INT4 (`moeroute.experts.cpu.mxfp4`, `moeroute.experts.cpu.int4`:
nibbles decoded in registers; `moeroute.experts.cpu.mxfp4_rows`: rows decoded once;
`moeroute.experts.cpu.mxfp4_dot`: the bfloat16 dot instruction) and FP8
(`moeroute.experts.cpu.fp8`: e4m3 decoded in registers, widened or for the bfloat16 dot
instruction) are such plug-ins. Each
dot is the format's own, so the loop changes no sum's value: only which dots run together.
"""

from __future__ import annotations

import numba
import numpy as np

from moeroute.experts.cpu.dot import add_tile, store_tile
from moeroute.experts.cpu.variants import specialize

__all__ = ["ROW_BLOCK", "ROW_TILE", "KERNELS", "row_kernels", "no_scratch", "expert_weights", "whole_block"]

#: Weight rows per unit of parallel work (gate_up) and output columns per thread block (down).
ROW_BLOCK = 64
#: Activation rows per tile: one load of a weight tile serves them.
ROW_TILE = 4
#: The names of the standalone kernels `row_kernels` returns.
KERNELS = ("gate_up_rows", "gate_up_rows_serial", "down_rows", "down_rows_serial")
#: Placeholder of the format's weight tile (bound per format by `row_kernels`).
WEIGHT_TILE = 1
#: Placeholder: whether a segment's rows past its last whole tile go to ``dots`` as one tile
#: (else one row at a time; bound per format by `row_kernels`).
PARTIAL_TILES = False


def load(w, s, e, n, count, scratch):  # pragma: no cover - each format's copies bind their own
    """The format's weight rows n .. n + count - 1 of expert e, as its ``dots`` reads them."""
    raise NotImplementedError


def dots(operand, n, count, xs, x_rows, out):  # pragma: no cover - each format's copies bind their own
    """The format's dots of a weight tile with a tuple of activation rows."""
    raise NotImplementedError


def scratch(w, s, xs, rows):  # pragma: no cover - each format's copies bind their own
    """The format's scratch for ``load``, allocated once per work item."""
    raise NotImplementedError


def segment(xs, rows, w, s, e, n, last, scratch):  # pragma: no cover - each format's copies bind their own
    """The format's weight rows from n that read one form of the activation rows."""
    raise NotImplementedError


@numba.njit
def no_scratch(w, s, xs, rows):
    """``scratch`` of the formats that load views (no decode)."""
    return np.empty((0, 0), np.float32)


@numba.njit
def whole_block(xs, rows, w, s, e, n, last, scratch):
    """``segment`` of the formats whose dots read the activation rows as they are."""
    return last, xs, rows


@numba.njit
def expert_weights(w, s, e, n, count, scratch):
    """``load`` of the formats whose ``dots`` index the expert's weights and scales themselves."""
    return w[e], s[e]


def _tile_rows(operand, n, count, xs, rows, m, stop, tile):
    """``dots`` of a weight tile with rows[m], .. (up to `ROW_TILE`, before ``stop``); returns how many."""
    k = min(ROW_TILE, stop - m)
    if k == 4:
        dots(operand, n, count, xs, (rows[m], rows[m + 1], rows[m + 2], rows[m + 3]), tile)
    elif k == 3:
        dots(operand, n, count, xs, (rows[m], rows[m + 1], rows[m + 2]), tile)
    elif k == 2:
        dots(operand, n, count, xs, (rows[m], rows[m + 1]), tile)
    else:
        dots(operand, n, count, xs, (rows[m],), tile)
    return k


def _gate_up_item(xs, tokens, offsets, e, b, w, s, bias, out):
    """Block ``b`` of expert ``e``'s gate_up rows for all its sorted rows."""
    start, stop = offsets[e], offsets[e + 1]
    first, last = b * ROW_BLOCK, min(w.shape[1], (b + 1) * ROW_BLOCK)
    tile = np.empty(WEIGHT_TILE * ROW_TILE, np.float32)
    buffer = scratch(w, s, xs, stop - start)
    n = first
    while n < last:
        end, x, rows = segment(xs, tokens[start:stop], w, s, e, n, last, buffer)
        while n < end:
            count = WEIGHT_TILE if n + WEIGHT_TILE <= end else (end - n if PARTIAL_TILES else 1)
            operand = load(w, s, e, n, count, buffer)
            for m in range(0, stop - start, ROW_TILE):
                k = _tile_rows(operand, n, count, x, rows, m, stop - start, tile)
                store_tile(tile, count, n, k, start + m, bias, e, out)
            n += count


def gate_up_rows(xs, tokens, offsets, work, w, s, bias, out):
    """out[m, n] = xs[tokens[m]] . W_e[n] (+ bias[e, n]) for each expert e's sorted rows m
    (`moeroute.experts.cpu.tiles`)."""
    for item in numba.prange(work.shape[0]):
        _gate_up_item(xs, tokens, offsets, work[item, 0], work[item, 1], w, s, bias, out)


def _down_block(acts, tokens, slot_weights, offsets, experts, w, s, bias, sums, block, columns):
    """Output columns [block * columns, ..) over every hit expert."""
    first, last = block * columns, min(w.shape[1], (block + 1) * columns)
    index = np.arange(tokens.shape[0])
    tile = np.empty(WEIGHT_TILE * ROW_TILE, np.float32)
    most = 0
    for i in range(experts.shape[0]):
        most = max(most, offsets[experts[i] + 1] - offsets[experts[i]])
    buffer = scratch(w, s, acts, most)
    for i in range(experts.shape[0]):
        e = experts[i]
        start, stop = offsets[e], offsets[e + 1]
        n = first
        while n < last:
            end, x, rows = segment(acts, index[start:stop], w, s, e, n, last, buffer)
            while n < end:
                count = WEIGHT_TILE if n + WEIGHT_TILE <= end else (end - n if PARTIAL_TILES else 1)
                operand = load(w, s, e, n, count, buffer)
                for m in range(0, stop - start, ROW_TILE):
                    k = _tile_rows(operand, n, count, x, rows, m, stop - start, tile)
                    add_tile(tile, count, n, index[start + m : start + m + k], tokens, slot_weights, bias, e, sums)
                n += count


def down_rows(acts, tokens, slot_weights, offsets, experts, w, s, bias, sums, threaded=True):
    """sums[tokens[m], n] += slot_weights[m] * (acts[m] . W_e[n] (+ bias[e, n])); threads split
    the output columns (`moeroute.experts.cpu.tiles`)."""
    columns = ROW_BLOCK if threaded else max(1, w.shape[1])
    for block in numba.prange((w.shape[1] + columns - 1) // columns):
        _down_block(acts, tokens, slot_weights, offsets, experts, w, s, bias, sums, block, columns)


def row_kernels(
    module: str,
    prefix: str,
    load,
    dots,
    weight_tile: int,
    scratch=no_scratch,
    segment=whole_block,
    standalone: bool = True,
    partial_tiles: bool = False,
) -> dict:
    """The format's copies of the loop (see the module's docstring), named ``<prefix>_<name>``
    and belonging to ``module`` (the caller's ``__name__``; bind them at module level there):
    the work item ``_gate_up_item`` and the column block ``_down_block`` (for one-call
    forwards) and, with ``standalone``, the kernels ``gate_up_rows``, ``down_rows`` and their
    ``_serial`` forms."""
    namespace = dict(
        globals(),
        load=load,
        dots=dots,
        scratch=scratch,
        segment=segment,
        WEIGHT_TILE=weight_tile,
        PARTIAL_TILES=partial_tiles,
    )
    return specialize(
        module,
        prefix,
        namespace,
        helpers=(_tile_rows, _gate_up_item, _down_block),
        kernels=(gate_up_rows, down_rows) if standalone else (),
        fastmath=True,
    )
