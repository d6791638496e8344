"""Placement metrics: planned rank loads, measured physical counters, folding replicas."""

from __future__ import annotations

import numpy as np
import pytest

import _eplb_reference as ref
from moeroute.eplb import (
    Placement,
    balancedness,
    balancedness_from_physical,
    fold_physical_load,
    linear_placement,
    rank_load,
    rank_load_from_physical,
    round_robin_placement,
)
from moeroute.layout import ExpertLayout


def test_physical_counters_give_rank_load_and_balancedness():
    counts = np.array([[5, 1, 0, 2, 2, 2], [0, 0, 0, 0, 0, 0]])
    assert rank_load_from_physical(counts, 3).tolist() == [[6, 2, 4], [0, 0, 0]]
    assert balancedness_from_physical(counts, 3).tolist() == pytest.approx([4 / 6, 1.0])
    assert balancedness_from_physical(counts[0], 2) == pytest.approx(6 / 6)  # [6, 6]


def test_fold_adds_replicas_into_their_logical_expert():
    table = np.array([[0, 1, 2, 0, 0, 3], [3, 2, 1, 0, 1, 1]])
    counts = np.array([[4, 1, 2, 3, 5, 7], [1, 2, 3, 4, 5, 6]])
    expected = np.zeros((2, 4))
    for layer in range(2):
        for p in range(6):
            expected[layer, table[layer, p]] += counts[layer, p]
    assert fold_physical_load(counts, table, 4).tolist() == expected.tolist()
    assert fold_physical_load(counts[0], table[0], 4).tolist() == expected[0].tolist()


def test_even_split_matches_measured_counters_of_an_even_split():
    # When every replica receives exactly load / count, the planned and the measured
    # metrics agree.
    load = np.array([12.0, 6.0, 3.0, 3.0])
    table = np.array([0, 1, 0, 2, 0, 3, 1, 0])
    counts = np.bincount(table, minlength=4)
    physical = load[table] / counts[table]
    assert rank_load(load, table, 4).tolist() == rank_load_from_physical(physical, 4).tolist()
    assert balancedness(load, table, 4) == pytest.approx(balancedness_from_physical(physical, 4))
    assert balancedness(load, table, 4) == pytest.approx(
        ref.balancedness(ref.rank_loads(load.tolist(), table.tolist(), 4))
    )


def test_linear_and_round_robin_tables_are_the_layouts():
    for e in (1, 2, 4):
        assert (
            linear_placement(8, 12)[0].tolist()
            == ExpertLayout(
                8, ep_size=e, dispatch="none" if e == 1 else "all2all", num_redundant_experts=4
            ).physical_to_logical.tolist()
        )
        assert (
            round_robin_placement(8, 12, e)[0].tolist()
            == ExpertLayout(
                8, ep_size=e, dispatch="none" if e == 1 else "all2all", num_redundant_experts=4, placement="round_robin"
            ).physical_to_logical.tolist()
        )


def test_placement_round_trips_and_validates():
    plan = Placement([[0, 1, 2, 0], [2, 1, 0, 0]], 2)
    assert plan.replica_counts.tolist() == [[2, 1, 1], [2, 1, 1]]
    assert plan.logical_to_physical.tolist() == [[[0, 3], [1, -1], [2, -1]], [[2, 3], [1, -1], [0, -1]]]
    assert plan.duplicates().tolist() == [0, 1]
    assert Placement.from_dict(plan.to_dict()) == plan
    with pytest.raises(ValueError, match="ep_size=3 does not divide the 4"):
        Placement([0, 1, 2, 0], 3)
    with pytest.raises(ValueError, match=r"no replica of logical expert\(s\) \[1\]"):
        Placement([0, 0, 2, 0], 2, 3)
    with pytest.raises(ValueError, match="integer array"):
        Placement([0.5, 1.0], 1)
    with pytest.raises(ValueError, match="physical_to_logical and ep_size"):
        Placement.from_dict({"ep_size": 2})


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: rank_load([1.0, 2.0], [0, 1, 0], 2), ["ep_size=2", "divide", "3"]),
        (lambda: rank_load([1.0, 2.0], [0, 5], 2), ["physical_to_logical", "[0, 2)"]),
        (lambda: rank_load([1.0, 2.0], [0], 1), ["fewer than the 2 logical"]),
        (lambda: rank_load([[1.0, 2.0]] * 3, [[0, 1]] * 2, 1), ["2 layers", "load has 3"]),
        (lambda: rank_load_from_physical([1.0, -2.0], 1), ["physical_load", "negative"]),
        (lambda: fold_physical_load([1.0, 2.0, 3.0], [0, 1], 2), ["2 physical", "num_physical_experts=3"]),
    ],
)
def test_metric_bad_input(call, words):
    with pytest.raises(ValueError) as info:
        call()
    for word in words:
        assert word in str(info.value)
