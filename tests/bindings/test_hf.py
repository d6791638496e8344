"""transformers interop: MoE.from_hf equals each block's own forward; the swap helper keeps logits.

Tiny random blocks and models are built from their configs (no download).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.interop

from helpers.modules import randomize  # noqa: E402
from helpers.reference import rel_error  # noqa: E402
from moeroute.bindings.torch import MoE, replace_moe_blocks  # noqa: E402
from moeroute.layout import LayoutError  # noqa: E402

H = 64
FP32_RTOL = 1e-5  # normwise relative error in float32 (the brief's bound)
# bfloat16 keeps 8 significant bits (ulp 2**-8 = 0.0039 relative); the blocks round their
# routing weights and accumulate expert outputs in bfloat16, moeroute in float32: allow a
# few ulps of the output's scale.
BF16_RTOL = 2e-2


def _deepseek_v3(**overrides):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    fields = dict(
        hidden_size=H,
        moe_intermediate_size=32,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    fields.update(overrides)
    return DeepseekV3MoE(DeepseekV3Config(**fields))


def _glm4_moe():
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE

    return Glm4MoeMoE(
        Glm4MoeConfig(
            hidden_size=H,
            moe_intermediate_size=32,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_group=1,
            topk_group=1,
            n_shared_experts=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
        )
    )


def _qwen2_moe():
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    # Qwen1.5-MoE shape: the shared expert is 4x the routed one -> S = 4 slots.
    return Qwen2MoeSparseMoeBlock(
        Qwen2MoeConfig(
            hidden_size=H,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=64,
            num_experts=12,
            num_experts_per_tok=4,
            norm_topk_prob=False,
        )
    )


def _qwen3_moe():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    return Qwen3MoeSparseMoeBlock(
        Qwen3MoeConfig(
            hidden_size=H, moe_intermediate_size=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True
        )
    )


def _qwen3_next():
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    return Qwen3NextSparseMoeBlock(
        Qwen3NextConfig(
            hidden_size=H,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            num_experts=16,
            num_experts_per_tok=5,
            norm_topk_prob=True,
        )
    )


def _qwen3_5_moe():
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    return Qwen3_5MoeSparseMoeBlock(
        Qwen3_5MoeTextConfig(
            hidden_size=H,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            num_experts=16,
            num_experts_per_tok=5,
        )
    )


def _mixtral():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    return MixtralSparseMoeBlock(
        MixtralConfig(hidden_size=H, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)
    )


# name -> (builder, has a shared expert, expected S)
BLOCKS = {
    "deepseek_v3": (_deepseek_v3, True, 1),
    "kimi_k2": (
        lambda: _deepseek_v3(n_routed_experts=12, n_group=1, topk_group=1, routed_scaling_factor=2.827),
        True,
        1,
    ),
    "glm4_moe": (_glm4_moe, True, 2),
    "qwen2_moe": (_qwen2_moe, True, 4),
    "qwen3_moe": (_qwen3_moe, False, 0),
    "qwen3_next": (_qwen3_next, True, 1),
    "qwen3_5_moe": (_qwen3_5_moe, True, 1),
    "mixtral": (_mixtral, False, 0),
}


def _randomize(module, seed=0):
    """Random weights, the correction bias spread so that it changes selection; eval mode."""
    return randomize(module, seed, 0.2, 0.05).eval()


def _cases():
    for name, (_, has_shared, _) in BLOCKS.items():
        for shared in ("auto", "runner", "overlap", "fused") if has_shared else ("auto",):
            yield name, shared


@pytest.mark.parametrize("name,shared", list(_cases()))
def test_from_hf_matches_block_fp32(name, shared):
    builder, has_shared, slots = BLOCKS[name]
    block = _randomize(builder(), seed=1)
    moe = MoE.from_hf(block, shared=shared)
    assert moe.num_shared_experts == slots
    assert moe.layout.shared == ({"auto": "fused"}.get(shared, shared) if has_shared else "none")
    x = torch.randn(3, 5, H, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = block(x)
        actual = moe(x)
    assert actual.shape == expected.shape
    assert rel_error(actual, expected) < FP32_RTOL


@pytest.mark.parametrize("name", list(BLOCKS))
def test_from_hf_matches_block_bf16(name):
    builder, has_shared, _ = BLOCKS[name]
    block = _randomize(builder(), seed=3).to(torch.bfloat16)
    moe = MoE.from_hf(block)
    assert moe.experts.w_gate_up.dtype == torch.bfloat16
    x = torch.randn(2, 6, H, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    with torch.no_grad():
        expected = block(x)
        actual = moe(x)
    assert actual.dtype == torch.bfloat16
    assert rel_error(actual, expected) < BF16_RTOL


def test_from_hf_routing_matches_block_router():
    """Selection is exact: the same ids and (to float32 rounding) weights as the block's router."""
    from moeroute.bindings.torch import arrays

    block = _randomize(_deepseek_v3(), seed=5)
    moe = MoE.from_hf(block)
    x = torch.randn(20, H, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        _, hf_weights, hf_ids = block.gate(x)
        weights, ids = arrays.select_experts(moe.compute_router_logits(x), moe.router, moe.correction_bias)
    order = torch.argsort(hf_ids.to(torch.int64), dim=1)
    ours = torch.argsort(ids.to(torch.int64), dim=1)
    assert torch.equal(torch.gather(hf_ids.to(torch.int32), 1, order), torch.gather(ids, 1, ours))
    torch.testing.assert_close(torch.gather(weights, 1, ours), torch.gather(hf_weights, 1, order), rtol=1e-6, atol=0)


def test_from_hf_copies_routed_weights_and_reads_router_fields():
    block = _randomize(_deepseek_v3(), seed=7)
    moe = MoE.from_hf(block)
    assert moe.router.scoring == "sigmoid" and moe.router.num_expert_group == 4
    assert moe.router.topk_group == 2 and moe.router.routed_scaling_factor == 2.5
    torch.testing.assert_close(moe.correction_bias, block.gate.e_score_correction_bias, rtol=0, atol=0)
    n = block.experts.gate_up_proj.shape[0]
    torch.testing.assert_close(moe.experts.w_gate_up[:n], block.experts.gate_up_proj, rtol=0, atol=0)
    # the fused shared slot is the shared MLP, gate rows then up rows
    slot = moe.experts.w_gate_up[n]
    torch.testing.assert_close(slot[:32], block.shared_experts.gate_proj.weight, rtol=0, atol=0)
    torch.testing.assert_close(slot[32:], block.shared_experts.up_proj.weight, rtol=0, atol=0)
    assert moe.experts.w_gate_up.data_ptr() != block.experts.gate_up_proj.data_ptr()


def test_from_hf_fused_refused_when_shared_does_not_split():
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    block = Qwen2MoeSparseMoeBlock(
        Qwen2MoeConfig(
            hidden_size=H,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=40,
            num_experts=8,
            num_experts_per_tok=2,
        )
    )
    block = _randomize(block, seed=8)
    assert MoE.from_hf(block).layout.shared == "runner"
    with pytest.raises(LayoutError, match="not a multiple"):
        MoE.from_hf(block, shared="fused")
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        assert rel_error(MoE.from_hf(block)(x), block(x[None])[0]) < FP32_RTOL


def test_from_hf_rejects_unsupported_block():
    with pytest.raises(TypeError, match="not a supported transformers MoE block"):
        MoE.from_hf(nn.Linear(4, 4))


# ------------------------------------------------------------------ whole models


def _tiny_models():
    from transformers import (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    common = dict(
        vocab_size=128,
        hidden_size=H,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        intermediate_size=96,
    )
    return {
        "qwen3_moe": (
            Qwen3MoeForCausalLM,
            Qwen3MoeConfig(
                **common, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True
            ),
            2,
        ),
        "qwen2_moe": (
            Qwen2MoeForCausalLM,
            Qwen2MoeConfig(
                **common,
                moe_intermediate_size=16,
                shared_expert_intermediate_size=32,
                num_experts=8,
                num_experts_per_tok=2,
            ),
            2,
        ),
        "deepseek_v3": (
            DeepseekV3ForCausalLM,
            DeepseekV3Config(
                **common,
                moe_intermediate_size=32,
                n_routed_experts=8,
                num_experts_per_tok=2,
                n_group=2,
                topk_group=1,
                n_shared_experts=1,
                first_k_dense_replace=1,
                kv_lora_rank=16,
                q_lora_rank=32,
                qk_rope_head_dim=8,
                qk_nope_head_dim=8,
                v_head_dim=16,
            ),
            1,
        ),
    }


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "deepseek_v3"])
def test_replace_moe_blocks_keeps_logits(name):
    model_class, config, expected_blocks = _tiny_models()[name]
    torch.manual_seed(10)
    model = model_class(config).eval()
    with torch.no_grad():  # make the correction bias matter
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(torch.randn(bias.shape) * 0.05)
    input_ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        expected = model(input_ids).logits
        count = replace_moe_blocks(model)
        actual = model(input_ids).logits
    assert count == expected_blocks
    assert sum(isinstance(m, MoE) for m in model.modules()) == expected_blocks
    assert rel_error(actual, expected) < FP32_RTOL


