"""The bfloat16 dot-product instruction (AVX512-BF16) for Numba kernels: the LLVM pieces the
row kernels share (`moeroute.experts.cpu.rows` on bfloat16 weights, `moeroute.experts.cpu.fp8`
on e4m3 weights decoded to bfloat16).

``vdpbf16ps`` adds the two products of each pair of bfloat16 lanes into a float32 lane: one
instruction per 32 values and row, exact products, float32 sums. It flushes subnormal inputs
and sums to zero.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types

from moeroute import cpu_features

__all__ = [
    "BF16_DOT",
    "LANES",
    "BFloat16Type",
    "dot_function",
    "sum_lanes",
    "row_pointers",
    "accumulators",
    "splat",
    "row_ahead",
    "prefetch",
    "store_tile",
    "add_tile",
]

#: bfloat16 values per vdpbf16ps operand.
LANES = 32


#: Whether the kernels built on the bfloat16 dot-product instruction run: the "avx512bf16"
#: path of `moeroute.cpu_features`.
BF16_DOT = cpu_features.BF16_DOT


class BFloat16Type(ir.types.Type):
    """LLVM's ``bfloat`` (llvmlite's IR builder has no name for it)."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, BFloat16Type)

    def __hash__(self):
        return hash(BFloat16Type)


def dot_function(builder):
    """``llvm.x86.avx512bf16.dpbf16ps.512``: (<16 x float> acc, <32 x bfloat> a, <32 x bfloat> b)
    -> acc plus the pairwise products."""
    v16f = ir.VectorType(ir.FloatType(), 16)
    v32bf = ir.VectorType(BFloat16Type(), LANES)
    return cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(v16f, [v16f, v32bf, v32bf]), "llvm.x86.avx512bf16.dpbf16ps.512"
    )


def sum_lanes(builder, vectors):
    """The lane sums of float vectors of one width, in order. Pairs of vectors become one, each
    sum's lanes halved and added: 16 -> 8 -> 4 -> 2 -> 1 lanes per sum, lane i plus lane
    i + half (a zero vector partners an odd one out; a last vector halves alone)."""
    i32 = ir.IntType(32)
    # (vector, owners): the vector holds len(owners) sums of `lanes` consecutive lanes each.
    entries = [(vector, [i]) for i, vector in enumerate(vectors)]
    lanes = vectors[0].type.count
    while lanes > 1:
        half = lanes // 2
        groups = len(entries[0][1])
        low = [g * lanes + j for g in range(groups) for j in range(half)]
        high = [i + half for i in low]
        if len(entries) % 2 and len(entries) > 1:
            vector_type = entries[0][0].type
            entries.append((ir.Constant(vector_type, [0.0] * vector_type.count), [None] * groups))
        paired = []
        for k in range(0, len(entries), 2):
            p, owners = entries[k]
            if k + 1 < len(entries):
                q, q_owners = entries[k + 1]
                picks = (low + [p.type.count + i for i in low], high + [p.type.count + i for i in high])
                owners = owners + q_owners
            else:  # alone: halved
                q, picks = p, (low, high)
            halves = [builder.shuffle_vector(p, q, ir.Constant(ir.VectorType(i32, len(pick)), pick)) for pick in picks]
            paired.append((builder.fadd(*halves), owners))
        entries, lanes = paired, half
    sums = [None] * len(vectors)
    for vector, owners in entries:
        for lane, owner in enumerate(owners):
            if owner is not None:
                sums[owner] = builder.extract_element(vector, ir.Constant(i32, lane))
    return sums


def row_pointers(context, builder, array_type, array, rows_type, rows, pointee):
    """Pointers (to ``pointee``) to the rows ``rows`` (a UniTuple of ``rows_type``) of a
    C-contiguous 2-D array, and the array's row length."""
    view = context.make_array(array_type)(context, builder, array)
    width = builder.extract_value(view.shape, 1)
    pointers = []
    for row in cgutils.unpack_tuple(builder, rows, rows_type.count):
        start = builder.mul(context.cast(builder, row, rows_type.dtype, types.intp), width)
        pointers.append(builder.bitcast(builder.gep(view.data, [start]), pointee.as_pointer()))
    return pointers, width


def row_ahead(builder, data, row, ahead, rows, row_bytes, pointee):
    """A pointer (to ``pointee``) to row ``row + ahead`` of a C-contiguous array at ``data``
    of ``rows`` rows of ``row_bytes`` bytes, or to its last row where that is past the end (a
    repeated line to prefetch, no branch)."""
    index_type = row.type
    last = builder.sub(rows, ir.Constant(index_type, 1))
    later = builder.add(row, ir.Constant(index_type, ahead))
    later = builder.select(builder.icmp_signed("<", later, last), later, last)
    start = builder.gep(builder.bitcast(data, ir.IntType(8).as_pointer()), [builder.mul(later, row_bytes)])
    return builder.bitcast(start, pointee.as_pointer())


def prefetch(builder, pointer):
    """``llvm.prefetch`` of the 64-byte line at ``pointer`` (a read, kept in every cache
    level): a tile's weight rows are short streams side by side, which the hardware
    prefetchers pick up late."""
    i8, i32 = ir.IntType(8), ir.IntType(32)
    function = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [i8.as_pointer(), i32, i32, i32]), "llvm.prefetch.p0"
    )
    line = builder.bitcast(pointer, i8.as_pointer())
    builder.call(function, [line, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])


def accumulators(builder, count, vector_type):
    """``count`` stack slots holding a zero ``vector_type`` (promoted to registers by LLVM)."""
    zero = ir.Constant(vector_type, [0.0] * vector_type.count)
    return [cgutils.alloca_once_value(builder, zero) for _ in range(count)]


def splat(builder, scalar, lanes):
    """A vector of ``lanes`` copies of ``scalar``."""
    vector_type = ir.VectorType(scalar.type, lanes)
    single = builder.insert_element(ir.Constant(vector_type, ir.Undefined), scalar, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(single, single, ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes))


# The row kernels' tile epilogues: ``dots[i * count + j]`` is weight row n + i against
# activation row j of the tile.


@numba.njit(fastmath=True, inline="always")
def store_tile(dots, tile, n, count, m, bias, e, out):
    """out[m + j, n + i] = dots[i * count + j] (+ bias[e, n + i]): a first GEMM's tile."""
    for i in range(tile):
        add = bias[e, n + i] if bias.shape[0] > 0 else np.float32(0.0)
        for j in range(count):
            out[m + j, n + i] = dots[i * count + j] + add


@numba.njit(fastmath=True, inline="always")
def add_tile(dots, tile, n, a_rows, tokens, slot_weights, bias, e, sums):
    """sums[tokens[m], n + i] += slot_weights[m] * (dots[i * len(a_rows) + j] (+ bias[e, n + i]))
    for m = a_rows[j]: a second GEMM's tile, combined."""
    for i in range(tile):
        add = bias[e, n + i] if bias.shape[0] > 0 else np.float32(0.0)
        for j in range(len(a_rows)):
            m = a_rows[j]
            sums[tokens[m], n + i] += slot_weights[m] * (dots[i * len(a_rows) + j] + add)
