"""combine on the CPU: float32 against a float64 sum, float16 against the reference,
bfloat16 bits against torch."""

import importlib

import numpy as np
import pytest
import torch

from moeroute.routing import reference
from moeroute.routing.combine import accumulate_rows, combine

# The package re-exports a function named like this module.
combine_module = importlib.import_module("moeroute.routing.combine")

PRESET_TOP_K = [8, 10, 4, 2]
TOKENS = [0, 1, 7, 333, 4096]
HIDDEN = 64
#: float32 accumulation of K terms vs an exact sum: K * 2**-24 relative to sum |terms|,
#: far below this bound.
FLOAT32_RTOL = 1e-6


def make_case(rng, tokens, top_k, invalid_fraction=0.1, rows=None):
    rows = tokens * top_k if rows is None else rows
    inverse = rng.permutation(max(rows, tokens * top_k))[: tokens * top_k] % max(rows, 1)
    inverse = inverse.reshape(tokens, top_k).astype(np.int32)
    inverse[rng.random((tokens, top_k)) < invalid_fraction] = -1
    weights = rng.random((tokens, top_k)).astype(np.float32)
    return inverse, weights


def float64_combine(values, inverse, weights):
    """sum_k w * y in float64 and the matching bound sum_k |w * y|."""
    tokens, top_k = inverse.shape
    total = np.zeros((tokens, values.shape[1]))
    magnitude = np.zeros_like(total)
    for k in range(top_k):
        kept = inverse[:, k] >= 0
        rows = values[inverse[kept, k]].astype(np.float64)
        term = weights[kept, k, None].astype(np.float64) * rows
        total[kept] += term
        magnitude[kept] += np.abs(term)
    return total, magnitude


def bf16_bits(values):
    return torch.from_numpy(values).to(torch.bfloat16).view(torch.uint16).numpy()


def bf16_values(bits):
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float()


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("top_k", PRESET_TOP_K)
def test_float32_against_float64_sum(top_k, tokens):
    rng = np.random.default_rng(top_k * 1000 + tokens)
    inverse, weights = make_case(rng, tokens, top_k)
    values = rng.standard_normal((tokens * top_k, HIDDEN)).astype(np.float32)
    out = combine(values, inverse, weights)
    exact, magnitude = float64_combine(values, inverse, weights)
    assert out.dtype == np.float32 and out.shape == (tokens, HIDDEN)
    assert np.all(np.abs(out - exact) <= FLOAT32_RTOL * magnitude)


@pytest.mark.parametrize("tokens", [1, 7, 333])
def test_float16_matches_reference(tokens):
    rng = np.random.default_rng(tokens)
    inverse, weights = make_case(rng, tokens, 8)
    values = rng.standard_normal((tokens * 8, HIDDEN)).astype(np.float16)
    out = combine(values, inverse, weights)
    expected = reference.combine(values, inverse, weights)
    assert out.dtype == np.float16
    # Same float32 sum in the same order, rounded once to float16 by NumPy.
    np.testing.assert_array_equal(out, expected)
    exact, magnitude = float64_combine(values, inverse, weights)
    bound = FLOAT32_RTOL * magnitude + np.abs(exact) * 2.0**-11 + 2.0**-24
    assert np.all(np.abs(out.astype(np.float64) - exact) <= bound)


@pytest.mark.parametrize("bits_dtype", [np.uint16, np.int16])
@pytest.mark.parametrize("tokens", [1, 7, 333, 4096])
def test_bf16_bits_against_torch(tokens, bits_dtype):
    rng = np.random.default_rng(tokens + 5)
    inverse, weights = make_case(rng, tokens, 8)
    bits = bf16_bits(rng.standard_normal((tokens * 8, HIDDEN)).astype(np.float32))
    out = combine(bits.view(bits_dtype), inverse, weights, raw_bf16=True)
    assert out.dtype == bits_dtype
    # torch: float32 terms of the bf16 values, summed in float32, rounded to bf16.
    values = bf16_values(bits)
    expected = torch.zeros(tokens, HIDDEN)
    for k in range(8):
        rows = torch.from_numpy(inverse[:, k].astype(np.int64))
        kept = rows >= 0
        expected[kept] += torch.from_numpy(weights[:, k])[kept, None] * values[rows[kept]]
    expected_bits = expected.to(torch.bfloat16).view(torch.uint16).numpy()
    np.testing.assert_array_equal(out.view(np.uint16), expected_bits)


