"""Tests for moeroute.layout: placement, shared slots, ownership, replicas, errors."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeroute.layout import (
    REPLICA_HASH_MULTIPLIER,
    ExpertLayout,
    LayoutError,
)

# ----------------------------------------------------------------------------
# Independent references


def reference_routed_blocks(num_physical, ep_size):
    """Routed physical ids of each rank: numpy's array_split gives the first P % E ranks one more."""
    return [chunk.tolist() for chunk in np.array_split(np.arange(num_physical), ep_size)]


def reference_physical_ids(num_physical, ep_size, num_shared, slots):
    """Per rank: list of (physical id, kind) in local order, built by plain enumeration."""
    blocks = reference_routed_blocks(num_physical, ep_size)
    ranks = []
    if slots == "per_rank":
        next_id = 0
        for block in blocks:
            entries = []
            for p in block:
                entries.append((next_id, ("routed", p)))
                next_id += 1
            for j in range(num_shared):
                entries.append((next_id, ("shared", j)))
                next_id += 1
            ranks.append(entries)
    else:
        for block in blocks:
            entries = [(p, ("routed", p)) for p in block]
            if slots == "global":
                entries += [(num_physical + j, ("shared", j)) for j in range(num_shared)]
            ranks.append(entries)
    return ranks


def reference_replica(replicas, token_row):
    return replicas[((token_row * 2654435769) % 2**32) % len(replicas)]


# ----------------------------------------------------------------------------
# Worked examples


def test_worked_example_8_routed_1_shared_2_ranks_all2all():
    layout = ExpertLayout(8, 1, ep_size=2, dispatch="all2all")
    assert layout.shared == "fused"
    assert layout.shared_slots == "per_rank"
    assert layout.num_physical_experts == 10
    assert layout.expert_map(0).tolist() == [0, 1, 2, 3, 4, -1, -1, -1, -1, -1]
    assert layout.expert_map(1).tolist() == [-1, -1, -1, -1, -1, 0, 1, 2, 3, 4]
    assert layout.routed_id_map.tolist() == [0, 1, 2, 3, 5, 6, 7, 8]
    assert layout.shared_slot_ids(0).tolist() == [4]
    assert layout.shared_slot_ids(1).tolist() == [9]
    assert layout.owner_rank.tolist() == [0] * 5 + [1] * 5
    assert [layout.num_local_experts(r) for r in range(2)] == [5, 5]
    assert layout.expert_map(0).dtype == np.int32
    assert layout.shared_slot_ids(1).dtype == np.int32


def test_512_routed_1_shared_8_ranks_tiles_exactly():
    layout = ExpertLayout(512, 1, ep_size=8, dispatch="all2all")
    assert (layout.shared, layout.shared_slots) == ("fused", "per_rank")
    assert layout.num_physical_experts == 520
    assert [layout.num_local_experts(r) for r in range(8)] == [65] * 8
    covered = np.zeros(520, dtype=int)
    for rank in range(8):
        held = np.flatnonzero(layout.expert_map(rank) >= 0)
        assert held.tolist() == list(range(65 * rank, 65 * (rank + 1)))
        covered[held] += 1
        assert layout.shared_slot_ids(rank).tolist() == [65 * rank + 64]
    assert (covered == 1).all()
    assert layout.check_backend() == []


def test_global_slots_single_rank():
    layout = ExpertLayout(6, 2)
    assert (layout.shared, layout.shared_slots) == ("fused", "global")
    assert layout.num_physical_experts == 8
    assert layout.expert_map(0).tolist() == list(range(8))
    assert layout.shared_slot_ids(0).tolist() == [6, 7]
    assert layout.owner_rank.tolist() == [0] * 6 + [-1, -1]
    assert layout.routed_id_map.tolist() == list(range(6))


def test_global_slots_under_allgather_are_home_rank_masked():
    layout = ExpertLayout(9, 2, ep_size=2, dispatch="allgather", shared_slots="global")
    assert layout.home_rank_masked
    assert layout.num_physical_experts == 11
    assert layout.expert_map(0).tolist() == [0, 1, 2, 3, 4, -1, -1, -1, -1, 5, 6]
    assert layout.expert_map(1).tolist() == [-1] * 5 + [0, 1, 2, 3, 4, 5]
    assert layout.shared_slot_ids(1).tolist() == [9, 10]
    assert [layout.num_local_experts(r) for r in range(2)] == [7, 6]


