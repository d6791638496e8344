"""eplb.apply's agreement on 2 gloo ranks: everything a rank acts on is compared first.

Ranks that agreed on the table but not on its ep_size passed the check; one refused the
request locally while the other started the transfer, and the next forward aborted a
process. Now both raise the same RankMismatchError naming the field, and nothing moves.
"""

from __future__ import annotations

import pytest

from _eplb_agreement_workers import TABLE, agreement_worker
from helpers.gloo import spawn_group

#: The group's collective timeout: a rank left waiting fails the test instead of stalling it.
GROUP_TIMEOUT_S = 30


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    return spawn_group(agreement_worker, 2, tmp_path_factory.mktemp("agreement"), timeout_s=GROUP_TIMEOUT_S)


@pytest.mark.parametrize(
    "case, fields",
    [
        ("ep_size", ["eplb.placement.ep_size: rank 0=2, rank 1=4"]),
        ("dtype", ["eplb.layer0.dtype", "torch.bfloat16", "eplb.expert_tensors"]),
    ],
)
def test_ranks_that_disagree_on_a_field_raise_the_same_error_naming_it(records, case, fields):
    outcomes = [rank_records[case] for rank_records in records]
    messages = {outcome["outcome"] for outcome in outcomes}
    assert len(messages) == 1, messages  # the same error on both ranks
    (message,) = messages
    assert "disagree on the EPLB placement" in message
    for field in fields:
        assert field in message
    assert all(outcome["table_kept"] and outcome["rows_kept"] for outcome in outcomes)


def test_ranks_that_agree_apply_the_placement(records):
    for rank_records in records:
        assert rank_records["agreed"]["outcome"] == "applied"
        assert rank_records["agreed"]["table"] == TABLE
