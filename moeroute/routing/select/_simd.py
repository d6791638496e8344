"""select_experts' CPU kernel, its vector steps: Numba intrinsics that emit LLVM IR on 16
lanes (compress, pick rounds, lane maxima, cuts), and the IR builder helpers they share."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from moeroute import cpu_features
from moeroute.routing.reference import FLOAT32_MAX
from moeroute.routing.select import _common as common
from moeroute.routing.select._common import _INT32_LOW31, _NAN_KEY, _NO_KEY

# Candidate collection and the pick rounds work on 16 lanes at a time (one AVX-512
# register of int32 keys; two of packed int64 picks).
_LANES = 16
_PACK_LOW31 = np.int64(0x7FFFFFFF)  # packed pick = key << 32 | (_PACK_LOW31 - id), as on the device
_PACK_NONE = np.int64(np.iinfo(np.int64).min)  # below every packed pick


@intrinsic
def _float32_bits(typingctx, value):
    """The bits of a float32 as an int32 (a register move, vectorizable)."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.int32(types.float32), codegen


@intrinsic
def _bits_float32(typingctx, bits):
    """The float32 whose bits are the int32 ``bits``."""
    if bits != types.int32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@intrinsic
def _fma32(typingctx, a, b, c):
    """a * b + c in float32 with one rounding (llvm.fma: one instruction where the CPU has
    FMA, a libm call elsewhere; the result is the same)."""
    if not (a == b == c == types.float32):
        return None

    def codegen(context, builder, signature, args):
        single = ir.FloatType()
        fma = _llvm_function(builder, "llvm.fma.f32", single, [single] * 3)
        return builder.call(fma, args)

    return types.float32(types.float32, types.float32, types.float32), codegen


