"""The shared-expert ownership switch at E = 1 (docs/semantics.md section 3).

Every (shared mode x S x gate x scaling regime) must give the dense reference
``sum_k w_k * expert_k(x) + g * shared(x)``, computed here in float64 from the routing of
moeroute.routing.reference, with the shared contribution computed exactly once.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers.modules import CountingMLP, randomize
from helpers.reference import dense_experts, rel_error
from moeroute.bindings.torch.moe import MoE
from moeroute.config import RouterConfig
from moeroute.layout import LayoutError
from moeroute.routing import reference

H, I, N, K, T = 32, 16, 8, 2, 12
RSF = 2.5
FP32_RTOL = 1e-5  # normwise relative error allowed in float32 (the brief's bound)

ROUTERS = {
    "softmax": RouterConfig(N, K, "softmax", renormalize=True, routed_scaling_factor=RSF),
    "sigmoid_grouped": RouterConfig(
        N, K, "sigmoid", num_expert_group=4, topk_group=2, renormalize=True, routed_scaling_factor=RSF
    ),
}


class CountingGate(nn.Linear):
    def __init__(self, hidden):
        super().__init__(hidden, 1, bias=False)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


def build(shared, S, gated, regime, router="softmax", seed=0, **kwargs):
    shared_mlp = CountingMLP(H, S * I) if S else None
    gate = CountingGate(H) if gated else None
    if shared_mlp is not None:
        randomize(shared_mlp, seed + 1, 0.3, 0.1)
    if gate is not None:
        randomize(gate, seed + 2, 0.3, 0.1)
    config = ROUTERS[router]
    module = MoE(
        config,
        H,
        I,
        shared_experts=shared_mlp,
        shared_expert_gate=gate,
        shared=shared,
        scaling_regime=regime,
        correction_bias=config.scoring == "sigmoid",
        **kwargs,
    )
    generator = torch.Generator().manual_seed(seed)
    routed_in = module.routed_hidden_size
    w_gate_up = torch.randn(N, 2 * I, routed_in, generator=generator) * 0.3
    w_down = torch.randn(N, routed_in, I, generator=generator) * 0.3
    with torch.no_grad():
        module.router_weight.copy_(torch.randn(N, H, generator=generator))
        if module.correction_bias is not None:
            module.correction_bias.copy_(torch.randn(N, generator=generator) * 0.1)
        module.load_routed_weights(w_gate_up, w_down)
    return module, shared_mlp, gate, (w_gate_up, w_down)


@torch.no_grad()
def dense_reference(module, x, shared_mlp, gate, weights, *, routed_in=None, routed_out=None):
    """``out_t(sum_k w_k * expert_k(in_t(x))) + g * shared(x)`` in float64."""
    w_gate_up, w_down = (w.double() for w in weights)
    logits = F.linear(x.float(), module.router_weight.float())
    bias = None if module.correction_bias is None else module.correction_bias.numpy()
    topk_weights, topk_ids = reference.select_experts(logits.numpy(), module.router, bias)
    x64 = x.double()
    routed_x = x64 if routed_in is None else F.linear(x64, routed_in.weight.double())
    routed = dense_experts(routed_x, topk_weights, topk_ids, w_gate_up, w_down)
    if routed_out is not None:
        routed = F.linear(routed, routed_out.weight.double(), routed_out.bias.double())
    if shared_mlp is None:
        return routed
    s = (
        shared_mlp.down_proj.weight.double()
        @ (F.silu(x64 @ shared_mlp.gate_proj.weight.double().T) * (x64 @ shared_mlp.up_proj.weight.double().T)).T
    )
    s = s.T
    if gate is not None:
        s = torch.sigmoid(x64 @ gate.weight.double().T) * s
    return routed + s


CASES = list(itertools.product(["auto", "runner", "overlap", "fused"], [1, 2], [False, True], ["router", "output"]))


@pytest.mark.parametrize("shared,S,gated,regime", CASES)
def test_invariant_every_mode(shared, S, gated, regime):
    module, shared_mlp, gate, weights = build(shared, S, gated, regime)
    expected_mode = "fused" if shared in ("auto", "fused") else shared
    assert module.layout.shared == expected_mode
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        out = module(x)
    assert out.shape == x.shape and out.dtype == torch.float32
    assert rel_error(out, dense_reference(module, x, shared_mlp, gate, weights)) < FP32_RTOL


@pytest.mark.parametrize("shared", ["runner", "overlap", "fused"])
@pytest.mark.parametrize("regime", ["router", "output"])
def test_invariant_grouped_sigmoid_with_bias(shared, regime):
    module, shared_mlp, gate, weights = build(shared, 1, True, regime, router="sigmoid_grouped", seed=3)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        out = module(x)
    assert rel_error(out, dense_reference(module, x, shared_mlp, gate, weights)) < FP32_RTOL


def _record_expert_inputs(module):
    seen = []
    original = module.experts.forward

    def recording(hidden, weights, local_ids):
        seen.append((hidden.shape[0], local_ids.clone(), weights.clone()))
        return original(hidden, weights, local_ids)

    module.experts.forward = recording
    return seen


@pytest.mark.parametrize("shared,S", list(itertools.product(["runner", "overlap", "fused"], [1, 2])))
def test_shared_expert_computed_exactly_once(shared, S):
    module, shared_mlp, gate, _ = build(shared, S, True, "router")
    seen = _record_expert_inputs(module)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        module(x)
    assert len(seen) == 1
    _, local_ids, slot_weights = seen[0]
    num_routed = module.layout.routed_range(0)[1]
    shared_entries = local_ids >= num_routed
    assert gate.calls == 1  # the gate runs once in every mode
    if shared == "fused":
        assert shared_mlp.calls == 0 and shared_mlp.rows == 0
        # every token reaches each of the S slots exactly once, with weight g
        for j in range(S):
            assert torch.equal((local_ids == num_routed + j).sum(dim=1), torch.ones(T, dtype=torch.int64))
        g = torch.sigmoid(x @ gate.weight.T).reshape(-1)
        torch.testing.assert_close(slot_weights[:, K:], g[:, None].expand(T, S), rtol=1e-6, atol=0)
        assert int(shared_entries.sum()) == T * S
    else:
        assert shared_mlp.calls == 1 and shared_mlp.rows == T
        assert int(shared_entries.sum()) == 0  # no slot: nothing else computes it


def test_fused_slot_weight_in_output_regime_is_gate_over_rsf():
    module, _, gate, _ = build("fused", 1, True, "output")
    seen = _record_expert_inputs(module)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        module(x)
    g = torch.sigmoid(x @ gate.weight.T).reshape(-1)
    torch.testing.assert_close(seen[0][2][:, K], g / RSF, rtol=1e-6, atol=0)
    # routed weights are routed with rsf = 1 in this regime: renormalized to sum 1
    torch.testing.assert_close(seen[0][2][:, :K].sum(dim=1), torch.ones(T), rtol=1e-6, atol=0)


def test_auto_picks_runner_when_the_shared_mlp_does_not_split():
    shared_mlp = CountingMLP(H, 24)  # 24 is not a multiple of I = 16
    module = MoE(ROUTERS["softmax"], H, I, shared_experts=shared_mlp)
    assert module.layout.shared == "runner"
    assert "not a multiple" in module.layout.shared_reason
    with pytest.raises(LayoutError, match="not a multiple"):
        MoE(ROUTERS["softmax"], H, I, shared_experts=CountingMLP(H, 24), shared="fused")


def test_opaque_shared_module_is_never_fused():
    opaque = nn.Sequential(nn.Linear(H, H, bias=False))
    module = MoE(ROUTERS["softmax"], H, I, shared_experts=opaque)
    assert module.layout.shared == "runner"
    with pytest.raises(LayoutError, match="gate_proj"):
        MoE(ROUTERS["softmax"], H, I, shared_experts=opaque, shared="fused")


def test_shared_mlp_with_another_activation_is_not_fused():
    shared_mlp = CountingMLP(H, I)
    shared_mlp.act_fn = nn.GELU()
    with pytest.raises(LayoutError, match="act_fn"):
        MoE(ROUTERS["softmax"], H, I, shared_experts=shared_mlp, shared="fused")


LATENT = 12  # the routed experts' smaller input size


@pytest.mark.parametrize("shared,expected", [("auto", "runner"), ("runner", "runner"), ("overlap", "overlap")])
@pytest.mark.parametrize("regime", ["router", "output"])
def test_latent_moe(shared, expected, regime):
    generator = torch.Generator().manual_seed(9)
    routed_in = nn.Linear(H, LATENT, bias=False)
    routed_out = nn.Linear(LATENT, H, bias=True)
    with torch.no_grad():
        for p in list(routed_in.parameters()) + list(routed_out.parameters()):
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    module, shared_mlp, gate, weights = build(
        shared, 1, True, regime, routed_input_transform=routed_in, routed_output_transform=routed_out
    )
    assert module.layout.shared == expected
    assert module.experts.w_gate_up.shape == (N, 2 * I, LATENT)
    assert "routed_input_transform" in module.layout.shared_reason or shared != "auto"
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = module(x)
    expected_out = dense_reference(module, x, shared_mlp, gate, weights, routed_in=routed_in, routed_out=routed_out)
    assert rel_error(out, expected_out) < FP32_RTOL
    assert shared_mlp.calls == 1


def test_latent_moe_explicit_fused_is_a_layout_error():
    with pytest.raises(LayoutError, match="routed_input_transform"):
        MoE(
            ROUTERS["softmax"],
            H,
            I,
            shared_experts=CountingMLP(H, I),
            shared="fused",
            routed_input_transform=nn.Linear(H, LATENT, bias=False),
            routed_output_transform=nn.Linear(LATENT, H, bias=False),
        )


def test_no_shared_expert_resolves_to_none():
    module, _, _, weights = build("auto", 0, False, "output")
    assert module.layout.shared == "none"
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = module(x)
    assert rel_error(out, dense_reference(module, x, None, None, weights)) < FP32_RTOL


@pytest.mark.parametrize("regime", ["router", "output"])
@pytest.mark.parametrize("shared", ["runner", "overlap", "fused"])
def test_zero_tokens_every_mode(shared, regime):
    module, _, _, _ = build(shared, 1, True, regime)
    with torch.no_grad():
        out = module(torch.zeros(0, H))
    assert out.shape == (0, H) and out.dtype == torch.float32
