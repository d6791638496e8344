"""select_experts: top-k expert selection for every token (SPEC section 1).

Two kernels compute the same thing:

* the CPU kernel (Numba ``njit``, ``prange`` over token rows) for NumPy inputs;
* the CUDA kernel (``numba.cuda``, one warp per token row, built in ``_select_device.py``)
  for device inputs.

Both follow ``reference.select_experts`` and agree with each other: the same ranking
(choice descending, a NaN choice below every value, ties to the lower expert id and the
lower group id), the same float32 operations in the same order, the softmax sums taken
in the same lane order. They differ only where ``exp`` itself rounds differently (the host's
vectorized polynomial and libdevice's ``expf`` are each within 1-2 ulp of the exact value),
i.e. by an ulp or two of a weight, and so in ids only between choices that close.

Softmax without a correction bias ranks the raw logits: softmax is monotone, so this is
the ranking of the scores without computing them, and with ``renormalize`` only the K
picked exponentials are needed (the softmax denominator cancels). One exception keeps
the reference's ties: when the K-th pick lies more than ``SOFTMAX_EXACT_GAP`` below the
row's maximum, its float32 score may underflow to zero or a subnormal, where distinct
logits tie at equal scores and the lower id must win; such rows rank the computed
scores instead, as the reference does.
"""

from __future__ import annotations

from functools import lru_cache

import numba
import numpy as np
from llvmlite import ir
# Kernel code must reach numba.cuda through this module-level name: the CUDA simulator
# swaps in its own module for the global `cuda` of the functions it runs.
from numba import cuda, njit, prange
from numba.core import types
from numba.extending import intrinsic, overload

from moeroute.config import RouterConfig
from moeroute.routing import _arrays, _parallel
from moeroute.routing.reference import FLOAT32_MAX, RENORMALIZE_EPS

__all__ = [
    "select_experts",
    "MAX_DEVICE_EXPERTS",
    "MAX_DEVICE_TOP_K",
    "MAX_DEVICE_GROUPS",
    "SOFTMAX_EXACT_GAP",
]

WARP_SIZE = 32  # lanes of an NVIDIA warp; the device kernel gives one warp to a token row

# Device limits: every lane keeps ceil(N / 32) scores in registers, lane r keeps pick r,
# and the kept-group set is a 32-bit mask.
MAX_DEVICE_EXPERTS = 1024  # 32 values per lane: more would spill registers to local memory
MAX_DEVICE_TOP_K = WARP_SIZE  # lane r holds the r-th pick until the final coalesced store
MAX_DEVICE_GROUPS = 32  # the kept groups form a 32-bit mask

# A softmax pick more than this many nats below the row max may have a subnormal or zero
# float32 score (exp(-87.3) is the smallest normal float32, less ln N for the division):
# such rows rank the computed scores so that underflow ties go to the lower id.
SOFTMAX_EXACT_GAP = 64.0

# Below this many logits (T * N) one thread does the whole batch: the serial kernel takes
# ~50-100 us there on 2 cores, the pool's wake-up ~10 us on an idle machine and far more
# when the sibling core is busy (scratch timings of serial vs parallel at T = 16..512).
PARALLEL_MIN_ELEMENTS = 1 << 15
# Rows per parallel work item: small enough that a thread stalled by other load leaves its
# share to the others, large enough that per-item scratch and the first row's full scan
# (no cut guess yet) stay negligible.
PARALLEL_CHUNK_ROWS = 256

_SUPPORTED_HOST_DTYPES = ("float32", "float16", "bfloat16")
_SUPPORTED_DEVICE_DTYPES = ("float32", "float16", "bfloat16")

_F32_MAX = np.float32(FLOAT32_MAX)
_F32_NEG_MAX = np.float32(-FLOAT32_MAX)
_F32_ONE = np.float32(1.0)
_F32_ZERO = np.float32(0.0)
_F32_EPS = np.float32(RENORMALIZE_EPS)
_F32_NEG_INF = np.float32(-np.inf)
_F32_INF = np.float32(np.inf)
_F32_HALF = np.float32(0.5)

# float16 -> float32 for every bit pattern: NumPy's own conversion, looked up by the CPU
# kernel (Numba has no host float16 type).
_HALF_TO_FLOAT = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
#: bfloat16 is the top half of a float32.
_BF16_SHIFT = 16
# bfloat16 -> float32 for every bit pattern (exact: the pattern shifted into the top half);
# the same kernel as float16 serves it with this table.
_BF16_TO_FLOAT = (np.arange(1 << 16, dtype=np.uint32) << _BF16_SHIFT).view(np.float32)

# config.scoring as the CPU kernel's integer argument (one compiled kernel serves all four).
_SOFTMAX, _SIGMOID, _SQRTSOFTPLUS, _RAW = 0, 1, 2, 3
_SCORING_CODES = {"softmax": _SOFTMAX, "sigmoid": _SIGMOID, "sqrtsoftplus": _SQRTSOFTPLUS,
                  "none": _RAW}


# --------------------------------------------------------------------------------------
# Validation (one place, at the boundary)
# --------------------------------------------------------------------------------------


def _dtype_name(dtype) -> str:
    """'float32', 'float16', 'bfloat16', ... for NumPy, CuPy, torch and numba dtypes."""
    return str(dtype).rsplit(".", 1)[-1]


