"""The module under dtype changes, copies and checkpoints: nothing silently wrong, nothing lost.

* Every dtype a module can be moved to either computes what a float64 reference computes
  from the module's own weights, or is refused with a ValueError at the forward.
* ``correction_bias`` stays float32, values unchanged, under every dtype change.
* oneDNN-packed copies are not part of copied or saved state: copies re-pack and compute
  the same.
* A patched transformers model saves what the unpatched model saves, and loads it back
  (the expert-parallel refusal runs on gloo ranks in test_ep.py).
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F

from helpers.reference import dense_experts, rel_error
from helpers.reference import generator as _generator
from moeroute.bindings.torch import MoE
from moeroute.experts.formats.unquantized import SUPPORTED_DTYPES, onednn_linear_serves, streamed_expert_mlp
from moeroute.experts.modules import LocalExperts
from moeroute.config import RouterConfig
from moeroute.routing import reference

N, K, H, I = 8, 2, 16, 8
#: Normwise relative error allowed against the float64 reference: float32 rounding, and a
#: few ulps of the output's scale in half precision (ulp 2**-11 float16, 2**-8 bfloat16).
RTOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}

NEEDS_ONEDNN = pytest.mark.skipif(
    not onednn_linear_serves(torch.float32), reason="this torch build has no oneDNN linear"
)


def _biased_moe(seed=0, **kwargs):
    """A DeepSeek-style module: sigmoid scores, a correction bias that changes selection, rsf."""
    router = RouterConfig(N, K, scoring="sigmoid", renormalize=True, routed_scaling_factor=2.5)
    module = MoE(router, H, I, correction_bias=True, **kwargs)
    generator = _generator(seed)
    with torch.no_grad():
        module.router_weight.copy_(torch.randn(N, H, generator=generator))
        module.correction_bias.copy_(torch.randn(N, generator=generator) * 0.3)
        module.experts.w_gate_up.copy_(torch.randn(N, 2 * I, H, generator=generator) * 0.3)
        module.experts.w_down.copy_(torch.randn(N, H, I, generator=generator) * 0.3)
    return module


def dense_reference(module, x):
    """``sum_k w_k * expert_k(x)`` in float64 from the module's weights; the logits as the
    module defines them (router_weight's dtype), selection by the NumPy reference."""
    weight = module.router_weight
    logits = F.linear(x.to(weight.dtype), weight).float()
    bias = None if module.correction_bias is None else module.correction_bias.numpy()
    topk_weights, topk_ids = reference.select_experts(logits.numpy(), module.router, bias)
    return dense_experts(x, topk_weights, topk_ids, module.experts.w_gate_up, module.experts.w_down)


# ------------------------------------------------------------------ dtypes a module can take

#: Conversions nn.Module offers (floating and complex dtypes), and whether the forward serves them.
SERVED = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16}
REFUSED = {
    "double": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "complex64": torch.complex64,
}


def _convert(module, how):
    return getattr(module, how)() if how in SERVED or how == "double" else module.to(REFUSED[how])


@pytest.mark.parametrize("how", list(SERVED))
def test_every_served_dtype_change_computes_the_reference(how):
    module = _biased_moe(seed=1)
    bias = module.correction_bias.clone()
    dtype = SERVED[how]
    _convert(module, how)
    assert module.experts.w_gate_up.dtype == dtype
    assert module.correction_bias.dtype == torch.float32
    assert torch.equal(module.correction_bias, bias)  # moved, never rounded
    x = torch.randn(12, H, generator=_generator(2)).to(dtype)
    out = module(x)
    assert out.dtype == dtype
    assert rel_error(out, dense_reference(module, x)) < RTOL[dtype]


@pytest.mark.filterwarnings("ignore:Complex modules:UserWarning")
@pytest.mark.parametrize("how", list(REFUSED))
def test_every_other_dtype_change_is_refused_at_the_forward(how):
    module = _convert(_biased_moe(seed=3), how)
    dtype = REFUSED[how]
    assert module.correction_bias.dtype == torch.float32
    x = torch.randn(5, H, generator=_generator(4)).to(dtype)
    with pytest.raises(
        ValueError,
        match=rf"expert weights are {dtype}.*torch.float32, torch.float16, "
        r"torch.bfloat16",
    ):
        module(x)


