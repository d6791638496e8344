"""Warp primitives for the numba.cuda kernels, with exact versions for the CUDA simulator.

On a device the helpers are the hardware's warp intrinsics (``shfl_xor_sync``,
``shfl_sync``, ``shfl_down_sync``, ``shfl_up_sync``, ``syncwarp``, ``ballot_sync``) and
libdevice bit casts. Under ``NUMBA_ENABLE_CUDASIM=1`` the simulator has no warp
intrinsics; this module gives it versions with the same semantics for the full mask: the
32 lanes of each warp (or the lanes of a partial last warp) meet at a barrier of their own,
publish their values and read their partner's. Each warp is independent of the others, so
they are exact for blocks of any number of warps, and warp-divergent control flow between
warps is allowed (as on the device); lanes of one warp that do not all arrive raise an
error after `SIM_BARRIER_TIMEOUT_S` instead of hanging.

Kernels launch ``warps_per_block(preferred)`` warps per block: ``preferred`` on a device;
under the simulator ``MOEROUTE_SIM_WARPS`` of them (default 1, at most ``preferred``), so
``MOEROUTE_SIM_WARPS=4`` runs the device's launch configuration. Every simulated thread is
a Python thread, which is why one warp is the default.

Both paths define the same helpers with the same signatures, so kernel code is the same
on a device and under the simulator.

Which path is taken is fixed when this module is imported (the simulator cannot be
switched on or off later in a process).
"""

from __future__ import annotations

import math
import threading

import numpy as np
from numba import cuda

from moeroute._validate import environ_int
from moeroute.routing._arrays import simulator_enabled

