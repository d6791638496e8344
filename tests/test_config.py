"""Tests for moeroute.config: RouterConfig validation, Hugging Face configs, presets."""

import dataclasses
import json
import math
import pathlib

import numpy as np
import pytest

from moeroute.config import (
    PRESETS,
    SUPPORTED_MODEL_TYPES,
    ModelPreset,
    RouterConfig,
    get_preset,
)

# ----------------------------------------------------------------------------
# RouterConfig


def test_router_config_defaults_and_experts_per_group():
    config = RouterConfig(64, 6)
    assert (config.scoring, config.num_expert_group, config.topk_group) == ("softmax", 1, 1)
    assert config.renormalize is True and config.routed_scaling_factor == 1.0
    assert config.experts_per_group == 64
    assert RouterConfig(256, 8, "sigmoid", 8, 4).experts_per_group == 32


def test_router_config_normalises_numpy_scalars():
    config = RouterConfig(
        np.int64(16),
        np.int32(2),
        num_expert_group=np.int64(4),
        topk_group=np.int64(2),
        renormalize=np.bool_(False),
        routed_scaling_factor=np.float32(2.0),
    )
    assert type(config.num_experts) is int and type(config.top_k) is int
    assert type(config.renormalize) is bool and type(config.routed_scaling_factor) is float
    assert config == RouterConfig(16, 2, num_expert_group=4, topk_group=2, renormalize=False, routed_scaling_factor=2.0)


def test_router_config_is_frozen_and_hashable():
    config = RouterConfig(8, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.top_k = 3
    assert hash(config) == hash(RouterConfig(8, 2))


ROUTER_ERRORS = [
    (dict(num_experts=8, top_k=9), r"top_k=9 exceeds num_experts=8; top_k must be in \[1, 8\]"),
    (dict(num_experts=0, top_k=1), r"num_experts=0 must be an integer >= 1"),
    (dict(num_experts=8, top_k=0), r"top_k=0 must be an integer >= 1"),
    (dict(num_experts=8, top_k=-2), r"top_k=-2"),
    (dict(num_experts=8.0, top_k=2), r"num_experts=8.0 must be an integer.*float"),
    (dict(num_experts=8, top_k="2"), r"top_k='2' must be an integer"),
    (dict(num_experts=True, top_k=1), r"num_experts=True must be an integer"),
    (dict(num_experts=2**31 + 16, top_k=2), r"num_experts=2147483664 exceeds 2147483647: expert ids are int32"),
    (dict(num_experts=8, top_k=2.0), r"top_k=2.0 must be an integer >= 1, got float"),
    (dict(num_experts=8, top_k=2, scoring="relu"), r"scoring='relu' is not supported.*'softmax', 'sigmoid'"),
    (dict(num_experts=8, top_k=2, scoring=None), r"scoring=None"),
    (dict(num_experts=8, top_k=2, num_expert_group=0), r"num_expert_group=0 must be an integer >= 1"),
    (dict(num_experts=8, top_k=2, num_expert_group=3), r"num_expert_group=3 does not divide num_experts=8"),
    (dict(num_experts=8, top_k=2, num_expert_group=4, topk_group=0), r"topk_group=0 must be an integer >= 1"),
    (
        dict(num_experts=8, top_k=2, num_expert_group=4, topk_group=5),
        r"topk_group=5 exceeds num_expert_group=4; topk_group must be in \[1, 4\]",
    ),
    (
        dict(num_experts=16, top_k=9, num_expert_group=8, topk_group=4),
        r"top_k=9 exceeds topk_group \* experts_per_group = 8",
    ),
    (dict(num_experts=8, top_k=2, renormalize=1), r"renormalize=1 must be a bool"),
    (dict(num_experts=8, top_k=2, renormalize="yes"), r"renormalize='yes' must be a bool"),
    (
        dict(num_experts=8, top_k=2, routed_scaling_factor=0.0),
        r"routed_scaling_factor=0.0 must be a finite real number in \[1e-06, 1e\+06\]",
    ),
    (dict(num_experts=8, top_k=2, routed_scaling_factor=1e300), r"routed_scaling_factor=1e\+300 .*\[1e-06, 1e\+06\]"),
    (dict(num_experts=8, top_k=2, routed_scaling_factor=1e-300), r"routed_scaling_factor=1e-300 .*\[1e-06, 1e\+06\]"),
    (dict(num_experts=8, top_k=2, routed_scaling_factor=1.000001e6), r"routed_scaling_factor=1000001"),
    (dict(num_experts=8, top_k=2, routed_scaling_factor=-1), r"routed_scaling_factor=-1"),
    (dict(num_experts=8, top_k=2, routed_scaling_factor=math.inf), r"routed_scaling_factor=inf"),
    (dict(num_experts=8, top_k=2, routed_scaling_factor=math.nan), r"routed_scaling_factor=nan"),
    (dict(num_experts=8, top_k=2, routed_scaling_factor="2.5"), r"routed_scaling_factor='2.5'.*str"),
    (dict(num_experts=8, top_k=2, routed_scaling_factor=True), r"routed_scaling_factor=True"),
]


@pytest.mark.parametrize("kwargs, message", ROUTER_ERRORS)
def test_router_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RouterConfig(**kwargs)


def test_router_config_grouped_limit_is_inclusive():
    config = RouterConfig(16, 8, num_expert_group=8, topk_group=4)
    assert config.top_k == config.topk_group * config.experts_per_group


# ----------------------------------------------------------------------------
# Hugging Face config.json contents (field names and values of the released checkpoints)

HF_CONFIGS = {
    "deepseek-v3": {
        "_name_or_path": "deepseek-ai/DeepSeek-V3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
        "num_hidden_layers": 61,
    },
    "kimi-k2": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "kimi_k2",
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 384,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.827,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "first_k_dense_replace": 1,
    },
    "glm-4.5": {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "hidden_size": 5120,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "n_routed_experts": 160,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 3,
    },
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "qwen3.5-moe": {  # Qwen3-Next-80B-A3B
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "hidden_size": 2048,
        "intermediate_size": 5120,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
    },
    "qwen1.5-moe-a2.7b": {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
    },
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.02,
    },
    # Released config.json files (the 20b one spells top-k as experts_per_token).
    "gpt-oss-20b": {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_local_experts": 32,
        "experts_per_token": 4,
        "swiglu_limit": 7.0,
        "num_hidden_layers": 24,
    },
    "gpt-oss-120b": {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "swiglu_limit": 7.0,
        "num_hidden_layers": 36,
    },
}

