"""select_experts on the CPU (NumPy in, NumPy out) against reference.select_experts.

Ids are compared exactly, weights with rtol 1e-6 (about 8 float32 ulps: the kernel's exp
and sums round differently from NumPy's by an ulp or two). On random data, exact ids can
legitimately differ only where two choices sit within float rounding of each other at a
decision the routing makes; `near_tie_rows` finds those rows with an independent float64
computation, every other row must match exactly, and mismatches must stay ~0.
"""

import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from moeroute.config import PRESETS, RouterConfig
from moeroute.routing import reference
from moeroute.routing.reference import FLOAT32_MAX
from moeroute.routing.select import select_experts

WEIGHT_RTOL = 1e-6
# Choices closer than this (relative, or absolute below 1e-2) count as a near tie: float32
# rounding of scores (~6e-8 relative) may order them either way.
NEAR_TIE_RTOL = 1e-5
NEAR_TIE_FLOOR = 1e-2
# At most this fraction of rows may have ids differing from the reference (only near ties).
MAX_MISMATCH_FRACTION = 1e-3

PRESET_NAMES = [
    "deepseek-v3",
    "kimi-k2",
    "glm-4.5",
    "qwen3-30b-a3b",
    "qwen3.5-moe",
    "qwen1.5-moe-a2.7b",
    "mixtral-8x7b",
]
TOKEN_COUNTS = [0, 1, 7, 333, 4096]
DTYPES = ["float32", "float16"]
CASES = [(name, tokens, dtype) for name in PRESET_NAMES for tokens in TOKEN_COUNTS for dtype in DTYPES]