def _validate(logits, config, correction_bias, on_device: bool, dtype_name=None) -> None:
    """Raise TypeError/ValueError naming the bad argument; return None when all is well.

    ``dtype_name`` overrides the dtype of host ``logits`` passed as raw bits (bfloat16).
    """
    if not isinstance(config, RouterConfig):
        raise TypeError(f"config must be a moeroute RouterConfig, got {type(config).__name__}")
    if not on_device and not isinstance(logits, np.ndarray):
        raise TypeError(
            f"logits must be a NumPy array or a CUDA device array, got {type(logits).__name__}"
        )
    shape = tuple(logits.shape)
    if len(shape) != 2:
        raise ValueError(f"logits must be 2-D [num_tokens, num_experts], got shape {shape}")
    num_experts = config.num_experts
    if shape[1] != num_experts:
        raise ValueError(
            f"logits.shape[1]={shape[1]} does not match config.num_experts={num_experts}"
        )
    allowed = _SUPPORTED_DEVICE_DTYPES if on_device else _SUPPORTED_HOST_DTYPES
    name = dtype_name or _dtype_name(logits.dtype)
    if name not in allowed:
        where = "device" if on_device else "host"
        raise ValueError(
            f"logits dtype {name} is not supported on the {where}; use one of {allowed}")
    if correction_bias is not None:
        if _arrays.is_device_array(correction_bias) != on_device:
            raise TypeError(
                "correction_bias must live where logits live: "
                f"logits is a {'device' if on_device else 'host'} array, "
                f"correction_bias is a {type(correction_bias).__name__}"
            )
        if not on_device and not isinstance(correction_bias, np.ndarray):
            raise TypeError(
                f"correction_bias must be a NumPy array, got {type(correction_bias).__name__}"
            )
        bias_shape = tuple(correction_bias.shape)
        if bias_shape != (num_experts,):
            raise ValueError(
                f"correction_bias shape {bias_shape} must be ({num_experts},) = [num_experts]"
            )
        bias_dtype = _dtype_name(correction_bias.dtype)
        if bias_dtype != "float32":
            raise ValueError(f"correction_bias dtype {bias_dtype} must be float32")
        if config.num_expert_group > 1 and config.experts_per_group < 2:
            raise ValueError(
                f"num_expert_group={config.num_expert_group} leaves "
                f"{config.experts_per_group} expert per group; with a correction_bias the group "
                "score is the sum of the two best experts, so a group needs at least 2"
            )
    if on_device:
        if num_experts > MAX_DEVICE_EXPERTS:
            raise ValueError(
                f"num_experts={num_experts} exceeds the device kernel limit {MAX_DEVICE_EXPERTS}"
            )
        if config.top_k > MAX_DEVICE_TOP_K:
            raise ValueError(
                f"top_k={config.top_k} exceeds the device kernel limit {MAX_DEVICE_TOP_K}")
        if config.num_expert_group > MAX_DEVICE_GROUPS:
            raise ValueError(
                f"num_expert_group={config.num_expert_group} exceeds the device kernel limit "
                f"{MAX_DEVICE_GROUPS}"
            )


# --------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------


def select_experts(logits, config, correction_bias=None, *, stream=None, out=None):
    """Pick each token's top-k routed experts and their weights (SPEC section 1).

    Parameters
    ----------
    logits : array [T, N], float32, float16 or bfloat16
        Router logits. NumPy arrays and CPU torch tensors run the CPU kernel (on the
        tensor's memory, no copy; bfloat16 read as its raw bits and upcast exactly); CUDA
        arrays (numba device arrays, CuPy arrays, torch CUDA tensors) run the CUDA kernel
        on the device. Device logits must be C-contiguous. float16 and bfloat16 logits
        route exactly as their float32 upcast.
    config : moeroute.config.RouterConfig
        N, K, scoring ("softmax", "sigmoid", "sqrtsoftplus" or "none"), grouped routing,
        renormalize and the routed scaling factor.
    correction_bias : array [N] float32, optional
        Added to the scores for selection only (DeepSeek-V3 ``noaux_tc``); on the same
        side (host or device) as ``logits``.
    stream : numba stream or int handle, optional
        Device inputs only: the stream to launch on. Default: the current stream of the
        framework that produced ``logits``. Ignored for host inputs.
    out : (topk_weights, topk_ids), optional
        Preallocated outputs to write into and return: C-contiguous [T, K] float32 and
        int32 arrays of the framework and device of ``logits``.

    Returns
    -------
    topk_weights : float32 [T, K]
        Scores of the picked experts, renormalized if ``config.renormalize``, times
        ``config.routed_scaling_factor``. Scoring "none" (raw logits): renormalized only when
        ``sum + 1e-20`` is positive and finite, then clamped to the finite float32 range.
    topk_ids : int32 [T, K]
        Picked expert ids, distinct, in [0, N), columns ordered by choice descending.
        NumPy in gives NumPy out, torch in gives torch tensors on the same device, CuPy
        in gives CuPy, numba device arrays give numba device arrays.

    Raises
    ------
    TypeError
        ``config`` is not a RouterConfig; ``logits`` is neither a NumPy array, a torch
        tensor nor a device array; ``correction_bias`` does not live where ``logits``
        lives; ``out`` is not a pair of arrays of the framework of ``logits``.
    ValueError
        ``logits`` not 2-D, ``logits.shape[1] != N``, an unsupported dtype, a bias
        whose shape is not [N] or dtype not float32, a bias with groups of one expert,
        non-contiguous device logits, ``out`` buffers of the wrong shape, dtype or
        device or not C-contiguous, or a configuration past the device kernel's
        limits: N <= 1024, K <= 32, num_expert_group <= 32 (``MAX_DEVICE_*``).
        The CPU kernel has no limits beyond RouterConfig's own.

    Notes
    -----
    Any row, NaN and infinite logits included, yields K distinct ids and finite
    weights; T = 0 returns empty [0, K] outputs without launching anything.
    """
    on_device = _arrays.is_device_array(logits)
    if on_device:
        _validate(logits, config, correction_bias, on_device)
        outputs = _check_out(out, logits, config.top_k, on_device)
        return _select_device(logits, config, correction_bias, stream, outputs)
    caller = logits
    # CPU torch tensors (and bfloat16 ones as their raw bits) run the CPU kernel in place.
    bfloat16 = _arrays.is_bfloat16(logits)
    logits = _host_input("logits", logits)
    if correction_bias is not None and not _arrays.is_device_array(correction_bias):
        if _arrays.is_bfloat16(correction_bias):  # its raw bits would read as uint16
            raise ValueError("correction_bias dtype bfloat16 must be float32")
        correction_bias = _host_input("correction_bias", correction_bias)
    _validate(logits, config, correction_bias, on_device,
              dtype_name="bfloat16" if bfloat16 else None)
    outputs = _check_out(out, caller, config.top_k, on_device)
    host_out = None if outputs is None else tuple(_arrays.host_array(o) for o in outputs)
    weights, ids = _select_host(logits, config, correction_bias, bfloat16, host_out)
    if outputs is not None:
        return outputs
    return _arrays.as_caller(weights, caller), _arrays.as_caller(ids, caller)


