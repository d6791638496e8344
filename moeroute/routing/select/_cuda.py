"""The CUDA side of select_experts and route: one warp per token row.

`row_routine` builds the per-row work as a device function (select_experts' kernel and the
fused route kernel both call it); `select_kernel_function` and `route_kernel_function`
build the kernels around it. Every builder takes the compile-time constants
(N, groups, scoring, bias or not, renormalize, input dtype) and returns plain Python
functions: `cuda.jit` compiles them for a device, `cuda.compile_ptx` checks them without
one, and the CUDA simulator runs them as Python.

The ranking is the CPU kernel's (_host.py): int32 order keys of the float32 choices
(-0 == +0, NaN below -inf), ties to the lower expert id and the lower group id, the same
float32 operations in the same order.

Top-k design
------------
Lane ``l`` holds experts ``l, l + 32, l + 64, ...`` (coalesced loads) in S = ceil(N / 32)
registers. The lane packs them as ``key << 32 | (2**31 - 1 - id)`` (larger is better, the
lower id wins a tie) and sorts them once, descending, with Batcher's odd-even merge
network (compile-time indices, so the values stay in registers), then parks the sorted
column in shared memory (its own column: no bank conflicts, no other lane reads it). Each
of the K rounds is then O(1) per lane:

* warp max of the lanes' head keys (int32): 5 shuffles + 5 max;
* ``ballot(head key == max)``: one lane holds it almost always; that lane is the winner
  (``ffs``) and one indexed shuffle brings its id to lane r. A tie of keys across lanes
  (equal choices, saturated or NaN rows) takes the warp-uniform slow path: a 64-bit
  packed maximum (10 shuffles), which puts the lower id first;
* the winner advances its head: one shared-memory load.

Expected instructions per row and lane (S slots, C(S) comparators: C = 19 for S = 8, 42 for
S = 12, 63 for S = 16, 191 for S = 32; K picks): S loads (+ S bias loads), S score
evaluations (~8 each for sigmoid, ~6 for exp), ~6 C for the sort, S shared stores, then
~25 per round (6 shuffles, 5 max, vote, popc, ffs, one shared load, bookkeeping). With a
bias, lane r re-derives pick r's score from its logit (one cached load, the same float32
operations) and K shuffles sum the weights in pick order. DeepSeek-V3 (S = 8, K = 8):
~120 sort + ~200 rounds, against ~600 for the plain alternative, K rescans of all S slots
with a 64-bit allreduce; Qwen3.5 (S = 16, K = 10): ~380 + ~250 against ~1200.
"""

from __future__ import annotations

import math

import numpy as np

# Kernel code must reach numba.cuda through this module-level name: the CUDA simulator
# swaps in its own module for the global `cuda` of the functions it runs.
from numba import cuda, float32, int32, int64
from numba.core import types

from moeroute.routing import _warp
from moeroute.routing.select._common import (
    _F32_EPS,
    _F32_MAX,
    _F32_NEG_MAX,
    _F32_ONE,
    _F32_ZERO,
    _NAN_KEY,
    _NO_KEY,
    _SCORING_CODES,
    SOFTMAX_EXACT_GAP,
    WARP_SIZE,
)

__all__ = [
    "WARP_SIZE",
    "DEVICE_WARPS_PER_BLOCK",
    "sorting_network",
    "row_routine",
    "select_kernel_function",
    "select_signature",
    "route_kernel_function",
    "route_signature",
    "warps_per_block",
]

# 4 warps (128 threads) per block: one row per warp, enough warps per block to keep an SM
# busy, and little idle tail when T is small.
DEVICE_WARPS_PER_BLOCK = 4
SCORINGS = tuple(_SCORING_CODES)
_LOW31 = 0x7FFFFFFF  # packed pick = key << 32 | (_LOW31 - expert): max() prefers the lower id
_NO_PICK = np.int64(np.iinfo(np.int64).min)  # below every packed pick: an exhausted lane


def warps_per_block() -> int:
    """Warps (rows) per block: 4 on a device, ``MOEROUTE_SIM_WARPS`` under the simulator."""
    return _warp.warps_per_block(DEVICE_WARPS_PER_BLOCK)


# --------------------------------------------------------------------------------------
# The per-lane sort
# --------------------------------------------------------------------------------------


