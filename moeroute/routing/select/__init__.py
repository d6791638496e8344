"""select_experts: top-k expert selection for every token (docs/semantics.md section 1).

Two kernels compute the same thing, one module each in this package:

* ``_host``: the CPU kernel (Numba ``njit``, ``prange`` over token rows) for NumPy inputs,
  with its vector steps written as LLVM IR in ``_simd``;
* ``_cuda``: the CUDA kernels (``numba.cuda``, one warp per token row), shared with ``route``;
* ``_device``: select_experts on device inputs (allocation, kernel cache, launch).

This module holds the public function and its validation; ``_common`` the constants and
order keys both kernels share.

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

import numpy as np

from moeroute.config import RouterConfig
from moeroute.routing import _arrays
from moeroute.routing.select._common import (  # noqa: F401 (re-exported)
    SOFTMAX_EXACT_GAP,
    WARP_SIZE,
    _dtype_name,
)
from moeroute.routing.select._device import (  # noqa: F401 (re-exported)
    DEVICE_WARPS_PER_BLOCK,
    _device_kernel,
    _device_kernel_function,
    _device_signature,
    _device_warps_per_block,
    _select_device,
)
from moeroute.routing.select._host import (  # noqa: F401 (re-exported)
    _BF16_TO_FLOAT,
    _EMPTY_BIAS,
    _HALF_TO_FLOAT,
    PARALLEL_CHUNK_ROWS,
    PARALLEL_MIN_ELEMENTS,
    _lane_order_sum,
    _select_host,
    _select_parallel,
    _select_rows,
)

__all__ = [
    "select_experts",
    "MAX_DEVICE_EXPERTS",
    "MAX_DEVICE_TOP_K",
    "MAX_DEVICE_GROUPS",
    "SOFTMAX_EXACT_GAP",
]

# Device limits: every lane keeps ceil(N / 32) scores in registers, lane r keeps pick r,
# and the kept-group set is a 32-bit mask.
MAX_DEVICE_EXPERTS = 1024  # 32 values per lane: more would spill registers to local memory
MAX_DEVICE_TOP_K = WARP_SIZE  # lane r holds the r-th pick until the final coalesced store
MAX_DEVICE_GROUPS = 32  # the kept groups form a 32-bit mask

_SUPPORTED_HOST_DTYPES = ("float32", "float16", "bfloat16")
_SUPPORTED_DEVICE_DTYPES = ("float32", "float16", "bfloat16")


# --------------------------------------------------------------------------------------
# Validation (one place, at the boundary)
# --------------------------------------------------------------------------------------


def _validate(logits, config, correction_bias, on_device: bool, dtype_name=None, bias_on_device=None) -> None:
    """Raise TypeError/ValueError naming the bad argument; return None when all is well.

    ``dtype_name`` overrides the dtype of host ``logits`` passed as raw bits (bfloat16);
    ``bias_on_device``: where ``correction_bias`` lives, when its boundary already knows.
    """
    if not isinstance(config, RouterConfig):
        raise TypeError(f"config must be a moeroute RouterConfig, got {type(config).__name__}")
    if not on_device and not isinstance(logits, np.ndarray):
        raise TypeError(f"logits must be a NumPy array or a CUDA device array, got {type(logits).__name__}")
    shape = tuple(logits.shape)
    if len(shape) != 2:
        raise ValueError(f"logits must be 2-D [num_tokens, num_experts], got shape {shape}")
    num_experts = config.num_experts
    if shape[1] != num_experts:
        raise ValueError(f"logits.shape[1]={shape[1]} does not match config.num_experts={num_experts}")
    allowed = _SUPPORTED_DEVICE_DTYPES if on_device else _SUPPORTED_HOST_DTYPES
    name = dtype_name or _dtype_name(logits.dtype)
    if name not in allowed:
        where = "device" if on_device else "host"
        raise ValueError(f"logits dtype {name} is not supported on the {where}; use one of {allowed}")
    if correction_bias is not None:
        if bias_on_device is None:
            bias_on_device = _arrays.is_device_array(correction_bias)
        if bias_on_device != on_device:
            raise TypeError(
                "correction_bias must live where logits live: "
                f"logits is a {'device' if on_device else 'host'} array, "
                f"correction_bias is a {type(correction_bias).__name__}"
            )
        if not on_device and not isinstance(correction_bias, np.ndarray):
            raise TypeError(f"correction_bias must be a NumPy array, got {type(correction_bias).__name__}")
        bias_shape = tuple(correction_bias.shape)
        if bias_shape != (num_experts,):
            raise ValueError(f"correction_bias shape {bias_shape} must be ({num_experts},) = [num_experts]")
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
            raise ValueError(f"num_experts={num_experts} exceeds the device kernel limit {MAX_DEVICE_EXPERTS}")
        if config.top_k > MAX_DEVICE_TOP_K:
            raise ValueError(f"top_k={config.top_k} exceeds the device kernel limit {MAX_DEVICE_TOP_K}")
        if config.num_expert_group > MAX_DEVICE_GROUPS:
            raise ValueError(
                f"num_expert_group={config.num_expert_group} exceeds the device kernel limit {MAX_DEVICE_GROUPS}"
            )


# --------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------


def select_experts(logits, config, correction_bias=None, *, stream=None, out=None):
    """Pick each token's top-k routed experts and their weights (docs/semantics.md section 1).

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
        int32 arrays of the framework and device of ``logits``, sharing no memory with
        each other or with ``logits`` and ``correction_bias``.

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
        device, not C-contiguous, or sharing memory with each other, ``logits`` or
        ``correction_bias`` (no alias is allowed), or a configuration past the device kernel's
        limits: N <= 1024, K <= 32, num_expert_group <= 32 (``MAX_DEVICE_*``).
        The CPU kernel has no limits beyond RouterConfig's own.

    Notes
    -----
    Any row, NaN and infinite logits included, yields K distinct ids and finite
    weights; T = 0 returns empty [0, K] outputs without launching anything.
    """
    entry = _arrays.enter(logits, "logits")
    bias = None if correction_bias is None else _arrays.enter(correction_bias, "correction_bias")
    if entry.on_device:
        _validate(logits, config, correction_bias, True, bias_on_device=None if bias is None else bias.on_device)
        outputs = _check_out(out, entry, config.top_k, True, correction_bias)
        return _select_device(entry, config, bias, stream, outputs)
    weights, ids, outputs = _select_host_entry(entry, config, bias, out)
    if outputs is not None:
        return outputs
    return entry.wrap(weights), entry.wrap(ids)


def _select_host_entry(entry, config, bias, out=None):
    """select_experts on host logits, from their boundaries (``bias``: None when absent):
    ``(topk_weights, topk_ids, outputs)``, NumPy arrays (the ``out=`` buffers' views when
    ``outputs``, the validated caller buffers, is not None)."""
    # CPU torch tensors (and bfloat16 ones as their raw bits) run the CPU kernel in place.
    logits = _host_input(entry)
    correction_bias = None if bias is None else bias.array
    if bias is not None and not bias.on_device:
        if bias.bfloat16:  # its raw bits would read as uint16
            raise ValueError("correction_bias dtype bfloat16 must be float32")
        correction_bias = _host_input(bias)
    _validate(
        logits,
        config,
        correction_bias,
        False,
        dtype_name="bfloat16" if entry.bfloat16 else None,
        bias_on_device=None if bias is None else bias.on_device,
    )
    outputs = _check_out(out, entry, config.top_k, False, correction_bias)
    host_out = None if outputs is None else tuple(_arrays.host_array(o) for o in outputs)
    weights, ids = _select_host(logits, config, correction_bias, entry.bfloat16, host_out)
    return weights, ids, outputs


def _host_input(entry):
    """A NumPy view of a host input, from its boundary (CPU torch tensors without a copy)."""
    name, array = entry.name, entry.array
    if entry.torch is not None and not array.is_cpu:
        # A meta (or other non-CUDA) tensor holds no values the kernels could read.
        raise ValueError(
            f"{name} is on {array.device}; select_experts takes a CPU tensor, a CUDA "
            "tensor, a NumPy array or a CUDA device array"
        )
    if entry.framework in ("numpy", "torch"):
        return entry.host()
    raise TypeError(f"{name} must be a NumPy array, a torch tensor or a CUDA device array, got {type(array).__name__}")


def _check_out(out, entry, top_k, on_device, correction_bias=None):
    """Validated caller buffers ``(topk_weights, topk_ids)`` for ``out=``, or None.

    Each must be C-contiguous, of shape [T, K], float32 / int32, from the framework of
    the logits (``entry``: their boundary) and on their device, and share no memory with
    the other buffer, the logits or ``correction_bias``; TypeError / ValueError naming the
    buffer otherwise.
    """
    if out is None:
        return None
    logits = entry.array
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise TypeError(f"out must be a (topk_weights, topk_ids) pair, got {type(out).__name__}")
    shape = (int(logits.shape[0]), int(top_k))
    torch = entry.torch
    for name, buffer, dtype in (("out[0] (topk_weights)", out[0], "float32"), ("out[1] (topk_ids)", out[1], "int32")):
        if _arrays.is_device_array(buffer) != on_device:
            where = "a device array" if on_device else "a host array"
            raise TypeError(f"{name} must be {where} like logits, got {type(buffer).__name__}")
        if on_device and _arrays.framework_of(buffer) != entry.framework:
            raise TypeError(
                f"{name} is a {_arrays.framework_of(buffer)} array but logits is a "
                f"{entry.framework} one; pass buffers of the same framework"
            )
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
            if (
                device_of is not None
                and getattr(logits, "device", None) is not None
                and str(device_of) != str(logits.device)
            ):
                raise ValueError(f"{name} is on {device_of} but logits is on {logits.device}")
        if not contiguous:
            raise ValueError(f"{name} must be C-contiguous")
    _arrays.check_no_overlap(
        {"out[0] (topk_weights)": out[0], "out[1] (topk_ids)": out[1]},
        {"logits": logits, "correction_bias": correction_bias},
    )
    return tuple(out)
