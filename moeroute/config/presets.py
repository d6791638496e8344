"""Presets: the models of docs/semantics.md section 1 with the sizes of their released checkpoints.

`PRESETS` maps a preset name to its `moeroute.config.ModelPreset`; `get_preset` looks one up.
"""

from __future__ import annotations

from typing import Any

from moeroute.config.configs import ModelPreset, RouterConfig

__all__ = ["PRESETS", "get_preset"]


def _preset(name: str, model_type: str, router: RouterConfig, **fields: Any) -> ModelPreset:
    fields.setdefault("has_correction_bias", False)
    fields.setdefault("num_shared_experts", 0)
    fields.setdefault("shared_intermediate_size", 0)
    fields.setdefault("shared_gated", False)
    return ModelPreset(name=name, model_type=model_type, router=router, **fields)


PRESETS: dict[str, ModelPreset] = {
    preset.name: preset
    for preset in (
        _preset(
            "deepseek-v3",
            "deepseek_v3",
            RouterConfig(
                256, 8, "sigmoid", num_expert_group=8, topk_group=4, renormalize=True, routed_scaling_factor=2.5
            ),
            has_correction_bias=True,
            num_shared_experts=1,
            shared_intermediate_size=2048,
            hidden_size=7168,
            moe_intermediate_size=2048,
        ),
        _preset(
            # The released Kimi-K2 config.json sets norm_topk_prob true.
            "kimi-k2",
            "kimi_k2",
            RouterConfig(384, 8, "sigmoid", renormalize=True, routed_scaling_factor=2.827),
            has_correction_bias=True,
            num_shared_experts=1,
            shared_intermediate_size=2048,
            hidden_size=7168,
            moe_intermediate_size=2048,
        ),
        _preset(
            "glm-4.5",
            "glm4_moe",
            RouterConfig(160, 8, "sigmoid", renormalize=True, routed_scaling_factor=2.5),
            has_correction_bias=True,
            num_shared_experts=1,
            shared_intermediate_size=1536,
            hidden_size=5120,
            moe_intermediate_size=1536,
        ),
        _preset(
            "qwen3-30b-a3b",
            "qwen3_moe",
            RouterConfig(128, 8, "softmax", renormalize=True),
            hidden_size=2048,
            moe_intermediate_size=768,
        ),
        _preset(
            # Qwen3-Next-80B-A3B sizes: the shared expert is one slot of size I.
            "qwen3.5-moe",
            "qwen3_next",
            RouterConfig(512, 10, "softmax", renormalize=True),
            num_shared_experts=1,
            shared_intermediate_size=512,
            shared_gated=True,
            hidden_size=2048,
            moe_intermediate_size=512,
        ),
        _preset(
            # shared_expert_intermediate_size 5632 = 4 x 1408: four slots.
            "qwen1.5-moe-a2.7b",
            "qwen2_moe",
            RouterConfig(60, 4, "softmax", renormalize=False),
            num_shared_experts=4,
            shared_intermediate_size=5632,
            shared_gated=True,
            hidden_size=2048,
            moe_intermediate_size=1408,
        ),
        _preset(
            "mixtral-8x7b",
            "mixtral",
            RouterConfig(8, 2, "softmax", renormalize=True),
            hidden_size=4096,
            moe_intermediate_size=14336,
        ),
        # gpt-oss: softmax over the top-k logits = softmax + renormalize; biased experts.
        _preset(
            "gpt-oss-20b",
            "gpt_oss",
            RouterConfig(32, 4, "softmax", renormalize=True),
            hidden_size=2880,
            moe_intermediate_size=2880,
            activation="swigluoai",
            expert_bias=True,
        ),
        _preset(
            "gpt-oss-120b",
            "gpt_oss",
            RouterConfig(128, 4, "softmax", renormalize=True),
            hidden_size=2880,
            moe_intermediate_size=2880,
            activation="swigluoai",
            expert_bias=True,
        ),
    )
}


def get_preset(name: str) -> ModelPreset:
    """Return the preset called ``name``.

    Raises
    ------
    ValueError
        Unknown name; the message lists the preset names.
    """
    try:
        return PRESETS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown preset {name!r}; available presets: {', '.join(PRESETS)}") from None
