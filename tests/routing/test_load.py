"""expert_load (per-expert token counters for EPLB) on the CPU, under the CUDA simulator,
and compiled for a device; logical_to_physical(prefer_rank=...) on the simulator.

``test_sim_*`` run only under NUMBA_ENABLE_CUDASIM=1: `test_cuda_simulator_suite` runs them
in a subprocess and asserts that they all passed.
"""

from pathlib import Path

import numpy as np
import pytest

from moeroute.layout import ExpertLayout
from moeroute.routing import reference
from moeroute.routing._arrays import simulator_enabled
from moeroute.routing.load import expert_load
from moeroute.routing.remap import logical_to_physical
from moeroute.routing.shared_slots import append_shared_slots
from _simulator import run_simulator_suite  # noqa: E402

SIMULATED = simulator_enabled()
sim_only = pytest.mark.skipif(not SIMULATED, reason="runs inside the CUDA simulator subprocess")
no_sim = pytest.mark.skipif(SIMULATED, reason="needs the real numba.cuda, not the simulator")


def bincount_reference(ids, num_experts):
    """Plain NumPy: count each id in [0, num_experts)."""
    flat = np.asarray(ids).reshape(-1)
    return np.array([(flat == e).sum() for e in range(num_experts)], np.int64)


@pytest.mark.parametrize("shape", [(0,), (0, 8), (7,), (333, 8), (4, 3, 2)])
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.int16, np.uint8])
def test_counts_match_reference(shape, dtype):
    rng = np.random.default_rng(len(shape) * 13 + shape[0])
    low = 0 if np.dtype(dtype).kind == "u" else -2
    ids = rng.integers(low, 40, shape).astype(dtype)
    counts = expert_load(ids, 37)
    assert counts.dtype == np.int64 and counts.shape == (37,)
    np.testing.assert_array_equal(counts, bincount_reference(ids, 37))
    np.testing.assert_array_equal(counts, reference.expert_load(ids, 37))


def test_out_accumulates_over_steps():
    rng = np.random.default_rng(3)
    counter = np.zeros(16, np.int64)
    total = np.zeros(16, np.int64)
    for step in range(4):
        ids = rng.integers(-1, 17, (50, 4))
        returned = expert_load(ids, 16, out=counter)
        assert returned is counter
        total += bincount_reference(ids, 16)
    np.testing.assert_array_equal(counter, total)


def test_physical_load_of_a_layout():
    # Per physical expert, replicas and per-rank shared slots included.
    layout = ExpertLayout(6, 1, ep_size=2, dispatch="all2all", num_redundant_experts=2, placement="round_robin")
    rng = np.random.default_rng(5)
    logical = rng.integers(0, 6, (400, 3))
    _, ids = append_shared_slots(np.ones((400, 3), np.float32), logical, layout, home_rank=1)
    counts = expert_load(ids, layout.num_physical_experts)
    np.testing.assert_array_equal(counts, bincount_reference(ids, layout.num_physical_experts))
    assert counts.sum() == 400 * 4
    assert counts[layout.shared_slot_ids(1)[0]] == 400
    # Every replica of a logical expert takes part of its load.
    by_logical = np.zeros(6, np.int64)
    for p in range(layout.num_routed_physical):
        by_logical[layout.physical_to_logical[p]] += counts[layout.routed_id_map[p]]
    np.testing.assert_array_equal(by_logical, bincount_reference(logical, 6))


def test_cpu_torch_tensors_in_and_out():
    import torch

    ids = torch.tensor([[1, 2], [2, -1]], dtype=torch.int64)
    counts = expert_load(ids, 3)
    assert isinstance(counts, torch.Tensor) and counts.tolist() == [0, 1, 2]
    counter = torch.zeros(3, dtype=torch.int64)
    assert expert_load(ids, 3, out=counter) is counter
    expert_load(ids, 3, out=counter)
    assert counter.tolist() == [0, 2, 4]


class _DeviceLike:
    __cuda_array_interface__ = {}


