"""align_block_size: expert-sorted, block-padded flat indices for a grouped GEMM.

The CPU kernel is a sequential counting sort (`moeroute.routing._sort.align_cpu`); the
CUDA kernels are the deterministic chunked counting sort of `moeroute.routing._sort`.
Both give the same arrays, entry for entry (SPEC section 4 fixes one answer).
"""

from __future__ import annotations

import numpy as np

from numba import int32, njit

from moeroute.routing import _sort
from moeroute.routing._arrays import as_device_array, device_empty, is_device_array, resolve_stream

try:
    from numba import cuda
except ImportError:  # pragma: no cover - CPU-only installs
    cuda = None

__all__ = ["align_block_size"]


# ------------------------------------------------------------- with an expert map
#
# align_block_size(..., expert_map=m) sorts by m[id] instead of id, -1 and ids outside the
# map dropped: remap_to_local followed by align_block_size, without the [T, K] local-id
# array in between. The kernels are the counting sort of `_sort` with the map lookup in the
# two passes that read ids (count and place); scan and pad are shared as they are.


# The place kernel's shared tile needs a compile-time size: a module global, not an attribute.
_SORT_TILE = _sort.SORT_TILE


@njit(cache=True)
def _mapped(expert_map, value):
    """``expert_map[value]``, -1 outside the map."""
    if value < 0 or value >= expert_map.shape[0]:
        return -1
    return expert_map[value]


