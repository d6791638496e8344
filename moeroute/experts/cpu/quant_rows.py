"""The quantized expert MLPs in one Numba call each, on CPUs with AVX512-BF16: FP8 (w8a8,
`moeroute.experts.cpu.fp8`'s bfloat16-dot kernels, dynamic activation scales as floats, or
w8a16: the same kernels on the bfloat16 activations with unit scales) and MXFP4
(w4a16, `moeroute.experts.cpu.mxfp4_dot`) and symmetric INT4 (w4a16, the same tiles with
INT4's table and scales).

A decode step then enters compiled code once for its experts, as the float layer's
`moeroute.experts.cpu.rows.rows_experts_bf16` does. FP8: the rows quantized per group
(`moeroute.experts.cpu.fp8.quantize_rows`, bit for bit `quantize_fp8_activations`), the gate_up
dots, the gated activation (`_rows._gated`), the intermediate rounded to the activation dtype
and quantized again, the down dots added into the float32 sums, and the sums written out.
MXFP4: the rows reordered for the dot kernels, the gate_up dots (with bias), the activation
rounded to bfloat16 and reordered, the down dots, the output; INT4 the same, on the tiles
of `moeroute.experts.cpu.int4_dot` (symmetric and asymmetric, widths in whole chunks of 128
columns: their own order, with sums of the activations) or else MXFP4's (symmetric). Each
step is the one the torch-level paths (`fp8_experts._rows_forward`, `mxfp4_experts._rows_forward`) take between
their kernel calls; only the activation is computed by Numba instead of torch (the same
formulas, float32, within a few ulps).
"""

from __future__ import annotations

import numba
import numpy as np

from moeroute.experts.cpu.variants import parallel_and_serial, specialize
from moeroute.experts.cpu.rows import _round_bfloat16, activate_rows, activate_rows_bf16, float32_rows, store_sums
from moeroute.experts.cpu import int4 as cpu_int4
from moeroute.experts.cpu import int4_dot, mxfp4_dot
from moeroute.experts.cpu import fp8 as cpu_fp8

__all__ = [
    "rows_experts_fp8",
    "rows_experts_fp8_serial",
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


@numba.njit
def _quantized_bfloat16(x, group, round_bf16, min_amax, groups):
    """(e4m3 values as bfloat16 bits [M, K] uint16, scales [M, groups] float32) of float32 rows
    ``x``, quantized per ``group`` columns (`cpu_fp8.quantize_rows`); one scale per row
    (``group`` >= K) is repeated over the ``groups`` weight column blocks."""
    q, scales, bits = _quantization_buffers(x, group)
    for m in range(x.shape[0]):
        _quantize_row(x, m, group, round_bf16, min_amax, q, scales, bits)
    return bits, _weight_group_scales(scales, groups)


@numba.njit
def _bfloat16_operand(xs, groups):
    """(bfloat16 bits [M, K] uint16, unit scales [M, groups]) of float32 rows ``xs``: the w8a16
    operand (bfloat16 values exact, float32 ones rounded to the nearest bfloat16)."""
    bits = np.empty(xs.shape, np.uint16)
    for m in range(xs.shape[0]):
        for k in range(xs.shape[1]):
            bits[m, k] = _round_bfloat16(xs[m, k])
    return bits, np.ones((xs.shape[0], groups), np.float32)


@numba.njit
def _prologue(x, tokens, q_gate_up, gate_up_scale, group, min_amax, quantize):
    """The quantized rows of ``x`` (w8a8), or ``x`` as bfloat16 with unit scales (w8a16), and
    the gate_up output buffer."""
    xs = float32_rows(x)
    if quantize:
        q_x, s_x = _quantized_bfloat16(xs, group, False, min_amax, gate_up_scale.shape[2])
    else:
        q_x, s_x = _bfloat16_operand(xs, gate_up_scale.shape[2])
    return q_x, s_x, np.empty((tokens.shape[0], q_gate_up.shape[1]), np.float32)


@numba.njit
def _intermediate_buffers(gate_up, group):
    """(acts, q, scales, bits) for `_intermediate_row`: the activation [M, I] float32, its e4m3
    values, scales and bfloat16 bits."""
    acts = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), np.float32)
    q, scales, bits = _quantization_buffers(acts, group)
    return acts, q, scales, bits


@numba.njit
def _intermediate_row(gate_up, m, code, round_bf16, group, min_amax, quantize, acts, q, scales, bits):
    """Row m of the quantized intermediate: the activation, rounded to bfloat16 first where
    ``round_bf16``, quantized per ``group`` columns (`_quantize_row`); without ``quantize``
    (w8a16) the activation rounded to bfloat16 bits, the dot kernels' operand."""
    if quantize:
        activate_rows(gate_up[m : m + 1], code, acts[m : m + 1])
        _quantize_row(acts, m, group, round_bf16, min_amax, q, scales, bits)
    else:
        activate_rows_bf16(gate_up[m : m + 1], code, bits[m : m + 1])


