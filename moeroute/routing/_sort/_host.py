"""The counting sort on the CPU: count, scan, place (Numba ``njit``)."""

import numpy as np
from numba import njit

from moeroute.routing._sort._common import NO_EXPERT_MAP, _mapped_id

mapped_id_cpu = njit(cache=True)(_mapped_id)


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
def align_cpu(topk_ids, num_experts, block_size, sorted_token_ids, expert_ids, expert_map, use_map):
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
