"""route: select_experts + append_shared_slots + remap to one rank's local ids, fused.

On device inputs one CUDA kernel does all three (`select._cuda.route_kernel_function`):
the warp that picks a row's experts maps each pick to its physical id (replica hash,
per-rank shift), appends the fused shared slots and looks up the rank's local ids, so no
[T, K] intermediate is written or read back and there is one launch instead of three.
On host inputs (NumPy, CPU torch) it is the composition of the three CPU ops.
"""

from __future__ import annotations

import weakref
from functools import lru_cache

import numpy as np

from moeroute._validate import integer
from moeroute.routing import _arrays, _launcher, select, shared_slots
from moeroute.routing.remap import (
    _remap_host,
    check_layout,
    expert_map_device_table,
    layout_device_tables,
)
from moeroute.routing.select import _cuda as _select_device

__all__ = ["route"]


def _check_route_args(config, layout, rank) -> int:
    """Validated ``rank``; TypeError/ValueError naming the argument otherwise."""
    check_layout(layout)
    num_experts = getattr(config, "num_experts", None)
    if num_experts is not None and num_experts != layout.num_routed_experts:
        raise ValueError(
            f"config.num_experts={num_experts} does not match layout.num_routed_experts={layout.num_routed_experts}"
        )
    rank = integer("rank", rank)
    if not 0 <= rank < layout.ep_size:
        raise ValueError(f"rank={rank} is outside [0, {layout.ep_size}) for ep_size={layout.ep_size}")
    return int(rank)


def route(logits, config, layout, rank=0, correction_bias=None, shared_weights=None, home_rank=0, *, stream=None):
    """Route tokens to the local experts of ``rank`` in one step (docs/semantics.md sections 1, 2, 4).

    Equal to ``select_experts`` -> ``append_shared_slots(weights, ids, layout, home_rank,
    shared_weights)`` -> ``remap_to_local(ids, layout.expert_map(rank))``: ids exactly,
    weights as computed by select_experts (and the shared slot weights copied).

    Parameters
    ----------
    logits : array [T, N], float32, float16 or bfloat16
        Router logits, as for `select_experts`: NumPy or CPU torch runs the CPU ops;
        C-contiguous device arrays (numba, CuPy, torch CUDA) run one CUDA kernel and the
        results stay on the device, in the framework of ``logits``.
    config : moeroute.RouterConfig
        ``config.num_experts`` must equal ``layout.num_routed_experts``.
    layout : moeroute.ExpertLayout
        Replicas, shared slots and which rank holds which physical expert.
    rank : int
        The rank whose local ids are returned, in [0, layout.ep_size).
    correction_bias : array [N] float32, optional
        Selection-only bias, on the side (host or device) of ``logits``.
    shared_weights : None, scalar, or array [T], [T, 1] or [T, S] float32, optional
        The fused shared slot weight, ``layout.shared_slot_weight(gate, rsf)``; None
        means 1.0 (the "router" scaling regime only). Device arrays with device logits.
    home_rank : int
        The rank the tokens come from, in [0, layout.ep_size): picks the per-rank shared
        slots (and is where their results are computed).
    stream : optional
        Device inputs only: the stream to launch on; default: the current stream of the
        framework that produced ``logits``.

    Returns
    -------
    weights : float32 [T, K + S']
        Columns < K: select_experts' weights; columns K + j: the shared slot weight.
    local_ids : int32 [T, K + S']
        ``layout.expert_map(rank)`` of each physical id: the local expert index on
        ``rank``, or -1 where ``rank`` does not hold that expert (another rank's routed
        expert or, per_rank, another rank's shared slot).
        S' = layout.num_shared_experts when ``layout.shared == "fused"``, else 0.

    Raises
    ------
    TypeError
        ``config`` not a RouterConfig, ``layout`` not an ExpertLayout, ``rank`` or
        ``home_rank`` not an integer, ``correction_bias`` or ``shared_weights`` not on
        the side of ``logits``, and as `select_experts`.
    ValueError
        ``config.num_experts != layout.num_routed_experts``; ``rank`` or ``home_rank``
        outside [0, ep_size); ``shared_weights`` of another shape or None under
        scaling_regime "output" with fused slots; and as `select_experts` (shape, dtype,
        bias, device limits).
    """
    rank = _check_route_args(config, layout, rank)
    entry = _arrays.enter(logits, "logits")
    bias = None if correction_bias is None else _arrays.enter(correction_bias, "correction_bias")
    if entry.on_device:
        return _route_device(entry, config, layout, rank, bias, shared_weights, home_rank, stream)
    # The CPU ops on NumPy views, composed; the results leave through the logits' boundary.
    weights, ids, _ = select._select_host_entry(entry, config, bias)
    if _appends_nothing(layout):
        # No slot to append, one replica per expert at its own index: select_experts' ids
        # (all in [0, N), int32) already are the physical ones.
        home_rank = shared_slots._check_append_args(
            layout, home_rank, ids.shape, weights.shape, np.float32, shared_weights, None
        )[0]
    else:
        shared = None if shared_weights is None else _arrays.enter(shared_weights, "shared_weights").host_floats()
        weights, ids = shared_slots._append_host(weights, ids, layout, home_rank, shared_weights, shared)
    if layout.ep_size > 1:
        # On one rank every physical expert is held at its own index (expert_map(0) is the
        # identity on [0, num_physical_experts)): the physical ids already are local.
        ids = _remap_host(ids, layout.expert_map(rank))
    return entry.wrap(weights), entry.wrap(ids)


