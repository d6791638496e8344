"""Torch tensors in, routing kernels, torch tensors out: zero-copy, both ways.

The routing operations take torch tensors themselves (`moeroute.routing._arrays` does the
crossing): CPU tensors reach the Numba kernels as NumPy views of the same memory
(``Tensor.numpy()``), and the kernels' NumPy results come back through
``torch.from_numpy``: no copy in either direction. CUDA tensors go to the kernels as they
are (``__cuda_array_interface__``) and come back as torch tensors on the same device.
bfloat16 has no NumPy dtype, so it never becomes a NumPy float: it crosses as its raw
16-bit pattern to kernels that read raw bf16, or is converted on the torch side.

This module is the one place the torch adapter imports the routing kernels from.
"""

from __future__ import annotations

import types

import numpy as np
import torch

from moeroute.routing import _arrays
from moeroute.routing.combine import combine as _combine
from moeroute.routing.permute import permute as _permute
from moeroute.routing.permute import sort_by_expert as _sort_by_expert
from moeroute.routing.remap import remap_to_local as _remap_to_local
from moeroute.routing.route import route as _route
from moeroute.routing.select import select_experts as _select_experts
from moeroute.routing.shared_slots import append_shared_slots as _append_shared_slots

__all__ = [
    "host_array",
    "kernel_array",
    "as_tensor",
    "expert_map_for_device",
    "select_experts",
    "append_shared_slots",
    "route",
    "remap_to_local",
    "sort_by_expert",
    "permute",
    "combine",
    "ROUTING_KERNELS",
]

#: The routing operations the adapter calls (one import point).
ROUTING_KERNELS = types.SimpleNamespace(
    select_experts=_select_experts,
    append_shared_slots=_append_shared_slots,
    route=_route,
    remap_to_local=_remap_to_local,
    sort_by_expert=_sort_by_expert,
    permute=_permute,
    combine=_combine,
)


