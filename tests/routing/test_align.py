"""align_block_size on the CPU against the NumPy reference and the invariants of docs/semantics.md section 4."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeroute.routing import reference
from moeroute.routing.align import align_block_size

# (num_experts N, top_k K) of the built-in presets.
PRESET_SHAPES = [
    (256, 8),  # DeepSeek-V3/R1
    (384, 8),  # Kimi-K2
    (160, 8),  # GLM-4.5
    (128, 8),  # Qwen3-30B-A3B
    (512, 10),  # Qwen3-Next
    (60, 4),  # Qwen1.5-MoE-A2.7B
    (8, 2),  # Mixtral
]
TOKENS = [0, 1, 7, 333, 4096]
BLOCK_SIZES = [1, 16, 64, 128]


def skewed_ids(rng, tokens, top_k, num_experts, low=0, high=None):
    """Imbalanced routing: expert e drawn with probability ~ 1/(e+1)**1.2 (many get none)."""
    high = num_experts if high is None else high
    values = np.arange(low, high)
    p = 1.0 / (np.abs(values - low) + 1.0) ** 1.2
    return rng.choice(values, size=(tokens, top_k), p=p / p.sum()).astype(np.int32)


def assert_same(result, expected):
    sorted_ids, expert_ids, total = result
    ref_sorted, ref_experts, ref_total = expected
    assert sorted_ids.dtype == np.int32 and expert_ids.dtype == np.int32
    np.testing.assert_array_equal(sorted_ids, ref_sorted)
    np.testing.assert_array_equal(expert_ids, ref_experts)
    assert isinstance(total, int) and total == ref_total


def test_spec_worked_example():
    ids = np.array([[0, 1], [1, 2], [0, 2]])
    sorted_ids, expert_ids, total = align_block_size(ids, 4, 2)
    assert sorted_ids.tolist() == [0, 4, 1, 2, 3, 5, 6, 6, 6, 6]
    assert expert_ids.tolist() == [0, 1, 2, -1, -1]
    assert total == 6


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("num_experts,top_k", PRESET_SHAPES)
def test_presets_match_reference(num_experts, top_k, tokens):
    rng = np.random.default_rng(num_experts * 7919 + tokens)
    ids = skewed_ids(rng, tokens, top_k, num_experts)
    block_size = BLOCK_SIZES[(num_experts + tokens) % len(BLOCK_SIZES)]
    assert_same(
        align_block_size(ids, num_experts, block_size), reference.align_block_size(ids, num_experts, block_size)
    )


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_block_sizes_match_reference(block_size):
    rng = np.random.default_rng(block_size)
    ids = skewed_ids(rng, 333, 8, 256)
    assert_same(align_block_size(ids, 256, block_size), reference.align_block_size(ids, 256, block_size))


@pytest.mark.parametrize("num_experts", [520, 1024, 1])
def test_many_experts_and_one(num_experts):
    rng = np.random.default_rng(num_experts)
    ids = rng.integers(0, num_experts, (777, 9)).astype(np.int32)
    assert_same(align_block_size(ids, num_experts, 64), reference.align_block_size(ids, num_experts, 64))


def test_out_of_range_ids_are_dropped():
    rng = np.random.default_rng(3)
    ids = rng.integers(-3, 19, (101, 6)).astype(np.int64)
    sorted_ids, expert_ids, total = align_block_size(ids, 16, 4)
    assert_same((sorted_ids, expert_ids, total), reference.align_block_size(ids, 16, 4))
    flat = ids.reshape(-1)
    kept = sorted_ids[sorted_ids < flat.size]
    assert np.all((flat[kept] >= 0) & (flat[kept] < 16))
    assert kept.size == np.count_nonzero((flat >= 0) & (flat < 16))


def test_experts_without_rows_get_no_block():
    rng = np.random.default_rng(4)
    ids = 2 * rng.integers(0, 8, (50, 4))  # only even experts of 16
    sorted_ids, expert_ids, total = align_block_size(ids, 16, 8)
    used = expert_ids[expert_ids >= 0]
    assert set(used.tolist()) <= set(range(0, 16, 2))
    assert_same((sorted_ids, expert_ids, total), reference.align_block_size(ids, 16, 8))


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.uint8, np.uint16, np.int64, np.uint32])
def test_integer_dtypes(dtype):
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 12, (40, 3)).astype(dtype)
    assert_same(align_block_size(ids, 12, 4), reference.align_block_size(ids, 12, 4))


def test_non_contiguous_input():
    rng = np.random.default_rng(6)
    wide = rng.integers(0, 10, (30, 8)).astype(np.int32)
    ids = wide[:, ::2]
    assert not ids.flags.c_contiguous
    assert_same(align_block_size(ids, 10, 3), reference.align_block_size(ids, 10, 3))


def test_zero_tokens():
    ids = np.zeros((0, 8), np.int32)
    sorted_ids, expert_ids, total = align_block_size(ids, 4, 4)
    # numel = 0: capacity 4*(4-1)=12 rounded to 12, all padding, no used block.
    assert sorted_ids.tolist() == [0] * 12
    assert expert_ids.tolist() == [-1] * 3
    assert total == 0


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.integers(0, 40),
    top_k=st.integers(1, 6),
    num_experts=st.integers(1, 24),
    block_size=st.integers(1, 9),
    data=st.data(),
)
def test_invariants(tokens, top_k, num_experts, block_size, data):
    ids = np.array(
        data.draw(st.lists(st.integers(-2, num_experts + 2), min_size=tokens * top_k, max_size=tokens * top_k)),
        dtype=np.int32,
    ).reshape(tokens, top_k)
    sorted_ids, expert_ids, total = align_block_size(ids, num_experts, block_size)
    flat = ids.reshape(-1)
    numel = flat.size
    valid = (flat >= 0) & (flat < num_experts)
    capacity = -(-(numel + num_experts * (block_size - 1)) // block_size) * block_size
    assert sorted_ids.shape == (capacity,) and expert_ids.shape == (capacity // block_size,)
    # Every valid flat index exactly once; everything else is padding.
    entries = sorted_ids[sorted_ids != numel]
    assert sorted(entries.tolist()) == np.nonzero(valid)[0].tolist()
    assert np.count_nonzero(sorted_ids == numel) == capacity - valid.sum()
    counts = np.bincount(flat[valid], minlength=num_experts)
    assert total == int(sum(-(-c // block_size) * block_size for c in counts))
    used_blocks = total // block_size
    assert np.all(expert_ids[used_blocks:] == -1)
    assert np.all(sorted_ids[total:] == numel)
    for b in range(used_blocks):
        block = sorted_ids[b * block_size : (b + 1) * block_size]
        real = block[block != numel]
        assert real.size > 0, "a used block holds at least one entry"
        assert np.all(flat[real] == expert_ids[b])
        assert np.all(np.diff(real) > 0)
    assert np.all(np.diff(expert_ids[:used_blocks]) >= 0)


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        (dict(block_size=0), ValueError, "block_size=0"),
        (dict(block_size=-4), ValueError, "block_size=-4"),
        (dict(block_size=2.0), TypeError, "block_size=2.0"),
        (dict(block_size=True), TypeError, "block_size=True"),
        (dict(num_experts=0), ValueError, "num_experts=0"),
        (dict(num_experts="8"), TypeError, "num_experts='8'"),
        (dict(ids=np.zeros(6, np.int32)), ValueError, "topk_ids must be 2-D"),
        (dict(ids=np.zeros((2, 3, 1), np.int32)), ValueError, "topk_ids must be 2-D"),
        (dict(ids=np.zeros((2, 3), np.float32)), TypeError, "topk_ids must hold integers"),
        (dict(num_experts=2**20, block_size=2**12), ValueError, "int32 index limit"),
    ],
)
def test_invalid_arguments(kwargs, error, words):
    args = dict(ids=np.zeros((2, 3), np.int32), num_experts=8, block_size=4)
    args.update(kwargs)
    with pytest.raises(error, match=words):
        align_block_size(args["ids"], args["num_experts"], args["block_size"])


# ------------------------------------------------------------------ with an expert map

from moeroute.layout import ExpertLayout  # noqa: E402
from moeroute.routing.remap import remap_to_local  # noqa: E402

# (label, layout arguments): linear, round-robin, per-rank and global shared slots, EPLB.
MAP_LAYOUTS = [
    ("512+1 on 8, all2all", dict(num_routed_experts=512, num_shared_experts=1, ep_size=8, dispatch="all2all")),
    (
        "60+2 on 7, allgather",
        dict(num_routed_experts=60, num_shared_experts=2, ep_size=7, dispatch="allgather", shared_slots="global"),
    ),
    (
        "round robin 16 on 4",
        dict(num_routed_experts=16, ep_size=4, dispatch="all2all", placement="round_robin", num_redundant_experts=3),
    ),
    ("table", dict(num_routed_experts=6, ep_size=2, dispatch="all2all", physical_to_logical=[5, 0, 1, 2, 3, 4, 0, 0])),
]


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("label,kwargs", MAP_LAYOUTS, ids=[label for label, _ in MAP_LAYOUTS])
def test_expert_map_equals_remap_then_align(label, kwargs, block_size):
    layout = ExpertLayout(**kwargs)
    rng = np.random.default_rng(len(label) * 31 + block_size)
    # Ids past both ends of the physical id space and -1 must be dropped.
    ids = rng.integers(-2, layout.num_physical_experts + 3, (257, 9))
    for rank in range(layout.ep_size):
        expert_map = layout.expert_map(rank)
        local = layout.num_local_experts(rank)
        got = align_block_size(ids, local, block_size, expert_map)
        assert_same(got, align_block_size(remap_to_local(ids, expert_map), local, block_size))
        assert_same(got, reference.align_block_size(ids, local, block_size, expert_map))


def test_expert_map_worked_example():
    # Rank 1 of N=8, S=1, E=2 (docs/semantics.md section 2): physical 5..9 are its local 0..4.
    expert_map = ExpertLayout(8, 1, ep_size=2, dispatch="all2all").expert_map(1)
    ids = np.array([[5, 0], [9, 6], [-1, 5]])
    sorted_ids, expert_ids, total = align_block_size(ids, 5, 2, expert_map)
    # local 0 <- flat 0 and 5; local 1 <- flat 3; local 4 <- flat 2; flat 1 and 4 dropped.
    assert sorted_ids.tolist()[:6] == [0, 5, 3, 6, 2, 6]
    assert expert_ids.tolist()[:4] == [0, 1, 4, -1]
    assert total == 6


@settings(max_examples=100, deadline=None)
@given(
    tokens=st.integers(0, 30),
    top_k=st.integers(1, 5),
    num_physical=st.integers(1, 20),
    num_experts=st.integers(1, 12),
    block_size=st.integers(1, 8),
    data=st.data(),
)
def test_expert_map_property(tokens, top_k, num_physical, num_experts, block_size, data):
    # Any valid map (-1 or a local id), ids past num_experts included: equal to remap then align.
    expert_map = np.array(
        data.draw(st.lists(st.integers(-1, num_experts + 2), min_size=num_physical, max_size=num_physical)),
        dtype=np.int64,
    )
    ids = np.array(
        data.draw(st.lists(st.integers(-2, num_physical + 2), min_size=tokens * top_k, max_size=tokens * top_k)),
        dtype=np.int32,
    ).reshape(tokens, top_k)
    assert_same(
        align_block_size(ids, num_experts, block_size, expert_map),
        align_block_size(remap_to_local(ids, expert_map), num_experts, block_size),
    )


@pytest.mark.parametrize(
    "expert_map,error,words",
    [
        (np.zeros((2, 5), np.int32), ValueError, "expert_map must be 1-D"),
        (np.zeros(5, np.float32), TypeError, "expert_map must hold integers"),
        # The values remap_to_local refuses are refused here too.
        (np.array([0, -2, 1]), ValueError, r"expert_map values must be -1 .* got values in \[-2, 1\]"),
        (np.array([0, 2**31]), ValueError, "expert_map values must be -1"),
    ],
)
def test_expert_map_invalid(expert_map, error, words):
    with pytest.raises(error, match=words):
        align_block_size(np.zeros((2, 3), np.int32), 4, 2, expert_map)


# The CUDA path (the map read inside the counting sort's two kernels) under the simulator; see
# test_align_cuda_simulator below.
from moeroute.routing._arrays import simulator_enabled  # noqa: E402

_SIMULATED = simulator_enabled()
_sim_only = pytest.mark.skipif(not _SIMULATED, reason="runs inside the CUDA simulator subprocess")
_no_sim = pytest.mark.skipif(_SIMULATED, reason="needs the real numba.cuda, not the simulator")


@_sim_only
@pytest.mark.parametrize("block_size", [1, 4])
def test_sim_expert_map_matches_cpu(block_size):
    from numba import cuda

    layout = ExpertLayout(13, 1, ep_size=3, dispatch="all2all", placement="round_robin")
    rng = np.random.default_rng(block_size)
    ids = rng.integers(-2, layout.num_physical_experts + 2, (11, 3)).astype(np.int32)
    for rank in range(3):
        expert_map = layout.expert_map(rank)
        local = layout.num_local_experts(rank)
        expected = align_block_size(ids, local, block_size, expert_map)
        # Host map (uploaded once) and device map, through the public function.
        for table in (expert_map, cuda.to_device(expert_map)):
            got = align_block_size(cuda.to_device(ids), local, block_size, table)
            np.testing.assert_array_equal(got[0].copy_to_host(), expected[0])
            np.testing.assert_array_equal(got[1].copy_to_host(), expected[1])
            assert got[2].copy_to_host().tolist() == [expected[2]]


@_no_sim
def test_align_cuda_simulator():
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-k", "test_sim_", __file__],
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=900,
    )
    summary = result.stdout[-3000:] + result.stderr[-2000:]
    assert result.returncode == 0, summary
    passed = re.search(r"(\d+) passed", result.stdout)
    assert passed and int(passed.group(1)) > 0, summary
    assert not re.search(r"\d+ (failed|errors?)", result.stdout), summary


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.broadcast_to(np.zeros((1, 8), np.int64), (2**28 + 1, 8)),
        lambda: np.broadcast_to(np.zeros((1, 8), np.uint8), (2**28 + 1, 8)),
        lambda: __import__("torch").zeros(1, 8, dtype=__import__("torch").int64).expand(2**28 + 1, 8),
    ],
    ids=["numpy-int64", "numpy-uint8", "torch-expand"],
)
def test_the_int32_limit_is_checked_before_a_broadcast_view_is_copied(make):
    """Used to copy (and widen) the 2**31 + 8 entries, 8-16 GiB, then refuse them."""
    import tracemalloc

    ids = make()
    tracemalloc.start()
    try:
        with pytest.raises(
            ValueError,
            match=r"numel \+ num_experts\*\(block_size-1\)=.* exceeds "
            r"the int32 index limit 2147483647",
        ):
            align_block_size(ids, 8, 64)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
