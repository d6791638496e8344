"""select_experts' CPU kernel (Numba ``njit``, ``prange`` over token rows) and its host
launcher `_select_host`."""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange
from numba.core import types
from numba.extending import overload

from moeroute.routing import _parallel
from moeroute.routing._float16 import decode_table
from moeroute.routing.select._common import (
    _F32_EPS,
    _F32_HALF,
    _F32_INF,
    _F32_MAX,
    _F32_NEG_INF,
    _F32_NEG_MAX,
    _F32_ONE,
    _F32_ZERO,
    _EXP_HIGHEST,
    _EXP_LOWEST,
    _EXP_P0,
    _EXP_P1,
    _EXP_P2,
    _EXP_P3,
    _EXP_P4,
    _EXP_P5,
    _F32_EXPONENT_BIAS,
    _INT32_LOW31,
    _LN2_HI,
    _LN2_LO,
    _LOG2_E,
    _NAN_KEY,
    _NO_KEY,
    _RAW,
    _ROUND_MAGIC,
    _SCORING_CODES,
    _SIGMOID,
    _SOFTMAX,
    _SQRTSOFTPLUS,
    SOFTMAX_EXACT_GAP,
    WARP_SIZE,
)
from moeroute.routing.select._simd import (
    GROUP_SLOTS,
    _KEY_NEG_MAX,
    _LANES,
    _PACK_LOW31,
    _PACK_NONE,
    _bits_float32,
    _block_top2,
    _borrowed,
    _compress_at_least,
    _count_above,
    _float32_bits,
    _fma32,
    _group_picks,
    _keep_alive,
    _lane_cut,
    _lane_maxima,
    _logit_keys,
    _place_block,
    _pop_max,
    _prefetch_row,
    _raw_cut,
    _sigmoid_keys,
    _zero_block,
)

# Below this many logits (T * N) one thread does the whole batch: the serial kernel is then
# only a few times the thread pool's wake-up, which grows far beyond it when the other cores
# are busy.
PARALLEL_MIN_ELEMENTS = 1 << 15
# Rows per parallel work item: small enough that a thread stalled by other load leaves its
# share to the others, large enough that per-item scratch, the first row's full scan (no cut
# guess yet) and the scheduling stay negligible (at T = 8192, interleaved with torch, 512
# rows beat 256 and matched 1024 and 4096).
PARALLEL_CHUNK_ROWS = 512
# Each row asks for the row this many ahead (software prefetch): in a model the logits
# come from memory, the caches holding the layer before. Run right after torch's routing at
# T = 8192, 4 ahead beat none, and 2 or 8 did no better than 4.
PREFETCH_ROWS = 4

# The kernels' has_bias argument: no bias, a bias, a bias with NaN entries (whose choices
# are NaN in every row: the vector sigmoid pass leaves those to the scalar loops). The host
# launcher passes _BIAS for any bias; `_select_rows` finds the NaN entries itself (a NumPy
# isnan().any() per call cost more than a whole T = 1 routing kernel).
_NO_BIAS, _BIAS, _BIAS_WITH_NAN = 0, 1, 2

# float16 and bfloat16 -> float32 for every bit pattern, looked up by the CPU kernel (one
# kernel serves both 16-bit kinds, each with its table).
_HALF_TO_FLOAT = decode_table(bfloat16=False)
_BF16_TO_FLOAT = decode_table(bfloat16=True)

# error_model="numpy": a float division by zero gives inf instead of raising, which keeps
# the per-row loops free of branches so that LLVM vectorizes them.
_cpu_jit = njit(cache=True, error_model="numpy")
# Helpers are inlined into the row kernel, one of two ways. A called helper would pay
# reference-count updates on every array argument, per call, per row, and a scalar helper
# (exp, order keys, clipping) left as a call keeps its per-expert loop from vectorizing.
# * The small leaves: in Numba's IR (inline="always"), so that their loops are compiled in
#   their caller's context (compiled apart, the pick rounds over fewer than 16 keys lose the
#   bound their caller's branch gives them, and ran measurably slower).
# * The composite steps (a row's ranking, a scoring's row, the row loop): compiled once each
#   as functions of their own and inlined by LLVM (forceinline: LLVM's alwaysinline). Numba's
#   IR inlining runs the callee's front end and deep-copies its IR at every call site, and
#   again at every site inside each inlined callee: over this call tree that was most of the
#   kernel's compile time.
_cpu_inline = njit(cache=True, error_model="numpy", inline="always")
_cpu_scalar = _cpu_inline
_cpu_step = njit(cache=True, error_model="numpy", forceinline=True)


