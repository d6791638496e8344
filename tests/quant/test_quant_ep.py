"""FP8 experts under expert parallelism (2 gloo ranks): fp8_block 128x128 at I = 200, 64x128
at I = 100 (EP-split size, not a block multiple), fp8_tensor at I = 100; all2all and
allgather; runner/overlap/fused shared.

Each rank holds only its experts (FP8, never dequantized) and must reproduce the
single-process w8a8 reference with the shared contribution counted once.
"""

from __future__ import annotations

import pytest

from _quant_ep_workers import JOIN_TIMEOUT_S, N, fp8_worker
from helpers.gloo import spawn_group

RTOL = 2e-2


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_group(fp8_worker, 2, tmp_path_factory.mktemp("fp8_ep"), join_timeout_s=JOIN_TIMEOUT_S)


def test_every_case_matches_the_reference(results):
    cases = [case for rank_cases in results for case in rank_cases]
    assert len(cases) == 2 * 3 * 2 * 3  # ranks x (format, I) x dispatch x shared mode
    for case in cases:
        assert case["error"] < RTOL, case
        assert case["shared_calls"] == (0 if case["shared"] == "fused" else 1), case


def test_each_rank_holds_its_experts(results):
    for rank, rank_cases in enumerate(results):
        for case in rank_cases:
            assert case["local_experts"] == list(range(rank * N // 2, (rank + 1) * N // 2))
