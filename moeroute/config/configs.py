"""The configs: how a model routes its tokens (`RouterConfig`) and what its MoE layers are
(`ModelPreset`).

`RouterConfig` holds what `select_experts` needs to pick each token's experts
(docs/semantics.md section 1). `ModelPreset` adds what the expert layout and the shared-expert
plan need: the correction bias, the shared expert's shape and gate, and the
hidden and intermediate sizes. Both can be read from a Hugging Face
``config.json`` (a dict, a path, or a transformers configuration object) with
``from_hf``, through the readers of `moeroute.config.hf_readers`.

This module is the bottom of the stack: it imports neither torch nor
transformers (a transformers configuration is read through ``to_dict()``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import numpy as np

from moeroute._validate import integer
from moeroute.config.hf_readers import read_hf_config

__all__ = [
    "RouterConfig",
    "ModelPreset",
    "SCORING_FUNCTIONS",
    "ROUTED_SCALING_FACTOR_RANGE",
    "EXPERT_ACTIVATIONS",
    "MAX_NUM_EXPERTS",
]

#: Expert activations, the one list: a preset may name each, the torch experts
#: (`moeroute.experts.activations`) and the GPU kernels implement each, and engine name
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
            raise ValueError(
                f"num_experts={num_experts} exceeds {MAX_NUM_EXPERTS}: expert ids "
                "are int32; use at most 2**31 - 1 experts"
            )
        top_k = integer("top_k", self.top_k, 1)
        num_groups = integer("num_expert_group", self.num_expert_group, 1)
        topk_group = integer("topk_group", self.topk_group, 1)
        if not isinstance(self.scoring, str) or self.scoring not in SCORING_FUNCTIONS:
            raise ValueError(f"scoring={self.scoring!r} is not supported; use one of {SCORING_FUNCTIONS}")
        if not isinstance(self.renormalize, (bool, np.bool_)):
            raise ValueError(f"renormalize={self.renormalize!r} must be a bool, got {type(self.renormalize).__name__}")
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
            raise ValueError(f"top_k={top_k} exceeds num_experts={num_experts}; top_k must be in [1, {num_experts}]")
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
        if shared and self.shared_unfusable_reason is None and shared_size != shared * inter:
            raise ValueError(
                f"shared_intermediate_size={shared_size} must equal num_shared_experts * "
                f"moe_intermediate_size = {shared * inter}, or shared_unfusable_reason must say "
                "why the shared MLP does not split into slots"
            )
        if self.shared_gated and not shared:
            raise ValueError("shared_gated=True needs a shared expert (num_shared_experts > 0)")
        if self.activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r} is not supported; use one of {EXPERT_ACTIVATIONS}")
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
        model_type, default_name, fields = read_hf_config(config)
        router = RouterConfig(**fields.pop("router"))
        if name is None:
            name = default_name
        return cls(name=name, model_type=model_type, router=router, **fields)
