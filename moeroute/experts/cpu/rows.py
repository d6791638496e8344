"""Numba CPU kernels of the float expert GEMMs for few rows per expert: one weight row at a time.

At decode-sized batches an expert serves one to a few rows, and its GEMMs are bound by reading
its weights. These kernels read each weight row once and dot it with every row the expert
serves, two weight rows by four activation rows at a time; a bfloat16 weight is widened to
float32 in registers as it is read (its 16 bits moved into a float32's high half: exact), so
memory carries two bytes a weight. No weight is
reordered or copied per call (oneDNN reorders each expert's bfloat16 weights on every call
where the CPU has no bfloat16 instructions), and the second GEMM adds its weighted outputs
straight into the float32 sums (the combine). One call (`rows_experts`) runs a whole forward,
from the routed slots to the output rows, so a decode step enters compiled code once.

On CPUs with AVX512-BF16, `rows_experts_bf16` uses the bfloat16 dot-product instruction
(``vdpbf16ps``) instead of widening: a tile of four weight rows, read one after the other
(one sequential stream, which the hardware prefetchers follow), against up to four
activation rows, the tile's sums reduced together.

Arrays are NumPy: bfloat16 weights as uint16 views, or float32; activations, biases and
sums float32. The FP8 kernels of `moeroute.experts.cpu.fp8` have the same structure.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic, overload

from moeroute.experts.cpu import tiles
from moeroute.experts.cpu.variants import parallel_and_serial
from moeroute.experts.activations import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT
from moeroute.experts.cpu.dot import (
    BF16_DOT,
    LANES,
    BFloat16Type,
    accumulators,
    dot_function,
    row_pointers,
    sum_lanes,
)

__all__ = [
    "plan_rows",
    "rows_experts",
    "rows_experts_serial",
    "rows_experts_bf16",
    "rows_experts_bf16_serial",
    "BF16_DOT",
    "ACTIVATION_CODES",
    "ROW_BLOCK",
]

#: Weight rows per unit of parallel work (gate_up) and output columns per thread block (down).
ROW_BLOCK = tiles.ROW_BLOCK
#: Activation rows dotted per pass over a widened weight row.
_ROW_TILE = tiles.ROW_TILE


@intrinsic
def _bfloat16_bits_to_float32(typingctx, bits):
    """The float32 whose high 16 bits are ``bits`` (uint16) and low bits zero: a bfloat16's
    value, exactly. Zero-extend, shift, bitcast: LLVM vectorizes all three."""

    def codegen(context, builder, signature, args):
        wide = builder.zext(args[0], ir.IntType(32))
        return builder.bitcast(builder.shl(wide, ir.Constant(ir.IntType(32), 16)), ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def _float32_bits(typingctx, value):
    """The bits of a float32 as an int32 (a register move, vectorizable)."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.int32(types.float32), codegen


def _as_float32(value):  # pragma: no cover - replaced by the overload inside Numba code
    raise NotImplementedError


@overload(_as_float32)
def _as_float32_impl(value):
    """A weight element as float32: bfloat16 bits (uint16) widened, float32 as is."""
    if value == types.uint16:
        return lambda value: _bfloat16_bits_to_float32(value)
    if value == types.float32:
        return lambda value: value
    return None


@numba.njit(fastmath=True)
def _dot(w, x):
    acc = np.float32(0.0)
    for k in range(w.shape[0]):
        acc += _as_float32(w[k]) * x[k]
    return acc


@numba.njit(fastmath=True)
def _dot4(w, x0, x1, x2, x3, out):
    """out[i] = dot(w, x_i) for four rows (w read once for the four)."""
    a0 = a1 = a2 = a3 = np.float32(0.0)
    for k in range(w.shape[0]):
        wk = _as_float32(w[k])
        a0 += wk * x0[k]
        a1 += wk * x1[k]
        a2 += wk * x2[k]
        a3 += wk * x3[k]
    out[0], out[1], out[2], out[3] = a0, a1, a2, a3


