"""append_shared_slots: routed ids to the physical id space, plus the fused shared slots.

Column k < K of the output is the routed entry mapped by `logical_to_physical`; columns
K..K+S-1 are the shared slots of the token's home rank with the shared slot weight. The
shared slots exist only when the layout fuses the shared expert (``layout.shared ==
"fused"``); they never go through the replica map.
"""

from __future__ import annotations

import numbers

import numpy as np

from moeroute._validate import integer, weights_then_ids
from moeroute.routing import _launcher, _sort
from moeroute.routing._arrays import column_view, dtype_name, enter
from moeroute.routing.remap import check_layout, layout_device_tables
from moeroute.routing.shared_slots._cuda import _append_kernel, _kernel  # noqa: F401
from moeroute.routing.shared_slots._host import _append_cpu

__all__ = ["append_shared_slots"]


def _check_home_rank(layout, home_rank) -> int:
    home_rank = integer("home_rank", home_rank)
    if not 0 <= home_rank < layout.ep_size:
        raise ValueError(f"home_rank={home_rank} is outside [0, {layout.ep_size}) for ep_size={layout.ep_size}")
    return int(home_rank)


def _check_append_args(
    layout, home_rank, ids_shape, weights_shape, weights_dtype, shared_weights, shared_shape
) -> tuple[int, int]:
    """Validated (home_rank, S'); S' = number of appended slots.

    ``shared_shape`` is None for a scalar (or absent) shared weight.
    """
    check_layout(layout)
    home_rank = _check_home_rank(layout, home_rank)
    if tuple(weights_shape) != tuple(ids_shape):
        raise ValueError(
            f"topk_weights has shape {tuple(weights_shape)} but topk_ids has shape {tuple(ids_shape)}; they must match"
        )
    if np.dtype(weights_dtype).kind != "f":
        raise TypeError(f"topk_weights must be floating point, got dtype {weights_dtype}")
    _sort.check_index_limit("topk_ids.shape[0]", int(ids_shape[0]))
    slots = layout.num_shared_experts if layout.shared == "fused" else 0
    if slots == 0:
        return home_rank, 0
    if shared_weights is None and layout.scaling_regime == "output":
        raise ValueError(
            "shared_weights=None with scaling_regime='output': the combined sum is "
            "multiplied by routed_scaling_factor afterwards, so a shared slot weight of 1.0 "
            "would scale the shared expert by rsf. Pass "
            "shared_weights=layout.shared_slot_weight(gate, routed_scaling_factor)"
        )
    if shared_shape is not None:
        tokens = int(ids_shape[0])
        allowed = [(), (tokens,), (tokens, 1), (tokens, slots)]
        if tuple(shared_shape) not in allowed:
            raise ValueError(
                f"shared_weights has shape {tuple(shared_shape)}; use a scalar, [T]={tokens}, "
                f"[T, 1] or [T, S]=[{tokens}, {slots}]"
            )
    return home_rank, slots


def _slot_weight_strides(shape) -> tuple[int, int]:
    """(row, column) multipliers reading a [T], [T, 1] or [T, S] weight as 2-D."""
    if len(shape) == 0:
        return 0, 0
    if len(shape) == 1 or shape[1] == 1:
        return 1, 0
    return 1, 1


# --------------------------------------------------------------------------- API


