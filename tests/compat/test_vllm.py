"""moeroute.compat.vllm against a plain torch formulation of vLLM's reference routing."""

from __future__ import annotations

import pytest
import torch

from moeroute.compat.vllm import fused_topk, grouped_topk

WEIGHT_RTOL = 1e-6  # float32 weights: a few ulps between the kernel and torch
TOKENS = 33
LOGIT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _topk(values, k):
    """torch.topk with ties to the lower index (bfloat16 logits tie often; vLLM leaves
    ties to torch.topk, moeroute gives them to the lower id)."""
    values, ids = torch.sort(values, dim=-1, descending=True, stable=True)
    return values[:, :k], ids[:, :k]


def vllm_fused_topk(gating_output, topk, renormalize):
    """vLLM's torch-native fused_topk: float32 softmax, topk, divide by the sum."""
    scores = torch.softmax(gating_output.float(), dim=-1)
    weights, ids = _topk(scores, topk)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def vllm_grouped_topk(
    gating_output,
    topk,
    renormalize,
    num_expert_group,
    topk_group,
    scoring_func="softmax",
    routed_scaling_factor=1.0,
    e_score_correction_bias=None,
):
    """vLLM's torch grouped_topk, with the scores in float32."""
    logits = gating_output.float()
    scores = torch.softmax(logits, dim=-1) if scoring_func == "softmax" else logits.sigmoid()
    tokens = scores.shape[0]
    original_scores = scores
    if e_score_correction_bias is not None:
        scores = scores + e_score_correction_bias.float().unsqueeze(0)
        group_scores = scores.view(tokens, num_expert_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
    else:
        group_scores = scores.view(tokens, num_expert_group, -1).max(dim=-1).values
    group_idx = _topk(group_scores, topk_group)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = (
        group_mask.unsqueeze(-1)
        .expand(tokens, num_expert_group, scores.shape[-1] // num_expert_group)
        .reshape(tokens, -1)
    )
    masked = scores.masked_fill(~score_mask.bool(), float("-inf"))
    ids = _topk(masked, topk)[1]
    weights = original_scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights * routed_scaling_factor
    return weights.to(torch.float32), ids.to(torch.int32)


def _inputs(tokens, experts, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, 16, generator=generator)
    logits = torch.randn(tokens, experts, generator=generator).to(dtype)
    return hidden, logits


@pytest.mark.parametrize("dtype", LOGIT_DTYPES, ids=str)
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("experts,topk", [(8, 2), (64, 6), (128, 8)])
def test_fused_topk_matches_vllm(dtype, renormalize, experts, topk):
    hidden, logits = _inputs(TOKENS, experts, dtype, experts)
    weights, ids = fused_topk(hidden, logits, topk, renormalize)
    ref_weights, ref_ids = vllm_fused_topk(logits, topk, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=WEIGHT_RTOL, atol=0)


@pytest.mark.parametrize("indices_type", [torch.int64, torch.int16, torch.int32, None], ids=str)
def test_fused_topk_indices_type(indices_type):
    hidden, logits = _inputs(TOKENS, 64, torch.float32, 1)
    _, ids = fused_topk(hidden, logits, 4, True, indices_type=indices_type)
    _, ref_ids = vllm_fused_topk(logits, 4, True)
    assert ids.dtype == (indices_type or torch.int32)
    assert torch.equal(ids.long(), ref_ids.long())


GROUPED_CASES = {
    # DeepSeek-V3: sigmoid + bias, 8 groups of 32, keep 4, rsf 2.5
    "deepseek-v3": dict(
        experts=256,
        topk=8,
        num_expert_group=8,
        topk_group=4,
        scoring_func="sigmoid",
        routed_scaling_factor=2.5,
        bias=True,
        renormalize=True,
    ),
    # DeepSeek-V2: softmax, no bias, groups scored by their max, no renormalization
    "deepseek-v2": dict(
        experts=160,
        topk=6,
        num_expert_group=8,
        topk_group=3,
        scoring_func="softmax",
        routed_scaling_factor=1.0,
        bias=False,
        renormalize=False,
    ),
    # Kimi-K2 / GLM-4.5: one group, sigmoid + bias
    "one-group": dict(
        experts=64,
        topk=8,
        num_expert_group=1,
        topk_group=1,
        scoring_func="sigmoid",
        routed_scaling_factor=2.827,
        bias=True,
        renormalize=True,
    ),
}


@pytest.mark.parametrize("dtype", LOGIT_DTYPES, ids=str)
@pytest.mark.parametrize("name", list(GROUPED_CASES))
def test_grouped_topk_matches_vllm(name, dtype):
    case = GROUPED_CASES[name]
    hidden, logits = _inputs(TOKENS, case["experts"], dtype, 7)
    bias = torch.randn(case["experts"], generator=torch.Generator().manual_seed(3)) * 0.1 if case["bias"] else None
    kwargs = dict(
        num_expert_group=case["num_expert_group"],
        topk_group=case["topk_group"],
        scoring_func=case["scoring_func"],
        routed_scaling_factor=case["routed_scaling_factor"],
        e_score_correction_bias=bias,
    )
    weights, ids = grouped_topk(hidden, logits, case["topk"], case["renormalize"], **kwargs)
    ref_weights, ref_ids = vllm_grouped_topk(logits, case["topk"], case["renormalize"], **kwargs)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=WEIGHT_RTOL, atol=1e-7)


def test_grouped_topk_defaults_mean_no_grouping():
    hidden, logits = _inputs(TOKENS, 32, torch.float32, 9)
    weights, ids = grouped_topk(hidden, logits, 4, True)
    ref_weights, ref_ids = vllm_fused_topk(logits, 4, True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=WEIGHT_RTOL, atol=0)


def test_bfloat16_bias_is_upcast():
    hidden, logits = _inputs(TOKENS, 64, torch.float32, 11)
    bias = (torch.randn(64, generator=torch.Generator().manual_seed(4)) * 0.1).to(torch.bfloat16)
    weights, ids = grouped_topk(hidden, logits, 4, True, 4, 2, "sigmoid", 1.0, bias)
    ref_weights, ref_ids = grouped_topk(hidden, logits, 4, True, 4, 2, "sigmoid", 1.0, bias.float())
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)