# A row's top-k is picked among the keys at or above a cut. With K <= 16 and N >= 16 the
# cut is the K-th largest of the 16 lane maxima (lane l: keys l, l + 16, ...): 16 distinct
# keys of the row, so at least K keys pass, typically K to 2K of them on random logits.
# float32 softmax rows with renormalize and no groups (Qwen's routers) take this cut from
# the raw float bits and compare the logits themselves against it: no key array is
# written, only the candidates' keys are computed (_softmax_fast_row).
# Otherwise the first cut is the previous row's spread (best minus K-th best choice) below
# the row's best (rows of a batch are alike), bisected until between K and 16 keys pass,
# for at most _CUT_STEPS passes. With no usable cut every key is a candidate: always
# exact, only slower. Up to _COUNTED_BLOCKS blocks of 16 candidates are placed by counting
# the candidates above each; more go through K pick rounds.
_CUT_STEPS = 4

# Up to this many 16-candidate blocks get their places by counting (blocks**2 compares of
# 16 x 16); beyond, K pick rounds over the blocks cost less.
_COUNTED_BLOCKS = 2


@_cpu_scalar
def _exp(value):
    """float32 exp (see _common); inf above ~88.72 and for NaN, 0 below ~-103.97."""
    x = value if value < _EXP_HIGHEST else _EXP_HIGHEST  # NaN fails: exp(NaN) is inf
    x = x if x > _EXP_LOWEST else _EXP_LOWEST
    n = _fma32(x, _LOG2_E, _ROUND_MAGIC) - _ROUND_MAGIC
    r = _fma32(-n, _LN2_HI, x)
    r = _fma32(-n, _LN2_LO, r)
    p = _fma32(_fma32(_fma32(_fma32(_fma32(_EXP_P0, r, _EXP_P1), r, _EXP_P2), r, _EXP_P3), r, _EXP_P4), r, _EXP_P5)
    p = _fma32(p, r * r, r) + _F32_ONE
    half = np.int32(n) >> 1
    rest = np.int32(n) - half
    return (
        p
        * _bits_float32(np.int32((half + _F32_EXPONENT_BIAS) << 23))
        * _bits_float32(np.int32((rest + _F32_EXPONENT_BIAS) << 23))
    )


@_cpu_scalar
def _order_key(value):
    """int32 key of a float32: keys compare like the values, -0 == +0, NaN lowest."""
    bits = _float32_bits(value + _F32_ZERO)  # + 0 turns -0 into +0
    key = np.int32(bits ^ ((bits >> 31) & _INT32_LOW31))
    return key if value == value else _NAN_KEY


@_cpu_scalar
def _key_value(key):
    """The float32 of an order key (a NaN for the NaN key)."""
    return _bits_float32(np.int32(key ^ ((key >> 31) & _INT32_LOW31)))


def _as_float32(value, table):
    """A logit as float32: float32 as is, float16 (passed as its uint16 bits) via ``table``."""


@overload(_as_float32, inline="always")
def _as_float32_overload(value, table):
    if isinstance(value, types.Float):
        return lambda value, table: np.float32(value)
    return lambda value, table: table[value]


@_cpu_scalar
def _clip_logit(x):
    """NaN -> -inf, then clamp to the finite float32 range (reference._scores)."""
    x = x if x >= _F32_NEG_MAX else _F32_NEG_MAX  # NaN and -inf fail the comparison
    return x if x <= _F32_MAX else _F32_MAX


@_cpu_scalar
def _sqrt_softplus(x):
    """sqrt(softplus(x)) of a clipped logit in float32: max(x, 0) + log1p(exp(-|x|)) never
    overflows, so every score is finite and >= 0."""
    magnitude = x if x >= _F32_ZERO else -x
    positive = x if x > _F32_ZERO else _F32_ZERO
    return np.float32(np.sqrt(positive + np.float32(np.log1p(_exp(-magnitude)))))


@_cpu_scalar
def _raw_logit_weight(weight, total, renormalize, rsf):
    """Weight of a pick under scoring "none" (reference._raw_logit_weights): divided by
    ``total + 1e-20`` only when that divisor is positive and finite, times rsf, clamped to
    the finite float32 range."""
    divisor = total + _F32_EPS
    if renormalize and divisor > _F32_ZERO and divisor <= _F32_MAX:
        weight = weight / divisor
    weight = weight * rsf
    weight = weight if weight >= _F32_NEG_MAX else _F32_NEG_MAX
    return weight if weight <= _F32_MAX else _F32_MAX


