"""align_block_size written with array operations only (NumPy or CuPy), for the GPU GEMM path.

Used by ``moeroute.gpu.fused_experts`` only while ``moeroute.routing.align`` (the Numba CUDA
kernel) is not importable. Same semantics as ``moeroute.routing.reference.align_block_size``
(docs/semantics.md section 4), and no host synchronisation: every size is known from the input shape, so a
CuPy call only enqueues work on the current stream.
"""

from __future__ import annotations

import numpy as np


def align_block_size_array_api(topk_ids, num_experts: int, block_size: int, xp=np):
    """Expert-sorted, block-padded flat indices of ``topk_ids``.

    Parameters
    ----------
    topk_ids : array [T, K] int32 (``xp`` array); ids outside [0, num_experts) are dropped.
    num_experts : int >= 1
    block_size : int >= 1
    xp : module, ``numpy`` or ``cupy``

    Returns
    -------
    sorted_token_ids : array [capacity] int32, capacity = numel + num_experts*(B-1) rounded up
        to a multiple of B; padding and tail hold numel = T*K.
    expert_ids : array [capacity // B] int32, -1 after the last used block.
    num_tokens_post_padded : 0-d array int64 (stays on the device for CuPy).
    """
    flat = topk_ids.reshape(-1).astype(xp.int64)
    numel = int(flat.shape[0])
    E, B = int(num_experts), int(block_size)
    capacity = -(-(numel + E * (B - 1)) // B) * B
    valid = (flat >= 0) & (flat < E)
    expert = xp.where(valid, flat, E)  # dropped entries sort after every expert
    # Unique keys make any sort stable: expert first, then the flat index.
    position_in_input = xp.arange(numel, dtype=xp.int64)
    order = xp.argsort(expert * max(numel, 1) + position_in_input)
    sorted_expert = expert[order]

    counts = xp.bincount(expert, minlength=E + 1)[:E]
    padded = (counts + B - 1) // B * B
    starts = xp.cumsum(counts) - counts
    padded_ends = xp.cumsum(padded)
    padded_starts = padded_ends - padded

    kept = sorted_expert < E
    clipped = xp.minimum(sorted_expert, E - 1)
    destination = padded_starts[clipped] + (xp.arange(numel, dtype=xp.int64) - starts[clipped])
    # Dropped entries land in one spare slot past the end, cut off below.
    destination = xp.where(kept, destination, capacity)
    sorted_token_ids = xp.full(capacity + 1, numel, dtype=xp.int32)
    sorted_token_ids[destination] = order.astype(xp.int32)
    sorted_token_ids = sorted_token_ids[:capacity]

    block_start = xp.arange(capacity // B, dtype=xp.int64) * B
    block_expert = xp.searchsorted(padded_ends, block_start, side="right")
    total = padded_ends[-1]
    expert_ids = xp.where(block_start < total, block_expert, -1).astype(xp.int32)
    return sorted_token_ids, expert_ids, total
