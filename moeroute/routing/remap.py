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

from collections import OrderedDict

import numpy as np
from numba import njit

from moeroute.layout import REPLICA_HASH_MULTIPLIER, ExpertLayout
from moeroute.routing import _launcher, _sort
from moeroute.routing._arrays import (
    as_caller,
    as_device_array,
    device_empty,
    host_array,
    is_device_array,
    resolve_stream,
)

try:
    from numba import cuda
except ImportError:  # pragma: no cover - CPU-only installs
    cuda = None

__all__ = ["logical_to_physical", "remap_to_local"]

#: The replica hash is taken modulo 2**32 on every backend (uint32 arithmetic in engines).
_HASH_MASK = 0xFFFFFFFF
#: Largest local id: the output is int32.
_LOCAL_ID_MAX = int(np.iinfo(np.int32).max)
#: Layouts whose id tables are kept on the device; a process rarely uses more than a few.
_DEVICE_TABLE_CACHE_SIZE = 32


def check_layout(layout) -> ExpertLayout:
    """TypeError unless ``layout`` is an ExpertLayout."""
    if not isinstance(layout, ExpertLayout):
        raise TypeError(
            f"layout must be a moeroute ExpertLayout, got {type(layout).__name__}"
        )
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


# ------------------------------------------------------------------ shared scalar rule


def _physical_id(logical, token_row, num_routed, replica_offsets, replica_ids, routed_id_map):
    """Physical id of logical id ``logical`` for token row ``token_row``; -1 outside [0, N).

    Compiled twice from this one definition: for the CPU kernels (njit) and as a CUDA
    device function.
    """
    if logical < 0 or logical >= num_routed:
        return -1
    first = replica_offsets[logical]
    count = replica_offsets[logical + 1] - first
    replica = replica_ids[first]
    if count > 1:
        hashed = (np.int64(token_row) * REPLICA_HASH_MULTIPLIER) & _HASH_MASK
        replica = replica_ids[first + hashed % count]
    return routed_id_map[replica]


physical_id_cpu = njit(cache=True, inline="always")(_physical_id)
physical_id_device = (None if cuda is None
                      else cuda.jit(device=True, inline="always")(_physical_id))


# --------------------------------------------------------------------------- CPU


@njit(cache=True)
def logical_to_physical_cpu(topk_ids, num_routed, replica_offsets, replica_ids,
                            routed_id_map, out):
    """Fill out[:, :K] with the physical ids of topk_ids [T, K]."""
    rows, cols = topk_ids.shape
    for t in range(rows):
        for k in range(cols):
            out[t, k] = physical_id_cpu(topk_ids[t, k], t, num_routed, replica_offsets,
                                        replica_ids, routed_id_map)


@njit(cache=True)
def _remap_cpu(ids, expert_map, out):
    size = expert_map.shape[0]
    for i in range(ids.shape[0]):
        physical = ids[i]
        out[i] = expert_map[physical] if physical >= 0 and physical < size else -1


# --------------------------------------------------------------------------- CUDA


def logical_to_physical_kernel(topk_ids, num_routed, replica_offsets, replica_ids,
                               routed_id_map, out):
    """One thread per (t, k)."""
    i = cuda.grid(1)
    cols = topk_ids.shape[1]
    if i < topk_ids.shape[0] * cols:
        t = i // cols
        k = i % cols
        out[t, k] = physical_id_device(topk_ids[t, k], t, num_routed, replica_offsets,
                                       replica_ids, routed_id_map)


def _remap_kernel(ids, expert_map, out):
    i = cuda.grid(1)
    if i < ids.shape[0]:
        physical = ids[i]
        local = -1
        if physical >= 0 and physical < expert_map.shape[0]:
            local = expert_map[physical]
        out[i] = local


_jitted: dict = {}


def _kernel(name: str):
    if name not in _jitted:
        _sort.check_cuda_available()
        function = {"l2p": logical_to_physical_kernel, "remap": _remap_kernel}[name]
        _jitted[name] = cuda.jit(function)
    return _jitted[name]


def _kept(cache: OrderedDict, key: tuple, upload):
    """``cache``'s entry for ``key`` on the current device, made by ``upload()`` on a miss;
    the least recently used of more than `_DEVICE_TABLE_CACHE_SIZE` entries is dropped."""
    key = (*key, getattr(cuda.get_current_device(), "id", 0))
    found = cache.get(key)
    if found is None:
        found = cache[key] = upload()
        if len(cache) > _DEVICE_TABLE_CACHE_SIZE:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return found


_device_tables: OrderedDict = OrderedDict()


def _replica_tables(layout: ExpertLayout, prefer_rank):
    """(replica_offsets, replica_ids) of ``layout``, or its `preferred_replicas` of a rank."""
    if prefer_rank is None:
        return layout.replica_offsets, layout.replica_ids
    return layout.preferred_replicas(prefer_rank)


