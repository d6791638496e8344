"""moeroute.routing._warp: the device intrinsics compile for sm_90; the simulator versions are
exact in blocks of the device's warps per block (tests/routing/_sim_warp.py, in a subprocess)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

cuda = pytest.importorskip("numba.cuda")
from numba import types as nt  # noqa: E402

from moeroute.routing import _warp  # noqa: E402
from moeroute.routing.select import DEVICE_WARPS_PER_BLOCK  # noqa: E402
from _simulator import run_simulator_suite  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
SIM_MODULE = Path(__file__).with_name("_sim_warp.py")


def test_simulated_warp_intrinsics_with_the_devices_warps_per_block():
    run_simulator_suite(SIM_MODULE, DEVICE_WARPS_PER_BLOCK)


def _uses_every_helper(values, out):
    i = cuda.threadIdx.x
    value = values[i]
    value = _warp.shfl_xor(value, 1) + _warp.shfl_idx(value, 2)
    value += _warp.shfl_down(value, 1) + _warp.shfl_up(value, 1)
    _warp.syncwarp()
    value += _warp.ballot(value > 0)
    out[i] = _warp.allreduce_max(value) + _warp.allreduce_sum(value)


def test_device_helpers_compile_to_warp_instructions():
    ptx, _ = cuda.compile_ptx(_uses_every_helper, (nt.int64[::1], nt.int64[::1]), cc=(9, 0))
    for instruction in (
        "shfl.sync.bfly",
        "shfl.sync.idx",
        "shfl.sync.down",
        "shfl.sync.up",
        "bar.warp.sync",
        "vote.sync.ballot",
    ):
        assert instruction in ptx, instruction


@pytest.mark.parametrize("text", ["0", "-2", "four"])
def test_bad_warp_count_is_refused_naming_the_variable(text):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", MOEROUTE_SIM_WARPS=text)
    result = subprocess.run(
        [sys.executable, "-c", "import moeroute.routing._warp"],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert f"MOEROUTE_SIM_WARPS={text!r} must be an integer >= 1" in result.stderr
