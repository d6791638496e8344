"""Reading Hugging Face configs: one reader per model family, with the transformers defaults.

`read_hf_config` turns a model's ``config.json`` (a dict, a path, or a transformers
configuration object read through ``to_dict()``) into the fields of a
`moeroute.config.ModelPreset`, the router's as the keyword arguments of a
`moeroute.config.RouterConfig`; `ModelPreset.from_hf` and `RouterConfig.from_hf` build
and check them. The readers only translate names and fill in defaults: every range is
checked by the configs (docs/semantics.md section 1).

Imports neither torch nor transformers, nor the configs (they import this module).
"""

from __future__ import annotations

import json
import numbers
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from moeroute._validate import integer

__all__ = ["SUPPORTED_MODEL_TYPES", "read_hf_config"]

# Composite configurations whose MoE fields live in text_config -> text model type.
_COMPOSITE_TEXT_TYPES = {"qwen3_5_moe": "qwen3_5_moe_text", "kimi_k25": "deepseek_v3"}
_REQUIRED = object()


def _as_dict(config: Any) -> Mapping:
    """Return ``config`` (dict, path or transformers config) as a mapping."""
    if isinstance(config, Mapping):
        return config
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path, encoding="utf-8") as handle:
                loaded = json.load(handle)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"cannot read Hugging Face config {path!r}: {error}") from error
        if not isinstance(loaded, dict):
            raise ValueError(f"{path!r} does not hold a JSON object")
        return loaded
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        fields = to_dict()
        if not isinstance(fields, Mapping):
            raise ValueError(
                f"config {type(config).__name__}.to_dict() returned {type(fields).__name__}, "
                "expected a dict of the configuration's fields"
            )
        return fields
    raise ValueError(
        f"config must be a dict, a path to config.json or a transformers config, got {type(config).__name__}"
    )


def _check_field_type(key: str, value: Any, default: Any) -> None:
    """ValueError when ``value`` is not of the kind of its transformers default."""
    if isinstance(default, bool):
        ok, kind = isinstance(value, (bool, np.bool_)), "a bool"
    elif isinstance(default, numbers.Integral):
        ok = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
        kind = "an integer"
    elif isinstance(default, numbers.Real):
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        kind = "a real number"
    elif isinstance(default, str):
        ok, kind = isinstance(value, str), "a string"
    else:
        return
    if not ok:
        raise ValueError(f"Hugging Face config field {key!r}={value!r} must be {kind}, got {type(value).__name__}")


def _field(fields: Mapping, names: str | tuple[str, ...], default: Any = _REQUIRED) -> Any:
    """First present, non-null field among ``names``; ``default`` otherwise.

    A present value must be of the kind of ``default`` (bool, integer, real or string);
    ValueError naming the field otherwise.
    """
    names = (names,) if isinstance(names, str) else names
    for key in names:
        if fields.get(key) is not None:
            _check_field_type(key, fields[key], default)
            return fields[key]
    if default is _REQUIRED:
        raise ValueError(f"Hugging Face config lacks the required field {names[0]!r}")
    return default


def _shared_split(shared_size: int, inter: int) -> tuple[int, str | None]:
    """S and the unfusable reason for a shared MLP of total intermediate ``shared_size``."""
    shared_size = integer("shared_expert_intermediate_size", shared_size, 0)
    inter = integer("moe_intermediate_size", inter, 1)
    if shared_size == 0:
        return 0, None
    if shared_size % inter == 0:
        return shared_size // inter, None
    return 1, (
        f"shared_expert_intermediate_size={shared_size} is not a multiple of "
        f"moe_intermediate_size={inter}, so the shared MLP does not split into expert slots"
    )


def _read_deepseek_v3(fields: Mapping) -> dict:
    # DeepSeek-V3/R1 and Kimi-K2: sigmoid scores, grouped routing and, for
    # topk_method "noaux_tc", a correction bias used for selection only.
    topk_method = _field(fields, "topk_method", "noaux_tc")
    if topk_method not in ("noaux_tc", "greedy", "group_limited_greedy"):
        raise ValueError(
            f"topk_method={topk_method!r} is not supported for DeepSeek-V3-style models; "
            "use 'noaux_tc', 'greedy' or 'group_limited_greedy'"
        )
    inter = _field(fields, "moe_intermediate_size", 2048)
    num_shared = _field(fields, "n_shared_experts", 1)
    return dict(
        router=dict(
            num_experts=_field(fields, ("n_routed_experts", "num_local_experts"), 256),
            top_k=_field(fields, "num_experts_per_tok", 8),
            scoring=_field(fields, "scoring_func", "sigmoid"),
            num_expert_group=_field(fields, "n_group", 8) if topk_method != "greedy" else 1,
            topk_group=_field(fields, "topk_group", 4) if topk_method != "greedy" else 1,
            renormalize=_field(fields, "norm_topk_prob", True),
            routed_scaling_factor=_field(fields, "routed_scaling_factor", 2.5),
        ),
        has_correction_bias=topk_method == "noaux_tc",
        num_shared_experts=num_shared,
        shared_intermediate_size=num_shared * inter,
        shared_gated=False,
        hidden_size=_field(fields, "hidden_size", 7168),
        moe_intermediate_size=inter,
    )