def rng_for(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def draw_inputs(preset, num_tokens, dtype, rng):
    config = preset.router
    logits = rng.standard_normal((num_tokens, config.num_experts)).astype(dtype)
    bias = None
    if preset.has_correction_bias:
        bias = (0.1 * rng.standard_normal(config.num_experts)).astype(np.float32)
    return logits, bias


def float64_scores(logits, scoring):
    """Independent float64 scores of finite logits (docs/semantics.md sections 1 and 9)."""
    x = logits.astype(np.float64)
    if scoring == "sigmoid":
        return 1.0 / (1.0 + np.exp(-x))
    if scoring == "sqrtsoftplus":
        return np.sqrt(np.logaddexp(0.0, x))
    if scoring == "none":
        return x
    if x.size == 0:
        return x
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def near_tie_rows(logits, config, bias):
    """Rows where a decision (group cut-off, pick order, K-th vs K+1-th) is a near tie.

    Independent float64 definition of docs/semantics.md section 1 for finite logits. Exact ties (equal
    inputs) are not near ties: both sides compute equal values and take the lower id.
    """
    scores = float64_scores(logits, config.scoring)
    choice = scores if bias is None else scores + bias.astype(np.float64)

    def close(a, b):
        gap = np.abs(a - b)
        scale = np.maximum(np.maximum(np.abs(a), np.abs(b)), NEAR_TIE_FLOOR)
        return (gap > 0) & (gap < NEAR_TIE_RTOL * scale)

    num_tokens, num_experts = choice.shape
    near = np.zeros(num_tokens, dtype=bool)
    allowed = np.ones_like(choice, dtype=bool)
    groups = config.num_expert_group
    if groups > 1:
        grouped = np.sort(choice.reshape(num_tokens, groups, -1), axis=-1)[..., ::-1]
        group_score = grouped[..., 0] + grouped[..., 1] if bias is not None else grouped[..., 0]
        order = np.argsort(-group_score, axis=1, kind="stable")
        ranked = np.take_along_axis(group_score, order, axis=1)
        cut = config.topk_group
        if cut < groups:
            near |= close(ranked[:, cut - 1], ranked[:, cut])
        kept = np.zeros((num_tokens, groups), dtype=bool)
        np.put_along_axis(kept, order[:, :cut], True, axis=1)
        allowed = np.repeat(kept, num_experts // groups, axis=1)
    ranked = -np.sort(-np.where(allowed, choice, -np.inf), axis=1)
    last = min(config.top_k + 1, int(allowed[0].sum())) if num_tokens else 0
    for k in range(last - 1):
        near |= close(ranked[:, k], ranked[:, k + 1])
    return near


def assert_matches_reference(logits, config, bias=None):
    weights, ids = select_experts(logits, config, bias)
    ref_weights, ref_ids = reference.select_experts(logits, config, bias)
    assert weights.dtype == np.float32 and ids.dtype == np.int32
    assert weights.shape == ids.shape == (logits.shape[0], config.top_k)
    same = (ids == ref_ids).all(axis=1)
    mismatched = np.flatnonzero(~same)
    if mismatched.size:
        near = near_tie_rows(logits[mismatched], config, bias)
        assert near.all(), f"rows {mismatched[~near][:5]} differ from the reference"
        assert mismatched.size <= MAX_MISMATCH_FRACTION * logits.shape[0], mismatched.size
    np.testing.assert_allclose(weights[same], ref_weights[same], rtol=WEIGHT_RTOL, atol=0)
    return weights, ids


@pytest.mark.parametrize("preset_name,num_tokens,dtype", CASES)
def test_matches_reference(preset_name, num_tokens, dtype):
    preset = PRESETS[preset_name]
    logits, bias = draw_inputs(preset, num_tokens, dtype, rng_for(preset_name, num_tokens, dtype))
    assert_matches_reference(logits, preset.router, bias)


def test_near_tie_detector_flags_a_rounding_tie_and_not_an_exact_one():
    config = RouterConfig(4, 1, "softmax")
    logits = np.array([[1.0, 1.0 + 2e-7, 0.0, 0.0], [2.0, 2.0, 0.0, 0.0], [3.0, 1.0, 0.0, 0.0]], dtype=np.float32)
    np.testing.assert_array_equal(near_tie_rows(logits, config, None), [True, False, False])


CONFIG_CASES = {
    "softmax, no renormalize": RouterConfig(64, 6, "softmax", renormalize=False, routed_scaling_factor=1.5),
    "sigmoid, no bias": RouterConfig(96, 8, "sigmoid", renormalize=True, routed_scaling_factor=2.0),
    "sigmoid, no bias, no renormalize": RouterConfig(96, 8, "sigmoid", renormalize=False),
    "softmax, groups (max)": RouterConfig(128, 8, "softmax", num_expert_group=8, topk_group=3),
    "sigmoid, groups (max)": RouterConfig(
        64, 4, "sigmoid", num_expert_group=4, topk_group=2, routed_scaling_factor=2.5
    ),
    "K = N": RouterConfig(16, 16, "softmax"),
    "K = 32": RouterConfig(256, 32, "softmax"),
    "K = 1": RouterConfig(64, 1, "sigmoid", renormalize=True),
    "groups of 2": RouterConfig(32, 4, "sigmoid", num_expert_group=16, topk_group=4),
    "sqrtsoftplus": RouterConfig(96, 8, "sqrtsoftplus", renormalize=True, routed_scaling_factor=2.5),
    "sqrtsoftplus, no renormalize": RouterConfig(64, 6, "sqrtsoftplus", renormalize=False),
    "sqrtsoftplus, groups": RouterConfig(64, 4, "sqrtsoftplus", num_expert_group=8, topk_group=2),
    "none": RouterConfig(64, 4, "none", renormalize=False, routed_scaling_factor=1.5),
    "none, renormalize": RouterConfig(32, 1, "none", renormalize=True),
    "none, groups": RouterConfig(64, 6, "none", num_expert_group=4, topk_group=2, renormalize=False),
}


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("name", list(CONFIG_CASES))
def test_configurations_match_reference(name, with_bias):
    config = CONFIG_CASES[name]
    rng = rng_for(name, with_bias)
    logits = (2.0 * rng.standard_normal((513, config.num_experts))).astype(np.float32)
    bias = (0.3 * rng.standard_normal(config.num_experts)).astype(np.float32) if with_bias else None
    assert_matches_reference(logits, config, bias)


def test_zero_tokens_returns_empty_outputs():
    config = PRESETS["deepseek-v3"].router
    weights, ids = select_experts(np.empty((0, 256), np.float32), config, np.zeros(256, np.float32))
    assert weights.shape == ids.shape == (0, 8)
    assert weights.dtype == np.float32 and ids.dtype == np.int32


def test_equal_logits_pick_the_lowest_ids():
    config = RouterConfig(8, 3, "softmax", renormalize=True, routed_scaling_factor=2.0)
    weights, ids = select_experts(np.zeros((2, 8), np.float32), config)
    np.testing.assert_array_equal(ids, [[0, 1, 2], [0, 1, 2]])
    np.testing.assert_allclose(weights, np.full((2, 3), 2.0 / 3.0), rtol=WEIGHT_RTOL)


def test_ties_at_the_cut_go_to_the_lower_id():
    config = RouterConfig(6, 3, "softmax")
    logits = np.array([[1.0, 3.0, 2.0, 3.0, 0.0, 2.0]], np.float32)
    weights, ids = select_experts(logits, config)
    np.testing.assert_array_equal(ids, [[1, 3, 2]])
    assert_matches_reference(logits, config)


# The CPU kernel cuts each row at the K-th largest of its 16 lane maxima (K <= 16, N >= 16),
# places up to 32 candidates by counting and more by pick rounds, and guesses the cut from
# the previous row otherwise (K > 16 or N < 16). Few distinct values make exact ties, wide
# ones tens of candidates: every path meets the lower-id rule.
@pytest.mark.parametrize(
    "num_experts,top_k", [(n, k) for n in (8, 16, 17, 60, 64, 200, 512) for k in (1, 2, 10, 16, 17, 24) if k <= n]
)
@pytest.mark.parametrize("levels", [3, 40, None])
def test_candidate_paths_match_reference(num_experts, top_k, levels):
    rng = rng_for("paths", num_experts, top_k, levels)
    shape = (97, num_experts)
    if levels is None:
        logits = rng.standard_normal(shape).astype(np.float32)
    else:
        logits = rng.integers(0, levels, shape).astype(np.float32)
    for scoring in ("softmax", "sigmoid", "sqrtsoftplus", "none"):
        assert_matches_reference(logits, RouterConfig(num_experts, top_k, scoring, renormalize=scoring != "none"))


# float32 softmax rows with renormalize and no groups are ranked straight from the raw
# logits; signed zeros, the finite extremes, infinities and NaNs (in the 16-logit blocks or
# the tail) either rank as their clipped values there or send the row to the keyed path.
@pytest.mark.parametrize("num_experts", [16, 17, 64, 70, 512])
@pytest.mark.parametrize("top_k", [1, 10, 16])
@pytest.mark.parametrize(
    "palette",
    [
        [-0.0, 0.0, 0.5, -1.0, 2.0],
        [-0.0, 0.0, FLOAT32_MAX, -FLOAT32_MAX, 1.0],
        [np.inf, -np.inf, np.nan, -np.nan, 0.0, -0.0, 1.0, -1.0],
        [-np.inf, -FLOAT32_MAX, np.nan, -2.0],
    ],
)
def test_raw_logit_path_edge_values(num_experts, top_k, palette):
    rng = rng_for("raw", num_experts, top_k, len(palette), palette[2])
    logits = rng.choice(np.array(palette, np.float32), size=(64, num_experts))
    logits[::3] += rng.standard_normal((len(logits[::3]), num_experts)).astype(np.float32)
    config = RouterConfig(num_experts, top_k, "softmax", renormalize=True, routed_scaling_factor=1.5)
    with np.errstate(invalid="ignore", over="ignore"):
        weights, ids = select_experts(logits, config)
        ref_weights, ref_ids = reference.select_experts(logits, config)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(weights, ref_weights, rtol=WEIGHT_RTOL, atol=1e-30)


from numba import njit  # noqa: E402

from moeroute.routing.select import _simd  # noqa: E402


def _compress_all(compress):
    """Every 16-value block of ``keys`` through ``compress``, as one index list."""

    @njit(cache=False)
    def run(keys, cut, out):
        count = 0
        for start in range(0, keys.shape[0] - keys.shape[0] % 16, 16):
            count = compress(keys, start, cut, out, count)
        return count

    return run


@pytest.mark.parametrize("kind", ["vector", "table"])
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_compress_at_least_both_ways(kind, dtype):
    # The block compress of the candidate pass, both implementations on this CPU (the one not
    # chosen for it is only slower): the indices passing an ordered >= compare, ascending.
    compress = {"vector": _simd._compress_vector, "table": _simd._compress_table}[kind]
    run = _compress_all(compress)
    rng = np.random.default_rng(17)
    palette = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, FLOAT32_MAX], np.float32)
    for trial in range(40):
        n = 16 * int(rng.integers(1, 9))
        if dtype == np.float32:
            keys = rng.standard_normal(n).astype(np.float32)
            keys[rng.random(n) < 0.1] = palette[trial % len(palette)]
            cut = np.float32(rng.choice([0.5, 0.0, -np.inf, np.inf, 2.0]))
        else:
            keys = rng.integers(-(2**31), 2**31, n, dtype=np.int64).astype(np.int32)
            keys[rng.random(n) < 0.1] = np.int32(2**31 - 1)
            cut = np.int32(rng.choice([0, -(2**31), 2**31 - 1, 2**30]))
        out = np.full(n + 16, -7, np.int32)
        count = run(keys, cut, out)
        with np.errstate(invalid="ignore"):
            expected = np.nonzero(keys >= cut)[0]
        assert count == len(expected)
        np.testing.assert_array_equal(out[:count], expected)