@_cpu_inline
def _lane_order_sum(values, lane_sums):
    """float32 sum of ``values`` in the device kernel's order.

    Lane l adds elements l, l + 32, l + 64, ... in sequence, then the 32 lane sums meet
    in a butterfly (xor 16, 8, 4, 2, 1) as in the warp reduction, so host and device
    sums are bit for bit equal given equal summands.
    """
    n = values.shape[0]
    for lane in range(WARP_SIZE):
        lane_sums[lane] = _F32_ZERO
    full = n - n % WARP_SIZE
    for base in range(0, full, WARP_SIZE):
        for lane in range(WARP_SIZE):
            lane_sums[lane] += values[base + lane]
    for lane in range(n - full):
        lane_sums[lane] += values[full + lane]
    width = WARP_SIZE // 2
    while width >= 1:
        for lane in range(width):
            lane_sums[lane] = lane_sums[lane] + lane_sums[lane + width]
        width //= 2
    return lane_sums[0]


@_cpu_inline
def _push_top(key, index, top_keys, top_ids, count, capacity):
    """Insert (key, index) into the descending buffer and return the new count.

    Indices arrive in ascending order, so the strict comparison keeps the lower index
    first among equal keys.
    """
    if count < capacity:
        position = count
        count += 1
    elif key > top_keys[capacity - 1]:
        position = capacity - 1
    else:
        return count
    while position > 0 and key > top_keys[position - 1]:
        top_keys[position] = top_keys[position - 1]
        top_ids[position] = top_ids[position - 1]
        position -= 1
    top_keys[position] = key
    top_ids[position] = index
    return count


@_cpu_step
def _keep_groups(keys, num_groups, topk_group, two_best, group_keys, kept, top_keys, top_ids):
    """Mark the topk_group best groups in ``kept`` (ties to the lower group id).

    A group's score is its best choice, or with ``two_best`` the float32 sum of its two
    best choices (the reference's ranked[0] + ranked[1]).
    """
    group_size = keys.shape[0] // num_groups
    full = group_size - group_size % _LANES
    for g in range(num_groups):
        start = g * group_size
        best = _NO_KEY
        second = _NO_KEY
        for block in range(start, start + full, _LANES):
            pair = _block_top2(keys, block)
            block_best = np.int32(pair >> 32)
            block_second = np.int32(pair & 0xFFFFFFFF)
            second = max(max(second, block_second), min(best, block_best))
            best = max(best, block_best)
        for i in range(start + full, start + group_size):
            key = keys[i]
            # Branch-free: the loser of (key, best) competes for second place.
            second = max(second, min(key, best))
            best = max(key, best)
        if two_best:
            group_keys[g] = _order_key(_key_value(best) + _key_value(second))
        else:
            group_keys[g] = best
    count = 0
    for g in range(num_groups):
        kept[g] = False
        count = _push_top(group_keys[g], g, top_keys, top_ids, count, topk_group)
    for j in range(topk_group):
        kept[top_ids[j]] = True


@_cpu_inline
def _collect(keys, cut, candidates):
    """Indices of keys >= cut into ``candidates`` (ascending); returns their count."""
    n = keys.shape[0]
    full = n - n % _LANES
    count = 0
    for start in range(0, full, _LANES):
        count = _compress_at_least(keys, start, cut, candidates, count)
    for i in range(full, n):  # branch-free append
        candidates[count] = i
        count += keys[i] >= cut
    return count


@_cpu_inline
def _small_top_k(keys, top_k, packed, top_keys, top_ids):
    """The top_k best of a few keys into top_keys/top_ids by pick rounds: each round takes
    the largest packed (key, id) (the lower id first on equal keys, as _place) and removes
    it. Packed picks are distinct and above _PACK_NONE, so exactly the winner goes."""
    n = keys.shape[0]
    for i in range(n):
        packed[i] = (np.int64(keys[i]) << 32) | (_PACK_LOW31 - i)
    for r in range(top_k):
        winner = _PACK_NONE
        for i in range(n):
            winner = max(winner, packed[i])
        index = _PACK_LOW31 - (winner & 0xFFFFFFFF)
        top_keys[r] = np.int32(winner >> 32)
        top_ids[r] = index
        packed[index] = _PACK_NONE