QWEN3_5_35B = {  # composite: the MoE fields live in text_config
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "text_config": {
        "model_type": "qwen3_5_moe_text",
        "hidden_size": 2048,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "num_experts": 256,
        "num_experts_per_tok": 8,
    },
    "vision_config": {"model_type": "qwen3_5_moe", "hidden_size": 1152},
}

DEEPSEEK_V2 = {
    "model_type": "deepseek_v2",
    "hidden_size": 5120,
    "moe_intermediate_size": 1536,
    "n_routed_experts": 160,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "n_group": 8,
    "topk_group": 3,
    "topk_method": "group_limited_greedy",
    "norm_topk_prob": False,
    "routed_scaling_factor": 16.0,
    "scoring_func": "softmax",
}

DEEPSEEK_V2_LITE = {
    "model_type": "deepseek_v2",
    "hidden_size": 2048,
    "moe_intermediate_size": 1408,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "greedy",
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
}


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_from_hf_reproduces_each_preset(name):
    preset = ModelPreset.from_hf(HF_CONFIGS[name], name=name)
    assert preset == PRESETS[name]
    assert RouterConfig.from_hf(HF_CONFIGS[name]) == PRESETS[name].router


def test_from_hf_name_defaults():
    assert ModelPreset.from_hf(HF_CONFIGS["deepseek-v3"]).name == "deepseek-ai/DeepSeek-V3"
    assert ModelPreset.from_hf(HF_CONFIGS["mixtral-8x7b"]).name == "mixtral"


def test_from_hf_qwen3_5_composite():
    preset = ModelPreset.from_hf(QWEN3_5_35B)
    assert preset.model_type == "qwen3_5_moe"
    assert preset.router == RouterConfig(256, 8, "softmax", renormalize=True)
    assert (preset.num_shared_experts, preset.shared_intermediate_size) == (1, 512)
    assert preset.shared_gated and not preset.has_correction_bias
    assert (preset.hidden_size, preset.moe_intermediate_size) == (2048, 512)
    # The text config on its own reads the same way.
    text = ModelPreset.from_hf(QWEN3_5_35B["text_config"])
    assert text.router == preset.router and text.model_type == "qwen3_5_moe_text"


