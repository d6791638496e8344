"""The simulator's warp intrinsics against NumPy, in blocks of several warps.

Run by tests/routing/test_warp.py in a subprocess with NUMBA_ENABLE_CUDASIM=1 and
MOEROUTE_SIM_WARPS=4 (both must be set before numba and moeroute are imported).
"""

import numpy as np
import pytest

from moeroute.routing._arrays import simulator_enabled

if not simulator_enabled():
    pytest.skip("needs NUMBA_ENABLE_CUDASIM=1 before numba is imported", allow_module_level=True)

from numba import cuda  # noqa: E402

from moeroute.routing import _warp  # noqa: E402

W = _warp.WARP_SIZE
#: Operations per lane written by the kernel below.
OPS = ("xor3", "idx5", "down2", "up7", "ballot", "max", "sum")


@cuda.jit
def _warp_ops_kernel(values, out):
    tid = cuda.threadIdx.x
    i = cuda.blockIdx.x * cuda.blockDim.x + tid
    value = values[i]
    out[i, 0] = _warp.shfl_xor(value, 3)
    out[i, 1] = _warp.shfl_idx(value, 5)
    out[i, 2] = _warp.shfl_down(value, 2)
    out[i, 3] = _warp.shfl_up(value, 7)
    out[i, 4] = _warp.ballot(value % 3 == 0)
    _warp.syncwarp()
    out[i, 5] = _warp.allreduce_max(value)
    out[i, 6] = _warp.allreduce_sum(value)


def _reference(values):
    warps = values.reshape(-1, W)
    lane = np.arange(W)
    out = np.empty((values.size, len(OPS)), np.int64)
    for w, v in enumerate(warps):
        rows = slice(w * W, (w + 1) * W)
        out[rows, 0] = v[lane ^ 3]
        out[rows, 1] = v[5]
        out[rows, 2] = np.where(lane + 2 < W, v[np.minimum(lane + 2, W - 1)], v)
        out[rows, 3] = np.where(lane >= 7, v[np.maximum(lane - 7, 0)], v)
        out[rows, 4] = int(sum(1 << int(l) for l in lane if v[l] % 3 == 0))
        out[rows, 5] = v.max()
        out[rows, 6] = v.sum()
    return out


def test_the_launch_configuration_is_the_devices():
    assert _warp.SIM_WARPS == 4 and _warp.warps_per_block(4) == 4 and _warp.warps_per_block(2) == 2


def test_warp_intrinsics_are_exact_in_blocks_of_four_warps():
    rng = np.random.default_rng(0)
    blocks, threads = 2, 4 * W
    values = rng.integers(-1000, 1000, blocks * threads).astype(np.int64)
    out = cuda.device_array((values.size, len(OPS)), np.int64)
    _warp_ops_kernel[blocks, threads](cuda.to_device(values), out)
    got = out.copy_to_host()
    want = _reference(values)
    for column, name in enumerate(OPS):
        np.testing.assert_array_equal(got[:, column], want[:, column], err_msg=name)


@cuda.jit
def _divergent_warps_kernel(values, out):
    """Warp w runs w + 1 rounds of shuffles while the other warps do something else: legal on
    the device (each warp is its own SIMT unit), a deadlock for a block-wide fallback."""
    tid = cuda.threadIdx.x
    warp = tid // W
    value = values[tid]
    for _ in range(warp + 1):
        value = _warp.allreduce_sum(value)
    out[tid] = value


def test_warps_of_one_block_may_diverge_from_each_other():
    values = np.arange(4 * W, dtype=np.int64)
    out = cuda.device_array(values.size, np.int64)
    _divergent_warps_kernel[1, values.size](cuda.to_device(values), out)
    want = values.reshape(4, W).astype(object)
    for w in range(4):
        total = want[w].sum()
        for _ in range(w):
            total *= W  # a second allreduce of 32 equal values
        want[w] = total
    np.testing.assert_array_equal(out.copy_to_host(), want.reshape(-1).astype(np.int64))


@cuda.jit
def _early_return_kernel(out):
    lane = cuda.threadIdx.x % W
    if lane == 0:
        return  # lane 0 leaves: the others' full-mask shuffle can never complete
    out[cuda.threadIdx.x] = _warp.shfl_xor(lane, 1)


def test_a_lane_missing_from_a_full_mask_collective_is_an_error(monkeypatch):
    monkeypatch.setattr(_warp, "SIM_BARRIER_TIMEOUT_S", 0.5)
    monkeypatch.setattr(_warp, "_exchanges", {})  # fresh barriers with the short timeout
    with pytest.raises(RuntimeError, match="not every lane of the warp arrived"):
        _early_return_kernel[1, W](cuda.device_array(W, np.int64))
