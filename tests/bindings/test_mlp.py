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
    act = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh")}[activation]
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


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"hidden_size": 0, "intermediate_size": 4}, "hidden_size=0"),
        ({"hidden_size": 4, "intermediate_size": 2.5}, "intermediate_size=2.5"),
        ({"hidden_size": 4, "intermediate_size": 4, "activation": "relu"}, "activation='relu'"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GatedMLP(**kwargs)


def test_swigluoai_forward_matches_definition():
    torch.manual_seed(1)
    mlp = GatedMLP(16, 24, "swigluoai")
    x = torch.randn(7, 16) * 8.0  # products beyond the clamps at +-7
    g, u, d = (m.weight.double() for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    gate, up = x.double() @ g.T, x.double() @ u.T
    assert (gate > 7).any() and (up.abs() > 7).any()
    gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
    expected = ((up + 1) * gate * torch.sigmoid(1.702 * gate)) @ d.T
    with torch.no_grad():
        torch.testing.assert_close(mlp(x).double(), expected, rtol=1e-5, atol=1e-5)


def test_swigluoai_shared_mlp_fuses_only_when_it_declares_the_activation():
    assert shared_mlp_slots(GatedMLP(16, 24, "swigluoai"), 16, 8, "swigluoai") == (3, None)
    slots, reason = shared_mlp_slots(GatedMLP(16, 24), 16, 8, "swigluoai")
    assert slots == 1 and "swigluoai" in reason
    slots, reason = shared_mlp_slots(GatedMLP(16, 24, "swigluoai"), 16, 8, "silu")
    assert slots == 1 and "activation" in reason


def test_fused_swigluoai_shared_expert_matches_runner():
    from moeroute.bindings.torch.moe import MoE
    from moeroute.config import RouterConfig

    torch.manual_seed(2)
    shared = GatedMLP(16, 16, "swigluoai")
    router_weight = torch.randn(4, 16)
    w_gate_up, w_down = torch.randn(4, 16, 16), torch.randn(4, 16, 8)
    x = torch.randn(5, 16) * 4.0
    outs = []
    for mode in ("fused", "runner"):
        moe = MoE(RouterConfig(4, 2), 16, 8, shared_experts=shared, shared=mode, activation="swigluoai")
        assert moe.layout.shared == mode
        with torch.no_grad():
            moe.router_weight.copy_(router_weight)
            moe.load_routed_weights(w_gate_up, w_down)
            outs.append(moe(x))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
