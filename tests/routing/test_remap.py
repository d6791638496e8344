"""logical_to_physical (EPLB replicas, per-rank shift) and remap_to_local on the CPU."""

import numpy as np
import pytest

from moeroute.layout import ExpertLayout
from moeroute.routing import reference
from moeroute.routing.remap import logical_to_physical, remap_to_local

# (label, layout arguments)
LAYOUTS = [
    ("single", dict(num_routed_experts=256, num_shared_experts=1)),
    ("spec-example", dict(num_routed_experts=8, num_shared_experts=1, ep_size=2, dispatch="all2all")),
    ("512+1 on 8", dict(num_routed_experts=512, num_shared_experts=1, ep_size=8, dispatch="all2all")),
    ("uneven", dict(num_routed_experts=60, num_shared_experts=2, ep_size=7, dispatch="allgather")),
    ("eplb default", dict(num_routed_experts=16, ep_size=4, dispatch="all2all", num_redundant_experts=8)),
    (
        "eplb table",
        dict(
            num_routed_experts=6,
            num_shared_experts=1,
            ep_size=2,
            dispatch="all2all",
            num_redundant_experts=4,
            replica_table=[0, 0, 0, 3],
        ),
    ),
    (
        "runner",
        dict(
            num_routed_experts=64,
            num_shared_experts=1,
            ep_size=4,
            dispatch="all2all",
            shared="runner",
            num_redundant_experts=3,
        ),
    ),
]
TOKENS = [0, 1, 7, 333, 4096]


def make_layout(kwargs):
    return ExpertLayout(**kwargs)


def logical_ids(rng, tokens, layout, top_k=8):
    n = layout.num_routed_experts
    return rng.integers(-2, n + 2, (tokens, min(top_k, n + 4)))


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("label,kwargs", LAYOUTS, ids=[label for label, _ in LAYOUTS])
def test_logical_to_physical_matches_reference(label, kwargs, tokens):
    layout = make_layout(kwargs)
    rng = np.random.default_rng(tokens + len(label))
    ids = logical_ids(rng, tokens, layout)
    out = logical_to_physical(ids, layout)
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, reference.logical_to_physical(ids, layout))


def test_replicas_follow_the_hash_rule_and_are_all_used():
    layout = ExpertLayout(16, ep_size=4, dispatch="all2all", num_redundant_experts=8)
    tokens = 4096
    ids = np.tile(np.arange(16), (tokens, 1))
    out = logical_to_physical(ids, layout)
    for logical in range(16):
        expected = [layout.choose_replica(logical, t) for t in range(tokens)]
        np.testing.assert_array_equal(out[:, logical], expected)
        replicas = [p for p in range(24) if p % 16 == logical]
        assert sorted(set(out[:, logical].tolist())) == replicas
    # Knuth's hash spreads rows evenly: each of two replicas serves about half.
    share = np.mean(out[:, 0] == 0)
    assert 0.45 < share < 0.55


def test_replica_table_is_honored():
    # Physical 6..9 replicate logical 0, 0, 0, 3; per-rank slots shift rank 1 by S=1.
    layout = ExpertLayout(6, 1, ep_size=2, dispatch="all2all", num_redundant_experts=4, replica_table=[0, 0, 0, 3])
    tokens = 2000
    ids = np.tile(np.arange(6), (tokens, 1))
    out = logical_to_physical(ids, layout)
    shift = lambda p: p + (1 if p >= 5 else 0)  # P=10 over 2 ranks: rank 1 holds 5..9
    assert sorted(set(out[:, 0].tolist())) == [shift(p) for p in (0, 6, 7, 8)]
    assert sorted(set(out[:, 3].tolist())) == [shift(p) for p in (3, 9)]
    for logical in (1, 2, 4, 5):
        assert set(out[:, logical].tolist()) == {shift(logical)}


def test_512_routed_plus_shared_on_8_ranks_lands_in_owner_blocks():
    layout = ExpertLayout(512, 1, ep_size=8, dispatch="all2all")
    ids = np.arange(512).reshape(64, 8)
    out = logical_to_physical(ids, layout)
    owner = ids // 64
    block_start = owner * 65  # each rank's block: 64 routed + 1 shared
    assert np.all((out >= block_start) & (out < block_start + 64))
    np.testing.assert_array_equal(out, ids + owner)


@pytest.mark.parametrize("rank", range(4))
def test_remap_to_local_matches_reference_and_expert_map(rank):
    layout = ExpertLayout(30, 2, ep_size=4, dispatch="all2all")
    expert_map = layout.expert_map(rank)
    rng = np.random.default_rng(rank)
    ids = rng.integers(-3, layout.num_physical_experts + 3, (333, 10))
    local = remap_to_local(ids, expert_map)
    assert local.dtype == np.int32
    np.testing.assert_array_equal(local, reference.remap_to_local(ids, expert_map))
    start, count = layout.routed_range(rank)
    block = start + rank * 2
    held = (ids >= block) & (ids < block + count + 2)
    np.testing.assert_array_equal(local, np.where(held, ids - block, -1))


@pytest.mark.parametrize("shape", [(0,), (5,), (0, 8), (4, 3, 2)])
def test_remap_any_shape(shape):
    rng = np.random.default_rng(1)
    expert_map = np.array([-1, 0, 1, -1, 2], np.int32)
    ids = rng.integers(-1, 7, shape).astype(np.int64)
    out = remap_to_local(ids, expert_map)
    assert out.shape == shape
    np.testing.assert_array_equal(out, reference.remap_to_local(ids, expert_map))


