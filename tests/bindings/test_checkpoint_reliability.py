"""Checkpoint loaders under damaged input, and copies of quantized layers.

A checkpoint that is refused leaves the layer bit for bit as it was, with an error naming the
key (and the expert); a missing tensor is never read as zeros. The loaded tensors are
compared byte for byte with the tensors the test wrote, in moeroute's layout (gate rows
first), written out here from the checkpoint layouts' definitions.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

from helpers.reference import randn
from moeroute.bindings.torch import MoE, load_experts
from moeroute.config import RouterConfig
from moeroute.quant import QuantConfig, quantize_experts

safetensors_torch = pytest.importorskip("safetensors.torch")

H, I, N, K = 128, 96, 6, 2
BLOCK = QuantConfig("fp8_block", block_size=(32, 64))
TENSOR = QuantConfig("fp8_tensor")
ROUTER = RouterConfig(N, K, "softmax", renormalize=True)


def _quantized(quant=BLOCK, seed=0):
    return quantize_experts(randn(N, 2 * I, H, seed=seed, scale=0.1), randn(N, H, I, seed=seed + 1, scale=0.1), quant)


def _per_expert(prefix, q_gu, s_gu, q_d, s_d):
    """DeepSeek-V3's per-expert keys of stacked moeroute tensors (fp8_block scales)."""
    nb = s_gu.shape[1] // 2
    state = {}
    for e in range(q_gu.shape[0]):
        for name, weight, scale in (
            ("gate_proj", q_gu[e, :I], s_gu[e, :nb]),
            ("up_proj", q_gu[e, I:], s_gu[e, nb:]),
            ("down_proj", q_d[e], s_d[e]),
        ):
            state[f"{prefix}experts.{e}.{name}.weight"] = weight.contiguous()
            state[f"{prefix}experts.{e}.{name}.weight_scale_inv"] = scale.contiguous()
    return state


def _snapshot(module):
    """Every tensor of the module as bytes (FP8 included), cloned."""
    return {
        name: tensor.detach().clone().view(torch.uint8)
        if tensor.dtype == torch.float8_e4m3fn
        else tensor.detach().clone()
        for name, tensor in module.state_dict(keep_vars=True).items()
    }


def _assert_unchanged(module, before):
    after = _snapshot(module)
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name


def _save(path, state):
    safetensors_torch.save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))


def _holder(**layers):
    holder = nn.Module()
    for name, layer in layers.items():
        setattr(holder, name, layer)
    return holder


def _loaded_fp8_layer(quant=BLOCK, seed=100, **kwargs):
    """A layer already holding other experts than the checkpoints below."""
    layer = MoE(ROUTER, H, I, quant=quant, **kwargs)
    q_gu, s_gu, q_d, s_d = _quantized(quant, seed=seed)
    layer.load_routed_weights(q_gu, q_d, gate_up_scale=s_gu, down_scale=s_d)
    return layer


# ------------------------------------------------------------------ refused before anything is written


def test_missing_down_scale_of_expert_3_changes_nothing(tmp_path):
    state = _per_expert("mlp.", *_quantized())
    del state["mlp.experts.3.down_proj.weight_scale_inv"]
    _save(tmp_path, state)
    model = _holder(mlp=_loaded_fp8_layer())
    before = _snapshot(model)
    with pytest.raises(ValueError, match=r"mlp\.experts\.3\.down_proj\.weight_scale_inv is missing"):
        load_experts(model, tmp_path)
    _assert_unchanged(model, before)


def test_a_bad_scale_value_in_the_second_layer_changes_neither_layer(tmp_path):
    state = _per_expert("a.", *_quantized())
    state.update(_per_expert("b.", *_quantized(seed=5)))
    state["b.experts.4.up_proj.weight_scale_inv"][1, 0] = float("nan")
    _save(tmp_path, state)
    model = _holder(a=_loaded_fp8_layer(), b=_loaded_fp8_layer(seed=200))
    before = _snapshot(model)
    with pytest.raises(ValueError, match=r"b\.experts\.4\.up_proj\.weight_scale_inv must be finite and > 0"):
        load_experts(model, tmp_path)
    _assert_unchanged(model, before)