def test_bf16_rounding_matches_torch_bit_for_bit():
    """With y = 1.0 the sum is the weight itself: the encode alone is compared."""
    rng = np.random.default_rng(9)
    special = np.array(
        [
            1 + 2**-8,
            1 + 3 * 2**-8,
            1 - 2**-9,
            3.3895e38,
            3.4e38,
            np.inf,
            -np.inf,
            1e-40,
            -1e-40,
            2**-133,
            65504.0,
            -2.5,
        ],
        np.float32,
    )
    weights = np.concatenate([special, rng.standard_normal(500).astype(np.float32)])[:, None]
    one = bf16_bits(np.ones((1, 1), np.float32))
    out = combine(one, np.zeros_like(weights, dtype=np.int32), weights, raw_bf16=True)
    np.testing.assert_array_equal(out, bf16_bits(weights))


def test_bf16_nan_stays_nan():
    one = bf16_bits(np.ones((1, 1), np.float32))
    out = combine(one, np.zeros((2, 1), np.int32), np.array([[np.nan], [-np.nan]], np.float32), raw_bf16=True)
    assert torch.isnan(bf16_values(out)).all()


def test_weights_none_sums_outputs():
    rng = np.random.default_rng(3)
    inverse, _ = make_case(rng, 20, 4)
    values = rng.standard_normal((80, 16)).astype(np.float32)
    exact, magnitude = float64_combine(values, inverse, np.ones((20, 4), np.float32))
    out = combine(values, inverse)
    assert np.all(np.abs(out - exact) <= FLOAT32_RTOL * magnitude)


def test_rows_without_entries_are_zero_and_empty_inputs():
    values = np.ones((3, 5), np.float32)
    inverse = np.array([[-1, -1], [0, 2]], np.int32)
    out = combine(values, inverse, np.full((2, 2), 0.5, np.float32))
    np.testing.assert_array_equal(out, [[0] * 5, [1] * 5])
    empty = combine(np.zeros((0, 5), np.float32), np.full((4, 2), -1, np.int32))
    np.testing.assert_array_equal(empty, np.zeros((4, 5), np.float32))
    assert combine(values, np.zeros((0, 2), np.int32)).shape == (0, 5)


def test_parallel_kernels_match_sequential(monkeypatch):
    rng = np.random.default_rng(4)
    inverse, weights = make_case(rng, 64, 4)
    values = rng.standard_normal((256, 24)).astype(np.float32)
    bits = bf16_bits(values)
    sequential = [
        combine(values, inverse, weights),
        combine(bits, inverse, weights, raw_bf16=True),
        combine(values.astype(np.float16), inverse, weights),
    ]
    monkeypatch.setattr(combine_module, "PARALLEL_COMBINE_MIN_ELEMENTS", 0)
    parallel = [
        combine(values, inverse, weights),
        combine(bits, inverse, weights, raw_bf16=True),
        combine(values.astype(np.float16), inverse, weights),
    ]
    for got, want in zip(parallel, sequential):
        np.testing.assert_array_equal(got, want)


def test_int64_index_and_float64_weights_are_accepted():
    rng = np.random.default_rng(5)
    inverse, weights = make_case(rng, 30, 3)
    values = rng.standard_normal((90, 8)).astype(np.float32)
    wide = combine(values, inverse.astype(np.int64), weights.astype(np.float64))
    np.testing.assert_array_equal(wide, combine(values, inverse, weights))


GOOD = dict(
    expert_out=np.zeros((4, 3), np.float32),
    inverse_index=np.zeros((2, 2), np.int32),
    topk_weights=np.ones((2, 2), np.float32),
)


@pytest.mark.parametrize(
    "change,error,words",
    [
        (dict(expert_out=np.zeros((4, 3), np.float64)), TypeError, "float32 or float16"),
        (dict(expert_out=np.zeros((4, 3), np.uint16)), TypeError, "raw_bf16=True"),
        (dict(expert_out=np.zeros((4, 3), np.float32), raw_bf16=True), TypeError, "uint16 or int16"),
        (dict(expert_out=np.zeros(4, np.float32)), ValueError, "expert_out must be 2-D"),
        (dict(inverse_index=np.zeros(2, np.int32)), ValueError, "inverse_index must be 2-D"),
        (dict(inverse_index=np.zeros((2, 2), np.float32)), TypeError, "int32 or int64"),
        (dict(topk_weights=np.ones((2, 3), np.float32)), ValueError, r"shape \(2, 3\)"),
        (dict(topk_weights=np.ones((2, 2), np.int32)), TypeError, "floating point"),
        (dict(inverse_index=np.array([[0, 4], [1, 1]], np.int32)), ValueError, "row 4"),
    ],
)
def test_invalid_arguments(change, error, words):
    args = dict(GOOD, raw_bf16=False)
    args.update(change)
    with pytest.raises(error, match=words):
        combine(args["expert_out"], args["inverse_index"], args["topk_weights"], raw_bf16=args["raw_bf16"])