def _read_deepseek_v2(fields: Mapping) -> dict:
    # Softmax scores; "greedy" ignores groups, "group_limited_greedy" keeps the
    # topk_group groups with the largest max score. norm_topk_prob as in the
    # original DeepSeek-V2 code (default False).
    topk_method = _field(fields, "topk_method", "greedy")
    if topk_method == "greedy":
        num_groups, topk_group = 1, 1
    elif topk_method == "group_limited_greedy":
        num_groups = _field(fields, "n_group")
        topk_group = _field(fields, "topk_group")
    else:
        raise ValueError(
            f"topk_method={topk_method!r} is not supported for deepseek_v2; use 'greedy' or 'group_limited_greedy'"
        )
    inter = _field(fields, "moe_intermediate_size", 1407)
    num_shared = _field(fields, "n_shared_experts", 2)
    return dict(
        router=dict(
            num_experts=_field(fields, ("n_routed_experts", "num_experts"), 64),
            top_k=_field(fields, "num_experts_per_tok"),
            scoring=_field(fields, "scoring_func", "softmax"),
            num_expert_group=num_groups,
            topk_group=topk_group,
            renormalize=_field(fields, "norm_topk_prob", False),
            routed_scaling_factor=_field(fields, "routed_scaling_factor", 1.0),
        ),
        has_correction_bias=False,
        num_shared_experts=num_shared,
        shared_intermediate_size=num_shared * inter,
        shared_gated=False,
        hidden_size=_field(fields, "hidden_size", 4096),
        moe_intermediate_size=inter,
    )


def _read_glm4_moe(fields: Mapping) -> dict:
    # GLM-4.5: always sigmoid scores with a correction bias.
    inter = _field(fields, "moe_intermediate_size", 1408)
    num_shared = _field(fields, "n_shared_experts", 1)
    return dict(
        router=dict(
            num_experts=_field(fields, ("n_routed_experts", "num_local_experts"), 128),
            top_k=_field(fields, "num_experts_per_tok", 8),
            scoring="sigmoid",
            num_expert_group=_field(fields, "n_group", 1),
            topk_group=_field(fields, "topk_group", 1),
            renormalize=_field(fields, "norm_topk_prob", True),
            routed_scaling_factor=_field(fields, "routed_scaling_factor", 1.0),
        ),
        has_correction_bias=True,
        num_shared_experts=num_shared,
        shared_intermediate_size=num_shared * inter,
        shared_gated=False,
        hidden_size=_field(fields, "hidden_size", 4096),
        moe_intermediate_size=inter,
    )


def _qwen_reader(
    experts: int, top_k: int, inter: int, shared: int, norm_topk_prob: bool | None
) -> Callable[[Mapping], dict]:
    """Reader for the Qwen MoE family: softmax, no groups, optional gated shared MLP.

    The defaults are those of the transformers class. ``norm_topk_prob`` is the
    default of that field, or None when the model has no such field and always
    renormalizes. ``shared=0`` means the family has no shared expert.
    """

    def read(fields: Mapping) -> dict:
        moe_inter = _field(fields, "moe_intermediate_size", inter)
        shared_size = _field(fields, "shared_expert_intermediate_size", shared) if shared else 0
        num_shared, reason = _shared_split(shared_size, moe_inter)
        renormalize = True if norm_topk_prob is None else _field(fields, "norm_topk_prob", norm_topk_prob)
        return dict(
            router=dict(
                num_experts=_field(fields, "num_experts", experts),
                top_k=_field(fields, "num_experts_per_tok", top_k),
                scoring="softmax",
                renormalize=renormalize,
            ),
            has_correction_bias=False,
            num_shared_experts=num_shared,
            shared_intermediate_size=shared_size,
            shared_gated=num_shared > 0,
            hidden_size=_field(fields, "hidden_size", 2048),
            moe_intermediate_size=moe_inter,
            shared_unfusable_reason=reason,
        )

    return read