@_cpu_step
def _top_k(keys, lanes, lanes_ready, top_k, spread, candidates, packed, top_keys, top_ids):
    """The top_k best keys into top_keys/top_ids, descending, the lower id first on ties.

    ``lanes`` holds the lane maxima of ``keys`` (_lane_maxima) when ``lanes_ready``, else
    it is scratch. With at most 16 picks and at least 16 keys the cut comes from the lane
    maxima; otherwise ``spread[0]`` carries the previous row's spread from row to row (NaN:
    none yet) to guess the cut. ``top_keys``/``top_ids`` need top_k + 1 slots (the last
    takes the unplaced candidates).
    """
    if keys.shape[0] < _LANES:
        # Fewer keys than one block (Mixtral's 8 experts): no cut, no candidates; top_k
        # branch-free pick rounds over the packed keys (an insertion sort mispredicts).
        _small_top_k(keys, top_k, packed, top_keys, top_ids)
        spread[0] = _key_value(top_keys[0]) - _key_value(top_keys[top_k - 1])
        return
    if top_k <= _LANES:
        if not lanes_ready:
            _lane_maxima(keys, lanes)
        count = _collect(keys, _lane_cut(lanes, top_k), candidates)
    else:
        best = _NO_KEY
        for i in range(keys.shape[0]):
            best = keys[i] if keys[i] > best else best
        best_value = _key_value(best)
        target = max(top_k, _LANES)
        width = spread[0]
        narrow = _F32_ZERO  # widest width known to pass fewer than top_k keys
        wide = _F32_INF  # narrowest width known to pass at least top_k keys
        count = 0
        enough = False
        for _ in range(_CUT_STEPS):
            guess = best_value - width
            if not guess > _F32_NEG_INF:  # NaN, or a cut at -inf: no usable cut
                break
            count = _collect(keys, _order_key(guess), candidates)
            enough = count >= top_k
            if enough:
                if count <= target:
                    break
                wide = width
                width = (narrow + width) * _F32_HALF
            else:
                narrow = width
                width = width + width if wide == _F32_INF else (width + wide) * _F32_HALF
                if not width > narrow:  # a zero spread cannot grow
                    break
        if not enough:
            cut = _order_key(best_value - wide) if wide < _F32_INF else _NO_KEY
            count = _collect(keys, cut, candidates)
    _place_candidates(keys, count, top_k, spread, candidates, packed, top_keys, top_ids)


@_cpu_inline
def _place_candidates(keys, count, top_k, spread, candidates, packed, top_keys, top_ids):
    """The top_k best of the ``count`` candidate indices (ascending) into top_keys/top_ids,
    and the row's spread into ``spread[0]``."""
    for j in range(count):
        index = candidates[j]
        packed[j] = (np.int64(keys[index]) << 32) | (_PACK_LOW31 - index)
    _place(packed, count, top_k, candidates, top_keys, top_ids)
    spread[0] = _key_value(top_keys[0]) - _key_value(top_keys[top_k - 1])


@_cpu_inline
def _place(packed, count, top_k, places, top_keys, top_ids):
    """The top_k largest of the ``count`` packed candidates into top_keys/top_ids,
    descending (``places``: scratch; top_keys/top_ids need top_k + 1 slots)."""
    if count <= _LANES:  # the usual case: the cut passes a few more than top_k
        _place_block(packed, count, top_k, top_keys, top_ids)
        return
    blocks = (count + _LANES - 1) // _LANES
    for j in range(count, blocks * _LANES):
        packed[j] = _PACK_NONE
    if blocks <= _COUNTED_BLOCKS:
        # Every candidate's place by counting the candidates above it: no pick rounds.
        _zero_block(places, 0)  # no loop: LLVM would make a loop of zero stores a memset call
        _zero_block(places, _LANES)  # (blocks is 2 here)
        for block in range(0, blocks * _LANES, _LANES):
            for against in range(0, blocks * _LANES, _LANES):
                _count_above(packed, block, against, places)
        for j in range(count):  # branch-free: places past the picks land in the spare slot
            place = min(places[j], top_k)
            top_keys[place] = np.int32(packed[j] >> 32)
            top_ids[place] = _PACK_LOW31 - (packed[j] & 0xFFFFFFFF)
    else:
        # Pick rounds: the packed (key, id) maximum, 16 lanes at a time.
        previous = _PACK_NONE
        for r in range(top_k):
            winner = _PACK_NONE
            for block in range(blocks):
                winner = max(winner, _pop_max(packed, block * _LANES, previous))
            top_keys[r] = np.int32(winner >> 32)
            top_ids[r] = _PACK_LOW31 - (winner & 0xFFFFFFFF)
            previous = winner


