"""The CPU select kernel's vector steps against plain NumPy definitions: the float32 exp,
the one-pass sigmoid scores/keys/lane maxima, and the vector choice of groups.

These steps are exercised end to end by test_select.py; here each is held to its own
definition, so that a wrong lane or a wrong tie shows where it happens."""

import numpy as np
import pytest
from numba import njit

from moeroute.routing.select import _host
from moeroute.routing.select._simd import GROUP_SLOTS, _group_picks, _place_block, _sigmoid_keys

LANES = 16
NO_KEY = np.int32(np.iinfo(np.int32).min)


@njit(error_model="numpy")
def _exp_all(x, out):
    for i in range(x.shape[0]):
        out[i] = _host._exp(x[i])


@njit(error_model="numpy")
def _sigmoid_scalar(x, out):
    for i in range(x.shape[0]):
        out[i] = np.float32(1.0) / (np.float32(1.0) + _host._exp(-x[i]))


@njit(error_model="numpy")
def _sigmoid_pass(x, bias, scores, keys, lanes):
    _sigmoid_keys(x, bias, scores, keys, lanes)


@njit(error_model="numpy")
def _sigmoid_pass_no_bias(x, scores, keys, lanes):
    _sigmoid_keys(x, None, scores, keys, lanes)


@njit(error_model="numpy")
def _groups(keys, num_groups, topk_group, two_best, kept, lanes):
    _group_picks(keys, num_groups, topk_group, two_best, kept, lanes)


@njit(error_model="numpy")
def _place(packed, count, top_k, top_keys, top_ids):
    _place_block(packed, count, top_k, top_keys, top_ids)


def order_keys(values):
    """int32 keys that compare like float32 values: -0 as +0, NaN below -inf."""
    values = np.asarray(values, np.float32) + np.float32(0.0)
    bits = values.view(np.int32)
    keys = bits ^ ((bits >> 31) & np.int32(0x7FFFFFFF))
    nan_key = order_keys_finite(np.float32(-np.inf)) - 1
    return np.where(np.isnan(values), nan_key, keys).astype(np.int32)


def order_keys_finite(value):
    bits = np.asarray(value, np.float32).view(np.int32)
    return np.int32(bits ^ ((bits >> 31) & np.int32(0x7FFFFFFF)))


def key_values(keys):
    keys = np.asarray(keys, np.int32)
    return (keys ^ ((keys >> 31) & np.int32(0x7FFFFFFF))).view(np.float32)


def ulps(a, b):
    return np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))


def test_exp_is_within_one_ulp_of_the_float64_exp_on_every_31st_float():
    top = np.float32(88.72).view(np.int32)
    bottom = np.float32(103.9).view(np.int32)
    x = np.concatenate(
        [
            np.arange(0, top, 31, dtype=np.int32).view(np.float32),
            -np.arange(0, bottom, 31, dtype=np.int32).view(np.float32),
        ]
    )
    out = np.empty_like(x)
    _exp_all(x, out)
    expected = np.exp(x.astype(np.float64)).astype(np.float32)
    error = ulps(out, expected)
    assert error.max() <= 1
    assert (error == 0).mean() > 0.99


def test_exp_at_its_edges():
    x = np.array([np.nan, np.inf, 89.0, 88.8, -np.inf, -104.0, -110.0, 0.0, -0.0], np.float32)
    out = np.empty_like(x)
    _exp_all(x, out)
    # NaN maps to inf (a sigmoid score of 0, as for a NaN logit clipped to -FLOAT32_MAX).
    assert np.all(np.isposinf(out[:4]))
    assert np.all(out[4:7] == 0.0)
    assert np.all(out[7:] == 1.0)


