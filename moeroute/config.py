"""Router configuration, model presets and reading Hugging Face configs.

`RouterConfig` holds what `select_experts` needs to pick each token's experts
(docs/semantics.md section 1). `ModelPreset` adds what the expert layout and the shared-expert
plan need: the correction bias, the shared expert's shape and gate, and the
hidden and intermediate sizes. Both can be read from a Hugging Face
``config.json`` (a dict, a path, or a transformers configuration object) with
``from_hf``; `PRESETS` holds the models of docs/semantics.md section 1 with their real sizes.

This module is the bottom of the stack: it imports neither torch nor
transformers (a transformers configuration is read through ``to_dict()``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from moeroute._validate import integer

__all__ = [
    "RouterConfig",
    "ModelPreset",
    "PRESETS",
    "get_preset",
    "SCORING_FUNCTIONS",
    "SUPPORTED_MODEL_TYPES",
    "ROUTED_SCALING_FACTOR_RANGE",
]

#: Expert activations, the one list: a preset may name each, the torch experts
#: (`moeroute.bindings.torch.activations`) and the GPU kernels implement each, and engine name
#: mappings (vLLM, transformers) derive from it. Position = the kernels' activation code
#: (kActivation* in gpu/kernels/moe_gemm.cu): "silu" SwiGLU, "gelu" exact (erf) GeGLU,
#: "gelu_tanh" torch's approximate="tanh", "swigluoai" gpt-oss's clamped SwiGLU.
EXPERT_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swigluoai")

#: Scoring functions applied to the router logits before selection: softmax, sigmoid,
#: sqrt(softplus(logits)) and "none" (the raw logits are the scores).
SCORING_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus", "none")
#: Allowed routed_scaling_factor range. Scores are at most 1 (before scaling), so
#: weights stay at most 1e6, far below float32's 3.4e38 even summed over many tokens'
#: expert outputs, and a weight of 1 stays far above float32's smallest normal 1.2e-38.
ROUTED_SCALING_FACTOR_RANGE = (1e-6, 1e6)


#: Largest number of experts: expert ids (and the offsets of their rows) are int32.
MAX_NUM_EXPERTS = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """How a token's routed experts are chosen and weighted (docs/semantics.md section 1).

    Parameters
    ----------
    num_experts : int
        N, the number of routed (logical) experts; 1 <= N <= 2**31 - 1 (`MAX_NUM_EXPERTS`:
        expert ids are int32).
    top_k : int
        K, the number of routed experts per token; 1 <= K <= N, and with grouped
        routing K <= topk_group * N / num_expert_group.
    scoring : {"softmax", "sigmoid", "sqrtsoftplus", "none"}
        Function turning router logits into scores: softmax over the N logits, sigmoid,
        ``sqrt(softplus(logits))`` (SGLang's biased top-k), or "none": the raw logits are
        the scores (FlashInfer's TopK routing). With "none" and ``renormalize`` the K picked
        logits are divided by ``sum + 1e-20`` only when that divisor is positive and finite
        (otherwise they stay as they are), and every weight is clamped to the finite float32
        range. Top-k on the logits then a softmax over the K picked (gpt-oss) is
        "softmax" with ``renormalize=True``.
    num_expert_group : int
        G, the number of expert groups; must divide N. 1 disables grouped routing.
    topk_group : int
        Number of groups a token may pick experts from; 1 <= topk_group <= G.
    renormalize : bool
        Divide the K picked weights by their sum before scaling.
    routed_scaling_factor : float
        rsf, a factor in `ROUTED_SCALING_FACTOR_RANGE` ([1e-6, 1e6]) multiplied into the
        routed weights, so that float32 weights stay finite and nonzero.

    Raises
    ------
    ValueError
        On any value outside the ranges above; the message names the argument,
        its value and the allowed range, e.g.
        ``top_k=9 exceeds topk_group * experts_per_group = 8``. Integers follow
        `moeroute._validate.integer`: Python or NumPy integers; a bool, float or string is
        refused (`IntegerTypeError`, a ValueError and a TypeError).
    """

    num_experts: int
    top_k: int
    scoring: str = "softmax"
    num_expert_group: int = 1
    topk_group: int = 1
    renormalize: bool = True
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        num_experts = integer("num_experts", self.num_experts, 1)
        if num_experts > MAX_NUM_EXPERTS:
            raise ValueError(f"num_experts={num_experts} exceeds {MAX_NUM_EXPERTS}: expert ids "
                             "are int32; use at most 2**31 - 1 experts")
        top_k = integer("top_k", self.top_k, 1)
        num_groups = integer("num_expert_group", self.num_expert_group, 1)
        topk_group = integer("topk_group", self.topk_group, 1)
        if not isinstance(self.scoring, str) or self.scoring not in SCORING_FUNCTIONS:
            raise ValueError(
                f"scoring={self.scoring!r} is not supported; use one of {SCORING_FUNCTIONS}"
            )
        if not isinstance(self.renormalize, (bool, np.bool_)):
            raise ValueError(
                f"renormalize={self.renormalize!r} must be a bool, "
                f"got {type(self.renormalize).__name__}"
            )
        rsf = self.routed_scaling_factor
        low, high = ROUTED_SCALING_FACTOR_RANGE
        if isinstance(rsf, bool) or not isinstance(rsf, numbers.Real):
            raise ValueError(
                f"routed_scaling_factor={rsf!r} must be a finite real number in "
                f"[{low:g}, {high:g}], got {type(rsf).__name__}"
            )
        if not math.isfinite(rsf) or not low <= rsf <= high:
            raise ValueError(
                f"routed_scaling_factor={rsf} must be a finite real number in [{low:g}, {high:g}] "
                "(outside it float32 weights overflow to inf or vanish to 0)"
            )
        if top_k > num_experts:
            raise ValueError(
                f"top_k={top_k} exceeds num_experts={num_experts}; top_k must be in [1, {num_experts}]"
            )
        if num_experts % num_groups != 0:
            raise ValueError(
                f"num_expert_group={num_groups} does not divide num_experts={num_experts}; "
                f"use a divisor of {num_experts}"
            )
        if topk_group > num_groups:
            raise ValueError(
                f"topk_group={topk_group} exceeds num_expert_group={num_groups}; "
                f"topk_group must be in [1, {num_groups}]"
            )
        selectable = topk_group * (num_experts // num_groups)
        if top_k > selectable:
            raise ValueError(
                f"top_k={top_k} exceeds topk_group * experts_per_group = {selectable} "
                f"(topk_group={topk_group}, experts_per_group={num_experts // num_groups}); "
                f"top_k must be in [1, {selectable}]"
            )
        # Frozen dataclass: store plain Python values (numpy scalars are accepted).
        for name, value in (
            ("num_experts", num_experts),
            ("top_k", top_k),
            ("num_expert_group", num_groups),
            ("topk_group", topk_group),
            ("renormalize", bool(self.renormalize)),
            ("routed_scaling_factor", float(rsf)),
        ):
            object.__setattr__(self, name, value)

    @property
    def experts_per_group(self) -> int:
        """N / G, the number of experts in each routing group."""
        return self.num_experts // self.num_expert_group

    @classmethod
    def from_hf(cls, config: Any) -> RouterConfig:
        """Read the router configuration of a Hugging Face model.

        Parameters
        ----------
        config : dict, str, os.PathLike or transformers.PretrainedConfig
            The parsed ``config.json``, a path to it (or to the directory holding
            it), or a transformers configuration object. Supported model types
            are listed in `SUPPORTED_MODEL_TYPES`.

        Returns
        -------
        RouterConfig

        Raises
        ------
        ValueError
            Unknown model type (the message lists the supported ones), a missing
            required field, or field values `RouterConfig` rejects.
        """
        return ModelPreset.from_hf(config).router


@dataclasses.dataclass(frozen=True)
class ModelPreset:
    """Everything moeroute needs to know about one model's MoE layers.

    Parameters
    ----------
    name : str
        Preset or checkpoint name.
    model_type : str
        Hugging Face ``model_type`` (top level, e.g. ``"qwen3_5_moe"``).
    router : RouterConfig
        How tokens are routed.
    has_correction_bias : bool
        The router adds a per-expert correction bias [N] (float32) to the scores
        for selection (DeepSeek-V3 ``noaux_tc``, GLM-4.5).
    num_shared_experts : int
        S, the number of shared slots of size ``moe_intermediate_size`` the shared
        MLP splits into; 0 when the model has no shared expert. When the shared MLP
        does not split (see ``shared_unfusable_reason``) it counts as one.
    shared_intermediate_size : int
        Total intermediate size of the shared MLP; 0 when there is none.
    shared_gated : bool
        The shared output is multiplied by a per-token sigmoid gate
        (Qwen1.5/Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE).
    hidden_size : int
        H.
    moe_intermediate_size : int
        I, the intermediate size of one routed expert.
    shared_unfusable_reason : str or None
        Why the shared MLP cannot become expert slots (pass it to
        ``ExpertLayout(unfusable_reason=...)``); None when it can.
    activation : str
        The experts' activation: "silu" (default), "gelu", "gelu_tanh" or "swigluoai"
        (gpt-oss).
    expert_bias : bool
        The experts carry gate_up and down biases, and the router linear a bias (gpt-oss).

    Raises
    ------
    ValueError
        Inconsistent fields: negative sizes, a shared size that is not
        S * moe_intermediate_size without a reason, or S without a shared size.
    """

    name: str
    model_type: str
    router: RouterConfig
    has_correction_bias: bool
    num_shared_experts: int
    shared_intermediate_size: int
    shared_gated: bool
    hidden_size: int
    moe_intermediate_size: int
    shared_unfusable_reason: str | None = None
    activation: str = "silu"
    expert_bias: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.router, RouterConfig):
            raise ValueError(f"router={self.router!r} must be a RouterConfig")
        hidden = integer("hidden_size", self.hidden_size, 1)
        inter = integer("moe_intermediate_size", self.moe_intermediate_size, 1)
        shared = integer("num_shared_experts", self.num_shared_experts, 0)
        shared_size = integer("shared_intermediate_size", self.shared_intermediate_size, 0)
        if (shared == 0) != (shared_size == 0):
            raise ValueError(
                f"num_shared_experts={shared} and shared_intermediate_size={shared_size} "
                "disagree: both must be 0 (no shared expert) or both positive"
            )
        if (
            shared
            and self.shared_unfusable_reason is None
            and shared_size != shared * inter
        ):
            raise ValueError(
                f"shared_intermediate_size={shared_size} must equal num_shared_experts * "
                f"moe_intermediate_size = {shared * inter}, or shared_unfusable_reason must say "
                "why the shared MLP does not split into slots"
            )
        if self.shared_gated and not shared:
            raise ValueError("shared_gated=True needs a shared expert (num_shared_experts > 0)")
        if self.activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r} is not supported; use one of "
                             f"{EXPERT_ACTIVATIONS}")
        object.__setattr__(self, "expert_bias", bool(self.expert_bias))
        object.__setattr__(self, "hidden_size", hidden)
        object.__setattr__(self, "moe_intermediate_size", inter)
        object.__setattr__(self, "num_shared_experts", shared)
        object.__setattr__(self, "shared_intermediate_size", shared_size)
        object.__setattr__(self, "has_correction_bias", bool(self.has_correction_bias))
        object.__setattr__(self, "shared_gated", bool(self.shared_gated))

    @classmethod
    def from_hf(cls, config: Any, name: str | None = None) -> ModelPreset:
        """Read a model's MoE description from its Hugging Face configuration.

        Fields missing from ``config`` take the defaults of the transformers 5.x
        configuration class of that model type, except the expert count and
        top-k, which must be present when that class has no default for them.

        Parameters
        ----------
        config : dict, str, os.PathLike or transformers.PretrainedConfig
            The parsed ``config.json``, a path to it (or to the directory holding
            it), or a transformers configuration object (read via ``to_dict()``).
            Composite configurations (``qwen3_5_moe``, ``kimi_k25``) are read
            from their ``text_config``.
        name : str, optional
            Preset name; defaults to ``_name_or_path`` when set, else the model type.

        Returns
        -------
        ModelPreset

        Raises
        ------
        ValueError
            Unknown model type (the message lists `SUPPORTED_MODEL_TYPES`), an
            unreadable file, a missing required field, an unknown ``topk_method``,
            or values `RouterConfig` rejects.
        """
        top = _as_dict(config)
        model_type = top.get("model_type")
        if model_type is None:
            raise ValueError(
                "config has no 'model_type'; supported model types: "
                + ", ".join(SUPPORTED_MODEL_TYPES)
            )
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
                raise ValueError(
                    f"model_type={model_type!r} keeps its MoE fields in 'text_config', "
                    "which is missing"
                )
            text_type = _COMPOSITE_TEXT_TYPES[model_type]
        reader = _READERS.get(text_type)
        if reader is None:
            raise ValueError(
                f"model_type={model_type!r} is not supported; supported model types: "
                + ", ".join(SUPPORTED_MODEL_TYPES)
            )
        if name is None:
            name = top.get("_name_or_path") or model_type
        return cls(name=name, model_type=model_type, **reader(fields))


# ---------------------------------------------------------------------------
# Hugging Face readers: one per model family, with the transformers defaults.

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
        f"config must be a dict, a path to config.json or a transformers config, "
        f"got {type(config).__name__}"
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
        raise ValueError(
            f"Hugging Face config field {key!r}={value!r} must be {kind}, "
            f"got {type(value).__name__}"
        )


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
        router=RouterConfig(
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
            f"topk_method={topk_method!r} is not supported for deepseek_v2; "
            "use 'greedy' or 'group_limited_greedy'"
        )
    inter = _field(fields, "moe_intermediate_size", 1407)
    num_shared = _field(fields, "n_shared_experts", 2)
    return dict(
        router=RouterConfig(
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
        router=RouterConfig(
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
        renormalize = True if norm_topk_prob is None else _field(
            fields, "norm_topk_prob", norm_topk_prob
        )
        return dict(
            router=RouterConfig(
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
        router=RouterConfig(
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
            f"swiglu_alpha={alpha}, swiglu_limit={limit}: moeroute's swigluoai uses alpha=1.702 "
            "and limit=7.0"
        )
    return dict(
        router=RouterConfig(
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
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(
    sorted(set(_READERS) | set(_COMPOSITE_TEXT_TYPES))
)


# ---------------------------------------------------------------------------
# Presets: the models of docs/semantics.md section 1 with the sizes of their released checkpoints.

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
            "deepseek-v3", "deepseek_v3",
            RouterConfig(256, 8, "sigmoid", num_expert_group=8, topk_group=4,
                         renormalize=True, routed_scaling_factor=2.5),
            has_correction_bias=True, num_shared_experts=1, shared_intermediate_size=2048,
            hidden_size=7168, moe_intermediate_size=2048,
        ),
        _preset(
            # The released Kimi-K2 config.json sets norm_topk_prob true.
            "kimi-k2", "kimi_k2",
            RouterConfig(384, 8, "sigmoid", renormalize=True, routed_scaling_factor=2.827),
            has_correction_bias=True, num_shared_experts=1, shared_intermediate_size=2048,
            hidden_size=7168, moe_intermediate_size=2048,
        ),
        _preset(
            "glm-4.5", "glm4_moe",
            RouterConfig(160, 8, "sigmoid", renormalize=True, routed_scaling_factor=2.5),
            has_correction_bias=True, num_shared_experts=1, shared_intermediate_size=1536,
            hidden_size=5120, moe_intermediate_size=1536,
        ),
        _preset(
            "qwen3-30b-a3b", "qwen3_moe",
            RouterConfig(128, 8, "softmax", renormalize=True),
            hidden_size=2048, moe_intermediate_size=768,
        ),
        _preset(
            # Qwen3-Next-80B-A3B sizes: the shared expert is one slot of size I.
            "qwen3.5-moe", "qwen3_next",
            RouterConfig(512, 10, "softmax", renormalize=True),
            num_shared_experts=1, shared_intermediate_size=512, shared_gated=True,
            hidden_size=2048, moe_intermediate_size=512,
        ),
        _preset(
            # shared_expert_intermediate_size 5632 = 4 x 1408: four slots.
            "qwen1.5-moe-a2.7b", "qwen2_moe",
            RouterConfig(60, 4, "softmax", renormalize=False),
            num_shared_experts=4, shared_intermediate_size=5632, shared_gated=True,
            hidden_size=2048, moe_intermediate_size=1408,
        ),
        _preset(
            "mixtral-8x7b", "mixtral",
            RouterConfig(8, 2, "softmax", renormalize=True),
            hidden_size=4096, moe_intermediate_size=14336,
        ),
        # gpt-oss: softmax over the top-k logits = softmax + renormalize; biased experts.
        _preset(
            "gpt-oss-20b", "gpt_oss",
            RouterConfig(32, 4, "softmax", renormalize=True),
            hidden_size=2880, moe_intermediate_size=2880, activation="swigluoai",
            expert_bias=True,
        ),
        _preset(
            "gpt-oss-120b", "gpt_oss",
            RouterConfig(128, 4, "softmax", renormalize=True),
            hidden_size=2880, moe_intermediate_size=2880, activation="swigluoai",
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
        raise ValueError(
            f"unknown preset {name!r}; available presets: {', '.join(PRESETS)}"
        ) from None