def _host_input(name, array):
    """A NumPy view of a host ``array`` (CPU torch tensors without a copy)."""
    if isinstance(array, np.ndarray) or _arrays.torch_of(array) is not None:
        return _arrays.host_array(array)
    raise TypeError(f"{name} must be a NumPy array, a torch tensor or a CUDA device array, got "
                    f"{type(array).__name__}")


def _check_out(out, logits, top_k, on_device):
    """Validated caller buffers ``(topk_weights, topk_ids)`` for ``out=``, or None.

    Each must be C-contiguous, of shape [T, K], float32 / int32, from the framework of
    ``logits`` and on its device; TypeError / ValueError naming the buffer otherwise.
    """
    if out is None:
        return None
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise TypeError(f"out must be a (topk_weights, topk_ids) pair, got {type(out).__name__}")
    shape = (int(logits.shape[0]), int(top_k))
    torch = _arrays.torch_of(logits)
    for name, buffer, dtype in (("out[0] (topk_weights)", out[0], "float32"),
                                ("out[1] (topk_ids)", out[1], "int32")):
        if _arrays.is_device_array(buffer) != on_device:
            where = "a device array" if on_device else "a host array"
            raise TypeError(f"{name} must be {where} like logits, got {type(buffer).__name__}")
        if on_device and _arrays.framework_of(buffer) != _arrays.framework_of(logits):
            raise TypeError(f"{name} is a {_arrays.framework_of(buffer)} array but logits is a "
                            f"{_arrays.framework_of(logits)} one; pass buffers of the same framework")
        if not on_device:
            if torch is not None and _arrays.torch_of(buffer) is None:
                raise TypeError(f"{name} must be a torch tensor like logits, got {type(buffer).__name__}")
            if torch is None and not isinstance(buffer, np.ndarray):
                raise TypeError(f"{name} must be a NumPy array like logits, got {type(buffer).__name__}")
        if tuple(int(n) for n in buffer.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(buffer.shape)}, expected [T, K] = {list(shape)}")
        if _dtype_name(buffer.dtype) != dtype:
            raise ValueError(f"{name} has dtype {_dtype_name(buffer.dtype)}, expected {dtype}")
        if torch is not None:
            if buffer.device != logits.device:
                raise ValueError(f"{name} is on {buffer.device} but logits is on {logits.device}")
            contiguous = buffer.is_contiguous()
        elif isinstance(buffer, np.ndarray):
            contiguous = buffer.flags.c_contiguous
            if not buffer.flags.writeable:
                raise ValueError(f"{name} is read-only")
        else:
            view = _arrays.as_device_array(buffer)
            contiguous = view.is_c_contiguous()
            device_of = getattr(buffer, "device", None)
            if device_of is not None and getattr(logits, "device", None) is not None \
                    and str(device_of) != str(logits.device):
                raise ValueError(f"{name} is on {device_of} but logits is on {logits.device}")
        if not contiguous:
            raise ValueError(f"{name} must be C-contiguous")
    return tuple(out)


# --------------------------------------------------------------------------------------
# CPU kernel
# --------------------------------------------------------------------------------------

# error_model="numpy": a float division by zero gives inf instead of raising, which keeps
# the per-row loops free of branches so that LLVM vectorizes them.
_cpu_jit = njit(cache=True, error_model="numpy")
# Helpers that take arrays are inlined in Numba's IR: a real call would pay reference-count
# updates (atomics) on every array argument, per call, per row.
_cpu_inline = njit(cache=True, error_model="numpy", inline="always")


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


# exp on the host: Cody-Waite reduction by ln 2 and Cephes' degree-6 polynomial in float32,
# from plain arithmetic that vectorizes (libm's expf is a scalar call; Numba's SVML route
# needs an SVML-patched llvmlite, which PyPI's wheels are not). Within 1 ulp of the correctly
# rounded exp (9 in 10 inputs exact, checked against float64 exp on 2M inputs); 2**n is
# applied as two normal factors so that subnormal results and overflow round correctly.
_EXP_LOWEST = np.float32(-104.0)  # exp(-104) rounds to float32 zero
_EXP_HIGHEST = np.float32(89.0)  # exp(89) overflows float32 to inf
_ROUND_MAGIC = np.float32(1.5 * 2.0**23)  # x + M - M rounds a float32 to an integer
_LOG2_E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)  # ln 2 split so that n * hi is exact (9 significant bits)
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_P0, _EXP_P1, _EXP_P2, _EXP_P3, _EXP_P4, _EXP_P5 = (
    np.float32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3,
                            4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1))