def test_zero_tokens():
    weights, ids = fused_topk(torch.empty(0, 16), torch.empty(0, 8), 2, True)
    assert weights.shape == ids.shape == (0, 2)
    weights, ids = grouped_topk(torch.empty(0, 16), torch.empty(0, 8), 2, True, 2, 1)
    assert weights.shape == ids.shape == (0, 2)


def test_bad_arguments_are_named():
    hidden, logits = _inputs(4, 16, torch.float32)
    with pytest.raises(TypeError, match="gating_output must be a torch.Tensor"):
        fused_topk(hidden, logits.numpy(), 2, True)
    with pytest.raises(ValueError, match="first dimensions must match"):
        fused_topk(hidden[:3], logits, 2, True)
    with pytest.raises(ValueError, match="gating_output must be 2-D"):
        fused_topk(hidden, logits[None], 2, True)
    with pytest.raises(ValueError, match="top_k"):
        fused_topk(hidden, logits, 17, True)
    with pytest.raises(TypeError, match="indices_type"):
        fused_topk(hidden, logits, 2, True, indices_type=torch.float32)
    with pytest.raises(ValueError, match="cannot hold expert id 299"):
        fused_topk(torch.zeros(2, 1), torch.zeros(2, 300), 2, True, indices_type=torch.int8)
    with pytest.raises(ValueError, match="scoring_func='tanh'"):
        grouped_topk(hidden, logits, 2, True, 4, 2, scoring_func="tanh")
    with pytest.raises(ValueError, match="num_expert_group"):
        grouped_topk(hidden, logits, 2, True, 3, 1)
    with pytest.raises(ValueError, match="num_expert_group=-1"):
        grouped_topk(hidden, logits, 2, True, -1, 1)
    with pytest.raises(ValueError, match="correction_bias shape"):
        grouped_topk(hidden, logits, 2, True, 4, 2, "sigmoid", 1.0, torch.zeros(15))


