"""align_block_size: expert-sorted, block-padded flat indices for a grouped GEMM.

The CPU kernel is a sequential counting sort (`moeroute.routing._sort._host.align_cpu`); the
CUDA kernels are the deterministic chunked counting sort of `moeroute.routing._sort`.
Both give the same arrays, entry for entry (docs/semantics.md section 4 fixes one answer).

With an ``expert_map`` (vLLM's argument) each id is first ``expert_map[id]`` (-1 outside the
map) and -1 is dropped: the result of `remap_to_local` followed by `align_block_size`. On
the CPU the map is read inside the sort's two passes over the ids, on the GPU inside the
counting sort's two kernels: no [T, K] local-id array is written and no launch is added.
"""

from __future__ import annotations

import numpy as np

from moeroute._validate import integer
from moeroute.routing import _sort
from moeroute.routing._arrays import enter
from moeroute.routing.remap import _check_host_expert_map, device_expert_map

__all__ = ["align_block_size"]


def _host_expert_map(entry) -> np.ndarray:
    """``expert_map`` (its boundary ``entry``) as a C-contiguous int32 NumPy vector (its
    values are checked to fit); TypeError/ValueError otherwise."""
    table = np.asarray(entry.host())
    if table.dtype.kind not in "iu":
        raise TypeError(f"expert_map must hold integers, got dtype {table.dtype}")
    if table.ndim != 1:
        raise ValueError(f"expert_map must be 1-D [num_physical_experts], got shape {table.shape}")
    _check_host_expert_map(table)  # the values remap_to_local accepts: -1 or an int32 local id
    return np.ascontiguousarray(table, dtype=np.int32)


def _check_align_args(shape, num_experts, block_size) -> tuple[int, int, int, int]:
    """Validated (num_experts, block_size, numel, capacity) for ids of ``shape``."""
    num_experts = integer("num_experts", num_experts, 1)
    block_size = integer("block_size", block_size, 1)
    numel = int(shape[0]) * int(shape[1])
    capacity = _sort.padded_capacity(numel, num_experts, block_size)
    _sort.check_index_limit("numel + num_experts*(block_size-1)", capacity)
    return num_experts, block_size, numel, capacity


def align_block_size(topk_ids, num_experts, block_size, expert_map=None, *, stream=None):
    """Sort the flat (token, slot) entries by expert and pad each expert to ``block_size``.

    Flat index ``i = t*K + k``. With ``expert_map`` each id first becomes
    ``expert_map[id]`` (-1 for ids outside the map): the result equals
    ``align_block_size(remap_to_local(topk_ids, expert_map), num_experts, block_size)``.
    Entries whose (mapped) id is outside ``[0, num_experts)`` are dropped. Per expert, its flat indices in ascending order, padded to a multiple of
    ``block_size`` with the value ``numel = T*K``; experts with no entries get no block.

    Parameters
    ----------
    topk_ids : array [T, K], integer
        NumPy or CPU torch (any integer dtype) or a device array (int32 or int64; CuPy,
        torch CUDA, numba). T = 0 is allowed. The arrays come back in the framework and
        on the device of ``topk_ids``.
    num_experts : int
        Experts in the id space, >= 1 (e.g. 520 = 512 routed + 8 per-rank shared slots).
    block_size : int
        B, rows per GEMM block, >= 1.
    expert_map : array [num_physical_experts], integer, optional
        Physical id -> local id (-1: not held here), e.g. ``layout.expert_map(rank)``
        (vLLM's ``expert_map`` argument); ``num_experts`` is then the local expert count.
        NumPy/CPU torch for host ids; for device ids a device map, or a host map (uploaded
        once per content and device, as `remap_to_local` does).
    stream : numba stream or int handle, optional
        Device inputs only; default: the current stream of the input's framework.

    Returns
    -------
    sorted_token_ids : int32 [C], C = numel + num_experts*(B-1) rounded up to a multiple of B
        Each expert's flat indices, padded with ``numel``; the tail is ``numel``.
    expert_ids : int32 [C // B]
        Expert of each block, -1 after the last used block.
    num_tokens_post_padded : int (host) or int32 [1] device array (device, no sync)
        Sum over experts of ceil(count/B)*B.

    Raises
    ------
    TypeError
        ``topk_ids`` not integer (int32/int64 on the device); ``num_experts`` or
        ``block_size`` not an integer; a non-integer ``expert_map``, or a device map with
        host ids.
    ValueError
        ``topk_ids`` not 2-D; ``num_experts`` < 1; ``block_size`` < 1; C above the int32
        limit (2**31 - 1); ``expert_map`` not 1-D.

    Examples
    --------
    >>> s, e, n = align_block_size(np.array([[0, 1], [1, 2], [0, 2]]), 4, 2)
    >>> s.tolist(), e.tolist(), n
    ([0, 4, 1, 2, 3, 5, 6, 6, 6, 6], [0, 1, 2, -1, -1], 6)
    """
    entry = enter(topk_ids, "topk_ids")
    table = None if expert_map is None else enter(expert_map, "expert_map")
    if entry.on_device:
        return _align_device(entry, num_experts, block_size, table, stream)
    if table is not None and table.on_device:
        raise TypeError(
            "expert_map is a device array but topk_ids are on the host; pass both on the device or both as NumPy arrays"
        )
    view = _sort.host_id_view("topk_ids", entry)
    table = None if table is None else _host_expert_map(table)
    num_experts, block_size, numel, capacity = _check_align_args(
        view.shape, num_experts, block_size
    )  # before anything is copied
    ids = _sort.kernel_ids(view)
    sorted_token_ids = np.empty(capacity, np.int32)
    expert_ids = np.empty(capacity // block_size, np.int32)
    use_map = table is not None
    total = _sort.align_cpu(
        ids, num_experts, block_size, sorted_token_ids, expert_ids, table if use_map else _sort.NO_EXPERT_MAP, use_map
    )
    return entry.wrap(sorted_token_ids), entry.wrap(expert_ids), int(total)


def _align_device(entry, num_experts, block_size, expert_map, stream):
    """align_block_size on device ids, from the boundaries of ``topk_ids`` and
    ``expert_map`` (None when absent)."""
    ids = _sort.device_ids("topk_ids", entry)
    table = None if expert_map is None else device_expert_map(expert_map)
    num_experts, block_size, numel, capacity = _check_align_args(ids.shape, num_experts, block_size)
    launch_stream = entry.stream(stream)
    sorted_token_ids, sorted_view = entry.empty((capacity,), np.int32, launch_stream)
    expert_ids, expert_view = entry.empty((capacity // block_size,), np.int32, launch_stream)
    starts, starts_view = entry.empty((num_experts + 1,), np.int32, launch_stream)
    _sort.counting_sort_device(
        ids,
        num_experts,
        block_size,
        sorted_view,
        starts_view,
        expert_view,
        None,
        launch_stream,
        expert_map=table,
        template=entry,
    )
    return sorted_token_ids, expert_ids, starts[num_experts:]
