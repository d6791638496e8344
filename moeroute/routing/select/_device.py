"""select_experts' CUDA kernel (``numba.cuda``, one warp per token row) and its launcher
`_select_device`."""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
# Kernel code must reach numba.cuda through this module-level name: the CUDA simulator
# swaps in its own module for the global `cuda` of the functions it runs.
from numba import cuda, float32, int32, int64
from numba.core import types

from moeroute.routing import _arrays, _launcher
from moeroute.routing.select._common import (
    _F32_EPS, _F32_MAX, _F32_NEG_MAX, _F32_ONE, _F32_ZERO, _NAN_KEY, _NO_KEY, _SCORING_CODES,
    SOFTMAX_EXACT_GAP, WARP_SIZE, _dtype_name)


# --------------------------------------------------------------------------------------
# CUDA kernel
# --------------------------------------------------------------------------------------

# 4 warps (128 threads) per block: one row per warp, enough warps per block to keep an SM
# busy, and little idle tail when T is small.
DEVICE_WARPS_PER_BLOCK = 4
_LOW31 = 0x7FFFFFFF  # packed pick = key << 32 | (_LOW31 - expert): max() prefers the lower id


def _device_kernel_function(num_experts, num_groups, scoring, has_bias, renormalize, input_kind):
    """The CUDA kernel, as a Python function specialised to these compile-time constants.

    One warp per token row; lane ``l`` holds experts ``l, l + 32, l + 64, ...`` (coalesced
    loads) in ``ceil(N / 32)`` registers. Grouped routing reduces each group's best two
    over the warp; then K rounds of warp argmax (a packed (key, id) maximum) pick the
    experts, lane r keeping pick r for one coalesced store. ``scoring`` is one of
    `moeroute.config.SCORING_FUNCTIONS`; ``input_kind`` is "float32", "float16" or
    "bfloat16" (bfloat16 arrives as its int16 bits).
    """
    from moeroute.routing import _warp

    shfl_xor, shfl_idx = _warp.shfl_xor, _warp.shfl_idx
    allreduce_max, allreduce_sum = _warp.allreduce_max, _warp.allreduce_sum
    float_as_int, int_as_float, expf = _warp.float_as_int, _warp.int_as_float, _warp.expf

    lanes = WARP_SIZE
    lane_bits = WARP_SIZE.bit_length() - 1  # tid >> lane_bits is the warp of a thread
    slots = -(-num_experts // WARP_SIZE)
    group_size = num_experts // num_groups
    grouped = num_groups > 1
    # Groups made of whole slots (DeepSeek-V3: 32 experts, slot j = group j): membership is
    # known when compiling, so each lane touches only its own slots of a group.
    slot_groups = group_size % WARP_SIZE == 0
    if scoring not in _SCORING_CODES:
        raise ValueError(f"scoring={scoring!r} is not one of {tuple(_SCORING_CODES)}")
    sigmoid = scoring == "sigmoid"
    sqrt_softplus = scoring == "sqrtsoftplus"
    raw = scoring == "none"
    rank_logits = scoring == "softmax" and not has_bias
    bf16 = input_kind == "bfloat16"
    warps = _warp.warps_per_block(DEVICE_WARPS_PER_BLOCK)
    scratch = _warp.scratch_size(warps * WARP_SIZE)
    pad_key = _NO_KEY
    nan_key = _NAN_KEY
    low31 = _LOW31
    no_pick = np.int64(-(2**63))
    f32_zero, f32_one, f32_eps = _F32_ZERO, _F32_ONE, _F32_EPS
    f32_max, f32_neg_max = _F32_MAX, _F32_NEG_MAX
    exact_gap = np.float32(-SOFTMAX_EXACT_GAP)

    @cuda.jit(device=True, inline="always")
    def softplus_sqrt(x):
        """sqrt(softplus(x)) as the CPU kernel's _sqrt_softplus: never overflows."""
        magnitude = x if x >= f32_zero else -x
        positive = x if x > f32_zero else f32_zero
        return np.float32(math.sqrt(np.float32(positive + np.float32(math.log1p(expf(-magnitude))))))

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
    def keep_groups(keys, lane, topk_group, two_best, scratch_i):
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
                other_best = shfl_xor(best, offset, scratch_i)
                other_second = shfl_xor(second, offset, scratch_i)
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
    def lane_best(keys, scores, lane):
        """This lane's best (packed key, score). Selects on compile-time slots only: a
        run-time slot index would send the arrays to local memory."""
        best = no_pick
        best_score = f32_zero
        for j in range(slots):
            candidate = pack(keys[j], j * lanes + lane)
            better = candidate > best
            best = candidate if better else best
            best_score = scores[j] if better else best_score
        return best, best_score

    @cuda.jit(device=True, inline="always")
    def pick(keys, scores, lane, top_k, exp_weights, scratch_i, scratch_f):
        """K rounds of warp argmax. Lane r returns pick r's id and weight numerator; all
        lanes return the weight total (summed in pick order) and the first and last
        picked values (clipped logits, scores or choices)."""
        local_best, local_score = lane_best(keys, scores, lane)
        my_id = 0
        my_weight = f32_zero
        total = f32_zero
        first = f32_zero
        value = f32_zero
        for r in range(top_k):
            best = allreduce_max(local_best, scratch_i)
            key = np.int32(best >> 32)
            expert = low31 - np.int32(best & 0xFFFFFFFF)
            owner = expert % lanes
            picked = local_score
            if lane == owner:
                slot = expert // lanes
                for j in range(slots):
                    keys[j] = pad_key if j == slot else keys[j]
                local_best, local_score = lane_best(keys, scores, lane)
            if has_bias:  # the choice includes the bias: fetch the score from its lane
                value = shfl_idx(picked, owner, scratch_f)
            else:
                value = key_value(key)
            if r == 0:
                first = value
            weight = expf(value - first) if exp_weights else value
            total += weight
            if lane == r:
                my_id = expert
                my_weight = weight
        return my_id, my_weight, total, first, value

    def select_experts_kernel(logits, bias, num_tokens, top_k, topk_group, rsf, out_w, out_ids):
        scratch_i = cuda.shared.array(scratch, int64)
        scratch_f = cuda.shared.array(scratch, float32)
        tid = cuda.threadIdx.x
        lane = tid & (lanes - 1)
        row = cuda.blockIdx.x * warps + (tid >> lane_bits)
        source_row = min(row, num_tokens - 1)  # idle warps of the last block mirror a row
        x = cuda.local.array(slots, float32)
        keys = cuda.local.array(slots, int32)
        scores = cuda.local.array(slots, float32)
        for j in range(slots):
            expert = j * lanes + lane
            x[j] = load(logits, source_row, expert) if expert < num_experts else f32_neg_max

        exact = True
        my_id = 0
        my_weight = f32_zero
        if rank_logits:
            for j in range(slots):
                keys[j] = order_key(x[j]) if j * lanes + lane < num_experts else pad_key
            if grouped:
                keep_groups(keys, lane, topk_group, False, scratch_i)
            my_id, my_weight, total, row_max, last = pick(
                keys, x, lane, top_k, True, scratch_i, scratch_f)
            exact = last - row_max < exact_gap
            if not exact:
                if not renormalize:
                    partial = f32_zero
                    for j in range(slots):
                        if j * lanes + lane < num_experts:
                            partial += expf(x[j] - row_max)
                    total = allreduce_sum(partial, scratch_f)
                my_weight = (my_weight / total) * rsf
        if exact:
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
                row_max = key_value(allreduce_max(best, scratch_i))
                partial = f32_zero
                for j in range(slots):
                    scores[j] = expf(x[j] - row_max)
                    if j * lanes + lane < num_experts:
                        partial += scores[j]
                total = allreduce_sum(partial, scratch_f)
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
                keep_groups(keys, lane, topk_group, has_bias, scratch_i)
            my_id, my_weight, total, first, last = pick(
                keys, scores, lane, top_k, False, scratch_i, scratch_f)
            if raw:
                my_weight = raw_weight(my_weight, total) * rsf
                my_weight = my_weight if my_weight >= f32_neg_max else f32_neg_max
                my_weight = my_weight if my_weight <= f32_max else f32_max
            else:
                if renormalize:
                    my_weight = my_weight / (total + f32_eps)
                my_weight = my_weight * rsf
        if row < num_tokens and lane < top_k:
            out_ids[row, lane] = my_id
            out_w[row, lane] = my_weight

    return select_experts_kernel


@lru_cache(maxsize=None)
def _device_signature(input_kind):
    """The numba signature of the kernel for ``input_kind`` logits (the cached launcher's
    layout, compile_ptx checks)."""
    element = {"float32": types.float32, "float16": types.float16,
               "bfloat16": types.int16}[input_kind]
    bias = types.float32[::1]
    return (element[:, ::1], bias, types.int64, types.int64, types.int64, types.float32,
            types.float32[:, ::1], types.int32[:, ::1])


@lru_cache(maxsize=None)
def _device_kernel(num_experts, num_groups, scoring, has_bias, renormalize, input_kind):
    """The compiled kernel (a numba.cuda dispatcher), built once per specialisation."""
    return cuda.jit(_device_kernel_function(num_experts, num_groups, scoring, has_bias,
                                            renormalize, input_kind))


def _device_logits(logits, launcher="numba"):
    """(kernel array, input kind): bfloat16 is passed as its int16 bits."""
    kind = _dtype_name(logits.dtype)
    if kind == "bfloat16":
        logits = _arrays.device_bits16(logits)
    return _launcher.kernel_array(logits, launcher), kind


def _select_device(logits, config, correction_bias, stream, out=None):
    launcher = _launcher.active_launcher()
    array, kind = _device_logits(logits, launcher)
    if not _arrays.is_c_contiguous(array):
        strides = (tuple(s * array.element_size() for s in array.stride())  # torch, in bytes
                   if callable(getattr(array, "stride", None)) else tuple(array.strides))
        raise ValueError(f"device logits must be C-contiguous, got strides {strides}")
    num_tokens = array.shape[0]
    top_k = config.top_k
    if launcher == "cached":  # the raw handle: no numba stream object per call
        launch_stream = _launcher.stream_handle_of(logits, stream)
    else:
        launch_stream = _arrays.resolve_stream(logits, stream)
    if out is None:
        view = launcher == "numba"
        topk_weights, out_w = _arrays.device_empty((num_tokens, top_k), np.float32, logits,
                                                   launch_stream, view=view)
        topk_ids, out_ids = _arrays.device_empty((num_tokens, top_k), np.int32, logits,
                                                 launch_stream, view=view)
    else:
        topk_weights, topk_ids = out
        out_w, out_ids = (_launcher.kernel_array(o, launcher) for o in out)
    if num_tokens > 0:
        has_bias = correction_bias is not None
        # Without a bias the kernel never reads it: any float32 vector fills the slot.
        bias = (_launcher.kernel_array(correction_bias, launcher) if has_bias
                else out_w.reshape(-1))
        kernel = _device_kernel(config.num_experts, config.num_expert_group,
                                config.scoring, has_bias, config.renormalize, kind)
        warps = _device_warps_per_block()
        blocks = -(-num_tokens // warps)
        _launcher.launch(kernel, _device_signature(kind), blocks, warps * WARP_SIZE,
                         launch_stream,
                         (array, bias, num_tokens, top_k, config.topk_group,
                          np.float32(config.routed_scaling_factor), out_w, out_ids),
                         launcher)
    return topk_weights, topk_ids


def _device_warps_per_block():
    from moeroute.routing import _warp

    return _warp.warps_per_block(DEVICE_WARPS_PER_BLOCK)