_F32_EXPONENT_BIAS = 127

_INT32_LOW31 = np.int32(0x7FFFFFFF)
# Order keys: int32 that sort like the float32 choices, -0 == +0, NaN below -inf.
_NAN_KEY = np.int32((int(np.float32(-np.inf).view(np.int32)) ^ 0x7FFFFFFF) - 1)  # key(-inf) - 1
_NO_KEY = np.int32(np.iinfo(np.int32).min)  # below every key: "nothing picked yet"

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

# Candidate collection and the pick rounds work on 16 lanes at a time (one AVX-512
# register of int32 keys; two of packed int64 picks).
_LANES = 16
_PACK_LOW31 = np.int64(0x7FFFFFFF)  # packed pick = key << 32 | (_PACK_LOW31 - id), as on the device
_PACK_NONE = np.int64(np.iinfo(np.int64).min)  # below every packed pick


@_cpu_jit
def _exp(value):
    """float32 exp (see above); inf above ~88.72, 0 below ~-103.97."""
    x = value if value > _EXP_LOWEST else _EXP_LOWEST
    x = x if x < _EXP_HIGHEST else _EXP_HIGHEST
    n = (x * _LOG2_E + _ROUND_MAGIC) - _ROUND_MAGIC
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = (((((_EXP_P0 * r + _EXP_P1) * r + _EXP_P2) * r + _EXP_P3) * r + _EXP_P4) * r + _EXP_P5)
    p = (p * (r * r) + r) + _F32_ONE
    half = np.int32(n) >> 1
    rest = np.int32(n) - half
    return (p * _bits_float32(np.int32((half + _F32_EXPONENT_BIAS) << 23))
            * _bits_float32(np.int32((rest + _F32_EXPONENT_BIAS) << 23)))


@_cpu_jit
def _order_key(value):
    """int32 key of a float32: keys compare like the values, -0 == +0, NaN lowest."""
    bits = _float32_bits(value + _F32_ZERO)  # + 0 turns -0 into +0
    key = np.int32(bits ^ ((bits >> 31) & _INT32_LOW31))
    return key if value == value else _NAN_KEY


@_cpu_jit
def _key_value(key):
    """The float32 of an order key (a NaN for the NaN key)."""
    return _bits_float32(np.int32(key ^ ((key >> 31) & _INT32_LOW31)))


def _as_float32(value, table):
    """A logit as float32: float32 as is, float16 (passed as its uint16 bits) via ``table``."""


@overload(_as_float32)
def _as_float32_overload(value, table):
    if isinstance(value, types.Float):
        return lambda value, table: np.float32(value)
    return lambda value, table: table[value]


@_cpu_jit
def _clip_logit(x):
    """NaN -> -inf, then clamp to the finite float32 range (reference._scores)."""
    x = x if x >= _F32_NEG_MAX else _F32_NEG_MAX  # NaN and -inf fail the comparison
    return x if x <= _F32_MAX else _F32_MAX


@_cpu_jit
def _sqrt_softplus(x):
    """sqrt(softplus(x)) of a clipped logit in float32: max(x, 0) + log1p(exp(-|x|)) never
    overflows, so every score is finite and >= 0."""
    magnitude = x if x >= _F32_ZERO else -x
    positive = x if x > _F32_ZERO else _F32_ZERO
    return np.float32(np.sqrt(positive + np.float32(np.log1p(_exp(-magnitude)))))


@_cpu_jit
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


@_cpu_inline
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


def _is_c_array(value, dtype, ndim=1):
    return (isinstance(value, types.Array) and value.dtype == dtype and value.ndim == ndim
            and value.layout == "C")


def _splat(builder, vector, value):
    result = ir.Constant(vector, ir.Undefined)
    for lane in range(vector.count):
        result = builder.insert_element(result, value, ir.Constant(ir.IntType(32), lane))
    return result


def _llvm_function(builder, name, return_type, argument_types):
    module = builder.module
    return module.globals.get(name) or ir.Function(
        module, ir.FunctionType(return_type, argument_types), name=name)


