"""A gpt-oss MXFP4 checkpoint loaded by transformers' own ``from_pretrained``, then patched.

The checkpoint is written as gpt-oss publishes it (safetensors: ``*_blocks``, ``*_scales`` and
the float biases of every layer's experts, ``quantization_config`` with quant_method mxfp4).

On a machine without triton and the ``kernels`` hub package transformers dequantizes such a
checkpoint (``Mxfp4Config(dequantize=True)``): its float ``GptOssMLP`` is the reference here,
computing with exactly the MXFP4 values. Where it keeps the experts packed it swaps each
``GptOssMLP`` for an ``Mxfp4GptOssMLP`` whose experts hold the bytes and scales in
triton_kernels tensors (a hardware layout). That load runs here through transformers' own
loader with triton_kernels' tensor and layout API stood in for by `_stub_triton_kernels_hub`,
whose layout really moves the bytes (a reader that skipped the unswizzle would read
garbage). transformers' packed forward needs the GPU kernels, so the patched model is
compared with the dequantized model: max |logits difference| <= 1e-4 * max |logits| in
float32 (the same dequantized values, summed in another order).
"""

from __future__ import annotations

import inspect
import json
import sys
import types
import warnings

import pytest
import torch

from moeroute.bindings.torch import MoE, replace_moe_blocks
from moeroute.bindings.torch.hf import TupleOutputMoE
from moeroute.quant import QuantConfig, quantize_mxfp4

pytest.importorskip("transformers")
pytestmark = pytest.mark.interop