# ------------------------------------------------------------------ accumulate_rows


def _accumulate_reference(out, rows, tokens, weights):
    """The same sums in float64, row by row."""
    expected = out.astype(np.float64)
    for r in range(rows.shape[0]):
        expected[tokens[r]] += float(weights[r]) * rows[r].astype(np.float64)
    return expected


@pytest.mark.parametrize("num_rows,width,repeat", [(0, 8, False), (5, 8, False), (300, 256, False), (300, 256, True)])
def test_accumulate_rows_float32(num_rows, width, repeat):
    """Serial, parallel (>= PARALLEL_ACCUMULATE_MIN_ELEMENTS, distinct tokens) and
    repeated tokens (always serial) all equal the float64 sums."""
    rng = np.random.default_rng(num_rows + repeat)
    num_tokens = 400
    tokens = (
        rng.integers(0, num_tokens, num_rows) if repeat else np.sort(rng.choice(num_tokens, num_rows, replace=False))
    )
    rows = rng.standard_normal((num_rows, width)).astype(np.float32)
    weights = rng.random(num_rows).astype(np.float32)
    out = rng.standard_normal((num_tokens, width)).astype(np.float32)
    expected = _accumulate_reference(out, rows, tokens, weights)
    accumulate_rows(out, rows, tokens.astype(np.int64), weights)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_accumulate_rows_16_bit(kind):
    rng = np.random.default_rng(7)
    values = torch.from_numpy(rng.standard_normal((6, 16)).astype(np.float32))
    tokens = np.array([0, 3, 3, 1, 9, 2])
    weights = rng.random(6).astype(np.float32)
    out = np.zeros((10, 16), np.float32)
    if kind == "float16":
        rows, exact = values.half().numpy(), values.half().float().numpy()
        accumulate_rows(out, rows, tokens, weights)
    else:
        rows, exact = values.bfloat16().view(torch.uint16).numpy(), values.bfloat16().float().numpy()
        accumulate_rows(out, rows, tokens, weights, raw_bf16=True)
    np.testing.assert_allclose(
        out, _accumulate_reference(np.zeros_like(out), exact, tokens, weights), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize(
    "change,error,words",
    [
        ({"out": np.zeros((4, 3), np.float64)}, TypeError, "out must be a 2-D float32"),
        ({"out": np.zeros((3, 4), np.float32).T}, ValueError, "C-contiguous"),
        ({"rows": np.zeros((2, 5), np.float32)}, ValueError, "rows must be"),
        ({"tokens": np.array([0])}, ValueError, "tokens and weights must be"),
        ({"tokens": np.array([0.0, 1.0])}, TypeError, "tokens must be integers"),
        ({"tokens": np.array([0, 4])}, ValueError, r"tokens must lie in \[0, 4\)"),
        ({"weights": np.ones(2)}, TypeError, "weights must be float32"),
        ({"rows": np.zeros((2, 3), np.int32)}, TypeError, "rows must be float32 or float16"),
        ({"out": np.zeros((4, 3), np.float32)[:, :]}, None, None),
        ({"out": np.broadcast_to(np.zeros(3, np.float32), (4, 3)).copy()}, None, None),
        ({"out": [[0.0] * 3] * 4}, TypeError, "out must be a NumPy array .* got list"),
        ({"out": np.zeros((4, 3), np.float32)}, "readonly", None),
    ],
)
def test_accumulate_rows_invalid_arguments(change, error, words):
    args = {
        "out": np.zeros((4, 3), np.float32),
        "rows": np.zeros((2, 3), np.float32),
        "tokens": np.array([0, 1]),
        "weights": np.ones(2, np.float32),
    }
    args.update(change)
    if error is None:  # writable arrays of other provenance are fine
        accumulate_rows(args["out"], args["rows"], args["tokens"], args["weights"])
        return
    if error == "readonly":  # was a Numba TypingError
        args["out"].setflags(write=False)
        error, words = ValueError, r"out is read-only \(flags.writeable is False\)"
    with pytest.raises(error, match=words):
        accumulate_rows(args["out"], args["rows"], args["tokens"], args["weights"])