def test_per_rank_equals_global_on_one_rank():
    per_rank = ExpertLayout(8, 2, dispatch="none", shared_slots="per_rank")
    global_ = ExpertLayout(8, 2, dispatch="none", shared_slots="global")
    assert per_rank.expert_map(0).tolist() == global_.expert_map(0).tolist()
    assert per_rank.shared_slot_ids(0).tolist() == global_.shared_slot_ids(0).tolist()
    assert per_rank.num_physical_experts == global_.num_physical_experts == 10


# ----------------------------------------------------------------------------
# Linear placement

PLACEMENT_CASES = [(8, 1), (8, 2), (10, 4), (257, 8), (3, 3), (100, 7), (512, 8), (5, 2)]


@pytest.mark.parametrize("num_physical, ep_size", PLACEMENT_CASES)
def test_routed_range_matches_array_split(num_physical, ep_size):
    dispatch = "none" if ep_size == 1 else "all2all"
    layout = ExpertLayout(num_physical, ep_size=ep_size, dispatch=dispatch)
    for rank, block in enumerate(reference_routed_blocks(num_physical, ep_size)):
        assert layout.routed_range(rank) == (block[0], len(block))
        assert layout.num_local_experts(rank) == len(block)


def test_placement_with_redundant_experts_uses_p():
    layout = ExpertLayout(8, ep_size=3, dispatch="all2all", num_redundant_experts=1)
    assert layout.num_routed_physical == 9
    assert [layout.routed_range(r) for r in range(3)] == [(0, 3), (3, 3), (6, 3)]


@pytest.mark.parametrize("rank", [-1, 2, 2.0, True])
def test_rank_out_of_range(rank):
    layout = ExpertLayout(8, 1, ep_size=2, dispatch="all2all")
    with pytest.raises(ValueError, match="rank"):
        layout.expert_map(rank)
    with pytest.raises(ValueError, match="home_rank"):
        layout.shared_slot_ids(rank)


# ----------------------------------------------------------------------------
# Properties over random layouts


@st.composite
def layouts(draw):
    n = draw(st.integers(1, 40))
    r = draw(st.integers(0, 12))
    e = draw(st.integers(1, min(n + r, 9)))
    s = draw(st.integers(0, 3))
    dispatch = "none" if e == 1 and draw(st.booleans()) else draw(st.sampled_from(["all2all", "allgather"]))
    shared = draw(st.sampled_from(["auto", "fused", "runner", "overlap"]))
    slots = None
    if shared in ("auto", "fused"):
        allowed = [None, "per_rank"]
        if dispatch != "all2all" or e == 1:
            allowed.append("global")
        slots = draw(st.sampled_from(allowed))
    # The physical id space (blocks, slots, maps) is the same for every placement.
    placement = draw(st.sampled_from(["linear", "round_robin"]))
    return ExpertLayout(n, s, e, dispatch, shared, slots, r, placement=placement)


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_every_physical_id_held_once_and_local_ids_dense(layout):
    e, s, p = layout.ep_size, layout.num_shared_experts, layout.num_routed_physical
    maps = np.stack([layout.expert_map(r) for r in range(e)])
    assert maps.shape == (e, layout.num_physical_experts)
    holders = (maps >= 0).sum(axis=0)
    shared_global = np.zeros(layout.num_physical_experts, dtype=bool)
    if layout.shared_slots == "global":
        shared_global[p:] = True
    assert (holders[shared_global] == e).all()
    assert (holders[~shared_global] == 1).all()
    for rank in range(e):
        local = np.sort(maps[rank][maps[rank] >= 0])
        assert local.tolist() == list(range(layout.num_local_experts(rank)))
    # num_physical_experts formula
    expected = {None: p, "global": p + s, "per_rank": p + e * s}[layout.shared_slots]
    assert layout.num_physical_experts == expected
    # owner_rank agrees with expert_map
    for pid in range(layout.num_physical_experts):
        owners = np.flatnonzero(maps[:, pid] >= 0)
        want = -1 if shared_global[pid] else int(owners[0])
        assert layout.owner_rank[pid] == want


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_layout_matches_enumeration_reference(layout):
    reference = reference_physical_ids(
        layout.num_routed_physical,
        layout.ep_size,
        layout.num_shared_experts,
        layout.shared_slots,
    )
    for rank, entries in enumerate(reference):
        emap = layout.expert_map(rank)
        start, count = layout.routed_range(rank)
        for local_id, (pid, (kind, index)) in enumerate(entries):
            assert emap[pid] == local_id
            if kind == "routed":
                assert layout.routed_id_map[index] == pid
                assert emap[layout.routed_id_map[index]] == index - start
            else:
                assert layout.shared_slot_ids(rank)[index] == pid
                assert emap[pid] == count + index
        assert (emap >= 0).sum() == len(entries)
    if layout.shared != "fused":
        assert layout.shared_slot_ids(0).size == 0


