"""Numba CPU kernels of the INT4 (w4a16) expert GEMMs with no table lookup, on the bfloat16 dot
instruction or on float32 FMAs: symmetric and asymmetric weights.

On CPUs with AVX512-BF16 (`moeroute.experts.cpu.dot.BF16_DOT`) and bfloat16 activations, a
4-bit code q placed in the top four mantissa bits of the bfloat16 16.0 (bits ``0x4180 | q << 3``)
is the bfloat16 16 + q, exactly. With w = (q - z) * s,

    x . w = s * (x . (16 + q) - (16 + z) * sum(x))

over a group, so a block decodes with shifts and masks only (no shuffle): one 64-byte load
holds four blocks (a 128-bit lane each), and word shifts by 4k place nibble k of every
16-bit word (the block's element 4w + k, w the word) at the mantissa bits. The activations
are reordered once per call to match (`split_quads`: per chunk of four blocks, four vectors
of 32 words whose lane L, word w is block L's element 4w + k), and each chunk carries, per
activation row, the 16 float32 sums of x that the lanes of ``vdpbf16ps`` cover (eight
consecutive elements each, summed in float64 and rounded once). A chunk's dot of a weight
row then starts from -(16 + z) times those sums (z per lane: each 128-bit lane is one block,
so one group), adds the four ``vdpbf16ps`` of its 16 + q words with the activations (exact
products, float32 sums), and one multiply-add applies the scales (per lane, its block's
group's).

Numerics: each weight's value is the definition's (q - z) * s and each product exact; the sum
differs from the plain order's by the float32 roundings of a chunk lane's partial sums (its
start -(16 + z) * sum(x), then eight products with 16 + q), bounded by ((16 + z) + 31) *
sum |x| <= 62 * sum |x| over the lane's eight activations instead of 15 * sum |x|: within
2^-24 * 9 * 62 * s * sum |x| a chunk (about 3.3e-5 * s * sum |x|, the bound
tests/quant/test_int4_dot.py asserts), a float32 sum's bound with a larger constant, far
below the bfloat16 output's rounding (2^-8 relative) in practice. The sums of x are float64
sums rounded once (times 24 for symmetric weights: the start is then a load).

On the other vector paths (AVX2, and AVX-512 without its bfloat16 dot: `FMA_TILE`) the same
tile runs on 256-bit vectors: each half of a chunk (blocks 2h, 2h + 1) is 16 words decoded to
16 + q by the same shifts and masks, and its even and odd words widen exactly to two float32
vectors (a shift by 16, a mask of the high half): lane d then holds words 2d and 2d + 1, block
2h + d // 4's elements 8(d % 4) + 4p + k over nibbles k and p = 0, 1, the eight activations of
`split_quads`' sum 8h + d. The activations are widened once per call to float32 in that order
(`split_quads_float`), each product is one FMA (exact product, one rounding), and a lane's
chain is the 512-bit tile's: the same start, eight products, the same bound. No byte shuffle
runs, whose lookups and widenings bound the table kernels of `moeroute.experts.cpu.int4`.

Loop order: with 2 to 4 activation rows, every weight row of a tile takes each chunk in turn
(four weight streams in flight, the chunk's activations loaded once for them; the totals of
every pair of rows fit the 32 vector registers). With one activation row there is nothing to
share, and a weight row at a time (one sequential stream) reads faster. The FMA tile has 16
registers: a weight row at a time from three activation rows on as well.

Arrays: blocks uint8 [R, G, 16] (G a multiple of 4: `serves`), params [R, P, G'] as
`moeroute.experts.cpu.int4` (float32, or 16-bit scales as bits when symmetric), activations
the uint16 words of `split_quads` [*, G / 4 * 160] (the FMA tile: the float32 values of
`split_quads_float` [*, G / 4 * 144]).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from moeroute import cpu_features
from moeroute.experts.cpu import tiles
from moeroute.experts.cpu.dot import BF16_DOT, LANES, BFloat16Type, dot_function, prefetch, row_ahead, sum_lanes
from moeroute.quant.int4 import SYMMETRIC_ZERO

__all__ = [
    "CHUNK",
    "CHUNK_WORDS",
    "CHUNK_FLOATS",
    "FMA_TILE",
    "FMA_MAX_MEAN_ROWS",
    "serves",
    "split_quads",
    "split_quads_float",
    "split",
    "split_empty",
    "sums_bias",
    "tile_family",
]

#: Columns per chunk: four blocks of 32, one 64-byte load of packed codes.
CHUNK = 128
#: uint16 words per chunk of `split_quads` activations: 128 bfloat16 values and 16 float32 sums.
CHUNK_WORDS = CHUNK + 32
#: float32 values per chunk of `split_quads_float` activations: 128 activations and 16 sums.
CHUNK_FLOATS = CHUNK + 16
#: The bfloat16 16.0: its top four mantissa bits take q (16 + q, exactly).
_BIAS_WORD = 0x4180
_BIAS = 16.0
#: The mantissa bits q occupies (bits 3..6).
_CODE_MASK = 0x0078
ROW_TILE = tiles.ROW_TILE
#: Weight rows ahead of the one being dotted whose lines the tile asks for (`llvm.prefetch`):
#: the tile after next's (one tile ahead leaves too little time for the lines to arrive).
_PREFETCH_ROWS = 8
#: Whether the tiles multiply with float32 FMAs on 256-bit vectors (AVX2, and AVX-512 without
#: its bfloat16 dot) rather than with the bfloat16 dot instruction: decided once, with the path.
FMA_TILE = cpu_features.AVX2_SIMD and not BF16_DOT
#: Mean rows per hit expert below which the FMA tiles run; from it on the decode-once row
#: kernels (`moeroute.experts.cpu.mxfp4_rows`), whose float32 rows cost no decode per tile.
FMA_MAX_MEAN_ROWS = 12


def serves(dtype_is_bfloat16: bool, hidden: int, inter: int, mean_rows: float = 1.0) -> bool:
    """Whether these kernels run: `BF16_DOT`, or `FMA_TILE` below `FMA_MAX_MEAN_ROWS` mean rows
    per hit expert (``mean_rows``); bfloat16 activations; both GEMMs' input widths (H, I) whole
    chunks of 128 columns."""
    path = BF16_DOT or (FMA_TILE and mean_rows < FMA_MAX_MEAN_ROWS)
    return path and dtype_is_bfloat16 and hidden % CHUNK == 0 and inter % CHUNK == 0


@numba.njit(inline="always")
def sums_bias(asymmetric):
    """`split_quads`' ``bias``: 16 + 8 for symmetric weights, 1 for asymmetric ones."""
    return 1.0 if asymmetric else _BIAS + SYMMETRIC_ZERO


