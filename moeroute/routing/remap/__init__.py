"""Id-space maps: logical -> physical (EPLB replicas, per-rank shared-slot shift) and
physical -> local (one rank's view).

logical_to_physical
    Token row t's logical id l goes to replica
    ``replica_ids[offsets[l] + ((t * 2654435769) mod 2**32) % count(l)]`` and then through
    ``layout.routed_id_map`` (identity, or ``p + owner(p) * S`` with per-rank shared slots).
remap_to_local
    ``expert_map[id]``, -1 when the rank does not hold the expert or the id is out of range.
"""

from __future__ import annotations

import numpy as np

from moeroute.layout import ExpertLayout
from moeroute.routing import _launcher, _sort
from moeroute.routing._arrays import Boundary, enter
from moeroute.routing.remap._common import _physical_id, _replica_tables  # noqa: F401
from moeroute.routing.remap._cuda import (  # noqa: F401  (the device ops import these)
    _DEVICE_TABLE_CACHE_SIZE,
    _device_maps,
    _device_tables,
    _kernel,
    expert_map_device_table,
    launch_logical_to_physical,
    layout_device_tables,
    logical_to_physical_kernel,
    physical_id_device,
)
from moeroute.routing.remap._host import (  # noqa: F401
    _remap_cpu,
    logical_to_physical_cpu,
    physical_id_cpu,
)

__all__ = ["logical_to_physical", "remap_to_local"]

#: Largest local id: the output is int32.
_LOCAL_ID_MAX = int(np.iinfo(np.int32).max)


def check_layout(layout) -> ExpertLayout:
    """TypeError unless ``layout`` is an ExpertLayout."""
    if not isinstance(layout, ExpertLayout):
        raise TypeError(f"layout must be a moeroute ExpertLayout, got {type(layout).__name__}")
    return layout


def _check_expert_map_dtype(dtype, ndim) -> None:
    if np.dtype(dtype).kind not in "iu":
        raise TypeError(f"expert_map must hold integers, got dtype {dtype}")
    if ndim != 1:
        raise ValueError(f"expert_map must be 1-D [num_physical_experts], got {ndim}-D")


def _check_host_expert_map(table: np.ndarray) -> None:
    """ValueError unless every entry is -1 or a local id that fits the int32 output."""
    if table.size == 0 or table.dtype == np.int32 and int(table.min()) >= -1:
        return
    low, high = int(table.min()), int(table.max())
    if low < -1 or high > _LOCAL_ID_MAX:
        raise ValueError(
            f"expert_map values must be -1 (not held) or local ids in [0, {_LOCAL_ID_MAX}] "
            f"(int32), got values in [{low}, {high}]"
        )


# --------------------------------------------------------------------------- API


def logical_to_physical(topk_ids, layout, prefer_rank=None, *, stream=None):
    """Map logical routed ids to the layout's physical id space (docs/semantics.md sections 2 and 9).

    Redundant experts (EPLB): logical l of token row t uses replica
    ``replicas[((t * 2654435769) mod 2**32) % count]`` of ``layout.replica_ids``; then
    ``layout.routed_id_map`` shifts it into its owner's block (per-rank shared slots).
    With ``prefer_rank`` the replicas are those ``prefer_rank`` holds when it holds any
    (SGLang's static dispatch: traffic stays on the rank), else all of them
    (`ExpertLayout.preferred_replicas`). Shared slots never go through this map (see
    `append_shared_slots`).

    Parameters
    ----------
    topk_ids : array [T, K], integer
        Logical ids; NumPy or CPU torch (any integer dtype) or device (int32/int64).
        The result is in the framework and on the device of ``topk_ids``.
    layout : moeroute.layout.ExpertLayout
    prefer_rank : int, optional
        A rank in [0, E) whose replicas are preferred.
    stream : optional
        Device inputs only; default: the current stream of the input's framework.

    Returns
    -------
    physical_ids : int32 [T, K]
        -1 where the logical id is outside [0, N).

    Raises
    ------
    TypeError
        ``layout`` not an ExpertLayout; non-integer ``topk_ids``.
    ValueError
        ``topk_ids`` not 2-D, or with more than 2**31 - 1 rows; ``prefer_rank`` not an
        integer in [0, E).
    """
    check_layout(layout)
    if prefer_rank is not None:
        # Validates it (ValueError naming prefer_rank) before anything launches.
        layout.preferred_replicas(prefer_rank)
        prefer_rank = int(prefer_rank)
    entry = enter(topk_ids, "topk_ids")
    if entry.on_device:
        ids = _sort.device_ids("topk_ids", entry)
        _sort.check_index_limit("topk_ids.shape[0]", int(ids.shape[0]))
        launch_stream = entry.stream(stream)
        out, out_view = entry.empty(tuple(ids.shape), np.int32, launch_stream)
        launch_logical_to_physical(ids, layout, out_view, launch_stream, prefer_rank)
        return out
    view = _sort.host_id_view("topk_ids", entry)
    _sort.check_index_limit("topk_ids.shape[0]", view.shape[0])  # before anything is copied
    ids = _sort.kernel_ids(view)
    out = np.empty(ids.shape, np.int32)
    offsets, replica_ids = _replica_tables(layout, prefer_rank)
    logical_to_physical_cpu(ids, layout.num_routed_experts, offsets, replica_ids, layout.routed_id_map, out)
    return entry.wrap(out)


