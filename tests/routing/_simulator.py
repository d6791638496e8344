"""Run a simulator suite in a subprocess: NUMBA_ENABLE_CUDASIM must be set before numba is
imported, so the suites under the CUDA simulator cannot share the parent's interpreter."""

import os
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
#: The longest suite takes a few minutes on 2 cores; this only guards against a hang.
SIM_TIMEOUT_S = 900


def run_simulator_suite(module, warps=None, *, select=None, allow_skipped=False, timeout=SIM_TIMEOUT_S):
    """Run the pytest file ``module`` (or a list of files, in one process) under the
    simulator and assert that it passed.

    ``warps``: MOEROUTE_SIM_WARPS (threads of a block run as that many warps); ``select``: a
    ``-k`` expression; ``allow_skipped``: whether skips are accepted (else a skip fails the
    run: a simulator case that cannot run is missing coverage, not a pass).
    """
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    if warps is not None:
        env["MOEROUTE_SIM_WARPS"] = str(warps)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
    if select is not None:
        command += ["-k", select]
    modules = module if isinstance(module, (list, tuple)) else [module]
    result = subprocess.run(
        command + [str(m) for m in modules], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout
    )
    summary = result.stdout[-3000:] + result.stderr[-2000:]
    assert result.returncode == 0, summary
    passed = re.search(r"(\d+) passed", result.stdout)
    assert passed and int(passed.group(1)) > 0, summary
    refused = r"\d+ (failed|errors?)" if allow_skipped else r"\d+ (failed|skipped|errors?)"
    assert not re.search(refused, result.stdout), summary
    return result
