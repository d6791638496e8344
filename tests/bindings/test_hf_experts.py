"""moeroute as a transformers experts implementation (``experts_implementation="moeroute"``).

Each supported block family computes the same output with moeroute's experts as with
transformers' own (eager) experts loop; a whole model selects it without any module being
replaced. Tiny random blocks and models are built from their configs (no download).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.interop

from moeroute.bindings.torch import hf  # noqa: E402
from moeroute.bindings.torch import register_experts_implementation  # noqa: E402
from helpers.reference import rel_error  # noqa: E402
from test_hf import BF16_RTOL, BLOCKS, FP32_RTOL, H, _randomize  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def registered():
    return register_experts_implementation()


def _run(block, x, implementation):
    block.experts.config._experts_implementation = implementation
    with torch.no_grad():
        return block(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(BLOCKS))
def test_experts_implementation_matches_eager(name, dtype):
    builder = BLOCKS[name][0]
    block = _randomize(builder(), seed=11).to(dtype)
    x = torch.randn(3, 7, H, generator=torch.Generator().manual_seed(12)).to(dtype)
    expected = _run(block, x, "eager")
    actual = _run(block, x, "moeroute")
    assert actual.dtype == dtype and actual.shape == expected.shape
    # The block's router, shared expert and weights are the same; only the expert sum moves
    # (float32 accumulation in moeroute, the block's dtype in transformers).
    assert rel_error(actual, expected) < (FP32_RTOL if dtype == torch.float32 else BF16_RTOL)
    local = hf._LOCAL_EXPERTS[block.experts][1]
    assert local.w_gate_up.data_ptr() == block.experts.gate_up_proj.data_ptr()  # no copy


def test_registered_in_all_experts_functions():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    assert ALL_EXPERTS_FUNCTIONS["moeroute"] is hf.experts_forward
    assert register_experts_implementation() == "moeroute"  # idempotent


def test_a_model_selects_moeroute_without_patching():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=H,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        head_dim=16,
    )
    torch.manual_seed(13)
    model = _randomize(Qwen3MoeForCausalLM(config), seed=13)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(14))
    with torch.no_grad():
        expected = model(tokens).logits
        model.set_experts_implementation("moeroute")
        assert model.config._experts_implementation == "moeroute"
        experts_types = {type(layer.mlp.experts) for layer in model.model.layers}
        actual = model(tokens).logits
    assert experts_types == {type(model.model.layers[0].mlp.experts)}  # nothing replaced
    assert all(layer.mlp.experts in hf._LOCAL_EXPERTS for layer in model.model.layers)
    assert rel_error(actual, expected) < FP32_RTOL


def test_weights_replaced_after_first_use_are_picked_up():
    block = _randomize(BLOCKS["qwen3_moe"][0](), seed=15)
    x = torch.randn(1, 5, H, generator=torch.Generator().manual_seed(16))
    _run(block, x, "moeroute")
    block.experts.gate_up_proj = torch.nn.Parameter(block.experts.gate_up_proj.detach() * 2)
    assert rel_error(_run(block, x, "moeroute"), _run(block, x, "eager")) < FP32_RTOL


def test_experts_forward_skips_expert_parallel_sentinels():
    block = _randomize(BLOCKS["mixtral"][0](), seed=17)
    experts = block.experts
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(18))
    ids = torch.tensor([[0, 8], [3, 1], [8, 8], [7, 2]])  # 8 = num_experts: not held here
    weights = torch.rand(4, 2, generator=torch.Generator().manual_seed(19))
    out = hf.experts_forward(experts, x, ids, weights)
    expected = torch.zeros_like(x)
    for t in range(4):
        for k in range(2):
            e = int(ids[t, k])
            if e < 8:
                gate, up = torch.nn.functional.linear(x[t], experts.gate_up_proj[e]).chunk(2)
                expected[t] += weights[t, k] * torch.nn.functional.linear(
                    experts.act_fn(gate) * up, experts.down_proj[e]
                )
    assert rel_error(out, expected) < FP32_RTOL


def test_unsupported_experts_layout_is_refused():
    block = BLOCKS["qwen3_moe"][0]()
    block.experts.has_bias = True
    with pytest.raises(ValueError, match="biased"):
        hf.experts_forward(block.experts, torch.zeros(1, H), torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4))