# ----------------------------------------------------------------------------
# Shared-expert resolution (docs/semantics.md section 3)

# (S, E, dispatch, unfusable_reason) -> (shared, shared_slots, home_rank_masked)
AUTO_TABLE = [
    (0, 1, "none", None, "none", None, False),
    (0, 4, "all2all", None, "none", None, False),
    (0, 4, "allgather", "does not split", "none", None, False),
    (1, 1, "none", None, "fused", "global", False),
    (2, 1, "all2all", None, "fused", "per_rank", False),
    (1, 4, "all2all", None, "fused", "per_rank", False),
    (1, 4, "allgather", None, "fused", "per_rank", False),
    (1, 1, "none", "does not split", "runner", None, False),
    (1, 1, "all2all", "does not split", "runner", None, False),
    (1, 4, "all2all", "does not split", "overlap", None, False),
    (4, 4, "allgather", "a routed_input_transform is set", "overlap", None, False),
]


@pytest.mark.parametrize("s, e, dispatch, reason, shared, slots, masked", AUTO_TABLE)
def test_auto_resolution(s, e, dispatch, reason, shared, slots, masked):
    layout = ExpertLayout(8, s, e, dispatch, "auto", unfusable_reason=reason)
    assert (layout.shared, layout.shared_slots, layout.home_rank_masked) == (shared, slots, masked)
    if reason is not None and s:
        assert reason in layout.shared_reason


@pytest.mark.parametrize("mode", ["runner", "overlap", "fused", "auto"])
def test_no_shared_expert_resolves_to_none(mode):
    layout = ExpertLayout(8, 0, 2, "all2all", mode, "per_rank" if mode == "fused" else None)
    assert layout.shared == "none" and layout.shared_slots is None
    assert layout.num_physical_experts == 8
    assert "no shared expert" in layout.shared_reason


@pytest.mark.parametrize("mode", ["runner", "overlap"])
def test_explicit_non_fused_modes(mode):
    layout = ExpertLayout(8, 1, 2, "all2all", mode)
    assert layout.shared == mode and layout.shared_slots is None
    assert layout.num_physical_experts == 8
    assert layout.num_local_experts(0) == 4
    assert "requested" in layout.shared_reason


def test_explicit_fused_with_requested_slots():
    layout = ExpertLayout(8, 1, 2, "allgather", "fused", "global")
    assert (layout.shared, layout.shared_slots, layout.home_rank_masked) == ("fused", "global", True)
    layout = ExpertLayout(8, 1, 2, "allgather", "fused", "per_rank")
    assert (layout.shared_slots, layout.home_rank_masked) == ("per_rank", False)
    layout = ExpertLayout(8, 1, 1, "all2all", "fused", "global")
    assert layout.shared_slots == "global"


# ----------------------------------------------------------------------------
# Errors

