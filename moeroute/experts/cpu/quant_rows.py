"""The quantized expert MLPs in one Numba call each: FP8 (w8a8, dynamic activation scales as
floats, or w8a16: the activations as they are with unit scales) on either of
`moeroute.experts.cpu.fp8`'s families (`rows_experts_fp8_widened` on any CPU,
`rows_experts_fp8_dot` with the bfloat16 dot instruction), and, on CPUs with AVX512-BF16,
MXFP4 (w4a16, `moeroute.experts.cpu.mxfp4_dot`) and INT4 (w4a16, `moeroute.experts.cpu.int4_dot`, or MXFP4's tiles
with INT4's table and scales).

A decode step then enters compiled code once for its experts, as the float layer's
`moeroute.experts.cpu.rows.rows_experts_bf16` does. Each forward is a template around one
format's work item and column block of the tiled loop (`moeroute.experts.cpu.tiles`). FP8:
the rows quantized per group (`moeroute.experts.cpu.fp8.quantize_rows`, bit for bit
`quantize_fp8_activations`), the gate_up dots, the gated activation (`_rows._gated`), the
intermediate rounded to the activation dtype and quantized again, the down dots added into
the float32 sums, and the sums written out. MXFP4: the rows reordered for the dot kernels,
the gate_up dots (with bias), the activation rounded to bfloat16 and reordered, the down
dots, the output; INT4 the same, on the tiles of `moeroute.experts.cpu.int4_dot` (symmetric
and asymmetric, widths in whole chunks of 128 columns: their own order, with sums of the
activations) or else MXFP4's (symmetric). Each step is the one the torch-level paths
(`fp8_experts._rows_forward`, `mxfp4_experts._rows_forward`) take between their kernel calls;
only the activation is computed by Numba instead of torch (the same formulas, float32, within
a few ulps).
"""

from __future__ import annotations

import numba
import numpy as np

from moeroute.experts.cpu.variants import specialize
from moeroute.experts.cpu.rows import (
    _bfloat16_bits_to_float32,
    _round_bfloat16,
    activate_rows,
    activate_rows_bf16,
    float32_rows,
    store_sums,
)
from moeroute.experts.cpu import int4 as cpu_int4
from moeroute.experts.cpu import int4_dot, mxfp4_dot
from moeroute.experts.cpu import fp8 as cpu_fp8

__all__ = [
    "rows_experts_fp8_widened",
    "rows_experts_fp8_widened_serial",
    "rows_experts_fp8_dot",
    "rows_experts_fp8_dot_serial",
    "rows_experts_mxfp4",
    "rows_experts_mxfp4_serial",
    "rows_experts_int4",
    "rows_experts_int4_serial",
    "rows_experts_int4_quad",
    "rows_experts_int4_quad_serial",
    "thread_columns",
]


@numba.njit
def _quantize_row(x, m, group, round_bf16, min_amax, q, scales, bits):
    """Row m of float32 ``x`` quantized per ``group`` columns (`cpu_fp8.quantize_rows`): its e4m3
    values into ``q`` and, as bfloat16 bits, into ``bits``, its scales into ``scales``."""
    cpu_fp8.quantize_rows(x[m : m + 1], group, round_bf16, min_amax, q[m : m + 1], scales[m : m + 1])
    values = q[m].view(np.uint32)
    for k in range(x.shape[1]):
        bits[m, k] = np.uint16(values[k] >> np.uint32(16))  # an e4m3 value is a bfloat16