def append_shared_slots(topk_weights, topk_ids, layout, home_rank=0, shared_weights=None, *, stream=None):
    """Weights and physical ids with the fused shared slots appended (docs/semantics.md sections 2, 4).

    The pair comes weights first, as ``select_experts`` and ``route`` return it (and as vLLM
    passes it); before 0.2 this function took and returned ids first.

    Parameters
    ----------
    topk_weights : array [T, K], float
        float32 on the device; host floats are converted to float32.
    topk_ids : array [T, K], integer
        Logical routed ids (``select_experts`` output); ids outside [0, N) become -1.
        NumPy or CPU torch (any integer dtype) or device (int32/int64). Results come back
        in the framework and on the device of ``topk_ids``.
    layout : moeroute.layout.ExpertLayout
        Decides the routed id map and whether (and where) shared slots are appended.
    home_rank : int
        Rank the tokens come from, in [0, layout.ep_size): selects the per-rank shared
        slots ``b_h + L_h + j``; global slots are ``P + j`` for every rank.
    shared_weights : None, scalar, or array [T], [T, 1] or [T, S] (float32 on the device)
        The shared slot weight, ``layout.shared_slot_weight(gate, routed_scaling_factor)``.
        None means 1.0, which is only right in the "router" scaling regime. Ignored when
        no slots are appended.
    stream : optional
        Device inputs only; default: the current stream of the input's framework.

    Returns
    -------
    weights : float32 [T, K + S']
    ids : int32 [T, K + S']
        S' = layout.num_shared_experts when ``layout.shared == "fused"``, else 0.

    Raises
    ------
    TypeError
        ``layout`` not an ExpertLayout; ``home_rank`` not an integer; non-integer ids;
        non-float weights (not float32 on the device), which is also what ids passed first
        (the order before 0.2) raise; a host ``shared_weights`` array with device ids.
    ValueError
        ``home_rank`` outside [0, ep_size); ids not 2-D; weights of another shape;
        ``shared_weights`` of another shape; ``shared_weights`` None while the layout
        fuses the shared expert under scaling_regime "output" (the slot weight must be
        ``layout.shared_slot_weight(gate, rsf)``, i.e. 1/rsf without a gate).

    Examples
    --------
    N=8, S=1, E=2 (all2all): a token from rank 1 routed to logical 4 and 7 gets physical
    ids 5 and 8 and shared id 9.
    """
    weights_then_ids(topk_weights, topk_ids)
    entry = enter(topk_ids, "topk_ids")
    weights = enter(topk_weights, "topk_weights")
    shared = None if shared_weights is None else enter(shared_weights, "shared_weights")
    if entry.on_device:
        return _append_device(weights, entry, layout, home_rank, shared, stream)
    ids = _sort.host_ids("topk_ids", entry)
    out_weights, out_ids = _append_host(
        weights.host_floats(), ids, layout, home_rank, shared_weights, None if shared is None else shared.host_floats()
    )
    return entry.wrap(out_weights), entry.wrap(out_ids)


def _append_host(weights, ids, layout, home_rank, shared_weights, shared):
    """`append_shared_slots` on float ``weights`` and NumPy ``ids`` (int32/int64);
    ``shared``: the NumPy view of ``shared_weights`` (None when absent). NumPy results
    (weights, ids)."""
    if shared is not None and shared.dtype.kind not in "fiu":
        raise TypeError(f"shared_weights must be real numbers, got dtype {shared.dtype}")
    home_rank, slots = _check_append_args(
        layout,
        home_rank,
        ids.shape,
        weights.shape,
        weights.dtype,
        shared_weights,
        None if shared is None else shared.shape,
    )
    weights = np.ascontiguousarray(weights, dtype=np.float32)
    first_slot = int(layout.shared_slot_ids(home_rank)[0]) if slots else 0
    if shared is None or shared.ndim == 0:
        scalar = np.float32(1.0 if shared is None else shared)
        slot_weights, use_row, use_col, has_array = weights, 0, 0, False
    else:
        scalar = np.float32(0.0)
        use_row, use_col = _slot_weight_strides(shared.shape)
        columns = shared.shape[1] if shared.ndim == 2 else 1
        slot_weights = np.ascontiguousarray(shared.reshape(shared.shape[0], columns), np.float32)
        has_array = True
    rows, top_k = ids.shape
    out_ids = np.empty((rows, top_k + slots), np.int32)
    out_weights = np.empty((rows, top_k + slots), np.float32)
    _append_cpu(
        ids,
        weights,
        layout.num_routed_experts,
        layout.replica_offsets,
        layout.replica_ids,
        layout.routed_id_map,
        first_slot,
        slot_weights,
        use_row,
        use_col,
        scalar,
        has_array,
        out_ids,
        out_weights,
    )
    return out_weights, out_ids