ERROR_CASES = [
    (dict(num_routed_experts=8, ep_size=0), r"ep_size=0 must be an integer >= 1"),
    (dict(num_routed_experts=0), r"num_routed_experts=0"),
    (dict(num_routed_experts=8.0), r"num_routed_experts=8.0 must be an integer"),
    (dict(num_routed_experts=8, num_shared_experts=-1), r"num_shared_experts=-1"),
    (dict(num_routed_experts=8, num_redundant_experts=-2), r"num_redundant_experts=-2"),
    (dict(num_routed_experts=8, ep_size=2), r"dispatch='none' serves a single rank.*all2all.*allgather"),
    (
        dict(num_routed_experts=3, ep_size=4, dispatch="all2all"),
        r"3 routed physical experts \(N=3 \+ R=0\) over ep_size=4.*ep_size <= 3",
    ),
    (dict(num_routed_experts=8, dispatch="deepep"), r"unknown dispatch='deepep'.*'all2all'"),
    (dict(num_routed_experts=8, shared="always"), r"unknown shared='always'.*'fused'"),
    (
        dict(num_routed_experts=8, num_shared_experts=1, shared_slots="local"),
        r"unknown shared_slots='local'.*'per_rank'",
    ),
    (dict(num_routed_experts=8, scaling_regime="both"), r"unknown scaling_regime='both'.*'output'"),
    (dict(num_routed_experts=8, num_redundant_experts=2, replica_table=[1]), r"replica_table has shape \(1,\).*\[2\]"),
    (dict(num_routed_experts=8, num_redundant_experts=2, replica_table=[1, 8]), r"replica_table\[1\]=8.*\[0, 8\)"),
    (dict(num_routed_experts=8, num_redundant_experts=1, replica_table=[-1]), r"replica_table\[0\]=-1"),
    (dict(num_routed_experts=8, num_redundant_experts=1, replica_table=[0.5]), r"integers"),
    (dict(num_routed_experts=8, unfusable_reason=""), r"unfusable_reason"),
    (
        dict(
            num_routed_experts=8,
            num_shared_experts=1,
            shared="fused",
            unfusable_reason="a routed_input_transform is set",
        ),
        r"shared='fused' is impossible: a routed_input_transform is set.*'overlap'.*'runner'",
    ),
    (
        dict(num_routed_experts=8, num_shared_experts=1, shared_slots="per_rank", unfusable_reason="it does not split"),
        r"shared_slots='per_rank'.*impossible: it does not split",
    ),
    (
        dict(num_routed_experts=8, num_shared_experts=1, ep_size=2, dispatch="all2all", shared_slots="global"),
        r"shared_slots='global' cannot be served by dispatch='all2all'.*per_rank.*runner",
    ),
    (
        dict(
            num_routed_experts=8,
            num_shared_experts=1,
            ep_size=2,
            dispatch="all2all",
            shared="fused",
            shared_slots="global",
        ),
        r"shared_slots='global' cannot be served",
    ),
    (
        dict(num_routed_experts=8, num_shared_experts=1, shared="runner", shared_slots="global"),
        r"shared slots only exist when the shared expert is fused",
    ),
    (
        dict(
            num_routed_experts=8,
            num_shared_experts=1,
            ep_size=2,
            dispatch="all2all",
            shared="overlap",
            shared_slots="per_rank",
        ),
        r"shared_slots='per_rank' was requested with shared='overlap'",
    ),
]


@pytest.mark.parametrize("kwargs, message", ERROR_CASES)
def test_layout_errors(kwargs, message):
    with pytest.raises(LayoutError, match=message):
        ExpertLayout(**kwargs)


def spec_says_invalid(n, s, e, r, dispatch, shared, slots, reason):
    """docs/semantics.md sections 2-3 as a plain decision list."""
    if dispatch == "none" and e > 1 or n + r < e:
        return True
    if s == 0:
        return False
    if shared in ("runner", "overlap"):
        return slots is not None
    if reason is not None:
        return shared == "fused" or slots is not None
    slots = slots or ("global" if dispatch == "none" else "per_rank")
    return slots == "global" and dispatch == "all2all" and e > 1


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(1, 12),
    s=st.integers(0, 2),
    e=st.integers(1, 6),
    r=st.integers(0, 3),
    dispatch=st.sampled_from(["none", "all2all", "allgather"]),
    shared=st.sampled_from(["auto", "runner", "overlap", "fused"]),
    slots=st.sampled_from([None, "global", "per_rank"]),
    reason=st.sampled_from([None, "it does not split"]),
)
def test_raises_exactly_when_spec_says_invalid(n, s, e, r, dispatch, shared, slots, reason):
    args = (n, s, e, r, dispatch, shared, slots, reason)
    if spec_says_invalid(*args):
        with pytest.raises(LayoutError):
            ExpertLayout(n, s, e, dispatch, shared, slots, r, unfusable_reason=reason)
    else:
        layout = ExpertLayout(n, s, e, dispatch, shared, slots, r, unfusable_reason=reason)
        if s and shared == "auto":
            fused_ok = reason is None
            assert layout.shared == ("fused" if fused_ok else "overlap" if e > 1 else "runner")


def test_layout_error_is_value_error():
    assert issubclass(LayoutError, ValueError)


def test_immutable():
    layout = ExpertLayout(8, 1, 2, "all2all")
    with pytest.raises(AttributeError, match="immutable"):
        layout.ep_size = 4
    with pytest.raises(AttributeError, match="immutable"):
        layout._shared = "runner"
    for array in (layout.routed_id_map, layout.owner_rank, layout.replica_ids, layout.replica_offsets):
        assert not array.flags.writeable
    fresh = layout.expert_map(0)
    fresh[0] = 7  # a fresh array: editing it leaves the layout alone
    assert layout.expert_map(0)[0] == 0