def remap_to_local(ids, expert_map, *, stream=None):
    """Physical -> local ids for one rank: ``expert_map[id]``, -1 when not held.

    Parameters
    ----------
    ids : array, any shape, integer
        Physical ids (NumPy or CPU torch, any integer dtype; device int32/int64,
        C-contiguous). The result is in the framework and on the device of ``ids``.
    expert_map : int [num_physical_experts]
        ``layout.expert_map(rank)``: local id or -1, each fitting int32 (a NumPy map of a
        wider dtype is checked; a device map must be int32). A NumPy map with device
        ``ids`` is uploaded once per distinct content and device and kept (as the layout
        tables are), so later calls copy nothing and can be captured in a CUDA graph.
    stream : optional
        Device inputs only.

    Returns
    -------
    local_ids : int32, shape of ``ids``
        -1 where ``expert_map`` says -1 and for ids outside [0, len(expert_map)).

    Raises
    ------
    TypeError
        Non-integer ``ids`` or ``expert_map``; a device ``expert_map`` with host ``ids``
        or of a dtype other than int32.
    ValueError
        ``expert_map`` not 1-D or holding values outside [-1, 2**31 - 1] (they would wrap
        to a held expert's id); device ``ids`` not C-contiguous.
    """
    entry = enter(ids, "ids")
    table = enter(expert_map, "expert_map")
    if entry.on_device:
        return _remap_device(entry, table, stream)
    if table.on_device:
        raise TypeError(
            "expert_map is a device array but ids are on the host; pass both on the device or both as NumPy arrays"
        )
    return entry.wrap(_remap_host(_sort.host_ids("ids", entry, ndim=None), table.host()))


def _remap_host(ids: np.ndarray, expert_map: np.ndarray) -> np.ndarray:
    """`remap_to_local` of NumPy ``ids`` (int32/int64) through a NumPy ``expert_map``
    (checked here): a NumPy int32 array of the shape of ``ids``."""
    _check_expert_map_dtype(expert_map.dtype, expert_map.ndim)
    _check_host_expert_map(expert_map)
    table = np.ascontiguousarray(expert_map, dtype=np.int32)
    out = np.empty(ids.shape, np.int32)
    _remap_cpu(ids.reshape(-1), table, out.reshape(-1))
    return out


def device_expert_map(expert_map):
    """``expert_map`` as an int32 numba device vector, checked: a device map must already be
    int32 (wider values could not be checked against int32 without a sync); a host map is
    checked on the host and uploaded once (`expert_map_device_table`). ``expert_map`` may be
    given as its `Boundary`."""
    entry = expert_map if isinstance(expert_map, Boundary) else enter(expert_map, "expert_map")
    if entry.on_device:
        table = entry.kernel()
        _check_expert_map_dtype(table.dtype, table.ndim)
        if table.dtype != np.int32:
            raise TypeError(
                f"a device expert_map must be int32, got dtype {table.dtype}; layout.expert_map(rank) is int32"
            )
        return table
    host_table = np.asarray(entry.array)
    _check_expert_map_dtype(host_table.dtype, host_table.ndim)
    _check_host_expert_map(host_table)
    return expert_map_device_table(host_table)


def _remap_device(entry, expert_map, stream):
    """`remap_to_local` of device ids, from the boundaries of ``ids`` and ``expert_map``."""
    view = _sort.device_ids("ids", entry, ndim=None)
    if not view.is_c_contiguous():
        raise ValueError("ids on the device must be C-contiguous")
    launch_stream = entry.stream(stream)
    table = device_expert_map(expert_map)
    shape = tuple(view.shape)
    out, out_view = entry.empty(shape, np.int32, launch_stream)
    size = int(np.prod(shape, dtype=np.int64))
    if size:
        blocks, threads = _sort.launch_config(size)
        _launcher.launch(
            _kernel("remap"), None, blocks, threads, launch_stream, (view.reshape(size), table, out_view.reshape(size))
        )
    return out