def test_double_then_back_to_float_computes_exactly_as_before():
    module = _biased_moe(seed=5)
    x = torch.randn(9, H, generator=_generator(6))
    before = module(x)
    module.double().float()  # float32 -> float64 -> float32 is exact for every value
    assert torch.equal(module(x), before)


@NEEDS_ONEDNN
def test_packed_module_moved_to_float64_is_refused_not_misread():
    module = _biased_moe(seed=7, gemm="loop").pack_cpu_weights()
    module.double()
    with pytest.raises(ValueError, match="torch.float64"):
        module(torch.randn(4, H, dtype=torch.float64))


def test_local_experts_and_expert_bodies_refuse_float64():
    experts = LocalExperts(4, H, I).double()
    x = torch.randn(3, H, dtype=torch.float64)
    ids = torch.tensor([[0, 1], [2, 3], [1, 0]], dtype=torch.int32)
    weights = torch.full((3, 2), 0.5)
    with pytest.raises(ValueError, match="expert weights are torch.float64"):
        experts(x, weights, ids)
    with pytest.raises(ValueError, match="hidden_states has dtype torch.float64"):
        torch.ops.moeroute.experts(x, experts.w_gate_up, experts.w_down, weights, ids)
    slots = torch.arange(6, dtype=torch.int32)
    with pytest.raises(ValueError, match="hidden_states are torch.float64"):
        streamed_expert_mlp(x, slots, [0, 2, 4, 5, 6], weights, experts.w_gate_up, experts.w_down)
    assert torch.float64 not in SUPPORTED_DTYPES


def test_transformers_experts_interface_refuses_a_float64_model():
    pytest.importorskip("transformers")
    from moeroute.bindings.torch.hf import experts_forward

    block = _model("qwen3_moe", seed=13).model.layers[0].mlp.double()
    x = torch.randn(3, MODEL_H, dtype=torch.float64, generator=_generator(14))
    ids = torch.tensor([[0, 1], [2, 3], [4, 5]])
    with pytest.raises(ValueError, match=r"torch.float64 is not supported.*torch.float32"):
        experts_forward(block.experts, x, ids, torch.full((3, 2), 0.5, dtype=torch.float64))


# ------------------------------------------------------------------ correction_bias stays float32


@pytest.mark.filterwarnings("ignore:Complex modules:UserWarning")
@pytest.mark.parametrize(
    "change",
    [
        lambda m: m.half(),
        lambda m: m.bfloat16(),
        lambda m: m.double(),
        lambda m: m.to(torch.bfloat16),
        lambda m: m.to(dtype=torch.float16),
        lambda m: m.to("cpu", torch.bfloat16),
        lambda m: m.float(),
        lambda m: m.to(torch.complex64),
    ],
    ids=["half", "bfloat16", "double", "to-bf16", "to-dtype-f16", "to-cpu-bf16", "float", "complex64"],
)
def test_correction_bias_stays_float32_under_every_dtype_change(change):
    module = _biased_moe(seed=8)
    bias = module.correction_bias.clone()
    change(module)
    assert module.correction_bias.dtype == torch.float32
    assert torch.equal(module.correction_bias, bias)
    assert "correction_bias" in module.state_dict()  # still a (persistent) buffer


# ------------------------------------------------------------------ copies of packed modules


def _deepcopy(module):
    return copy.deepcopy(module)


def _torch_save_load(module):
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _pickle(module):
    return pickle.loads(pickle.dumps(module))


@NEEDS_ONEDNN
@pytest.mark.parametrize("copier", [_deepcopy, _torch_save_load, _pickle])
def test_copies_of_a_packed_module_repack_and_compute_the_same(copier):
    module = _biased_moe(seed=9, gemm="loop").pack_cpu_weights()
    x = torch.randn(20, H, generator=_generator(10))
    expected = module(x)
    copied = copier(module)
    assert copied is not module and copied.experts.pack_cpu
    packed_gate_up, _ = copied.experts.cpu_weights()  # rebuilt from the copy's own weights
    assert isinstance(packed_gate_up, list) and len(packed_gate_up) == N
    assert copied.experts.w_gate_up.data_ptr() != module.experts.w_gate_up.data_ptr()
    assert torch.equal(copied(x), expected)
    assert rel_error(copied(x), dense_reference(copied, x)) < RTOL[torch.float32]
    # The original keeps its own copies and is unaffected by the copy.
    with torch.no_grad():
        copied.experts.w_down.mul_(2)
    copied.pack_cpu_weights()
    assert torch.equal(module(x), expected)