@numba.njit(fastmath=True)
def _dot2x4(w0, w1, x0, x1, x2, x3, out):
    """out[4i + j] = dot(w_i, x_j) for two weight rows and four activation rows: eight sums
    in registers for six loads a step, where `_dot4` has four for five."""
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
    for k in range(w0.shape[0]):
        u, v = _as_float32(w0[k]), _as_float32(w1[k])
        p = x0[k]
        a0 += u * p
        b0 += v * p
        p = x1[k]
        a1 += u * p
        b1 += v * p
        p = x2[k]
        a2 += u * p
        b2 += v * p
        p = x3[k]
        a3 += u * p
        b3 += v * p
    out[0], out[1], out[2], out[3] = a0, a1, a2, a3
    out[4], out[5], out[6], out[7] = b0, b1, b2, b3


def widened_dots(operand, n, count, xs, x_rows, out):  # pragma: no cover - replaced by the overload inside Numba code
    raise NotImplementedError


@overload(widened_dots, jit_options={"fastmath": True})
def _widened_dots_impl(operand, n, count, xs, x_rows, out):
    """The tiled loop's dots (`moeroute.experts.cpu.tiles`) of ``count`` (1 or 2) weight rows
    ``operand`` (bfloat16 bits or float32, widened as read) with a tuple of activation rows:
    two weight rows by four activation rows in one pass (`_dot2x4`), one by four (`_dot4`),
    fewer rows one dot each."""
    if isinstance(x_rows, types.UniTuple) and x_rows.count == _ROW_TILE:

        def four(operand, n, count, xs, x_rows, out):
            w0, w1 = operand
            x0, x1, x2, x3 = xs[x_rows[0]], xs[x_rows[1]], xs[x_rows[2]], xs[x_rows[3]]
            if count == 2:
                _dot2x4(w0, w1, x0, x1, x2, x3, out)
            else:
                _dot4(w0, x0, x1, x2, x3, out)

        return four

    def fewer(operand, n, count, xs, x_rows, out):
        w0, w1 = operand
        rows = len(x_rows)
        for j in range(rows):
            x = xs[x_rows[j]]
            out[j] = _dot(w0, x)
            if count == 2:
                out[rows + j] = _dot(w1, x)

    return fewer


@numba.njit
def _weight_rows(w, s, e, n, count, scratch):
    """The tiled loop's ``load`` of the float weights: rows n and n + count - 1 of expert e
    (views: the weights are read as they are, no copy)."""
    return w[e, n], w[e, n + count - 1]


#: The tiled loop around the widened dots: two weight rows by four activation rows.
_float = tiles.row_kernels(__name__, "float", _weight_rows, widened_dots, 2, standalone=False)
_gate_up_item, _down_block = _float["_gate_up_item"], _float["_down_block"]


@numba.njit(cache=True)
def plan_rows(ids, weights, num_experts, blocks):
    """The row kernels' bookkeeping in one pass: each expert's slots in token order.

    ids [T, K] int32/int64 local expert ids (outside [0, L) = held elsewhere, skipped),
    weights [T, K] float32, ``blocks`` = weight-row blocks of gate_up per expert. Returns
    tokens [M] int64 and slot_weights [M] float32 (expert-major, token order within an
    expert, as a stable sort of the flat slots gives), offsets [L + 1] int64, hit [E'] int64
    (experts with rows) and work [E' * blocks, 2] int64 (expert, block) for the gate_up pass.
    """
    num_tokens, top_k = ids.shape
    offsets = np.zeros(num_experts + 1, np.int64)
    for t in range(num_tokens):
        for k in range(top_k):
            e = ids[t, k]
            if 0 <= e < num_experts:
                offsets[e + 1] += 1
    hits = 0
    for e in range(num_experts):
        hits += offsets[e + 1] > 0
        offsets[e + 1] += offsets[e]
    tokens = np.empty(offsets[num_experts], np.int64)
    slot_weights = np.empty(offsets[num_experts], np.float32)
    fill = offsets[:num_experts].copy()
    for t in range(num_tokens):
        for k in range(top_k):
            e = ids[t, k]
            if 0 <= e < num_experts:
                tokens[fill[e]] = t
                slot_weights[fill[e]] = weights[t, k]
                fill[e] += 1
    hit = np.empty(hits, np.int64)
    work = np.empty((hits * blocks, 2), np.int64)
    i = 0
    for e in range(num_experts):
        if offsets[e + 1] > offsets[e]:
            hit[i] = e
            for b in range(blocks):
                work[i * blocks + b, 0] = e
                work[i * blocks + b, 1] = b
            i += 1
    return tokens, slot_weights, offsets, hit, work