__all__ = [
    "WARP_SIZE",
    "FULL_MASK",
    "SIMULATED",
    "SIM_WARPS",
    "warps_per_block",
    "shfl_xor",
    "shfl_idx",
    "shfl_down",
    "shfl_up",
    "syncwarp",
    "ballot",
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
#: Environment variable: warps per block under the simulator.
SIM_WARPS_VARIABLE = "MOEROUTE_SIM_WARPS"
#: Seconds the simulator waits for all lanes of a warp at a collective before it reports
#: divergence (a simulated lane takes milliseconds per step, never this long).
SIM_BARRIER_TIMEOUT_S = 120.0

SIMULATED = simulator_enabled()


def _sim_warps_from_environment() -> int:
    return environ_int(SIM_WARPS_VARIABLE, 1, 1, "warps per block under the CUDA simulator")


SIM_WARPS = _sim_warps_from_environment() if SIMULATED else 1


def warps_per_block(preferred: int) -> int:
    """``preferred`` on a device; ``min(preferred, MOEROUTE_SIM_WARPS)`` under the simulator."""
    return min(preferred, SIM_WARPS) if SIMULATED else preferred


if not SIMULATED:

    @cuda.jit(device=True, inline="always")
    def shfl_xor(value, lane_mask):
        """The ``value`` of lane ``lane ^ lane_mask`` (int32/int64/float32/float64)."""
        return cuda.shfl_xor_sync(FULL_MASK, value, lane_mask)

    @cuda.jit(device=True, inline="always")
    def shfl_idx(value, src_lane):
        """The ``value`` of lane ``src_lane``."""
        return cuda.shfl_sync(FULL_MASK, value, src_lane)

    @cuda.jit(device=True, inline="always")
    def shfl_down(value, delta):
        """The ``value`` of lane ``lane + delta``; a lane's own value past the warp."""
        return cuda.shfl_down_sync(FULL_MASK, value, delta)

    @cuda.jit(device=True, inline="always")
    def shfl_up(value, delta):
        """The ``value`` of lane ``lane - delta``; a lane's own value below lane 0."""
        return cuda.shfl_up_sync(FULL_MASK, value, delta)

    @cuda.jit(device=True, inline="always")
    def syncwarp():
        """The lanes of the warp wait for each other (memory ordering among them)."""
        cuda.syncwarp(FULL_MASK)

    @cuda.jit(device=True, inline="always")
    def ballot(predicate):
        """uint32 with bit l set when lane l's ``predicate`` holds."""
        return cuda.ballot_sync(FULL_MASK, predicate)

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

    class _WarpExchange:
        """The meeting point of one simulated warp: a barrier of its lanes and a slot each."""

        def __init__(self, lanes):
            self.barrier = threading.Barrier(lanes, timeout=SIM_BARRIER_TIMEOUT_S)
            self.values = [None] * WARP_SIZE

        def exchange(self, lane, value):
            """Every lane's ``value``, once all lanes have published theirs."""
            try:
                self.values[lane] = value
                self.barrier.wait()
                values = list(self.values)
                self.barrier.wait()  # nobody overwrites a slot before all have read
            except threading.BrokenBarrierError:
                raise RuntimeError(
                    "simulated warp collective: not every lane of the warp arrived (divergent "
                    "lanes or an early return before a full-mask shuffle)"
                ) from None
            return values

    _exchanges: dict = {}
    _exchanges_lock = threading.Lock()

    def _warp_exchange(block, warp, lanes):
        key = (block, warp, lanes)
        with _exchanges_lock:
            found = _exchanges.get(key)
            if found is None or found.barrier.broken:
                found = _exchanges[key] = _WarpExchange(lanes)
        return found

    def _my_warp():
        """(exchange, lane) of the calling simulated thread."""
        dim, idx, block = cuda.blockDim, cuda.threadIdx, cuda.blockIdx
        threads = dim.x * dim.y * dim.z
        tid = idx.x + dim.x * (idx.y + dim.y * idx.z)
        warp, lane = divmod(tid, WARP_SIZE)
        lanes = min(WARP_SIZE, threads - warp * WARP_SIZE)
        return _warp_exchange((block.x, block.y, block.z, threads), warp, lanes), lane

    def _all_lanes(value):
        exchange, lane = _my_warp()
        return exchange.exchange(lane, value), lane

    @cuda.jit(device=True)
    def shfl_xor(value, lane_mask):
        """Simulator ``shfl_xor_sync`` (full mask): the value of lane ``lane ^ lane_mask``."""
        values, lane = _all_lanes(value)
        partner = lane ^ lane_mask
        return values[partner] if partner < len(values) and values[partner] is not None else value

    @cuda.jit(device=True)
    def shfl_idx(value, src_lane):
        """Simulator ``shfl_sync`` (full mask): the value of lane ``src_lane`` (mod 32)."""
        values, _ = _all_lanes(value)
        source = values[src_lane % WARP_SIZE]
        return value if source is None else source

    @cuda.jit(device=True)
    def shfl_down(value, delta):
        """Simulator ``shfl_down_sync``: lane + delta's value, own value past the warp."""
        values, lane = _all_lanes(value)
        source = lane + delta
        return values[source] if source < WARP_SIZE and values[source] is not None else value

    @cuda.jit(device=True)
    def shfl_up(value, delta):
        """Simulator ``shfl_up_sync``: lane - delta's value, own value below lane 0."""
        values, lane = _all_lanes(value)
        source = lane - delta
        return values[source] if source >= 0 else value

    @cuda.jit(device=True)
    def syncwarp():
        """Simulator ``syncwarp`` (full mask): the lanes of this warp wait for each other."""
        _all_lanes(0)

    @cuda.jit(device=True)
    def ballot(predicate):
        """Simulator ``ballot_sync`` (full mask): bit l set when lane l's predicate holds."""
        values, _ = _all_lanes(bool(predicate))
        bits = 0
        for lane, vote in enumerate(values):
            if vote:
                bits |= 1 << lane
        return np.uint32(bits)

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
def allreduce_max(value):
    """Maximum of ``value`` over the warp, returned to every lane (butterfly)."""
    offset = WARP_SIZE // 2
    for _ in range(_BUTTERFLY_STEPS):
        other = shfl_xor(value, offset)
        value = max(value, other)
        offset //= 2
    return value


@cuda.jit(device=True, inline="always")
def allreduce_sum(value):
    """Sum of ``value`` over the warp, returned to every lane.

    Butterfly order (xor 16, 8, 4, 2, 1, each lane adding its partner to its own value):
    every lane ends with the same bits, and the host reproduces them
    (``select._host._lane_order_sum``).
    """
    offset = WARP_SIZE // 2
    for _ in range(_BUTTERFLY_STEPS):
        value = value + shfl_xor(value, offset)
        offset //= 2
    return value