@pytest.mark.parametrize(
    "call,error,words",
    [
        (lambda: expert_load(np.zeros(3), 4), TypeError, "ids must hold integers"),
        (lambda: expert_load(np.zeros(3, np.int32), 0), ValueError, "num_experts=0"),
        (lambda: expert_load(np.zeros(3, np.int32), 2.0), TypeError, "num_experts=2.0"),
        (lambda: expert_load(np.zeros(3, np.int32), 4, out=np.zeros(5, np.int64)), ValueError, r"out has shape \(5,\)"),
        (
            lambda: expert_load(np.zeros(3, np.int32), 4, out=np.zeros(4, np.int32)),
            TypeError,
            "out must hold int64 counters, got dtype int32",
        ),
        (lambda: expert_load(np.zeros(3, np.int32), 4, out=[0, 0, 0, 0]), TypeError, "out must be a NumPy"),
        (
            lambda: expert_load(np.zeros(3, np.int32), 4, out=_DeviceLike()),
            TypeError,
            "out is a device array but ids are on the host",
        ),
    ],
)
def test_invalid_arguments(call, error, words):
    with pytest.raises(error, match=words):
        call()


# ------------------------------------------------------------------ simulator


@no_sim
def test_cuda_simulator_suite():
    run_simulator_suite(Path(__file__), select="test_sim_")


@sim_only
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_sim_counts_match_cpu(dtype):
    from numba import cuda

    rng = np.random.default_rng(11)
    ids = rng.integers(-2, 12, (9, 4)).astype(dtype)
    counts = expert_load(cuda.to_device(ids), 10)
    assert counts.dtype == np.int64
    np.testing.assert_array_equal(counts.copy_to_host(), bincount_reference(ids, 10))
    # Accumulating into a device counter.
    more = rng.integers(0, 10, (5, 4)).astype(dtype)
    expert_load(cuda.to_device(more), 10, out=counts)
    np.testing.assert_array_equal(counts.copy_to_host(), bincount_reference(ids, 10) + bincount_reference(more, 10))
    empty = expert_load(cuda.to_device(np.zeros((0, 4), dtype)), 3)
    np.testing.assert_array_equal(empty.copy_to_host(), [0, 0, 0])


@sim_only
def test_sim_load_window_ring_row_matches_bincount():
    """The device call of the MoE load window (LoadRecorder.record): row ``forward % W`` of
    the int64 ring [W, P] is zeroed, then ``expert_load(physical_ids, P, out=row)`` adds
    into that row, a view at an offset inside the ring; the other rows stay as they were."""
    from numba import cuda

    window, num_physical = 3, 11
    rng = np.random.default_rng(17)
    ring = cuda.to_device(np.full((window, num_physical), 7, np.int64))  # stale counts
    expected = np.full((window, num_physical), 7, np.int64)
    for forward in range(5):
        # append_shared_slots output: int32 [T, K + S]; -1 and ids >= P are never counted.
        ids = rng.integers(-1, num_physical + 2, (6, 3)).astype(np.int32)
        row = ring[forward % window]
        row.copy_to_device(np.zeros(num_physical, np.int64))  # the recorder's row.zero_()
        assert expert_load(cuda.to_device(ids), num_physical, out=row) is row
        flat = ids.reshape(-1)
        expected[forward % window] = np.bincount(flat[(flat >= 0) & (flat < num_physical)], minlength=num_physical)
        np.testing.assert_array_equal(ring.copy_to_host(), expected)


@sim_only
def test_sim_prefer_rank_matches_cpu():
    from numba import cuda

    layout = ExpertLayout(4, 1, ep_size=4, dispatch="all2all", physical_to_logical=[0, 1, 2, 3, 0, 2, 0, 3])
    ids = np.random.default_rng(2).integers(-1, 5, (6, 3)).astype(np.int32)
    for rank in (None, 0, 3):
        got = logical_to_physical(cuda.to_device(ids), layout, rank).copy_to_host()
        np.testing.assert_array_equal(got, logical_to_physical(ids, layout, rank))
        np.testing.assert_array_equal(got, reference.logical_to_physical(ids, layout, rank))


# ------------------------------------------------------------------ device compile checks


@no_sim
@pytest.mark.parametrize("cc", [(8, 0), (9, 0)], ids=["sm_80", "sm_90"])
@pytest.mark.parametrize("ids_type", ["int32", "int64"])
def test_count_kernel_compiles_to_ptx(ids_type, cc):
    cuda = pytest.importorskip("numba.cuda")
    from numba import types

    from moeroute.routing.load import _cuda as load

    signature = (getattr(types, ids_type)[::1], types.int64[::1])
    ptx, _ = cuda.compile_ptx(load._count_kernel, signature, cc=cc)
    assert f".target sm_{cc[0]}{cc[1]}" in ptx and "atom.global.add.u64" in ptx