@_cpu_step
def _softmax_fast_row(row, top_k, rsf, candidates, packed, top_keys, top_ids, out_w, out_ids, t):
    """Softmax with renormalize, without bias or groups, K <= 16 <= N, straight from a
    float32 row: the cut from the raw lane maxima (_raw_cut), candidates by a float
    compare, order keys only for them. Returns False, writing nothing, when the row takes
    the keyed path instead: an inf or NaN among the lane maxima, a cut at or below
    -FLOAT32_MAX (where clipping could tie values), or picks past SOFTMAX_EXACT_GAP.

    With the cut finite and no +inf or NaN above it, every logit at or above the cut is
    finite, so clipping leaves the candidates as they are; -0 and +0 compare equal as
    floats and get one key."""
    cut = _raw_cut(row, top_k)
    if cut <= _KEY_NEG_MAX:
        return False
    cut_value = _key_value(cut)
    n = row.shape[0]
    full = n - n % _LANES
    count = 0
    for start in range(0, full, _LANES):
        count = _compress_at_least(row, start, cut_value, candidates, count)
    for i in range(full, n):  # branch-free append; an inf here clips to FLOAT32_MAX
        candidates[count] = i
        count += row[i] >= cut_value
    for j in range(count):
        index = candidates[j]
        packed[j] = (np.int64(_order_key(_clip_logit(row[index]))) << 32) | (_PACK_LOW31 - index)
    _place(packed, count, top_k, candidates, top_keys, top_ids)
    if not _within_exact_gap(top_keys, top_k):
        return False
    total = _write_picks(top_keys, top_ids, top_k, out_w, out_ids, t)
    for k in range(top_k):
        out_w[t, k] = (out_w[t, k] / total) * rsf
    return True


@_cpu_inline
def _within_exact_gap(top_keys, top_k):
    """False when the K-th pick lies more than SOFTMAX_EXACT_GAP below the first."""
    return not _key_value(top_keys[top_k - 1]) - _key_value(top_keys[0]) < -SOFTMAX_EXACT_GAP


@_cpu_inline
def _write_picks(top_keys, top_ids, top_k, out_w, out_ids, t):
    """Row ``t``: the picks' ids, and exp(pick - first pick) as weights (the logits from
    their keys); returns the sum of those exponentials."""
    row_max = _key_value(top_keys[0])
    for k in range(top_k):  # vectorizes: no sum in this loop
        out_w[t, k] = _exp(_key_value(top_keys[k]) - row_max)
    total = _F32_ZERO
    for k in range(top_k):
        out_ids[t, k] = top_ids[k]
        total += out_w[t, k]
    return total


@_cpu_step
def _rank(
    keys,
    lanes,
    lanes_ready,
    num_groups,
    topk_group,
    two_best,
    top_k,
    group_keys,
    kept,
    spread,
    candidates,
    packed,
    top_keys,
    top_ids,
):
    """Grouped routing, then the top-k; experts of dropped groups get the lowest key.
    ``lanes``: the lane maxima of ``keys`` when ``lanes_ready``."""
    if num_groups > 1:
        group_size = keys.shape[0] // num_groups
        if group_size % _LANES == 0 and num_groups <= GROUP_SLOTS:
            # The vector choice of groups, which also gives the kept groups' lane maxima.
            _group_picks(keys, num_groups, topk_group, two_best, kept, lanes)
            if top_k <= _LANES:
                # Candidates from the kept groups' blocks only: the dropped groups are
                # neither scanned nor cleared.
                cut = _lane_cut(lanes, top_k)
                count = 0
                for g in range(num_groups):
                    if kept[g]:
                        for start in range(g * group_size, (g + 1) * group_size, _LANES):
                            count = _compress_at_least(keys, start, cut, candidates, count)
                _place_candidates(keys, count, top_k, spread, candidates, packed, top_keys, top_ids)
                return
            lanes_ready = True
        else:
            lanes_ready = False  # the dropped groups change the lane maxima
            _keep_groups(keys, num_groups, topk_group, two_best, group_keys, kept, top_keys, top_ids)
        for g in range(num_groups):
            if not kept[g]:
                # A slice store: one bounds computation, then a vector fill (an indexed loop
                # pays a negative-index check per key and stays scalar).
                keys[g * group_size : (g + 1) * group_size] = _NO_KEY
    _top_k(keys, lanes, lanes_ready, top_k, spread, candidates, packed, top_keys, top_ids)