#: id(layout) -> (weak reference, whether append_shared_slots is the identity on it).
_APPENDS_NOTHING: dict = {}


def _appends_nothing(layout) -> bool:
    """Whether `append_shared_slots` returns select_experts' output unchanged on ``layout``:
    no fused shared slot and every logical expert one physical expert of the same id."""
    entry = _APPENDS_NOTHING.get(id(layout))
    if entry is not None and entry[0]() is layout:
        return entry[1]
    n = layout.num_routed_experts
    identity = (
        layout.shared != "fused"
        and layout.num_routed_physical == n
        and np.array_equal(layout.replica_offsets, np.arange(n + 1))
        and np.array_equal(layout.replica_ids, np.arange(n))
        and np.array_equal(layout.routed_id_map, np.arange(n))
    )
    _APPENDS_NOTHING[id(layout)] = (weakref.ref(layout), identity)
    return identity


@lru_cache(maxsize=None)
def _route_kernel(num_experts, num_groups, scoring, has_bias, renormalize, input_kind):
    """The compiled route kernel, built once per specialisation."""
    from numba import cuda

    return cuda.jit(
        _select_device.route_kernel_function(num_experts, num_groups, scoring, has_bias, renormalize, input_kind)
    )


@lru_cache(maxsize=None)
def _route_signature(input_kind, bias_layout, slot_layout):
    """The route kernel's signature, one tuple object per argument (the launcher's key)."""
    return _select_device.route_signature(input_kind, bias_layout, slot_layout)


def _route_device(entry, config, layout, rank, bias, shared_weights, home_rank, stream):
    """route on device logits, from the boundaries of ``logits`` and ``correction_bias``
    (``bias``: None when absent): one launch on the logits' stream."""
    correction_bias = None if bias is None else bias.array
    select._validate(
        entry.array, config, correction_bias, True, bias_on_device=None if bias is None else bias.on_device
    )
    launcher = _launcher.active_launcher()
    array, kind = entry.kernel(launcher, bits16=True), entry.dtype  # bfloat16 as int16 bits
    if not entry.contiguous():
        raise ValueError(
            f"device logits must be C-contiguous, got shape {tuple(array.shape)} with non-contiguous strides"
        )
    num_tokens, top_k = int(array.shape[0]), config.top_k
    shared_entry = None if shared_weights is None else _arrays.enter(shared_weights, "shared_weights")
    shared, scalar = shared_slots.device_shared_weights(shared_entry, launcher, "logits")
    home_rank, slots = shared_slots._check_append_args(
        layout,
        home_rank,
        (num_tokens, top_k),
        (num_tokens, top_k),
        np.float32,
        shared_weights,
        None if shared is None else tuple(shared.shape),
    )
    # The cached launcher takes the raw handle: no numba stream object per call.
    launch_stream = entry.stream(stream, launcher)
    width = top_k + slots
    view = launcher == "numba"
    weights, weights_out = entry.empty((num_tokens, width), np.float32, launch_stream, view=view)
    local_ids, ids_out = entry.empty((num_tokens, width), np.int32, launch_stream, view=view)
    if num_tokens == 0:
        return weights, local_ids
    has_bias = bias is not None
    # Without a bias (or a shared weight array) the kernel never reads it: any float32
    # array of the right rank fills the slot.
    bias_array = bias.kernel(launcher) if has_bias else weights_out.reshape(-1)
    slot_weights, use_row, use_col, has_array = shared_slots.device_slot_weights(shared, weights_out)
    first_slot = int(layout.shared_slot_ids(home_rank)[0]) if slots else 0
    offsets, replica_ids, routed_id_map = layout_device_tables(layout)
    expert_map = expert_map_device_table(layout.expert_map(rank))
    kernel = _route_kernel(
        config.num_experts, config.num_expert_group, config.scoring, has_bias, config.renormalize, kind
    )
    warps = _select_device.warps_per_block()
    signature = _route_signature(
        kind,
        "C" if not has_bias or bias.contiguous() else "A",
        "C"
        if shared is None
        or (shared_entry.contiguous() if slot_weights is shared else _arrays.is_c_contiguous(slot_weights))
        else "A",
    )
    _launcher.launch(
        kernel,
        signature,
        -(-num_tokens // warps),
        warps * _select_device.WARP_SIZE,
        launch_stream,
        (
            array,
            bias_array,
            num_tokens,
            top_k,
            config.topk_group,
            np.float32(config.routed_scaling_factor),
            layout.num_routed_experts,
            offsets,
            replica_ids,
            routed_id_map,
            first_slot,
            slots,
            slot_weights,
            use_row,
            use_col,
            scalar,
            has_array,
            expert_map,
            weights_out,
            ids_out,
        ),
        launcher,
    )
    return weights, local_ids