# Arguments are checked before the config cache: the same answer whatever came before.


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda h, g: fused_topk(h, g, [2], True), TypeError, r"topk=\[2\] must be an integer"),
        (lambda h, g: fused_topk(h, g, 2.0, True), TypeError, r"topk=2.0 must be an integer.*float"),
        (lambda h, g: fused_topk(h, g, True, True), TypeError, r"topk=True must be an integer"),
        (lambda h, g: fused_topk(h, g, "2", True), TypeError, r"topk='2' must be an integer"),
        (lambda h, g: fused_topk(h, g, 2, 1), TypeError, r"renormalize=1 must be a bool"),
        (
            lambda h, g: grouped_topk(h, g, 2, True, 4, 2, "softmax", None),
            TypeError,
            r"routed_scaling_factor=None must be a real number in \[1e-06, 1e\+06\], got NoneType",
        ),
        (
            lambda h, g: grouped_topk(h, g, 2, True, 4, 2, "softmax", "2.5"),
            TypeError,
            r"routed_scaling_factor='2.5' must be a real number.*got str",
        ),
        (lambda h, g: grouped_topk(h, g, 2, True, 4, 2, "softmax", [2.5]), TypeError, r"routed_scaling_factor=\[2.5\]"),
        (
            lambda h, g: grouped_topk(h, g, 2, True, 4, 2, "softmax", 0.0),
            ValueError,
            r"routed_scaling_factor=0.0 must be a finite real number",
        ),
        (
            lambda h, g: grouped_topk(h, g, 2, True, 4.0, 2),
            TypeError,
            r"num_expert_group=4.0 must be an integer >= 0, got float",
        ),
        (lambda h, g: grouped_topk(h, g, 2, True, 4, [2]), TypeError, r"topk_group=\[2\]"),
        (
            lambda h, g: fused_topk(h, g.to("meta"), 2, True),
            ValueError,
            r"gating_output is on meta; routing runs on cpu or cuda tensors",
        ),
    ],
    ids=[
        "topk-list",
        "topk-float",
        "topk-bool",
        "topk-str",
        "renormalize-int",
        "rsf-none",
        "rsf-str",
        "rsf-list",
        "rsf-range",
        "groups-float",
        "topk-group-list",
        "meta",
    ],
)
def test_bad_arguments_refused_whatever_came_before(call, error, match):
    hidden, logits = _inputs(4, 16, torch.float32)
    # Warm the config cache with the valid neighbours first (2 == 2.0, 4 == 4.0 as keys).
    fused_topk(hidden, logits, 2, True)
    grouped_topk(hidden, logits, 2, True, 4, 2, "softmax", 2.5)
    grouped_topk(hidden, logits, 2, True, 4, 2)
    with pytest.raises(error, match=match):
        call(hidden, logits)


def test_numpy_integers_are_integers_for_every_argument():
    """np.int64 is accepted for topk, num_expert_group and topk_group alike (and np.float64
    for the scaling factor), with the same result as Python ints."""
    np = pytest.importorskip("numpy")
    hidden, logits = _inputs(TOKENS, 16, torch.float32, seed=3)
    want_w, want_ids = vllm_grouped_topk(logits, 3, True, 4, 2, routed_scaling_factor=2.5)
    weights, ids = grouped_topk(
        hidden, logits, np.int64(3), np.bool_(True), np.int64(4), np.int32(2), "softmax", np.float64(2.5)
    )
    torch.testing.assert_close(ids, want_ids, rtol=0, atol=0)
    torch.testing.assert_close(weights, want_w, rtol=WEIGHT_RTOL, atol=0)
    weights, ids = fused_topk(hidden, logits, np.int64(3), True)
    want_w, want_ids = vllm_fused_topk(logits, 3, True)
    torch.testing.assert_close(ids, want_ids, rtol=0, atol=0)
    torch.testing.assert_close(weights, want_w, rtol=WEIGHT_RTOL, atol=0)
