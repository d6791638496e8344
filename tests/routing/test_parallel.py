"""How many threads the parallel CPU kernels take next to torch (moeroute.routing._parallel).

With torch loaded the kernels take ``torch.get_num_threads()`` threads (at most Numba's pool);
on one thread select_experts runs its serial kernel, which must give bit for bit what the
parallel kernel gives (same rows, same code per row), and both the reference's ids exactly and
weights within rtol 1e-6 (the kernel's exp rounds apart from NumPy's by an ulp or two).
"""

import numba
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from moeroute.config import PRESETS  # noqa: E402
from moeroute.routing import _parallel, reference  # noqa: E402
from moeroute.routing.select import PARALLEL_MIN_ELEMENTS, select_experts  # noqa: E402

WEIGHT_RTOL = 1e-6


def _inputs(preset, tokens, dtype, seed):
    rng = np.random.default_rng(seed)
    config = preset.router
    logits = (3 * rng.standard_normal((tokens, config.num_experts))).astype(dtype)
    bias = None
    if preset.has_correction_bias:
        bias = (0.1 * rng.standard_normal(config.num_experts)).astype(np.float32)
    return config, logits, bias


@pytest.mark.parametrize("name", ["qwen3.5-moe", "deepseek-v3"])
def test_the_kernels_take_torchs_thread_count_and_agree_on_one_thread(name):
    preset = PRESETS[name]
    tokens = PARALLEL_MIN_ELEMENTS // preset.router.num_experts + 5  # parallel, uneven chunks
    config, logits, bias = _inputs(preset, tokens, "float32", seed=len(name))
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert _parallel.cpu_threads() == 1
        single = select_experts(logits, config, bias)  # one thread: the serial kernel
        torch.set_num_threads(previous)
        assert _parallel.cpu_threads() == max(1, min(previous, numba.config.NUMBA_NUM_THREADS))
        threaded = select_experts(logits, config, bias)
    finally:
        torch.set_num_threads(previous)
    np.testing.assert_array_equal(single[1], threaded[1])
    np.testing.assert_array_equal(single[0], threaded[0])
    ref_w, ref_ids = reference.select_experts(logits, config, bias)
    same = (np.sort(single[1], axis=1) == np.sort(ref_ids, axis=1)).all(axis=1)
    assert same.mean() > 0.999, f"{(~same).sum()} rows pick other experts than the reference"
    np.testing.assert_allclose(single[0][same], ref_w[same], rtol=WEIGHT_RTOL, atol=1e-30)


_KEEPS_TORCH_THREADS = r"""
import sys
import numpy as np
import torch
assert torch.get_num_threads() == 1, torch.get_num_threads()
if sys.argv[1] == "bindings":
    import moeroute.bindings.torch  # noqa: F401
import moeroute
from moeroute.routing.combine import PARALLEL_ACCUMULATE_MIN_ELEMENTS, accumulate_rows

rows = PARALLEL_ACCUMULATE_MIN_ELEMENTS // 64 * 4
rng = np.random.default_rng(0)
y = rng.standard_normal((rows, 64)).astype(np.float32)
out = np.zeros((rows, 64), np.float32)
accumulate_rows(out, y, np.arange(rows, dtype=np.int32), np.ones(rows, np.float32))  # a parallel kernel
assert np.array_equal(out, y)
logits = torch.from_numpy(rng.standard_normal((4096, 64)).astype(np.float32))
moeroute.select_experts(logits, moeroute.RouterConfig(64, 8))
print(torch.get_num_threads())
"""


@pytest.mark.parametrize("first_import", ["routing", "bindings"])
def test_numbas_workers_leave_torchs_thread_count_alone(first_import):
    """Numba's omp layer and torch share libgomp: starting Numba's pool would set torch's
    thread count to the pool size (1 -> cores). It stays what the process gave torch."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="2")
    result = subprocess.run(
        [sys.executable, "-c", _KEEPS_TORCH_THREADS, first_import], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["1"]