@intrinsic
def _prefetch_row(typingctx, array, row):
    """Ask the CPU to bring row ``row`` of the 2-D ``array`` into its caches (llvm.prefetch of
    each 64-byte line; a hint that never faults, so a row past the end is harmless)."""
    if not (isinstance(array, types.Array) and array.ndim == 2 and isinstance(row, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        view = context.make_array(signature.args[0])(context, builder, value=args[0])
        i64 = ir.IntType(64)
        i32 = ir.IntType(32)
        byte_ptr = ir.IntType(8).as_pointer()
        strides = cgutils.unpack_tuple(builder, view.strides, 2)
        shape = cgutils.unpack_tuple(builder, view.shape, 2)
        row_index = context.cast(builder, args[1], signature.args[1], types.int64)
        start = builder.add(builder.ptrtoint(view.data, i64), builder.mul(row_index, strides[0]))
        nbytes = builder.mul(shape[1], strides[1])
        prefetch = _llvm_function(builder, "llvm.prefetch.p0", ir.VoidType(), [byte_ptr, i32, i32, i32])
        with cgutils.for_range_slice(builder, ir.Constant(i64, 0), nbytes, ir.Constant(i64, 64)) as (offset, _):
            address = builder.inttoptr(builder.add(start, offset), byte_ptr)
            builder.call(prefetch, [address, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.none(array, row), codegen


@intrinsic
def _borrowed(typingctx, array):
    """``array`` as a view that holds no reference (no meminfo, no parent).

    Numba counts references to an array on every assignment, view (``a[t]``) and inlined
    helper argument: an atomic add and subtract each time, which summed to about half of a
    row's time on small rows. A borrowed view's count updates see a null meminfo and do
    nothing. The caller must keep the owning array alive (use it again after the last use
    of the view): Numba releases an array after its last use.
    """
    if not isinstance(array, types.Array):
        return None

    def codegen(context, builder, signature, args):
        view = context.make_array(signature.args[0])(context, builder, value=args[0])
        view.meminfo = cgutils.get_null_value(view.meminfo.type)
        view.parent = cgutils.get_null_value(view.parent.type)
        return view._getvalue()

    return array(array), codegen


@intrinsic
def _keep_alive(typingctx, owners):
    """Use ``owners`` (a tuple of arrays) here and do nothing: Numba releases an array
    after its last use, so this keeps the owners of borrowed views alive up to this call."""
    if not isinstance(owners, types.BaseTuple):
        return None

    def codegen(context, builder, signature, args):
        return context.get_dummy_value()

    return types.none(owners), codegen


def _is_c_array(value, dtype, ndim=1):
    return isinstance(value, types.Array) and value.dtype == dtype and value.ndim == ndim and value.layout == "C"


def _splat(builder, vector, value):
    result = ir.Constant(vector, ir.Undefined)
    for lane in range(vector.count):
        result = builder.insert_element(result, value, ir.Constant(ir.IntType(32), lane))
    return result


def _llvm_function(builder, name, return_type, argument_types):
    module = builder.module
    return module.globals.get(name) or ir.Function(module, ir.FunctionType(return_type, argument_types), name=name)


# How _compress_at_least packs the passing indices of a 16-lane block to the front:
# * on the AVX-512 paths of moeroute.cpu_features (vpcompressd), LLVM's vector compress:
#   one instruction;
# * elsewhere (AVX2, generic, NEON), where LLVM expands that compress into 16 scalar steps, a
#   table: each 8-lane half's compare mask (vmovmskps) picks a row of _PACK_TABLE holding the
#   set bits' positions packed left, stored as one 8-lane vector: two table lookups and two
#   stores instead of 16 scalar steps.
VECTOR_COMPRESS = cpu_features.VECTOR_COMPRESS
_HALF = 8
_PACK_TABLE = [[bit for bit in range(_HALF) if mask >> bit & 1] for mask in range(1 << _HALF)]
_PACK_TABLE = [row + [0] * (_HALF - len(row)) for row in _PACK_TABLE]


def _pack_table(builder):
    """The 256 x 8 int32 table of set-bit positions, one constant per LLVM module."""
    row = ir.VectorType(ir.IntType(32), _HALF)
    table_type = ir.ArrayType(row, len(_PACK_TABLE))
    name = "moeroute_select_pack_table"
    table = builder.module.globals.get(name)
    if table is None:
        table = ir.GlobalVariable(builder.module, table_type, name=name)
        table.linkage = "internal"
        table.global_constant = True
        table.align = 32
        table.initializer = ir.Constant(table_type, [ir.Constant(row, r) for r in _PACK_TABLE])
    return table


def _compress_intrinsic(vector_compress):
    """``_compress_at_least(keys, start, cut, out, count)``: append to ``out[count:]`` the
    indices i in [start, start + 16) with keys[i] >= cut, in ascending order, and return
    the new count. ``keys``: int32 keys with an int32 cut, or float32 logits with a float32
    cut (an ordered compare: NaN never passes). Stores 16 lanes at ``out[count]``, so ``out``
    needs 16 spare slots. One vector compare, then a compress (``vector_compress``:
    vpcompressd into a register and a plain store, as its memory form is microcoded on some
    AVX-512 CPUs) or two table lookups and 8-lane stores."""

    def compress_at_least(typingctx, keys, start, cut, out, count):
        return _compress_typing(vector_compress, keys, cut, out)

    return intrinsic(compress_at_least)


def _compress_typing(vector_compress, keys, cut, out):
    floats = _is_c_array(keys, types.float32) and cut == types.float32
    if not ((floats or _is_c_array(keys, types.int32) and cut == types.int32) and _is_c_array(out, types.int32)):
        return None
    signature = types.intp(keys, types.intp, cut, out, types.intp)

    def compare(builder, data, first, cut_value, lanes):
        element = ir.FloatType() if floats else ir.IntType(32)
        vector = ir.VectorType(element, lanes)
        source = builder.load(builder.bitcast(builder.gep(data, [first]), vector.as_pointer()), align=4)
        if floats:
            return builder.fcmp_ordered(">=", source, _splat(builder, vector, cut_value))
        return builder.icmp_signed(">=", source, _splat(builder, vector, cut_value))

    def append(builder, out_data, count, indices, mask, lanes):
        """Store ``indices`` at out[count] and return count + popcount(mask)."""
        target = builder.bitcast(builder.gep(out_data, [count]), indices.type.as_pointer())
        builder.store(indices, target, align=4)
        mask_bits = ir.IntType(lanes)
        popcount = _llvm_function(builder, f"llvm.ctpop.i{lanes}", mask_bits, [mask_bits])
        passed = builder.call(popcount, [builder.bitcast(mask, mask_bits)])
        return builder.add(count, builder.zext(passed, count.type))

    def codegen(context, builder, sig, args):
        keys_value, start_value, cut_value, out_value, count_value = args
        keys_data = context.make_array(sig.args[0])(context, builder, value=keys_value).data
        out_data = context.make_array(sig.args[3])(context, builder, value=out_value).data
        i32 = ir.IntType(32)
        if vector_compress:
            vector = ir.VectorType(i32, _LANES)
            mask = compare(builder, keys_data, start_value, cut_value, _LANES)
            indices = builder.add(
                _splat(builder, vector, builder.trunc(start_value, i32)), ir.Constant(vector, list(range(_LANES)))
            )
            compress = _llvm_function(
                builder,
                f"llvm.experimental.vector.compress.v{_LANES}i32",
                vector,
                [vector, ir.VectorType(ir.IntType(1), _LANES), vector],
            )
            packed = builder.call(compress, [indices, mask, ir.Constant(vector, ir.Undefined)])
            return append(builder, out_data, count_value, packed, mask, _LANES)
        table = _pack_table(builder)
        row = ir.VectorType(i32, _HALF)
        count = count_value
        for half in range(_LANES // _HALF):
            first = builder.add(start_value, ir.Constant(start_value.type, half * _HALF))
            mask = compare(builder, keys_data, first, cut_value, _HALF)
            entry = builder.zext(builder.bitcast(mask, ir.IntType(_HALF)), i32)
            positions = builder.load(builder.gep(table, [ir.Constant(i32, 0), entry]), align=32)
            indices = builder.add(positions, _splat(builder, row, builder.trunc(first, i32)))
            count = append(builder, out_data, count, indices, mask, _HALF)
        return count

    return signature, codegen


_compress_vector = _compress_intrinsic(True)
_compress_table = _compress_intrinsic(False)
_compress_at_least = _compress_vector if VECTOR_COMPRESS else _compress_table


@intrinsic
def _pop_max(typingctx, packed, start, previous):
    """In ``packed[start:start + 16]`` replace ``previous`` by the lowest value, store the
    block back and return its maximum: one pick round on one block, without branches."""
    if not _is_c_array(packed, types.int64):
        return None
    signature = types.int64(packed, types.intp, types.int64)

    def codegen(context, builder, sig, args):
        packed_value, start_value, previous_value = args
        data = context.make_array(sig.args[0])(context, builder, value=packed_value).data
        i64 = ir.IntType(64)
        vector = ir.VectorType(i64, _LANES)
        address = builder.bitcast(builder.gep(data, [start_value]), vector.as_pointer())
        block = builder.load(address, align=8)
        taken = builder.icmp_signed("==", block, _splat(builder, vector, previous_value))
        block = builder.select(taken, _splat(builder, vector, ir.Constant(i64, int(_PACK_NONE))), block)
        builder.store(block, address, align=8)
        reduce_max = _llvm_function(builder, f"llvm.vector.reduce.smax.v{_LANES}i64", i64, [vector])
        return builder.call(reduce_max, [block])

    return signature, codegen


@intrinsic
def _block_top2(typingctx, keys, start):
    """The two largest of ``keys[start:start + 16]`` (equal when the maximum repeats),
    packed as best << 32 | second (low 32 bits): vector max, count, masked max."""
    if not _is_c_array(keys, types.int32):
        return None
    signature = types.int64(keys, types.intp)

    def codegen(context, builder, sig, args):
        keys_value, start_value = args
        data = context.make_array(sig.args[0])(context, builder, value=keys_value).data
        i32 = ir.IntType(32)
        i64 = ir.IntType(64)
        vector = ir.VectorType(i32, _LANES)
        block = builder.load(builder.bitcast(builder.gep(data, [start_value]), vector.as_pointer()), align=4)
        reduce_max = _reduce_smax(builder)
        best = builder.call(reduce_max, [block])
        equal = builder.icmp_signed("==", block, _splat(builder, vector, best))
        mask_bits = ir.IntType(_LANES)
        popcount = _llvm_function(builder, f"llvm.ctpop.i{_LANES}", mask_bits, [mask_bits])
        repeats = builder.call(popcount, [builder.bitcast(equal, mask_bits)])
        others = builder.select(equal, _splat(builder, vector, ir.Constant(i32, int(_NO_KEY))), block)
        second = builder.select(
            builder.icmp_unsigned(">", repeats, ir.Constant(mask_bits, 1)), best, builder.call(reduce_max, [others])
        )
        high = builder.shl(builder.sext(best, i64), ir.Constant(i64, 32))
        return builder.or_(high, builder.zext(second, i64))

    return signature, codegen


def _block_loop(builder, blocks, first, step):
    """Emit ``for i in range(blocks)`` with loop-carried values: ``step(i, carried)`` builds
    one iteration and returns the next carried values; returns the final ones (``first``
    when ``blocks`` is 0)."""
    i64 = ir.IntType(64)
    entry = builder.basic_block
    body = builder.append_basic_block("blocks")
    done = builder.append_basic_block("blocks_done")
    builder.cbranch(builder.icmp_signed(">", blocks, ir.Constant(i64, 0)), body, done)
    builder.position_at_end(body)
    index = builder.phi(i64)
    carried = [builder.phi(value.type) for value in first]
    following = step(index, carried)
    after = builder.add(index, ir.Constant(i64, 1))
    tail = builder.basic_block
    index.add_incoming(ir.Constant(i64, 0), entry)
    index.add_incoming(after, tail)
    for phi, start, value in zip(carried, first, following):
        phi.add_incoming(start, entry)
        phi.add_incoming(value, tail)
    builder.cbranch(builder.icmp_signed("<", after, blocks), body, done)
    builder.position_at_end(done)
    final = []
    for start, value in zip(first, following):
        phi = builder.phi(value.type)
        phi.add_incoming(start, entry)
        phi.add_incoming(value, tail)
        final.append(phi)
    return final


def _vector_smax(builder, a, b):
    return builder.select(builder.icmp_signed(">", a, b), a, b)


def _vector_smin(builder, a, b):
    return builder.select(builder.icmp_signed("<", a, b), a, b)


def _vector_key_map(builder, bits):
    """bits ^ ((bits >> 31) & 0x7FFFFFFF) on int32 lanes: float32 bits to an order key, and
    back (the map is its own inverse)."""
    ints = bits.type
    i32 = ints.element
    sign = builder.ashr(bits, _splat(builder, ints, ir.Constant(i32, 31)))
    return builder.xor(bits, builder.and_(sign, _splat(builder, ints, ir.Constant(i32, int(_INT32_LOW31)))))


def _lane_maxima_loop(builder, blocks, block_keys):
    """Emit the loop over ``blocks`` 16-lane blocks; ``block_keys(index)`` builds block
    ``index``'s int32 keys. Returns the per-lane maxima (_NO_KEY where there is no block)."""
    ints = ir.VectorType(ir.IntType(32), _LANES)
    (maxima,) = _block_loop(
        builder,
        blocks,
        [ir.Constant(ints, [int(_NO_KEY)] * _LANES)],
        lambda index, carried: [_vector_smax(builder, carried[0], block_keys(index))],
    )
    return maxima


def _kth_largest(builder, maxima, k):
    """The k-th largest (1 <= k <= 16, counted with repeats) of 16 int32 lanes: the largest
    lane with at least k lanes at or above it."""
    ints = maxima.type
    i32 = ints.element
    at_least = ir.Constant(ints, [0] * _LANES)
    for lane in range(_LANES):
        other = _splat(builder, ints, builder.extract_element(maxima, ir.Constant(i32, lane)))
        at_least = builder.sub(at_least, builder.sext(builder.icmp_signed(">=", other, maxima), ints))
    if k.type.width != 32:
        k = builder.trunc(k, i32) if k.type.width > 32 else builder.sext(k, i32)
    enough = builder.icmp_signed(">=", at_least, _splat(builder, ints, k))
    no_key = _splat(builder, ints, ir.Constant(i32, int(_NO_KEY)))
    return builder.call(_reduce_smax(builder), [builder.select(enough, maxima, no_key)])


def _reduce_smax(builder):
    """LLVM's signed maximum over a 16-lane int32 vector."""
    ints = ir.VectorType(ir.IntType(32), _LANES)
    return _llvm_function(builder, f"llvm.vector.reduce.smax.v{_LANES}i32", ints.element, [ints])


@intrinsic
def _lane_maxima(typingctx, keys, lanes):
    """``lanes[l]`` = the largest of keys l, l + 16, l + 32, ... over the whole 16-key blocks
    (the maximum is kept in a register across blocks)."""
    if not (_is_c_array(keys, types.int32) and _is_c_array(lanes, types.int32)):
        return None
    signature = types.void(keys, lanes)

    def codegen(context, builder, sig, args):
        keys_array = context.make_array(sig.args[0])(context, builder, value=args[0])
        lanes_data = context.make_array(sig.args[1])(context, builder, value=args[1]).data
        vector = ir.VectorType(ir.IntType(32), _LANES)
        base = builder.bitcast(keys_array.data, vector.as_pointer())
        blocks = builder.udiv(builder.extract_value(keys_array.shape, 0), ir.Constant(ir.IntType(64), _LANES))
        maxima = _lane_maxima_loop(builder, blocks, lambda index: builder.load(builder.gep(base, [index]), align=4))
        builder.store(maxima, builder.bitcast(lanes_data, vector.as_pointer()), align=4)
        return context.get_dummy_value()

    return signature, codegen


# Order keys of the finite float32 extremes: keys outside them are infinities or NaNs.
_KEY_NEG_MAX = np.int32(int(np.float32(-FLOAT32_MAX).view(np.int32)) ^ 0x7FFFFFFF)
_KEY_POS_MAX = np.int32(np.float32(FLOAT32_MAX).view(np.int32))


@intrinsic
def _raw_cut(typingctx, row, top_k):
    """The top_k-th largest (top_k <= 16) of the 16 lane maxima of the raw keys (bits ^
    ((bits >> 31) & 0x7FFFFFFF): -0 below +0, infinities and NaNs unclipped) over the whole
    16-logit blocks of a float32 row: at least top_k logits of the row have a raw key at or
    above it. _NO_KEY when a lane maximum exceeds the key of FLOAT32_MAX (+inf or NaN)."""
    if not (_is_c_array(row, types.float32) and isinstance(top_k, types.Integer)):
        return None
    signature = types.int32(row, top_k)

    def codegen(context, builder, sig, args):
        row_array = context.make_array(sig.args[0])(context, builder, value=args[0])
        i32 = ir.IntType(32)
        ints = ir.VectorType(i32, _LANES)
        base = builder.bitcast(row_array.data, ints.as_pointer())
        blocks = builder.udiv(builder.extract_value(row_array.shape, 0), ir.Constant(ir.IntType(64), _LANES))
        maxima = _lane_maxima_loop(
            builder, blocks, lambda index: _vector_key_map(builder, builder.load(builder.gep(base, [index]), align=4))
        )
        cut = _kth_largest(builder, maxima, args[1])
        top = builder.call(_reduce_smax(builder), [maxima])
        clean = builder.icmp_signed("<=", top, ir.Constant(i32, int(_KEY_POS_MAX)))
        return builder.select(clean, cut, ir.Constant(i32, int(_NO_KEY)))

    return signature, codegen


@intrinsic
def _logit_keys(typingctx, row, x, keys, lanes):
    """One pass over the whole 16-logit blocks of a float32 row: the clipped logit into
    ``x`` (NaN -> -inf, then clamped to the finite range: _clip_logit), its order key into
    ``keys`` (_order_key) and the per-lane key maxima into ``lanes`` (_lane_maxima)."""
    if not (
        _is_c_array(row, types.float32)
        and _is_c_array(x, types.float32)
        and _is_c_array(keys, types.int32)
        and _is_c_array(lanes, types.int32)
    ):
        return None
    signature = types.void(row, x, keys, lanes)

    def codegen(context, builder, sig, args):
        row_array = context.make_array(sig.args[0])(context, builder, value=args[0])
        x_data = context.make_array(sig.args[1])(context, builder, value=args[1]).data
        keys_data = context.make_array(sig.args[2])(context, builder, value=args[2]).data
        lanes_data = context.make_array(sig.args[3])(context, builder, value=args[3]).data
        i32 = ir.IntType(32)
        floats = ir.VectorType(ir.FloatType(), _LANES)
        ints = ir.VectorType(i32, _LANES)
        row_base = builder.bitcast(row_array.data, floats.as_pointer())
        x_base = builder.bitcast(x_data, floats.as_pointer())
        keys_base = builder.bitcast(keys_data, ints.as_pointer())
        blocks = builder.udiv(builder.extract_value(row_array.shape, 0), ir.Constant(ir.IntType(64), _LANES))
        lowest = _splat(builder, ints, ir.Constant(i32, int(_KEY_NEG_MAX)))
        highest = _splat(builder, ints, ir.Constant(i32, int(_KEY_POS_MAX)))

        def block_keys(index):
            value = builder.load(builder.gep(row_base, [index]), align=4)
            # + 0 turns -0 into +0; the key map is its own inverse.
            bits = builder.bitcast(builder.fadd(value, ir.Constant(floats, [0.0] * _LANES)), ints)
            key = _vector_smin(builder, _vector_smax(builder, _vector_key_map(builder, bits), lowest), highest)
            key = builder.select(builder.fcmp_unordered("uno", value, value), lowest, key)
            builder.store(key, builder.gep(keys_base, [index]), align=4)
            builder.store(builder.bitcast(_vector_key_map(builder, key), floats), builder.gep(x_base, [index]), align=4)
            return key

        maxima = _lane_maxima_loop(builder, blocks, block_keys)
        builder.store(maxima, builder.bitcast(lanes_data, ints.as_pointer()), align=4)
        return context.get_dummy_value()

    return signature, codegen


@intrinsic
def _count_above(typingctx, packed, block, against, ranks):
    """``ranks[block + j] +=`` how many of ``packed[against:against + 16]`` exceed
    ``packed[block + j]``, j < 16: 16 broadcast compares, each adding its 0/1 lanes. Summed
    over every ``against`` block this is each distinct packed pick's place in descending
    order."""
    if not (_is_c_array(packed, types.int64) and _is_c_array(ranks, types.int32)):
        return None
    signature = types.void(packed, types.intp, types.intp, ranks)

    def codegen(context, builder, sig, args):
        packed_value, block_start, against_start, ranks_value = args
        packed_data = context.make_array(sig.args[0])(context, builder, value=packed_value).data
        ranks_data = context.make_array(sig.args[3])(context, builder, value=ranks_value).data
        i32 = ir.IntType(32)
        vector = ir.VectorType(ir.IntType(64), _LANES)
        ints = ir.VectorType(i32, _LANES)
        own = builder.load(builder.bitcast(builder.gep(packed_data, [block_start]), vector.as_pointer()), align=8)
        target = builder.bitcast(builder.gep(ranks_data, [block_start]), ints.as_pointer())
        counts = builder.load(target, align=4)
        for lane in range(_LANES):
            other = builder.load(
                builder.gep(packed_data, [builder.add(against_start, ir.Constant(against_start.type, lane))]), align=8
            )
            below = builder.icmp_signed("<", own, _splat(builder, vector, other))
            counts = builder.add(counts, builder.zext(below, ints))
        builder.store(counts, target, align=4)
        return context.get_dummy_value()

    return signature, codegen


@intrinsic
def _zero_block(typingctx, counts, start):
    """``counts[start:start + 16] = 0`` as one vector store (a zeroing loop there becomes a
    call to libc's memset, a call per row; so does a loop of these)."""
    if not _is_c_array(counts, types.int32):
        return None
    signature = types.void(counts, types.intp)

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, value=args[0]).data
        ints = ir.VectorType(ir.IntType(32), _LANES)
        builder.store(
            ir.Constant(ints, [0] * _LANES), builder.bitcast(builder.gep(data, [args[1]]), ints.as_pointer()), align=4
        )
        return context.get_dummy_value()

    return signature, codegen


@intrinsic
def _place_block(typingctx, packed, count, top_k, top_keys, top_ids):
    """The top_k largest of the ``count`` <= 16 packed picks ``packed[:count]`` into
    top_keys/top_ids, descending, all in registers: a pick's place is the number of picks
    above it (packed picks are distinct), and places from top_k on go to the spare slot
    ``top_k``. Reads 16 entries of ``packed``; those past ``count`` are ignored."""
    if not (
        _is_c_array(packed, types.int64)
        and _is_c_array(top_keys, types.int32)
        and _is_c_array(top_ids, types.int64)
        and isinstance(count, types.Integer)
        and isinstance(top_k, types.Integer)
    ):
        return None
    signature = types.void(packed, count, top_k, top_keys, top_ids)

    def codegen(context, builder, sig, args):
        packed_data = context.make_array(sig.args[0])(context, builder, value=args[0]).data
        keys_data = context.make_array(sig.args[3])(context, builder, value=args[3]).data
        ids_data = context.make_array(sig.args[4])(context, builder, value=args[4]).data
        i32, i64 = ir.IntType(32), ir.IntType(64)
        longs = ir.VectorType(i64, _LANES)
        count_value = context.cast(builder, args[1], sig.args[1], types.int64)
        spare = context.cast(builder, args[2], sig.args[2], types.int64)
        picks = builder.load(builder.bitcast(packed_data, longs.as_pointer()), align=8)
        valid = builder.icmp_signed("<", ir.Constant(longs, list(range(_LANES))), _splat(builder, longs, count_value))
        picks = builder.select(valid, picks, _int_splat(longs, _PACK_NONE))
        above = ir.Constant(longs, [0] * _LANES)
        for lane in range(_LANES):
            other = _splat(builder, longs, builder.extract_element(picks, ir.Constant(i32, lane)))
            above = builder.add(above, builder.zext(builder.icmp_signed(">", other, picks), longs))
        low31 = ir.Constant(i64, int(_PACK_LOW31))
        for lane in range(_LANES):
            index = ir.Constant(i32, lane)
            pick = builder.extract_element(picks, index)
            place = builder.extract_element(above, index)
            place = builder.select(builder.icmp_signed("<", place, spare), place, spare)
            place = builder.select(builder.icmp_signed("<", ir.Constant(i64, lane), count_value), place, spare)
            builder.store(builder.trunc(builder.ashr(pick, ir.Constant(i64, 32)), i32), builder.gep(keys_data, [place]))
            builder.store(
                builder.sub(low31, builder.and_(pick, ir.Constant(i64, 0xFFFFFFFF))), builder.gep(ids_data, [place])
            )
        return context.get_dummy_value()

    return signature, codegen


@intrinsic
def _lane_cut(typingctx, lanes, top_k):
    """A cut with at least ``top_k`` keys at or above it (``top_k`` <= 16): the top_k-th
    largest of the 16 lane maxima ``lanes`` (16 distinct keys of the row)."""
    if not (_is_c_array(lanes, types.int32) and isinstance(top_k, types.Integer)):
        return None
    signature = types.int32(lanes, top_k)

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, value=args[0]).data
        ints = ir.VectorType(ir.IntType(32), _LANES)
        maxima = builder.load(builder.bitcast(data, ints.as_pointer()), align=4)
        return _kth_largest(builder, maxima, args[1])

    return signature, codegen


def _float_splat(vector, value):
    return ir.Constant(vector, [float(np.float32(value))] * vector.count)


def _int_splat(vector, value):
    return ir.Constant(vector, [int(value)] * vector.count)


def _vector_exp(builder, value):
    """_host._exp on a float32 vector, operation for operation (the same fused multiply-adds
    and roundings): lane for lane bit-equal to the scalar helper."""
    floats = value.type
    ints = ir.VectorType(ir.IntType(32), floats.count)
    fma_function = _llvm_function(builder, f"llvm.fma.v{floats.count}f32", floats, [floats] * 3)

    def fma(a, b, c):
        return builder.call(fma_function, [a, b, c])

    lowest = _float_splat(floats, common._EXP_LOWEST)
    highest = _float_splat(floats, common._EXP_HIGHEST)
    x = builder.select(builder.fcmp_ordered("<", value, highest), value, highest)
    x = builder.select(builder.fcmp_ordered(">", x, lowest), x, lowest)
    magic = _float_splat(floats, common._ROUND_MAGIC)
    n = builder.fsub(fma(x, _float_splat(floats, common._LOG2_E), magic), magic)
    minus_n = builder.fneg(n)
    r = fma(minus_n, _float_splat(floats, common._LN2_HI), x)
    r = fma(minus_n, _float_splat(floats, common._LN2_LO), r)
    p = _float_splat(floats, common._EXP_P0)
    for coefficient in (common._EXP_P1, common._EXP_P2, common._EXP_P3, common._EXP_P4, common._EXP_P5):
        p = fma(p, r, _float_splat(floats, coefficient))
    p = builder.fadd(fma(p, builder.fmul(r, r), r), _float_splat(floats, 1.0))
    whole = builder.fptosi(n, ints)
    half = builder.ashr(whole, _int_splat(ints, 1))
    rest = builder.sub(whole, half)
    bias = _int_splat(ints, common._F32_EXPONENT_BIAS)
    mantissa = _int_splat(ints, 23)
    first = builder.bitcast(builder.shl(builder.add(half, bias), mantissa), floats)
    second = builder.bitcast(builder.shl(builder.add(rest, bias), mantissa), floats)
    return builder.fmul(builder.fmul(p, first), second)


@intrinsic
def _sigmoid_keys(typingctx, x, bias, scores, keys, lanes):
    """One pass over the whole 16-value blocks of the logits ``x`` (raw or clipped: the exp
    makes a NaN score 0): ``scores`` = 1 / (1 + exp(-x)) (the scalar formula of _host, bit
    for bit), ``keys`` = the order keys
    of score + ``bias`` (of the score alone when ``bias`` is None) and ``lanes`` = the
    per-lane key maxima (_lane_maxima).

    ``bias`` must hold no NaN. A score is in [+0, 1], so score + bias is then neither NaN
    nor -0 (+0 + -0 is +0) and its order key is the plain key map of its bits: the NaN and
    -0 handling of _vector_order_key (a third of this pass) is left out."""
    has_bias = bias != types.none
    if not (
        _is_c_array(x, types.float32)
        and _is_c_array(scores, types.float32)
        and _is_c_array(keys, types.int32)
        and _is_c_array(lanes, types.int32)
        and (not has_bias or _is_c_array(bias, types.float32))
    ):
        return None
    signature = types.void(x, bias, scores, keys, lanes)

    def codegen(context, builder, sig, args):
        def data(index):
            return context.make_array(sig.args[index])(context, builder, value=args[index]).data

        x_array = context.make_array(sig.args[0])(context, builder, value=args[0])
        i64 = ir.IntType(64)
        ints = ir.VectorType(ir.IntType(32), _LANES)
        sources = [data(0), data(1) if has_bias else None, data(2), data(3)]
        blocks = builder.udiv(builder.extract_value(x_array.shape, 0), ir.Constant(i64, _LANES))

        def run(width, first, count, maxima):
            """Blocks [first, first + count) of ``width`` lanes; per-lane key maxima."""
            floats = ir.VectorType(ir.FloatType(), width)
            wide = ir.VectorType(ir.IntType(32), width)
            x_base, bias_base, scores_base, keys_base = (
                None if source is None else builder.bitcast(source, kind.as_pointer())
                for source, kind in zip(sources, (floats, floats, floats, wide))
            )
            one = _float_splat(floats, 1.0)

            def step(index, carried):
                index = builder.add(first, index)
                value = builder.load(builder.gep(x_base, [index]), align=4)
                score = builder.fdiv(one, builder.fadd(one, _vector_exp(builder, builder.fneg(value))))
                builder.store(score, builder.gep(scores_base, [index]), align=4)
                if has_bias:
                    choice = builder.fadd(score, builder.load(builder.gep(bias_base, [index]), align=4))
                    key = _vector_key_map(builder, builder.bitcast(choice, wide))
                else:
                    key = builder.bitcast(score, wide)  # a float >= +0: its bits are its key
                builder.store(key, builder.gep(keys_base, [index]), align=4)
                return [_vector_smax(builder, carried[0], key)]

            (result,) = _block_loop(builder, count, [maxima], step)
            return result

        # Four blocks at a time as 64-lane vectors, then a pair, then a single block: each
        # constant of the exp serves more registers; lane l + 16 j of a wider maximum belongs
        # to lane l.
        done = ir.Constant(i64, 0)
        maxima = _int_splat(ir.VectorType(ir.IntType(32), 4 * _LANES), _NO_KEY)
        for width in (4 * _LANES, 2 * _LANES, _LANES):
            while maxima.type.count > width:
                half = maxima.type.count // 2
                low, high = [
                    builder.shuffle_vector(
                        maxima,
                        maxima,
                        ir.Constant(ir.VectorType(ir.IntType(32), half), list(range(start, start + half))),
                    )
                    for start in (0, half)
                ]
                maxima = _vector_smax(builder, low, high)
            per = ir.Constant(i64, width // _LANES)
            count = builder.udiv(builder.sub(blocks, done), per)
            maxima = run(width, builder.udiv(done, per), count, maxima)
            done = builder.add(done, builder.mul(count, per))
        builder.store(maxima, builder.bitcast(data(4), ints.as_pointer()), align=4)
        return context.get_dummy_value()

    return signature, codegen


# Grouped routing on groups of whole 16-key blocks: up to this many groups are chosen by
# `_group_picks` (8 covers DeepSeek-V3's routers; more groups take the scalar merge).
GROUP_SLOTS = 8


def _top2_merge(builder, first, second):
    """The per-lane (best, second best) of two (best, second best) vector pairs, repeats
    counted: a best that appears in both is also the second."""
    (best_a, second_a), (best_b, second_b) = first, second
    return (
        _vector_smax(builder, best_a, best_b),
        _vector_smax(builder, _vector_smin(builder, best_a, best_b), _vector_smax(builder, second_a, second_b)),
    )


def _halve_groups(builder, pairs, width):
    """One level of the transposed top-2 reduction: vectors holding groups of ``width``
    lanes each, in group order, become half as many vectors (or one, with junk lanes after
    its groups) holding groups of ``width / 2`` lanes, each lane the merge of two."""
    i32 = ir.IntType(32)
    half = width // 2
    merged = []
    for index in range(0, len(pairs), 2):
        low = pairs[index]
        high = pairs[index + 1] if index + 1 < len(pairs) else None
        groups = _LANES // width
        sources = [(0, j) for j in range(groups)] + ([(_LANES, j) for j in range(groups)] if high is not None else [])
        first_lanes, second_lanes = [], []
        for offset, group in sources:
            start = offset + group * width
            first_lanes += range(start, start + half)
            second_lanes += range(start + half, start + width)
        first_lanes += [0] * (_LANES - len(first_lanes))
        second_lanes += [0] * (_LANES - len(second_lanes))
        other = high if high is not None else low

        def pick(lanes, which):
            mask = ir.Constant(ir.VectorType(i32, _LANES), lanes)
            return builder.shuffle_vector(low[which], other[which], mask)

        merged.append(
            _top2_merge(
                builder, (pick(first_lanes, 0), pick(first_lanes, 1)), (pick(second_lanes, 0), pick(second_lanes, 1))
            )
        )
    return merged


@intrinsic
def _group_picks(typingctx, keys, num_groups, topk_group, two_best, kept, lanes):
    """Grouped routing's choice of groups when every group is whole 16-key blocks and there
    are at most GROUP_SLOTS groups: ``kept[g]`` marks the ``topk_group`` best groups (a
    group's score is its best key, or with ``two_best`` the order key of the float32 sum of
    its two best choices; ties to the lower group), ``lanes`` gets the per-lane key maxima of
    the kept groups (_lane_maxima of the keys once dropped groups hold _NO_KEY).

    Each group's blocks fold into per-lane (best, second) vectors; the groups' vectors then
    meet in a transposed reduction (pairs of vectors shuffled into halves and merged) that
    ends with group g's best and second in lane g, scored and ranked in one vector."""
    if not (
        _is_c_array(keys, types.int32)
        and _is_c_array(kept, types.boolean)
        and _is_c_array(lanes, types.int32)
        and isinstance(num_groups, types.Integer)
        and isinstance(topk_group, types.Integer)
        and isinstance(two_best, (types.Integer, types.Boolean))
    ):
        return None
    signature = types.void(keys, num_groups, topk_group, two_best, kept, lanes)

    def codegen(context, builder, sig, args):
        keys_array = context.make_array(sig.args[0])(context, builder, value=args[0])
        kept_data = context.make_array(sig.args[4])(context, builder, value=args[4]).data
        lanes_data = context.make_array(sig.args[5])(context, builder, value=args[5]).data
        i1, i8, i32, i64 = ir.IntType(1), ir.IntType(8), ir.IntType(32), ir.IntType(64)
        ints = ir.VectorType(i32, _LANES)
        floats = ir.VectorType(ir.FloatType(), _LANES)
        no_key = _int_splat(ints, _NO_KEY)
        base = builder.bitcast(keys_array.data, ints.as_pointer())
        groups = context.cast(builder, args[1], sig.args[1], types.int64)
        chosen = builder.trunc(context.cast(builder, args[2], sig.args[2], types.int64), i32)
        two = builder.icmp_signed("!=", context.cast(builder, args[3], sig.args[3], types.int64), ir.Constant(i64, 0))
        blocks = builder.udiv(builder.extract_value(keys_array.shape, 0), ir.Constant(i64, _LANES))
        group_blocks = builder.udiv(blocks, groups)

        slots = []
        for slot in range(GROUP_SLOTS):
            valid = builder.icmp_signed("<", ir.Constant(i64, slot), groups)
            first = builder.mul(builder.select(valid, ir.Constant(i64, slot), ir.Constant(i64, 0)), group_blocks)

            def fold(index, carried, first=first):
                block = builder.load(builder.gep(base, [builder.add(first, index)]), align=4)
                best, second = carried
                return [
                    _vector_smax(builder, best, block),
                    _vector_smax(builder, second, _vector_smin(builder, best, block)),
                ]

            best, second = _block_loop(builder, group_blocks, [no_key, no_key], fold)
            slots.append((valid, builder.select(valid, best, no_key), builder.select(valid, second, no_key)))

        pairs = [(best, second) for _, best, second in slots]
        width = _LANES
        while width > 1:
            pairs = _halve_groups(builder, pairs, width)
            width //= 2
        ((best, second),) = pairs

        def value(key):
            return builder.bitcast(_vector_key_map(builder, key), floats)

        total = builder.fadd(builder.fadd(value(best), value(second)), _float_splat(floats, 0.0))  # + 0: -0 as +0
        summed = builder.select(
            builder.fcmp_unordered("uno", total, total),
            _int_splat(ints, _NAN_KEY),
            _vector_key_map(builder, builder.bitcast(total, ints)),
        )
        score = builder.select(two, summed, best)

        lane_ids = ir.Constant(ints, list(range(_LANES)))
        ahead = ir.Constant(ints, [0] * _LANES)
        for slot in range(GROUP_SLOTS):
            other = _splat(builder, ints, builder.extract_element(score, ir.Constant(i32, slot)))
            beats = builder.or_(
                builder.icmp_signed(">", other, score),
                builder.and_(
                    builder.icmp_signed("==", other, score), builder.icmp_signed("<", _int_splat(ints, slot), lane_ids)
                ),
            )
            beats = builder.and_(beats, _splat(builder, ir.VectorType(i1, _LANES), slots[slot][0]))
            ahead = builder.add(ahead, builder.zext(beats, ints))
        keep = builder.icmp_signed("<", ahead, _splat(builder, ints, chosen))

        maxima = no_key
        for slot, (valid, slot_best, _) in enumerate(slots):
            taken = builder.and_(valid, builder.extract_element(keep, ir.Constant(i32, slot)))
            maxima = _vector_smax(builder, maxima, builder.select(taken, slot_best, no_key))
            with builder.if_then(valid):
                builder.store(builder.zext(taken, i8), builder.gep(kept_data, [ir.Constant(i64, slot)]))
        builder.store(maxima, builder.bitcast(lanes_data, ints.as_pointer()), align=4)
        return context.get_dummy_value()

    return signature, codegen
