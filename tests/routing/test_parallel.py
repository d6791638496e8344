"""How the CPU kernels run in parallel: torch's OpenMP team against Numba's own threads.

select_experts' parallel kernel in torch's team must give bit for bit what the Numba
``prange`` kernel gives (same rows, same code per row), and both the reference's ids
exactly and weights within rtol 1e-6 (the kernel's exp rounds apart from NumPy's by an
ulp or two).
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from moeroute.config import PRESETS  # noqa: E402
from moeroute.routing import _parallel, reference  # noqa: E402
from moeroute.routing.select import PARALLEL_MIN_ELEMENTS, select_experts  # noqa: E402

WEIGHT_RTOL = 1e-6
# Rows whose K-th and (K+1)-th choices lie this close may rank either way in float32.
NEAR_TIE = 1e-5

needs_team = pytest.mark.skipif(not _parallel.torch_team_available(),
                                reason="torch here does not bring its own libgomp")


def _inputs(preset, tokens, dtype, seed):
    rng = np.random.default_rng(seed)
    config = preset.router
    logits = (3 * rng.standard_normal((tokens, config.num_experts))).astype(dtype)
    bias = None
    if preset.has_correction_bias:
        bias = (0.1 * rng.standard_normal(config.num_experts)).astype(np.float32)
    return config, logits, bias


def _select_in(mode, *args):
    previous = _parallel.set_team_mode(mode)
    try:
        return select_experts(*args)
    finally:
        _parallel.set_team_mode(previous)


@needs_team
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_team_kernel_matches_numba_kernel_and_reference(name, dtype):
    preset = PRESETS[name]
    tokens = PARALLEL_MIN_ELEMENTS // preset.router.num_experts * 3 + 5  # parallel, uneven chunks
    config, logits, bias = _inputs(preset, tokens, dtype, seed=len(name))
    team_w, team_ids = _select_in("torch", logits, config, bias)
    numba_w, numba_ids = _select_in("numba", logits, config, bias)
    np.testing.assert_array_equal(team_ids, numba_ids)
    np.testing.assert_array_equal(team_w, numba_w)
    ref_w, ref_ids = reference.select_experts(logits, config, bias)
    same = (np.sort(team_ids, axis=1) == np.sort(ref_ids, axis=1)).all(axis=1)
    assert same.mean() > 0.999, f"{(~same).sum()} rows pick other experts than the reference"
    np.testing.assert_allclose(team_w[same], ref_w[same], rtol=WEIGHT_RTOL, atol=1e-30)


@needs_team
def test_team_kernel_uses_torch_thread_count():
    preset = PRESETS["qwen3.5-moe"]
    config, logits, bias = _inputs(preset, 4096, "float32", seed=1)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert _parallel.cpu_threads() == 1
        single = _select_in("torch", logits, config, bias)  # one thread: the serial kernel
        torch.set_num_threads(previous)
        assert _parallel.cpu_threads() == min(previous, _numba_max_threads())
        team = _select_in("torch", logits, config, bias)
    finally:
        torch.set_num_threads(previous)
    np.testing.assert_array_equal(single[1], team[1])
    np.testing.assert_array_equal(single[0], team[0])


def _numba_max_threads():
    import numba

    return numba.config.NUMBA_NUM_THREADS


def test_team_mode_rejects_unknown_mode():
    with pytest.raises(ValueError, match="mode='openmp'.*auto"):
        _parallel.set_team_mode("openmp")
    assert _parallel.team_mode() in _parallel.TEAM_MODES


def test_numba_mode_never_uses_the_team():
    previous = _parallel.set_team_mode("numba")
    try:
        assert not _parallel.torch_team()
    finally:
        _parallel.set_team_mode(previous)


@pytest.mark.parametrize("value", ["bogus", "Numba2", "1"])
def test_an_unknown_cpu_team_variable_is_refused_when_read(monkeypatch, value):
    """MOEROUTE_CPU_TEAM=bogus used to run as "auto"; now the first parallel call names it."""
    from moeroute.config import RouterConfig
    from moeroute.routing.select import PARALLEL_MIN_ELEMENTS, select_experts

    monkeypatch.setattr(_parallel, "_mode", None)  # not chosen yet: read the variable
    monkeypatch.setenv(_parallel.TEAM_ENV, value)
    message = rf"MOEROUTE_CPU_TEAM='{value}' is not one of \('auto', 'torch', 'numba'\)"
    with pytest.raises(ValueError, match=message):
        _parallel.team_mode()
    logits = np.zeros((PARALLEL_MIN_ELEMENTS // 8 + 1, 8), np.float32)
    with pytest.raises(ValueError, match=message):
        select_experts(logits, RouterConfig(8, 2))


@pytest.mark.parametrize("value, mode", [("numba", "numba"), (" AUTO ", "auto"), ("", "numba")])
def test_the_cpu_team_variable_names_the_mode(monkeypatch, value, mode):
    monkeypatch.setattr(_parallel, "_mode", None)
    monkeypatch.setenv(_parallel.TEAM_ENV, value)
    assert _parallel.team_mode() == mode
    assert _parallel.DEFAULT_TEAM_MODE == "numba"
