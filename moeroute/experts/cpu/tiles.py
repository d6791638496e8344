"""The tiled loop of the CPU row kernels, written once for every weight format.

A format plugs in its dot: ``dots(w_row, s_row, xs, rows, out)`` sets ``out[i] = W . xs[rows[i]]``
for one weight row (``w_row`` its packed or float values, ``s_row`` its scales, whatever the
format keeps per row) and a tuple of 1 to `ROW_TILE` activation rows. `row_kernels` returns
the format's kernels around it, each with a serial twin (`parallel_and_serial`):

* ``gate_up_rows(xs, tokens, offsets, work, w, s, bias, out)``: ``out[m, n] = xs[tokens[m]]
  . W_e[n] (+ bias[e, n])`` for each expert e's sorted rows m (`moeroute.experts.cpu.rows.plan_rows`'
  order); the parallel work items are (expert, block of `ROW_BLOCK` weight rows) pairs
  (``work [W, 2]``), each weight row read once and dotted with the expert's rows a tile of up
  to `ROW_TILE` at a time.
* ``down_rows(acts, tokens, slot_weights, offsets, experts, w, s, bias, sums)``: the second
  GEMM and the combine, ``sums[tokens[m], n] += slot_weights[m] * (acts[m] . W_e[n] (+ bias[e,
  n]))``; threads split the output columns (blocks of `ROW_BLOCK`), so each sum has one
  writer, and experts add in ``experts`` order (deterministic).

``bias`` is float32 [L, N] or [0, 0] (none); sums and outputs float32. The format's dot sees
the activations as the kernels are given them (e.g. in `moeroute.experts.cpu.mxfp4.split_blocks`
order for the 4-bit formats). MXFP4 (`moeroute.experts.cpu.mxfp4`) and INT4
(`moeroute.experts.cpu.int4`) instantiate it with their in-register block dots.
"""

from __future__ import annotations

import numba
import numpy as np

from moeroute.experts.cpu.dot import add_tile, store_tile
from moeroute.experts.cpu.variants import specialize

__all__ = ["ROW_BLOCK", "ROW_TILE", "row_kernels"]

#: Weight rows per unit of parallel work (gate_up) and output columns per thread block (down).
ROW_BLOCK = 64
#: Activation rows dotted per pass over a weight row: one read (and decode) serves them all.
ROW_TILE = 4


def dots(w_row, s_row, xs, rows, out):  # pragma: no cover - each format's copies bind its own
    """The format's dot of one weight row with a tuple of activation rows (`row_kernels`)."""
    raise NotImplementedError


def tile(w_e, w_rows, s_e, xs, x_rows, out):  # pragma: no cover - each format's copies bind its own
    """The format's dots of a tile of weight rows with a tuple of activation rows (`tile_kernels`)."""
    raise NotImplementedError


def _row_tile(w_row, s_row, xs, index, m, stop, tile):
    """tile[i] = W . xs[index[m + i]] for up to `ROW_TILE` rows from m; returns how many."""
    count = min(ROW_TILE, stop - m)
    if count == 4:
        dots(w_row, s_row, xs, (index[m], index[m + 1], index[m + 2], index[m + 3]), tile)
    elif count == 3:
        dots(w_row, s_row, xs, (index[m], index[m + 1], index[m + 2]), tile)
    elif count == 2:
        dots(w_row, s_row, xs, (index[m], index[m + 1]), tile)
    else:
        dots(w_row, s_row, xs, (index[m],), tile)
    return count


def _gate_up_item(xs, tokens, offsets, e, b, w, s, bias, out):
    """Block ``b`` of expert ``e``'s gate_up rows for all its sorted rows."""
    tile = np.empty(ROW_TILE, np.float32)
    start, stop = offsets[e], offsets[e + 1]
    for n in range(b * ROW_BLOCK, min(w.shape[1], (b + 1) * ROW_BLOCK)):
        add = bias[e, n] if bias.shape[0] > 0 else np.float32(0.0)
        w_row, s_row = w[e, n], s[e, n]
        for m in range(start, stop, ROW_TILE):
            count = _row_tile(w_row, s_row, xs, tokens, m, stop, tile)
            for i in range(count):
                out[m + i, n] = tile[i] + add


def gate_up_rows(xs, tokens, offsets, work, w, s, bias, out):
    """out[m, n] = xs[tokens[m]] . W_e[n] (+ bias[e, n]) for each expert e's sorted rows m
    (`moeroute.experts.cpu.tiles`)."""
    for item in numba.prange(work.shape[0]):
        _gate_up_item(xs, tokens, offsets, work[item, 0], work[item, 1], w, s, bias, out)