@_cpu_step
def _softmax_logit_row(
    x,
    keys,
    lanes,
    num_groups,
    topk_group,
    top_k,
    renormalize,
    rsf,
    scores,
    lane_sums,
    group_keys,
    kept,
    spread,
    candidates,
    packed,
    top_keys,
    top_ids,
    out_w,
    out_ids,
    t,
):
    """Softmax without bias: rank the clipped logits ``x`` by their ``keys`` (``lanes``
    their lane maxima). Returns False, writing nothing, when the row's K-th pick is more than
    SOFTMAX_EXACT_GAP below its maximum."""
    num_experts = x.shape[0]
    _rank(
        keys,
        lanes,
        True,
        num_groups,
        topk_group,
        False,
        top_k,
        group_keys,
        kept,
        spread,
        candidates,
        packed,
        top_keys,
        top_ids,
    )
    if not _within_exact_gap(top_keys, top_k):
        return False
    total = _write_picks(top_keys, top_ids, top_k, out_w, out_ids, t)
    if not renormalize:
        row_max = _key_value(top_keys[0])
        for i in range(num_experts):
            scores[i] = _exp(x[i] - row_max)
        total = _lane_order_sum(scores, lane_sums)
    for k in range(top_k):
        out_w[t, k] = (out_w[t, k] / total) * rsf
    return True


@_cpu_step
def _exact_row(
    x,
    bias,
    has_bias,
    scoring,
    num_groups,
    topk_group,
    top_k,
    renormalize,
    rsf,
    scores,
    keys,
    lanes,
    lane_sums,
    group_keys,
    kept,
    spread,
    candidates,
    packed,
    top_keys,
    top_ids,
    out_w,
    out_ids,
    t,
):
    """Select one row from its computed scores (sigmoid, sqrt-softplus, raw logits, a bias,
    or a softmax row whose picks reach the underflow range)."""
    num_experts = x.shape[0]
    lanes_ready = False
    if scoring == _SIGMOID and has_bias != _BIAS_WITH_NAN:
        # One 16-lane pass for scores, keys and lane maxima over the whole blocks: the logits
        # are read once instead of once per vectorized loop.
        if has_bias:
            _sigmoid_keys(x, bias, scores, keys, lanes)
        else:
            _sigmoid_keys(x, None, scores, keys, lanes)
        lanes_ready = True
        for i in range(num_experts - num_experts % _LANES, num_experts):
            scores[i] = _F32_ONE / (_F32_ONE + _exp(-x[i]))
            keys[i] = _order_key(scores[i] + bias[i]) if has_bias else _order_key(scores[i])
    elif scoring == _SIGMOID:
        for i in range(num_experts):
            scores[i] = _F32_ONE / (_F32_ONE + _exp(-x[i]))
    elif scoring == _SQRTSOFTPLUS:
        for i in range(num_experts):
            scores[i] = _sqrt_softplus(x[i])
    elif scoring == _RAW:
        for i in range(num_experts):
            scores[i] = x[i]
    else:
        best = _NO_KEY
        for i in range(num_experts):
            key = _order_key(x[i])
            best = key if key > best else best
        row_max = _key_value(best)
        for i in range(num_experts):
            scores[i] = _exp(x[i] - row_max)
        total = _lane_order_sum(scores, lane_sums)
        for i in range(num_experts):
            scores[i] = scores[i] / total
    if lanes_ready:
        pass
    elif has_bias:
        for i in range(num_experts):
            keys[i] = _order_key(scores[i] + bias[i])
    else:
        for i in range(num_experts):
            keys[i] = _order_key(scores[i])
    _rank(
        keys,
        lanes,
        lanes_ready,
        num_groups,
        topk_group,
        has_bias,
        top_k,
        group_keys,
        kept,
        spread,
        candidates,
        packed,
        top_keys,
        top_ids,
    )

    total = _F32_ZERO
    for k in range(top_k):
        expert = top_ids[k]
        out_ids[t, k] = expert
        weight = scores[expert]
        out_w[t, k] = weight
        total += weight
    if scoring == _RAW:
        for k in range(top_k):
            out_w[t, k] = _raw_logit_weight(out_w[t, k], total, renormalize, rsf)
        return
    for k in range(top_k):
        weight = out_w[t, k]
        if renormalize:
            weight = weight / (total + _F32_EPS)
        out_w[t, k] = weight * rsf


def _load_row(logits, t, table, x, keys, lanes):
    """Row ``t`` of the logits clipped into ``x``, its order keys into ``keys`` and their
    lane maxima into ``lanes``: one vector pass for float32 rows."""