# ----------------------------------------------------------------------------
# Replicas


def test_default_replicas_follow_p_mod_n():
    layout = ExpertLayout(4, num_redundant_experts=6, ep_size=2, dispatch="all2all")
    # physical 4..9 replicate 0,1,2,3,0,1
    assert layout.physical_to_logical.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert layout.replica_offsets.tolist() == [0, 3, 6, 8, 10]
    assert layout.replica_ids.tolist() == [0, 4, 8, 1, 5, 9, 2, 6, 3, 7]


def test_replica_table():
    layout = ExpertLayout(4, num_redundant_experts=3, replica_table=np.array([2, 2, 0]))
    assert layout.physical_to_logical.tolist() == [0, 1, 2, 3, 2, 2, 0]
    assert layout.replica_offsets.tolist() == [0, 2, 3, 6, 7]
    assert layout.replica_ids.tolist() == [0, 6, 1, 2, 4, 5, 3]
    assert layout.replica_ids.dtype == np.int32 and layout.replica_offsets.dtype == np.int32


@pytest.mark.parametrize("table", [None, [3, 3, 1, 0, 3]])
def test_choose_replica_matches_formula(table):
    n = 4
    layout = ExpertLayout(n, num_redundant_experts=5, replica_table=table)
    logical_of = list(range(n)) + ([(n + i) % n for i in range(5)] if table is None else table)
    for logical in range(n):
        replicas = [p for p, owner in enumerate(logical_of) if owner == logical]
        for row in [0, 1, 2, 3, 17, 1000, 2**31 + 5, 2**40 + 3]:
            assert layout.choose_replica(logical, row) == reference_replica(replicas, row)


def test_replica_hash_constant_and_spread():
    assert REPLICA_HASH_MULTIPLIER == 2654435769
    layout = ExpertLayout(2, num_redundant_experts=4)  # logical 0 has physical 0, 2, 4
    picks = [layout.choose_replica(0, row) for row in range(300)]
    assert sorted(set(picks)) == [0, 2, 4]
    assert min(picks.count(p) for p in (0, 2, 4)) > 80


def test_choose_replica_errors():
    layout = ExpertLayout(4, num_redundant_experts=1)
    with pytest.raises(ValueError, match=r"logical_id=4 must be an integer in \[0, 4\)"):
        layout.choose_replica(4, 0)
    with pytest.raises(ValueError, match=r"token_row=-1"):
        layout.choose_replica(0, -1)


def test_replicas_never_touch_shared_slots():
    layout = ExpertLayout(4, 1, 2, "all2all", num_redundant_experts=2)
    assert layout.replica_ids.size == 6
    assert set(layout.replica_ids.tolist()) == set(range(6))
    # routed physical 0..5 over 2 ranks, per-rank slot after each block
    assert layout.routed_id_map.tolist() == [0, 1, 2, 4, 5, 6]
    assert layout.shared_slot_ids(0).tolist() == [3]
    assert layout.shared_slot_ids(1).tolist() == [7]


# ----------------------------------------------------------------------------
# Shared slot weight (docs/semantics.md section 3)


def test_shared_slot_weight_router_regime():
    layout = ExpertLayout(8, 1)
    assert layout.shared_slot_weight() == 1.0
    assert layout.shared_slot_weight(None, routed_scaling_factor=2.5) == 1.0
    gate = np.array([0.25, 0.5], dtype=np.float32)
    out = layout.shared_slot_weight(gate, routed_scaling_factor=2.5)
    np.testing.assert_array_equal(out, gate)
    assert out.dtype == np.float32


def test_shared_slot_weight_output_regime():
    layout = ExpertLayout(8, 1, scaling_regime="output")
    assert layout.shared_slot_weight(routed_scaling_factor=2.5) == pytest.approx(0.4)
    gate = np.array([0.25, 0.5], dtype=np.float32)
    np.testing.assert_allclose(layout.shared_slot_weight(gate, 2.5), gate / 2.5, rtol=1e-7)
    assert layout.shared_slot_weight(0.5, 4.0) == pytest.approx(0.125)


def test_shared_slot_weight_torch_tensor():
    torch = pytest.importorskip("torch")
    layout = ExpertLayout(8, 1, scaling_regime="output")
    gate = torch.tensor([[0.5], [1.0]], dtype=torch.bfloat16)
    out = layout.shared_slot_weight(gate, 2.0)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    assert out.flatten().tolist() == [0.25, 0.5]