def _read_mixtral(fields: Mapping) -> dict:
    # Mixtral always renormalizes its top-k softmax weights; no shared expert.
    return dict(
        router=dict(
            num_experts=_field(fields, ("num_local_experts", "num_experts"), 8),
            top_k=_field(fields, "num_experts_per_tok", 2),
            scoring="softmax",
            renormalize=True,
        ),
        has_correction_bias=False,
        num_shared_experts=0,
        shared_intermediate_size=0,
        shared_gated=False,
        hidden_size=_field(fields, "hidden_size", 4096),
        moe_intermediate_size=_field(fields, "intermediate_size", 14336),
    )


def _read_gpt_oss(fields: Mapping) -> dict:
    # gpt-oss: top-k of the (biased) router logits, then softmax over the K picked, which is
    # softmax + renormalize (docs/semantics.md section 9); biased experts with the clamped swigluoai.
    limit = _field(fields, "swiglu_limit", 7.0)
    alpha = _field(fields, "swiglu_alpha", 1.702)
    if (float(alpha), float(limit)) != (1.702, 7.0):
        raise ValueError(
            f"swiglu_alpha={alpha}, swiglu_limit={limit}: moeroute's swigluoai uses alpha=1.702 and limit=7.0"
        )
    return dict(
        router=dict(
            num_experts=_field(fields, ("num_local_experts", "num_experts"), 128),
            top_k=_field(fields, ("num_experts_per_tok", "experts_per_token"), 4),
            scoring="softmax",
            renormalize=True,
        ),
        has_correction_bias=False,
        num_shared_experts=0,
        shared_intermediate_size=0,
        shared_gated=False,
        hidden_size=_field(fields, "hidden_size", 2880),
        moe_intermediate_size=_field(fields, "intermediate_size", 2880),
        activation="swigluoai",
        expert_bias=True,
    )


_READERS: dict[str, Callable[[Mapping], dict]] = {
    "deepseek_v3": _read_deepseek_v3,
    "kimi_k2": _read_deepseek_v3,
    "deepseek_v2": _read_deepseek_v2,
    "glm4_moe": _read_glm4_moe,
    "qwen2_moe": _qwen_reader(60, 4, 1408, 5632, norm_topk_prob=False),
    "qwen3_moe": _qwen_reader(128, 8, 768, 0, norm_topk_prob=False),
    "qwen3_next": _qwen_reader(512, 10, 512, 512, norm_topk_prob=True),
    # Qwen3.5-MoE's router always renormalizes (it has no norm_topk_prob field).
    "qwen3_5_moe_text": _qwen_reader(256, 8, 512, 512, norm_topk_prob=None),
    "mixtral": _read_mixtral,
    "gpt_oss": _read_gpt_oss,
}

#: Model types ``from_hf`` reads (top-level ``model_type`` values).
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(set(_READERS) | set(_COMPOSITE_TEXT_TYPES)))


def read_hf_config(config: Any) -> tuple[str, str, dict]:
    """The model type, default preset name and `ModelPreset` fields of a Hugging Face config.

    Parameters
    ----------
    config : dict, str, os.PathLike or transformers.PretrainedConfig
        As `moeroute.config.ModelPreset.from_hf`. Composite configurations
        (``qwen3_5_moe``, ``kimi_k25``) are read from their ``text_config``.

    Returns
    -------
    model_type : str
        The top-level ``model_type``.
    name : str
        ``_name_or_path`` when set, else the model type.
    fields : dict
        `ModelPreset` keyword arguments except ``name`` and ``model_type``; ``fields["router"]``
        holds the `RouterConfig` keyword arguments (not yet checked).

    Raises
    ------
    ValueError
        Unknown model type (the message lists `SUPPORTED_MODEL_TYPES`), an unreadable
        file, a missing required field, a field of the wrong kind, an unknown
        ``topk_method``.
    """
    top = _as_dict(config)
    model_type = top.get("model_type")
    if model_type is None:
        raise ValueError("config has no 'model_type'; supported model types: " + ", ".join(SUPPORTED_MODEL_TYPES))
    if not isinstance(model_type, str):
        raise ValueError(
            f"model_type={model_type!r} must be a string, got {type(model_type).__name__}; "
            "supported model types: " + ", ".join(SUPPORTED_MODEL_TYPES)
        )
    fields = top
    text_type = model_type
    if model_type in _COMPOSITE_TEXT_TYPES:
        fields = top.get("text_config")
        if not isinstance(fields, Mapping):
            raise ValueError(f"model_type={model_type!r} keeps its MoE fields in 'text_config', which is missing")
        text_type = _COMPOSITE_TEXT_TYPES[model_type]
    reader = _READERS.get(text_type)
    if reader is None:
        raise ValueError(
            f"model_type={model_type!r} is not supported; supported model types: " + ", ".join(SUPPORTED_MODEL_TYPES)
        )
    return model_type, top.get("_name_or_path") or model_type, reader(fields)
