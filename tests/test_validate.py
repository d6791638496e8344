"""moeroute._validate: the one integer rule and the MOEROUTE_* environment readers."""

import numpy as np
import pytest

from moeroute._validate import IntegerTypeError, environ_choice, environ_int, integer
from moeroute.config import RouterConfig
from moeroute.layout import ExpertLayout, LayoutError


@pytest.mark.parametrize("value", [3, np.int64(3), np.int32(3), np.uint8(3)])
def test_python_and_numpy_integers_are_integers(value):
    result = integer("n", value, 1, 8)
    assert result == 3 and type(result) is int


@pytest.mark.parametrize(
    "value, kind",
    [
        (True, "bool"),
        (np.bool_(True), "bool"),
        (3.0, "float"),
        (np.float64(3), "float64"),
        ("3", "str"),
        ([3], "list"),
        (None, "NoneType"),
    ],
)
def test_other_kinds_are_refused_as_both_type_and_value_errors(value, kind):
    with pytest.raises(IntegerTypeError, match=rf"n=.* must be an integer >= 1, got {kind}") as info:
        integer("n", value, 1)
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)


def test_bounds_are_named():
    with pytest.raises(ValueError, match=r"^k=0 must be an integer in \[1, 8\]$"):
        integer("k", 0, 1, 8)
    with pytest.raises(ValueError, match=r"^k=9 must be an integer <= 8$"):
        integer("k", 9, maximum=8)
    with pytest.raises(LayoutError, match=r"k=-1 must be an integer >= 0"):
        integer("k", -1, 0, error=LayoutError)


def test_the_same_rule_in_config_layout_and_ops():
    """np.int64 accepted and 2.0 refused by RouterConfig, ExpertLayout and the ops alike."""
    from moeroute.routing import align_block_size, expert_load

    assert RouterConfig(np.int64(8), np.int64(2), num_expert_group=np.int32(2)) == RouterConfig(
        8, 2, num_expert_group=2
    )
    assert ExpertLayout(np.int64(8), ep_size=np.int64(2), dispatch="all2all") == ExpertLayout(
        8, ep_size=2, dispatch="all2all"
    )
    ids = np.array([[0, 1], [1, 3]])
    np.testing.assert_array_equal(expert_load(ids, np.int64(4)), [1, 2, 0, 1])
    for call in (
        lambda: RouterConfig(8, 2.0),
        lambda: ExpertLayout(8.0),
        lambda: expert_load(ids, 4.0),
        lambda: align_block_size(ids, 4, 2.0),
    ):
        with pytest.raises(ValueError, match=r"=\d\.0 must be an integer"):
            call()


def test_why_ends_both_messages():
    with pytest.raises(ValueError, match=r"^w=0 must be an integer >= 1 \(forwards per window\)$"):
        integer("w", 0, 1, why="forwards per window")
    with pytest.raises(IntegerTypeError, match=r"^w=2.0 must be an integer >= 1 \(forwards per window\), got float$"):
        integer("w", 2.0, 1, why="forwards per window")


def test_the_same_rule_in_the_torch_modules_eplb_and_quant():
    """The checks that were written by hand before: a bool, a float and 0 refused, NumPy integers taken."""
    import torch

    from moeroute.bindings.torch.load_window import check_window
    from moeroute.bindings.torch.mlp import GatedMLP
    from moeroute.eplb import rebalance
    from moeroute.quant import QuantConfig
    from moeroute.quant.fp8 import quantize_fp8_activations

    load = np.ones(8)
    calls = {
        "load_window": check_window,
        "hidden_size": lambda v: GatedMLP(v, 4),
        "num_physical_experts": lambda v: rebalance(load, v, 2),
        "group_size": lambda v: quantize_fp8_activations(torch.ones(2, 8), group_size=v),
    }
    for name, call in calls.items():
        for bad in (True, 2.0, 0):
            with pytest.raises(ValueError, match=rf"{name}={bad!r} must be an integer >= 1"):
                call(bad)
    assert check_window(np.int64(4)) == 4 and GatedMLP(np.int32(8), 4).gate_proj.in_features == 8
    with pytest.raises(ValueError, match=r"block_size=\(True, 128\) must be a pair \(rows, columns\) of integers >= 1"):
        QuantConfig("fp8_block", block_size=(True, 128))
    assert QuantConfig("fp8_block", block_size=(np.int64(64), 128)).block_size == (64, 128)


def test_router_config_refuses_more_experts_than_int32_ids():
    with pytest.raises(ValueError, match=r"num_experts=2147483664 exceeds 2147483647.*int32"):
        RouterConfig(2**31 + 16, 2)
    assert RouterConfig(2**31 - 1, 2).num_experts == 2**31 - 1


def test_environ_choice(monkeypatch):
    monkeypatch.delenv("MOEROUTE_TEST_CHOICE", raising=False)
    assert environ_choice("MOEROUTE_TEST_CHOICE", ("a", "b"), "a") == "a"
    monkeypatch.setenv("MOEROUTE_TEST_CHOICE", " B ")
    assert environ_choice("MOEROUTE_TEST_CHOICE", ("a", "b"), "a") == "b"
    monkeypatch.setenv("MOEROUTE_TEST_CHOICE", "")
    assert environ_choice("MOEROUTE_TEST_CHOICE", ("a", "b"), "a") == "a"
    monkeypatch.setenv("MOEROUTE_TEST_CHOICE", "bogus")
    with pytest.raises(ValueError, match=r"MOEROUTE_TEST_CHOICE='bogus' is not one of \('a', 'b'\)"):
        environ_choice("MOEROUTE_TEST_CHOICE", ("a", "b"), "a")


def test_environ_int(monkeypatch):
    monkeypatch.delenv("MOEROUTE_TEST_INT", raising=False)
    assert environ_int("MOEROUTE_TEST_INT", 1, 1) == 1
    monkeypatch.setenv("MOEROUTE_TEST_INT", "4")
    assert environ_int("MOEROUTE_TEST_INT", 1, 1) == 4
    for text in ("0", "four", "2.5"):
        monkeypatch.setenv("MOEROUTE_TEST_INT", text)
        with pytest.raises(ValueError, match=rf"MOEROUTE_TEST_INT='{text}' must be an integer >= 1"):
            environ_int("MOEROUTE_TEST_INT", 1, 1)