@pytest.mark.parametrize("rsf", [0.0, -1.0, float("nan"), float("inf"), "2", True])
def test_shared_slot_weight_bad_rsf(rsf):
    with pytest.raises(ValueError, match="routed_scaling_factor"):
        ExpertLayout(8, 1).shared_slot_weight(0.5, rsf)


# ----------------------------------------------------------------------------
# Backend checks, describe, identity


def test_check_backend_reports_uneven_blocks():
    layout = ExpertLayout(256, 1, 8, "all2all", num_redundant_experts=1)
    problems = layout.check_backend("equal_blocks")
    assert len(problems) == 1
    assert problems[0].startswith("P % E != 0: 257 routed physical experts over 8 ranks")
    assert "add 7 redundant experts" in problems[0]
    assert ExpertLayout(256, 1, 8, "all2all", num_redundant_experts=8).check_backend() == []


def test_check_backend_reports_global_slots():
    layout = ExpertLayout(8, 1, 2, "allgather", shared_slots="global")
    problems = layout.check_backend()
    assert len(problems) == 1 and "per_rank" in problems[0]
    assert ExpertLayout(8, 1, shared_slots="global").check_backend() == []


def test_check_backend_unknown_requirement():
    with pytest.raises(ValueError, match=r"unknown requirement='mori'.*'equal_blocks'"):
        ExpertLayout(8).check_backend("mori")


def test_describe_states_ranges_and_owner():
    layout = ExpertLayout(8, 1, 2, "all2all")
    text = layout.describe()
    assert "physical experts: 10" in text
    assert "[0, 5)" in text and "[5, 10)" in text
    assert "[4, 8) -> [5, 9)" in text
    assert layout.shared_reason in text
    assert "per_rank" in text and "compatible" in text
    rows = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit()]
    assert [(row[0], row[3]) for row in rows] == [("0", "5"), ("1", "5")]


def test_describe_uneven_and_unfused():
    layout = ExpertLayout(10, 1, 4, "all2all", unfusable_reason="it does not split")
    text = layout.describe()
    assert "physical experts: 10" in text
    for rank, (start, count) in enumerate([(0, 3), (3, 3), (6, 2), (8, 2)]):
        assert f"[{start}, {start + count})" in text
    assert "shared expert: overlap" in text and "it does not split" in text
    assert "P % E != 0" in text


def test_describe_global_masked_and_replicas():
    layout = ExpertLayout(6, 2, 2, "allgather", shared_slots="global", num_redundant_experts=2)
    text = layout.describe()
    assert "physical experts: 10" in text
    assert "[0, 4) + [8, 10)" in text
    assert "home rank" in text
    assert "6->0, 7->1" in text


def test_equality_hash_and_repr_round_trip():
    layouts_ = [
        ExpertLayout(8, 1, 2, "all2all"),
        ExpertLayout(8, 1, 2, "allgather", shared_slots="global", scaling_regime="output"),
        ExpertLayout(8, 1, 2, "all2all", unfusable_reason="no split"),
        ExpertLayout(8, 0, 1, num_redundant_experts=2, replica_table=[5, 5]),
    ]
    for layout in layouts_:
        rebuilt = eval(repr(layout), {"ExpertLayout": ExpertLayout})
        assert rebuilt == layout and hash(rebuilt) == hash(layout)
    assert layouts_[0] != layouts_[1]
    assert ExpertLayout(8, 1, 2, "all2all") == ExpertLayout(8, 1, 2, "all2all", "fused", "per_rank")


# ----------------------------------------------------------------------------
# Placements: round-robin and general physical_to_logical tables (docs/semantics.md section 9)


def reference_round_robin(n, r, e, replica_table=None):
    """Logical experts of each rank, by enumeration: entry q of the linear sequence
    (q < N: q, else its replica) goes to rank q % E."""
    sequence = list(range(n)) + ([(n + i) % n for i in range(r)] if replica_table is None else list(replica_table))
    return [[sequence[q] for q in range(len(sequence)) if q % e == rank] for rank in range(e)]