def test_replace_moe_blocks_rejects_non_module():
    with pytest.raises(TypeError, match="nn.Module"):
        replace_moe_blocks("model")


# ------------------------------------------------------------------ gpt-oss


def _gpt_oss_config(**overrides):
    from transformers import GptOssConfig

    fields = dict(
        vocab_size=128,
        hidden_size=H,
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=4,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        layer_types=["sliding_attention", "full_attention"],
    )
    fields.update(overrides)
    return GptOssConfig(**fields)


def _gpt_oss_block(seed, expert_scale=3.0):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    block = _randomize(GptOssMLP(_gpt_oss_config()), seed=seed)
    with torch.no_grad():  # large enough that swigluoai's clamps at +-7 take effect
        block.experts.gate_up_proj.mul_(expert_scale)
    return block


def _gpt_oss_gate_up(block, x):
    """Pre-activation gate/up values of every expert, to check the clamps are exercised."""
    experts = block.experts
    return torch.einsum("th,ehc->etc", x.reshape(-1, H), experts.gate_up_proj) + experts.gate_up_proj_bias[:, None]


@pytest.mark.parametrize("shape", [(13, H), (3, 5, H)], ids=["T,H", "B,S,H"])
def test_from_hf_gpt_oss_matches_block_fp32(shape):
    block = _gpt_oss_block(seed=21)
    moe = MoE.from_hf(block)
    assert moe.activation == "swigluoai" and moe.router.scoring == "softmax" and moe.router.renormalize
    assert moe.router.num_experts == 8 and moe.router.top_k == 4
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(22))
    gate_up = _gpt_oss_gate_up(block, x)
    assert (gate_up[..., 0::2] > 7).any() and (gate_up[..., 1::2].abs() > 7).any()
    with torch.no_grad():
        expected, _ = block(x if x.dim() == 3 else x[None])
        actual = moe(x)
    expected = expected if x.dim() == 3 else expected[0]
    assert actual.shape == x.shape
    assert rel_error(actual, expected) < FP32_RTOL