def test_from_hf_kimi_k2_as_deepseek_v3_and_kimi_k25():
    as_v3 = dict(HF_CONFIGS["kimi-k2"], model_type="deepseek_v3")
    assert ModelPreset.from_hf(as_v3).router == PRESETS["kimi-k2"].router
    k25 = {"model_type": "kimi_k25", "text_config": HF_CONFIGS["kimi-k2"]}
    preset = ModelPreset.from_hf(k25)
    assert preset.router == PRESETS["kimi-k2"].router and preset.has_correction_bias


def test_from_hf_deepseek_v2_group_limited_greedy():
    preset = ModelPreset.from_hf(DEEPSEEK_V2)
    assert preset.router == RouterConfig(
        160, 6, "softmax", num_expert_group=8, topk_group=3, renormalize=False, routed_scaling_factor=16.0
    )
    assert not preset.has_correction_bias and not preset.shared_gated
    assert (preset.num_shared_experts, preset.shared_intermediate_size) == (2, 3072)


def test_from_hf_deepseek_v2_greedy_ignores_groups():
    preset = ModelPreset.from_hf(dict(DEEPSEEK_V2_LITE, n_group=8, topk_group=3))
    assert (preset.router.num_expert_group, preset.router.topk_group) == (1, 1)
    assert preset.router == RouterConfig(64, 6, renormalize=False)
    assert ModelPreset.from_hf(dict(DEEPSEEK_V2_LITE, n_group=None, topk_group=None)) == preset


def test_from_hf_deepseek_v3_without_noaux_tc_has_no_bias():
    preset = ModelPreset.from_hf(dict(HF_CONFIGS["deepseek-v3"], topk_method="greedy"))
    assert not preset.has_correction_bias
    assert preset.router.num_expert_group == 1


def test_from_hf_defaults_follow_transformers():
    # Missing fields take the transformers class defaults.
    assert ModelPreset.from_hf({"model_type": "qwen2_moe", "norm_topk_prob": None}).router == (
        RouterConfig(60, 4, renormalize=False)
    )
    assert ModelPreset.from_hf({"model_type": "qwen3_moe"}).router.renormalize is False
    assert ModelPreset.from_hf({"model_type": "qwen3_next"}).router.renormalize is True
    v3 = ModelPreset.from_hf({"model_type": "deepseek_v3"})
    assert v3.router == PRESETS["deepseek-v3"].router and v3.has_correction_bias
    glm = ModelPreset.from_hf({"model_type": "glm4_moe"})
    assert glm.router == RouterConfig(128, 8, "sigmoid", renormalize=True)
    # Mixtral always renormalizes, whatever the config says.
    assert ModelPreset.from_hf(dict(HF_CONFIGS["mixtral-8x7b"], norm_topk_prob=False)).router.renormalize


def test_from_hf_expert_count_aliases():
    v3 = dict(HF_CONFIGS["deepseek-v3"])
    v3["num_local_experts"] = v3.pop("n_routed_experts")
    assert ModelPreset.from_hf(v3).router.num_experts == 256
    mixtral = dict(HF_CONFIGS["mixtral-8x7b"])
    mixtral["num_experts"] = mixtral.pop("num_local_experts")
    assert ModelPreset.from_hf(mixtral).router.num_experts == 8


def test_from_hf_unsplittable_shared_expert():
    config = dict(HF_CONFIGS["qwen1.5-moe-a2.7b"], shared_expert_intermediate_size=5000)
    preset = ModelPreset.from_hf(config)
    assert preset.num_shared_experts == 1 and preset.shared_intermediate_size == 5000
    assert "5000 is not a multiple of moe_intermediate_size=1408" in preset.shared_unfusable_reason
    no_shared = ModelPreset.from_hf(dict(config, shared_expert_intermediate_size=0))
    assert (no_shared.num_shared_experts, no_shared.shared_gated) == (0, False)


def test_from_hf_reads_a_config_json_path(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(HF_CONFIGS["glm-4.5"]))
    expected = ModelPreset.from_hf(HF_CONFIGS["glm-4.5"])
    assert ModelPreset.from_hf(path) == expected
    assert ModelPreset.from_hf(str(path)) == expected
    assert ModelPreset.from_hf(tmp_path) == expected  # the directory holding config.json
    assert RouterConfig.from_hf(pathlib.Path(path)) == PRESETS["glm-4.5"].router