@overload(_load_row, inline="always")
def _load_row_overload(logits, t, table, x, keys, lanes):
    if logits.dtype == types.float32 and logits.layout == "C":

        def load(logits, t, table, x, keys, lanes):
            row = logits[t]
            _logit_keys(row, x, keys, lanes)
            for i in range(row.shape[0] - row.shape[0] % _LANES, row.shape[0]):
                x[i] = _clip_logit(row[i])
                keys[i] = _order_key(x[i])

        return load

    def load_converted(logits, t, table, x, keys, lanes):
        for i in range(logits.shape[1]):
            x[i] = _clip_logit(_as_float32(logits[t, i], table))
            keys[i] = _order_key(x[i])
        _lane_maxima(keys, lanes)

    return load_converted


def _exact_source(logits, t, table, scoring, x):
    """What `_exact_row` reads for row ``t``: the clipped logits in ``x``, or for sigmoid
    scoring of float32 logits the row itself (its exp maps NaN to inf, a score of 0, as
    for the clipped NaN, and clamps the rest: the same scores without a clipping pass)."""


@overload(_exact_source, inline="always")
def _exact_source_overload(logits, t, table, scoring, x):
    if logits.dtype == types.float32 and logits.layout == "C":

        def direct(logits, t, table, scoring, x):
            if scoring == _SIGMOID:
                return logits[t]
            for i in range(logits.shape[1]):
                x[i] = _clip_logit(logits[t, i])
            return x

        return direct

    def converted(logits, t, table, scoring, x):
        for i in range(logits.shape[1]):
            x[i] = _clip_logit(_as_float32(logits[t, i], table))
        return x

    return converted


def _fast_row(logits, t, top_k, rsf, candidates, packed, top_keys, top_ids, out_w, out_ids):
    """`_softmax_fast_row` on row ``t`` of float32 logits; False (not done) otherwise."""


@overload(_fast_row, inline="always")
def _fast_row_overload(logits, t, top_k, rsf, candidates, packed, top_keys, top_ids, out_w, out_ids):
    if logits.dtype == types.float32 and logits.layout == "C":

        def fast(logits, t, top_k, rsf, candidates, packed, top_keys, top_ids, out_w, out_ids):
            return _softmax_fast_row(logits[t], top_k, rsf, candidates, packed, top_keys, top_ids, out_w, out_ids, t)

        return fast

    def converted(logits, t, top_k, rsf, candidates, packed, top_keys, top_ids, out_w, out_ids):
        return False

    return converted


@_cpu_jit
def _select_rows(
    logits,
    table,
    bias,
    has_bias,
    scoring,
    num_groups,
    topk_group,
    top_k,
    renormalize,
    rsf,
    row_start,
    row_stop,
    out_w,
    out_ids,
):
    """Rows [row_start, row_stop) of select_experts into out_w / out_ids."""
    num_experts = logits.shape[1]
    if has_bias == _BIAS:
        for i in range(num_experts):
            if np.isnan(bias[i]):
                has_bias = _BIAS_WITH_NAN
                break
    x = np.empty(num_experts, np.float32)
    scores = np.empty(num_experts, np.float32)
    keys = np.empty(num_experts, np.int32)
    lane_sums = np.empty(WARP_SIZE, np.float32)
    group_keys = np.empty(num_groups, np.int32)
    kept = np.empty(num_groups, np.bool_)
    buffer_size = max(top_k, topk_group) + 1  # + 1: _top_k's spare slot
    top_keys = np.empty(buffer_size, np.int32)
    top_ids = np.empty(buffer_size, np.int64)
    candidates = np.empty(num_experts + _LANES, np.int32)
    packed = np.empty(num_experts + _LANES, np.int64)
    spread = np.full(1, np.nan, np.float32)
    lanes = np.empty(_LANES, np.int32)
    # The row loop, inlined here, sees borrowed views only: LLVM then sees null owners and
    # drops every reference count update of the loop. The arguments are the caller's; the
    # scratch is kept alive below.
    _row_loop(
        _borrowed(logits),
        _borrowed(table),
        _borrowed(bias),
        has_bias,
        scoring,
        num_groups,
        topk_group,
        top_k,
        renormalize,
        rsf,
        row_start,
        row_stop,
        _borrowed(out_w),
        _borrowed(out_ids),
        _borrowed(x),
        _borrowed(scores),
        _borrowed(keys),
        _borrowed(lane_sums),
        _borrowed(group_keys),
        _borrowed(kept),
        _borrowed(top_keys),
        _borrowed(top_ids),
        _borrowed(candidates),
        _borrowed(packed),
        _borrowed(spread),
        _borrowed(lanes),
    )
    _keep_alive((x, scores, keys, lane_sums, group_keys, kept, top_keys, top_ids, candidates, packed, spread, lanes))