def test_from_hf_gpt_oss_matches_plain_torch_definition():
    # Independent definition: router linear with bias, top-k logits, softmax over the K,
    # per slot (up + 1) * g * sigmoid(1.702 g) with clamps, both projections biased.
    block = _gpt_oss_block(seed=23)
    moe = MoE.from_hf(block)
    r, e = block.router, block.experts
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(24))
    logits = x @ r.weight.T + r.bias
    top, ids = torch.topk(logits, 4, dim=-1)
    weights = torch.softmax(top, dim=-1)
    expected = torch.zeros_like(x)
    for t in range(9):
        for k in range(4):
            j = int(ids[t, k])
            gate_up = x[t] @ e.gate_up_proj[j] + e.gate_up_proj_bias[j]
            gate = gate_up[0::2].clamp(max=7.0)
            up = gate_up[1::2].clamp(-7.0, 7.0)
            hidden = (up + 1) * gate * torch.sigmoid(1.702 * gate)
            expected[t] += weights[t, k] * (hidden @ e.down_proj[j] + e.down_proj_bias[j])
    with torch.no_grad():
        assert rel_error(moe(x), expected) < FP32_RTOL


def test_from_hf_gpt_oss_weight_layout():
    block = _gpt_oss_block(seed=25)
    moe = MoE.from_hf(block)
    e = block.experts
    inter = 32
    for j in range(8):
        # gate rows = even columns of gate_up_proj[j] transposed, up rows = odd columns.
        torch.testing.assert_close(moe.experts.w_gate_up[j, :inter], e.gate_up_proj[j][:, 0::2].T, rtol=0, atol=0)
        torch.testing.assert_close(moe.experts.w_gate_up[j, inter:], e.gate_up_proj[j][:, 1::2].T, rtol=0, atol=0)
        torch.testing.assert_close(moe.experts.b_gate_up[j, :inter], e.gate_up_proj_bias[j, 0::2], rtol=0, atol=0)
        torch.testing.assert_close(moe.experts.b_gate_up[j, inter:], e.gate_up_proj_bias[j, 1::2], rtol=0, atol=0)
        torch.testing.assert_close(moe.experts.w_down[j], e.down_proj[j].T, rtol=0, atol=0)
        torch.testing.assert_close(moe.experts.b_down[j], e.down_proj_bias[j], rtol=0, atol=0)
    torch.testing.assert_close(moe.router_bias, block.router.bias, rtol=0, atol=0)


