"""Run a test's own function on the AVX2 path, in a fresh process.

The instruction-set path is fixed when moeroute is imported (`moeroute.cpu_features`), so a
test that checks every path this CPU runs calls its function here once more in a process
whose Numba target has no AVX-512 and whose ``MOEROUTE_CPU_ISA`` is "avx2".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

#: For a Numba target without AVX-512, MOEROUTE_CPU_ISA for `moeroute.cpu_features`.
AVX2 = {"MOEROUTE_CPU_ISA": "avx2", "NUMBA_CPU_NAME": "haswell"}


def on_avx2(module: str, function: str):
    """What ``module.function()`` (a module under tests/, e.g. "quant.test_int4_scales")
    returns, JSON in and out, run with one torch thread on the AVX2 path. AssertionError with
    the end of its stderr when the process fails."""
    code = (
        "import json, sys; sys.path.insert(0, 'tests'); import torch; torch.set_num_threads(1); "
        f"from {module} import {function}; print(json.dumps({function}()))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env={**os.environ, **AVX2},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])