@_cpu_step
def _row_loop(
    logits,
    table,
    bias,
    has_bias,
    scoring,
    num_groups,
    topk_group,
    top_k,
    renormalize,
    rsf,
    row_start,
    row_stop,
    out_w,
    out_ids,
    x,
    scores,
    keys,
    lane_sums,
    group_keys,
    kept,
    top_keys,
    top_ids,
    candidates,
    packed,
    spread,
    lanes,
):
    """`_select_rows`' loop over its rows, on its scratch arrays."""
    num_experts = logits.shape[1]
    rank_logits = scoring == _SOFTMAX and not has_bias
    fast = renormalize and num_groups == 1 and top_k <= _LANES and num_experts >= _LANES
    for t in range(row_start, row_stop):
        _prefetch_row(logits, t + PREFETCH_ROWS)
        if rank_logits:
            if fast and _fast_row(logits, t, top_k, rsf, candidates, packed, top_keys, top_ids, out_w, out_ids):
                continue
            _load_row(logits, t, table, x, keys, lanes)
            if _softmax_logit_row(
                x,
                keys,
                lanes,
                num_groups,
                topk_group,
                top_k,
                renormalize,
                rsf,
                scores,
                lane_sums,
                group_keys,
                kept,
                spread,
                candidates,
                packed,
                top_keys,
                top_ids,
                out_w,
                out_ids,
                t,
            ):
                continue
        _exact_row(
            _exact_source(logits, t, table, scoring, x),
            bias,
            has_bias,
            scoring,
            num_groups,
            topk_group,
            top_k,
            renormalize,
            rsf,
            scores,
            keys,
            lanes,
            lane_sums,
            group_keys,
            kept,
            spread,
            candidates,
            packed,
            top_keys,
            top_ids,
            out_w,
            out_ids,
            t,
        )


@njit(parallel=True, cache=True, error_model="numpy")
def _select_parallel(
    logits, table, bias, has_bias, scoring, num_groups, topk_group, top_k, renormalize, rsf, num_chunks, out_w, out_ids
):
    num_tokens = logits.shape[0]
    for chunk in prange(num_chunks):
        _select_rows(
            logits,
            table,
            bias,
            has_bias,
            scoring,
            num_groups,
            topk_group,
            top_k,
            renormalize,
            rsf,
            chunk * num_tokens // num_chunks,
            (chunk + 1) * num_tokens // num_chunks,
            out_w,
            out_ids,
        )


_EMPTY_BIAS = np.zeros(1, np.float32)


def _select_host(logits, config, correction_bias, bfloat16=False, out=None):
    """The CPU kernel; ``bfloat16``: ``logits`` are bfloat16 bit patterns (uint16);
    ``out``: C-contiguous (float32, int32) [T, K] NumPy buffers to write into."""
    num_tokens = logits.shape[0]
    top_k = config.top_k
    if out is None:
        out_w = np.empty((num_tokens, top_k), np.float32)
        out_ids = np.empty((num_tokens, top_k), np.int32)
    else:
        out_w, out_ids = out
    if num_tokens == 0:
        return out_w, out_ids
    logits = np.ascontiguousarray(logits)
    table = _BF16_TO_FLOAT if bfloat16 else _HALF_TO_FLOAT
    if logits.dtype == np.float16:
        logits = logits.view(np.uint16)
    has_bias = _NO_BIAS
    bias = _EMPTY_BIAS
    if correction_bias is not None:
        bias = np.ascontiguousarray(correction_bias)
        has_bias = _BIAS  # _select_rows looks for NaN entries
    args = (
        logits,
        table,
        bias,
        has_bias,
        _SCORING_CODES[config.scoring],
        config.num_expert_group,
        config.topk_group,
        top_k,
        config.renormalize,
        np.float32(config.routed_scaling_factor),
    )
    threads = _parallel.cpu_threads()
    if threads > 1 and num_tokens > 1 and num_tokens * config.num_experts >= PARALLEL_MIN_ELEMENTS:
        chunks = max(threads, -(-num_tokens // PARALLEL_CHUNK_ROWS))
        # One chunk per scheduling step: chunks go to whichever thread is free, so a thread
        # stalled by other load on the machine leaves its share to the others. (Set here:
        # setting it inside the jitted function would keep Numba from caching it.)
        previous = numba.set_parallel_chunksize(1)
        try:
            _select_parallel(*args, chunks, out_w, out_ids)
        finally:
            numba.set_parallel_chunksize(previous)
    else:
        # One thread: the row kernel itself on all rows. Its bounds are int64 as in the
        # parallel kernel's calls, so that both use one compiled specialization.
        _select_rows(*args, 0, num_tokens, out_w, out_ids)
    return out_w, out_ids