@pytest.mark.parametrize("n, r, e", [(8, 0, 2), (16, 0, 4), (10, 0, 3), (8, 2, 3), (64, 7, 8), (5, 0, 5), (6, 3, 4)])
@pytest.mark.parametrize("s, dispatch", [(0, "all2all"), (1, "all2all"), (2, "allgather")])
def test_round_robin_places_logical_r_r_plus_e(n, r, e, s, dispatch):
    layout = ExpertLayout(n, s, e, dispatch, num_redundant_experts=r, placement="round_robin")
    assert layout.placement == "round_robin"
    expected = reference_round_robin(n, r, e)
    for rank in range(e):
        assert layout.logical_experts(rank).tolist() == expected[rank]
        start, count = layout.routed_range(rank)
        assert count == len(expected[rank])
        # The physical id space keeps its per-rank blocks: expert_map and owner_rank agree.
        emap = layout.expert_map(rank)
        for local, p in enumerate(range(start, start + count)):
            physical = int(layout.routed_id_map[p])
            assert emap[physical] == local and layout.owner_rank[physical] == rank
    if r == 0:
        # vLLM's round-robin: rank r holds logical r, r+E, r+2E, ...
        for rank in range(e):
            assert layout.logical_experts(rank).tolist() == list(range(rank, n, e))
    # Shared slots and the equal-block check do not depend on the placement.
    linear = ExpertLayout(n, s, e, dispatch, num_redundant_experts=r)
    assert layout.num_physical_experts == linear.num_physical_experts
    assert layout.check_backend() == linear.check_backend()
    for rank in range(e):
        np.testing.assert_array_equal(layout.shared_slot_ids(rank), linear.shared_slot_ids(rank))
        np.testing.assert_array_equal(layout.expert_map(rank), linear.expert_map(rank))


def test_round_robin_with_replica_table():
    layout = ExpertLayout(4, 0, 3, "all2all", num_redundant_experts=2, replica_table=[3, 1], placement="round_robin")
    # Linear sequence 0, 1, 2, 3, 3, 1: rank 0 takes entries 0 and 3, rank 1 1 and 4, ...
    assert [layout.logical_experts(r).tolist() for r in range(3)] == [[0, 3], [1, 3], [2, 1]]
    assert repr(layout).endswith("replica_table=[3, 1], placement='round_robin')")


def test_round_robin_replicas_follow_the_hash_rule():
    layout = ExpertLayout(6, 0, 4, "all2all", num_redundant_experts=2, placement="round_robin")
    table = layout.physical_to_logical
    for logical in range(6):
        replicas = np.flatnonzero(table == logical).tolist()
        assert len(replicas) == (2 if logical < 2 else 1)
        for row in (0, 1, 5, 77):
            assert layout.choose_replica(logical, row) == reference_replica(replicas, row)


TABLE_CASES = [
    ([0, 1, 2, 3], 2),
    ([3, 2, 1, 0], 2),
    ([0, 1, 2, 3, 0, 0, 3], 3),
    ([2, 0, 1, 2, 3, 2, 1, 0], 4),
]


@pytest.mark.parametrize("table, e", TABLE_CASES)
def test_physical_to_logical_table(table, e):
    layout = ExpertLayout(4, 1, e, "all2all", physical_to_logical=table)
    assert layout.placement == "table"
    assert layout.num_redundant_experts == len(table) - 4
    assert layout.physical_to_logical.tolist() == table
    blocks = reference_routed_blocks(len(table), e)
    for rank in range(e):
        assert layout.logical_experts(rank).tolist() == [table[p] for p in blocks[rank]]
    for logical in range(4):
        replicas = [p for p, x in enumerate(table) if x == logical]
        got = layout.replica_ids[layout.replica_offsets[logical] : layout.replica_offsets[logical + 1]]
        assert got.tolist() == replicas
    again = eval(repr(layout), {"ExpertLayout": ExpertLayout})
    assert again == layout and hash(again) == hash(layout)
    # num_redundant_experts may be given when it agrees with the table.
    assert ExpertLayout(4, 1, e, "all2all", num_redundant_experts=len(table) - 4, physical_to_logical=table) == layout


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(physical_to_logical=[0, 1, 2]), r"shape \(3,\).*P >= num_routed_experts=4"),
        (dict(physical_to_logical=[[0, 1, 2, 3]]), r"shape \(1, 4\)"),
        (dict(physical_to_logical=[0, 1, 2, 2]), r"no replica of logical expert\(s\) \[3\]"),
        (dict(physical_to_logical=[0, 1, 2, 3, 4]), r"physical_to_logical\[4\]=4 is not a logical"),
        (dict(physical_to_logical=[0, 1, 2, -1, 3]), r"physical_to_logical\[3\]=-1"),
        (dict(physical_to_logical=[0.0, 1.0, 2.0, 3.0]), "must hold integers"),
        (
            dict(physical_to_logical=[0, 1, 2, 3, 0], num_redundant_experts=2),
            "num_redundant_experts=2 disagrees with physical_to_logical of length 5",
        ),
        (
            dict(physical_to_logical=[0, 1, 2, 3, 0], num_redundant_experts=1, replica_table=[0]),
            "physical_to_logical and replica_table",
        ),
        (
            dict(physical_to_logical=[0, 1, 2, 3], placement="round_robin"),
            "placement='round_robin' cannot be combined with physical_to_logical",
        ),
        (dict(placement="blocked"), "unknown placement='blocked'"),
        (dict(physical_to_logical=[0, 1, 2, 3], ep_size=5), "would leave a rank with no routed"),
    ],
)
def test_placement_errors(kwargs, message):
    args = dict(num_routed_experts=4, ep_size=2, dispatch="all2all")
    args.update(kwargs)
    with pytest.raises(LayoutError, match=message):
        ExpertLayout(**args)


