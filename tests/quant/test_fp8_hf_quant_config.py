"""``MoE.from_hf(block, quant=QuantConfig.from_hf(config))`` on a transformers FP8Experts block
whose ``quantization_config`` lists ``modules_to_not_convert`` (informational): the config
agrees with the block's format, so the block loads, its FP8 bytes kept as they are.

The reference is the same block read without ``quant`` (the format taken from the weights):
the outputs must be identical (the same bytes, scales and kernels).
"""

from __future__ import annotations

import pytest
import torch

from moeroute.bindings.torch import MoE
from moeroute.quant import QuantConfig, quantize_experts

pytest.importorskip("transformers")
pytestmark = pytest.mark.interop

H, I, N, K = 128, 96, 6, 2
BLOCK = (32, 64)
HF_FP8 = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": list(BLOCK),
    "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate"],
}


def _fp8_block():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    from transformers.integrations.finegrained_fp8 import FP8Experts

    config = DeepseekV3Config(
        vocab_size=64,
        hidden_size=H,
        intermediate_size=128,
        moe_intermediate_size=I,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=N,
        num_experts_per_tok=K,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    )
    torch.manual_seed(0)
    block = DeepseekV3ForCausalLM(config).model.layers[1].mlp
    generator = torch.Generator().manual_seed(1)
    fp8 = FP8Experts(block.experts.config, block_size=BLOCK)
    q_gu, s_gu, q_d, s_d = quantize_experts(
        torch.randn(N, 2 * I, H, generator=generator) * 0.1,
        torch.randn(N, H, I, generator=generator) * 0.1,
        QuantConfig("fp8_block", block_size=BLOCK),
    )
    with torch.no_grad():
        fp8.gate_up_proj.data, fp8.gate_up_proj_scale_inv.data = q_gu, s_gu
        fp8.down_proj.data, fp8.down_proj_scale_inv.data = q_d, s_d
    block.experts = fp8
    return block


def test_quant_config_with_modules_to_not_convert_agrees_with_the_block():
    block = _fp8_block()
    quant = QuantConfig.from_hf({"quantization_config": HF_FP8})
    assert quant.modules_to_not_convert == ("lm_head", "model.layers.0.mlp.gate")
    # Informational: not compared, not hashed.
    assert quant == QuantConfig("fp8_block", block_size=BLOCK) and hash(quant) == hash(
        QuantConfig("fp8_block", block_size=BLOCK)
    )
    module = MoE.from_hf(block, quant=quant, shared="runner")
    assert module.quant.modules_to_not_convert == quant.modules_to_not_convert
    reference = MoE.from_hf(block, shared="runner")
    for name in ("w_gate_up", "gate_up_scale", "w_down", "down_scale"):
        a, b = getattr(module.experts, name), getattr(reference.experts, name)
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(module(x), reference(x))
    # A format that really differs is still refused.
    with pytest.raises(ValueError, match="differs from the block's FP8 experts"):
        MoE.from_hf(block, quant=QuantConfig.from_hf({"quantization_config": {**HF_FP8, "weight_block_size": None}}))
