"""MoE.from_hf / replace_moe_blocks on gpt-oss blocks whose experts carry the checkpoint's
MXFP4 tensors (``gate_up_proj_blocks``/``_scales``, ``down_proj_blocks``/``_scales``; rows
are outputs, gate_up's rows alternate gate and up).

The reference is transformers' own float gpt-oss block (GptOssMLP) with its expert weights
set to the dequantized bytes: 1e-4 relative in float32, 2e-2 in bfloat16.
"""

from __future__ import annotations

import pytest
import torch

from moeroute.bindings.torch import MoE, replace_moe_blocks
from moeroute.quant import QuantConfig, dequantize_mxfp4, quantize_mxfp4

pytest.importorskip("transformers")
pytestmark = pytest.mark.interop

H, I, N, K = 64, 64, 8, 4
RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _config():
    from transformers import GptOssConfig

    return GptOssConfig(
        vocab_size=128,
        hidden_size=H,
        intermediate_size=I,
        num_local_experts=N,
        num_experts_per_tok=K,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        layer_types=["sliding_attention", "full_attention"],
    )


def mxfp4_block(seed=0):
    """(float reference block, the same block with MXFP4 expert tensors and no float weights)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    generator = torch.Generator().manual_seed(seed)
    reference = GptOssMLP(_config()).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    experts = reference.experts
    # The checkpoint stores [out, in]: gate_up rows [N, 2I, H] (interleaved), down [N, H, I].
    gate_up = quantize_mxfp4(experts.gate_up_proj.detach().transpose(1, 2))
    down = quantize_mxfp4(experts.down_proj.detach().transpose(1, 2))
    with torch.no_grad():  # the reference computes with exactly the dequantized values
        experts.gate_up_proj.copy_(dequantize_mxfp4(*gate_up).transpose(1, 2))
        experts.down_proj.copy_(dequantize_mxfp4(*down).transpose(1, 2))
    packed = GptOssMLP(_config()).eval()
    packed.load_state_dict(reference.state_dict())
    del packed.experts.gate_up_proj, packed.experts.down_proj
    for name, tensor in zip(
        ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales"), (*gate_up, *down)
    ):
        packed.experts.register_buffer(name, tensor)
    return reference, packed, gate_up, down


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(11, H), (2, 5, H)])
def test_from_hf_matches_the_float_block(dtype, shape):
    reference, packed, gate_up, _ = mxfp4_block()
    moe = MoE.from_hf(packed)
    assert moe.quant == QuantConfig("mxfp4") and moe.activation == "swigluoai"
    # Gate rows first: the block's even rows, then its odd rows, bytes and scales alike.
    assert torch.equal(moe.experts.w_gate_up, torch.cat([gate_up[0][:, 0::2], gate_up[0][:, 1::2]], 1))
    assert torch.equal(moe.experts.gate_up_scale, torch.cat([gate_up[1][:, 0::2], gate_up[1][:, 1::2]], 1))
    assert all(t.dtype == torch.uint8 for t in (moe.experts.w_gate_up, moe.experts.w_down))
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected, _ = reference(x if x.dim() == 3 else x[None])
        actual = moe(x.to(dtype))
    expected = expected.reshape(x.shape).double()
    assert actual.dtype == dtype
    assert float((actual.double() - expected).abs().max() / expected.abs().max()) < RTOL[dtype]


def test_replace_moe_blocks_keeps_the_packed_bytes():
    from transformers import GptOssForCausalLM

    torch.manual_seed(0)
    model = GptOssForCausalLM(_config()).eval()
    reference, packed, _, _ = mxfp4_block(seed=1)
    model.model.layers[0].mlp = packed
    model.model.layers[1].mlp = reference
    input_ids = torch.arange(10)[None] % 128
    with torch.no_grad():
        model.model.layers[0].mlp = reference
        expected = model(input_ids).logits
        model.model.layers[0].mlp = packed
        assert replace_moe_blocks(model) == 2
        actual = model(input_ids).logits
    layers = [layer.mlp.moe for layer in model.model.layers]
    assert layers[0].quant == QuantConfig("mxfp4") and layers[1].quant is None
    assert float((actual - expected).abs().max() / expected.abs().max()) < 1e-4


def test_from_hf_refuses_another_format():
    _, packed, _, _ = mxfp4_block()
    with pytest.raises(ValueError, match="MXFP4 experts"):
        MoE.from_hf(packed, quant=QuantConfig("fp8_block"))


def _checkpoint(packed):
    """The block's state dict under gpt-oss's checkpoint names (a layer prefix included)."""
    return {"model.layers.0.mlp." + key: value for key, value in packed.state_dict().items()}


def test_load_state_dict_of_gpt_oss_mxfp4_keys():
    reference, packed, _, _ = mxfp4_block(seed=2)
    state = _checkpoint(packed)
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in state
    moe = MoE(
        MoE.from_hf(packed).router,
        H,
        I,
        activation="swigluoai",
        expert_bias=True,
        router_bias=True,
        quant=QuantConfig("mxfp4"),
    )
    holder = torch.nn.Module()
    holder.mlp = moe
    holder.load_state_dict({k[len("model.layers.0.") :]: v for k, v in state.items()})
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected, _ = reference(x[None])
        actual = moe(x)
    assert float((actual - expected[0]).abs().max() / expected.abs().max()) < RTOL[torch.float32]


def test_load_state_dict_refuses_nan_scales_and_missing_keys():
    _, packed, _, _ = mxfp4_block(seed=3)
    moe = MoE.from_hf(packed)
    state = dict(packed.state_dict())
    state["experts.gate_up_proj_scales"] = state["experts.gate_up_proj_scales"].clone()
    state["experts.gate_up_proj_scales"][1, 2, 0] = 255
    with pytest.raises(ValueError, match=r"experts.gate_up_proj scales\[1, 2, 0\] is 255"):
        moe.load_state_dict(state)
    del state["experts.down_proj_scales"]
    with pytest.raises(KeyError, match="down_proj_scales"):
        moe.load_state_dict(state)


def test_load_experts_reads_the_mxfp4_safetensors(tmp_path):
    from safetensors.torch import save_file

    from moeroute.bindings.torch import load_experts

    reference, packed, _, _ = mxfp4_block(seed=4)
    save_file({k: v.contiguous() for k, v in _checkpoint(packed).items()}, str(tmp_path / "model.safetensors"))
    _, blank, _, _ = mxfp4_block(seed=5)  # other bytes and router: the load must replace them all
    holder = torch.nn.Module()
    holder.model = torch.nn.Module()
    holder.model.layers = torch.nn.ModuleList([torch.nn.Module()])
    holder.model.layers[0].mlp = MoE.from_hf(blank)
    stats = load_experts(holder, tmp_path)
    assert stats["layers"] == 1
    moe = holder.model.layers[0].mlp
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected, _ = reference(x[None])
        actual = moe(x)
    assert float((actual - expected[0]).abs().max() / expected.abs().max()) < RTOL[torch.float32]
    assert moe.experts.w_gate_up.dtype == torch.uint8
