"""logical_to_physical and remap_to_local on a CUDA device: one thread per entry; the
layout's tables and the host expert maps uploaded once per device and kept (LRU)."""

from collections import OrderedDict

import numpy as np

from moeroute.layout import ExpertLayout
from moeroute.routing import _launcher, _sort
from moeroute.routing.remap._common import _physical_id, _replica_tables

try:
    from numba import cuda
except ImportError:  # pragma: no cover - CPU-only installs
    cuda = None

#: Layouts whose id tables are kept on the device; a process rarely uses more than a few.
_DEVICE_TABLE_CACHE_SIZE = 32

physical_id_device = None if cuda is None else cuda.jit(device=True, inline="always")(_physical_id)


def logical_to_physical_kernel(topk_ids, num_routed, replica_offsets, replica_ids, routed_id_map, out):
    """One thread per (t, k)."""
    i = cuda.grid(1)
    cols = topk_ids.shape[1]
    if i < topk_ids.shape[0] * cols:
        t = i // cols
        k = i % cols
        out[t, k] = physical_id_device(topk_ids[t, k], t, num_routed, replica_offsets, replica_ids, routed_id_map)


def _remap_kernel(ids, expert_map, out):
    i = cuda.grid(1)
    if i < ids.shape[0]:
        physical = ids[i]
        local = -1
        if physical >= 0 and physical < expert_map.shape[0]:
            local = expert_map[physical]
        out[i] = local


def _kernel(name: str):
    return _sort.jit_kernel({"l2p": logical_to_physical_kernel, "remap": _remap_kernel}[name])


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


def layout_device_tables(layout: ExpertLayout, prefer_rank=None):
    """(replica_offsets, replica_ids, routed_id_map) of ``layout`` on the current device.

    Uploaded once per layout, ``prefer_rank`` and device (a synchronous copy, so any stream
    may use them).
    """

    def upload():
        offsets, replica_ids = _replica_tables(layout, prefer_rank)
        return tuple(cuda.to_device(np.ascontiguousarray(a)) for a in (offsets, replica_ids, layout.routed_id_map))

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
    _launcher.launch(
        _kernel("l2p"),
        None,
        blocks,
        threads,
        stream,
        (ids_view, layout.num_routed_experts, offsets, replica_ids, routed_id_map, out_view),
    )