#: The gated activations of `rows_experts`, by code (the names of
#: `moeroute.experts.activations.ACTIVATIONS`).
ACTIVATION_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "swigluoai": 3}
_SQRT_HALF = np.float32(0.7071067811865476)
_SQRT_2_OVER_PI = np.float32(0.7978845608028654)
_GELU_CUBIC = np.float32(0.044715)
_SWIGLUOAI_ALPHA = np.float32(SWIGLUOAI_ALPHA)
_SWIGLUOAI_LIMIT = np.float32(SWIGLUOAI_LIMIT)


@numba.njit
def _gated(gate, up, code):
    """The gated MLP's intermediate for one column, in float32: ``act(gate) * up``, or
    gpt-oss's ``(clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g)`` with ``g = min(gate, 7)``.
    Not fast-math: NaN and infinities pass through as in torch's definitions."""
    one, half = np.float32(1.0), np.float32(0.5)
    if code == 0:
        return gate / (one + math.exp(-gate)) * up
    if code == 1:
        return gate * half * (one + math.erf(gate * _SQRT_HALF)) * up
    if code == 2:
        inner = _SQRT_2_OVER_PI * (gate + _GELU_CUBIC * gate * gate * gate)
        return half * gate * (one + math.tanh(inner)) * up
    g = _SWIGLUOAI_LIMIT if gate > _SWIGLUOAI_LIMIT else gate
    u = _SWIGLUOAI_LIMIT if up > _SWIGLUOAI_LIMIT else (-_SWIGLUOAI_LIMIT if up < -_SWIGLUOAI_LIMIT else up)
    return g * (one / (one + math.exp(-(g * _SWIGLUOAI_ALPHA)))) * (u + one)


@numba.njit
def activate_rows(gate_up, code, acts):
    """acts[m] = gated(gate_up[m, :I], gate_up[m, I:]) for every row m (`_gated`)."""
    inter = acts.shape[1]
    for m in range(acts.shape[0]):
        for n in range(inter):
            acts[m, n] = _gated(gate_up[m, n], gate_up[m, inter + n], code)


def float32_rows(x):  # pragma: no cover - replaced by the overload inside Numba code
    raise NotImplementedError


@overload(float32_rows)
def _float32_rows_impl(x):
    """Activations as float32 rows: bfloat16 bits (uint16) widened into a new array, float32
    as they are."""
    if x.dtype == types.uint16:

        def widen(x):
            xs = np.empty(x.shape, np.float32)
            for t in range(x.shape[0]):
                for k in range(x.shape[1]):
                    xs[t, k] = _bfloat16_bits_to_float32(x[t, k])
            return xs

        return widen
    if x.dtype == types.float32:
        return lambda x: x
    return None


def store_sums(sums, out):  # pragma: no cover - replaced by the overload inside Numba code
    raise NotImplementedError


@overload(store_sums)
def _store_sums_impl(sums, out):
    """The float32 sums into ``out``: copied for float32, rounded to the nearest bfloat16
    (ties to even; NaN as the quiet NaN 0x7FC0, as torch rounds) for uint16 bits."""
    if out.dtype == types.uint16:

        def round_to_bfloat16(sums, out):
            for t in range(out.shape[0]):
                for n in range(out.shape[1]):
                    out[t, n] = _round_bfloat16(sums[t, n])

        return round_to_bfloat16
    if out.dtype == types.float32:

        def copy(sums, out):
            out[:] = sums

        return copy
    return None


