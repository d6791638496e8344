"""The NumPy reference against independent formulations: torch routing as engines write it,
the worked examples of docs/semantics.md, and per-entry loops for the dispatch operations."""

import numpy as np
import pytest
import torch

from moeroute.config import RouterConfig
from moeroute.routing import reference

ROUTING_CASES = [
    # (num_experts, top_k, scoring, groups, topk_group, renormalize, rsf, bias)
    (256, 8, "sigmoid", 8, 4, True, 2.5, True),  # DeepSeek-V3
    (384, 8, "sigmoid", 1, 1, True, 2.827, True),  # Kimi-K2
    (128, 8, "softmax", 1, 1, True, 1.0, False),  # Qwen3-30B-A3B
    (60, 4, "softmax", 1, 1, False, 1.0, False),  # Qwen1.5-MoE
    (64, 6, "softmax", 8, 3, True, 16.0, False),  # DeepSeek-V2 style group_limited_greedy
    (256, 8, "sqrtsoftplus", 8, 4, True, 2.5, True),  # SGLang's biased top-k, sqrt-softplus
    (64, 4, "sqrtsoftplus", 1, 1, False, 1.0, False),
    (32, 4, "none", 1, 1, False, 1.5, False),  # FlashInfer's TopK: the raw logits
]


def torch_route(logits, cfg, bias):
    """Routing as transformers' DeepSeek-V3 / Qwen blocks compute it (float64, no ties here)."""
    x = torch.from_numpy(logits).double()
    scores = {
        "sigmoid": x.sigmoid,
        "sqrtsoftplus": lambda: torch.nn.functional.softplus(x).sqrt(),
        "none": lambda: x,
    }.get(cfg.scoring, lambda: x.softmax(-1))()
    choice = scores + torch.from_numpy(bias).double() if bias is not None else scores
    T, N = x.shape
    G = cfg.num_expert_group
    if G > 1:
        grouped = choice.view(T, G, N // G)
        gscore = grouped.topk(2, dim=-1)[0].sum(-1) if bias is not None else grouped.max(-1)[0]
        keep = gscore.topk(cfg.topk_group, dim=-1)[1]
        mask = torch.zeros(T, G, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~mask.repeat_interleave(N // G, dim=1), float("-inf"))
    ids = choice.topk(cfg.top_k, dim=-1)[1]
    w = scores.gather(1, ids)
    if cfg.renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return (w * cfg.routed_scaling_factor).numpy(), ids.numpy()


@pytest.mark.parametrize("case", ROUTING_CASES)
def test_select_matches_torch_formulation(case):
    N, K, scoring, G, tg, renorm, rsf, with_bias = case
    cfg = RouterConfig(
        N, K, scoring=scoring, num_expert_group=G, topk_group=tg, renormalize=renorm, routed_scaling_factor=rsf
    )
    rng = np.random.default_rng(N + K)
    logits = rng.standard_normal((257, N)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(N)).astype(np.float32) if with_bias else None
    w, ids = reference.select_experts(logits, cfg, bias)
    w_ref, ids_ref = torch_route(logits, cfg, bias)
    np.testing.assert_array_equal(ids, ids_ref)
    np.testing.assert_allclose(w, w_ref, rtol=1e-6)


def test_select_ties_lower_id_and_lower_group_win():
    cfg = RouterConfig(8, 2, scoring="sigmoid", num_expert_group=4, topk_group=2)
    logits = np.zeros((1, 8), np.float32)  # every expert and group tied
    _, ids = reference.select_experts(logits, cfg)
    np.testing.assert_array_equal(ids, [[0, 1]])
    logits[0, 7] = 1.0  # group 3 now leads; ties among the rest go to group 0, expert 0
    _, ids = reference.select_experts(logits, cfg)
    np.testing.assert_array_equal(ids, [[7, 0]])


def test_select_nan_and_inf_rows():
    cfg = RouterConfig(6, 3, scoring="softmax")
    logits = np.array([[np.nan] * 6, [0, np.inf, 0, 1, np.nan, 2], [-np.inf] * 6], np.float32)
    w, ids = reference.select_experts(logits, cfg)
    # +inf takes all the mass; the rest underflow to exact zeros and tie by id.
    np.testing.assert_array_equal(ids, [[0, 1, 2], [1, 0, 2], [0, 1, 2]])
    np.testing.assert_allclose(w, [[1 / 3] * 3, [1, 0, 0], [1 / 3] * 3], rtol=1e-6)
    # A NaN correction bias makes a NaN choice, which ranks below every value.
    bias = np.zeros(6, np.float32)
    bias[0] = np.nan
    _, ids = reference.select_experts(np.zeros((1, 6), np.float32), cfg, bias)
    np.testing.assert_array_equal(ids, [[1, 2, 3]])


def test_align_worked_example():
    sorted_ids, expert_ids, padded = reference.align_block_size(
        np.array([[0, 1], [1, 2], [0, 2]]), num_experts=4, block_size=2
    )
    np.testing.assert_array_equal(sorted_ids, [0, 4, 1, 2, 3, 5, 6, 6, 6, 6])
    np.testing.assert_array_equal(expert_ids, [0, 1, 2, -1, -1])
    assert padded == 6


def test_sort_permute_combine_against_loops():
    rng = np.random.default_rng(1)
    T, K, E, H = 37, 3, 5, 4
    ids = rng.integers(-1, E + 1, size=(T, K))  # includes ids to drop (-1 and E)
    x = rng.standard_normal((T, H)).astype(np.float32)
    w = rng.random((T, K)).astype(np.float32)
    slots, offsets, inverse = reference.sort_by_expert(ids, E)
    expected = [t * K + k for e in range(E) for t in range(T) for k in range(K) if ids[t, k] == e]
    np.testing.assert_array_equal(slots, expected)
    np.testing.assert_array_equal(np.diff(offsets), [(ids == e).sum() for e in range(E)])
    permuted, _, _ = reference.permute(x, ids, E)
    scale = np.arange(1, E + 1, dtype=np.float32)
    expert_id_of_row = np.repeat(np.arange(E), np.diff(offsets))
    y = permuted * scale[expert_id_of_row, None]  # expert e multiplies by e + 1
    out = reference.combine(y, inverse, w)
    loop = np.zeros((T, H), np.float64)
    for t in range(T):
        for k in range(K):
            if 0 <= ids[t, k] < E:
                loop[t] += w[t, k] * (ids[t, k] + 1) * x[t]
    np.testing.assert_allclose(out, loop, rtol=1e-5, atol=1e-6)


def test_gpt_oss_routing_is_softmax_with_renormalize():
    # top-k of the logits, then softmax over the K picked (transformers' GptOssTopKRouter).
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((65, 32)).astype(np.float32)
    top, ids = torch.topk(torch.from_numpy(logits).double(), 4, dim=-1)
    w, got_ids = reference.select_experts(logits, RouterConfig(32, 4, "softmax", renormalize=True))
    np.testing.assert_array_equal(got_ids, ids.numpy())
    np.testing.assert_allclose(w, torch.softmax(top, dim=-1).numpy(), rtol=1e-6)


def test_align_with_expert_map_worked_example():
    # Rank 1 of N=8, S=1, E=2 holds physical 5..9 as local 0..4.
    expert_map = np.array([-1] * 5 + [0, 1, 2, 3, 4], np.int32)
    ids = np.array([[5, 0], [9, 6], [-1, 5], [12, 7]])
    sorted_ids, expert_ids, total = reference.align_block_size(ids, 5, 2, expert_map)
    # local 0: flat 0, 5; local 1: flat 3; local 2: flat 7; local 4: flat 2 (ids 0, -1, 12 dropped).
    assert sorted_ids.tolist()[:8] == [0, 5, 3, 8, 7, 8, 2, 8]
    assert expert_ids.tolist()[:5] == [0, 1, 2, 4, -1]
    assert total == 8


def test_expert_load_counts_by_loop():
    ids = np.array([[3, 0, -1], [3, 7, 2], [9, 3, 0]])
    counts = [sum(int(v) == e for v in ids.reshape(-1)) for e in range(8)]
    assert reference.expert_load(ids, 8).tolist() == counts == [2, 0, 1, 3, 0, 0, 0, 1]