def test_a_tensor_the_layer_does_not_have_changes_nothing(tmp_path):
    state = _per_expert("mlp.", *_quantized())
    state["mlp.gate.weight"] = randn(N, H, seed=3)
    state["mlp.gate.extra"] = torch.ones(2)
    _save(tmp_path, state)
    model = _holder(mlp=_loaded_fp8_layer())
    before = _snapshot(model)
    with pytest.raises(ValueError, match=r"the layer does not have: \['mlp\.gate\.extra'\]"):
        load_experts(model, tmp_path)
    _assert_unchanged(model, before)


def test_a_misshapen_router_beside_per_expert_fp8_keys_changes_nothing():
    """The per-expert FP8 keys are written into the layer's own tensors (no second copy of the
    layer): the router's shape is checked before the first write, not after."""
    state = _per_expert("", *_quantized())
    state["gate.weight"] = randn(N + 1, H, seed=3)
    layer = _loaded_fp8_layer()
    before = _snapshot(layer)
    with pytest.raises(ValueError, match=r"router_weight has shape \[7, 128\], expected \[6, 128\]"):
        layer.load_state_dict(state)
    _assert_unchanged(layer, before)


@pytest.mark.parametrize("missing", ["mlp.experts.2.up_proj.weight", "mlp.experts.5.gate_proj.weight"])
def test_a_missing_expert_weight_is_a_value_error_naming_the_key(tmp_path, missing):
    state = _per_expert("mlp.", *_quantized())
    del state[missing]
    _save(tmp_path, state)
    model = _holder(mlp=_loaded_fp8_layer())
    before = _snapshot(model)
    with pytest.raises(ValueError, match=missing.replace(".", r"\.") + " is missing"):
        load_experts(model, tmp_path)
    _assert_unchanged(model, before)


def test_a_missing_stacked_tensor_is_a_value_error_naming_the_key(tmp_path):
    q_gu, s_gu, q_d, s_d = _quantized()
    _save(
        tmp_path,
        {
            "mlp.experts.gate_up_proj": q_gu,
            "mlp.experts.gate_up_proj_scale_inv": s_gu,
            "mlp.experts.down_proj_scale_inv": s_d,
        },
    )
    model = _holder(mlp=_loaded_fp8_layer())
    before = _snapshot(model)
    with pytest.raises(ValueError, match=r"mlp\.experts\.down_proj is missing from the checkpoint"):
        load_experts(model, tmp_path)
    _assert_unchanged(model, before)


# ------------------------------------------------------------------ damaged per-expert tensors


def _damaged(kind):
    """A per-expert state dict whose expert 2 has one damaged tensor: (state, key, actual, expected)."""
    state = _per_expert("", *_quantized())
    if kind == "transposed scale":  # [3, 2] -> [2, 3]
        key = "experts.2.gate_proj.weight_scale_inv"
        state[key] = state[key].t().contiguous()
        return state, key, [2, 3], [3, 2]
    if kind == "narrow scale":
        key = "experts.2.up_proj.weight_scale_inv"
        state[key] = state[key][:, :1].contiguous()
        return state, key, [3, 1], [3, 2]
    key = "experts.2.down_proj.weight"
    state[key] = state[key].t().contiguous()
    return state, key, [I, H], [H, I]


KINDS = ["transposed scale", "narrow scale", "transposed down weight"]


@pytest.mark.parametrize("kind", KINDS)
def test_load_state_dict_names_the_damaged_tensor(kind):
    state, key, actual, expected = _damaged(kind)
    layer = _loaded_fp8_layer()
    before = _snapshot(layer)
    message = rf"{key.replace('.', chr(92) + '.')} \(expert 2\) has shape {actual}, expected {expected}"
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        layer.load_state_dict(state, strict=False)
    _assert_unchanged(layer, before)


