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
2. ``scan`` (one block): per expert, the exclusive prefix of its counts over the chunks
   (in place), then the exclusive scan of the padded per-expert totals in expert order:
   ``expert_starts[e]``; ``expert_starts[E]`` is the padded total.
3. ``place``: block c walks its chunk in tiles of ``blockDim`` entries; an entry's rank
   among the earlier entries of the tile with the same expert, plus the chunk's running
   count, plus the chunk prefix, plus the expert start is its output position. Then,
   in the same launch, the grid strides over the output positions: the padding value
   into positions past their expert's entries, the expert id of every block (disjoint
   from the placed positions, so no barrier is needed between the two passes).

Three launches, no host read-back: every size is an upper bound known on the host.
"""

from __future__ import annotations

import numpy as np
from numba import int32, int64, njit

try:  # numba.cuda comes with the optional numba-cuda package
    from numba import cuda
except ImportError:  # pragma: no cover - CPU-only installs
    cuda = None

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
#: Blocks of the place kernel beyond its chunks, for the padding pass (grid-stride): enough
#: to fill an H100/H200 (132 SMs) a few times over.
MAX_PAD_BLOCKS = 1024

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


@njit(cache=True)
def _count_cpu(topk_ids, num_experts):
    counts = np.zeros(num_experts, np.int64)
    rows, cols = topk_ids.shape
    for t in range(rows):
        for k in range(cols):
            e = topk_ids[t, k]
            if e >= 0 and e < num_experts:
                counts[e] += 1
    return counts


@njit(cache=True)
def align_cpu(topk_ids, num_experts, block_size, sorted_token_ids, expert_ids):
    """Fill ``sorted_token_ids`` and ``expert_ids``; return num_tokens_post_padded."""
    rows, cols = topk_ids.shape
    numel = rows * cols
    counts = _count_cpu(topk_ids, num_experts)
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
            e = topk_ids[t, k]
            if e >= 0 and e < num_experts:
                sorted_token_ids[cursor[e]] = t * cols + k
                cursor[e] += 1
    return position


@njit(cache=True)
def sort_cpu(topk_ids, num_experts):
    """(sorted_slots int32 [M], expert_offsets int32 [E+1], inverse_index int32 [T, K])."""
    rows, cols = topk_ids.shape
    counts = _count_cpu(topk_ids, num_experts)
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


def _count_kernel(topk_ids, num_experts, chunk_size, chunk_counts):
    """Block c: chunk_counts[c, e] = entries of chunk c with expert e."""
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
        e = topk_ids[i // cols, i % cols]
        if e >= 0 and e < num_experts:
            cuda.atomic.add(chunk_counts, (chunk, int32(e)), 1)


def _scan_kernel(chunk_counts, num_experts, block_size, expert_counts, expert_starts):
    """One block. chunk_counts -> per-expert exclusive prefix over chunks (in place);
    expert_counts[e] = entries of expert e; expert_starts[e] = padded exclusive scan,
    expert_starts[E] = padded total."""
    tile = cuda.shared.array(SORT_TILE, int64)
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    num_chunks = chunk_counts.shape[0]
    for e in range(tid, num_experts, nthreads):
        running = 0
        for c in range(num_chunks):
            count = chunk_counts[c, e]
            chunk_counts[c, e] = running
            running += count
        expert_counts[e] = running
    cuda.syncthreads()
    carry = int64(0)
    for base in range(0, num_experts, nthreads):
        e = base + tid
        value = int64(0)
        if e < num_experts:
            value = (int64(expert_counts[e]) + block_size - 1) // block_size * block_size
        tile[tid] = value
        cuda.syncthreads()
        # Hillis-Steele inclusive scan of the tile.
        offset = 1
        while offset < nthreads:
            addend = int64(0)
            if tid >= offset:
                addend = tile[tid - offset]
            cuda.syncthreads()
            tile[tid] += addend
            cuda.syncthreads()
            offset *= 2
        if e < num_experts:
            expert_starts[e] = carry + tile[tid] - value
        carry += tile[nthreads - 1]
        cuda.syncthreads()  # the next tile overwrites `tile`
    if tid == 0:
        expert_starts[num_experts] = carry


def _place_kernel(topk_ids, num_experts, chunk_size, chunk_counts, expert_counts, expert_starts,
                  block_size, sorted_out, inverse_out, write_inverse, expert_ids):
    """Block c places the entries of chunk c, stably (chunk_counts[c, :] is its cursor); then
    the whole grid pads: every output position past its expert's entries gets T*K and every
    block of B positions its expert id. The two write disjoint positions, so the padding
    needs no barrier after the placing (one launch instead of two)."""
    tile = cuda.shared.array(SORT_TILE, int32)
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
            if value >= 0 and value < num_experts:
                e = int32(value)
        tile[tid] = e
        cuda.syncthreads()
        if e >= 0:
            rank = 0
            for j in range(tid):
                if tile[j] == e:
                    rank += 1
            position = expert_starts[e] + chunk_counts[chunk, e] + rank
            sorted_out[position] = i
            if write_inverse:
                inverse_out[i // cols, i % cols] = position
        elif i < end and write_inverse:
            inverse_out[i // cols, i % cols] = -1
        cuda.syncthreads()  # every thread has read its cursor before any update
        if e >= 0:
            cuda.atomic.add(chunk_counts, (chunk, e), 1)
        cuda.syncthreads()
    for p in range(chunk * nthreads + tid, sorted_out.shape[0], cuda.gridDim.x * nthreads):
        pad_position_device(p, expert_counts, expert_starts, num_experts, block_size, numel,
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


pad_position_device = None if cuda is None else cuda.jit(device=True)(_pad_position)


_KERNEL_FUNCTIONS = {
    "count": _count_kernel,
    "scan": _scan_kernel,
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
                         expert_ids, inverse_out, stream, *, chunk_size=SORT_CHUNK,
                         threads_per_block=SORT_TILE, template=None):
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
    expert_counts = scratch((num_experts,))
    # Tiny inputs get a block no larger than their chunk.
    sort_threads = min(threads_per_block, _power_of_two_at_least(max(min(chunk_size, numel), 1)))
    scan_threads = min(threads_per_block, _power_of_two_at_least(num_experts))
    write_inverse = inverse_out is not None
    if inverse_out is None:
        inverse_out = scratch((1, 1))  # never written (write_inverse is False)
    if expert_ids is None:
        expert_ids = scratch((0,))
    kernel("count")[num_chunks, sort_threads, stream](topk_ids, num_experts, chunk_size,
                                                       chunk_counts)
    kernel("scan")[1, scan_threads, stream](chunk_counts, num_experts, block_size,
                                            expert_counts, expert_starts)
    capacity = sorted_out.shape[0]
    if capacity:
        # Enough blocks for the chunks, and for the padding pass when the chunks are few.
        pad_blocks = -(-capacity // sort_threads)
        kernel("place")[max(num_chunks, min(pad_blocks, MAX_PAD_BLOCKS)), sort_threads, stream](
            topk_ids, num_experts, chunk_size, chunk_counts, expert_counts, expert_starts,
            block_size, sorted_out, inverse_out, write_inverse, expert_ids)


def _power_of_two_at_least(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())
