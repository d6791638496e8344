"""Live re-placement on 2 and 4 gloo ranks: outputs, weights, bytes, async, agreement, dead peer.

One spawned group per world size runs every (dispatch, shared) mode; the assertions compare
with what _eplb_workers computed from plain definitions.
"""

from __future__ import annotations

import pytest

from _eplb_workers import HELD_CASES, HELD_FORWARDS, TOLERANCE, live_worker
from helpers.gloo import spawn_group

MODES = [f"{d}-{s}" for d in ("all2all", "allgather") for s in ("runner", "overlap", "fused")]


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels():
    """Compile the routing kernels here once, so the ranks load them from Numba's cache."""
    import torch

    from _eplb_workers import N
    from helpers.modules import CountingMLP
    from moeroute.bindings.torch.moe import MoE
    from moeroute.config import RouterConfig
    from moeroute.eplb import rebalance

    rebalance([1.0] * N, N + 2, 2, previous=list(range(N)) + [0, 1])
    for shared in ("fused", "runner"):
        module = MoE(
            RouterConfig(N, 2),
            16,
            8,
            CountingMLP(16, 8),
            torch.nn.Linear(16, 1, bias=False),
            shared=shared,
            num_redundant_experts=2,
            record_load=True,
        )
        with torch.no_grad():
            module(torch.randn(5, 16))


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    cache = {}

    def get(world_size):
        if world_size not in cache:
            try:
                cache[world_size] = spawn_group(
                    live_worker, world_size, tmp_path_factory.mktemp(f"live{world_size}"), {"more": world_size == 2}
                )
            except AssertionError as error:
                cache[world_size] = error
        if isinstance(cache[world_size], AssertionError):
            raise cache[world_size]
        return cache[world_size]

    return get


def _record(results, rank, name):
    return next(r for r in results[rank] if r["name"] == name)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("mode", MODES)
def test_outputs_weights_and_bytes_after_a_live_rebalance(live, world_size, mode):
    results = live(world_size)
    for rank in range(world_size):
        record = _record(results, rank, mode)
        assert record["shared_mode"] == mode.split("-")[1]
        assert record["load"] == record["expected_load"]  # gather_load: group sum, folded
        assert record["tables"] == record["expected_tables"]
        assert record["wrong_weights"] == 0
        assert record["error"] <= TOLERANCE
        assert record["bytes_received"] == record["expected_bytes_received"]
        assert record["experts_moved"] == record["expected_moved"] > 0
        assert record["total_sent"] == record["total_received"] > 0
        # The skewed load is better balanced after (experts 0 and 1 are hot).
        assert all(a > b for a, b in zip(record["balancedness_after"], record["balancedness_before"]))


def test_async_apply_swaps_every_rank_at_the_same_forward(live):
    results = live(2)
    for name in ("async-all2all", "async-allgather"):
        records = [_record(results, rank, name) for rank in range(2)]
        assert all(r["pending_after_apply"] for r in records)
        assert len({r["swapped_at"] for r in records}) == 1 and records[0]["swapped_at"] is not None
        for record in records:
            assert record["done"] and record["tables"] == record["expected_tables"]
            assert max(record["errors"]) <= TOLERANCE


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("case", ["-".join([d, s, "posted" if p else "deferred"]) for d, s, p in HELD_CASES])
def test_async_apply_keeps_the_old_placement_while_the_transfer_is_in_flight(live, world_size, case):
    """The transfer is held open (_eplb_workers.HeldTransfer) for several forwards: they
    compute with the old placement and weights; the forward after its release swaps."""
    for rank in range(world_size):
        record = _record(live(world_size), rank, "held-" + case)
        assert record["moved"] > 0  # the placement changes
        assert len(record["during"]) == HELD_FORWARDS
        for forward in record["during"]:
            assert forward["error"] <= TOLERANCE  # NaN (read the receive buffer early) fails too
            assert forward["pending"] and not forward["done"]
            assert forward["tables"] == record["old_tables"]
            assert forward["rows_kept"]  # nothing written into the live expert tensors yet
        assert not record["waited_while_held"]  # no forward blocked on the transfer
        assert record["after_done"] and not record["after_pending"], record["error"]
        assert record["after_tables"] == record["expected_tables"] != record["old_tables"]
        assert record["wrong_weights"] == 0
        assert record["after_error"] <= TOLERANCE


def test_ranks_that_disagree_raise_everywhere_and_keep_the_old_placement(live):
    results = [_record(live(2), rank, "disagree") for rank in range(2)]
    messages = {r["outcome"] for r in results}
    assert len(messages) == 1
    (message,) = messages
    assert "disagree on the EPLB placement" in message and "eplb.placement" in message
    assert all(r["table_kept"] and r["weights_kept"] for r in results)