@pytest.mark.parametrize("kind", KINDS)
def test_load_experts_names_the_damaged_tensor(tmp_path, kind):
    state, key, actual, expected = _damaged(kind)
    _save(tmp_path, {"mlp." + k: v for k, v in state.items()})
    model = _holder(mlp=_loaded_fp8_layer())
    before = _snapshot(model)
    message = rf"mlp\.{key.replace('.', chr(92) + '.')} \(expert 2\) has shape {actual}, expected {expected}"
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_experts(model, tmp_path)
    _assert_unchanged(model, before)


def test_a_stacked_tensor_of_the_wrong_shape_is_named():
    q_gu, s_gu, q_d, s_d = _quantized()
    layer = _loaded_fp8_layer()
    state = {
        "experts.gate_up_proj": q_gu,
        "experts.gate_up_proj_scale_inv": s_gu,
        "experts.down_proj": q_d.transpose(1, 2).contiguous(),
        "experts.down_proj_scale_inv": s_d,
    }
    with pytest.raises(
        ValueError, match=rf"experts\.down_proj has shape \[{N}, {I}, {H}\], expected \[{N}, {H}, {I}\]"
    ):
        layer.load_state_dict(state, strict=False)


# ------------------------------------------------------------------ transformers' per-tensor FP8Experts


def _fp8_experts_state(q_gu, s_gu, q_d, s_d):
    """transformers' per-tensor FP8Experts block state (scales [N, 2, 1] and [N, 1, 1]),
    from the module itself when transformers has it."""
    try:
        from transformers import DeepseekV3Config
        from transformers.integrations.finegrained_fp8 import FP8Experts
    except ImportError:  # the names and shapes it saves
        return {
            "gate_up_proj": q_gu,
            "gate_up_proj_scale_inv": s_gu[:, :, None],
            "down_proj": q_d,
            "down_proj_scale_inv": s_d[:, None, None],
        }
    config = DeepseekV3Config(hidden_size=H, moe_intermediate_size=I, n_routed_experts=N)
    block = FP8Experts(config, block_size=None)
    with torch.no_grad():
        block.gate_up_proj.copy_(q_gu)
        block.down_proj.copy_(q_d)
        block.gate_up_proj_scale_inv.copy_(s_gu[:, :, None])
        block.down_proj_scale_inv.copy_(s_d[:, None, None])
    return dict(block.state_dict())


