"""A rank dying inside the EPLB transfer: the survivors raise within seconds and keep their
old placement (its own file: the 3-rank group runs with a short process-group timeout)."""

from __future__ import annotations

from _eplb_workers import SHORT_TIMEOUT_S, dead_peer_worker
from helpers.gloo import spawn_group

#: Survivors of a dead peer must raise within this many seconds (gloo timeout plus noise).
PEER_FAILURE_DEADLINE_S = 20


def test_a_rank_dying_in_the_transfer_leaves_the_survivors_on_the_old_placement(tmp_path):
    results = spawn_group(dead_peer_worker, 3, tmp_path, timeout_s=SHORT_TIMEOUT_S, every_rank=False)
    assert results[2] is None  # it died
    for record in results[:2]:
        assert record["outcome"].startswith("CollectiveError")
        assert "keeps its old placement" in record["outcome"]
        assert record["seconds"] < PEER_FAILURE_DEADLINE_S
        assert record["table_kept"] and record["weights_kept"] and not record["pending"]