@NEEDS_ONEDNN
def test_packed_module_loaded_where_it_cannot_pack_runs_unpacked(monkeypatch):
    module = _biased_moe(seed=11, gemm="loop").pack_cpu_weights()
    x = torch.randn(6, H, generator=_generator(12))
    expected = module(x)
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    from moeroute.experts import modules as experts_modules

    monkeypatch.setattr(experts_modules, "onednn_linear_serves", lambda dtype: False)
    loaded = torch.load(buffer, weights_only=False)
    assert not loaded.experts.pack_cpu
    assert loaded.experts.cpu_weights()[0] is loaded.experts.w_gate_up
    monkeypatch.undo()
    assert rel_error(loaded(x), expected.double()) < RTOL[torch.float32]


# ------------------------------------------------------------------ transformers checkpoints

VOCAB, MODEL_H = 96, 32
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=MODEL_H,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    intermediate_size=48,
)
_LINEAR_ATTENTION = dict(
    layer_types=["linear_attention", "full_attention"],
    linear_num_value_heads=2,
    linear_num_key_heads=2,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
)


def _config(family):
    """(model class, config) of a tiny two-layer model of each supported family."""
    tf = pytest.importorskip("transformers")
    experts = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
    deepseek_style = dict(
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
    )
    if family == "qwen2_moe":
        return tf.Qwen2MoeForCausalLM, tf.Qwen2MoeConfig(**_COMMON, **experts, shared_expert_intermediate_size=32)
    if family == "qwen3_moe":
        return tf.Qwen3MoeForCausalLM, tf.Qwen3MoeConfig(**_COMMON, **experts, head_dim=8, norm_topk_prob=True)
    if family == "qwen3_next":
        return tf.Qwen3NextForCausalLM, tf.Qwen3NextConfig(
            **_COMMON, **experts, head_dim=8, shared_expert_intermediate_size=16, **_LINEAR_ATTENTION
        )
    if family == "qwen3_5_moe":
        return tf.Qwen3_5MoeForCausalLM, tf.Qwen3_5MoeTextConfig(
            **_COMMON, **experts, head_dim=8, shared_expert_intermediate_size=16, **_LINEAR_ATTENTION
        )
    if family == "deepseek_v3":
        return tf.DeepseekV3ForCausalLM, tf.DeepseekV3Config(
            **{**_COMMON, "num_key_value_heads": 4},
            **deepseek_style,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
        )
    if family == "glm4_moe":
        return tf.Glm4MoeForCausalLM, tf.Glm4MoeConfig(
            **_COMMON, **deepseek_style, head_dim=8, n_group=1, topk_group=1, n_shared_experts=2
        )
    if family == "mixtral":
        return tf.MixtralForCausalLM, tf.MixtralConfig(
            **_COMMON, head_dim=8, num_local_experts=8, num_experts_per_tok=2
        )
    if family == "gpt_oss":  # 2 layers, 4 experts
        return tf.GptOssForCausalLM, tf.GptOssConfig(
            **{**_COMMON, "intermediate_size": 16},
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"],
        )
    raise AssertionError(family)


FAMILIES = ["qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe", "deepseek_v3", "glm4_moe", "mixtral", "gpt_oss"]