def _same_bytes(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.interop
@pytest.mark.parametrize("loader", ["load_state_dict", "load_experts"])
def test_per_tensor_fp8_experts_block_state_loads(tmp_path, loader):
    q_gu, s_gu, q_d, s_d = expected = _quantized(TENSOR, seed=7)
    block_state = _fp8_experts_state(*expected)
    assert tuple(block_state["gate_up_proj_scale_inv"].shape) == (N, 2, 1)
    assert tuple(block_state["down_proj_scale_inv"].shape) == (N, 1, 1)
    router = randn(N, H, seed=8)
    state = {"experts." + k: v for k, v in block_state.items()}
    state["gate.weight"] = router
    layer = _loaded_fp8_layer(TENSOR)
    if loader == "load_state_dict":
        layer.load_state_dict(state)
    else:
        _save(tmp_path, {"mlp." + k: v for k, v in state.items()})
        load_experts(_holder(mlp=layer), tmp_path)
    experts = layer.experts
    assert _same_bytes(experts.w_gate_up, q_gu) and _same_bytes(experts.w_down, q_d)
    assert torch.equal(experts.gate_up_scale, s_gu) and torch.equal(experts.down_scale, s_d)
    # The same layer as one given the [N, 2] and [N] scales directly: the same bits out.
    direct = MoE(ROUTER, H, I, quant=TENSOR)
    direct.load_routed_weights(q_gu, q_d, gate_up_scale=s_gu, down_scale=s_d)
    direct.router_weight.data.copy_(router)
    x = randn(7, H, seed=9)
    with torch.no_grad():
        assert torch.equal(layer(x), direct(x))


def test_per_tensor_scales_of_another_shape_are_refused_naming_the_key():
    q_gu, s_gu, q_d, s_d = _quantized(TENSOR, seed=7)
    layer = _loaded_fp8_layer(TENSOR)
    state = {
        "experts.gate_up_proj": q_gu,
        "experts.gate_up_proj_scale_inv": s_gu[:, :, None].expand(N, 2, 2),
        "experts.down_proj": q_d,
        "experts.down_proj_scale_inv": s_d,
    }
    with pytest.raises(ValueError, match=r"experts\.gate_up_proj_scale_inv has shape \[6, 2, 2\]"):
        layer.load_state_dict(state, strict=False)


# ------------------------------------------------------------------ MXFP4 (gpt-oss) expert biases

MX_H, MX_I = 64, 64
MXFP4 = QuantConfig("mxfp4")


def _mxfp4_layer(expert_bias=True):
    return MoE(ROUTER, MX_H, MX_I, activation="swigluoai", expert_bias=expert_bias, router_bias=True, quant=MXFP4)


def _mxfp4_checkpoint(seed=0):
    """gpt-oss's MXFP4 block keys: random code bytes, scale bytes 120..134 (no 255), biases;
    gate_up rows alternate gate and up."""
    generator = torch.Generator().manual_seed(seed)

    def bytes_(*shape, low=0, high=256):
        return torch.randint(low, high, shape, generator=generator, dtype=torch.uint8)

    return {
        "router.weight": torch.randn(N, MX_H, generator=generator),
        "router.bias": torch.randn(N, generator=generator),
        "experts.gate_up_proj_blocks": bytes_(N, 2 * MX_I, MX_H // 32, 16),
        "experts.gate_up_proj_scales": bytes_(N, 2 * MX_I, MX_H // 32, low=120, high=135),
        "experts.gate_up_proj_bias": torch.randn(N, 2 * MX_I, generator=generator),
        "experts.down_proj_blocks": bytes_(N, MX_H, MX_I // 32, 16),
        "experts.down_proj_scales": bytes_(N, MX_H, MX_I // 32, low=120, high=135),
        "experts.down_proj_bias": torch.randn(N, MX_H, generator=generator),
    }


def _gate_rows_first(tensor):
    return torch.cat([tensor[:, 0::2], tensor[:, 1::2]], dim=1)


@pytest.mark.parametrize("loader", ["load_state_dict", "load_experts"])
def test_mxfp4_checkpoint_loads_its_biases(tmp_path, loader):
    state = _mxfp4_checkpoint()
    layer = _mxfp4_layer()
    if loader == "load_state_dict":
        layer.load_state_dict(state)
    else:
        _save(tmp_path, {"mlp." + k: v for k, v in state.items()})
        load_experts(_holder(mlp=layer), tmp_path)
    experts = layer.experts
    assert torch.equal(experts.w_gate_up, _gate_rows_first(state["experts.gate_up_proj_blocks"]))
    assert torch.equal(experts.gate_up_scale, _gate_rows_first(state["experts.gate_up_proj_scales"]))
    assert torch.equal(experts.b_gate_up, _gate_rows_first(state["experts.gate_up_proj_bias"]))
    assert torch.equal(experts.w_down, state["experts.down_proj_blocks"])
    assert torch.equal(experts.b_down, state["experts.down_proj_bias"])
    assert torch.equal(layer.router_bias, state["router.bias"])


@pytest.mark.parametrize("missing", ["experts.gate_up_proj_bias", "experts.down_proj_bias"])
def test_mxfp4_checkpoint_without_an_expert_bias_is_refused(tmp_path, missing):
    state = _mxfp4_checkpoint()
    del state[missing]
    layer = _mxfp4_layer()
    layer.load_state_dict(_mxfp4_checkpoint(seed=1))
    before = _snapshot(layer)
    _save(tmp_path, {"mlp." + k: v for k, v in state.items()})
    with pytest.raises(ValueError, match=rf"mlp\.{missing.replace('.', chr(92) + '.')} is missing"):
        load_experts(_holder(mlp=layer), tmp_path)
    with pytest.raises(KeyError, match=rf"{missing.replace('.', chr(92) + '.')} is missing"):
        layer.load_state_dict(state, strict=False)
    _assert_unchanged(layer, before)


def test_mxfp4_biases_for_a_layer_without_them_are_refused(tmp_path):
    state = _mxfp4_checkpoint()
    layer = _mxfp4_layer(expert_bias=False)
    before = _snapshot(layer)
    _save(tmp_path, {"mlp." + k: v for k, v in state.items()})
    with pytest.raises(ValueError, match=r"holds mlp\.experts\.gate_up_proj_bias but the layer .* no expert biases"):
        load_experts(_holder(mlp=layer), tmp_path)
    with pytest.raises(ValueError, match=r"holds experts\.gate_up_proj_bias but the layer has no expert biases"):
        layer.load_state_dict(state, strict=False)
    _assert_unchanged(layer, before)


def test_mxfp4_scale_byte_255_of_the_last_expert_changes_nothing(tmp_path):
    state = _mxfp4_checkpoint()
    state["experts.down_proj_scales"][N - 1, 3, 1] = 255
    layer = _mxfp4_layer()
    layer.load_state_dict(_mxfp4_checkpoint(seed=1))
    before = _snapshot(layer)
    _save(tmp_path, {"mlp." + k: v for k, v in state.items()})
    with pytest.raises(ValueError, match=rf"mlp\.experts\.down_proj_scales\[{N - 1}\] holds the scale byte 255"):
        load_experts(_holder(mlp=layer), tmp_path)
    _assert_unchanged(layer, before)


# ------------------------------------------------------------------ pickle and torch.save of quantized layers


def _pickle(module):
    return pickle.loads(pickle.dumps(module))


def _torch_save_load(module):
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("copier", [_pickle, _torch_save_load, copy.deepcopy])
@pytest.mark.parametrize("quant", [BLOCK, TENSOR, MXFP4], ids=["fp8_block", "fp8_tensor", "mxfp4"])
def test_copies_of_quantized_layers_compute_the_same_bits(copier, quant):
    if quant.format == "mxfp4":
        layer = _mxfp4_layer()
        layer.load_state_dict(_mxfp4_checkpoint(seed=2))
        hidden = MX_H
    else:
        layer = _loaded_fp8_layer(quant, seed=3)
        hidden = H
    x = randn(9, hidden, seed=4)
    copied = copier(layer)
    for name, tensor in layer.state_dict(keep_vars=True).items():
        other = copied.state_dict(keep_vars=True)[name]
        assert other.dtype == tensor.dtype and type(other) is type(tensor), name
        assert other.data_ptr() != tensor.data_ptr(), name
        assert (
            torch.equal(other.view(torch.uint8), tensor.view(torch.uint8))
            if tensor.dtype.itemsize == 1
            else torch.equal(other, tensor)
        ), name
    assert not any(p.requires_grad for p in copied.experts.parameters())
    with torch.no_grad():
        assert torch.equal(copied(x), layer(x))
    # The copy pickles again, and the original is untouched by having been pickled.
    assert layer.experts.w_gate_up.dtype == (torch.uint8 if quant.format == "mxfp4" else torch.float8_e4m3fn)
    assert _pickle(copied).experts.w_down.dtype == layer.experts.w_down.dtype


# ------------------------------------------------------------------ gpt-oss float experts


@pytest.mark.interop
def test_load_experts_reads_gpt_oss_float_experts(tmp_path):
    # A gpt-oss block's own float checkpoint: gate_up_proj [N, H, 2I] with gate/up columns
    # interleaved, down_proj [N, I, H], and the biases.
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = transformers.GptOssConfig(
        hidden_size=MX_H,
        intermediate_size=MX_I,
        num_local_experts=N,
        num_experts_per_tok=K,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )

    def block(seed):
        generator = torch.Generator().manual_seed(seed)
        mlp = GptOssMLP(config).eval()
        with torch.no_grad():
            for p in mlp.parameters():
                p.copy_(torch.randn(p.shape, generator=generator))
        return mlp

    saved = block(0)
    _save(tmp_path, {"mlp." + k: v for k, v in saved.state_dict().items()})
    layer = MoE.from_hf(block(1))
    load_experts(_holder(mlp=layer), tmp_path)
    experts, source = layer.experts, saved.experts
    assert torch.equal(experts.w_gate_up, _gate_rows_first(source.gate_up_proj.detach().transpose(1, 2)))
    assert torch.equal(experts.w_down, source.down_proj.detach().transpose(1, 2))
    assert torch.equal(experts.b_gate_up, _gate_rows_first(source.gate_up_proj_bias.detach()))
    assert torch.equal(experts.b_down, source.down_proj_bias.detach())
    assert torch.equal(layer.router_weight, saved.router.weight) and torch.equal(layer.router_bias, saved.router.bias)
    x = randn(5, MX_H, seed=3)
    with torch.no_grad():
        assert torch.equal(layer(x), MoE.from_hf(saved)(x))


# ------------------------------------------------------------------ moeroute's own names


def test_own_names_of_the_wrong_shape_change_nothing():
    layer = MoE(ROUTER, H, I)
    state = {
        name: torch.randn(tensor.shape, generator=torch.Generator().manual_seed(1))
        for name, tensor in layer.state_dict().items()
    }
    state["experts.w_down"] = state["experts.w_down"].transpose(1, 2).contiguous()
    before = _snapshot(layer)
    with pytest.raises(ValueError, match=rf"experts\.w_down has shape \[{N}, {I}, {H}\], expected \[{N}, {H}, {I}\]"):
        layer.load_state_dict(state)
    _assert_unchanged(layer, before)


@pytest.mark.parametrize("quant", [BLOCK, MXFP4, None], ids=["fp8", "mxfp4", "float"])
def test_weights_of_another_format_are_never_cast(quant):
    # Float values copied into FP8 or MXFP4 weights (or e4m3 bytes into float weights) would
    # be cast without their scales.
    if quant is None:
        layer, weight = MoE(ROUTER, H, I), _quantized()[0]
    elif quant.format == "mxfp4":
        layer = _mxfp4_layer()
        weight = torch.rand(layer.experts.w_gate_up.shape)
    else:
        layer, weight = _loaded_fp8_layer(), torch.rand(N, 2 * I, H)
    state = dict(layer.state_dict())
    state["experts.w_gate_up"] = weight
    before = _snapshot(layer)
    with pytest.raises(ValueError, match=rf"experts\.w_gate_up has dtype {weight.dtype} but the layer holds"):
        layer.load_state_dict(state)
    _assert_unchanged(layer, before)


def test_mxfp4_checkpoint_loads_into_the_layers_own_tensors_and_round_trips():
    """The gpt-oss keys are written one expert at a time into the layer's tensors (no copy of
    the layer is built); the layer's own state dict loads back bit for bit."""
    state = _mxfp4_checkpoint(seed=3)
    layer = _mxfp4_layer()
    experts = layer.experts
    pointers = {name: getattr(experts, name).data_ptr() for name in ("w_gate_up", "gate_up_scale", "w_down")}
    layer.load_state_dict(state)
    assert {name: getattr(experts, name).data_ptr() for name in pointers} == pointers
    assert torch.equal(experts.w_gate_up, _gate_rows_first(state["experts.gate_up_proj_blocks"]))
    assert torch.equal(experts.down_scale, state["experts.down_proj_scales"])
    before = {name: tensor.clone() for name, tensor in layer.state_dict().items()}
    layer.load_state_dict(layer.state_dict())
    after = layer.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[name], after[name]) for name in before)