H, I, N, K = 64, 64, 8, 4
RTOL = 1e-4


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


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A directory holding a tiny gpt-oss MXFP4 checkpoint (config.json + model.safetensors)."""
    from safetensors.torch import save_file
    from transformers import GptOssForCausalLM

    torch.manual_seed(0)
    model = GptOssForCausalLM(_config()).eval()
    generator = torch.Generator().manual_seed(1)
    tensors = {}
    for key, value in model.state_dict().items():
        value = value.detach()
        if "mlp." in key:  # transformers' init leaves the MoE weights small: wider ones route and mix more
            value = torch.randn(value.shape, generator=generator) * 0.5
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            # transformers holds [N, in, out]; the checkpoint's MXFP4 rows are outputs.
            blocks, scales = quantize_mxfp4(value.transpose(1, 2).contiguous())
            tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
        else:
            tensors[key] = value.contiguous()
    path = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = _config().to_dict()
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


def _dequantized_model(path):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    # .float(): transformers 5.19 and older dequantize the experts to bfloat16 whatever the dtype
    # asked for (the values, e2m1 times a power of two, are exact in both).
    return (
        AutoModelForCausalLM.from_pretrained(
            path, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32
        )
        .float()
        .eval()
    )


class _FlippedLayout:
    """A stand-in hardware layout: the stored bytes are the tensor's flipped along its last
    axis; ``unswizzle_data`` undoes it (triton_kernels' layouts have this method)."""

    def __init__(self, shape=None):
        pass

    def swizzle_data(self, data):
        return data.flip(-1).contiguous()

    def unswizzle_data(self, data):
        return data.flip(-1).contiguous()


def _stub_triton_kernels_hub():
    """The part of triton_kernels' API that transformers' MXFP4 loader calls (no kernels)."""

    def wrap_torch_tensor(data, dtype=None):
        return types.SimpleNamespace(storage=types.SimpleNamespace(data=data, layout=None), shape=data.shape)

    def convert_layout(tensor, layout_cls, **options):
        layout = layout_cls()
        return types.SimpleNamespace(
            storage=types.SimpleNamespace(data=layout.swizzle_data(tensor.storage.data), layout=layout),
            shape=tensor.shape,
        )

    layout = types.SimpleNamespace(
        make_default_matmul_mxfp4_w_layout=lambda mx_axis: (_FlippedLayout, {}), StridedLayout=_FlippedLayout
    )
    return types.SimpleNamespace(
        tensor=types.SimpleNamespace(FP4="fp4", convert_layout=convert_layout, wrap_torch_tensor=wrap_torch_tensor),
        tensor_details=types.SimpleNamespace(layout=layout),
        matmul_ogs=types.SimpleNamespace(
            PrecisionConfig=types.SimpleNamespace, FlexCtx=types.SimpleNamespace, InFlexData=types.SimpleNamespace
        ),
    )


def _packed_model(path, monkeypatch):
    """``from_pretrained`` keeping the MXFP4 experts packed, as on a machine with the kernels."""
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    quantizer = pytest.importorskip("transformers.quantizers.quantizer_mxfp4")
    hub_kernels = pytest.importorskip("transformers.integrations.hub_kernels")
    if not hasattr(mxfp4, "Mxfp4Deserialize"):
        pytest.skip("this transformers loads MXFP4 checkpoints another way")
    from transformers import AutoModelForCausalLM

    # The environment check wants accelerate, triton and the kernels package: the stub stands in.
    monkeypatch.setattr(quantizer.Mxfp4HfQuantizer, "validate_environment", lambda self, *a, **k: None)
    monkeypatch.setattr(hub_kernels, "get_kernel", lambda *a, **k: _stub_triton_kernels_hub())
    prepare = quantizer.Mxfp4HfQuantizer._process_model_before_weight_loading
    if "use_kernels" in inspect.signature(prepare).parameters:
        # transformers 5.1x dequantizes on a CPU unless told use_kernels (on a GPU it keeps the bytes).
        monkeypatch.setattr(
            quantizer.Mxfp4HfQuantizer,
            "_process_model_before_weight_loading",
            lambda self, model, **kwargs: prepare(self, model, **{**kwargs, "use_kernels": True}),
        )
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_replace_moe_blocks_of_a_transformers_loaded_mxfp4_checkpoint(checkpoint, monkeypatch):
    from safetensors.torch import load_file

    input_ids = (torch.arange(12) * 7 % 128)[None]
    reference = _dequantized_model(checkpoint)
    with torch.no_grad():
        expected = reference(input_ids).logits.double()
    packed = _packed_model(checkpoint, monkeypatch)
    # transformers >= 5.2x swaps the block for Mxfp4GptOssMLP; earlier 5.x patch GptOssMLP's forward.
    block_class = (
        "Mxfp4GptOssMLP" if hasattr(sys.modules["transformers.integrations.mxfp4"], "Mxfp4GptOssMLP") else "GptOssMLP"
    )
    mlps = [layer.mlp for layer in packed.model.layers]
    assert [(type(mlp).__name__, type(mlp.experts).__name__) for mlp in mlps] == [
        (block_class, "Mxfp4GptOssExperts")
    ] * 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every block is supported: nothing to warn about
        assert replace_moe_blocks(packed) == 2
    stored = load_file(str(checkpoint / "model.safetensors"))
    for index, layer in enumerate(packed.model.layers):
        assert isinstance(layer.mlp, TupleOutputMoE) and layer.mlp.moe.quant == QuantConfig("mxfp4")
        # The checkpoint's bytes, gate rows (the even rows) first: not dequantized, not requantized.
        blocks = stored[f"model.layers.{index}.mlp.experts.gate_up_proj_blocks"].flatten(2)
        assert torch.equal(layer.mlp.moe.experts.w_gate_up.flatten(2), torch.cat([blocks[:, 0::2], blocks[:, 1::2]], 1))
    with torch.no_grad():
        actual = packed(input_ids).logits.double()
    assert float((actual - expected).abs().max()) <= RTOL * float(expected.abs().max())


def test_the_dequantized_model_is_patched_too(checkpoint):
    model = _dequantized_model(checkpoint)
    input_ids = (torch.arange(9) * 5 % 128)[None]
    with torch.no_grad():
        expected = model(input_ids).logits.double()
        assert replace_moe_blocks(model) == 2
        actual = model(input_ids).logits.double()
    assert all(layer.mlp.moe.quant is None for layer in model.model.layers)
    assert float((actual - expected).abs().max()) <= RTOL * float(expected.abs().max())


class RenamedSparseMoeBlock(torch.nn.Module):
    """A block class moeroute does not know, shaped like every transformers MoE block."""

    def __init__(self, block):
        super().__init__()
        self.router, self.experts = block.router, block.experts

    def forward(self, hidden_states):
        raise AssertionError("not called")


def test_unsupported_blocks_of_a_supported_family_warn_or_raise(checkpoint):
    model = _dequantized_model(checkpoint)
    kept = model.model.layers[0].mlp
    model.model.layers[1].mlp = RenamedSparseMoeBlock(model.model.layers[1].mlp)
    with pytest.raises(TypeError, match=r"class RenamedSparseMoeBlock at model\.layers\.1\.mlp .*1 of 2"):
        replace_moe_blocks(model, strict=True)
    assert model.model.layers[0].mlp is kept  # strict: nothing replaced
    with pytest.warns(UserWarning, match=r"class RenamedSparseMoeBlock at model\.layers\.1\.mlp .*1 of 2"):
        assert replace_moe_blocks(model) == 1
    assert isinstance(model.model.layers[0].mlp, TupleOutputMoE)
    with pytest.raises(TypeError, match="strict must be a bool"):
        replace_moe_blocks(model, strict="yes")


def test_from_hf_reads_the_loaded_packed_block(checkpoint, monkeypatch):
    packed = _packed_model(checkpoint, monkeypatch)
    reference = _dequantized_model(checkpoint)
    block = packed.model.layers[1].mlp
    moe = MoE.from_hf(block)
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected, _ = reference.model.layers[1].mlp(x[None])
        actual = moe(x)
    expected = expected[0].double()
    assert float((actual.double() - expected).abs().max()) <= RTOL * float(expected.abs().max())
    # Packed bytes without their scales are refused, naming the tensor.
    del block.experts.down_proj_precision_config
    with pytest.raises(ValueError, match="down_proj holds packed MXFP4 bytes without their scales"):
        MoE.from_hf(block)


def test_a_supported_family_with_no_supported_block_warns_another_model_does_not(checkpoint):
    model = _dequantized_model(checkpoint)
    for layer in model.model.layers:
        layer.mlp = RenamedSparseMoeBlock(layer.mlp)
    # The family is read from config.model_type ("gpt_oss"): 0 of 2 is reported, not silent.
    with pytest.warns(
        UserWarning,
        match=r"class RenamedSparseMoeBlock at model\.layers\.0\.mlp, "
        r"model\.layers\.1\.mlp .*0 of 2",
    ):
        assert replace_moe_blocks(model) == 0
    # A model of no supported family (no config, no supported block) is not moeroute's to judge.
    other = torch.nn.Sequential(model.model.layers[0].mlp)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert replace_moe_blocks(other, strict=True) == 0