HF_ERRORS = [
    ({"model_type": "llama"}, r"model_type='llama' is not supported; supported model types: deepseek_v2, deepseek_v3"),
    ({"hidden_size": 8}, r"no 'model_type'.*mixtral"),
    ({"model_type": "deepseek_v2"}, r"lacks the required field 'num_experts_per_tok'"),
    (dict(DEEPSEEK_V2, n_group=None), r"lacks the required field 'n_group'"),
    (dict(DEEPSEEK_V2, topk_method="noaux_tc"), r"topk_method='noaux_tc' is not supported for deepseek_v2"),
    (dict(HF_CONFIGS["deepseek-v3"], topk_method="random"), r"topk_method='random' is not supported"),
    (dict(HF_CONFIGS["deepseek-v3"], scoring_func="tanh"), r"scoring='tanh' is not supported"),
    ({"model_type": "qwen3_5_moe"}, r"'text_config', which is missing"),
    (dict(HF_CONFIGS["qwen3-30b-a3b"], num_experts_per_tok=200), r"top_k=200 exceeds num_experts=128"),
    (42, r"config must be a dict, a path to config.json or a transformers config, got int"),
    # Values of the wrong kind name the field (they were ZeroDivisionError/TypeError).
    (
        dict(HF_CONFIGS["qwen1.5-moe-a2.7b"], moe_intermediate_size=0),
        r"moe_intermediate_size=0 must be an integer >= 1",
    ),
    (dict(HF_CONFIGS["qwen3-30b-a3b"], moe_intermediate_size=0), r"moe_intermediate_size=0 must be an integer >= 1"),
    (dict(HF_CONFIGS["deepseek-v3"], moe_intermediate_size=0), r"moe_intermediate_size=0 must be an integer >= 1"),
    (
        dict(HF_CONFIGS["qwen1.5-moe-a2.7b"], shared_expert_intermediate_size="5632"),
        r"'shared_expert_intermediate_size'='5632' must be an integer, got str",
    ),
    (dict(HF_CONFIGS["deepseek-v3"], n_shared_experts="1"), r"'n_shared_experts'='1' must be an integer, got str"),
    (
        dict(HF_CONFIGS["deepseek-v3"], routed_scaling_factor="2.5"),
        r"'routed_scaling_factor'='2.5' must be a real number, got str",
    ),
    (dict(HF_CONFIGS["deepseek-v3"], norm_topk_prob="yes"), r"'norm_topk_prob'='yes' must be a bool, got str"),
    (dict(HF_CONFIGS["mixtral-8x7b"], num_local_experts=8.0), r"'num_local_experts'=8.0 must be an integer, got float"),
    (dict(HF_CONFIGS["deepseek-v3"], routed_scaling_factor=1e300), r"routed_scaling_factor=1e\+300"),
    ({"model_type": ["qwen3_moe"]}, r"model_type=\['qwen3_moe'\] must be a string, got list"),
    ({"model_type": 3}, r"model_type=3 must be a string, got int"),
]


@pytest.mark.parametrize("config, message", HF_ERRORS)
def test_from_hf_errors(config, message):
    with pytest.raises(ValueError, match=message):
        ModelPreset.from_hf(config)