def device_shared_weights(entry, launcher: str, beside: str):
    """(kernel array or None, scalar weight) of ``shared_weights`` for a device launch,
    from its boundary ``entry`` (None when absent).

    A device array is viewed as the kernels take it under ``launcher`` and must be float32
    (the scalar is then unused); None means 1.0; a Python or NumPy scalar is the scalar.
    TypeError for a host array (``beside`` names the device input it should sit beside) or
    another type.
    """
    if entry is None:
        return None, np.float32(1.0)
    shared_weights = entry.array
    if entry.on_device:
        shared = entry.kernel(launcher)
        dtype = dtype_name(shared.dtype)
        if dtype != "float32":
            raise TypeError(f"shared_weights on the device must be float32, got dtype {dtype}")
        return shared, np.float32(0.0)
    if isinstance(shared_weights, np.ndarray) and shared_weights.ndim > 0:
        raise TypeError(
            f"shared_weights is a host array but {beside} is on the device; pass "
            f"it on the same device (or a Python scalar)"
        )
    if not isinstance(shared_weights, (numbers.Real, np.ndarray, np.generic)) or isinstance(shared_weights, bool):
        raise TypeError(f"shared_weights must be None, a real scalar or an array, got {type(shared_weights).__name__}")
    return None, np.float32(float(shared_weights))


def device_slot_weights(shared, unused):
    """(slot_weights 2-D, use_row, use_col, has_array) the append and route kernels read:
    ``shared`` [T], [T, 1], [T, S] or 0-d as a 2-D view (`column_view`: no copy, strided
    vectors included), or, without one, ``unused`` (any float32 2-D array: never read)."""
    if shared is None:
        return unused, 0, 0, False
    use_row, use_col = _slot_weight_strides(tuple(shared.shape))
    if shared.ndim != 2:
        shared = column_view(shared)
    return shared, use_row, use_col, True


def _append_device(weights_entry, entry, layout, home_rank, shared_entry, stream):
    """`append_shared_slots` on device ids, from the boundaries of its arrays
    (``shared_entry``: None when ``shared_weights`` is absent); (weights, ids)."""
    ids = _sort.device_ids("topk_ids", entry)
    if not weights_entry.on_device:
        raise TypeError("topk_weights must be a device array when topk_ids is one")
    weights = weights_entry.kernel()
    if weights.dtype != np.float32:
        raise TypeError(f"topk_weights on the device must be float32, got dtype {weights.dtype}")
    shared, scalar = device_shared_weights(shared_entry, "numba", "topk_ids")
    shared_weights = None if shared_entry is None else shared_entry.array
    home_rank, slots = _check_append_args(
        layout,
        home_rank,
        ids.shape,
        weights.shape,
        weights.dtype,
        shared_weights,
        None if shared is None else tuple(shared.shape),
    )
    launch_stream = entry.stream(stream)
    first_slot = int(layout.shared_slot_ids(home_rank)[0]) if slots else 0
    slot_weights, use_row, use_col, has_array = device_slot_weights(shared, weights)
    rows, top_k = (int(n) for n in ids.shape)
    out_ids, ids_view = entry.empty((rows, top_k + slots), np.int32)
    out_weights, weights_view = entry.empty((rows, top_k + slots), np.float32)
    numel = rows * (top_k + slots)
    if numel:
        offsets, replica_ids, routed_id_map = layout_device_tables(layout)
        blocks, threads = _sort.launch_config(numel)
        _launcher.launch(
            _kernel(),
            None,
            blocks,
            threads,
            launch_stream,
            (
                ids,
                weights,
                layout.num_routed_experts,
                offsets,
                replica_ids,
                routed_id_map,
                first_slot,
                slot_weights,
                use_row,
                use_col,
                scalar,
                has_array,
                ids_view,
                weights_view,
            ),
        )
    return out_weights, out_ids
