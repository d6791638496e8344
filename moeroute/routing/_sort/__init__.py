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

from moeroute.routing._sort._common import (  # noqa: F401
    INDEX_LIMIT,
    MAX_GRID_Y,
    NO_EXPERT_MAP,
    PAD_BLOCKS,
    SORT_CHUNK,
    SORT_TILE,
    THREADS_PER_BLOCK,
    check_cuda_available,
    check_index_limit,
    device_ids,
    host_id_view,
    host_ids,
    jit_kernel,
    kernel_ids,
    launch_config,
    padded_capacity,
    row_launch_config,
)
from moeroute.routing._sort._cuda import (  # noqa: F401
    _count_kernel,
    _place_kernel,
    counting_sort_device,
    kernel,
)
from moeroute.routing._sort._host import align_cpu, sort_cpu  # noqa: F401