def _model(family, seed):
    """A random model; the correction biases spread (bfloat16-exact) so they change selection."""
    model_class, config = _config(family)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    generator = _generator(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_((torch.randn(buffer.shape, generator=generator) * 0.05).to(torch.bfloat16))
    return model


def _input_ids(seed=1):
    return torch.randint(0, VOCAB, (2, 7), generator=_generator(seed))


def _logits(model):
    with torch.no_grad():
        return model(_input_ids()).logits


def _patch(model, **kwargs):
    from moeroute.bindings.torch import replace_moe_blocks

    assert replace_moe_blocks(model, **kwargs) > 0
    return model


def _state(model):
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


#: (family, replace_moe_blocks options): every family as patched by default (fused shared
#: slots where the shared MLP splits), and the other shared modes and replicas.
CHECKPOINT_CASES = [(family, {}) for family in FAMILIES] + [
    ("deepseek_v3", {"shared": "runner"}),
    ("qwen3_5_moe", {"shared": "overlap"}),
    ("qwen3_moe", {"num_redundant_experts": 3}),
    ("gpt_oss", {"num_redundant_experts": 2}),
]


def _case_id(case):
    family, kwargs = case
    return family + "".join(f"-{key}={value}" for key, value in kwargs.items())


@pytest.mark.interop
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("case", CHECKPOINT_CASES, ids=_case_id)
def test_patched_model_state_dict_is_the_unpatched_models_both_ways(case):
    family, kwargs = case
    model = _model(family, seed=2)
    expected_state, expected_logits = _state(model), _logits(model)
    patched = _patch(model, **kwargs)
    saved = _state(patched)
    # Saved: the same names, shapes, dtypes and values as the unpatched model's.
    assert set(saved) == set(expected_state)
    for name, tensor in expected_state.items():
        assert saved[name].dtype == tensor.dtype and saved[name].shape == tensor.shape, name
        assert torch.equal(saved[name], tensor), name
    # Loaded: a patched model with other weights loads the unpatched model's state strictly.
    other = _patch(_model(family, seed=3), **kwargs)
    result = other.load_state_dict(expected_state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert rel_error(_logits(other), expected_logits) < RTOL[torch.float32]
    # And its own saved state loads into the unpatched model.
    unpatched = _model(family, seed=4)
    unpatched.load_state_dict(_state(other), strict=True)
    assert rel_error(_logits(unpatched), expected_logits) < RTOL[torch.float32]


@pytest.mark.interop
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_of_a_patched_model_loads_into_transformers(family, tmp_path):
    from safetensors import safe_open

    model = _model(family, seed=5)
    expected = _logits(model)
    model.save_pretrained(tmp_path / "unpatched")
    _patch(model).save_pretrained(tmp_path / "patched")
    files = {}
    for which in ("unpatched", "patched"):
        with safe_open(str(tmp_path / which / "model.safetensors"), "pt") as handle:
            files[which] = {key: handle.get_tensor(key) for key in handle.keys()}
    assert set(files["patched"]) == set(files["unpatched"])
    for key, tensor in files["unpatched"].items():
        assert torch.equal(files["patched"][key], tensor), key
    model_class, _ = _config(family)
    loaded = model_class.from_pretrained(tmp_path / "patched").eval()
    assert rel_error(_logits(loaded), expected) < RTOL[torch.float32]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("copier", [_deepcopy, _torch_save_load])
def test_copies_of_a_patched_model_keep_saving_transformers_names(copier):
    model = _model("deepseek_v3", seed=15)
    expected = _state(model)
    copied = copier(_patch(model))
    saved = _state(copied)
    assert set(saved) == set(expected)
    assert all(torch.equal(saved[name], tensor) for name, tensor in expected.items())


# ------------------------------------------------------------------ bfloat16 DeepSeek / GLM

#: Whole-model logits in bfloat16: both models round every layer's output to bfloat16;
#: the blocks also accumulate expert outputs in bfloat16, moeroute in float32.
MODEL_BF16_RTOL = 3e-2


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_patched_biased_model_moved_to_bfloat16_runs_and_matches(family):
    from moeroute.bindings.torch import arrays

    reference_model = _model(family, seed=7).to(torch.bfloat16)
    patched = _patch(_model(family, seed=7)).to(torch.bfloat16)
    moes = [m for m in patched.modules() if isinstance(m, MoE)]
    blocks = [layer.mlp for layer in reference_model.model.layers if hasattr(layer.mlp, "gate")]
    assert len(moes) == len(blocks) == 1
    moe, block = moes[0], blocks[0]
    assert moe.correction_bias.dtype == torch.float32
    assert moe.router_weight.dtype == torch.bfloat16  # as the block's gate (and its checkpoint)
    # Selection is exact: the router computes in float32 from the bfloat16 weight, as the block's.
    x = torch.randn(40, MODEL_H, generator=_generator(8)).to(torch.bfloat16)
    with torch.no_grad():
        _, block_weights, block_ids = block.gate(x)
        weights, ids = arrays.select_experts(moe.compute_router_logits(x), moe.router, moe.correction_bias)
        assert torch.equal(torch.sort(ids, dim=1).values, torch.sort(block_ids.to(torch.int32), dim=1).values)
        assert rel_error(moe(x), block(x[None])[0]) < RTOL[torch.bfloat16]
    assert rel_error(_logits(patched), _logits(reference_model)) < MODEL_BF16_RTOL