@numba.njit
def _quantization_buffers(x, group):
    """(q, scales, bits) for `_quantize_row` over the rows of ``x``."""
    rows, cols = x.shape
    return (
        np.empty((rows, cols), np.float32),
        np.empty((rows, (cols + group - 1) // group), np.float32),
        np.empty((rows, cols), np.uint16),
    )


@numba.njit
def _weight_group_scales(scales, groups):
    """``scales`` [M, groups]; one scale per row (a group of the whole row) repeated over the
    ``groups`` weight column blocks."""
    if scales.shape[1] == groups:
        return scales
    repeated = np.empty((scales.shape[0], groups), np.float32)
    for m in range(scales.shape[0]):
        for g in range(groups):
            repeated[m, g] = scales[m, 0]
    return repeated


# What the two FP8 families' dots read (bound per family by `_fp8_one_call`): the e4m3
# values as float32 (the widened kernels, `cpu_fp8.widened`) or as bfloat16 bits (the dot
# kernels, `cpu_fp8.bf16_dot`); for w8a16, the rows and the intermediate as they are, or as
# bfloat16 bits.


@numba.njit
def _e4m3_values(q, bits):
    return q


@numba.njit
def _e4m3_bits(q, bits):
    return bits


@numba.njit
def _rows_as_given(xs):
    return xs


@numba.njit
def _rows_as_bfloat16(xs):
    """bfloat16 bits of float32 rows ``xs`` (bfloat16 values exact, float32 ones rounded to the nearest)."""
    bits = np.empty(xs.shape, np.uint16)
    for m in range(xs.shape[0]):
        for k in range(xs.shape[1]):
            bits[m, k] = _round_bfloat16(xs[m, k])
    return bits


@numba.njit
def _activated_floats(gate_up, m, code, round_bf16, acts, bits):
    """Row m of the w8a16 intermediate as float32 ``acts``, rounded to bfloat16 values where ``round_bf16``."""
    activate_rows(gate_up[m : m + 1], code, acts[m : m + 1])
    if round_bf16:
        for k in range(acts.shape[1]):
            acts[m, k] = _bfloat16_bits_to_float32(_round_bfloat16(acts[m, k]))


@numba.njit
def _activated_bits(gate_up, m, code, round_bf16, acts, bits):
    """Row m of the w8a16 intermediate as bfloat16 ``bits``."""
    activate_rows_bf16(gate_up[m : m + 1], code, bits[m : m + 1])


def operand(q, bits):  # pragma: no cover - bound per family
    """The dots' operand of quantized rows."""
    raise NotImplementedError


def unquantized(xs):  # pragma: no cover - bound per family
    """The dots' operand of w8a16 input rows."""
    raise NotImplementedError


def activated(gate_up, m, code, round_bf16, acts, bits):  # pragma: no cover - bound per family
    """Row m of the w8a16 intermediate, into ``acts`` or ``bits``."""
    raise NotImplementedError


def intermediate(acts, bits):  # pragma: no cover - bound per family
    """The dots' operand of the w8a16 intermediate."""
    raise NotImplementedError


#: Whether the intermediate runs row by row on every thread (bound per family).
THREADED_INTERMEDIATE = True


def tile_gate_up_item(xs, tokens, offsets, e, chunk, w, s, bias, out):  # pragma: no cover - bound per family
    """The FP8 family's gate_up work item (`moeroute.experts.cpu.tiles.row_kernels`)."""
    raise NotImplementedError


def tile_down_block(
    acts, tokens, slot_weights, offsets, experts, w, s, bias, sums, block, columns
):  # pragma: no cover - bound per family
    """The FP8 family's down column block (`moeroute.experts.cpu.tiles.row_kernels`)."""
    raise NotImplementedError


def _fp8_rows(x, group, min_amax, quantize, groups):
    """The first GEMM's operand: the rows of ``x`` quantized per ``group`` columns (w8a8), or
    as they are with unit scales (w8a16), as the family's dots read them; scales [T, groups]."""
    xs = float32_rows(x)
    if not quantize:
        return unquantized(xs), np.ones((xs.shape[0], groups), np.float32)
    q, scales, bits = _quantization_buffers(xs, group)
    for m in range(xs.shape[0]):
        _quantize_row(xs, m, group, False, min_amax, q, scales, bits)
    return operand(q, bits), _weight_group_scales(scales, groups)


def _fp8_intermediate_row(gate_up, m, code, round_bf16, group, min_amax, quantize, acts, q, scales, bits):
    """Row m of the intermediate: the activation, rounded to bfloat16 first where
    ``round_bf16``, quantized per ``group`` columns (`_quantize_row`); without ``quantize``
    (w8a16) as the family's dots read it."""
    if quantize:
        activate_rows(gate_up[m : m + 1], code, acts[m : m + 1])
        _quantize_row(acts, m, group, round_bf16, min_amax, q, scales, bits)
    else:
        activated(gate_up, m, code, round_bf16, acts, bits)


def _fp8_intermediate(q, scales, bits, acts, groups, quantize):
    """The down GEMM's operand and its scales per weight column block (ones for w8a16)."""
    if quantize:
        return operand(q, bits), _weight_group_scales(scales, groups)
    return intermediate(acts, bits), np.ones((scales.shape[0], groups), np.float32)


def rows_experts_fp8(
    x,
    tokens,
    slot_weights,
    offsets,
    hit,
    work,
    q_gate_up,
    gate_up_scale,
    q_down,
    down_scale,
    gate_up_block,
    down_block,
    groups,
    round_intermediate,
    min_amax,
    code,
    quantize,
    columns,
    out,
):
    """out[t] = sum_k weights[t, k] * expert_{ids[t, k]}(x[t]), the w8a8 expert MLP, in one call.

    x [T, H] and out [T, H] uint16 (bfloat16 bits) or float32; tokens, slot_weights, offsets,
    hit, work: `moeroute.experts.cpu.rows.plan_rows`' plan; q_gate_up [L, 2I, H] and
    q_down [L, H, I] uint8 (e4m3 bytes), gate_up_scale [L, 2nb, G] and down_scale
    [L, ceil(H/bn), G'] float32, gate_up_block / down_block (bn, bk); ``groups`` the
    activation group sizes of the two GEMMs' inputs (each a weight column block, or the row
    length: one scale per row); ``round_intermediate``: the intermediate rounded to bfloat16
    before it is quantized (bfloat16 activations); ``code`` the activation
    (`_rows.ACTIVATION_CODES`); ``quantize``: False for w8a16 (the rows and the intermediate
    taken as they are with unit scales; ``groups`` and ``min_amax`` unused); ``columns``:
    the down GEMM's output columns per unit of parallel work (`thread_columns`, a multiple
    of 64). A template (`rows_experts_fp8_widened`: `cpu_fp8.widened`'s tiles, any CPU;
    `rows_experts_fp8_dot`: `cpu_fp8.bf16_dot`'s, only where `cpu_fp8.bf16_dot_serves`).
    """
    inter = q_gate_up.shape[1] // 2
    no_bias = np.empty((0, 0), np.float32)
    xs = _fp8_rows(x, groups[0], min_amax, quantize, gate_up_scale.shape[2])
    gate_up = np.empty((tokens.shape[0], 2 * inter), np.float32)
    gate_up_scales = (gate_up_scale, inter, gate_up_block[0], gate_up_block[1])
    for item in numba.prange(work.shape[0]):
        tile_gate_up_item(
            xs, tokens, offsets, work[item, 0], work[item, 1], q_gate_up, gate_up_scales, no_bias, gate_up
        )
    acts = np.empty((gate_up.shape[0], inter), np.float32)
    q, scales, bits = _quantization_buffers(acts, groups[1])
    if THREADED_INTERMEDIATE:
        for m in numba.prange(acts.shape[0]):  # the activation and its quantization row by row on every thread
            _fp8_intermediate_row(
                gate_up, m, code, round_intermediate, groups[1], min_amax, quantize, acts, q, scales, bits
            )
    else:
        for m in range(acts.shape[0]):
            _fp8_intermediate_row(
                gate_up, m, code, round_intermediate, groups[1], min_amax, quantize, acts, q, scales, bits
            )
    a = _fp8_intermediate(q, scales, bits, acts, down_scale.shape[2], quantize)
    sums = np.zeros((x.shape[0], q_down.shape[1]), np.float32)
    down_scales = (down_scale, q_down.shape[1], down_block[0], down_block[1])
    for block in numba.prange((q_down.shape[1] + columns - 1) // columns):
        tile_down_block(a, tokens, slot_weights, offsets, hit, q_down, down_scales, no_bias, sums, block, columns)
    store_sums(sums, out)


def thread_columns(columns: int, threads: int, multiple: int) -> int:
    """``columns`` output columns split in ``threads`` contiguous ranges, each a multiple of
    ``multiple`` (where the serial kernels' tiles start too)."""
    share = -(-columns // threads)
    return max(multiple, -(-share // multiple) * multiple)


@numba.njit
def _split_rows(x, scales):
    """bfloat16 rows (uint16 bits) in the MXFP4 dot kernels' order (`mxfp4_dot.split_pairs`)."""
    out = np.empty_like(x)
    mxfp4_dot.split_pairs(x, out)
    return out


@numba.njit
def _mxfp4_intermediate_row(gate_up, m, code, natural, acts, scales):
    """Row m of the intermediate rounded to bfloat16 (``natural``), and in `split_pairs` order
    (``acts``)."""
    activate_rows_bf16(gate_up[m : m + 1], code, natural[m : m + 1])
    mxfp4_dot.split_pairs(natural[m : m + 1], acts[m : m + 1])


@numba.njit
def _same_empty(rows, columns):
    """An empty array of ``rows`` `split_pairs` rows: bfloat16 bits, the columns."""
    return np.empty((rows, columns), np.uint16)


@numba.njit
def _int4_split_rows(x, params):
    """bfloat16 rows in the order of the tile `int4_dot` runs on this path (`int4_dot.split`,
    with the sums its weights' zero points need: ``params [L, N, P, G']``, P = 2 asymmetric)."""
    out = int4_dot.split_empty(x.shape[0], x.shape[1])
    int4_dot.split(x, int4_dot.sums_bias(params.shape[2] == 2), out)
    return out


@numba.njit
def _int4_intermediate_row(gate_up, m, code, natural, acts, params):
    """Row m of the intermediate rounded to bfloat16 (``natural``), and in the tile's order
    (``acts``, as `int4_dot.split_empty` makes them)."""
    activate_rows_bf16(gate_up[m : m + 1], code, natural[m : m + 1])
    int4_dot.split(natural[m : m + 1], int4_dot.sums_bias(params.shape[2] == 2), acts[m : m + 1])


def rows_experts(
    x,
    tokens,
    slot_weights,
    offsets,
    hit,
    work,
    gate_up_blocks,
    gate_up_scales,
    down_blocks,
    down_scales,
    gate_up_bias,
    down_bias,
    code,
    columns,
    out,
):
    """The 4-bit (w4a16) expert MLP in one call, with the bfloat16-dot tiles of
    `moeroute.experts.cpu.mxfp4_dot` (a template: `rows_experts_mxfp4`, `rows_experts_int4`;
    only where `mxfp4_dot.serves`): x [T, H] and out [T, H] uint16 (bfloat16 bits); the plan
    as `rows_experts_fp8`'s; blocks, scales and biases as the format's ``gate_up_rows`` /
    ``down_rows`` take them (MXFP4: `mxfp4_dot`; symmetric INT4: `moeroute.experts.cpu.int4`); ``code`` the activation (`_rows.ACTIVATION_CODES`). The
    intermediate is rounded to bfloat16 before the down dots, as the float layer keeps it.
    ``columns``: the down GEMM's output columns per unit of parallel work (`thread_columns`:
    one contiguous range per thread, so that each expert's down rows are one stream per
    thread; the same sums, bit for bit, as any other multiple of four).
    """
    xs = split_rows(x, gate_up_scales)
    rows, inter = tokens.shape[0], gate_up_blocks.shape[1] // 2
    gate_up = np.empty((rows, 2 * inter), np.float32)
    for item in numba.prange(work.shape[0]):
        gate_up_item(
            xs, tokens, offsets, work[item, 0], work[item, 1], gate_up_blocks, gate_up_scales, gate_up_bias, gate_up
        )
    natural = np.empty((rows, inter), np.uint16)
    acts = split_empty(rows, inter)
    for m in numba.prange(rows):  # the activation row by row on every thread
        intermediate_row(gate_up, m, code, natural, acts, down_scales)
    sums = np.zeros((x.shape[0], down_blocks.shape[1]), np.float32)
    for block in numba.prange((down_blocks.shape[1] + columns - 1) // columns):
        down_block(acts, tokens, slot_weights, offsets, hit, down_blocks, down_scales, down_bias, sums, block, columns)
    store_sums(sums, out)


def gate_up_item(xs, tokens, offsets, e, chunk, blocks, scales, bias, out):  # pragma: no cover - bound per format
    """The format's gate_up work item (`moeroute.experts.cpu.tiles.row_kernels`)."""
    raise NotImplementedError


def down_block(
    acts, tokens, slot_weights, offsets, experts, blocks, scales, bias, sums, block, columns
):  # pragma: no cover
    """The format's down column block (`moeroute.experts.cpu.tiles.row_kernels`)."""
    raise NotImplementedError


def split_rows(x, scales):  # pragma: no cover - bound per format
    """The activations in the order the format's tile reads (`_split_rows`, `_int4_split_rows`)."""
    raise NotImplementedError


def split_empty(rows, columns):  # pragma: no cover - bound per format
    """An empty array of ``rows`` rows of ``columns`` activations in that order."""
    raise NotImplementedError


def intermediate_row(gate_up, m, code, natural, acts, scales):  # pragma: no cover - bound per format
    """Row m of the intermediate, rounded to bfloat16 and in that order."""
    raise NotImplementedError


def _one_call(
    prefix: str,
    kernels: dict,
    split_rows=_split_rows,
    split_empty=_same_empty,
    intermediate_row=_mxfp4_intermediate_row,
) -> dict:
    """`rows_experts` (and its serial form) around one format's tile kernels and the order its
    activations take (``split_rows(x, scales)``, an empty array of it ``split_empty(rows,
    columns)``, ``intermediate_row``)."""
    namespace = dict(
        globals(),
        gate_up_item=kernels["_gate_up_item"],
        down_block=kernels["_down_block"],
        split_rows=split_rows,
        split_empty=split_empty,
        intermediate_row=intermediate_row,
    )
    return specialize(__name__, prefix, namespace, kernels=(rows_experts,))


def _fp8_one_call(prefix: str, kernels: dict, operand, unquantized, activated, intermediate, threaded) -> dict:
    """`rows_experts_fp8` (and its serial form) around one FP8 family's tile kernels;
    ``threaded``: the intermediate row by row on every thread (else on the calling thread,
    between the two GEMMs' parallel regions)."""
    namespace = dict(
        globals(),
        THREADED_INTERMEDIATE=threaded,
        tile_gate_up_item=kernels["_gate_up_item"],
        tile_down_block=kernels["_down_block"],
        operand=operand,
        unquantized=unquantized,
        activated=activated,
        intermediate=intermediate,
    )
    return specialize(
        __name__,
        prefix,
        namespace,
        helpers=(_fp8_rows, _fp8_intermediate_row, _fp8_intermediate),
        kernels=(rows_experts_fp8,),
    )


# The widened family's intermediate stays on the calling thread: with its float dots a
# third parallel region costs a decode step more than the rows' activation takes.
_fp8 = _fp8_one_call("fp8", cpu_fp8.widened, _e4m3_values, _rows_as_given, _activated_floats, _e4m3_values, False)
rows_experts_fp8_widened, rows_experts_fp8_widened_serial = _fp8["rows_experts_fp8"], _fp8["rows_experts_fp8_serial"]
_fp8_dot = _fp8_one_call("fp8_dot", cpu_fp8.bf16_dot, _e4m3_bits, _rows_as_bfloat16, _activated_bits, _e4m3_bits, True)
rows_experts_fp8_dot, rows_experts_fp8_dot_serial = _fp8_dot["rows_experts_fp8"], _fp8_dot["rows_experts_fp8_serial"]
_mxfp4 = _one_call("mxfp4", mxfp4_dot.tile_family)
rows_experts_mxfp4, rows_experts_mxfp4_serial = _mxfp4["rows_experts"], _mxfp4["rows_experts_serial"]
_int4 = _one_call("int4", cpu_int4.tile_family)
rows_experts_int4, rows_experts_int4_serial = _int4["rows_experts"], _int4["rows_experts_serial"]
_int4_quad = _one_call(
    "int4_quad", int4_dot.tile_family, _int4_split_rows, int4_dot.split_empty, _int4_intermediate_row
)
rows_experts_int4_quad = _int4_quad["rows_experts"]
rows_experts_int4_quad_serial = _int4_quad["rows_experts_serial"]