def test_from_hf_gpt_oss_bf16():
    block = _gpt_oss_block(seed=26, expert_scale=1.0).to(torch.bfloat16)
    moe = MoE.from_hf(block)
    x = torch.randn(2, 6, H, generator=torch.Generator().manual_seed(27)).to(torch.bfloat16)
    with torch.no_grad():
        expected, _ = block(x)
        actual = moe(x)
    assert actual.dtype == torch.bfloat16
    assert rel_error(actual, expected) < BF16_RTOL


def test_from_hf_gpt_oss_rejects_other_swiglu_constants():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    block = GptOssMLP(_gpt_oss_config(swiglu_limit=5.0))
    block.experts.limit = 5.0  # what the forward reads (transformers 5.16 and older hard-code 7.0)
    with pytest.raises(ValueError, match="swiglu_limit=5.0"):
        MoE.from_hf(block)


def test_replace_moe_blocks_gpt_oss_keeps_logits():
    from transformers import GptOssForCausalLM

    from moeroute.bindings.torch.hf import TupleOutputMoE

    torch.manual_seed(28)
    model = GptOssForCausalLM(_gpt_oss_config()).eval()
    _randomize(model, seed=28)
    input_ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(29))
    with torch.no_grad():
        expected = model(input_ids).logits
        count = replace_moe_blocks(model)
        actual = model(input_ids).logits
    assert count == 2
    assert sum(isinstance(m, TupleOutputMoE) for m in model.modules()) == 2
    assert rel_error(actual, expected) < FP32_RTOL


@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen2_moe", "deepseek_v3"])
def test_from_hf_runs_as_inference_in_every_shared_mode_outside_no_grad(name):
    """transformers leaves the shared MLP's parameters requiring grad; that used to make
    shared="runner"/"overlap" raise outside no_grad while "auto" (fused) ran."""
    builder, _, _ = BLOCKS[name]
    block = _randomize(builder(), seed=4)
    assert any(p.requires_grad for p in block.parameters())
    x = torch.randn(2, 3, H, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = block(x)
    for shared in ("auto", "runner", "overlap", "fused"):
        out = MoE.from_hf(block, shared=shared)(x)  # grad mode on
        assert not out.requires_grad, shared
        assert rel_error(out, expected) < FP32_RTOL, shared
    with pytest.raises(RuntimeError, match="inference-only.*hidden_states requires grad"):
        MoE.from_hf(block, shared="runner")(x.requires_grad_(True))


def test_replace_moe_blocks_on_a_bare_block_says_to_use_from_hf():
    block = _qwen3_moe()
    with pytest.raises(ValueError, match=r"itself a Qwen3MoeSparseMoeBlock.*MoE.from_hf\(block\)"):
        replace_moe_blocks(block)
    # A model holding the block is still swapped.
    holder = nn.Sequential(block)
    assert replace_moe_blocks(holder) == 1 and isinstance(holder[0], MoE)


# ------------------------------------------------------------------ module structure


def test_moe_module_does_not_import_hf():
    # Data flows one way: hf.py builds MoE (and attaches MoE.from_hf); moe.py never imports hf.
    import ast
    import inspect

    import moeroute.bindings.torch.moe as moe_module

    tree = ast.parse(inspect.getsource(moe_module))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not any(name and name.endswith(".hf") for name in imported), imported


def test_from_hf_classmethod_builds_the_subclass_it_is_called_on():
    class Tagged(MoE):
        pass

    block = _randomize(_qwen3_moe())
    x = torch.randn(1, 7, H, generator=torch.Generator().manual_seed(5))
    module = Tagged.from_hf(block)
    assert type(module) is Tagged
    with torch.no_grad():
        assert rel_error(module(x), block(x)) < FP32_RTOL
