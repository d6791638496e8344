"""Numba CPU kernels of the MXFP4 (w4a16) expert GEMMs on the bfloat16 dot instruction.

On CPUs with AVX512-BF16 (`moeroute.experts.cpu.dot.BF16_DOT`) and bfloat16 activations, every
e2m1 value and every activation is a bfloat16, so ``vdpbf16ps`` forms the exact products
and float32 sums; each block's sum is then multiplied by its scale ``2 ** (s - 127)``, as
the float kernels of `moeroute.experts.cpu.mxfp4` do. Only the summation order differs from
the definition's.

A step takes two blocks (32 packed bytes, 64 values): the bytes widened to 16-bit words, their
low and high nibbles (the blocks' even and odd elements) looked up in a 16-entry table of
e2m1 values as bfloat16 (``vpermw``). The activation rows are first reordered per pair of
blocks A, B as A's 16 even elements, B's 16 even, A's 16 odd, B's 16 odd (`split_pairs`), so
that a dot instruction's lanes 0-7 hold block A's partial sums and lanes 8-15 block B's, and
one multiply-add applies both scales. Tiles, as in the bfloat16 row kernels: four weight rows
per call, read one after the other, against up to four activation rows.

Arrays are NumPy: blocks uint8 [L, R, G, 16] and scales uint8 [L, R, G] (G = cols / 32, even
here), activations uint16 (bfloat16 bits) in `split_pairs` order, sums float32.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from moeroute.experts.cpu import tiles
from moeroute.experts.cpu.dot import (
    BF16_DOT,
    LANES,
    BFloat16Type,
    accumulators,
    dot_function,
    prefetch,
    row_ahead,
    splat,
    sum_lanes,
)
from moeroute.quant.mxfp4 import E2M1_VALUES, MXFP4_BLOCK, SCALE_BIAS

__all__ = ["serves", "split_pairs", "gate_up_rows", "gate_up_rows_serial", "down_rows", "down_rows_serial"]

#: Weight rows per unit of parallel work (gate_up) and output columns per thread block (down).
ROW_BLOCK = tiles.ROW_BLOCK
#: Activation rows per tile, and weight rows per call of `_mxfp4_tile` (tuples of four below);
#: a block of output columns that starts on a multiple of it tiles as the whole range does.
ROW_TILE = tiles.ROW_TILE
#: Values per step: two blocks.
_PAIR = 2 * MXFP4_BLOCK
#: bfloat16 bits of the 16 e2m1 codes (sign included), twice: the 32 words of a table that
#: ``vpermw`` indexes by the low 5 bits of a word, so that a byte widened to a word looks up
#: its low nibble without masking off the high one (bit 4 selects the copy).
_E2M1_BF16 = [int(np.array(v, np.float32).view(np.uint32)) >> 16 for v in E2M1_VALUES] * 2
#: 2 ** (s - 127) for every scale byte (255 is refused at load; NaN here).
_SCALES = [float(2.0 ** (s - SCALE_BIAS)) for s in range(255)] + [float("nan")]


def serves(dtype_is_bfloat16: bool, hidden: int, inter: int) -> bool:
    """Whether these kernels run: `BF16_DOT`, bfloat16 activations, and both GEMMs' input
    widths (H, I) whole pairs of blocks."""
    return BF16_DOT and dtype_is_bfloat16 and hidden % _PAIR == 0 and inter % _PAIR == 0


@numba.njit(cache=True)
def split_pairs(x, out):
    """out[t] = x[t] (uint16 [T, C], C a multiple of 64) with each pair of blocks A, B
    reordered as A's even elements, B's even, A's odd, B's odd (16 each)."""
    half = MXFP4_BLOCK // 2
    for t in range(x.shape[0]):
        row, target = x[t], out[t]
        for base in range(0, x.shape[1], _PAIR):
            for j in range(half):
                target[base + j] = row[base + 2 * j]
                target[base + half + j] = row[base + MXFP4_BLOCK + 2 * j]
                target[base + 2 * half + j] = row[base + 2 * j + 1]
                target[base + 3 * half + j] = row[base + MXFP4_BLOCK + 2 * j + 1]


#: Weight rows ahead of the one being dotted whose 64-byte lines the tile asks for.
PREFETCH_ROWS = 8


def tile_intrinsic(table, tile_scale, scales_ndim, scales_dtype):
    """A Numba intrinsic ``(blocks, w_rows, scales, xs, x_rows, out)``: out[i * len(x_rows) + j]
    = W[w_rows[i]] . xs[x_rows[j]] for 1 to 4 packed weight rows of one expert (``blocks``
    uint8 [R, G, 16], G even; their scales ``scales``, an array of ``scales_ndim`` dimensions
    of ``scales_dtype``) and 1 to 4 activation rows (``xs`` uint16 [*, G * 32], `split_pairs`
    order); all C-contiguous, ``out`` float32 [>= the tile's size].

    ``table``: the 32 bfloat16 words ``vpermw`` looks the 4-bit codes up in (the 16 values
    by code, twice). ``tile_scale(context, builder, scales_type, scales_value, groups)`` emits
    what runs once a call and returns ``row_at(row)``, which returns ``at(g)``: block g's
    scale of weight row ``row`` as a float32 scalar. Where ``at.group_shift`` is set (an
    integer value: log2 of the blocks that share a scale), a scale is applied once to the summed
    dots of a whole pair, or two pairs, instead of per block. ``scales_dtype``: a Numba type or
    a tuple of those accepted. MXFP4 and symmetric INT4 (`moeroute.experts.cpu.int4`) share it
    with their own tables and scale rules.
    """
    scales_dtypes = scales_dtype if isinstance(scales_dtype, tuple) else (scales_dtype,)

    @intrinsic
    def tile(typingctx, blocks, w_rows, scales, xs, x_rows, out):
        tuples_ok = all(
            isinstance(t, types.UniTuple) and 1 <= t.count <= ROW_TILE and isinstance(t.dtype, types.Integer)
            for t in (w_rows, x_rows)
        )
        arrays_ok = (
            isinstance(blocks, types.Array)
            and blocks.ndim == 3
            and blocks.dtype == types.uint8
            and blocks.layout == "C"
            and isinstance(scales, types.Array)
            and scales.ndim == scales_ndim
            and scales.dtype in scales_dtypes
            and scales.layout == "C"
            and isinstance(xs, types.Array)
            and xs.ndim == 2
            and xs.dtype == types.uint16
            and xs.layout == "C"
            and isinstance(out, types.Array)
            and out.ndim == 1
            and out.dtype == types.float32
        )
        if not (tuples_ok and arrays_ok):
            return None
        count = x_rows.count

        def codegen(context, builder, signature, args):
            i8, i16, i32, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
            v32i8, v32i16, v16f = ir.VectorType(i8, LANES), ir.VectorType(i16, LANES), ir.VectorType(f32, 16)
            v32bf = ir.VectorType(BFloat16Type(), LANES)
            dot = dot_function(builder)
            fma = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(v16f, [v16f, v16f, v16f]), "llvm.fma.v16f32"
            )
            permute = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(v32i16, [v32i16, v32i16]), "llvm.x86.avx512.permvar.hi.512"
            )
            block_view = context.make_array(signature.args[0])(context, builder, args[0])
            x_view = context.make_array(signature.args[3])(context, builder, args[3])
            groups = builder.extract_value(block_view.shape, 1)
            index_type = groups.type
            pairs = builder.udiv(groups, ir.Constant(index_type, 2))
            width = builder.extract_value(x_view.shape, 1)
            # The table in a register (an empty inline-asm statement keeps LLVM from folding it
            # into the loop as a memory operand).
            words = builder.asm(
                ir.FunctionType(v32i16, [v32i16]), "", "=v,0", [ir.Constant(v32i16, list(table))], side_effect=False
            )
            row_at = tile_scale(context, builder, signature.args[2], args[2], groups)
            four = ir.Constant(v32i16, [4] * LANES)
            zero = ir.Constant(v16f, [0.0] * 16)
            one, two, zero_index = (ir.Constant(index_type, k) for k in (1, 2, 0))
            x_ptrs = []
            for row in cgutils.unpack_tuple(builder, args[4], count):
                start = builder.mul(context.cast(builder, row, x_rows.dtype, types.intp), width)
                x_ptrs.append(builder.bitcast(builder.gep(x_view.data, [start]), v32i16.as_pointer()))
            totals = []
            for row in cgutils.unpack_tuple(builder, args[1], w_rows.count):
                row = context.cast(builder, row, w_rows.dtype, types.intp)
                w_ptr = builder.bitcast(
                    builder.gep(
                        block_view.data,
                        [builder.mul(row, builder.mul(groups, ir.Constant(index_type, MXFP4_BLOCK // 2)))],
                    ),
                    v32i8.as_pointer(),
                )
                at = row_at(row)
                # the same line of the row PREFETCH_ROWS further on
                a_ptr = row_ahead(
                    builder,
                    block_view.data,
                    row,
                    PREFETCH_ROWS,
                    builder.extract_value(block_view.shape, 0),
                    builder.mul(groups, ir.Constant(index_type, MXFP4_BLOCK // 2)),
                    v32i8,
                )

                def prefetch_pair(p):
                    prefetch(builder, builder.gep(a_ptr, [p]))

                # Two totals per activation row, for even and odd pairs: two chains of fused
                # multiply-adds in flight instead of one (one chain bound a single row's dots by
                # the instruction's latency).
                row_totals = [accumulators(builder, 2, v16f) for _ in range(count)]

                def decoded(p):
                    codes = builder.zext(builder.load(builder.gep(w_ptr, [p]), align=1), v32i16)
                    even = builder.bitcast(builder.call(permute, [words, codes]), v32bf)
                    odd = builder.bitcast(builder.call(permute, [words, builder.lshr(codes, four)]), v32bf)
                    return even, odd

                def dots(first, n, parity, scale):
                    """Pairs first .. first + n - 1 (n = 1 or 2) under one scale vector: their dots
                    summed in one chain, then one multiply-add into the totals."""
                    pairs_codes = [
                        (
                            builder.add(first, ir.Constant(index_type, k)),
                            decoded(builder.add(first, ir.Constant(index_type, k))),
                        )
                        for k in range(n)
                    ]
                    for x_ptr, totals_j in zip(x_ptrs, row_totals):
                        acc = zero
                        for p, (even, odd) in pairs_codes:
                            g = builder.mul(p, two)
                            x_even = builder.bitcast(builder.load(builder.gep(x_ptr, [g]), align=2), v32bf)
                            x_odd = builder.bitcast(
                                builder.load(builder.gep(x_ptr, [builder.add(g, one)]), align=2), v32bf
                            )
                            acc = builder.call(dot, [acc, even, x_even])
                            acc = builder.call(dot, [acc, odd, x_odd])
                        total = totals_j[parity]
                        builder.store(builder.call(fma, [acc, scale, builder.load(total)]), total)

                def block_scales(p):
                    """Lanes 0-7 block 2p's scale, lanes 8-15 block 2p + 1's."""
                    g = builder.mul(p, two)
                    halves = [splat(builder, at(builder.add(g, ir.Constant(index_type, k))), 16) for k in range(2)]
                    return builder.shuffle_vector(
                        halves[0], halves[1], ir.Constant(ir.VectorType(i32, 16), list(range(8)) + list(range(24, 32)))
                    )

                def pair_loop(scale_of):
                    """Pair by pair, even and odd pairs into their own totals."""
                    with cgutils.for_range(builder, builder.udiv(pairs, two)) as loop:
                        first = builder.mul(loop.index, two)
                        prefetch_pair(first)
                        dots(first, 1, 0, scale_of(first))
                        second = builder.add(first, one)
                        dots(second, 1, 1, scale_of(second))
                    with cgutils.if_unlikely(
                        builder, builder.icmp_unsigned("!=", builder.urem(pairs, two), zero_index)
                    ):
                        last = builder.sub(pairs, one)
                        dots(last, 1, 0, scale_of(last))

                def shared_scale(p):
                    return splat(builder, at(builder.mul(p, two)), 16)

                shift = getattr(at, "group_shift", None)
                if shift is None:
                    pair_loop(block_scales)
                else:
                    # groups of 4+ blocks (two pairs or more a scale, whole pairs of pairs):
                    # two pairs' dots in one chain, one multiply by their scale
                    quads = builder.icmp_unsigned(">=", shift, ir.Constant(shift.type, 2))
                    with builder.if_else(quads) as (whole_group, smaller):
                        with whole_group:
                            with cgutils.for_range(builder, builder.udiv(pairs, two)) as loop:
                                first = builder.mul(loop.index, two)
                                prefetch_pair(first)
                                dots(first, 2, 0, shared_scale(first))
                        with smaller:
                            # a pair shares its scale from 2 blocks a group on
                            pairs_shared = builder.icmp_unsigned("==", shift, ir.Constant(shift.type, 1))
                            with builder.if_else(pairs_shared) as (shared, per_block):
                                with shared:
                                    pair_loop(shared_scale)
                                with per_block:
                                    pair_loop(block_scales)
                totals.extend(
                    builder.fadd(builder.load(even_total), builder.load(odd_total))
                    for even_total, odd_total in row_totals
                )
            out_view = context.make_array(signature.args[5])(context, builder, args[5])
            for k, value in enumerate(sum_lanes(builder, totals)):
                builder.store(value, builder.gep(out_view.data, [ir.Constant(index_type, k)]))
            return context.get_dummy_value()

        return types.none(blocks, w_rows, scales, xs, x_rows, out), codegen

    return tile


def _mxfp4_tile_scale(context, builder, scales_type, scales_value, groups):
    """MXFP4's scales in a tile: 2 ** (s - 127) of byte g of the row's scales [R, G] (a
    float32 table in memory)."""
    i32, f32 = ir.IntType(32), ir.FloatType()
    scale_view = context.make_array(scales_type)(context, builder, scales_value)
    scale_table = cgutils.global_constant(builder, "mxfp4_dot_scales", ir.Constant(ir.ArrayType(f32, 256), _SCALES))

    def row_at(row):
        s_ptr = builder.gep(scale_view.data, [builder.mul(row, groups)])

        def at(g):
            byte = builder.zext(builder.load(builder.gep(s_ptr, [g])), i32)
            return builder.load(builder.gep(scale_table, [ir.Constant(i32, 0), byte]))

        return at

    return row_at


_mxfp4_tile = tile_intrinsic(_E2M1_BF16, _mxfp4_tile_scale, 2, types.uint8)


@numba.njit(fastmath=True)
def _tile_dots(operand, n, count, xs, x_rows, out):
    """The tiled loop's dots (`moeroute.experts.cpu.tiles`): weight rows n .. n + count - 1 of
    the expert's (blocks, scales), four or one."""
    blocks, scales = operand
    if count == ROW_TILE:
        _mxfp4_tile(blocks, (n, n + 1, n + 2, n + 3), scales, xs, x_rows, out)
    else:
        _mxfp4_tile(blocks, (n,), scales, xs, x_rows, out)


#: The tiled loop around the tile (`moeroute.experts.cpu.tiles`).
tile_family = tiles.row_kernels(__name__, "mxfp4_dot", tiles.expert_weights, _tile_dots, ROW_TILE)
gate_up_rows, gate_up_rows_serial, down_rows, down_rows_serial = (tile_family[name] for name in tiles.KERNELS)