@pytest.mark.parametrize("num_experts", [16, 48, 112, 160, 256, 384])
@pytest.mark.parametrize("with_bias", [False, True])
def test_sigmoid_pass_is_the_scalar_formula_and_its_keys(num_experts, with_bias):
    rng = np.random.default_rng(num_experts + with_bias)
    x = (rng.standard_normal(num_experts) * 8).astype(np.float32)
    x[::13] = np.float32(-0.0)
    x[5] = np.nan
    x[7] = np.inf
    x[9] = -np.inf
    x[11] = np.float32(-88.5)
    scores = np.empty(num_experts, np.float32)
    keys = np.empty(num_experts, np.int32)
    lanes = np.empty(LANES, np.int32)
    bias = None
    if with_bias:
        bias = (rng.integers(-8, 8, num_experts) * 0.125).astype(np.float32)
        bias[3] = -np.inf
        bias[4] = np.float32(-0.0)
        _sigmoid_pass(x, bias, scores, keys, lanes)
    else:
        _sigmoid_pass_no_bias(x, scores, keys, lanes)
    expected_scores = np.empty_like(x)
    _sigmoid_scalar(x, expected_scores)
    assert np.array_equal(scores.view(np.int32), expected_scores.view(np.int32))
    # The definition itself: NaN scores 0, +inf 1, -inf 0.
    assert scores[5] == 0.0 and scores[7] == 1.0 and scores[9] == 0.0
    choices = expected_scores if bias is None else expected_scores + bias
    expected_keys = order_keys(choices)
    assert np.array_equal(keys, expected_keys)
    assert np.array_equal(lanes, expected_keys.reshape(-1, LANES).max(axis=0))


def reference_groups(keys, num_groups, topk_group, two_best):
    """Kept groups (ties to the lower group) and the kept keys' lane maxima."""
    grouped = keys.reshape(num_groups, -1)
    ranked = np.sort(grouped, axis=1)[:, ::-1]
    if two_best:
        scores = order_keys(key_values(ranked[:, 0]) + key_values(ranked[:, 1]))
    else:
        scores = ranked[:, 0]
    order = sorted(range(num_groups), key=lambda g: (-int(scores[g]), g))
    kept = np.zeros(num_groups, bool)
    kept[order[:topk_group]] = True
    masked = np.where(np.repeat(kept, grouped.shape[1]), keys, NO_KEY)
    return kept, masked.reshape(-1, LANES).max(axis=0)


@pytest.mark.parametrize("num_groups", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [16, 32, 64])
@pytest.mark.parametrize("two_best", [0, 1])
@pytest.mark.parametrize("values", ["spread", "ties"])
def test_group_picks_match_the_definition(num_groups, group_size, two_best, values):
    assert num_groups <= GROUP_SLOTS
    rng = np.random.default_rng([num_groups, group_size, two_best, values == "ties"])
    for trial in range(20):
        if values == "ties":
            choices = (rng.integers(-2, 3, num_groups * group_size) * 0.5).astype(np.float32)
        else:
            choices = rng.standard_normal(num_groups * group_size).astype(np.float32)
        if trial % 5 == 0:
            choices[rng.integers(choices.size)] = np.nan
        keys = order_keys(choices)
        for topk_group in range(1, num_groups + 1):
            kept = np.empty(num_groups, np.bool_)
            lanes = np.empty(LANES, np.int32)
            _groups(keys, num_groups, topk_group, two_best, kept, lanes)
            expected_kept, expected_lanes = reference_groups(keys, num_groups, topk_group, two_best)
            assert np.array_equal(kept, expected_kept), (trial, topk_group)
            assert np.array_equal(lanes, expected_lanes), (trial, topk_group)


@pytest.mark.parametrize(
    "count, top_k", [(count, top_k) for count in (1, 2, 7, 8, 15, 16) for top_k in (1, 4, 8, 16) if top_k <= count]
)
def test_place_block_puts_the_top_k_picks_in_descending_order(count, top_k):
    rng = np.random.default_rng([count, top_k])
    for trial in range(20):
        keys = rng.integers(-3, 3, count).astype(np.int32)  # repeats: ties to the lower id
        ids = np.sort(rng.choice(500, count, replace=False))
        packed = np.full(LANES, 12345, np.int64)  # entries past count are ignored
        packed[:count] = (keys.astype(np.int64) << 32) | (0x7FFFFFFF - ids)
        top_keys = np.full(top_k + 1, -1, np.int32)
        top_ids = np.full(top_k + 1, -1, np.int64)
        _place(packed, count, top_k, top_keys, top_ids)
        order = sorted(range(count), key=lambda j: (-int(keys[j]), int(ids[j])))[:top_k]
        assert np.array_equal(top_keys[:top_k], keys[order]), trial
        assert np.array_equal(top_ids[:top_k], ids[order]), trial
