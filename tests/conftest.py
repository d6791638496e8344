"""Test-suite-wide settings."""

import os
import subprocess
import sys
from pathlib import Path

from hypothesis import settings

REPO_ROOT = Path(__file__).resolve().parents[1]

# Every property test draws the same examples on every run and machine: CI cannot fail by
# chance, and a failure reproduces with the same command. No example database is read or
# written, so a local run cannot replay examples CI never saw.
settings.register_profile("moeroute", derandomize=True, database=None, print_blob=True)
settings.load_profile("moeroute")

# Under Numba's CUDA simulator every GPU thread is a Python thread, and a warp's threads wait
# for each other at each shuffle and barrier by polling while the others wait for the GIL.
# With CPython's default 5 ms switch interval that polling costs most of a simulator run;
# 0.1 ms runs the same kernels, to the same results, about five times faster.
if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    sys.setswitchinterval(1e-4)


def _lock_simulator_shared_arrays():
    """The simulator gives a block's threads one static shared array per source line: the
    first thread to reach the line creates it (``np.empty``) and the others look it up, with
    no lock between the lookup and the store. Two threads that both found it missing each
    made one; one of them then worked on an array no other thread read, and the others read
    uninitialized values (a routing kernel's scan stored such a value as an expert's start).
    The same per-line arrays, created under a lock."""
    import threading

    import numpy as np
    from numba.cuda import types
    from numba.cuda.np import numpy_support
    from numba.cuda.simulator import kernelapi

    original = kernelapi.FakeCUDAShared.array
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:  # dynamic shared memory, or the simulator's refusal
            return original(self, shape, dtype, alignment)
        frame = sys._getframe(1)  # the kernel's line, as the simulator keys it
        caller = (frame.f_code.co_filename, frame.f_lineno)
        with lock:
            found = self._allocations.get(caller)
            if found is None:
                dtype = numpy_support.as_dtype(dtype) if isinstance(dtype, types.Type) else dtype
                found = self._allocations[caller] = np.empty(shape, dtype)
            return found

    kernelapi.FakeCUDAShared.array = array


if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    _lock_simulator_shared_arrays()


# The CPU routing kernels (select_experts' serial and parallel kernels above all: about a
# minute each to compile) are wanted by nearly every test process: both xdist workers, the
# simulator suites' subprocesses (their host reference), the gloo ranks. With a cold on-disk
# cache each of them compiled the same kernels at the same time. Under xdist the controller
# compiles them into Numba's cache once, one process per logits dtype, before the workers
# start; from then on every process loads them. A warm cache makes this a few seconds.
WARMUP_DTYPES = ("float32", "float16")
WARMUP_CODE = (
    "import sys, moeroute; moeroute.warmup(['deepseek-v3'], dtypes=[sys.argv[1]], torch_module=False, progress=False)"
)


def pytest_sessionstart(session):
    config = session.config
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return  # an xdist worker, or a run without workers: kernels compile on first use
    # cwd: the checkout's moeroute, as the tests' own subprocesses import it; the environment
    # (NUMBA_CACHE_DIR included) is the workers'.
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", WARMUP_CODE, dtype],
            cwd=REPO_ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for dtype in WARMUP_DTYPES
    ]
    for dtype, process in zip(WARMUP_DTYPES, processes):
        _, stderr = process.communicate()
        if process.returncode != 0:  # the tests that use the kernel fail and say why
            sys.stderr.write(f"conftest: the {dtype} kernel warm-up failed:\n{stderr[-2000:]}\n")


def pytest_collection_modifyitems(session, config, items):
    """The modules holding a test marked ``slow`` first, each module's tests together and in
    their own order: xdist hands tests out in collection order, and the longest ones (cold
    compiles on another instruction-set path, the CUDA simulator, gloo ranks) collected last
    left one worker running them while the other sat idle."""
    slow_modules = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow_modules)
