"""sort_by_expert and permute: token rows in expert order, with offsets and the inverse index.

`sort_by_expert` is the stable counting sort of `moeroute.routing._sort` without padding;
`permute` gathers the token rows in that order. The gather moves raw bits, so every dtype
works the same way, bfloat16 included when passed as its raw 16-bit pattern (a uint16 or
int16 view): no value is ever converted.
"""

from __future__ import annotations

import numpy as np

from moeroute._validate import integer
from moeroute.routing import _launcher, _parallel, _sort
from moeroute.routing._arrays import enter

from moeroute.routing.permute._cuda import _gather_kernel, _gather_rows_kernel  # noqa: F401
from moeroute.routing.permute._host import _gather_rows, _gather_rows_parallel

__all__ = ["sort_by_expert", "permute"]

#: Output size from which the CPU gather runs on all cores: below it, waking the thread pool
#: costs about as much as a sequential gather of the whole output.
PARALLEL_GATHER_MIN_BYTES = 32 << 20

# Unsigned integer of each item size: rows are gathered as raw bits.
_BITS_DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _check_sort_args(shape, num_experts) -> tuple[int, int]:
    """Validated (num_experts, numel) for ids of ``shape``."""
    num_experts = integer("num_experts", num_experts, 1)
    numel = int(shape[0]) * int(shape[1])
    _sort.check_index_limit("topk_ids.size", numel)
    return num_experts, numel


def _check_hidden_states(shape, num_tokens) -> None:
    if len(shape) != 2:
        raise ValueError(f"hidden_states must be 2-D [T, H], got shape {tuple(shape)}")
    if int(shape[0]) != num_tokens:
        raise ValueError(
            f"hidden_states has {shape[0]} rows but topk_ids has {num_tokens}; they must describe the same tokens"
        )


def sort_by_expert(topk_ids, num_experts, *, stream=None):
    """Stable sort of the flat (token, slot) entries ``i = t*K + k`` by expert id.

    Parameters
    ----------
    topk_ids : array [T, K], integer
        NumPy or CPU torch (any integer dtype) or a device array (int32 or int64). Ids
        outside ``[0, num_experts)`` (e.g. -1 for experts another rank holds) are dropped.
        Results come back in the framework and on the device of ``topk_ids``.
    num_experts : int
        >= 1.
    stream : optional
        Device inputs only; default: the current stream of the input's framework.

    Returns
    -------
    sorted_slots : int32 [M]
        Flat indices in expert order, ascending within an expert; M = kept entries.
    expert_offsets : int32 [num_experts + 1]
        Expert e owns rows ``[expert_offsets[e], expert_offsets[e+1])``.
    inverse_index : int32 [T, K]
        Row of each entry in ``sorted_slots``, -1 for dropped entries.

    The order is the same on the CPU and the GPU (a stable sort has one answer).

    On the device nothing is read back to the host (no copy, no synchronization: CUDA
    graph capture works): ``sorted_slots`` is sized by its upper bound ``T*K``, its first
    ``expert_offsets[num_experts]`` entries are the sort and the rest hold ``T*K`` (the
    `align_block_size` padding value), as vLLM's ``num_tokens_post_padded`` pattern does.

    Raises
    ------
    TypeError
        Non-integer ``topk_ids`` (int32/int64 on the device); non-integer ``num_experts``.
    ValueError
        ``topk_ids`` not 2-D; ``num_experts`` < 1; more than 2**31 - 1 entries.
    """
    entry = enter(topk_ids, "topk_ids")
    if entry.on_device:
        return _sort_device(entry, num_experts, stream)[0]
    view = _sort.host_id_view("topk_ids", entry)
    num_experts, _ = _check_sort_args(view.shape, num_experts)  # before anything is copied
    ids = _sort.kernel_ids(view)
    return tuple(entry.wrap(a) for a in _sort.sort_cpu(ids, num_experts))


def _sort_device(entry, num_experts, stream):
    """Device sort at its upper-bound size, from the boundary of ``topk_ids``; also returns
    the numba views and the stream."""
    ids = _sort.device_ids("topk_ids", entry)
    num_experts, numel = _check_sort_args(ids.shape, num_experts)
    launch_stream = entry.stream(stream)
    sorted_all, sorted_view = entry.empty((numel,), np.int32, launch_stream)
    offsets, offsets_view = entry.empty((num_experts + 1,), np.int32, launch_stream)
    inverse, inverse_view = entry.empty(tuple(ids.shape), np.int32, launch_stream)
    _sort.counting_sort_device(
        ids,
        num_experts,
        1,
        sorted_view,
        offsets_view,
        None,
        inverse_view if numel else None,
        launch_stream,
        template=entry,
    )
    return (sorted_all, offsets, inverse), (sorted_view, offsets_view), launch_stream