@njit(cache=True)
def _align_mapped_cpu(topk_ids, expert_map, num_experts, block_size, sorted_token_ids,
                      expert_ids):
    """`_sort.align_cpu` on ``expert_map[topk_ids]``; returns num_tokens_post_padded."""
    rows, cols = topk_ids.shape
    numel = rows * cols
    counts = np.zeros(num_experts, np.int64)
    for t in range(rows):
        for k in range(cols):
            e = _mapped(expert_map, topk_ids[t, k])
            if e >= 0 and e < num_experts:
                counts[e] += 1
    cursor = np.empty(num_experts, np.int64)
    position = 0
    for e in range(num_experts):
        cursor[e] = position
        padded = (counts[e] + block_size - 1) // block_size * block_size
        for b in range(position // block_size, (position + padded) // block_size):
            expert_ids[b] = e
        position += padded
    for b in range(position // block_size, expert_ids.shape[0]):
        expert_ids[b] = -1
    sorted_token_ids[:] = numel
    for t in range(rows):
        for k in range(cols):
            e = _mapped(expert_map, topk_ids[t, k])
            if e >= 0 and e < num_experts:
                sorted_token_ids[cursor[e]] = t * cols + k
                cursor[e] += 1
    return position


def _mapped_count_kernel(topk_ids, expert_map, num_experts, chunk_size, chunk_counts):
    """`_sort._count_kernel` on ``expert_map[topk_ids]``."""
    chunk = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    cols = topk_ids.shape[1]
    numel = topk_ids.shape[0] * cols
    for e in range(tid, num_experts, nthreads):
        chunk_counts[chunk, e] = 0
    cuda.syncthreads()
    begin = chunk * chunk_size
    end = min(begin + chunk_size, numel)
    for i in range(begin + tid, end, nthreads):
        value = topk_ids[i // cols, i % cols]
        e = -1
        if value >= 0 and value < expert_map.shape[0]:
            e = expert_map[value]
        if e >= 0 and e < num_experts:
            cuda.atomic.add(chunk_counts, (chunk, int32(e)), 1)


def _mapped_place_kernel(topk_ids, expert_map, num_experts, chunk_size, chunk_counts,
                         expert_starts, sorted_out):
    """`_sort._place_kernel` (no inverse index) on ``expert_map[topk_ids]``."""
    tile = cuda.shared.array(_SORT_TILE, int32)
    chunk = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    cols = topk_ids.shape[1]
    numel = topk_ids.shape[0] * cols
    begin = chunk * chunk_size
    end = min(begin + chunk_size, numel)
    for tile_begin in range(begin, end, nthreads):  # same trip count for every thread
        i = tile_begin + tid
        e = int32(-1)
        if i < end:
            value = topk_ids[i // cols, i % cols]
            if value >= 0 and value < expert_map.shape[0]:
                local = expert_map[value]
                if local >= 0 and local < num_experts:
                    e = int32(local)
        tile[tid] = e
        cuda.syncthreads()
        if e >= 0:
            rank = 0
            for j in range(tid):
                if tile[j] == e:
                    rank += 1
            sorted_out[expert_starts[e] + chunk_counts[chunk, e] + rank] = i
        cuda.syncthreads()  # every thread has read its cursor before any update
        if e >= 0:
            cuda.atomic.add(chunk_counts, (chunk, e), 1)
        cuda.syncthreads()


_MAPPED_KERNEL_FUNCTIONS = {"count": _mapped_count_kernel, "place": _mapped_place_kernel}
_mapped_kernels: dict = {}


def _mapped_kernel(name: str):
    if name not in _mapped_kernels:
        _sort.check_cuda_available()
        _mapped_kernels[name] = cuda.jit(_MAPPED_KERNEL_FUNCTIONS[name])
    return _mapped_kernels[name]


def mapped_counting_sort_device(topk_ids, expert_map, num_experts, block_size, sorted_out,
                                expert_starts, expert_ids, stream, *,
                                chunk_size=_sort.SORT_CHUNK, threads_per_block=_sort.SORT_TILE):
    """`_sort.counting_sort_device` (no inverse index) over ``expert_map[topk_ids]``.

    ``expert_map`` is a numba device array of int32/int64 local ids (-1: not held); the
    other arguments are those of `_sort.counting_sort_device`.
    """
    if not 1 <= threads_per_block <= _sort.SORT_TILE or chunk_size < 1:
        raise ValueError(f"threads_per_block={threads_per_block} must be in [1, {_sort.SORT_TILE}] "
                         f"and chunk_size={chunk_size} >= 1")
    rows, cols = topk_ids.shape
    numel = rows * cols
    num_chunks = max(1, -(-numel // chunk_size))
    chunk_counts = cuda.device_array((num_chunks, num_experts), np.int32, stream=stream)
    expert_counts = cuda.device_array(num_experts, np.int32, stream=stream)
    sort_threads = min(threads_per_block,
                       _power_of_two_at_least(max(min(chunk_size, numel), 1)))
    scan_threads = min(threads_per_block, _power_of_two_at_least(num_experts))
    _mapped_kernel("count")[num_chunks, sort_threads, stream](
        topk_ids, expert_map, num_experts, chunk_size, chunk_counts)
    _sort.kernel("scan")[1, scan_threads, stream](chunk_counts, num_experts, block_size,
                                                  expert_counts, expert_starts)
    if numel:
        _mapped_kernel("place")[num_chunks, sort_threads, stream](
            topk_ids, expert_map, num_experts, chunk_size, chunk_counts, expert_starts,
            sorted_out)
    capacity = sorted_out.shape[0]
    if capacity:
        blocks, threads = _sort.launch_config(capacity)
        _sort.kernel("pad")[blocks, threads, stream](expert_counts, expert_starts, num_experts,
                                                     block_size, numel, sorted_out, expert_ids)


def _power_of_two_at_least(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())


def _host_expert_map(expert_map) -> np.ndarray:
    """``expert_map`` as a C-contiguous int64 NumPy vector; TypeError/ValueError otherwise."""
    table = np.asarray(expert_map)
    if table.dtype.kind not in "iu":
        raise TypeError(f"expert_map must hold integers, got dtype {table.dtype}")
    if table.ndim != 1:
        raise ValueError(f"expert_map must be 1-D [num_physical_experts], got shape {table.shape}")
    return np.ascontiguousarray(table, dtype=np.int64)


def _check_align_args(shape, num_experts, block_size) -> tuple[int, int, int, int]:
    """Validated (num_experts, block_size, numel, capacity) for ids of ``shape``."""
    num_experts = _sort.check_count("num_experts", num_experts, 1)
    block_size = _sort.check_count("block_size", block_size, 1)
    numel = int(shape[0]) * int(shape[1])
    capacity = _sort.padded_capacity(numel, num_experts, block_size)
    _sort.check_index_limit("numel + num_experts*(block_size-1)", capacity)
    return num_experts, block_size, numel, capacity


def align_block_size(topk_ids, num_experts, block_size, expert_map=None, *, stream=None):
    """Sort the flat (token, slot) entries by expert and pad each expert to ``block_size``.

    Flat index ``i = t*K + k``. With ``expert_map`` each id first becomes
    ``expert_map[id]`` (-1 for ids outside the map): the result equals
    ``align_block_size(remap_to_local(topk_ids, expert_map), num_experts, block_size)``,
    computed in one pass over the ids. Entries whose (mapped) id is outside
    ``[0, num_experts)`` are dropped. Per expert, its flat indices in ascending order, padded to a multiple of
    ``block_size`` with the value ``numel = T*K``; experts with no entries get no block.

    Parameters
    ----------
    topk_ids : array [T, K], integer
        NumPy (any integer dtype) or a device array (int32 or int64; CuPy, torch CUDA,
        numba). T = 0 is allowed.
    num_experts : int
        Experts in the id space, >= 1 (e.g. 520 = 512 routed + 8 per-rank shared slots).
    block_size : int
        B, rows per GEMM block, >= 1.
    expert_map : array [num_physical_experts], integer, optional
        Physical id -> local id (-1: not held here), e.g. ``layout.expert_map(rank)``
        (vLLM's ``expert_map`` argument); ``num_experts`` is then the local expert count.
        On the side of ``topk_ids``; a NumPy map with device ids is copied to the device
        on every call (pass a device map to avoid that).
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
    if is_device_array(topk_ids):
        return _align_device(topk_ids, num_experts, block_size, expert_map, stream)
    if expert_map is not None and is_device_array(expert_map):
        raise TypeError("expert_map is a device array but topk_ids are on the host; pass "
                        "both on the device or both as NumPy arrays")
    ids = _sort.host_ids("topk_ids", topk_ids)
    table = None if expert_map is None else _host_expert_map(expert_map)
    num_experts, block_size, numel, capacity = _check_align_args(
        ids.shape, num_experts, block_size)
    sorted_token_ids = np.empty(capacity, np.int32)
    expert_ids = np.empty(capacity // block_size, np.int32)
    if table is None:
        total = _sort.align_cpu(ids, num_experts, block_size, sorted_token_ids, expert_ids)
    else:
        total = _align_mapped_cpu(ids, table, num_experts, block_size, sorted_token_ids,
                                  expert_ids)
    return sorted_token_ids, expert_ids, int(total)


def _device_expert_map(expert_map, stream):
    """A numba device view of ``expert_map`` (uploaded when it is a NumPy array)."""
    if is_device_array(expert_map):
        table = as_device_array(expert_map)
        if np.dtype(table.dtype).kind not in "iu":
            raise TypeError(f"expert_map must hold integers, got dtype {table.dtype}")
        if table.ndim != 1:
            raise ValueError(f"expert_map must be 1-D [num_physical_experts], got shape "
                             f"{tuple(table.shape)}")
        return table
    return cuda.to_device(_host_expert_map(expert_map).astype(np.int32), stream=stream)


def _align_device(topk_ids, num_experts, block_size, expert_map, stream):
    ids = _sort.device_ids("topk_ids", topk_ids)
    num_experts, block_size, numel, capacity = _check_align_args(
        ids.shape, num_experts, block_size)
    launch_stream = resolve_stream(topk_ids, stream)
    sorted_token_ids, sorted_view = device_empty((capacity,), np.int32, topk_ids)
    expert_ids, expert_view = device_empty((capacity // block_size,), np.int32, topk_ids)
    starts, starts_view = device_empty((num_experts + 1,), np.int32, topk_ids)
    if expert_map is None:
        _sort.counting_sort_device(ids, num_experts, block_size, sorted_view, starts_view,
                                   expert_view, None, launch_stream)
    else:
        table = _device_expert_map(expert_map, launch_stream)
        mapped_counting_sort_device(ids, table, num_experts, block_size, sorted_view,
                                    starts_view, expert_view, launch_stream)
    return sorted_token_ids, expert_ids, starts[num_experts:]