def _down_block(acts, tokens, slot_weights, offsets, experts, w, s, bias, sums, b):
    """Output columns of block ``b`` over every hit expert."""
    index = np.arange(acts.shape[0])
    tile = np.empty(ROW_TILE, np.float32)
    first, last = b * ROW_BLOCK, min(w.shape[1], (b + 1) * ROW_BLOCK)
    for i in range(experts.shape[0]):
        e = experts[i]
        start, stop = offsets[e], offsets[e + 1]
        for n in range(first, last):
            add = bias[e, n] if bias.shape[0] > 0 else np.float32(0.0)
            w_row, s_row = w[e, n], s[e, n]
            for m in range(start, stop, ROW_TILE):
                count = _row_tile(w_row, s_row, acts, index, m, stop, tile)
                for j in range(count):
                    sums[tokens[m + j], n] += slot_weights[m + j] * (tile[j] + add)


def down_rows(acts, tokens, slot_weights, offsets, experts, w, s, bias, sums):
    """sums[tokens[m], n] += slot_weights[m] * (acts[m] . W_e[n] (+ bias[e, n])); threads split
    the output columns (`moeroute.experts.cpu.tiles`)."""
    for b in numba.prange((w.shape[1] + ROW_BLOCK - 1) // ROW_BLOCK):
        _down_block(acts, tokens, slot_weights, offsets, experts, w, s, bias, sums, b)


def row_kernels(module: str, prefix: str, dots) -> dict:
    """``gate_up_rows``, ``down_rows`` and their ``_serial`` forms around the format's ``dots``
    (a Numba function, see the module's docstring); bind them at module level in ``module``
    (the caller's ``__name__``), named ``<prefix>_gate_up_rows`` and so on."""
    return specialize(
        module,
        prefix,
        dict(globals(), dots=dots),
        helpers=(_row_tile, _gate_up_item, _down_block),
        kernels=(gate_up_rows, down_rows),
        fastmath=True,
    )


# ---------------------------------------------------------------- tiles of weight rows
#
# Where the format's dot takes several weight rows at once (the bfloat16 dot instruction:
# `moeroute.experts.cpu.mxfp4_dot`), ``tile(w_e, w_rows, s_e, xs, x_rows, dots)`` sets
# ``dots[i * len(x_rows) + j] = W_e[w_rows[i]] . xs[x_rows[j]]`` for tuples of 1 to `ROW_TILE`
# weight and activation rows of one expert (``w_e``, ``s_e`` the expert's weights and scales).


def _tile_gate_up_rows(blocks, scales, first, last, xs, x_rows, m, bias, e, dots, out):
    """out[m + j, n] = W_e[n] . xs[x_rows[j]] (+ bias[e, n]) for n in [first, last), four
    weight rows at a time, then one."""
    n = first
    while n + ROW_TILE <= last:
        tile(blocks, (n, n + 1, n + 2, n + 3), scales, xs, x_rows, dots)
        store_tile(dots, ROW_TILE, n, len(x_rows), m, bias, e, out)
        n += ROW_TILE
    while n < last:
        tile(blocks, (n,), scales, xs, x_rows, dots)
        store_tile(dots, 1, n, len(x_rows), m, bias, e, out)
        n += 1


def _tile_gate_up_item(xs, tokens, offsets, e, chunk, blocks, scales, bias, out):
    """Weight rows [chunk * ROW_BLOCK, ..) of expert ``e``'s gate_up for all its sorted rows,
    four at a time."""
    start, stop = offsets[e], offsets[e + 1]
    first, last = chunk * ROW_BLOCK, min(blocks.shape[1], (chunk + 1) * ROW_BLOCK)
    blocks_e, scales_e = blocks[e], scales[e]
    dots = np.empty(ROW_TILE * ROW_TILE, np.float32)
    for m in range(start, stop, ROW_TILE):
        count = min(ROW_TILE, stop - m)
        if count == 4:
            rows4 = (tokens[m], tokens[m + 1], tokens[m + 2], tokens[m + 3])
            _tile_gate_up_rows(blocks_e, scales_e, first, last, xs, rows4, m, bias, e, dots, out)
        elif count == 3:
            _tile_gate_up_rows(
                blocks_e, scales_e, first, last, xs, (tokens[m], tokens[m + 1], tokens[m + 2]), m, bias, e, dots, out
            )
        elif count == 2:
            _tile_gate_up_rows(blocks_e, scales_e, first, last, xs, (tokens[m], tokens[m + 1]), m, bias, e, dots, out)
        else:
            _tile_gate_up_rows(blocks_e, scales_e, first, last, xs, (tokens[m],), m, bias, e, dots, out)


def tile_gate_up_rows(xs, tokens, offsets, work, blocks, scales, bias, out):
    """`moeroute.experts.cpu.mxfp4.gate_up_rows` with the dot instructions (only where
    `serves`): xs [T, H] uint16, bfloat16 bits in `split_pairs` order; the rest as there."""
    for item in numba.prange(work.shape[0]):
        _tile_gate_up_item(xs, tokens, offsets, work[item, 0], work[item, 1], blocks, scales, bias, out)


def _tile_down_rows(blocks, scales, first, last, acts, a_rows, tokens, slot_weights, bias, e, dots, sums):
    """sums[tokens[m], n] += slot_weights[m] * (W_e[n] . acts[m] (+ bias[e, n])) for the rows
    m of ``a_rows`` and n in [first, last), four weight rows at a time, then one."""
    n = first
    while n + ROW_TILE <= last:
        tile(blocks, (n, n + 1, n + 2, n + 3), scales, acts, a_rows, dots)
        add_tile(dots, ROW_TILE, n, a_rows, tokens, slot_weights, bias, e, sums)
        n += ROW_TILE
    while n < last:
        tile(blocks, (n,), scales, acts, a_rows, dots)
        add_tile(dots, 1, n, a_rows, tokens, slot_weights, bias, e, sums)
        n += 1


def _tile_down_block(acts, tokens, slot_weights, offsets, experts, blocks, scales, bias, sums, block, columns):
    """Output columns [block * columns, ..) over every hit expert."""
    first, last = block * columns, min(blocks.shape[1], (block + 1) * columns)
    dots = np.empty(ROW_TILE * ROW_TILE, np.float32)
    for i in range(experts.shape[0]):
        e = experts[i]
        blocks_e, scales_e = blocks[e], scales[e]
        start, stop = offsets[e], offsets[e + 1]
        for m in range(start, stop, ROW_TILE):
            count = min(ROW_TILE, stop - m)
            if count == 4:
                _tile_down_rows(
                    blocks_e,
                    scales_e,
                    first,
                    last,
                    acts,
                    (m, m + 1, m + 2, m + 3),
                    tokens,
                    slot_weights,
                    bias,
                    e,
                    dots,
                    sums,
                )
            elif count == 3:
                _tile_down_rows(
                    blocks_e, scales_e, first, last, acts, (m, m + 1, m + 2), tokens, slot_weights, bias, e, dots, sums
                )
            elif count == 2:
                _tile_down_rows(
                    blocks_e, scales_e, first, last, acts, (m, m + 1), tokens, slot_weights, bias, e, dots, sums
                )
            else:
                _tile_down_rows(blocks_e, scales_e, first, last, acts, (m,), tokens, slot_weights, bias, e, dots, sums)


def tile_down_rows(acts, tokens, slot_weights, offsets, experts, blocks, scales, bias, sums, threaded=True):
    """`moeroute.experts.cpu.mxfp4.down_rows` with the dot instructions (only where `serves`):
    acts [M, I] uint16, bfloat16 bits in `split_pairs` order; threads split the output
    columns (blocks of `ROW_BLOCK`)."""
    # The serial form (threaded=False): all output columns as one block, each expert's down
    # weights read as one stream (the same sums, bit for bit).
    columns = ROW_BLOCK if threaded else max(1, blocks.shape[1])
    for block in numba.prange((blocks.shape[1] + columns - 1) // columns):
        _tile_down_block(acts, tokens, slot_weights, offsets, experts, blocks, scales, bias, sums, block, columns)


def tile_kernels(module: str, prefix: str, tile) -> dict:
    """``gate_up_rows``, ``down_rows`` (and ``_serial`` forms) over tiles of up to `ROW_TILE`
    weight rows by `ROW_TILE` activation rows, around the format's ``tile``; also the work
    item ``_tile_gate_up_item`` and the column block ``_tile_down_block``, for one-call
    forwards. The serial ``down_rows`` takes all output columns as one block (each expert's
    down weights one stream; the same sums, bit for bit)."""
    made = specialize(
        module,
        prefix,
        dict(globals(), tile=tile),
        helpers=(_tile_gate_up_rows, _tile_gate_up_item, _tile_down_rows, _tile_down_block),
        kernels=(tile_gate_up_rows, tile_down_rows),
        fastmath=True,
    )
    for name in ("gate_up_rows", "down_rows"):
        made[name], made[name + "_serial"] = made.pop("tile_" + name), made.pop(f"tile_{name}_serial")
    return made
