"""Warp primitives for the numba.cuda kernels, with a fallback for the CUDA simulator.

On a device the helpers are the hardware's warp shuffles (``shfl_xor_sync``,
``shfl_sync``) and libdevice bit casts. Under ``NUMBA_ENABLE_CUDASIM=1`` the simulator
has no warp intrinsics, so the same helpers exchange values through a shared-memory
scratch array and ``syncthreads``; that is only correct when a block is one warp, so
kernels launch one warp per block under the simulator (``warps_per_block``).

Every helper takes the scratch array, so kernel code is the same on both paths: kernels
allocate it with ``scratch_size(threads)`` elements, which is 1 on a device (unused) and
one slot per thread under the simulator.

Which path is taken is fixed when this module is imported (the simulator cannot be
switched on or off later in a process).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from moeroute.routing._arrays import simulator_enabled

__all__ = [
    "WARP_SIZE",
    "FULL_MASK",
    "SIMULATED",
    "scratch_size",
    "warps_per_block",
    "shfl_xor",
    "shfl_idx",
    "allreduce_max",
    "allreduce_sum",
    "float_as_int",
    "int_as_float",
    "expf",
]

WARP_SIZE = 32  # NVIDIA warp width; numba.cuda targets NVIDIA only
FULL_MASK = 0xFFFFFFFF  # every lane of the warp takes part in each shuffle
# Butterfly offsets of a full-warp reduction: 16, 8, 4, 2, 1.
_BUTTERFLY_STEPS = 5

SIMULATED = simulator_enabled()


def scratch_size(threads_per_block: int) -> int:
    """Elements of the per-block scratch array the helpers need."""
    return threads_per_block if SIMULATED else 1


def warps_per_block(preferred: int) -> int:
    """``preferred`` on a device; 1 under the simulator, whose fallback synchronizes the
    whole block and so needs block-uniform control flow."""
    return 1 if SIMULATED else preferred


if not SIMULATED:

    @cuda.jit(device=True, inline="always")
    def shfl_xor(value, lane_mask, scratch):
        """The ``value`` of lane ``lane ^ lane_mask`` (int32/int64/float32/float64)."""
        return cuda.shfl_xor_sync(FULL_MASK, value, lane_mask)

    @cuda.jit(device=True, inline="always")
    def shfl_idx(value, src_lane, scratch):
        """The ``value`` of lane ``src_lane``."""
        return cuda.shfl_sync(FULL_MASK, value, src_lane)

    @cuda.jit(device=True, inline="always")
    def float_as_int(value):
        """The bits of a float32 as an int32."""
        return cuda.libdevice.float_as_int(value)

    @cuda.jit(device=True, inline="always")
    def int_as_float(bits):
        """The float32 whose bits are the int32 ``bits``."""
        return cuda.libdevice.int_as_float(bits)

    @cuda.jit(device=True, inline="always")
    def expf(value):
        """float32 exp (libdevice ``expf``): inf on overflow, 0 on underflow."""
        return math.exp(value)

else:

    @cuda.jit(device=True)
    def shfl_xor(value, lane_mask, scratch):
        """Simulator fallback of ``shfl_xor_sync`` through shared memory (one warp per block)."""
        tid = cuda.threadIdx.x
        scratch[tid] = value
        cuda.syncthreads()
        lane = tid % WARP_SIZE
        out = scratch[tid - lane + (lane ^ lane_mask)]
        cuda.syncthreads()
        return out

    @cuda.jit(device=True)
    def shfl_idx(value, src_lane, scratch):
        """Simulator fallback of ``shfl_sync`` through shared memory (one warp per block)."""
        tid = cuda.threadIdx.x
        scratch[tid] = value
        cuda.syncthreads()
        out = scratch[tid - tid % WARP_SIZE + src_lane]
        cuda.syncthreads()
        return out

    @cuda.jit(device=True)
    def float_as_int(value):
        return np.float32(value).view(np.int32)

    @cuda.jit(device=True)
    def int_as_float(bits):
        return np.int32(bits).view(np.float32)

    @cuda.jit(device=True)
    def expf(value):
        # Python's math.exp raises on overflow where the device returns inf.
        with np.errstate(over="ignore", under="ignore"):
            return np.float32(np.exp(np.float64(value)))


@cuda.jit(device=True, inline="always")
def allreduce_max(value, scratch):
    """Maximum of ``value`` over the warp, returned to every lane (butterfly)."""
    offset = WARP_SIZE // 2
    for _ in range(_BUTTERFLY_STEPS):
        other = shfl_xor(value, offset, scratch)
        value = max(value, other)
        offset //= 2
    return value


@cuda.jit(device=True, inline="always")
def allreduce_sum(value, scratch):
    """Sum of ``value`` over the warp, returned to every lane.

    Butterfly order (xor 16, 8, 4, 2, 1, each lane adding its partner to its own value):
    every lane ends with the same bits, and the host reproduces them
    (``select._lane_order_sum``).
    """
    offset = WARP_SIZE // 2
    for _ in range(_BUTTERFLY_STEPS):
        value = value + shfl_xor(value, offset, scratch)
        offset //= 2
    return value