def test_preferred_replicas_keep_traffic_on_the_rank():
    table = [0, 1, 2, 3, 0, 2, 0, 3]  # ranks of 2: [0, 1] [2, 3] [0, 2] [0, 3]
    layout = ExpertLayout(4, 0, 4, "all2all", physical_to_logical=table)
    for rank in range(4):
        offsets, ids = layout.preferred_replicas(rank)
        start, count = layout.routed_range(rank)
        for logical in range(4):
            replicas = [p for p, x in enumerate(table) if x == logical]
            local = [p for p in replicas if start <= p < start + count]
            assert ids[offsets[logical] : offsets[logical + 1]].tolist() == (local or replicas)
    with pytest.raises(ValueError, match=r"prefer_rank=4 is outside \[0, 4\)"):
        layout.preferred_replicas(4)


def test_describe_names_the_placement_and_each_ranks_logical_experts():
    text = ExpertLayout(8, 1, 2, "all2all", placement="round_robin").describe()
    assert "placement: round_robin" in text
    assert "rank 0: 0, 2, 4, 6" in text and "rank 1: 1, 3, 5, 7" in text
    text = ExpertLayout(4, 0, 2, "all2all", physical_to_logical=[3, 2, 1, 0, 0]).describe()
    assert "placement: physical_to_logical table" in text
    assert "rank 0: 3, 2, 1" in text and "rank 1: 0, 0" in text
    long = ExpertLayout(40, 0, 2, "all2all", placement="round_robin").describe()
    assert "rank 0: 0, 2, 4" in long and "... (4 more)" in long


def test_round_robin_equality_and_repr():
    a = ExpertLayout(8, 1, 2, "all2all", placement="round_robin")
    b = ExpertLayout(8, 1, 2, "all2all")
    assert a != b
    # Layouts that place every expert alike are equal, however they were described.
    assert a == ExpertLayout(8, 1, 2, "all2all", physical_to_logical=[0, 2, 4, 6, 1, 3, 5, 7])
    assert b == ExpertLayout(8, 1, 2, "all2all", physical_to_logical=list(range(8)))
    again = eval(repr(a), {"ExpertLayout": ExpertLayout})
    assert again == a and hash(again) == hash(a)


# ---------------------------------------------------------------------------- int32 id limit


@pytest.mark.parametrize(
    "kwargs, total",
    [
        (dict(num_routed_experts=2**31 + 5), 2**31 + 5),
        (dict(num_routed_experts=2**31 - 2, num_redundant_experts=2), 2**31),
        (dict(num_routed_experts=2**31 - 8, num_shared_experts=2, ep_size=4, dispatch="all2all"), 2**31),
    ],
)
def test_layout_refuses_ids_beyond_int32_before_allocating(kwargs, total):
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(LayoutError, match=rf"= {total} physical experts exceed the int32 id limit 2147483647"):
            ExpertLayout(**kwargs)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # refused before any id table was built


def test_layout_id_limit_is_the_int32_maximum():
    """N + R + E*S may reach 2**31 - 1 (the largest int32); one more is refused."""
    from moeroute.layout import MAX_PHYSICAL_EXPERTS

    assert MAX_PHYSICAL_EXPERTS == np.iinfo(np.int32).max
    with pytest.raises(LayoutError, match="exceed the int32 id limit"):
        ExpertLayout(MAX_PHYSICAL_EXPERTS, 1)