def test_equal_group_maxima_keep_the_lower_group():
    # Groups 0 and 1 share the best logit; group 1 has the better runner-up, but a group's
    # score is its maximum, so the tie goes to group 0.
    config = RouterConfig(8, 2, "softmax", num_expert_group=2, topk_group=1)
    logits = np.array([[5.0, 1.0, 0.0, 0.0, 5.0, 4.0, 0.0, 0.0]], np.float32)
    weights, ids = select_experts(logits, config)
    np.testing.assert_array_equal(ids, [[0, 1]])
    assert_matches_reference(logits, config)


def test_equal_group_pair_sums_keep_the_lower_group():
    # sigmoid(0) = 0.5 exactly, dyadic biases: both groups' two best choices sum to 1.75.
    config = RouterConfig(8, 2, "sigmoid", num_expert_group=2, topk_group=1)
    bias = np.array([0.5, 0.25, 0.0, 0.0, 0.25, 0.5, 0.0, 0.0], np.float32)
    weights, ids = select_experts(np.zeros((1, 8), np.float32), config, bias)
    np.testing.assert_array_equal(ids, [[0, 1]])
    np.testing.assert_allclose(weights, [[0.5, 0.5]], rtol=WEIGHT_RTOL)
    assert_matches_reference(np.zeros((1, 8), np.float32), config, bias)