def host_array(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor's memory (no copy).

    Parameters
    ----------
    tensor : Tensor, on the CPU, any shape
        bfloat16 comes back as its raw bit pattern (``uint16``), never as NumPy floats.

    Returns
    -------
    numpy.ndarray, same shape, sharing ``tensor``'s memory.

    Raises
    ------
    TypeError
        ``tensor`` is not a torch.Tensor.
    ValueError
        ``tensor`` is not on the CPU.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    return _arrays.host_array(tensor)


def kernel_array(tensor: torch.Tensor):
    """What a routing kernel takes for ``tensor``: a NumPy view (CPU) or the tensor (CUDA).

    The tensor is made contiguous first (a no-op when it already is).
    """
    tensor = tensor.detach().contiguous()
    if tensor.device.type == "cpu":
        return host_array(tensor)
    return tensor


def as_tensor(array, device: torch.device | None = None) -> torch.Tensor:
    """A torch tensor viewing a kernel's output (no copy).

    Parameters
    ----------
    array : numpy.ndarray, torch.Tensor or a numba device array
    device : torch.device, optional
        The CUDA device a numba device array lives on.
    """
    if isinstance(array, torch.Tensor):
        return array
    if isinstance(array, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(array))
    if isinstance(array, np.generic):
        return torch.from_numpy(np.asarray(array))
    return torch.as_tensor(array, device=device)


def expert_map_for_device(expert_map: np.ndarray, device: torch.device):
    """``expert_map`` (int32 [num_physical_experts]) as the kernels take it on ``device``."""
    if torch.device(device).type == "cpu":
        return np.ascontiguousarray(expert_map, dtype=np.int32)
    return torch.as_tensor(expert_map, dtype=torch.int32, device=device)


def _contiguous(tensor):
    return tensor.detach().contiguous() if isinstance(tensor, torch.Tensor) else tensor


def select_experts(logits: torch.Tensor, router, correction_bias: torch.Tensor | None = None):
    """Top-k routing of docs/semantics.md section 1 on torch tensors.

    Parameters
    ----------
    logits : Tensor [T, N] float32, float16 or bfloat16
    router : moeroute.config.RouterConfig
    correction_bias : Tensor [N] float32, optional

    Returns
    -------
    topk_weights : Tensor [T, K] float32
    topk_ids : Tensor [T, K] int32
    """
    return ROUTING_KERNELS.select_experts(_contiguous(logits), router, _contiguous(correction_bias))


def append_shared_slots(topk_weights, topk_ids, layout, home_rank=0, shared_weights=None):
    """Weights and physical ids with the fused shared slots appended (docs/semantics.md section 4).

    Parameters
    ----------
    topk_weights : Tensor [T, K] float32
    topk_ids : Tensor [T, K] int32, logical routed ids
    layout : moeroute.layout.ExpertLayout
    home_rank : int
    shared_weights : None, float, or Tensor [T] / [T, 1] float32
        ``layout.shared_slot_weight(gate, rsf)``.

    Returns
    -------
    weights : Tensor [T, K + S'] float32, ids : Tensor [T, K + S'] int32
        (S' = S when fused, else 0).

    Raises
    ------
    TypeError
        Non-float weights or non-integer ids (the pair in the order before 0.2), and as
        `moeroute.append_shared_slots`.
    """
    if isinstance(shared_weights, torch.Tensor):
        shared_weights = shared_weights.detach().to(torch.float32).contiguous()
    return ROUTING_KERNELS.append_shared_slots(
        _contiguous(topk_weights), _contiguous(topk_ids), layout, home_rank, shared_weights
    )


def route(logits: torch.Tensor, router, layout, rank=0, correction_bias=None, shared_weights=None, home_rank=0):
    """select_experts, the fused shared slots and the local ids of ``rank`` in one step
    (docs/semantics.md sections 1, 2 and 4; one kernel launch on CUDA tensors).

    Parameters
    ----------
    logits : Tensor [T, N] float32, float16 or bfloat16
    router : moeroute.config.RouterConfig
    layout : moeroute.layout.ExpertLayout
    rank, home_rank : int
        The rank whose local ids are returned; the rank the tokens come from.
    correction_bias : Tensor [N] float32, optional
    shared_weights : None, float, or Tensor [T] / [T, 1] float32
        ``layout.shared_slot_weight(gate, rsf)``.

    Returns
    -------
    weights : Tensor [T, K + S'] float32, local_ids : Tensor [T, K + S'] int32
        -1 where ``rank`` does not hold the expert (S' = S when fused, else 0).
    """
    if isinstance(shared_weights, torch.Tensor):
        shared_weights = shared_weights.detach().to(torch.float32).contiguous()
    return ROUTING_KERNELS.route(
        _contiguous(logits), router, layout, rank, _contiguous(correction_bias), shared_weights, home_rank
    )


def remap_to_local(ids: torch.Tensor, expert_map) -> torch.Tensor:
    """Physical -> local ids: ``expert_map[id]``, -1 when not held (int32, shape of ``ids``)."""
    return ROUTING_KERNELS.remap_to_local(_contiguous(ids), expert_map)


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int):
    """Stable expert sort of the flat (token, slot) entries.

    Returns
    -------
    sorted_slots : Tensor [M] int32, flat indices ``t*K' + k`` in expert order
    expert_offsets : Tensor [num_experts + 1] int32
    inverse_index : Tensor [T, K'] int32, row of each entry, -1 when dropped
    """
    return ROUTING_KERNELS.sort_by_expert(_contiguous(topk_ids), num_experts)


def permute(hidden_states: torch.Tensor, topk_ids: torch.Tensor, num_experts: int):
    """Token rows in expert order (moved as raw bits: bfloat16 is never converted).

    Parameters
    ----------
    hidden_states : Tensor [T, H], any dtype
    topk_ids : Tensor [T, K'] int32; ids outside [0, num_experts) are dropped
    num_experts : int

    Returns
    -------
    permuted_hidden : Tensor [M, H], dtype of ``hidden_states``
        Row r is ``hidden_states[sorted_slots[r] // K']``.
    expert_offsets : Tensor [num_experts + 1] int32
    inverse_index : Tensor [T, K'] int32, -1 for dropped entries
    """
    return ROUTING_KERNELS.permute(_contiguous(hidden_states), _contiguous(topk_ids), num_experts)


def combine(expert_out: torch.Tensor, inverse_index: torch.Tensor, topk_weights: torch.Tensor):
    """``out[t] = sum_k w[t, k] * expert_out[inverse_index[t, k]]``, float32 accumulation.

    Parameters
    ----------
    expert_out : Tensor [M, H], float32, float16 or bfloat16
    inverse_index : Tensor [T, K'] int32 (-1 entries skipped)
    topk_weights : Tensor [T, K'] float32

    Returns
    -------
    Tensor [T, H], dtype of ``expert_out``.
    """
    return ROUTING_KERNELS.combine(_contiguous(expert_out), _contiguous(inverse_index), _contiguous(topk_weights))
