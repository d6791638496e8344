"""select_experts on device inputs: outputs from the caller's allocator, the kernel built
once per specialisation (its code: `_cuda.py`) and launched on the caller's stream."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from numba import cuda

from moeroute.routing import _launcher
from moeroute.routing.select import _cuda
from moeroute.routing.select._common import WARP_SIZE


# The kernels are built in _cuda.py (select_experts' and the fused route's share a row routine).
DEVICE_WARPS_PER_BLOCK = _cuda.DEVICE_WARPS_PER_BLOCK


def _device_kernel_function(num_experts, num_groups, scoring, has_bias, renormalize, input_kind):
    """The CUDA kernel as a Python function specialised to these compile-time constants
    (`moeroute.routing.select._cuda.select_kernel_function`)."""
    return _cuda.select_kernel_function(num_experts, num_groups, scoring, has_bias, renormalize, input_kind)


@lru_cache(maxsize=None)
def _device_signature(input_kind, bias_layout="C"):
    """The numba signature of the kernel for ``input_kind`` logits (the cached launcher's
    layout, compile_ptx checks); one tuple object per argument (the launcher's key)."""
    return _cuda.select_signature(input_kind, bias_layout)


@lru_cache(maxsize=None)
def _device_kernel(num_experts, num_groups, scoring, has_bias, renormalize, input_kind):
    """The compiled kernel (a numba.cuda dispatcher), built once per specialisation."""
    return cuda.jit(_device_kernel_function(num_experts, num_groups, scoring, has_bias, renormalize, input_kind))


def _select_device(entry, config, bias, stream, out=None):
    """select_experts on device logits, from their boundary ``entry`` (and ``bias``'s, or
    None): outputs from the logits' framework, the launch on its stream."""
    launcher = _launcher.active_launcher()
    array, kind = entry.kernel(launcher, bits16=True), entry.dtype  # bfloat16 as int16 bits
    if not entry.contiguous():
        strides = (
            tuple(s * array.element_size() for s in array.stride())  # torch, in bytes
            if callable(getattr(array, "stride", None))
            else tuple(array.strides)
        )
        raise ValueError(f"device logits must be C-contiguous, got strides {strides}")
    num_tokens = array.shape[0]
    top_k = config.top_k
    # The cached launcher takes the raw handle: no numba stream object per call.
    launch_stream = entry.stream(stream, launcher)
    if out is None:
        view = launcher == "numba"
        topk_weights, out_w = entry.empty((num_tokens, top_k), np.float32, launch_stream, view=view)
        topk_ids, out_ids = entry.empty((num_tokens, top_k), np.int32, launch_stream, view=view)
    else:
        topk_weights, topk_ids = out
        out_w, out_ids = (_launcher.kernel_array(o, launcher) for o in out)
    if num_tokens > 0:
        has_bias = bias is not None
        # Without a bias the kernel never reads it: any float32 vector fills the slot.
        bias_array = bias.kernel(launcher) if has_bias else out_w.reshape(-1)
        kernel = _device_kernel(
            config.num_experts, config.num_expert_group, config.scoring, has_bias, config.renormalize, kind
        )
        warps = _device_warps_per_block()
        blocks = -(-num_tokens // warps)
        bias_layout = "C" if not has_bias or bias.contiguous() else "A"
        _launcher.launch(
            kernel,
            _device_signature(kind, bias_layout),
            blocks,
            warps * WARP_SIZE,
            launch_stream,
            (
                array,
                bias_array,
                num_tokens,
                top_k,
                config.topk_group,
                np.float32(config.routed_scaling_factor),
                out_w,
                out_ids,
            ),
            launcher,
        )
    return topk_weights, topk_ids


def _device_warps_per_block():
    return _cuda.warps_per_block()
