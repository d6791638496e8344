"""vLLM-shaped routing entry points: ``fused_topk`` and ``grouped_topk`` on moeroute's kernels.

The signatures and results are vLLM's (``vllm.model_executor.layers.fused_moe``), so an
engine written against vLLM swaps the import and keeps its call sites:

    from moeroute.compat.vllm import fused_topk, grouped_topk

    topk_weights, topk_ids = fused_topk(hidden_states, router_logits, top_k, renormalize=True)

Both take torch tensors (CPU or CUDA) and return ``(topk_weights float32 [T, K], topk_ids
int32 [T, K])`` on the device of ``gating_output``. Routing follows moeroute's semantics (docs/semantics.md)
section 1, which is vLLM's reference semantics with three precisions:

* scores are computed in float32 whatever the logits' dtype (float16 and bfloat16 logits
  route exactly as their float32 upcast);
* ties go to the lower expert id (and the lower group id); vLLM leaves them to
  ``torch.topk``;
* renormalization divides by ``sum + 1e-20`` (vLLM: by ``sum``), which differs only for
  sums near zero, where vLLM would divide by zero.

vLLM's newest ``fused_topk`` also returns ``token_expert_indices``; these functions return
the two tensors every caller uses.
"""

from __future__ import annotations

import functools
import numbers

import numpy as np
import torch

from moeroute._validate import integer
from moeroute.config import ROUTED_SCALING_FACTOR_RANGE, RouterConfig
from moeroute.routing.select import select_experts

__all__ = ["fused_topk", "grouped_topk", "SCORING_FUNCS"]

#: ``scoring_func`` values grouped_topk accepts (vLLM's names are moeroute's).
SCORING_FUNCS = ("softmax", "sigmoid")
#: Devices whose tensors hold logits the kernels can read.
_DEVICE_TYPES = ("cpu", "cuda")


@functools.lru_cache(maxsize=256)
def _cached_router(num_experts, top_k, scoring, num_expert_group, topk_group, renormalize, rsf):
    return RouterConfig(
        num_experts,
        top_k,
        scoring,
        num_expert_group=num_expert_group,
        topk_group=topk_group,
        renormalize=renormalize,
        routed_scaling_factor=rsf,
    )


def _router(num_experts, top_k, scoring, num_expert_group, topk_group, renormalize, rsf):
    """The RouterConfig of these arguments, each checked first (so the answer never depends
    on which calls came before: an ``lru_cache`` alone would take ``2.0`` for a cached ``2``
    and hash a list into a TypeError). Engines call once per layer per step with the same
    arguments: the checked, plain-Python key then finds the cached config."""
    top_k = integer("topk", top_k, 1)
    if isinstance(rsf, (bool, np.bool_)) or not isinstance(rsf, numbers.Real):
        low, high = ROUTED_SCALING_FACTOR_RANGE
        raise TypeError(
            f"routed_scaling_factor={rsf!r} must be a real number in [{low:g}, {high:g}], got {type(rsf).__name__}"
        )
    return _cached_router(
        num_experts, top_k, scoring, num_expert_group, topk_group, _as_bool("renormalize", renormalize), float(rsf)
    )