@numba.njit
def _intermediate_scales(scales, groups, quantize):
    """The down GEMM's activation scales per weight column block: the intermediate's (w8a8),
    or ones (w8a16)."""
    if quantize:
        return _weight_group_scales(scales, groups)
    return np.ones((scales.shape[0], groups), np.float32)


@parallel_and_serial(cache=True)
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
    taken as bfloat16 with unit scales; ``groups``, ``min_amax`` and
    ``round_intermediate`` unused); ``columns``: the down GEMM's output columns per unit of
    parallel work (`thread_columns`, a multiple of 64). Only where `cpu_fp8.bf16_dot_serves`.
    """
    inter = q_gate_up.shape[1] // 2
    q_x, s_x, gate_up = _prologue(x, tokens, q_gate_up, gate_up_scale, groups[0], min_amax, quantize)
    for item in numba.prange(work.shape[0]):
        cpu_fp8._gate_up_item_bf16(
            q_x,
            s_x,
            tokens,
            offsets,
            work[item, 0],
            work[item, 1],
            q_gate_up,
            gate_up_scale,
            inter,
            gate_up_block[0],
            gate_up_block[1],
            gate_up,
        )
    acts, q, scales, q_a = _intermediate_buffers(gate_up, groups[1])
    for m in numba.prange(acts.shape[0]):  # the activation and its quantization row by row on every thread
        _intermediate_row(gate_up, m, code, round_intermediate, groups[1], min_amax, quantize, acts, q, scales, q_a)
    s_a = _intermediate_scales(scales, down_scale.shape[2], quantize)
    sums = np.zeros((x.shape[0], q_down.shape[1]), np.float32)
    for block in numba.prange((q_down.shape[1] + columns - 1) // columns):
        cpu_fp8._down_block_bf16(
            q_a,
            s_a,
            tokens,
            slot_weights,
            offsets,
            hit,
            q_down,
            down_scale,
            down_block[0],
            down_block[1],
            sums,
            block,
            columns,
        )
    store_sums(sums, out)


rows_experts_fp8_serial = rows_experts_fp8.serial


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
def _same_width(columns):
    """Words of a `split_pairs` row: the columns."""
    return columns


@numba.njit
def _int4_split_width(columns):
    """Words of a `split_quads` row of ``columns`` activations."""
    return columns // int4_dot.CHUNK * int4_dot.CHUNK_WORDS


@numba.njit
def _int4_split_rows(x, params):
    """bfloat16 rows in the order of `int4_dot`'s tile (`int4_dot.split_quads`, with the sums
    its weights' zero points need: ``params [L, N, P, G']``, P = 2 asymmetric)."""
    out = np.empty((x.shape[0], _int4_split_width(x.shape[1])), np.uint16)
    int4_dot.split_quads(x, int4_dot.sums_bias(params.shape[2] == 2), out)
    return out


@numba.njit
def _int4_intermediate_row(gate_up, m, code, natural, acts, params):
    """Row m of the intermediate rounded to bfloat16 (``natural``), and in `split_quads` order
    (``acts``, the width of `_int4_split_rows`)."""
    activate_rows_bf16(gate_up[m : m + 1], code, natural[m : m + 1])
    int4_dot.split_quads(natural[m : m + 1], int4_dot.sums_bias(params.shape[2] == 2), acts[m : m + 1])


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
    acts = np.empty((rows, split_width(inter)), np.uint16)
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


def split_width(columns):  # pragma: no cover - bound per format
    """Words of a row of ``columns`` activations in that order."""
    raise NotImplementedError


def intermediate_row(gate_up, m, code, natural, acts, scales):  # pragma: no cover - bound per format
    """Row m of the intermediate, rounded to bfloat16 and in that order."""
    raise NotImplementedError


def _one_call(
    prefix: str,
    kernels: dict,
    split_rows=_split_rows,
    split_width=_same_width,
    intermediate_row=_mxfp4_intermediate_row,
) -> dict:
    """`rows_experts` (and its serial form) around one format's tile kernels and the order its
    activations take (``split_rows(x, scales)``, its row width ``split_width(columns)``,
    ``intermediate_row``)."""
    namespace = dict(
        globals(),
        gate_up_item=kernels["_gate_up_item"],
        down_block=kernels["_down_block"],
        split_rows=split_rows,
        split_width=split_width,
        intermediate_row=intermediate_row,
    )
    return specialize(__name__, prefix, namespace, kernels=(rows_experts,))


_mxfp4 = _one_call("mxfp4", mxfp4_dot.tile_family)
rows_experts_mxfp4, rows_experts_mxfp4_serial = _mxfp4["rows_experts"], _mxfp4["rows_experts_serial"]
_int4 = _one_call("int4", cpu_int4.tile_family)
rows_experts_int4, rows_experts_int4_serial = _int4["rows_experts"], _int4["rows_experts_serial"]
_int4_quad = _one_call("int4_quad", int4_dot.tile_family, _int4_split_rows, _int4_split_width, _int4_intermediate_row)
rows_experts_int4_quad = _int4_quad["rows_experts"]
rows_experts_int4_quad_serial = _int4_quad["rows_experts_serial"]