@intrinsic
def _compress_at_least(typingctx, keys, start, cut, out, count):
    """Append to ``out[count:]`` the indices i in [start, start + 16) with keys[i] >= cut,
    in ascending order; return the new count. ``keys``: int32 keys with an int32 cut, or
    float32 logits with a float32 cut (an ordered compare: NaN never passes). Stores 16 lanes at ``out[count]``, so ``out``
    needs 16 spare slots. One vector compare, compress and store (vpcompressd into a
    register, then a plain store: its memory form is slow on Zen 4)."""
    floats = _is_c_array(keys, types.float32) and cut == types.float32
    if not ((floats or _is_c_array(keys, types.int32) and cut == types.int32)
            and _is_c_array(out, types.int32)):
        return None
    signature = types.intp(keys, types.intp, cut, out, types.intp)

    def codegen(context, builder, sig, args):
        keys_value, start_value, cut_value, out_value, count_value = args
        keys_data = context.make_array(sig.args[0])(context, builder, value=keys_value).data
        out_data = context.make_array(sig.args[3])(context, builder, value=out_value).data
        i32 = ir.IntType(32)
        vector = ir.VectorType(i32, _LANES)
        mask_type = ir.VectorType(ir.IntType(1), _LANES)
        if floats:
            values = ir.VectorType(ir.FloatType(), _LANES)
            source = builder.bitcast(builder.gep(keys_data, [start_value]), values.as_pointer())
            mask = builder.fcmp_ordered(">=", builder.load(source, align=4),
                                        _splat(builder, values, cut_value))
        else:
            source = builder.bitcast(builder.gep(keys_data, [start_value]), vector.as_pointer())
            mask = builder.icmp_signed(">=", builder.load(source, align=4),
                                       _splat(builder, vector, cut_value))
        indices = builder.add(_splat(builder, vector, builder.trunc(start_value, i32)),
                              ir.Constant(vector, list(range(_LANES))))
        compress = _llvm_function(builder, f"llvm.experimental.vector.compress.v{_LANES}i32",
                                  vector, [vector, mask_type, vector])
        packed = builder.call(compress, [indices, mask, ir.Constant(vector, ir.Undefined)])
        target = builder.bitcast(builder.gep(out_data, [count_value]), vector.as_pointer())
        builder.store(packed, target, align=4)
        mask_bits = ir.IntType(_LANES)
        popcount = _llvm_function(builder, f"llvm.ctpop.i{_LANES}", mask_bits, [mask_bits])
        passed = builder.call(popcount, [builder.bitcast(mask, mask_bits)])
        return builder.add(count_value, builder.zext(passed, count_value.type))

    return signature, codegen


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
        block = builder.select(taken, _splat(builder, vector, ir.Constant(i64, int(_PACK_NONE))),
                               block)
        builder.store(block, address, align=8)
        reduce_max = _llvm_function(builder, f"llvm.vector.reduce.smax.v{_LANES}i64", i64,
                                    [vector])
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
        block = builder.load(builder.bitcast(builder.gep(data, [start_value]),
                                             vector.as_pointer()), align=4)
        reduce_max = _reduce_smax(builder)
        best = builder.call(reduce_max, [block])
        equal = builder.icmp_signed("==", block, _splat(builder, vector, best))
        mask_bits = ir.IntType(_LANES)
        popcount = _llvm_function(builder, f"llvm.ctpop.i{_LANES}", mask_bits, [mask_bits])
        repeats = builder.call(popcount, [builder.bitcast(equal, mask_bits)])
        others = builder.select(equal, _splat(builder, vector, ir.Constant(i32, int(_NO_KEY))),
                                block)
        second = builder.select(builder.icmp_unsigned(">", repeats, ir.Constant(mask_bits, 1)),
                                best, builder.call(reduce_max, [others]))
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
    return builder.xor(bits, builder.and_(sign, _splat(builder, ints,
                                                       ir.Constant(i32, int(_INT32_LOW31)))))


def _lane_maxima_loop(builder, blocks, block_keys):
    """Emit the loop over ``blocks`` 16-lane blocks; ``block_keys(index)`` builds block
    ``index``'s int32 keys. Returns the per-lane maxima (_NO_KEY where there is no block)."""
    ints = ir.VectorType(ir.IntType(32), _LANES)
    (maxima,) = _block_loop(builder, blocks, [ir.Constant(ints, [int(_NO_KEY)] * _LANES)],
                            lambda index, carried: [_vector_smax(builder, carried[0],
                                                                 block_keys(index))])
    return maxima


def _kth_largest(builder, maxima, k):
    """The k-th largest (1 <= k <= 16, counted with repeats) of 16 int32 lanes: the largest
    lane with at least k lanes at or above it."""
    ints = maxima.type
    i32 = ints.element
    at_least = ir.Constant(ints, [0] * _LANES)
    for lane in range(_LANES):
        other = _splat(builder, ints, builder.extract_element(maxima, ir.Constant(i32, lane)))
        at_least = builder.sub(at_least, builder.sext(builder.icmp_signed(">=", other, maxima),
                                                      ints))
    if k.type.width != 32:
        k = builder.trunc(k, i32) if k.type.width > 32 else builder.sext(k, i32)
    enough = builder.icmp_signed(">=", at_least, _splat(builder, ints, k))
    no_key = _splat(builder, ints, ir.Constant(i32, int(_NO_KEY)))
    return builder.call(_reduce_smax(builder), [builder.select(enough, maxima, no_key)])


def _reduce_smax(builder):
    """LLVM's signed maximum over a 16-lane int32 vector."""
    ints = ir.VectorType(ir.IntType(32), _LANES)
    return _llvm_function(builder, f"llvm.vector.reduce.smax.v{_LANES}i32", ints.element,
                          [ints])


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
        blocks = builder.udiv(builder.extract_value(keys_array.shape, 0),
                              ir.Constant(ir.IntType(64), _LANES))
        maxima = _lane_maxima_loop(
            builder, blocks, lambda index: builder.load(builder.gep(base, [index]), align=4))
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
        blocks = builder.udiv(builder.extract_value(row_array.shape, 0),
                              ir.Constant(ir.IntType(64), _LANES))
        maxima = _lane_maxima_loop(builder, blocks, lambda index: _vector_key_map(
            builder, builder.load(builder.gep(base, [index]), align=4)))
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
    if not (_is_c_array(row, types.float32) and _is_c_array(x, types.float32)
            and _is_c_array(keys, types.int32) and _is_c_array(lanes, types.int32)):
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
        blocks = builder.udiv(builder.extract_value(row_array.shape, 0),
                              ir.Constant(ir.IntType(64), _LANES))
        lowest = _splat(builder, ints, ir.Constant(i32, int(_KEY_NEG_MAX)))
        highest = _splat(builder, ints, ir.Constant(i32, int(_KEY_POS_MAX)))

        def block_keys(index):
            value = builder.load(builder.gep(row_base, [index]), align=4)
            # + 0 turns -0 into +0; the key map is its own inverse.
            bits = builder.bitcast(builder.fadd(value, ir.Constant(floats, [0.0] * _LANES)), ints)
            key = _vector_smin(builder, _vector_smax(builder, _vector_key_map(builder, bits),
                                                     lowest), highest)
            key = builder.select(builder.fcmp_unordered("uno", value, value), lowest, key)
            builder.store(key, builder.gep(keys_base, [index]), align=4)
            builder.store(builder.bitcast(_vector_key_map(builder, key), floats),
                          builder.gep(x_base, [index]), align=4)
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
        own = builder.load(builder.bitcast(builder.gep(packed_data, [block_start]),
                                           vector.as_pointer()), align=8)
        target = builder.bitcast(builder.gep(ranks_data, [block_start]), ints.as_pointer())
        counts = builder.load(target, align=4)
        for lane in range(_LANES):
            other = builder.load(builder.gep(packed_data, [
                builder.add(against_start, ir.Constant(against_start.type, lane))]), align=8)
            below = builder.icmp_signed("<", own, _splat(builder, vector, other))
            counts = builder.add(counts, builder.zext(below, ints))
        builder.store(counts, target, align=4)
        return context.get_dummy_value()

    return signature, codegen


