"""Stable counting sort of (token, slot) entries by expert, shared by align and permute.

Both `align_block_size` and `sort_by_expert` order the flat entries ``i = t*K + k`` of a
``[T, K]`` id array by expert id, ascending flat index within an expert, dropping ids
outside ``[0, num_experts)``. `align_block_size` additionally pads every expert's run to a
multiple of the block size; `sort_by_expert` is the same sort with block size 1 plus the
inverse index. A stable sort has exactly one answer, so the CPU and the GPU agree entry
for entry.

CPU: one sequential pass to count, a scan, one pass to place (Numba ``njit``).

GPU (``numba.cuda``), deterministic by construction (no atomics decide an order):

1. ``count``: block c counts the ids of chunk c (``chunk_size`` flat entries) per expert
   into ``chunk_counts[c, e]`` (integer atomics: a sum, whatever the order).
2. ``place``, one launch, block b working alone on row b of its scratch: per expert, the
   counts of the chunks before chunk b and of all chunks; the exclusive scan of the padded
   totals over experts (a block-wide Hillis-Steele scan): ``expert_starts[e]``,
   ``expert_starts[E]`` the padded total (written by block 0). Then block b walks chunk b in
   tiles of ``blockDim`` entries: an entry's rank among the earlier entries of the tile
   with the same expert, plus the chunk's running count, plus its prefix, plus the expert
   start is its output position. Then the grid strides over the output positions: the
   padding value past each expert's entries, the expert id of every block (disjoint from
   the placed positions, so no barrier separates the two).

Two launches, no host read-back: every size is an upper bound known on the host.
"""

from __future__ import annotations

import numpy as np
from numba import int32, int64, njit

try:  # numba.cuda comes with the optional numba-cuda package
    from numba import cuda
except ImportError:  # pragma: no cover - CPU-only installs
    cuda = None

from moeroute.routing import _launcher
from moeroute.routing._arrays import as_device_array, device_empty

#: Threads per block of the elementwise kernels: a multiple of every warp size (32, 64)
#: that keeps several blocks resident per SM.
THREADS_PER_BLOCK = 256
#: Upper bound of the sort kernels' block size; sizes the shared tile of the place and
#: scan kernels (a compile-time constant in CUDA).
SORT_TILE = 256
#: Flat entries per chunk of the GPU counting sort: large enough that the per-expert
#: prefix over chunks stays short (T=65536, K=9 -> 144 chunks), small enough that the
#: chunks fill the GPU.
SORT_CHUNK = 4096
#: Output positions and block ids are int32: every size must stay below this.
INDEX_LIMIT = 2**31 - 1
#: CUDA's limit on gridDim.y (and z).
MAX_GRID_Y = 65535
#: Blocks of the place kernel when the padding pass wants more than one per chunk: two per
#: SM of an H100/H200 (132 SMs). Each block repeats the expert scan, so no more than that.
PAD_BLOCKS = 264

# --------------------------------------------------------------------------- helpers


def check_cuda_available() -> None:
    """Raise RuntimeError when a device array arrives but numba.cuda is not installed."""
    if cuda is None:
        raise RuntimeError(
            "a device array was passed but numba.cuda is not available; "
            "install the 'cuda' extra (numba-cuda)"
        )