def permute(hidden_states, topk_ids, num_experts, *, stream=None):
    """Gather token rows into expert-sorted order.

    Parameters
    ----------
    hidden_states : array [T, H], any dtype
        Moved as raw bits: float32, float16, bfloat16 torch tensors, or bfloat16 as its
        uint16/int16 bit pattern. Host (NumPy, CPU torch) and device inputs must not be
        mixed with ``topk_ids``. ``permuted_hidden`` has the framework and dtype of
        ``hidden_states``.
    topk_ids : array [T, K], integer
        As in `sort_by_expert`.
    num_experts : int
    stream : optional
        Device inputs only.

    Returns
    -------
    permuted_hidden : [M, H], dtype of ``hidden_states``
        Row r is ``hidden_states[sorted_slots[r] // K]``. On the device M is the upper
        bound ``T*K`` (nothing is read back to the host); rows from
        ``expert_offsets[num_experts]`` on are left unwritten.
    expert_offsets : int32 [num_experts + 1]
    inverse_index : int32 [T, K]

    Raises
    ------
    TypeError
        As `sort_by_expert`; ``hidden_states`` on the host while ``topk_ids`` is on the
        device or the other way round.
    ValueError
        As `sort_by_expert`; ``hidden_states`` not 2-D or not T rows.
    """
    ids_entry = enter(topk_ids, "topk_ids")
    hidden_entry = enter(hidden_states, "hidden_states")
    if ids_entry.on_device != hidden_entry.on_device:
        raise TypeError(
            "hidden_states and topk_ids must both be host (NumPy) arrays or both be "
            f"device arrays, got {type(hidden_states).__name__} and {type(topk_ids).__name__}"
        )
    if ids_entry.on_device:
        return _permute_device(hidden_entry, ids_entry, num_experts, stream)
    view = _sort.host_id_view("topk_ids", ids_entry)
    # bfloat16 torch tensors arrive as their uint16 bits: the gather moves bits anyway.
    hidden = hidden_entry.host()
    _check_hidden_states(hidden.shape, view.shape[0])
    num_experts, _ = _check_sort_args(view.shape, num_experts)  # before anything is copied
    ids = _sort.kernel_ids(view)
    sorted_slots, expert_offsets, inverse_index = _sort.sort_cpu(ids, num_experts)
    permuted = np.empty((sorted_slots.shape[0], hidden.shape[1]), hidden.dtype)
    if permuted.size:
        source = _as_bits(np.ascontiguousarray(hidden))
        parallel = permuted.nbytes >= PARALLEL_GATHER_MIN_BYTES and _parallel.cpu_threads() > 1
        gather = _gather_rows_parallel if parallel else _gather_rows
        gather(source, sorted_slots, ids.shape[1], _as_bits(permuted))
    return (
        hidden_entry.wrap(permuted, bfloat16=hidden_entry.bfloat16),
        ids_entry.wrap(expert_offsets),
        ids_entry.wrap(inverse_index),
    )


def _as_bits(array: np.ndarray) -> np.ndarray:
    """A 2-D unsigned-integer view of the same bytes (NumPy has no bfloat16; Numba no float16)."""
    bits = _BITS_DTYPES.get(array.dtype.itemsize)
    if bits is None:
        return array.view(np.uint8)
    return array.view(bits)


def _permute_device(hidden_entry, ids_entry, num_experts, stream):
    """permute on device arrays, from the boundaries of ``hidden_states`` and ``topk_ids``."""
    hidden_view = hidden_entry.kernel(bits16=True)  # bfloat16 moved as its 16-bit pattern
    ids_view = ids_entry.kernel()
    _check_hidden_states(hidden_view.shape, int(ids_view.shape[0]))
    top_k = int(ids_view.shape[1])
    (_, expert_offsets, inverse_index), (sorted_view, offsets_view), launch_stream = _sort_device(
        ids_entry, num_experts, stream
    )
    rows = int(sorted_view.shape[0])
    width = int(hidden_view.shape[1])
    permuted, permuted_view = hidden_entry.empty((rows, width), hidden_view.dtype, launch_stream)
    if rows and width:
        grid, threads = _sort.row_launch_config(rows, width)
        kept_count = offsets_view[num_experts:]  # on the device: no read-back
        _launcher.launch(
            _gather_kernel(),
            None,
            grid,
            threads,
            launch_stream,
            (hidden_view, sorted_view, kept_count, top_k, permuted_view),
        )
    return hidden_entry.from_bits16(permuted), expert_offsets, inverse_index