def sorting_network(size: int) -> list[tuple[int, int]]:
    """Batcher's odd-even merge sort on ``size`` elements: comparators (i, j), i < j.

    Built for the next power of two and pruned of comparators that touch a position
    >= ``size``: those positions hold the smallest value, which a descending comparator
    leaves in place, so the pruned network still sorts.
    """
    n = 1
    while n < size:
        n *= 2
    pairs = []
    p = 1
    while p < n:
        k = p
        while k >= 1:
            for j in range(k % p, n - k, 2 * k):
                for i in range(min(k, n - j - k)):
                    if (i + j) // (2 * p) == (i + j + k) // (2 * p):
                        pairs.append((i + j, i + j + k))
            k //= 2
        p *= 2
    return [(i, j) for i, j in pairs if j < size]


def _sort_descending_function(size: int):
    """A Python function sorting ``values[0:size]`` descending in place, one line per
    comparator with literal indices (so that compiled, the array stays in registers)."""
    lines = ["def sort_descending(values):"]
    for i, j in sorting_network(size):
        lines.append(f"    a = values[{i}]")
        lines.append(f"    b = values[{j}]")
        lines.append(f"    values[{i}] = max(a, b)")
        lines.append(f"    values[{j}] = min(a, b)")
    lines.append("    return")
    namespace: dict = {}
    exec(compile("\n".join(lines), f"<sorting network {size}>", "exec"), namespace)
    return namespace["sort_descending"]


# --------------------------------------------------------------------------------------
# The row routine
# --------------------------------------------------------------------------------------


