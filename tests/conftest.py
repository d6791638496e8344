"""Test-suite-wide settings."""

import os
import sys

from hypothesis import settings

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
