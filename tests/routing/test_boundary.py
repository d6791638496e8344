"""An array crosses into an op once: each input of one op call is examined by
``moeroute.routing._arrays`` a single time (`_arrays.enter`), and the results leave through
that boundary in the caller's framework, equal to the NumPy-input call's entry for entry.

A counting spy wraps every function of ``_arrays``, wherever a module of moeroute bound it,
and records each call made from outside ``_arrays`` with the ids of its array arguments.
"""

from __future__ import annotations

import inspect
import sys
from collections import Counter

import numpy as np
import pytest

from moeroute.config import RouterConfig
from moeroute.layout import ExpertLayout
from moeroute.routing import _arrays, align_block_size, route, select_experts

torch = pytest.importorskip("torch")

_ARRAYS_MODULE = _arrays.__name__


@pytest.fixture
def examined(monkeypatch):
    """A Counter: id(array) -> how many calls from outside ``_arrays`` received it."""
    counts: Counter = Counter()
    functions = {
        name: value
        for name, value in vars(_arrays).items()
        if inspect.isfunction(value) and value.__module__ == _ARRAYS_MODULE
    }

    def spy(function):
        def counted(*args, **kwargs):
            if sys._getframe(1).f_globals.get("__name__") != _ARRAYS_MODULE:
                for value in (*args, *kwargs.values()):
                    if hasattr(value, "shape"):
                        counts[id(value)] += 1
            return function(*args, **kwargs)

        return counted

    spies = {id(function): spy(function) for function in functions.values()}
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("moeroute") or module is None:
            continue
        for name, value in list(vars(module).items()):
            if inspect.isfunction(value) and id(value) in spies:
                monkeypatch.setattr(module, name, spies[id(value)])
    return counts


def _torch_and_numpy(array: np.ndarray):
    return torch.from_numpy(array.copy()), array


def _assert_same(result, expected):
    """A torch result equal, entry for entry and in dtype, to the NumPy-input result."""
    for got, want in zip(result, expected):
        if isinstance(want, np.ndarray):
            assert isinstance(got, torch.Tensor) and got.device.type == "cpu"
            np.testing.assert_array_equal(got.numpy(), want)
            assert got.numpy().dtype == want.dtype
        else:
            assert got == want


CONFIG = RouterConfig(64, 6, "sigmoid", num_expert_group=8, topk_group=3, routed_scaling_factor=2.5)


def test_select_experts_examines_each_input_once(examined):
    rng = np.random.default_rng(20)
    logits, logits_np = _torch_and_numpy(rng.standard_normal((5, 64)).astype(np.float32))
    bias, bias_np = _torch_and_numpy((0.1 * rng.standard_normal(64)).astype(np.float32))
    result = select_experts(logits, CONFIG, bias)
    assert examined[id(logits)] == 1 and examined[id(bias)] == 1
    expected = select_experts(logits_np, CONFIG, bias_np)
    _assert_same(result, expected)
    # The ids are the reference's: the highest biased sigmoid scores of the kept groups.
    from moeroute.routing import reference

    np.testing.assert_array_equal(result[1].numpy(), reference.select_experts(logits_np, CONFIG, bias_np)[1])


def test_select_experts_bfloat16_examines_logits_once(examined):
    values = np.random.default_rng(21).standard_normal((3, 64)).astype(np.float32)
    logits = torch.from_numpy(values).to(torch.bfloat16)
    result = select_experts(logits, CONFIG)
    assert examined[id(logits)] == 1
    _assert_same(result, select_experts(logits.float().numpy(), CONFIG))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_shared_experts=1, ep_size=2, dispatch="all2all", num_redundant_experts=2),
        dict(),
    ],
    ids=["ep2 fused shared, replicas", "one rank"],
)
def test_route_examines_each_input_once(examined, kwargs):
    layout = ExpertLayout(64, **kwargs)
    rng = np.random.default_rng(22)
    logits, logits_np = _torch_and_numpy(rng.standard_normal((7, 64)).astype(np.float32))
    bias, bias_np = _torch_and_numpy((0.1 * rng.standard_normal(64)).astype(np.float32))
    gate, gate_np = _torch_and_numpy(rng.random(7).astype(np.float32))
    shared = gate if layout.shared == "fused" else None
    rank = layout.ep_size - 1
    result = route(logits, CONFIG, layout, rank, bias, shared, home_rank=0)
    assert examined[id(logits)] == 1 and examined[id(bias)] == 1
    assert examined[id(gate)] == (1 if shared is not None else 0)
    expected = route(logits_np, CONFIG, layout, rank, bias_np, gate_np if shared is not None else None, home_rank=0)
    _assert_same(result, expected)