def _check_inputs(hidden_states, gating_output):
    """ValueError/TypeError naming the argument; the number of experts N when all is well."""
    for name, value in (("hidden_states", hidden_states), ("gating_output", gating_output)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if gating_output.device.type not in _DEVICE_TYPES:
        raise ValueError(
            f"gating_output is on {gating_output.device}; routing runs on "
            f"{' or '.join(_DEVICE_TYPES)} tensors (a meta tensor holds no "
            "logits to route)"
        )
    if gating_output.dim() != 2:
        raise ValueError(f"gating_output must be 2-D [num_tokens, num_experts], got shape {tuple(gating_output.shape)}")
    if hidden_states.dim() < 1 or hidden_states.shape[0] != gating_output.shape[0]:
        raise ValueError(
            f"hidden_states has shape {tuple(hidden_states.shape)} but gating_output has "
            f"{gating_output.shape[0]} tokens; the first dimensions must match"
        )
    return int(gating_output.shape[1])


def _ids_as(topk_ids, indices_type, num_experts):
    """``topk_ids`` (int32) converted to ``indices_type``; TypeError/ValueError when it
    is not an integer dtype or cannot hold every expert id."""
    if indices_type is None or indices_type == torch.int32:
        return topk_ids
    if (
        not isinstance(indices_type, torch.dtype)
        or indices_type.is_floating_point
        or indices_type.is_complex
        or indices_type == torch.bool
    ):
        raise TypeError(
            f"indices_type={indices_type!r} must be a torch integer dtype (e.g. torch.int32, torch.int64) or None"
        )
    if torch.iinfo(indices_type).max < num_experts - 1:
        raise ValueError(f"indices_type={indices_type} cannot hold expert id {num_experts - 1}")
    return topk_ids.to(indices_type)


def _as_bool(name, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}={value!r} must be a bool, got {type(value).__name__}")
    return bool(value)


def fused_topk(
    hidden_states: torch.Tensor,
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
    indices_type: torch.dtype | None = None,
):
    """Softmax top-k routing, as vLLM's ``fused_topk``.

    Parameters
    ----------
    hidden_states : Tensor [T, ...]
        Only its first dimension is read (the number of tokens, checked against the logits).
    gating_output : Tensor [T, N], float32, float16 or bfloat16, CPU or CUDA
        Router logits.
    topk : int
        K, 1 <= K <= N.
    renormalize : bool
        Divide the K picked probabilities by their sum.
    indices_type : torch.dtype, optional
        Integer dtype of ``topk_ids``; default int32.

    Returns
    -------
    topk_weights : Tensor [T, K] float32
        ``softmax(gating_output)`` at the picked experts (renormalized if asked).
    topk_ids : Tensor [T, K], int32 or ``indices_type``
        Picked experts, columns ordered by probability descending.

    Raises
    ------
    TypeError
        Inputs that are not tensors; ``topk`` not an integer (Python or NumPy; a bool,
        float, string or list is refused, the same in every process and after any call);
        ``renormalize`` not a bool; a non-integer ``indices_type``.
    ValueError
        Logits not 2-D, of an unsupported dtype or on a device other than CPU or CUDA
        (e.g. meta); token counts that differ; K outside [1, N]; an ``indices_type`` too
        narrow for N - 1.
    """
    num_experts = _check_inputs(hidden_states, gating_output)
    router = _router(num_experts, topk, "softmax", 1, 1, renormalize, 1.0)
    topk_weights, topk_ids = select_experts(gating_output.contiguous(), router)
    return topk_weights, _ids_as(topk_ids, indices_type, num_experts)


def grouped_topk(
    hidden_states: torch.Tensor,
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
    num_expert_group: int = 0,
    topk_group: int = 0,
    scoring_func: str = "softmax",
    routed_scaling_factor: float = 1.0,
    e_score_correction_bias: torch.Tensor | None = None,
):
    """Group-limited top-k routing (DeepSeek-V2/V3 style), as vLLM's ``grouped_topk``.

    The N experts form ``num_expert_group`` equal groups; each group is scored by its best
    expert (with a correction bias: by the sum of its two best biased scores), the
    ``topk_group`` best groups are kept, and the K best experts among them are picked.

    Parameters
    ----------
    hidden_states : Tensor [T, ...]
        Only its first dimension is read.
    gating_output : Tensor [T, N], float32, float16 or bfloat16, CPU or CUDA
    topk : int
        K.
    renormalize : bool
    num_expert_group : int
        G; 0 or 1 means one group (plain top-k). Must divide N.
    topk_group : int
        Groups kept; 0 means all G.
    scoring_func : {"softmax", "sigmoid"}
    routed_scaling_factor : float
        Multiplies the weights (after renormalization).
    e_score_correction_bias : Tensor [N], optional
        Added to the scores for selection only; on the device of ``gating_output``
        (converted to float32 when it is another float dtype).

    Returns
    -------
    topk_weights : Tensor [T, K] float32
        Unbiased scores of the picked experts, renormalized if asked, times rsf.
    topk_ids : Tensor [T, K] int32

    Raises
    ------
    TypeError
        Inputs that are not tensors; ``topk``, ``num_expert_group`` or ``topk_group`` not
        an integer; ``routed_scaling_factor`` not a real number (None, a string);
        ``renormalize`` not a bool.
    ValueError
        An unknown ``scoring_func``; a negative ``num_expert_group`` or ``topk_group``;
        ``routed_scaling_factor`` outside [1e-6, 1e6]; G not dividing N; ``topk_group`` > G; K larger than
        the kept groups hold; a bias of shape other than [N]; as `fused_topk`.
    """
    num_experts = _check_inputs(hidden_states, gating_output)
    if scoring_func not in SCORING_FUNCS:
        raise ValueError(f"scoring_func={scoring_func!r} is not supported; use one of {SCORING_FUNCS}")
    num_expert_group = integer("num_expert_group", num_expert_group, 0)  # 0: no grouping
    topk_group = integer("topk_group", topk_group, 0)  # 0: all groups
    groups = max(num_expert_group, 1)
    kept = groups if topk_group == 0 else topk_group
    router = _router(num_experts, topk, scoring_func, groups, kept, renormalize, routed_scaling_factor)
    bias = e_score_correction_bias
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"e_score_correction_bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if bias.is_floating_point() and bias.dtype != torch.float32:
            bias = bias.float()  # the kernels read a float32 bias; this is vLLM's upcast too
        bias = bias.contiguous()
    return select_experts(gating_output.contiguous(), router, bias)
