"""align_block_size: expert-sorted, block-padded flat indices for a grouped GEMM.

The CPU kernel is a sequential counting sort (`moeroute.routing._sort.align_cpu`); the
CUDA kernels are the deterministic chunked counting sort of `moeroute.routing._sort`.
Both give the same arrays, entry for entry (SPEC section 4 fixes one answer).
"""

from __future__ import annotations

import numpy as np

from moeroute.routing import _sort
from moeroute.routing._arrays import as_caller, device_empty, host_array, is_device_array, resolve_stream

__all__ = ["align_block_size"]


def _check_align_args(shape, num_experts, block_size) -> tuple[int, int, int, int]:
    """Validated (num_experts, block_size, numel, capacity) for ids of ``shape``."""
    num_experts = _sort.check_count("num_experts", num_experts, 1)
    block_size = _sort.check_count("block_size", block_size, 1)
    numel = int(shape[0]) * int(shape[1])
    capacity = _sort.padded_capacity(numel, num_experts, block_size)
    _sort.check_index_limit("numel + num_experts*(block_size-1)", capacity)
    return num_experts, block_size, numel, capacity


def align_block_size(topk_ids, num_experts, block_size, *, stream=None):
    """Sort the flat (token, slot) entries by expert and pad each expert to ``block_size``.

    Flat index ``i = t*K + k``. Entries whose id is outside ``[0, num_experts)`` are
    dropped. Per expert, its flat indices in ascending order, padded to a multiple of
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
        ``block_size`` not an integer.
    ValueError
        ``topk_ids`` not 2-D; ``num_experts`` < 1; ``block_size`` < 1; C above the int32
        limit (2**31 - 1).

    Examples
    --------
    >>> s, e, n = align_block_size(np.array([[0, 1], [1, 2], [0, 2]]), 4, 2)
    >>> s.tolist(), e.tolist(), n
    ([0, 4, 1, 2, 3, 5, 6, 6, 6, 6], [0, 1, 2, -1, -1], 6)
    """
    if is_device_array(topk_ids):
        return _align_device(topk_ids, num_experts, block_size, stream)
    ids = _sort.host_ids("topk_ids", host_array(topk_ids))
    num_experts, block_size, numel, capacity = _check_align_args(
        ids.shape, num_experts, block_size)
    sorted_token_ids = np.empty(capacity, np.int32)
    expert_ids = np.empty(capacity // block_size, np.int32)
    total = _sort.align_cpu(ids, num_experts, block_size, sorted_token_ids, expert_ids)
    return as_caller(sorted_token_ids, topk_ids), as_caller(expert_ids, topk_ids), int(total)


def _align_device(topk_ids, num_experts, block_size, stream):
    ids = _sort.device_ids("topk_ids", topk_ids)
    num_experts, block_size, numel, capacity = _check_align_args(
        ids.shape, num_experts, block_size)
    launch_stream = resolve_stream(topk_ids, stream)
    sorted_token_ids, sorted_view = device_empty((capacity,), np.int32, topk_ids, launch_stream)
    expert_ids, expert_view = device_empty((capacity // block_size,), np.int32, topk_ids,
                                           launch_stream)
    starts, starts_view = device_empty((num_experts + 1,), np.int32, topk_ids, launch_stream)
    _sort.counting_sort_device(ids, num_experts, block_size, sorted_view, starts_view,
                               expert_view, None, launch_stream, template=topk_ids)
    return sorted_token_ids, expert_ids, starts[num_experts:]