@numba.njit(inline="always")
def _widen(row, wide):
    """wide[k] = the float32 bits of bfloat16 row[k] (exact)."""
    for k in range(row.shape[0]):
        wide[k] = np.uint32(row[k]) << np.uint32(16)


@numba.njit(inline="always")
def _chunk_sums(values, base, bias, sums, at):
    """sums[at + i] = -bias * the sum of values[base + 8i .. base + 8i + 8], i < 16: float64
    sums rounded once."""
    for i in range(16):
        total = 0.0
        for j in range(8):
            total += np.float64(values[base + 8 * i + j])
        sums[at + i] = np.float32(-bias * total)


@numba.njit(cache=True)
def split_quads(x, bias, out):
    """out[t] = x[t] (bfloat16 bits uint16 [T, C], C a multiple of 128) in the tile's order: per
    chunk c of 128 columns, word 32k + 8L + w = x[128c + 32L + 4w + k] (k, L < 4, w < 8), then
    16 float32 (as 32 words, little-endian) sums: sum i is -bias * the sum of x[128c + 8i ..
    128c + 8i + 8], in float64 rounded once. ``out`` uint16 [T, C / 128 * 160]. ``bias``: 16 +
    8 for symmetric weights (the sums are then where a chunk's dots start), 1 for asymmetric
    ones (the tile multiplies by 16 + z)."""
    sums = out.view(np.float32)
    wide = np.empty(x.shape[1], np.uint32)
    values = wide.view(np.float32)
    for t in range(x.shape[0]):
        row, target = x[t], out[t]
        _widen(row, wide)
        for c in range(x.shape[1] // CHUNK):
            base, start = c * CHUNK, c * CHUNK_WORDS
            for k in range(4):
                for lane in range(4):
                    for w in range(8):
                        target[start + 32 * k + 8 * lane + w] = row[base + 32 * lane + 4 * w + k]
            _chunk_sums(values, base, bias, sums[t], start // 2 + CHUNK // 2)


@numba.njit(cache=True)
def split_quads_float(x, bias, out):
    """out[t] = x[t] (bfloat16 bits uint16 [T, C], C a multiple of 128) as float32 in the FMA
    tile's order: per chunk c of 128 columns, value 64h + 16k + 8p + d = x[128c + 32(2h + d //
    4) + 8(d % 4) + 4p + k] (h, p < 2, k < 4, d < 8: half h, nibble k, the even or odd words'
    vector p, its lane d), then the 16 sums of `split_quads` (lane d of half h sums the eight
    activations of sum 8h + d). ``out`` float32 [T, C / 128 * 144]."""
    wide = np.empty(x.shape[1], np.uint32)
    values = wide.view(np.float32)
    for t in range(x.shape[0]):
        row, target = x[t], out[t]
        _widen(row, wide)
        for c in range(x.shape[1] // CHUNK):
            base, start = c * CHUNK, c * CHUNK_FLOATS
            for h in range(2):
                for k in range(4):
                    for p in range(2):
                        for d in range(8):
                            column = base + 32 * (2 * h + d // 4) + 8 * (d % 4) + 4 * p + k
                            target[start + 64 * h + 16 * k + 8 * p + d] = values[column]
            _chunk_sums(values, base, bias, target, start + CHUNK)


@numba.njit
def _split_empty_words(rows, columns):
    return np.empty((rows, columns // CHUNK * CHUNK_WORDS), np.uint16)


@numba.njit
def _split_empty_floats(rows, columns):
    return np.empty((rows, columns // CHUNK * CHUNK_FLOATS), np.float32)


#: The activations' order of the tile this path runs, ``split(x, bias, out)``, and an empty
#: array of it, ``split_empty(rows, columns)``.
split = split_quads_float if FMA_TILE else split_quads
split_empty = _split_empty_floats if FMA_TILE else _split_empty_words


def _load_scales(builder, dtype, pointer, n):
    """<n x float> of the n scales at ``pointer``: float32 as they are; bfloat16 bits (uint16) to
    a float32's high half; float16 bits (int16) widened (both exact)."""
    f32 = ir.FloatType()
    if dtype == types.float32:
        return builder.load(builder.bitcast(pointer, ir.VectorType(f32, n).as_pointer()), align=4)
    i16, i32 = ir.IntType(16), ir.IntType(32)
    value = builder.load(builder.bitcast(pointer, ir.VectorType(i16, n).as_pointer()), align=2)
    if dtype == types.uint16:
        bits = builder.shl(builder.zext(value, ir.VectorType(i32, n)), ir.Constant(ir.VectorType(i32, n), [16] * n))
        return builder.bitcast(bits, ir.VectorType(f32, n))
    return builder.fpext(builder.bitcast(value, ir.VectorType(ir.HalfType(), n)), ir.VectorType(f32, n))


def _spread(builder, values, shift, lanes=16, first_block=0):
    """<lanes x float>: lane i takes values[(first_block + i // 4) >> shift] (a chunk's 128-bit
    lane L is block L, of group L >> shift within the chunk; a 256-bit half h starts at block
    2h)."""
    i32 = ir.IntType(32)
    n = values.type.count
    picks = [min(n - 1, (first_block + i // 4) >> shift) for i in range(lanes)]
    return builder.shuffle_vector(values, values, ir.Constant(ir.VectorType(i32, lanes), picks))


def _code_words(builder, raw, k):
    """Nibble k of every 16-bit word of ``raw`` (a vector of i16) moved to the mantissa's bits
    3..6 and ORed into the bfloat16 16.0: the words 16 + q."""
    words = raw.type
    lanes = words.count
    amount = 3 - 4 * k
    if amount > 0:
        moved = builder.shl(raw, ir.Constant(words, [amount] * lanes))
    else:
        moved = builder.lshr(raw, ir.Constant(words, [-amount] * lanes))
    masked = builder.and_(moved, ir.Constant(words, [_CODE_MASK] * lanes))
    return builder.or_(masked, ir.Constant(words, [_BIAS_WORD] * lanes))


def _words_as_floats(builder, words):
    """(even, odd) <8 x float> of <16 x i16> bfloat16 words: word 2d and word 2d + 1 widened,
    exactly (the low word shifted to the high half; the high word with the low one cleared)."""
    i32 = ir.IntType(32)
    v8i32, v8f = ir.VectorType(i32, 8), ir.VectorType(ir.FloatType(), 8)
    pairs = builder.bitcast(words, v8i32)
    even = builder.shl(pairs, ir.Constant(v8i32, [16] * 8))
    odd = builder.and_(pairs, ir.Constant(v8i32, [-65536] * 8))
    return builder.bitcast(even, v8f), builder.bitcast(odd, v8f)


def _quad_tile(fma: bool):
    """The tile as a Numba intrinsic: the bfloat16 dot instruction on 512-bit vectors, or
    (``fma``) float32 FMAs on 256-bit ones (`FMA_TILE`)."""

    @intrinsic
    def quad_tile(typingctx, blocks, w_rows, params, xs, x_rows, out):
        return _quad_tile_codegen(fma, blocks, w_rows, params, xs, x_rows, out)

    return quad_tile


def _quad_tile_codegen(fma_path, blocks, w_rows, params, xs, x_rows, out):
    """out[i * len(x_rows) + j] = W[w_rows[i]] . xs[x_rows[j]] for 1 to 4 packed INT4 weight rows
    of one expert (blocks uint8 [R, G, 16], G a multiple of 4; params [R, P, G'], P = 1
    symmetric, P = 2 with the zero points, float32 or, symmetric, 16-bit scale bits) and 1 to 4
    `split_quads` activation rows; all C-contiguous, ``out`` float32 [>= the tile's size]."""
    tuples_ok = all(
        isinstance(t, types.UniTuple) and 1 <= t.count <= ROW_TILE and isinstance(t.dtype, types.Integer)
        for t in (w_rows, x_rows)
    )
    arrays_ok = (
        isinstance(blocks, types.Array)
        and blocks.ndim == 3
        and blocks.dtype == types.uint8
        and blocks.layout == "C"
        and isinstance(params, types.Array)
        and params.ndim == 3
        and params.dtype in (types.float32, types.uint16, types.int16)
        and params.layout == "C"
        and isinstance(xs, types.Array)
        and xs.ndim == 2
        and xs.dtype == (types.float32 if fma_path else types.uint16)
        and xs.layout == "C"
        and isinstance(out, types.Array)
        and out.ndim == 1
        and out.dtype == types.float32
    )
    if not (tuples_ok and arrays_ok):
        return None
    count = x_rows.count
    dtype = params.dtype

    def codegen(context, builder, signature, args):
        i8, i16, f32 = ir.IntType(8), ir.IntType(16), ir.FloatType()
        v64i8, v32i16, v16f = ir.VectorType(i8, 64), ir.VectorType(i16, LANES), ir.VectorType(f32, 16)
        v32bf = ir.VectorType(BFloat16Type(), LANES)
        dot = None if fma_path else dot_function(builder)
        fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(v16f, [v16f, v16f, v16f]), "llvm.fma.v16f32"
        )
        block_view = context.make_array(signature.args[0])(context, builder, args[0])
        param_view = context.make_array(signature.args[2])(context, builder, args[2])
        x_view = context.make_array(signature.args[3])(context, builder, args[3])
        groups = builder.extract_value(block_view.shape, 1)
        index_type = groups.type
        chunks = builder.udiv(groups, ir.Constant(index_type, 4))
        _, parts, width = cgutils.unpack_tuple(builder, param_view.shape, 3)
        # blocks per group as a shift (1, 2, 4 blocks: 0, 1, 2); a row of no columns divides by one
        empty = builder.icmp_unsigned("==", width, ir.Constant(index_type, 0))
        per = builder.udiv(groups, builder.select(empty, ir.Constant(index_type, 1), width))
        cttz = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(index_type, [index_type, ir.IntType(1)]), f"llvm.cttz.i{index_type.width}"
        )
        shift = builder.call(cttz, [per, ir.Constant(ir.IntType(1), 0)])
        zeros = builder.icmp_unsigned("==", parts, ir.Constant(index_type, 2))
        x_width = builder.extract_value(x_view.shape, 1)
        x_ptrs = []
        for row in cgutils.unpack_tuple(builder, args[4], count):
            start = builder.mul(context.cast(builder, row, x_rows.dtype, types.intp), x_width)
            x_ptrs.append(builder.gep(x_view.data, [start]))
        zero = ir.Constant(v16f, [0.0] * 16)
        start = ir.Constant(ir.VectorType(f32, 8), [0.0] * 8) if fma_path else zero
        fma8 = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VectorType(f32, 8), [ir.VectorType(f32, 8)] * 3), "llvm.fma.v8f32"
        )

        def nibble(raw, k):
            """`_code_words` of a 512-bit load, as bfloat16 lanes."""
            return builder.bitcast(_code_words(builder, raw, k), v32bf)

        rows = []
        row_bytes = builder.mul(groups, ir.Constant(index_type, 16))
        weight_rows = builder.extract_value(block_view.shape, 0)
        for row in cgutils.unpack_tuple(builder, args[1], w_rows.count):
            row = context.cast(builder, row, w_rows.dtype, types.intp)
            w_ptr = builder.bitcast(builder.gep(block_view.data, [builder.mul(row, row_bytes)]), v64i8.as_pointer())
            a_ptr = row_ahead(builder, block_view.data, row, _PREFETCH_ROWS, weight_rows, row_bytes, v64i8)
            p_ptr = builder.gep(param_view.data, [builder.mul(row, builder.mul(parts, width))])
            rows.append((w_ptr, p_ptr, a_ptr, [cgutils.alloca_once_value(builder, start) for _ in range(count)]))

        def chunk_loop(group_shift, asymmetric, rows):
            """Chunk by chunk, each chunk against every weight row of the tile (the chunk's
            activations stay in the first-level cache across the weight rows), for groups of
            2 ** group_shift blocks (2: 4 or more blocks, one scale a chunk)."""
            n = 4 >> min(group_shift, 2)
            with cgutils.for_range(builder, chunks) as loop:
                c = loop.index
                first = builder.lshr(builder.shl(c, ir.Constant(index_type, 2)), shift)
                offset = builder.mul(c, ir.Constant(index_type, CHUNK_WORDS))
                for w_ptr, p_ptr, a_ptr, row_totals in rows:
                    prefetch(builder, builder.gep(a_ptr, [c]))  # the same line of a row further on
                    scales = _spread(builder, _load_scales(builder, dtype, builder.gep(p_ptr, [first]), n), group_shift)
                    if asymmetric:
                        z = _load_scales(builder, dtype, builder.gep(p_ptr, [builder.add(width, first)]), n)
                        start = _spread(builder, builder.fadd(_constant(n, _BIAS), z), group_shift)
                    raw = builder.bitcast(builder.load(builder.gep(w_ptr, [c]), align=1), v32i16)
                    decoded = [nibble(raw, k) for k in range(4)]
                    for x_ptr, total in zip(x_ptrs, row_totals):
                        base = builder.gep(x_ptr, [offset])
                        sums = builder.load(
                            builder.bitcast(builder.gep(base, [ir.Constant(index_type, CHUNK)]), v16f.as_pointer()),
                            align=4,
                        )
                        # symmetric: the sums are -(16 + 8) sum(x) already; else -sum(x), times 16 + z
                        acc = builder.fmul(sums, start) if asymmetric else sums
                        for k in range(4):
                            x_k = builder.load(
                                builder.bitcast(
                                    builder.gep(base, [ir.Constant(index_type, 32 * k)]), v32bf.as_pointer()
                                ),
                                align=2,
                            )
                            acc = builder.call(dot, [acc, decoded[k], x_k])
                        builder.store(builder.call(fma, [acc, scales, builder.load(total)]), total)

        v16i16, v8f = ir.VectorType(i16, 16), ir.VectorType(f32, 8)

        def chunk_loop_fma(group_shift, asymmetric, rows):
            """`chunk_loop` on 256-bit vectors: each half of a chunk (blocks 2h, 2h + 1) as 16
            words, whose even and odd words widen to two float32 vectors (the weights' 16 + q
            and the activations alike) that one FMA each multiplies; lane d of half h sums the
            eight activations of `split_quads`' sum 8h + d, as a lane of the 512-bit tile does."""
            n = 4 >> min(group_shift, 2)
            with cgutils.for_range(builder, chunks) as loop:
                c = loop.index
                first = builder.lshr(builder.shl(c, ir.Constant(index_type, 2)), shift)
                offset = builder.mul(c, ir.Constant(index_type, CHUNK_FLOATS))
                weights = []
                for w_ptr, p_ptr, a_ptr, row_totals in rows:
                    prefetch(builder, builder.gep(a_ptr, [c]))  # the same line of a row further on
                    values = _load_scales(builder, dtype, builder.gep(p_ptr, [first]), n)
                    scales = [_spread(builder, values, group_shift, 8, 2 * h) for h in range(2)]
                    starts = None
                    if asymmetric:
                        z = _load_scales(builder, dtype, builder.gep(p_ptr, [builder.add(width, first)]), n)
                        z = builder.fadd(_constant(n, _BIAS), z)
                        starts = [_spread(builder, z, group_shift, 8, 2 * h) for h in range(2)]
                    halves = builder.bitcast(builder.gep(w_ptr, [c]), v16i16.as_pointer())
                    weights.append((halves, scales, starts, row_totals))
                bases = [builder.bitcast(builder.gep(x_ptr, [offset]), v8f.as_pointer()) for x_ptr in x_ptrs]

                def x_vector(base, index):
                    return builder.load(builder.gep(base, [ir.Constant(index_type, index)]), align=4)

                for h in range(2):
                    accs = {}
                    for j, base in enumerate(bases):
                        sums = x_vector(base, CHUNK // 8 + h)
                        for r, (_, _, starts, _) in enumerate(weights):
                            # symmetric: the sums are -(16 + 8) sum(x) already; else -sum(x), times 16 + z
                            accs[r, j] = builder.fmul(sums, starts[h]) if asymmetric else sums
                    for k in range(4):
                        for r, (halves, _, _, _) in enumerate(weights):
                            raw = builder.load(builder.gep(halves, [ir.Constant(index_type, h)]), align=1)
                            w_even, w_odd = _words_as_floats(builder, _code_words(builder, raw, k))
                            for j, base in enumerate(bases):
                                x_even, x_odd = (x_vector(base, 8 * h + 2 * k + p) for p in range(2))
                                acc = builder.call(fma8, [w_even, x_even, accs[r, j]])
                                accs[r, j] = builder.call(fma8, [w_odd, x_odd, acc])
                    for r, (_, scales, _, row_totals) in enumerate(weights):
                        for j, total in enumerate(row_totals):
                            builder.store(builder.call(fma8, [accs[r, j], scales[h], builder.load(total)]), total)

        loop = chunk_loop_fma if fma_path else chunk_loop

        def by_shift(asymmetric, rows):
            quads = builder.icmp_unsigned(">=", shift, ir.Constant(index_type, 2))
            with builder.if_else(quads) as (whole, smaller):
                with whole:
                    loop(2, asymmetric, rows)
                with smaller:
                    pairs = builder.icmp_unsigned("==", shift, ir.Constant(index_type, 1))
                    with builder.if_else(pairs) as (two, one):
                        with two:
                            loop(1, asymmetric, rows)
                        with one:
                            loop(0, asymmetric, rows)

        def run(part):
            if dtype == types.float32:
                with builder.if_else(zeros) as (asym, sym):
                    with asym:
                        by_shift(True, part)
                    with sym:
                        by_shift(False, part)
            else:  # 16-bit scales come without zero points (symmetric only)
                by_shift(False, part)

        if count == 1 or (fma_path and count > 2):
            # a weight row at a time. One activation row: nothing to share among weight rows,
            # and one sequential stream (its prefetches a row further on in the same stream)
            # reads faster than four side by side, most with groups of 32 (their scales a
            # second stream per row). FMA tile from three activation rows: 16 vector registers
            # hold one row's totals and the chunk's activations; past the first-level cache
            # those stream from the second, still faster than sharing each chunk's activations
            # among weight rows whose totals would not fit.
            for row in rows:
                run([row])
        else:
            # every weight row of the tile per chunk: four weight streams in flight (with their
            # prefetches), the chunk's activations loaded once for them; the 32 registers hold
            # the totals of every pair
            run(rows)
        totals = [builder.load(total) for *_, row_totals in rows for total in row_totals]
        out_view = context.make_array(signature.args[5])(context, builder, args[5])
        for k, value in enumerate(sum_lanes(builder, totals)):
            builder.store(value, builder.gep(out_view.data, [ir.Constant(index_type, k)]))
        return context.get_dummy_value()

    return types.none(blocks, w_rows, params, xs, x_rows, out), codegen


def _constant(n, value):
    """<n x float> of ``value``."""
    return ir.Constant(ir.VectorType(ir.FloatType(), n), [value] * n)


#: The tile on the bfloat16 dot instruction (AVX512-BF16), and on float32 FMAs (AVX2).
_int4_quad_tile = _quad_tile(fma=False)
_int4_quad_tile_fma = _quad_tile(fma=True)
#: The one this path runs.
_tile = _int4_quad_tile_fma if FMA_TILE else _int4_quad_tile


@numba.njit(fastmath=True)
def _tile_dots(operand, n, count, xs, x_rows, out):
    """The tiled loop's dots: weight rows n .. n + count - 1 of the expert's (blocks, params)."""
    blocks, params = operand
    if count == ROW_TILE:
        _tile(blocks, (n, n + 1, n + 2, n + 3), params, xs, x_rows, out)
    else:
        _tile(blocks, (n,), params, xs, x_rows, out)


#: The tiled loop around the tile (`moeroute.experts.cpu.tiles`), for the one-call forward.
tile_family = tiles.row_kernels(__name__, "int4_quad", tiles.expert_weights, _tile_dots, ROW_TILE, standalone=False)
