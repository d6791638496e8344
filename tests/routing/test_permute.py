"""sort_by_expert and permute on the CPU against the NumPy reference; the permute/combine
round trip against a plain weighted sum."""

import importlib

import numpy as np
import pytest
import torch

from moeroute.routing import reference
from moeroute.routing.combine import combine
from moeroute.routing.permute import permute, sort_by_expert

# The package re-exports a function named like this module.
permute_module = importlib.import_module("moeroute.routing.permute")

PRESET_SHAPES = [(256, 8), (384, 8), (160, 8), (128, 8), (512, 10), (60, 4), (8, 2)]
TOKENS = [0, 1, 7, 333, 4096]


def skewed_ids(rng, tokens, top_k, num_experts, invalid_fraction=0.0):
    """Imbalanced routing with a fraction of -1 / out-of-range entries."""
    values = np.arange(num_experts)
    p = 1.0 / (values + 1.0) ** 1.2
    ids = rng.choice(values, size=(tokens, top_k), p=p / p.sum()).astype(np.int32)
    drop = rng.random((tokens, top_k)) < invalid_fraction
    ids[drop] = rng.choice([-1, num_experts, num_experts + 5], size=int(drop.sum()))
    return ids


def bf16_bits(rng, shape):
    """bfloat16 values as their raw uint16 patterns (made by torch, never by NumPy floats)."""
    values = torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
    return values.to(torch.bfloat16).view(torch.uint16).numpy()


def assert_sort_same(result, expected):
    for got, want in zip(result, expected):
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, want)


class _DeviceLike:
    """Claims to be a device array (has __cuda_array_interface__) without being one."""

    __cuda_array_interface__ = {}


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("num_experts,top_k", PRESET_SHAPES)
def test_sort_matches_reference(num_experts, top_k, tokens):
    rng = np.random.default_rng(num_experts + 31 * tokens)
    ids = skewed_ids(rng, tokens, top_k, num_experts, invalid_fraction=0.1)
    assert_sort_same(sort_by_expert(ids, num_experts), reference.sort_by_expert(ids, num_experts))


def test_sort_is_stable_and_inverse_points_back():
    rng = np.random.default_rng(1)
    ids = rng.integers(-1, 5, (64, 3))
    sorted_slots, offsets, inverse = sort_by_expert(ids, 4)
    flat = ids.reshape(-1)
    for e in range(4):
        run = sorted_slots[offsets[e] : offsets[e + 1]]
        assert np.all(flat[run] == e)
        assert np.all(np.diff(run) > 0), "ascending flat index within an expert"
    kept = (flat >= 0) & (flat < 4)
    assert np.all(inverse.reshape(-1)[~kept] == -1)
    np.testing.assert_array_equal(sorted_slots[inverse.reshape(-1)[kept]], np.nonzero(kept)[0])


@pytest.mark.parametrize("num_experts", [520, 1024])
def test_sort_many_experts(num_experts):
    rng = np.random.default_rng(num_experts)
    ids = rng.integers(-1, num_experts, (999, 9))
    assert_sort_same(sort_by_expert(ids, num_experts), reference.sort_by_expert(ids, num_experts))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16-bits", "int8", "float64"])
@pytest.mark.parametrize("tokens", [0, 1, 7, 333])
def test_permute_matches_reference_bit_for_bit(dtype, tokens):
    rng = np.random.default_rng(tokens)
    ids = skewed_ids(rng, tokens, 8, 64, invalid_fraction=0.05)
    if dtype == "bfloat16-bits":
        hidden = bf16_bits(rng, (tokens, 96))
    else:
        hidden = (rng.standard_normal((tokens, 96)) * 50).astype(dtype)
    permuted, offsets, inverse = permute(hidden, ids, 64)
    ref_permuted, ref_offsets, ref_inverse = reference.permute(hidden, ids, 64)
    assert permuted.dtype == hidden.dtype
    assert permuted.tobytes() == ref_permuted.tobytes()
    np.testing.assert_array_equal(offsets, ref_offsets)
    np.testing.assert_array_equal(inverse, ref_inverse)


def test_permute_parallel_gather_matches_sequential(monkeypatch):
    rng = np.random.default_rng(2)
    ids = skewed_ids(rng, 300, 4, 16)
    hidden = bf16_bits(rng, (300, 40))
    sequential = permute(hidden, ids, 16)[0]
    monkeypatch.setattr(permute_module, "PARALLEL_GATHER_MIN_BYTES", 0)
    parallel = permute(hidden, ids, 16)[0]
    assert parallel.tobytes() == sequential.tobytes()
    assert parallel.tobytes() == reference.permute(hidden, ids, 16)[0].tobytes()


