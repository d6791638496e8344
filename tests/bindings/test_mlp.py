"""GatedMLP against a plain float64 definition, and its fusion into expert slots."""

import pytest
import torch
import torch.nn.functional as F

from moeroute.bindings.torch.mlp import GatedMLP
from moeroute.bindings.torch.moe import shared_mlp_slots


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
def test_forward_matches_definition(activation):
    torch.manual_seed(0)
    mlp = GatedMLP(16, 24, activation)
    x = torch.randn(5, 16)
    act = {"silu": F.silu, "gelu": F.gelu,
           "gelu_tanh": lambda v: F.gelu(v, approximate="tanh")}[activation]
    g, u, d = (m.weight.double() for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    expected = (act(x.double() @ g.T) * (x.double() @ u.T)) @ d.T
    with torch.no_grad():
        torch.testing.assert_close(mlp(x).double(), expected, rtol=1e-5, atol=1e-6)


def test_splits_into_slots_of_the_routed_size():
    assert shared_mlp_slots(GatedMLP(16, 24), 16, 8, "silu") == (3, None)
    slots, reason = shared_mlp_slots(GatedMLP(16, 20), 16, 8, "silu")
    assert slots == 1 and "not a multiple" in reason
    slots, reason = shared_mlp_slots(GatedMLP(16, 8, "gelu"), 16, 8, "silu")
    assert slots == 1 and "activation" in reason


@pytest.mark.parametrize("kwargs, match", [
    ({"hidden_size": 0, "intermediate_size": 4}, "hidden_size=0"),
    ({"hidden_size": 4, "intermediate_size": 2.5}, "intermediate_size=2.5"),
    ({"hidden_size": 4, "intermediate_size": 4, "activation": "relu"}, "activation='relu'"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GatedMLP(**kwargs)
