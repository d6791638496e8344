"""torch.compile(fullgraph=True), torch.export and Dynamo on tiny transformers causal LMs
patched with replace_moe_blocks: no graph break, one moe_forward op per MoE layer, no private
op in the traced graph, and the same logits as eager and as the unpatched model.

The models are built from transformers configs (random weights, no download) and kept small
so that Inductor compiles them in seconds.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers.reference import rel_error  # noqa: E402
from moeroute.bindings.torch import MoE, replace_moe_blocks  # noqa: E402

H = 64
FP32_TOL = 1e-5  # max |difference| relative to the largest |logit|, float32
SEQUENCE = (2, 9)  # batch, tokens
COMMON = dict(
    vocab_size=128,
    hidden_size=H,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    intermediate_size=96,
)
MOE_OP = torch.ops.moeroute.moe_forward.default


def _qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        **COMMON,
        num_key_value_heads=2,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    )
    return Qwen3MoeForCausalLM(config), 2


def _deepseek_v3():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    # One dense layer, then one MoE layer (grouped sigmoid routing, bias, a shared expert).
    # As in DeepSeek-V3, every attention head has its own key/value head.
    config = DeepseekV3Config(
        **COMMON,
        num_key_value_heads=4,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    )
    return DeepseekV3ForCausalLM(config), 1


MODELS = {"qwen3_moe": _qwen3_moe, "deepseek_v3": _deepseek_v3}


@pytest.fixture(scope="module", params=list(MODELS))
def patched(request):
    """(name, patched model, input ids, its eager logits, the unpatched model's logits, MoE count)."""
    torch.manual_seed(20)
    model, moe_layers = MODELS[request.param]()
    model.eval()
    with torch.no_grad():  # a correction bias that changes selection
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(torch.randn(bias.shape) * 0.05)
    input_ids = torch.randint(0, COMMON["vocab_size"], SEQUENCE, generator=torch.Generator().manual_seed(21))
    with torch.inference_mode():
        unpatched = model(input_ids, use_cache=False).logits
        assert replace_moe_blocks(model) == moe_layers
        eager = model(input_ids, use_cache=False).logits
    assert rel_error(eager, unpatched) < FP32_TOL
    yield request.param, model, input_ids, eager, unpatched, moe_layers
    torch._dynamo.reset()


def _private_ops(targets):
    """Targets outside the public aten/moeroute/Python-operator namespaces."""
    private = []
    for target in targets:
        namespace = getattr(target, "namespace", None)
        if namespace == "mkldnn" or (namespace not in (None, "aten", "moeroute")) or "numpy" in str(target):
            private.append(target)
    return private


def test_dynamo_explain_sees_no_graph_break(patched):
    _, model, input_ids, _, _, moe_layers = patched
    torch._dynamo.reset()
    with torch.inference_mode():
        explanation = torch._dynamo.explain(model)(input_ids, use_cache=False)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    targets = [target for graph_ops in explanation.ops_per_graph for target in graph_ops]
    moe_calls = [target for target in targets if "moeroute" in str(target)]
    assert len(moe_calls) == moe_layers, moe_calls
    assert not [target for target in targets if "mkldnn" in str(target) or "numpy" in str(target)]


def test_compile_fullgraph_matches_eager(patched):
    _, model, input_ids, eager, unpatched, _ = patched
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    with torch.inference_mode():
        actual = compiled(input_ids, use_cache=False).logits
        # A second batch of the same shape reuses the compiled graph.
        other_ids = torch.flip(input_ids, dims=(1,))
        other_actual = compiled(other_ids, use_cache=False).logits
        other_eager = model(other_ids, use_cache=False).logits
    assert rel_error(actual, eager) < FP32_TOL
    assert rel_error(actual, unpatched) < FP32_TOL
    assert rel_error(other_actual, other_eager) < FP32_TOL


def test_export_matches_eager(patched):
    _, model, input_ids, eager, unpatched, moe_layers = patched
    with torch.inference_mode():
        exported = torch.export.export(model, (input_ids,), kwargs={"use_cache": False})
        actual = exported.module()(input_ids, use_cache=False).logits
    targets = [node.target for node in exported.graph.nodes if node.op == "call_function"]
    moe_calls = [target for target in targets if target == MOE_OP]
    assert len(moe_calls) == moe_layers
    assert _private_ops(targets) == []
    layer_keys = {node.args[2] for node in exported.graph.nodes if node.target == MOE_OP}
    assert layer_keys == {m.layer_key for m in model.modules() if isinstance(m, MoE)}
    assert rel_error(actual, eager) < FP32_TOL
    assert rel_error(actual, unpatched) < FP32_TOL


# ------------------------------------------------------------------ the ops in user graphs


def test_compiled_layer_serves_every_token_count_with_one_graph():
    from moeroute.bindings.torch import GatedMLP
    from moeroute.config import RouterConfig

    router = RouterConfig(8, 2, "sigmoid", num_expert_group=2, topk_group=1, routed_scaling_factor=2.5)
    module = MoE(router, H, 32, shared_experts=GatedMLP(H, 32), correction_bias=True)
    from torch._dynamo.testing import CompileCounter

    counts = CompileCounter()
    compiled = torch.compile(module, fullgraph=True, dynamic=True, backend=counts)
    generator = torch.Generator().manual_seed(22)
    with torch.inference_mode():
        for tokens in (3, 17, 64):  # not 0 or 1: Dynamo specializes those sizes
            x = torch.randn(tokens, H, generator=generator)
            assert torch.equal(compiled(x), module.forward_impl(x))
    assert counts.frame_count == 1


def test_routing_and_expert_ops_compose_under_inductor():
    from moeroute.bindings.torch import ops
    from moeroute.config import RouterConfig
    from moeroute.layout import ExpertLayout

    router = RouterConfig(8, 3, "softmax", renormalize=True)
    layout = ExpertLayout(8, 1)  # one fused shared slot, physical id 8
    generator = torch.Generator().manual_seed(23)
    w_gate_up = torch.randn(9, 64, H, generator=generator) * 0.2
    w_down = torch.randn(9, H, 32, generator=generator) * 0.2
    router_weight = torch.randn(8, H, generator=generator)

    def layer(x):
        weights, ids = ops.select_experts(x @ router_weight.T, router)
        weights, ids = ops.append_shared_slots(weights, ids, layout, 0, torch.sigmoid(x[:, 0]))
        return torch.ops.moeroute.experts(x, w_gate_up, w_down, weights, ids) * 2.0 + x

    compiled = torch.compile(layer, fullgraph=True)
    x = torch.randn(7, H, generator=generator)
    with torch.inference_mode():
        expected = layer(x)
        actual = compiled(x)
    # Independent check of the composition: routed experts plus the gated shared slot.
    logits = (x @ router_weight.T).double()
    probs = torch.softmax(logits, dim=-1)
    top = torch.topk(probs, 3, dim=-1)
    reference = torch.zeros(7, H, dtype=torch.float64)
    for t in range(7):
        slots = [(int(e), float(w) / float(top.values[t].sum())) for e, w in zip(top.indices[t], top.values[t])]
        slots.append((8, float(torch.sigmoid(x[t, 0]))))
        for e, w in slots:
            h = w_gate_up[e].double() @ x[t].double()
            reference[t] += w * (w_down[e].double() @ (torch.nn.functional.silu(h[:32]) * h[32:]))
    torch.testing.assert_close(actual.double(), reference * 2.0 + x.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)


def test_compiled_append_shared_slots_follows_the_layout_argument():
    from moeroute.bindings.torch import ops
    from moeroute.layout import ExpertLayout
    from moeroute.routing import reference

    def append(weights, ids, layout):
        return ops.append_shared_slots(weights, ids, layout, 0, 0.5)

    compiled = torch.compile(append, fullgraph=True)
    ids = torch.tensor([[3, 1], [0, 7]], dtype=torch.int32)
    weights = torch.tensor([[0.7, 0.3], [0.6, 0.4]])
    # Fresh layouts: their keys are made while Dynamo traces; a second layout must not
    # reuse the first one's graph.
    for layout in (ExpertLayout(8, 1), ExpertLayout(8, 2), ExpertLayout(8, 0)):
        got_weights, got_ids = compiled(weights, ids, layout)
        expected_weights, expected_ids = reference.append_shared_slots(weights.numpy(), ids.numpy(), layout, 0, 0.5)
        assert got_ids.tolist() == expected_ids.tolist()
        assert got_weights.tolist() == expected_weights.tolist()