def test_align_block_size_examines_each_input_once(examined):
    rng = np.random.default_rng(23)
    ids, ids_np = _torch_and_numpy(rng.integers(0, 16, (9, 4)).astype(np.int32))
    expert_map, expert_map_np = _torch_and_numpy(
        np.where(np.arange(16) % 2 == 0, np.arange(16) // 2, -1).astype(np.int32)
    )
    result = align_block_size(ids, 8, 4, expert_map)
    assert examined[id(ids)] == 1 and examined[id(expert_map)] == 1
    expected = align_block_size(ids_np, 8, 4, expert_map_np)
    _assert_same(result, expected)
    # Independent reference: the kept entries (even ids), sorted by local id, each expert
    # padded to the block size with numel.
    flat = ids_np.reshape(-1)
    local = expert_map_np[flat]
    numel, want = flat.size, []
    for expert in range(8):
        rows = np.flatnonzero(local == expert).tolist()
        if rows:
            want += rows + [numel] * (-len(rows) % 4)
    assert expected[2] == len(want)
    np.testing.assert_array_equal(expected[0][: len(want)], want)


def test_the_other_ops_examine_each_input_once(examined):
    from moeroute.routing import append_shared_slots, combine, expert_load, permute, remap_to_local

    rng = np.random.default_rng(24)
    layout = ExpertLayout(16, num_shared_experts=1, ep_size=2, dispatch="all2all")
    ids, ids_np = _torch_and_numpy(rng.integers(0, 16, (6, 3)).astype(np.int64))
    weights, weights_np = _torch_and_numpy(rng.random((6, 3)).astype(np.float32))
    gate, gate_np = _torch_and_numpy(rng.random(6).astype(np.float32))
    hidden, hidden_np = _torch_and_numpy(rng.standard_normal((6, 5)).astype(np.float32))
    expert_map, expert_map_np = _torch_and_numpy(layout.expert_map(1))
    calls = [
        (lambda i, w, g: append_shared_slots(w, i, layout, 1, g), (ids, weights, gate), (ids_np, weights_np, gate_np)),
        (lambda i, m: (remap_to_local(i, m),), (ids, expert_map), (ids_np, expert_map_np)),
        (lambda i: (expert_load(i, 16),), (ids,), (ids_np,)),
        (lambda h, i: permute(h, i, 16), (hidden, ids), (hidden_np, ids_np)),
    ]
    for op, args, args_np in calls:
        examined.clear()
        result = op(*args)
        assert [examined[id(a)] for a in args] == [1] * len(args)
        _assert_same(result, op(*args_np))
    permuted, _, inverse = permute(hidden_np, ids_np, 16)
    rows, inverse_t = torch.from_numpy(permuted), torch.from_numpy(inverse)
    examined.clear()
    summed = combine(rows, inverse_t, weights)
    assert [examined[id(a)] for a in (rows, inverse_t, weights)] == [1, 1, 1]
    # Each token's rows come back: the weighted sum of its hidden row, sum_k w[t, k] * h[t].
    np.testing.assert_allclose(summed.numpy(), weights_np.sum(1, keepdims=True) * hidden_np, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "dtype, name",
    [
        (np.dtype(np.float32), "float32"),
        (np.dtype(np.uint16), "uint16"),
        (torch.bfloat16, "bfloat16"),
        (torch.float16, "float16"),
        (torch.int32, "int32"),
        (None, ""),
        ("float32", "float32"),
    ],
)
def test_dtype_name_of_each_framework(dtype, name):
    from numba.core import types

    assert _arrays.dtype_name(dtype) == name
    assert _arrays.dtype_name(dtype) == name  # remembered: the same answer again
    assert _arrays.dtype_name(types.float32) == "float32"