def test_bias_steers_selection_but_not_weights():
    config = RouterConfig(4, 2, "sigmoid", renormalize=False)
    logits = np.array([[2.0, 1.0, 0.0, -1.0]], np.float32)
    bias = np.array([0.0, 0.0, 0.0, 10.0], np.float32)
    weights, ids = select_experts(logits, config, bias)
    np.testing.assert_array_equal(ids, [[3, 0]])
    expected = 1.0 / (1.0 + np.exp(-np.array([-1.0, 2.0])))
    np.testing.assert_allclose(weights[0], expected, rtol=WEIGHT_RTOL)


NAN, INF = np.nan, np.inf


def special_rows(num_experts, rng):
    rows = [np.full(num_experts, NAN), np.full(num_experts, INF), np.full(num_experts, -INF)]
    one_inf = rng.standard_normal(num_experts)
    one_inf[num_experts // 3] = INF
    rows.append(one_inf)
    mixed = rng.standard_normal(num_experts)
    mixed[::2] = NAN
    mixed[1::4] = -INF
    rows.append(mixed)
    two_inf = np.full(num_experts, -INF)
    two_inf[[1, num_experts - 1]] = INF
    rows.append(two_inf)
    mostly_neg_inf = np.full(num_experts, -INF)
    mostly_neg_inf[-2:] = [3.0, -200.0]
    rows.append(mostly_neg_inf)
    huge = rng.standard_normal(num_experts) * 1e30
    rows.append(huge)
    return np.array(rows, np.float32)


@pytest.mark.parametrize("preset_name", PRESET_NAMES)
def test_nan_and_inf_rows(preset_name):
    preset = PRESETS[preset_name]
    config = preset.router
    rng = rng_for("special", preset_name)
    logits = special_rows(config.num_experts, rng)
    bias = None
    if preset.has_correction_bias:
        bias = (0.1 * rng.standard_normal(config.num_experts)).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        weights, ids = select_experts(logits, config, bias)
        ref_weights, ref_ids = reference.select_experts(logits, config, bias)
    assert np.isfinite(weights).all()
    assert ((ids >= 0) & (ids < config.num_experts)).all()
    assert all(len(set(row)) == config.top_k for row in ids.tolist())
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(weights, ref_weights, rtol=WEIGHT_RTOL, atol=1e-30)


NEW_SCORING_CONFIGS = {
    "sqrtsoftplus": RouterConfig(24, 4, "sqrtsoftplus", routed_scaling_factor=2.0),
    "sqrtsoftplus, groups": RouterConfig(24, 4, "sqrtsoftplus", num_expert_group=4, topk_group=2),
    "none": RouterConfig(24, 4, "none", renormalize=False),
    "none, renormalize": RouterConfig(24, 4, "none", renormalize=True, routed_scaling_factor=3.0),
}


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("name", list(NEW_SCORING_CONFIGS))
def test_new_scorings_nan_and_inf_rows(name, with_bias):
    config = NEW_SCORING_CONFIGS[name]
    rng = rng_for("special-new", name, with_bias)
    logits = special_rows(config.num_experts, rng)
    bias = (0.1 * rng.standard_normal(config.num_experts)).astype(np.float32) if with_bias else None
    with np.errstate(invalid="ignore", over="ignore"):
        weights, ids = select_experts(logits, config, bias)
        ref_weights, ref_ids = reference.select_experts(logits, config, bias)
    assert np.isfinite(weights).all()
    assert all(len(set(row)) == config.top_k for row in ids.tolist())
    assert ((ids >= 0) & (ids < config.num_experts)).all()
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(weights, ref_weights, rtol=WEIGHT_RTOL, atol=1e-30)


def test_sqrtsoftplus_bias_selects_but_does_not_weigh():
    config = RouterConfig(4, 2, "sqrtsoftplus", renormalize=False, routed_scaling_factor=2.0)
    logits = np.array([[2.0, 1.0, 0.0, -1.0]], np.float32)
    bias = np.array([0.0, 0.0, 0.0, 10.0], np.float32)
    weights, ids = select_experts(logits, config, bias)
    np.testing.assert_array_equal(ids, [[3, 0]])
    expected = 2.0 * np.sqrt(np.log1p(np.exp(np.array([-1.0, 2.0]))))
    np.testing.assert_allclose(weights[0], expected, rtol=WEIGHT_RTOL)


# scoring "none" + renormalize: divide by sum + 1e-20 only when that is a positive finite
# number; keep the raw logits otherwise; clamp to the finite float32 range.
RAW_RENORMALIZE_ROWS = [
    ([3.0, 1.0, -5.0, 0.5], [0, 1], [0.75, 0.25]),  # positive sum: a plain division
    ([1.0, -1.0, -5.0, -6.0], [0, 1], [1e20, -1e20]),  # sum 0: divided by 1e-20
    ([-1.0, -2.0, -5.0, -6.0], [0, 1], [-1.0, -2.0]),  # negative sum: kept as they are
    ([FLOAT32_MAX, FLOAT32_MAX, 0.0, 0.0], [0, 1], [FLOAT32_MAX, FLOAT32_MAX]),  # sum overflows
    ([1e-30, 1e30, -3e38, 0.0], [1, 0], [1e30 / (1e30 + 1e-20), 1e-30 / 1e30]),
    ([np.nan, np.inf, -np.inf, 0.0], [1, 3], [1.0, 0.0]),  # +inf clips to FLOAT32_MAX
]


@pytest.mark.parametrize("row,expected_ids,expected_weights", RAW_RENORMALIZE_ROWS)
def test_raw_logit_renormalize_rule(row, expected_ids, expected_weights):
    config = RouterConfig(4, 2, "none", renormalize=True)
    logits = np.array([row], np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        weights, ids = select_experts(logits, config)
        ref_weights, ref_ids = reference.select_experts(logits, config)
    np.testing.assert_array_equal(ids[0], expected_ids)
    np.testing.assert_array_equal(ref_ids[0], expected_ids)
    expected = np.clip(np.array(expected_weights, np.float64), -FLOAT32_MAX, FLOAT32_MAX)
    # atol: 1e-30 / 1e30 underflows to 0 in float32.
    np.testing.assert_allclose(weights[0], expected, rtol=WEIGHT_RTOL, atol=1e-38)
    np.testing.assert_allclose(ref_weights[0], expected, rtol=WEIGHT_RTOL, atol=1e-38)
    assert np.isfinite(weights).all()


def test_raw_logit_weights_overflowing_rsf_are_clamped():
    config = RouterConfig(3, 2, "none", renormalize=False, routed_scaling_factor=4.0)
    weights, ids = select_experts(np.array([[3e38, -3e38, 1.0]], np.float32), config)
    np.testing.assert_array_equal(ids, [[0, 2]])
    np.testing.assert_array_equal(weights, [[FLOAT32_MAX, 4.0]])


def test_nan_bias_ranks_below_every_value():
    config = RouterConfig(6, 4, "sigmoid")
    bias = np.array([NAN, 0.0, NAN, -INF, 0.0, 0.0], np.float32)
    logits = np.zeros((1, 6), np.float32)
    weights, ids = select_experts(logits, config, bias)
    # Finite choices first (ties by id), then -inf, then the NaN choices by id.
    np.testing.assert_array_equal(ids, [[1, 4, 5, 3]])
    assert_matches_reference(logits, config, bias)


@pytest.mark.parametrize("num_tokens", [3, 600])  # 600 x 160 logits: the parallel kernel
def test_nan_bias_entries_with_vector_rows(num_tokens):
    # 160 experts take the vector sigmoid pass unless the bias holds a NaN; the kernel finds
    # the NaN entries itself, in every parallel work item.
    config = PRESETS["glm-4.5"].router
    rng = rng_for("nan-bias-vector")
    logits = rng.standard_normal((num_tokens, config.num_experts)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(config.num_experts)).astype(np.float32)
    bias[[3, 77, 150]] = NAN
    weights, ids = select_experts(logits, config, bias)
    assert not np.isin(ids, [3, 77, 150]).any()
    assert_matches_reference(logits, config, bias)


def test_softmax_underflow_rows_break_ties_by_id():
    # Every score but one underflows to 0: the zeros tie and the lowest ids win, although
    # their logits differ (a pure logit ranking would pick 5 and 4).
    config = RouterConfig(6, 3, "softmax")
    logits = np.array([[-300.0, -400.0, -500.0, 200.0, -250.0, -200.0]], np.float32)
    weights, ids = select_experts(logits, config)
    np.testing.assert_array_equal(ids, [[3, 0, 1]])
    assert_matches_reference(logits, config)


def test_non_contiguous_logits():
    config = PRESETS["qwen3-30b-a3b"].router
    wide = rng_for("strided").standard_normal((40, 256)).astype(np.float32)
    logits = wide[:, ::2]
    assert not logits.flags.c_contiguous
    assert_matches_reference(logits, config)


def test_float16_matches_its_float32_values():
    preset = PRESETS["kimi-k2"]
    logits, bias = draw_inputs(preset, 64, "float16", rng_for("half"))
    half = select_experts(logits, preset.router, bias)
    single = select_experts(logits.astype(np.float32), preset.router, bias)
    np.testing.assert_array_equal(half[1], single[1])
    np.testing.assert_array_equal(half[0], single[0])


def test_parallel_and_serial_paths_agree():
    # 4096 x 512 logits run on the thread pool, 7 x 512 serially: rows must not depend on
    # the path or on how rows are split into chunks.
    preset = PRESETS["qwen3.5-moe"]
    logits, _ = draw_inputs(preset, 4096, "float32", rng_for("paths"))
    weights, ids = select_experts(logits, preset.router)
    for start in (0, 1000, 4089):
        part_w, part_ids = select_experts(logits[start : start + 7], preset.router)
        np.testing.assert_array_equal(part_ids, ids[start : start + 7])
        np.testing.assert_array_equal(part_w, weights[start : start + 7])


def test_one_row_kernel_specialization_serves_both_paths():
    """The serial call (the row kernel on all rows) and the parallel kernel's chunks use one
    compiled specialization of the row kernel per logits kind: a second one (e.g. literal
    row bounds) would double the cold compile of the float path that `moeroute.warmup`
    pays for."""
    from moeroute.routing.select import _host

    preset = PRESETS["deepseek-v3"]
    small, bias = draw_inputs(preset, 3, "float32", rng_for("one specialization"))
    large, _ = draw_inputs(preset, 4096, "float32", rng_for("one specialization", "large"))
    select_experts(small, preset.router, bias)
    select_experts(large, preset.router, bias)
    float32_rows = [sig for sig in _host._select_rows.signatures if str(sig[0].dtype) == "float32"]
    assert len(float32_rows) == 1, float32_rows


# ------------------------------------------------------------------ invalid arguments

DEEPSEEK = PRESETS["deepseek-v3"].router
BIAS = np.zeros(256, np.float32)
LOGITS = np.zeros((3, 256), np.float32)

ERROR_CASES = [
    ("1-D logits", dict(logits=np.zeros(256, np.float32)), ValueError, r"2-D.*\(256,\)"),
    ("3-D logits", dict(logits=np.zeros((2, 3, 256), np.float32)), ValueError, r"2-D"),
    ("N mismatch", dict(logits=np.zeros((3, 255), np.float32)), ValueError, r"logits.shape\[1\]=255 .*num_experts=256"),
    (
        "float64 logits",
        dict(logits=np.zeros((3, 256))),
        ValueError,
        r"dtype float64 .*\('float32', 'float16', 'bfloat16'\)",
    ),
    ("int logits", dict(logits=np.zeros((3, 256), np.int32)), ValueError, r"dtype int32"),
    ("list logits", dict(logits=[[0.0] * 256]), TypeError, r"logits must be a NumPy array.*list"),
    (
        "bias shape",
        dict(correction_bias=np.zeros(255, np.float32)),
        ValueError,
        r"correction_bias shape \(255,\) must be \(256,\)",
    ),
    ("bias 2-D", dict(correction_bias=np.zeros((1, 256), np.float32)), ValueError, r"correction_bias shape \(1, 256\)"),
    ("bias dtype", dict(correction_bias=np.zeros(256)), ValueError, r"correction_bias dtype float64 must be float32"),
    (
        "bias list",
        dict(correction_bias=[0.0] * 256),
        TypeError,
        r"correction_bias must be a NumPy array, a torch tensor or a CUDA device array, got list",
    ),
    ("config", dict(config={"num_experts": 256}), TypeError, r"config must be a .*RouterConfig.*dict"),
    (
        "groups of one with bias",
        dict(
            config=RouterConfig(8, 2, "sigmoid", num_expert_group=8, topk_group=2),
            logits=np.zeros((1, 8), np.float32),
            correction_bias=np.zeros(8, np.float32),
        ),
        ValueError,
        r"num_expert_group=8 leaves 1 expert per group",
    ),
]


@pytest.mark.parametrize("name,changes,error,match", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_invalid_arguments(name, changes, error, match):
    arguments = dict(logits=LOGITS, config=DEEPSEEK, correction_bias=BIAS)
    arguments.update(changes)
    with pytest.raises(error, match=match):
        select_experts(arguments["logits"], arguments["config"], arguments["correction_bias"])


def test_groups_of_one_without_bias_are_fine():
    config = RouterConfig(8, 2, "softmax", num_expert_group=8, topk_group=3)
    logits = rng_for("g1").standard_normal((5, 8)).astype(np.float32)
    assert_matches_reference(logits, config)


# ------------------------------------------------------------------ properties


@st.composite
def routing_problems(draw):
    experts_per_group = draw(st.integers(2, 12))
    num_groups = draw(st.integers(1, 6))
    num_experts = experts_per_group * num_groups
    topk_group = draw(st.integers(1, num_groups))
    top_k = draw(st.integers(1, min(32, topk_group * experts_per_group)))
    config = RouterConfig(
        num_experts,
        top_k,
        draw(st.sampled_from(["softmax", "sigmoid", "sqrtsoftplus", "none"])),
        num_expert_group=num_groups,
        topk_group=topk_group,
        renormalize=draw(st.booleans()),
        routed_scaling_factor=draw(st.floats(0.25, 4.0)),
    )
    num_tokens = draw(st.integers(0, 6))
    values = st.floats(-20, 20, width=32)
    logits = np.array(
        draw(
            st.lists(
                st.lists(values, min_size=num_experts, max_size=num_experts), min_size=num_tokens, max_size=num_tokens
            )
        ),
        dtype=np.float32,
    ).reshape(num_tokens, num_experts)
    bias = None
    if draw(st.booleans()):
        bias = np.array(
            draw(st.lists(st.floats(-1, 1, width=32), min_size=num_experts, max_size=num_experts)), dtype=np.float32
        )
    return config, logits, bias


# A bias can pick an expert whose score is ~6e-16: its renormalized weight is then
# s / (s + 1e-20) = 0.99998, not 1 (docs/semantics.md section 1, rule 5).
_TINY_PICK = (
    RouterConfig(2, 1, "softmax", renormalize=True),
    np.array([[-19.0, 16.0]], np.float32),
    np.array([1.0, 0.0], np.float32),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(routing_problems())
@example(_TINY_PICK)
def test_properties(problem):
    config, logits, bias = problem
    weights, ids = select_experts(logits, config, bias)
    assert ids.shape == weights.shape == (logits.shape[0], config.top_k)
    assert ((ids >= 0) & (ids < config.num_experts)).all()
    assert all(len(set(row)) == config.top_k for row in ids.tolist())
    assert np.isfinite(weights).all()
    assert config.scoring == "none" or (weights >= 0).all()
    scores = float64_scores(logits, config.scoring)
    if config.scoring == "none" and logits.shape[0]:
        picked = np.take_along_axis(scores, ids.astype(np.int64), axis=1)
        divisor = picked.sum(axis=1, keepdims=True) + 1e-20
        usable = config.renormalize & (divisor > 1e-3)  # well away from the sign change
        expected = np.where(usable, picked / np.where(usable, divisor, 1.0), picked)
        expected = config.routed_scaling_factor * expected
        rows = (divisor[:, 0] > 1e-3) | (divisor[:, 0] < -1e-3) | (not config.renormalize)
        np.testing.assert_allclose(weights[rows], expected[rows], rtol=1e-4, atol=1e-5)
    elif config.renormalize and logits.shape[0]:
        picked_scores = np.take_along_axis(scores, ids.astype(np.int64), axis=1).sum(axis=1)
        expected = config.routed_scaling_factor * picked_scores / (picked_scores + 1e-20)
        np.testing.assert_allclose(weights.sum(axis=1, dtype=np.float64), expected, rtol=1e-5)
    # Columns are ordered by choice (score + bias), descending.
    choice = scores if bias is None else scores + bias
    picked = np.take_along_axis(choice, ids.astype(np.int64), axis=1)
    slack = 1e-6 * np.maximum(np.abs(picked[:, 1:]), 1e-3)
    assert (picked[:, :-1] >= picked[:, 1:] - slack).all()
