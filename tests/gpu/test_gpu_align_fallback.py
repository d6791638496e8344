"""align_block_size_array_api (the GPU path's fallback align) against the NumPy reference."""

import numpy as np
import pytest

from moeroute.gpu.align_fallback import align_block_size_array_api
from moeroute.routing import reference

# (tokens, top_k, num_experts, block_size, lowest id, highest id + 1): ids outside [0, E) included.
CASES = [
    (3, 2, 4, 2, 0, 4),
    (1, 1, 1, 16, 0, 1),
    (37, 3, 5, 16, -2, 7),
    (64, 8, 16, 64, -1, 16),
    (5, 4, 128, 128, 0, 128),
    (200, 2, 3, 32, -1, 3),
    (0, 4, 6, 16, 0, 6),
]


def _check(topk_ids, num_experts, block_size):
    sorted_ids, expert_ids, total = align_block_size_array_api(topk_ids, num_experts, block_size)
    want_sorted, want_experts, want_total = reference.align_block_size(topk_ids, num_experts, block_size)
    assert sorted_ids.dtype == np.int32 and expert_ids.dtype == np.int32
    np.testing.assert_array_equal(sorted_ids, want_sorted)
    np.testing.assert_array_equal(expert_ids, want_experts)
    assert int(total) == want_total


def test_spec_example():
    ids = np.array([[0, 1], [1, 2], [0, 2]], dtype=np.int32)
    sorted_ids, expert_ids, total = align_block_size_array_api(ids, 4, 2)
    assert sorted_ids.tolist() == [0, 4, 1, 2, 3, 5, 6, 6, 6, 6]
    assert expert_ids.tolist() == [0, 1, 2, -1, -1]
    assert int(total) == 6


@pytest.mark.parametrize("tokens, top_k, num_experts, block_size, low, high", CASES)
def test_matches_reference(tokens, top_k, num_experts, block_size, low, high):
    rng = np.random.default_rng(tokens * 1000 + num_experts)
    topk_ids = rng.integers(low, high, size=(tokens, top_k)).astype(np.int32)
    _check(topk_ids, num_experts, block_size)


def test_every_id_invalid():
    topk_ids = np.full((6, 2), -1, dtype=np.int32)
    topk_ids[0, 0] = 9
    _check(topk_ids, 4, 16)


def test_expert_counts_around_block_size():
    # experts holding 0, 1, B-1, B and B+1 entries
    block_size = 16
    counts = [0, 1, block_size - 1, block_size, block_size + 1]
    flat = np.repeat(np.arange(len(counts)), counts).astype(np.int32)
    np.random.default_rng(0).shuffle(flat)
    _check(flat.reshape(-1, 1), len(counts), block_size)