@pytest.mark.parametrize("tokens", [0, 1, 7, 333])
def test_round_trip_with_identity_experts(tokens):
    """combine(permute(x), inverse, w) with identity experts == sum_k w[t,k] x[t], kept slots."""
    rng = np.random.default_rng(tokens + 100)
    top_k, num_experts = 6, 32
    ids = skewed_ids(rng, tokens, top_k, num_experts, invalid_fraction=0.2)
    x = rng.standard_normal((tokens, 48)).astype(np.float32)
    w = rng.random((tokens, top_k)).astype(np.float32)
    permuted, _, inverse = permute(x, ids, num_experts)
    out = combine(permuted, inverse, w)
    kept = (ids >= 0) & (ids < num_experts)
    expected = (np.where(kept, w, 0).astype(np.float64).sum(axis=1))[:, None] * x
    bound = 1e-6 * np.abs(w).sum(axis=1, keepdims=True) * np.abs(x) + 1e-30
    assert out.dtype == np.float32
    assert np.all(np.abs(out - expected) <= bound)


def test_round_trip_bf16_bits_against_torch():
    rng = np.random.default_rng(7)
    ids = skewed_ids(rng, 50, 4, 8)
    x = bf16_bits(rng, (50, 32))
    w = rng.random((50, 4)).astype(np.float32)
    permuted, _, inverse = permute(x, ids, 8)
    out = combine(permuted, inverse, w, raw_bf16=True)
    xt = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).float()
    expected = torch.zeros(50, 32)
    for k in range(4):
        expected += torch.from_numpy(w[:, k : k + 1]) * xt
    expected_bits = expected.to(torch.bfloat16).view(torch.uint16).numpy()
    # Float32 sums in another order may differ in the last float32 bit: one bf16 ulp at most.
    diff = np.abs(out.astype(np.int32) - expected_bits.astype(np.int32))
    assert diff.max() <= 1 and np.mean(diff == 0) > 0.99


@pytest.mark.parametrize(
    "call,error,words",
    [
        (lambda: sort_by_expert(np.zeros((2, 3), np.int32), 0), ValueError, "num_experts=0"),
        (lambda: sort_by_expert(np.zeros((2, 3), np.int32), 2.5), TypeError, "num_experts=2.5"),
        (lambda: sort_by_expert(np.zeros(6, np.int32), 4), ValueError, "topk_ids must be 2-D"),
        (lambda: sort_by_expert(np.zeros((2, 3), np.float64), 4), TypeError, "integers"),
        (
            lambda: permute(np.zeros((3, 4)), np.zeros((2, 3), np.int32), 4),
            ValueError,
            "hidden_states has 3 rows but topk_ids has 2",
        ),
        (lambda: permute(np.zeros(2), np.zeros((2, 3), np.int32), 4), ValueError, "hidden_states must be 2-D"),
        (lambda: permute(np.zeros((2, 4)), np.zeros((2, 3), np.int32), -1), ValueError, "num_experts=-1"),
        (lambda: permute(_DeviceLike(), np.zeros((2, 3), np.int32), 4), TypeError, "both be host"),
    ],
)
def test_invalid_arguments(call, error, words):
    with pytest.raises(error, match=words):
        call()


# Size limits are checked on the shape, before a broadcast or expanded view is copied.

HUGE_ROWS = 2**28 + 1  # x 8 slots = 2**31 + 8 entries: past the int32 positions


def _refused_without_allocating(call, match):
    """``call`` raises ValueError matching ``match`` having allocated under 1 MiB (NumPy
    reports its buffers to tracemalloc; the copy the check used to follow was 8-16 GiB)."""
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=match):
            call()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.broadcast_to(np.zeros((1, 8), np.int64), (HUGE_ROWS, 8)),
        lambda: np.broadcast_to(np.zeros((1, 8), np.int16), (HUGE_ROWS, 8)),  # would be widened
        lambda: torch.zeros(1, 8, dtype=torch.int32).expand(HUGE_ROWS, 8),
    ],
    ids=["numpy-int64", "numpy-int16", "torch-expand"],
)
def test_sort_and_permute_check_the_entry_limit_before_copying(make):
    ids = make()
    _refused_without_allocating(
        lambda: sort_by_expert(ids, 8), r"topk_ids.size=2147483656 exceeds the int32 index limit"
    )
    hidden = np.broadcast_to(np.zeros((1, 4), np.float32), (HUGE_ROWS, 4))
    if isinstance(ids, torch.Tensor):
        hidden = torch.zeros(1, 4).expand(HUGE_ROWS, 4)
    _refused_without_allocating(
        lambda: permute(hidden, ids, 8), r"topk_ids.size=2147483656 exceeds the int32 index limit"
    )