# Up to this many 16-candidate blocks get their places by counting (blocks**2 compares of
# 16 x 16); beyond, K pick rounds over the blocks cost less.
_COUNTED_BLOCKS = 2


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
def _top_k(keys, lanes, lanes_ready, top_k, spread, candidates, packed, top_keys, top_ids):
    """The top_k best keys into top_keys/top_ids, descending, the lower id first on ties.

    ``lanes`` holds the lane maxima of ``keys`` (_lane_maxima) when ``lanes_ready``, else
    it is scratch. With at most 16 picks and at least 16 keys the cut comes from the lane
    maxima; otherwise ``spread[0]`` carries the previous row's spread from row to row (NaN:
    none yet) to guess the cut. ``top_keys``/``top_ids`` need top_k + 1 slots (the last
    takes the unplaced candidates).
    """
    if top_k <= _LANES and keys.shape[0] >= _LANES:
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
    for j in range(count):
        index = candidates[j]
        packed[j] = (np.int64(keys[index]) << 32) | (_PACK_LOW31 - index)
    _place(packed, count, top_k, candidates, top_keys, top_ids)
    spread[0] = _key_value(top_keys[0]) - _key_value(top_keys[top_k - 1])


@_cpu_inline
def _place(packed, count, top_k, places, top_keys, top_ids):
    """The top_k largest of the ``count`` packed candidates into top_keys/top_ids,
    descending (``places``: scratch; top_keys/top_ids need top_k + 1 slots)."""
    blocks = max((count + _LANES - 1) // _LANES, 1)
    for j in range(count, blocks * _LANES):
        packed[j] = _PACK_NONE
    if blocks <= _COUNTED_BLOCKS:
        # Every candidate's place by counting the candidates above it: no pick rounds.
        for j in range(blocks * _LANES):
            places[j] = 0
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


@_cpu_inline
def _softmax_fast_row(row, top_k, rsf, candidates, packed, top_keys, top_ids, out_w, out_ids,
                      t):
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


@_cpu_inline
def _rank(keys, lanes, lanes_ready, num_groups, topk_group, two_best, top_k, group_keys, kept,
          spread, candidates, packed, top_keys, top_ids):
    """Grouped routing, then the top-k; experts of dropped groups get the lowest key.
    ``lanes``: the lane maxima of ``keys`` when ``lanes_ready``."""
    if num_groups > 1:
        lanes_ready = False  # the dropped groups change the lane maxima
        _keep_groups(keys, num_groups, topk_group, two_best, group_keys, kept, top_keys, top_ids)
        group_size = keys.shape[0] // num_groups
        for g in range(num_groups):
            if not kept[g]:
                for i in range(g * group_size, (g + 1) * group_size):
                    keys[i] = _NO_KEY
    _top_k(keys, lanes, lanes_ready, top_k, spread, candidates, packed, top_keys, top_ids)


@_cpu_inline
def _softmax_logit_row(x, keys, lanes, num_groups, topk_group, top_k, renormalize, rsf, scores,
                       lane_sums, group_keys, kept, spread, candidates, packed, top_keys,
                       top_ids, out_w, out_ids, t):
    """Softmax without bias: rank the clipped logits ``x`` by their ``keys`` (``lanes``
    their lane maxima). Returns False, writing nothing, when the row's K-th pick is more than
    SOFTMAX_EXACT_GAP below its maximum."""
    num_experts = x.shape[0]
    _rank(keys, lanes, True, num_groups, topk_group, False, top_k, group_keys, kept, spread,
          candidates, packed, top_keys, top_ids)
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


@_cpu_inline
def _exact_row(x, bias, has_bias, scoring, num_groups, topk_group, top_k, renormalize, rsf,
               scores, keys, lanes, lane_sums, group_keys, kept, spread, candidates, packed, top_keys,
               top_ids, out_w, out_ids, t):
    """Select one row from its computed scores (sigmoid, sqrt-softplus, raw logits, a bias,
    or a softmax row whose picks reach the underflow range)."""
    num_experts = x.shape[0]
    if scoring == _SIGMOID:
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
    if has_bias:
        for i in range(num_experts):
            keys[i] = _order_key(scores[i] + bias[i])
    else:
        for i in range(num_experts):
            keys[i] = _order_key(scores[i])
    _rank(keys, lanes, False, num_groups, topk_group, has_bias, top_k, group_keys, kept,
          spread, candidates, packed, top_keys, top_ids)

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


def _fast_row(logits, t, top_k, rsf, candidates, packed, top_keys, top_ids, out_w, out_ids):
    """`_softmax_fast_row` on row ``t`` of float32 logits; False (not done) otherwise."""


@overload(_fast_row, inline="always")
def _fast_row_overload(logits, t, top_k, rsf, candidates, packed, top_keys, top_ids, out_w,
                       out_ids):
    if logits.dtype == types.float32 and logits.layout == "C":
        def fast(logits, t, top_k, rsf, candidates, packed, top_keys, top_ids, out_w, out_ids):
            return _softmax_fast_row(logits[t], top_k, rsf, candidates, packed, top_keys,
                                     top_ids, out_w, out_ids, t)
        return fast

    def converted(logits, t, top_k, rsf, candidates, packed, top_keys, top_ids, out_w, out_ids):
        return False
    return converted


@_cpu_jit
def _select_rows(logits, table, bias, has_bias, scoring, num_groups, topk_group, top_k,
                 renormalize, rsf, row_start, row_stop, out_w, out_ids):
    """Rows [row_start, row_stop) of select_experts into out_w / out_ids."""
    num_experts = logits.shape[1]
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
    rank_logits = scoring == _SOFTMAX and not has_bias
    fast = renormalize and num_groups == 1 and top_k <= _LANES and num_experts >= _LANES
    for t in range(row_start, row_stop):
        if rank_logits:
            if fast and _fast_row(logits, t, top_k, rsf, candidates, packed, top_keys, top_ids,
                                  out_w, out_ids):
                continue
            _load_row(logits, t, table, x, keys, lanes)
            if _softmax_logit_row(x, keys, lanes, num_groups, topk_group, top_k, renormalize,
                                  rsf, scores, lane_sums, group_keys, kept, spread, candidates,
                                  packed, top_keys, top_ids, out_w, out_ids, t):
                continue
        else:
            for i in range(num_experts):
                x[i] = _clip_logit(_as_float32(logits[t, i], table))
        _exact_row(x, bias, has_bias, scoring, num_groups, topk_group, top_k, renormalize,
                   rsf, scores, keys, lanes, lane_sums, group_keys, kept, spread, candidates, packed,
                   top_keys, top_ids, out_w, out_ids, t)


@_cpu_jit
def _select_serial(logits, table, bias, has_bias, scoring, num_groups, topk_group, top_k,
                   renormalize, rsf, out_w, out_ids):
    _select_rows(logits, table, bias, has_bias, scoring, num_groups, topk_group, top_k,
                 renormalize, rsf, 0, logits.shape[0], out_w, out_ids)


@njit(parallel=True, cache=True, error_model="numpy")
def _select_parallel(logits, table, bias, has_bias, scoring, num_groups, topk_group, top_k,
                     renormalize, rsf, num_chunks, out_w, out_ids):
    num_tokens = logits.shape[0]
    for chunk in prange(num_chunks):
        _select_rows(logits, table, bias, has_bias, scoring, num_groups, topk_group, top_k,
                     renormalize, rsf, chunk * num_tokens // num_chunks,
                     (chunk + 1) * num_tokens // num_chunks, out_w, out_ids)


# Slots of the descriptor of the torch-team kernel (see moeroute.routing._parallel).
_TEAM_SLOTS = ("counter", "num_chunks", "num_tokens", "num_experts", "top_k", "logits", "table",
               "bias_size", "bias", "has_bias", "scoring", "num_groups", "topk_group",
               "renormalize", "rsf_bits", "out_w", "out_ids")
(_S_COUNTER, _S_CHUNKS, _S_TOKENS, _S_EXPERTS, _S_TOP_K, _S_LOGITS, _S_TABLE, _S_BIAS_SIZE,
 _S_BIAS, _S_HAS_BIAS, _S_SCORING, _S_GROUPS, _S_TOPK_GROUP, _S_RENORMALIZE, _S_RSF,
 _S_OUT_W, _S_OUT_IDS) = range(len(_TEAM_SLOTS))
_TABLE_SIZE = 1 << 16  # _HALF_TO_FLOAT / _BF16_TO_FLOAT: one float32 per 16-bit pattern


@lru_cache(maxsize=None)
def _team_kernel(logits_dtype):
    """The cfunc running `_select_rows` chunks in torch's OpenMP team, compiled (and cached
    on disk) on first use per logits dtype ("float32" or "uint16")."""
    from numba import carray, cfunc

    from moeroute.routing._parallel import claim_chunk, float32_from_bits, pointer_at

    element = numba.from_dtype(np.dtype(logits_dtype))
    slots = len(_TEAM_SLOTS)

    @cfunc(types.void(types.voidptr), cache=True, error_model="numpy")
    def run_chunks(descriptor):
        d = carray(descriptor, (slots,), np.int64)
        num_tokens, top_k = d[_S_TOKENS], d[_S_TOP_K]
        logits = carray(pointer_at(d[_S_LOGITS], element), (num_tokens, d[_S_EXPERTS]))
        table = carray(pointer_at(d[_S_TABLE], float32), (_TABLE_SIZE,))
        bias = carray(pointer_at(d[_S_BIAS], float32), (d[_S_BIAS_SIZE],))
        out_w = carray(pointer_at(d[_S_OUT_W], float32), (num_tokens, top_k))
        out_ids = carray(pointer_at(d[_S_OUT_IDS], int32), (num_tokens, top_k))
        num_chunks = d[_S_CHUNKS]
        chunk = claim_chunk(descriptor)
        while chunk < num_chunks:
            _select_rows(logits, table, bias, d[_S_HAS_BIAS] != 0, d[_S_SCORING],
                         d[_S_GROUPS], d[_S_TOPK_GROUP], top_k, d[_S_RENORMALIZE] != 0,
                         float32_from_bits(d[_S_RSF]), chunk * num_tokens // num_chunks,
                         (chunk + 1) * num_tokens // num_chunks, out_w, out_ids)
            chunk = claim_chunk(descriptor)

    return run_chunks


def _select_team(args, num_chunks, threads, out_w, out_ids):
    """`_select_parallel(*args, ...)` on torch's OpenMP team (the arrays stay alive until it
    returns)."""
    (logits, table, bias, has_bias, scoring, num_groups, topk_group, top_k, renormalize,
     rsf) = args
    descriptor = np.zeros(len(_TEAM_SLOTS), np.int64)
    descriptor[_S_CHUNKS] = num_chunks
    descriptor[_S_TOKENS], descriptor[_S_EXPERTS] = logits.shape
    descriptor[_S_TOP_K] = top_k
    descriptor[_S_LOGITS] = logits.ctypes.data
    descriptor[_S_TABLE] = table.ctypes.data
    descriptor[_S_BIAS_SIZE] = bias.shape[0]
    descriptor[_S_BIAS] = bias.ctypes.data
    descriptor[_S_HAS_BIAS] = has_bias
    descriptor[_S_SCORING] = scoring
    descriptor[_S_GROUPS] = num_groups
    descriptor[_S_TOPK_GROUP] = topk_group
    descriptor[_S_RENORMALIZE] = renormalize
    descriptor[_S_RSF] = np.float32(rsf).view(np.int32)
    descriptor[_S_OUT_W] = out_w.ctypes.data
    descriptor[_S_OUT_IDS] = out_ids.ctypes.data
    _parallel.run_team(_team_kernel(logits.dtype.name), descriptor, threads)


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
    has_bias = correction_bias is not None
    bias = np.ascontiguousarray(correction_bias) if has_bias else _EMPTY_BIAS
    args = (logits, table, bias, has_bias, _SCORING_CODES[config.scoring],
            config.num_expert_group, config.topk_group, top_k, config.renormalize,
            np.float32(config.routed_scaling_factor))
    threads = _parallel.cpu_threads()
    if threads > 1 and num_tokens > 1 and num_tokens * config.num_experts >= PARALLEL_MIN_ELEMENTS:
        chunks = max(threads, -(-num_tokens // PARALLEL_CHUNK_ROWS))
        if _parallel.torch_team():
            _select_team(args, chunks, threads, out_w, out_ids)
            return out_w, out_ids
        # One chunk per scheduling step: chunks go to whichever thread is free, so a thread
        # stalled by other load on the machine leaves its share to the others. (Set here:
        # setting it inside the jitted function would keep Numba from caching it.)
        previous = numba.set_parallel_chunksize(1)
        try:
            _select_parallel(*args, chunks, out_w, out_ids)
        finally:
            numba.set_parallel_chunksize(previous)
    else:
        _select_serial(*args, out_w, out_ids)
    return out_w, out_ids


# --------------------------------------------------------------------------------------
# CUDA kernel
# --------------------------------------------------------------------------------------

# The kernel lives in _select_device.py (shared with the fused route kernel).
DEVICE_WARPS_PER_BLOCK = 4  # rows (warps) per block; _select_device.DEVICE_WARPS_PER_BLOCK


def _device_kernel_function(num_experts, num_groups, scoring, has_bias, renormalize, input_kind):
    """The CUDA kernel as a Python function specialised to these compile-time constants
    (`moeroute.routing._select_device.select_kernel_function`)."""
    from moeroute.routing import _select_device

    return _select_device.select_kernel_function(num_experts, num_groups, scoring, has_bias,
                                                 renormalize, input_kind)


def _device_signature(input_kind):
    """The numba signature of the kernel for ``input_kind`` logits (compile_ptx checks)."""
    from moeroute.routing import _select_device

    return _select_device.select_signature(input_kind)


@lru_cache(maxsize=None)
def _device_kernel(num_experts, num_groups, scoring, has_bias, renormalize, input_kind):
    """The compiled kernel (a numba.cuda dispatcher), built once per specialisation."""
    return cuda.jit(_device_kernel_function(num_experts, num_groups, scoring, has_bias,
                                            renormalize, input_kind))


def _device_logits(logits):
    """(numba device array, input kind): bfloat16 is passed as its int16 bits."""
    kind = _dtype_name(logits.dtype)
    if kind == "bfloat16":
        logits = _arrays.device_bits16(logits)
    array = _arrays.as_device_array(logits)
    return array, kind


def _select_device(logits, config, correction_bias, stream, out=None):
    array, kind = _device_logits(logits)
    if not array.is_c_contiguous():
        raise ValueError(f"device logits must be C-contiguous, got strides {array.strides}")
    num_tokens = array.shape[0]
    top_k = config.top_k
    launch_stream = _arrays.resolve_stream(logits, stream)
    if out is None:
        topk_weights, out_w = _arrays.device_empty((num_tokens, top_k), np.float32, logits,
                                                   launch_stream)
        topk_ids, out_ids = _arrays.device_empty((num_tokens, top_k), np.int32, logits,
                                                 launch_stream)
    else:
        topk_weights, topk_ids = out
        out_w, out_ids = (_arrays.as_device_array(o) for o in out)
    if num_tokens > 0:
        has_bias = correction_bias is not None
        # Without a bias the kernel never reads it: any float32 vector fills the slot.
        bias = _arrays.as_device_array(correction_bias) if has_bias else out_w.reshape(-1)
        kernel = _device_kernel(config.num_experts, config.num_expert_group,
                                config.scoring, has_bias, config.renormalize, kind)
        warps = _device_warps_per_block()
        blocks = -(-num_tokens // warps)
        kernel[blocks, warps * WARP_SIZE, launch_stream](
            array, bias, num_tokens, top_k, config.topk_group,
            np.float32(config.routed_scaling_factor), out_w, out_ids)
    return topk_weights, topk_ids


def _device_warps_per_block():
    from moeroute.routing import _warp

    return _warp.warps_per_block(DEVICE_WARPS_PER_BLOCK)