def test_from_hf_file_errors(tmp_path):
    with pytest.raises(ValueError, match="cannot read Hugging Face config"):
        ModelPreset.from_hf(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read Hugging Face config"):
        ModelPreset.from_hf(bad)
    listing = tmp_path / "list.json"
    listing.write_text("[1, 2]")
    with pytest.raises(ValueError, match="does not hold a JSON object"):
        ModelPreset.from_hf(listing)


def test_from_hf_non_utf8_file_names_the_path(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b'{"model_type": "\xff\xfe"}')
    with pytest.raises(ValueError, match=r"cannot read Hugging Face config .*config\.json.*utf-8"):
        ModelPreset.from_hf(tmp_path)


def test_from_hf_config_object_whose_to_dict_is_not_a_dict():
    class NoFields:
        def to_dict(self):
            return None

    with pytest.raises(ValueError, match=r"NoFields.to_dict\(\) returned NoneType, expected a dict"):
        ModelPreset.from_hf(NoFields())


def test_router_config_scaling_factor_range_keeps_float32_weights_finite():
    """The extremes of the allowed range still give finite, nonzero float32 weights."""
    from moeroute.config import ROUTED_SCALING_FACTOR_RANGE
    from moeroute.routing.reference import select_experts

    logits = np.array([[3.0, -2.0, 0.5, 40.0]], np.float32)
    for rsf in ROUTED_SCALING_FACTOR_RANGE:
        for renormalize in (True, False):
            config = RouterConfig(4, 2, renormalize=renormalize, routed_scaling_factor=rsf)
            weights, _ = select_experts(logits, config)
            assert np.all(np.isfinite(weights)) and weights[0, 0] > 0, (rsf, weights)


def test_unknown_model_type_lists_all_supported():
    with pytest.raises(ValueError) as info:
        RouterConfig.from_hf({"model_type": "gpt2"})
    for model_type in SUPPORTED_MODEL_TYPES:
        assert model_type in str(info.value)
    assert {
        "deepseek_v3",
        "kimi_k2",
        "deepseek_v2",
        "glm4_moe",
        "qwen2_moe",
        "qwen3_moe",
        "qwen3_next",
        "qwen3_5_moe",
        "mixtral",
    } <= set(SUPPORTED_MODEL_TYPES)


# ----------------------------------------------------------------------------
# transformers configuration objects


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


@pytest.mark.interop
def test_from_hf_transformers_deepseek_v3(transformers):
    config = transformers.DeepseekV3Config(scoring_func="sigmoid", topk_method="noaux_tc")
    preset = ModelPreset.from_hf(config, name="deepseek-v3")
    assert preset == PRESETS["deepseek-v3"]


@pytest.mark.interop
def test_from_hf_transformers_qwen3_moe(transformers):
    config = transformers.Qwen3MoeConfig(
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, moe_intermediate_size=768, hidden_size=2048
    )
    assert ModelPreset.from_hf(config, name="qwen3-30b-a3b") == PRESETS["qwen3-30b-a3b"]
    assert RouterConfig.from_hf(transformers.Qwen3MoeConfig()).renormalize is False


@pytest.mark.interop
def test_from_hf_transformers_composite_and_mixtral(transformers):
    preset = ModelPreset.from_hf(transformers.Qwen3_5MoeConfig())
    assert preset.model_type == "qwen3_5_moe"
    assert preset.router == RouterConfig(256, 8, renormalize=True)
    assert preset.shared_gated and preset.num_shared_experts == 1
    mixtral = ModelPreset.from_hf(transformers.MixtralConfig(), name="mixtral-8x7b")
    assert mixtral == PRESETS["mixtral-8x7b"]
    qwen2 = ModelPreset.from_hf(transformers.Qwen2MoeConfig(), name="qwen1.5-moe-a2.7b")
    assert qwen2 == PRESETS["qwen1.5-moe-a2.7b"]


# ----------------------------------------------------------------------------
# Presets

# name -> (N, K, scoring, G, topk_group, renormalize, rsf, bias, S, shared size, gated, H, I)
PRESET_TABLE = {
    "deepseek-v3": (256, 8, "sigmoid", 8, 4, True, 2.5, True, 1, 2048, False, 7168, 2048),
    "kimi-k2": (384, 8, "sigmoid", 1, 1, True, 2.827, True, 1, 2048, False, 7168, 2048),
    "glm-4.5": (160, 8, "sigmoid", 1, 1, True, 2.5, True, 1, 1536, False, 5120, 1536),
    "qwen3-30b-a3b": (128, 8, "softmax", 1, 1, True, 1.0, False, 0, 0, False, 2048, 768),
    "qwen3.5-moe": (512, 10, "softmax", 1, 1, True, 1.0, False, 1, 512, True, 2048, 512),
    "qwen1.5-moe-a2.7b": (60, 4, "softmax", 1, 1, False, 1.0, False, 4, 5632, True, 2048, 1408),
    "mixtral-8x7b": (8, 2, "softmax", 1, 1, True, 1.0, False, 0, 0, False, 4096, 14336),
    "gpt-oss-20b": (32, 4, "softmax", 1, 1, True, 1.0, False, 0, 0, False, 2880, 2880),
    "gpt-oss-120b": (128, 4, "softmax", 1, 1, True, 1.0, False, 0, 0, False, 2880, 2880),
}


def test_preset_names():
    assert set(PRESETS) == set(PRESET_TABLE)


@pytest.mark.parametrize("name", list(PRESET_TABLE))
def test_preset_fields(name):
    preset = get_preset(name)
    router = preset.router
    got = (
        router.num_experts,
        router.top_k,
        router.scoring,
        router.num_expert_group,
        router.topk_group,
        router.renormalize,
        router.routed_scaling_factor,
        preset.has_correction_bias,
        preset.num_shared_experts,
        preset.shared_intermediate_size,
        preset.shared_gated,
        preset.hidden_size,
        preset.moe_intermediate_size,
    )
    assert got == PRESET_TABLE[name]
    assert preset.name == name and preset.shared_unfusable_reason is None
    assert preset.shared_intermediate_size == preset.num_shared_experts * preset.moe_intermediate_size


def test_get_preset_unknown_lists_names():
    with pytest.raises(ValueError, match=r"unknown preset 'gpt-4'; available presets: deepseek-v3, kimi-k2"):
        get_preset("gpt-4")
    with pytest.raises(ValueError, match="unknown preset"):
        get_preset(None)


PRESET_ERRORS = [
    (dict(hidden_size=0), r"hidden_size=0 must be an integer >= 1"),
    (dict(moe_intermediate_size=-1), r"moe_intermediate_size=-1"),
    (dict(num_shared_experts=-1), r"num_shared_experts=-1"),
    (dict(num_shared_experts=0), r"num_shared_experts=0 and shared_intermediate_size=2048 disagree"),
    (
        dict(num_shared_experts=2),
        r"shared_intermediate_size=2048 must equal num_shared_experts \* moe_intermediate_size = 4096",
    ),
    (
        dict(num_shared_experts=0, shared_intermediate_size=0, shared_gated=True),
        r"shared_gated=True needs a shared expert",
    ),
    (dict(router=(256, 8)), r"router=\(256, 8\) must be a RouterConfig"),
]


@pytest.mark.parametrize("changes, message", PRESET_ERRORS)
def test_model_preset_errors(changes, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(PRESETS["deepseek-v3"], **changes)


def test_model_preset_with_unfusable_reason_accepts_any_shared_size():
    preset = dataclasses.replace(
        PRESETS["qwen1.5-moe-a2.7b"],
        num_shared_experts=1,
        shared_intermediate_size=5000,
        shared_unfusable_reason="5000 is not a multiple of 1408",
    )
    assert preset.shared_intermediate_size == 5000


# ----------------------------------------------------------------------------
# gpt-oss and the new scorings


def test_gpt_oss_presets_name_their_activation_and_biases():
    for name in ("gpt-oss-20b", "gpt-oss-120b"):
        preset = PRESETS[name]
        assert preset.activation == "swigluoai" and preset.expert_bias
    assert PRESETS["deepseek-v3"].activation == "silu" and not PRESETS["deepseek-v3"].expert_bias


def test_from_hf_transformers_gpt_oss(transformers):
    config = transformers.GptOssConfig(num_local_experts=32, num_experts_per_tok=4)
    assert RouterConfig.from_hf(config) == PRESETS["gpt-oss-20b"].router
    assert ModelPreset.from_hf(config, name="gpt-oss-20b") == PRESETS["gpt-oss-20b"]
    # transformers' defaults are the 120b sizes.
    assert ModelPreset.from_hf(transformers.GptOssConfig(), name="gpt-oss-120b") == PRESETS["gpt-oss-120b"]


def test_from_hf_gpt_oss_rejects_other_swiglu_constants():
    with pytest.raises(ValueError, match="swiglu_alpha=1.5, swiglu_limit=7.0"):
        RouterConfig.from_hf({"model_type": "gpt_oss", "swiglu_alpha": 1.5})


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "none"])
def test_router_config_new_scorings(scoring):
    config = RouterConfig(16, 4, scoring, num_expert_group=4, topk_group=2)
    assert config.scoring == scoring
    # A DeepSeek-style config naming the scoring function is read as it says.
    read = RouterConfig.from_hf(dict(HF_CONFIGS["deepseek-v3"], scoring_func=scoring))
    assert read == dataclasses.replace(PRESETS["deepseek-v3"].router, scoring=scoring)


def test_model_preset_unknown_activation():
    with pytest.raises(ValueError, match="activation='relu' is not supported"):
        dataclasses.replace(PRESETS["gpt-oss-20b"], activation="relu")