def row_routine(num_experts, num_groups, scoring, has_bias, renormalize, input_kind):
    """The device function ``select_row(logits, bias, row, lane, heads, warp, top_k,
    topk_group, rsf) -> (topk_id, topk_weight)`` routing one row with one warp.

    Lane r < K returns pick r (id, final weight); other lanes return (0, 0). Every lane of
    the warp must call it (warp collectives). ``heads`` is an int64 shared array
    [warps, S, 32]; ``warp`` the row's index in it. ``input_kind``: "float32", "float16"
    or "bfloat16" (bfloat16 arrives as its int16 bits).
    """
    if scoring not in SCORINGS:
        raise ValueError(f"scoring={scoring!r} is not one of {SCORINGS}")
    shfl_xor, shfl_idx, ballot = _warp.shfl_xor, _warp.shfl_idx, _warp.ballot
    allreduce_max, allreduce_sum = _warp.allreduce_max, _warp.allreduce_sum
    float_as_int, int_as_float, expf = _warp.float_as_int, _warp.int_as_float, _warp.expf

    lanes = WARP_SIZE
    slots = -(-num_experts // WARP_SIZE)
    group_size = num_experts // num_groups
    grouped = num_groups > 1
    # Groups made of whole slots (DeepSeek-V3: 32 experts, slot j = group j): membership is
    # known when compiling, so each lane touches only its own slots of a group.
    slot_groups = group_size % WARP_SIZE == 0
    sigmoid = scoring == "sigmoid"
    sqrt_softplus = scoring == "sqrtsoftplus"
    raw = scoring == "none"
    rank_logits = scoring == "softmax" and not has_bias
    bf16 = input_kind == "bfloat16"
    pad_key, nan_key, low31, no_pick = _NO_KEY, _NAN_KEY, _LOW31, _NO_PICK
    f32_zero, f32_one, f32_eps = _F32_ZERO, _F32_ONE, _F32_EPS
    f32_max, f32_neg_max = _F32_MAX, _F32_NEG_MAX
    exact_gap = np.float32(-SOFTMAX_EXACT_GAP)
    sort_descending = cuda.jit(device=True, inline="always")(_sort_descending_function(slots))

    @cuda.jit(device=True, inline="always")
    def softplus_sqrt(x):
        """sqrt(softplus(x)) as the CPU kernel's _sqrt_softplus: never overflows."""
        magnitude = x if x >= f32_zero else -x
        positive = x if x > f32_zero else f32_zero
        softplus = positive + np.float32(math.log1p(expf(-magnitude)))
        return np.float32(math.sqrt(np.float32(softplus)))

    @cuda.jit(device=True, inline="always")
    def raw_weight(weight, total):
        """A pick's weight under scoring "none" (the CPU kernel's _raw_logit_weight)."""
        divisor = total + f32_eps
        if renormalize and divisor > f32_zero and divisor <= f32_max:
            weight = weight / divisor
        return weight

    @cuda.jit(device=True, inline="always")
    def order_key(value):
        bits = float_as_int(value + f32_zero)  # + 0 turns -0 into +0
        key = np.int32(bits ^ ((bits >> 31) & low31))
        return key if value == value else nan_key

    @cuda.jit(device=True, inline="always")
    def key_value(key):
        return int_as_float(np.int32(key ^ ((key >> 31) & low31)))

    @cuda.jit(device=True, inline="always")
    def pack(key, expert):
        return (np.int64(key) << 32) | np.int64(low31 - expert)

    @cuda.jit(device=True, inline="always")
    def load(logits, row, expert):
        if bf16:
            value = int_as_float(np.int32(np.int32(logits[row, expert]) << 16))
        else:
            value = np.float32(logits[row, expert])
        value = value if value >= f32_neg_max else f32_neg_max  # NaN and -inf
        return value if value <= f32_max else f32_max

    @cuda.jit(device=True, inline="always")
    def score_of(x, row_max, total):
        """The score of a clipped logit ``x``, as the score loop computes it."""
        if sigmoid:
            return f32_one / (f32_one + expf(-x))
        if sqrt_softplus:
            return softplus_sqrt(x)
        if raw:
            return x
        return expf(x - row_max) / total

    @cuda.jit(device=True, inline="always")
    def keep_groups(keys, lane, topk_group, two_best):
        """Give the experts of dropped groups the lowest key (ties to the lower group)."""
        group_keys = cuda.local.array(num_groups, int32)
        for g in range(num_groups):
            best = pad_key
            second = pad_key
            for j in range(slots):
                if slot_groups:
                    member = (j * lanes) // group_size == g  # a constant once unrolled
                else:
                    expert = j * lanes + lane
                    member = expert >= g * group_size and expert < (g + 1) * group_size
                if member:
                    key = keys[j]
                    second = max(second, min(key, best))
                    best = max(key, best)
            offset = lanes // 2
            for _ in range(5):  # butterfly merge of (best, second) pairs
                other_best = shfl_xor(best, offset)
                other_second = shfl_xor(second, offset)
                second = max(max(second, other_second), min(best, other_best))
                best = max(best, other_best)
                offset //= 2
            if two_best:
                group_keys[g] = order_key(key_value(best) + key_value(second))
            else:
                group_keys[g] = best
        kept = 0
        for g in range(num_groups):
            rank = 0
            for h in range(num_groups):
                if group_keys[h] > group_keys[g] or (group_keys[h] == group_keys[g] and h < g):
                    rank += 1
            if rank < topk_group:
                kept |= 1 << g
        for j in range(slots):
            if slot_groups:
                group = (j * lanes) // group_size
            else:
                group = (j * lanes + lane) // group_size
            keys[j] = keys[j] if (kept >> group) & 1 else pad_key

    @cuda.jit(device=True, inline="always")
    def pick(keys, lane, heads, warp, top_k, exp_weights):
        """K rounds of warp argmax over sorted lane columns. Lane r returns pick r's id and
        weight numerator; all lanes return the weight total (summed in pick order) and
        the first and last picked values (key values: clipped logits, scores or choices)."""
        column = cuda.local.array(slots, int64)
        for j in range(slots):
            column[j] = pack(keys[j], j * lanes + lane)
        sort_descending(column)
        for j in range(slots):
            heads[warp, j, lane] = column[j]
        head = column[0]
        position = 0
        my_id = 0
        my_weight = f32_zero
        total = f32_zero
        first = f32_zero
        value = f32_zero
        for r in range(top_k):
            head_key = np.int32(head >> 32)
            best_key = allreduce_max(head_key)
            holders = ballot(head_key == best_key)
            head_id = low31 - np.int32(head & low31)
            if cuda.popc(holders) == 1:  # the same on every lane: no divergence
                owner = cuda.ffs(holders) - 1
                expert = shfl_idx(head_id, owner)
            else:  # equal keys on several lanes: the packed maximum has the lower id
                best = allreduce_max(head)
                expert = low31 - np.int32(best & low31)
                owner = expert % lanes
            if lane == owner:
                position += 1
                head = heads[warp, position, lane] if position < slots else no_pick
            value = key_value(best_key)
            if r == 0:
                first = value
            weight = expf(value - first) if exp_weights else value
            total += weight
            if lane == r:
                my_id = expert
                my_weight = weight
        return my_id, my_weight, total, first, value

    def select_row(logits, bias, row, lane, heads, warp, top_k, topk_group, rsf):
        x = cuda.local.array(slots, float32)
        keys = cuda.local.array(slots, int32)
        scores = cuda.local.array(slots, float32)
        for j in range(slots):
            expert = j * lanes + lane
            x[j] = load(logits, row, expert) if expert < num_experts else f32_neg_max

        exact = True
        my_id = 0
        my_weight = f32_zero
        if rank_logits:
            for j in range(slots):
                keys[j] = order_key(x[j]) if j * lanes + lane < num_experts else pad_key
            if grouped:
                keep_groups(keys, lane, topk_group, False)
            my_id, my_weight, total, row_max, last = pick(keys, lane, heads, warp, top_k, True)
            exact = last - row_max < exact_gap
            if not exact:
                if not renormalize:
                    partial = f32_zero
                    for j in range(slots):
                        if j * lanes + lane < num_experts:
                            partial += expf(x[j] - row_max)
                    total = allreduce_sum(partial)
                my_weight = (my_weight / total) * rsf
        if exact:
            row_max = f32_zero
            total = f32_one
            if sigmoid:
                for j in range(slots):
                    scores[j] = f32_one / (f32_one + expf(-x[j]))
            elif sqrt_softplus:
                for j in range(slots):
                    scores[j] = softplus_sqrt(x[j])
            elif raw:
                for j in range(slots):
                    scores[j] = x[j]
            else:
                best = pad_key
                for j in range(slots):
                    best = max(best, order_key(x[j]))
                row_max = key_value(allreduce_max(best))
                partial = f32_zero
                for j in range(slots):
                    scores[j] = expf(x[j] - row_max)
                    if j * lanes + lane < num_experts:
                        partial += scores[j]
                total = allreduce_sum(partial)
                for j in range(slots):
                    scores[j] = scores[j] / total
            for j in range(slots):
                expert = j * lanes + lane
                if expert < num_experts:
                    choice = scores[j] + bias[expert] if has_bias else scores[j]
                    keys[j] = order_key(choice)
                else:
                    keys[j] = pad_key
            if grouped:
                keep_groups(keys, lane, topk_group, has_bias)
            my_id, my_weight, weight_sum, first, last = pick(keys, lane, heads, warp, top_k, False)
            if has_bias:
                # The key is the choice (score + bias): lane r recomputes its pick's score
                # from the logit (a cached load, the same float32 operations), and the
                # weight total is summed in pick order as the CPU kernel does.
                picked = load(logits, row, min(my_id, num_experts - 1))
                my_weight = score_of(picked, row_max, total) if lane < top_k else f32_zero
                weight_sum = f32_zero
                for r in range(top_k):
                    weight_sum += shfl_idx(my_weight, r)
            if raw:
                my_weight = raw_weight(my_weight, weight_sum) * rsf
                my_weight = my_weight if my_weight >= f32_neg_max else f32_neg_max
                my_weight = my_weight if my_weight <= f32_max else f32_max
            else:
                if renormalize:
                    my_weight = my_weight / (weight_sum + f32_eps)
                my_weight = my_weight * rsf
        return my_id, my_weight

    return cuda.jit(device=True, inline="always")(select_row), slots


# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------


def _element_type(input_kind):
    return {"float32": types.float32, "float16": types.float16, "bfloat16": types.int16}[input_kind]


def _warp_row_routine(num_experts, num_groups, scoring, has_bias, renormalize, input_kind):
    """The row set-up both kernels share, as an inlined device function:
    ``pick(logits, bias, T, K, topk_group, rsf) -> (row, lane, id, weight)``: one warp per
    row, `warps_per_block()` rows per block, ``id``/``weight`` lane r's pick r (for
    r < K). Idle warps of the last block mirror row T - 1 (``row`` >= T: store nothing)."""
    select_row, slots = row_routine(num_experts, num_groups, scoring, has_bias, renormalize, input_kind)
    warps = warps_per_block()
    lanes = WARP_SIZE
    lane_bits = WARP_SIZE.bit_length() - 1  # tid >> lane_bits is the warp of a thread

    @cuda.jit(device=True, inline="always")
    def pick(logits, bias, num_tokens, top_k, topk_group, rsf):
        heads = cuda.shared.array((warps, slots, lanes), int64)
        tid = cuda.threadIdx.x
        lane = tid & (lanes - 1)
        warp = tid >> lane_bits
        row = cuda.blockIdx.x * warps + warp
        source_row = min(row, num_tokens - 1)
        my_id, my_weight = select_row(logits, bias, source_row, lane, heads, warp, top_k, topk_group, rsf)
        return row, lane, my_id, my_weight

    return pick


def select_kernel_function(num_experts, num_groups, scoring, has_bias, renormalize, input_kind):
    """select_experts' kernel: ``kernel(logits [T, N], bias [N] float32, T, K,
    topk_group, rsf, out_w [T, K] float32, out_ids [T, K] int32)``; one warp per row,
    `warps_per_block()` rows per block; lane r stores pick r (a coalesced store)."""
    pick = _warp_row_routine(num_experts, num_groups, scoring, has_bias, renormalize, input_kind)

    def select_experts_kernel(logits, bias, num_tokens, top_k, topk_group, rsf, out_w, out_ids):
        row, lane, my_id, my_weight = pick(logits, bias, num_tokens, top_k, topk_group, rsf)
        if row < num_tokens and lane < top_k:
            out_ids[row, lane] = my_id
            out_w[row, lane] = my_weight

    return select_experts_kernel


def select_signature(input_kind, bias_layout="C"):
    """The numba signature of `select_kernel_function`'s kernel (the cached launcher's
    layout, compile_ptx checks); ``bias_layout`` "A" for a strided bias vector."""
    return (
        _element_type(input_kind)[:, ::1],
        types.Array(types.float32, 1, bias_layout),
        types.int64,
        types.int64,
        types.int64,
        types.float32,
        types.float32[:, ::1],
        types.int32[:, ::1],
    )


def route_signature(input_kind, bias_layout="C", slot_layout="C"):
    """The numba signature of `route_kernel_function`'s kernel: "A" layouts for a strided
    bias or shared-weight array (any other argument is C-contiguous)."""
    table = types.int32[::1]
    return (
        _element_type(input_kind)[:, ::1],
        types.Array(types.float32, 1, bias_layout),
        types.int64,
        types.int64,
        types.int64,
        types.float32,
        types.int64,
        table,
        table,
        table,
        types.int64,
        types.int64,
        types.Array(types.float32, 2, slot_layout),
        types.int64,
        types.int64,
        types.float32,
        types.boolean,
        table,
        types.float32[:, ::1],
        types.int32[:, ::1],
    )


def route_kernel_function(num_experts, num_groups, scoring, has_bias, renormalize, input_kind):
    """The fused route kernel: select_experts' row routine, then in the same warp the
    physical id of each pick (replica hash and per-rank shift, `remap.physical_id_device`),
    the fused shared slots, and the rank's local ids.

    ``kernel(logits, bias, T, K, topk_group, rsf, num_routed, replica_offsets, replica_ids,
    routed_id_map, first_slot, num_slots, slot_weights [T or 1, S or 1] float32, use_row,
    use_col, scalar_weight, has_array, expert_map int32, out_w [T, K + S'], out_ids)``:
    columns < K are lane r's pick, column K + j (j < S') the shared slot ``first_slot + j``
    with weight ``slot_weights[t * use_row, j * use_col]`` or ``scalar_weight``.
    """
    from moeroute.routing.remap._common import _physical_id

    # Compiled here from remap's one definition: inlined, and compile_ptx needs no context.
    physical_id_device = cuda.jit(device=True, inline="always")(_physical_id)
    pick = _warp_row_routine(num_experts, num_groups, scoring, has_bias, renormalize, input_kind)
    lanes = WARP_SIZE

    def route_kernel(
        logits,
        bias,
        num_tokens,
        top_k,
        topk_group,
        rsf,
        num_routed,
        replica_offsets,
        replica_ids,
        routed_id_map,
        first_slot,
        num_slots,
        slot_weights,
        use_row,
        use_col,
        scalar_weight,
        has_array,
        expert_map,
        out_w,
        out_ids,
    ):
        row, lane, my_id, my_weight = pick(logits, bias, num_tokens, top_k, topk_group, rsf)
        if row < num_tokens:
            map_size = expert_map.shape[0]
            if lane < top_k:
                physical = physical_id_device(my_id, row, num_routed, replica_offsets, replica_ids, routed_id_map)
                local = -1
                if physical >= 0 and physical < map_size:
                    local = expert_map[physical]
                out_ids[row, lane] = local
                out_w[row, lane] = my_weight
            for j in range(lane, num_slots, lanes):
                physical = first_slot + j
                local = -1
                if physical >= 0 and physical < map_size:
                    local = expert_map[physical]
                out_ids[row, top_k + j] = local
                if has_array:
                    out_w[row, top_k + j] = slot_weights[row * use_row, j * use_col]
                else:
                    out_w[row, top_k + j] = scalar_weight

    return route_kernel