class _DeviceLike:
    __cuda_array_interface__ = {}


@pytest.mark.parametrize(
    "call,error,words",
    [
        (lambda: logical_to_physical(np.zeros((2, 2), np.int32), object()), TypeError, "ExpertLayout"),
        (lambda: logical_to_physical(np.zeros(4, np.int32), ExpertLayout(8)), ValueError, "2-D"),
        (lambda: logical_to_physical(np.zeros((2, 2)), ExpertLayout(8)), TypeError, "integers"),
        (lambda: remap_to_local(np.zeros((2, 2)), np.zeros(4, np.int32)), TypeError, "integers"),
        (
            lambda: remap_to_local(np.zeros(2, np.int32), np.zeros((2, 2), np.int32)),
            ValueError,
            "expert_map must be 1-D",
        ),
        (lambda: remap_to_local(np.zeros(2, np.int32), np.zeros(4)), TypeError, "expert_map must hold integers"),
        (lambda: remap_to_local(np.zeros(2, np.int32), _DeviceLike()), TypeError, "expert_map is a device array"),
    ],
)
def test_invalid_arguments(call, error, words):
    with pytest.raises(error, match=words):
        call()


# ------------------------------------------------------------------ placements, prefer_rank

PREFER_LAYOUTS = [
    (
        "round robin + replicas",
        dict(
            num_routed_experts=10,
            num_shared_experts=1,
            ep_size=3,
            dispatch="all2all",
            num_redundant_experts=5,
            placement="round_robin",
        ),
    ),
    ("table", dict(num_routed_experts=4, ep_size=4, dispatch="all2all", physical_to_logical=[0, 1, 2, 3, 0, 2, 0, 3])),
    (
        "table, global slots",
        dict(
            num_routed_experts=5,
            num_shared_experts=2,
            ep_size=2,
            dispatch="allgather",
            shared_slots="global",
            physical_to_logical=[4, 3, 2, 1, 0, 0, 1],
        ),
    ),
]


@pytest.mark.parametrize("label,kwargs", PREFER_LAYOUTS, ids=[label for label, _ in PREFER_LAYOUTS])
def test_prefer_rank_matches_reference(label, kwargs):
    layout = ExpertLayout(**kwargs)
    rng = np.random.default_rng(len(label))
    ids = logical_ids(rng, 301, layout, top_k=4)
    np.testing.assert_array_equal(logical_to_physical(ids, layout), reference.logical_to_physical(ids, layout))
    for rank in range(layout.ep_size):
        out = logical_to_physical(ids, layout, rank)
        np.testing.assert_array_equal(out, reference.logical_to_physical(ids, layout, rank))


def test_prefer_rank_keeps_tokens_on_the_rank_when_it_holds_a_replica():
    table = [0, 1, 2, 3, 0, 2, 0, 3]  # ranks hold [0, 1] [2, 3] [0, 2] [0, 3]
    layout = ExpertLayout(4, 0, 4, "all2all", physical_to_logical=table)
    ids = np.tile(np.arange(4), (500, 1))
    for rank in range(4):
        out = logical_to_physical(ids, layout, prefer_rank=rank)
        owner = np.asarray(layout.owner_rank)[out]
        held = {table[p] for p in range(2 * rank, 2 * rank + 2)}
        for logical in range(4):
            replicas = [p for p, x in enumerate(table) if x == logical]
            if logical in held:
                assert set(owner[:, logical].tolist()) == {rank}
            else:  # the hash rule over all replicas: every one is used
                assert sorted(set(out[:, logical].tolist())) == replicas


@pytest.mark.parametrize("rank,error", [(4, ValueError), (-1, ValueError), (1.5, ValueError)])
def test_prefer_rank_invalid(rank, error):
    layout = ExpertLayout(8, 0, 4, "all2all")
    with pytest.raises(error, match="prefer_rank"):
        logical_to_physical(np.zeros((2, 2), np.int32), layout, rank)


@pytest.mark.parametrize("values", [[0, 2**31], [-1, 2**31 + 3], [-2, 0], [0, 2**32 + 1]])
def test_remap_refuses_map_values_that_do_not_fit_int32(values):
    """Such values used to wrap to another (held) local id; now they raise."""
    expert_map = np.array(values, np.int64)
    with pytest.raises(ValueError, match=r"expert_map values must be -1 .* \[0, 2147483647\]"):
        remap_to_local(np.array([0, 1], np.int32), expert_map)


def test_remap_accepts_a_wide_map_within_int32():
    expert_map = np.array([-1, 0, 2**31 - 1], np.int64)
    ids = np.array([2, 1, 0, 3], np.int64)
    np.testing.assert_array_equal(remap_to_local(ids, expert_map), reference.remap_to_local(ids, expert_map))
    np.testing.assert_array_equal(remap_to_local(ids, expert_map), [2**31 - 1, 0, -1, -1])


@pytest.mark.parametrize("dtype", [np.int64, np.int8])
def test_the_row_limit_is_checked_before_a_broadcast_view_is_copied(dtype):
    """2**31 rows of a one-element broadcast: refused on the shape (the copy it used to
    make first was 2-16 GiB)."""
    import tracemalloc

    ids = np.broadcast_to(np.zeros((1, 1), dtype), (2**31, 1))
    layout = ExpertLayout(8)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"topk_ids.shape\[0\]=2147483648 exceeds the int32"):
            logical_to_physical(ids, layout)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