@numba.njit
def _blocks(matrix):
    """Blocks of `ROW_BLOCK` rows of ``matrix``'s second-to-last axis."""
    return (matrix.shape[-2] + ROW_BLOCK - 1) // ROW_BLOCK


@numba.njit
def _beyond(offsets, hit, bound):
    """Whether the mean rows per hit expert exceed ``bound``."""
    return hit.shape[0] > 0 and offsets[-1] > bound * hit.shape[0]


@numba.njit
def _buffers(x, rows, w_gate_up, w_down):
    """The float32 rows of ``x`` and the scratch of one forward: gate_up [M, 2I], the
    activations [M, I] and the zeroed sums [T, H]."""
    return (
        float32_rows(x),
        np.empty((rows, w_gate_up.shape[1]), np.float32),
        np.empty((rows, w_down.shape[2]), np.float32),
        np.zeros((x.shape[0], w_down.shape[1]), np.float32),
    )


@parallel_and_serial(cache=True)
def rows_experts(x, ids, weights, w_gate_up, w_down, b_gate_up, b_down, code, bound, out, threaded=True):
    """The whole float expert MLP with the row kernels, from the routed slots to the output.

    x [T, H] and out [T, H] uint16 (bfloat16 bits) or float32, ids [T, K] int32/int64 local
    expert ids (outside [0, L) skipped), weights [T, K] float32, w_gate_up [L, 2I, H] and
    w_down [L, H, I] of x's type, b_gate_up [L, 2I] / b_down [L, H] float32 or [0, 0] (none),
    ``code`` the activation (`ACTIVATION_CODES`). In one call: the bookkeeping (`plan_rows`),
    the rows as float32, the gate_up dots, the activation, the down dots added into float32
    sums (the combine: threads split the output columns, each sum has one writer and experts
    add in one order) and the sums written to ``out``:
    ``out[t] = sum_k weights[t, k] * expert_{ids[t, k]}(x[t])`` (rows with no slot held: 0).

    Returns False, leaving ``out`` untouched, when the mean rows per hit expert exceed
    ``bound`` (the caller's strategy choice; ``inf`` to serve every call), else True.
    """
    tokens, slot_weights, offsets, hit, work = plan_rows(ids, weights, w_gate_up.shape[0], _blocks(w_gate_up))
    if _beyond(offsets, hit, bound):
        return False
    xs, gate_up, acts, sums = _buffers(x, tokens.shape[0], w_gate_up, w_down)
    for item in numba.prange(work.shape[0]):
        _gate_up_item(xs, tokens, offsets, work[item, 0], work[item, 1], w_gate_up, w_gate_up, b_gate_up, gate_up)
    activate_rows(gate_up, code, acts)
    columns = ROW_BLOCK if threaded else max(1, w_down.shape[1])
    for b in numba.prange((w_down.shape[1] + columns - 1) // columns):
        _down_block(acts, tokens, slot_weights, offsets, hit, w_down, w_down, b_down, sums, b, columns)
    store_sums(sums, out)
    return True


rows_experts_serial = rows_experts.serial


# ---------------------------------------------------------------- bfloat16 dot-product instructions
#
# Where the CPU multiplies bfloat16 natively (AVX512-BF16: ``vdpbf16ps`` adds the two products
# of each pair of bfloat16 lanes into a float32 lane), the bfloat16 layer's dots need no
# widening: one instruction per 32 weights and row. The activations are then bfloat16 too: the
# rows as given, the intermediate rounded to bfloat16 after the activation (as torch's
# bfloat16 layer keeps it). The instruction flushes subnormal inputs and sums to zero.


_CHAINS = 4  # independent accumulators: the instruction's latency hidden
#: Weight rows per call of the dot instructions' tile (the tuples of four rows below).
_WEIGHT_TILE = 4


@intrinsic
def _dot_bf16_tile(typingctx, w, w_rows, xs, x_rows, out):
    """out[i * len(x_rows) + j] = w[w_rows[i]] . xs[x_rows[j]] over the first 32 * (n // 32)
    elements, for 1 to 4 rows of the bfloat16 weights ``w`` and 1 to 4 rows of the activations
    ``xs`` (uint16 [*, n], C-contiguous; ``out`` float32 [>= the tile's size]): each weight
    row is read once for the activation rows, four chains in flight, and the tile's sums are
    reduced together."""
    tuples_ok = all(
        isinstance(t, types.UniTuple)
        and 1 <= t.count <= max(_ROW_TILE, _WEIGHT_TILE)
        and isinstance(t.dtype, types.Integer)
        for t in (w_rows, x_rows)
    )
    if not (
        tuples_ok
        and isinstance(w, types.Array)
        and isinstance(xs, types.Array)
        and w.ndim == xs.ndim == 2
        and w.dtype == xs.dtype == types.uint16
        and w.layout == xs.layout == "C"
        and isinstance(out, types.Array)
        and out.ndim == 1
        and out.dtype == types.float32
    ):
        return None
    tile = (w_rows.count, x_rows.count)
    chains = max(1, _CHAINS // tile[1])

    def codegen(context, builder, signature, args):
        v32i16, v16f = ir.VectorType(ir.IntType(16), LANES), ir.VectorType(ir.FloatType(), 16)
        v32bf = ir.VectorType(BFloat16Type(), LANES)
        dot = dot_function(builder)
        w_ptrs, n = row_pointers(context, builder, signature.args[0], args[0], w_rows, args[1], v32i16)
        x_ptrs, _ = row_pointers(context, builder, signature.args[2], args[2], x_rows, args[3], v32i16)
        index_type = n.type
        accs = [[accumulators(builder, chains, v16f) for _ in x_ptrs] for _ in w_ptrs]
        vectors = builder.udiv(n, ir.Constant(index_type, LANES))
        rounds = builder.udiv(vectors, ir.Constant(index_type, chains))
        # The weight rows one after the other (one sequential stream through memory: weight
        # rows read side by side defeat the hardware prefetchers), each against every
        # activation row.
        for w_ptr, row_accs in zip(w_ptrs, accs):

            def step(vector, chain):
                a = builder.bitcast(builder.load(builder.gep(w_ptr, [vector]), align=2), v32bf)
                for x_ptr, chained in zip(x_ptrs, row_accs):
                    b = builder.bitcast(builder.load(builder.gep(x_ptr, [vector]), align=2), v32bf)
                    builder.store(builder.call(dot, [builder.load(chained[chain]), a, b]), chained[chain])

            with cgutils.for_range(builder, rounds) as loop:
                first = builder.mul(loop.index, ir.Constant(index_type, chains))
                for c in range(chains):
                    step(builder.add(first, ir.Constant(index_type, c)), c)
            with cgutils.for_range_slice(
                builder, builder.mul(rounds, ir.Constant(index_type, chains)), vectors, ir.Constant(index_type, 1)
            ) as (vector, _):
                step(vector, 0)
        totals = []
        for row in accs:
            for chained in row:
                total = builder.load(chained[0])
                for acc in chained[1:]:
                    total = builder.fadd(total, builder.load(acc))
                totals.append(total)
        out_array = context.make_array(signature.args[4])(context, builder, args[4])
        for k, value in enumerate(sum_lanes(builder, totals)):
            builder.store(value, builder.gep(out_array.data, [ir.Constant(index_type, k)]))
        return context.get_dummy_value()

    return types.none(w, w_rows, xs, x_rows, out), codegen


@numba.njit(fastmath=True, inline="always")
def _tail(w, x, acc):
    """acc plus the widened products past the last whole 32-lane group."""
    for k in range(w.shape[0] // LANES * LANES, w.shape[0]):
        acc += _bfloat16_bits_to_float32(w[k]) * _bfloat16_bits_to_float32(x[k])
    return acc


@numba.njit(fastmath=True, inline="always")
def _dots_bf16(weights, w_rows, xs, x_rows, out):
    """out[i * len(x_rows) + j] = weights[w_rows[i]] . xs[x_rows[j]]: the dot instructions
    over whole 32-lane groups, the widened products past them."""
    _dot_bf16_tile(weights, w_rows, xs, x_rows, out)
    if weights.shape[1] % LANES:
        for i in range(len(w_rows)):
            for j in range(len(x_rows)):
                k = i * len(x_rows) + j
                out[k] = _tail(weights[w_rows[i]], xs[x_rows[j]], out[k])


@numba.njit
def _expert_rows(w, s, e, n, count, scratch):
    """The tiled loop's ``load`` for the dot instructions: expert e's weights (a view)."""
    return w[e]


@numba.njit(fastmath=True)
def _bf16_dots(weights, n, count, xs, x_rows, out):
    """The tiled loop's dots with the dot instructions: weight rows n .. n + count - 1, four or one."""
    if count == _WEIGHT_TILE:
        _dots_bf16(weights, (n, n + 1, n + 2, n + 3), xs, x_rows, out)
    else:
        _dots_bf16(weights, (n,), xs, x_rows, out)


#: The tiled loop around the dot instructions' tile: four weight rows by four activation rows.
_bf16 = tiles.row_kernels(__name__, "bf16_dot", _expert_rows, _bf16_dots, _WEIGHT_TILE, standalone=False)
_gate_up_item_bf16, _down_block_bf16 = _bf16["_gate_up_item"], _bf16["_down_block"]


@numba.njit
def activate_rows_bf16(gate_up, code, acts):
    """`activate_rows`, each intermediate rounded to bfloat16 (uint16 bits [M, I])."""
    inter = acts.shape[1]
    for m in range(acts.shape[0]):
        for n in range(inter):
            acts[m, n] = _round_bfloat16(_gated(gate_up[m, n], gate_up[m, inter + n], code))


@numba.njit
def _round_bfloat16(value):
    """A float32 rounded to the nearest bfloat16 (ties to even; NaN as 0x7FC0), as uint16 bits."""
    if value != value:
        return np.uint16(0x7FC0)
    b = np.uint32(_float32_bits(value))
    return np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@parallel_and_serial(cache=True)
def rows_experts_bf16(x, ids, weights, w_gate_up, w_down, b_gate_up, b_down, code, bound, out, threaded=True):
    """`rows_experts` for bfloat16 (x, weights and out uint16 bits) with the dot instructions
    (`BF16_DOT`; never call it elsewhere): the intermediate is rounded to bfloat16 before the
    down dots."""
    tokens, slot_weights, offsets, hit, work = plan_rows(ids, weights, w_gate_up.shape[0], _blocks(w_gate_up))
    if _beyond(offsets, hit, bound):
        return False
    gate_up = np.empty((tokens.shape[0], w_gate_up.shape[1]), np.float32)
    for item in numba.prange(work.shape[0]):
        _gate_up_item_bf16(x, tokens, offsets, work[item, 0], work[item, 1], w_gate_up, w_gate_up, b_gate_up, gate_up)
    acts = np.empty((tokens.shape[0], w_down.shape[2]), np.uint16)
    activate_rows_bf16(gate_up, code, acts)
    sums = np.zeros((x.shape[0], w_down.shape[1]), np.float32)
    columns = ROW_BLOCK if threaded else max(1, w_down.shape[1])
    for b in numba.prange((w_down.shape[1] + columns - 1) // columns):
        _down_block_bf16(acts, tokens, slot_weights, offsets, hit, w_down, w_down, b_down, sums, b, columns)
    store_sums(sums, out)
    return True


rows_experts_bf16_serial = rows_experts_bf16.serial