def launch_config(work_items: int, limit: int = THREADS_PER_BLOCK) -> tuple[int, int]:
    """(blocks, threads) covering ``work_items`` threads, one item each.

    Small launches get a block rounded up to a multiple of 32 instead of ``limit``
    threads, so no block is mostly idle.
    """
    threads = min(limit, max(32, -(-work_items // 32) * 32))
    return max(1, -(-work_items // threads)), threads


def row_launch_config(rows: int, width: int, limit: int = THREADS_PER_BLOCK):
    """(grid, threads) of a row-wise elementwise kernel: block (r, c) covers columns
    ``[c*threads, (c+1)*threads)`` of row r.

    Row and column come straight from blockIdx (x: rows, up to 2**31 - 1; y: column tiles,
    up to 65535), so the kernels need no 64-bit division to split a flat index.
    """
    threads = min(limit, max(32, -(-width // 32) * 32))
    column_tiles = -(-width // threads)
    if column_tiles > MAX_GRID_Y:
        raise ValueError(f"width={width} needs {column_tiles} column tiles of {threads} threads; "
                         f"at most {MAX_GRID_Y} fit in gridDim.y")
    return (max(1, rows), max(1, column_tiles)), threads


def check_count(name: str, value, minimum: int) -> int:
    """``value`` as an int >= ``minimum``; TypeError/ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}={value!r} must be an integer >= {minimum}, "
                        f"got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}={value} must be an integer >= {minimum}")
    return int(value)


def host_ids(name: str, ids, ndim: int | None = 2) -> np.ndarray:
    """A C-contiguous int32 or int64 NumPy array of ``ids`` (copied only when needed).

    Raises
    ------
    TypeError
        A non-integer dtype.
    ValueError
        ``ndim`` given and the array has another number of dimensions.
    """
    array = np.asarray(ids)
    if array.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {array.dtype}")
    if ndim is not None and array.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {array.shape}")
    if array.dtype not in (np.int32, np.int64):
        # Other widths are rare; two specialisations keep the compiled cache small.
        array = array.astype(np.int64)
    return np.ascontiguousarray(array)


def device_ids(name: str, ids, ndim: int | None = 2):
    """A numba device array viewing the device array ``ids`` (int32 or int64).

    Raises
    ------
    TypeError
        A dtype other than int32 or int64.
    ValueError
        ``ndim`` given and the array has another number of dimensions.
    """
    check_cuda_available()
    view = as_device_array(ids)
    if view.dtype not in (np.int32, np.int64):
        raise TypeError(f"{name} on the device must be int32 or int64, got dtype {view.dtype}")
    if ndim is not None and view.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(view.shape)}")
    return view


def check_index_limit(what: str, size: int) -> None:
    """ValueError when an int32 position or index could overflow."""
    if size > INDEX_LIMIT:
        raise ValueError(f"{what}={size} exceeds the int32 index limit {INDEX_LIMIT}")


def padded_capacity(numel: int, num_experts: int, block_size: int) -> int:
    """Length of ``sorted_token_ids``: numel + num_experts*(B-1), rounded up to B."""
    return -(-(numel + num_experts * (block_size - 1)) // block_size) * block_size


# --------------------------------------------------------------------------- CPU


def _mapped_id(value, expert_map, use_map):
    """``expert_map[value]`` (-1 outside the map) when ``use_map``, else ``value``."""
    if not use_map:
        return value
    if value < 0 or value >= expert_map.shape[0]:
        return -1
    return expert_map[value]


mapped_id_cpu = njit(cache=True)(_mapped_id)
mapped_id_device = (None if cuda is None
                    else cuda.jit(device=True, inline="always")(_mapped_id))
#: The ``expert_map`` argument of the sort kernels when no map is used (never read).
NO_EXPERT_MAP = np.zeros(1, np.int32)


@njit(cache=True)
def _count_cpu(topk_ids, num_experts, expert_map, use_map):
    counts = np.zeros(num_experts, np.int64)
    rows, cols = topk_ids.shape
    for t in range(rows):
        for k in range(cols):
            e = mapped_id_cpu(topk_ids[t, k], expert_map, use_map)
            if e >= 0 and e < num_experts:
                counts[e] += 1
    return counts


@njit(cache=True)
def align_cpu(topk_ids, num_experts, block_size, sorted_token_ids, expert_ids, expert_map,
              use_map):
    """Fill ``sorted_token_ids`` and ``expert_ids``; return num_tokens_post_padded. With
    ``use_map`` each id is first ``expert_map[id]`` (-1 outside the map), in both passes."""
    rows, cols = topk_ids.shape
    numel = rows * cols
    counts = _count_cpu(topk_ids, num_experts, expert_map, use_map)
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
            e = mapped_id_cpu(topk_ids[t, k], expert_map, use_map)
            if e >= 0 and e < num_experts:
                sorted_token_ids[cursor[e]] = t * cols + k
                cursor[e] += 1
    return position


@njit(cache=True)
def sort_cpu(topk_ids, num_experts):
    """(sorted_slots int32 [M], expert_offsets int32 [E+1], inverse_index int32 [T, K])."""
    rows, cols = topk_ids.shape
    counts = _count_cpu(topk_ids, num_experts, NO_EXPERT_MAP, False)
    expert_offsets = np.empty(num_experts + 1, np.int32)
    cursor = np.empty(num_experts, np.int64)
    position = 0
    for e in range(num_experts):
        expert_offsets[e] = position
        cursor[e] = position
        position += counts[e]
    expert_offsets[num_experts] = position
    sorted_slots = np.empty(position, np.int32)
    inverse_index = np.empty((rows, cols), np.int32)
    for t in range(rows):
        for k in range(cols):
            e = topk_ids[t, k]
            if e >= 0 and e < num_experts:
                row = cursor[e]
                sorted_slots[row] = t * cols + k
                inverse_index[t, k] = row
                cursor[e] = row + 1
            else:
                inverse_index[t, k] = -1
    return sorted_slots, expert_offsets, inverse_index


# --------------------------------------------------------------------------- CUDA


def _count_kernel(topk_ids, expert_map, use_map, num_experts, chunk_size, chunk_counts):
    """Block c: chunk_counts[c, e] = entries of chunk c with expert e (after the map)."""
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
        e = mapped_id_device(topk_ids[i // cols, i % cols], expert_map, use_map)
        if e >= 0 and e < num_experts:
            cuda.atomic.add(chunk_counts, (chunk, int32(e)), 1)


def _place_kernel(topk_ids, expert_map, use_map, num_experts, chunk_size, num_chunks, block_size, chunk_counts,
                  cursors, starts, totals, expert_starts, sorted_out, inverse_out, write_inverse,
                  expert_ids):
    """Scan, place and pad in one launch; block b owns row b of ``cursors``, ``starts`` and
    ``totals`` (scratch [grid, E(+1)]), so blocks never wait for each other.

    1. Per expert (threads strided over experts): the entries of the chunks before chunk b
       and of all chunks (chunk_counts is only read here, never written).
    2. Exclusive scan of the padded totals over experts (Hillis-Steele in tiles of
       blockDim): each expert's start; block 0 also writes them to ``expert_starts``.
    3. Block b places the entries of chunk b, stably (row b of ``cursors`` is its cursor).
    4. The grid strides over the output positions: the padding value past each expert's
       entries and every block's expert id (disjoint from the placed positions).
    Every block repeats steps 1-2, O(E * chunks / blockDim) reads per thread from L2, in
    exchange for no grid-wide barrier and no second launch.
    """
    tile64 = cuda.shared.array(SORT_TILE, int64)
    tile = cuda.shared.array(SORT_TILE, int32)
    block = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    cols = topk_ids.shape[1]
    numel = topk_ids.shape[0] * cols
    for e in range(tid, num_experts, nthreads):
        running = 0
        before = 0
        for c in range(num_chunks):
            if c == block:
                before = running
            running += chunk_counts[c, e]
        cursors[block, e] = before
        totals[block, e] = running
    carry = int64(0)
    for base in range(0, num_experts, nthreads):  # same trip count for every thread
        e = base + tid
        value = int64(0)
        if e < num_experts:  # the same thread wrote totals[block, e] above
            value = (int64(totals[block, e]) + block_size - 1) // block_size * block_size
        tile64[tid] = value
        cuda.syncthreads()
        offset = 1
        while offset < nthreads:
            addend = int64(0)
            if tid >= offset:
                addend = tile64[tid - offset]
            cuda.syncthreads()
            tile64[tid] += addend
            cuda.syncthreads()
            offset *= 2
        if e < num_experts:
            start = carry + tile64[tid] - value
            starts[block, e] = start
            cursors[block, e] += start
            if block == 0:
                expert_starts[e] = start
        carry += tile64[nthreads - 1]
        cuda.syncthreads()  # the next tile overwrites `tile64`
    if tid == 0:
        starts[block, num_experts] = carry
        if block == 0:
            expert_starts[num_experts] = carry
    cuda.syncthreads()  # this block's rows are complete (global writes, one block)
    begin = block * chunk_size
    end = min(begin + chunk_size, numel)
    for tile_begin in range(begin, end, nthreads):  # same trip count for every thread
        i = tile_begin + tid
        e = int32(-1)
        if i < end:
            value = mapped_id_device(topk_ids[i // cols, i % cols], expert_map, use_map)
            if value >= 0 and value < num_experts:
                e = int32(value)
        tile[tid] = e
        cuda.syncthreads()
        if e >= 0:
            rank = 0
            for j in range(tid):
                if tile[j] == e:
                    rank += 1
            position = cursors[block, e] + rank
            sorted_out[position] = i
            if write_inverse:
                inverse_out[i // cols, i % cols] = position
        elif i < end and write_inverse:
            inverse_out[i // cols, i % cols] = -1
        cuda.syncthreads()  # every thread has read its cursor before any update
        if e >= 0:
            cuda.atomic.add(cursors, (block, e), 1)
        cuda.syncthreads()
    row_starts = starts[block]
    row_totals = totals[block]
    for p in range(block * nthreads + tid, sorted_out.shape[0], cuda.gridDim.x * nthreads):
        pad_position_device(p, row_totals, row_starts, num_experts, block_size, numel,
                            sorted_out, expert_ids)


def _pad_position(p, expert_counts, expert_starts, num_experts, block_size, pad_value,
                  sorted_out, expert_ids):
    """Position p: the pad value when p is past its expert's entries; its block's expert id."""
    total = expert_starts[num_experts]
    e = -1
    if p < total:
        # Last expert whose start is <= p: experts with no entries share the next start.
        lo = 0
        hi = num_experts
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if expert_starts[mid] <= p:
                lo = mid
            else:
                hi = mid
        e = lo
        if p - expert_starts[e] >= expert_counts[e]:
            sorted_out[p] = pad_value
    else:
        sorted_out[p] = pad_value
    if expert_ids.shape[0] > 0 and p % block_size == 0:
        expert_ids[p // block_size] = e


pad_position_device = (None if cuda is None
                       else cuda.jit(device=True, inline="always")(_pad_position))


_KERNEL_FUNCTIONS = {
    "count": _count_kernel,
    "place": _place_kernel,
}
_kernels: dict = {}


def kernel(name: str):
    """The numba.cuda dispatcher of one sort kernel, jitted on first use."""
    if name not in _kernels:
        check_cuda_available()
        _kernels[name] = cuda.jit(_KERNEL_FUNCTIONS[name])
    return _kernels[name]


def counting_sort_device(topk_ids, num_experts, block_size, sorted_out, expert_starts,
                         expert_ids, inverse_out, stream, *, expert_map=None,
                         chunk_size=SORT_CHUNK, threads_per_block=SORT_TILE, template=None):
    """Launch the stable counting sort on ``stream``.

    Parameters
    ----------
    topk_ids : numba device array [T, K] int32 or int64
    num_experts : int
    block_size : int
        1 for a plain sort; B for align_block_size padding.
    sorted_out : numba device array int32 [capacity]
        padded_capacity(T*K, num_experts, block_size) entries; positions past an expert's
        entries get T*K.
    expert_starts : numba device array int32 [num_experts + 1]
        Output: padded start of each expert's run; the last entry is the padded total.
    expert_ids : numba device array int32 [capacity // block_size] or None
    inverse_out : numba device array int32 [T, K] or None
    stream : numba stream
    chunk_size, threads_per_block : int
        Tuning knobs (any values give the same result); threads_per_block <= SORT_TILE.
    expert_map : numba device array int32 [num_physical_experts], optional
        Each id is first ``expert_map[id]`` (-1 outside the map) inside both kernels: the
        remap costs no launch and no [T, K] buffer.
    template : caller's device array, optional
        Scratch buffers come from its framework's allocator (`device_empty`); default:
        numba device arrays. No count is read back: every size here is an upper bound
        known on the host, so the launches can be captured in a CUDA graph.
    """
    if not 1 <= threads_per_block <= SORT_TILE or chunk_size < 1:
        raise ValueError(f"threads_per_block={threads_per_block} must be in [1, {SORT_TILE}] "
                         f"and chunk_size={chunk_size} >= 1")
    rows, cols = topk_ids.shape
    numel = rows * cols
    num_chunks = max(1, -(-numel // chunk_size))
    if template is None:
        template = sorted_out

    def scratch(shape):
        return device_empty(shape, np.int32, template, stream)[1]

    chunk_counts = scratch((num_chunks, num_experts))
    # Tiny inputs get a block no larger than their chunk or their expert count.
    threads = min(threads_per_block, max(_power_of_two_at_least(max(min(chunk_size, numel), 1)),
                                         _power_of_two_at_least(num_experts)))
    capacity = sorted_out.shape[0]
    # One block per chunk, more when the padding pass has far more positions than that.
    grid = max(num_chunks, min(-(-capacity // threads), PAD_BLOCKS))
    write_inverse = inverse_out is not None
    if inverse_out is None:
        inverse_out = scratch((1, 1))  # never written (write_inverse is False)
    if expert_ids is None:
        expert_ids = scratch((0,))
    use_map = expert_map is not None
    if expert_map is None:
        expert_map = scratch((1,))  # never read (use_map is False)
    _launcher.launch(kernel("count"), None, num_chunks, threads, stream,
                     (topk_ids, expert_map, use_map, num_experts, chunk_size, chunk_counts))
    _launcher.launch(kernel("place"), None, grid, threads, stream, (
        topk_ids, expert_map, use_map, num_experts, chunk_size, num_chunks, block_size, chunk_counts,
        scratch((grid, num_experts)), scratch((grid, num_experts + 1)), scratch((grid, num_experts)),
        expert_starts, sorted_out, inverse_out, write_inverse, expert_ids))


def _power_of_two_at_least(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())
