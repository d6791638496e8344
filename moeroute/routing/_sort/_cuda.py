"""The counting sort on a CUDA device: ``count`` then ``place`` (see the package docstring)."""

import numpy as np
from numba import int32, int64

from moeroute.routing import _launcher
from moeroute.routing._arrays import device_empty
from moeroute.routing._sort._common import (
    PAD_BLOCKS,
    SORT_CHUNK,
    SORT_TILE,
    _mapped_id,
    jit_kernel,
    cuda,
)

mapped_id_device = None if cuda is None else cuda.jit(device=True, inline="always")(_mapped_id)


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


def _place_kernel(
    topk_ids,
    expert_map,
    use_map,
    num_experts,
    chunk_size,
    num_chunks,
    block_size,
    chunk_counts,
    cursors,
    starts,
    totals,
    expert_starts,
    sorted_out,
    inverse_out,
    write_inverse,
    expert_ids,
):
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
        pad_position_device(p, row_totals, row_starts, num_experts, block_size, numel, sorted_out, expert_ids)


def _pad_position(p, expert_counts, expert_starts, num_experts, block_size, pad_value, sorted_out, expert_ids):
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


pad_position_device = None if cuda is None else cuda.jit(device=True, inline="always")(_pad_position)


_KERNEL_FUNCTIONS = {
    "count": _count_kernel,
    "place": _place_kernel,
}


def kernel(name: str):
    """The numba.cuda dispatcher of one sort kernel, jitted on first use."""
    return jit_kernel(_KERNEL_FUNCTIONS[name])


def counting_sort_device(
    topk_ids,
    num_experts,
    block_size,
    sorted_out,
    expert_starts,
    expert_ids,
    inverse_out,
    stream,
    *,
    expert_map=None,
    chunk_size=SORT_CHUNK,
    threads_per_block=SORT_TILE,
    template=None,
):
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
    template : caller's device array (or its `Boundary`), optional
        Scratch buffers come from its framework's allocator (`device_empty`); default:
        numba device arrays. No count is read back: every size here is an upper bound
        known on the host, so the launches can be captured in a CUDA graph.
    """
    if not 1 <= threads_per_block <= SORT_TILE or chunk_size < 1:
        raise ValueError(
            f"threads_per_block={threads_per_block} must be in [1, {SORT_TILE}] and chunk_size={chunk_size} >= 1"
        )
    rows, cols = topk_ids.shape
    numel = rows * cols
    num_chunks = max(1, -(-numel // chunk_size))
    if template is None:
        template = sorted_out

    def scratch(shape):
        return device_empty(shape, np.int32, template, stream)[1]

    chunk_counts = scratch((num_chunks, num_experts))
    # Tiny inputs get a block no larger than their chunk or their expert count.
    threads = min(
        threads_per_block,
        max(_power_of_two_at_least(max(min(chunk_size, numel), 1)), _power_of_two_at_least(num_experts)),
    )
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
    _launcher.launch(
        kernel("count"),
        None,
        num_chunks,
        threads,
        stream,
        (topk_ids, expert_map, use_map, num_experts, chunk_size, chunk_counts),
    )
    _launcher.launch(
        kernel("place"),
        None,
        grid,
        threads,
        stream,
        (
            topk_ids,
            expert_map,
            use_map,
            num_experts,
            chunk_size,
            num_chunks,
            block_size,
            chunk_counts,
            scratch((grid, num_experts)),
            scratch((grid, num_experts + 1)),
            scratch((grid, num_experts)),
            expert_starts,
            sorted_out,
            inverse_out,
            write_inverse,
            expert_ids,
        ),
    )


def _power_of_two_at_least(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())