def layout_device_tables(layout: ExpertLayout, prefer_rank=None):
    """(replica_offsets, replica_ids, routed_id_map) of ``layout`` on the current device.

    Uploaded once per layout, ``prefer_rank`` and device (a synchronous copy, so any stream
    may use them).
    """
    def upload():
        offsets, replica_ids = _replica_tables(layout, prefer_rank)
        return tuple(cuda.to_device(np.ascontiguousarray(a)) for a in (
            offsets, replica_ids, layout.routed_id_map))

    return _kept(_device_tables, (layout, prefer_rank), upload)


_device_maps: OrderedDict = OrderedDict()


def expert_map_device_table(expert_map: np.ndarray):
    """int32 device copy of the host ``expert_map``, uploaded once per content and device.

    Keyed by the map's bytes, so a map edited in place gets a new upload. The first call
    copies synchronously (before any capture: the warm-up call); later calls copy nothing.
    """
    table = np.ascontiguousarray(expert_map, dtype=np.int32)
    return _kept(_device_maps, (table.tobytes(),), lambda: cuda.to_device(table))


def launch_logical_to_physical(ids_view, layout, out_view, stream, prefer_rank=None) -> None:
    """Fill the first K columns of ``out_view`` from ``ids_view`` [T, K] on ``stream``."""
    numel = int(ids_view.shape[0]) * int(ids_view.shape[1])
    if numel == 0:
        return
    offsets, replica_ids, routed_id_map = layout_device_tables(layout, prefer_rank)
    blocks, threads = _sort.launch_config(numel)
    _launcher.launch(_kernel("l2p"), None, blocks, threads, stream,
                     (ids_view, layout.num_routed_experts, offsets, replica_ids, routed_id_map,
                      out_view))


# --------------------------------------------------------------------------- API


def logical_to_physical(topk_ids, layout, prefer_rank=None, *, stream=None):
    """Map logical routed ids to the layout's physical id space (SPEC sections 2 and 9).

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
    if is_device_array(topk_ids):
        ids = _sort.device_ids("topk_ids", topk_ids)
        _sort.check_index_limit("topk_ids.shape[0]", int(ids.shape[0]))
        launch_stream = resolve_stream(topk_ids, stream)
        out, out_view = device_empty(tuple(ids.shape), np.int32, topk_ids, launch_stream)
        launch_logical_to_physical(ids, layout, out_view, launch_stream, prefer_rank)
        return out
    ids = _sort.host_ids("topk_ids", host_array(topk_ids))
    _sort.check_index_limit("topk_ids.shape[0]", ids.shape[0])
    out = np.empty(ids.shape, np.int32)
    offsets, replica_ids = _replica_tables(layout, prefer_rank)
    logical_to_physical_cpu(ids, layout.num_routed_experts, offsets, replica_ids,
                            layout.routed_id_map, out)
    return as_caller(out, topk_ids)


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
    if is_device_array(ids):
        return _remap_device(ids, expert_map, stream)
    if is_device_array(expert_map):
        raise TypeError(
            "expert_map is a device array but ids are on the host; pass both on the "
            "device or both as NumPy arrays"
        )
    host = _sort.host_ids("ids", host_array(ids), ndim=None)
    table = host_array(expert_map)
    _check_expert_map_dtype(table.dtype, table.ndim)
    _check_host_expert_map(table)
    table = np.ascontiguousarray(table, dtype=np.int32)
    out = np.empty(host.shape, np.int32)
    _remap_cpu(host.reshape(-1), table, out.reshape(-1))
    return as_caller(out, ids)


def device_expert_map(expert_map):
    """``expert_map`` as an int32 numba device vector, checked: a device map must already be
    int32 (wider values could not be checked against int32 without a sync); a host map is
    checked on the host and uploaded once (`expert_map_device_table`)."""
    if is_device_array(expert_map):
        table = as_device_array(expert_map)
        _check_expert_map_dtype(table.dtype, table.ndim)
        if table.dtype != np.int32:
            raise TypeError(f"a device expert_map must be int32, got dtype {table.dtype}; "
                            "layout.expert_map(rank) is int32")
        return table
    host_table = np.asarray(expert_map)
    _check_expert_map_dtype(host_table.dtype, host_table.ndim)
    _check_host_expert_map(host_table)
    return expert_map_device_table(host_table)


def _remap_device(ids, expert_map, stream):
    view = _sort.device_ids("ids", ids, ndim=None)
    if not view.is_c_contiguous():
        raise ValueError("ids on the device must be C-contiguous")
    launch_stream = resolve_stream(ids, stream)
    table = device_expert_map(expert_map)
    shape = tuple(view.shape)
    out, out_view = device_empty(shape, np.int32, ids, launch_stream)
    size = int(np.prod(shape, dtype=np.int64))
    if size:
        blocks, threads = _sort.launch_config(size)
        _launcher.launch(_kernel("remap"), None, blocks, threads, launch_stream,
                         (view.reshape(size), table, out_view.reshape(size)))
    return out
