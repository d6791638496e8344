"""expert_load: tokens per expert, the counters an EPLB rebalancer reads.

``counts[e]`` is the number of entries of ``ids`` equal to ``e`` for ``e`` in
``[0, num_experts)``; every other id (-1, shared slots past the range, ...) is not counted.
Feed it physical ids (`logical_to_physical` / `append_shared_slots` output) with
``layout.num_physical_experts`` for per-physical-expert load, or logical ids with N for
per-logical-expert load. With ``out`` the counts are added into an existing counter, so a
rebalancer can accumulate a window of steps and reset the counter itself.

CPU: one sequential pass (Numba ``njit``, `_host`). CUDA: one thread per entry, integer
atomics into the int64 counters (`_cuda`); device inputs stay on the device, the counters
are allocated by the input's framework and nothing synchronizes.
"""

from __future__ import annotations

import numpy as np

from moeroute._validate import integer
from moeroute.routing import _launcher, _sort
from moeroute.routing._arrays import check_no_overlap, dtype_name, enter
from moeroute.routing.load._cuda import _kernel
from moeroute.routing.load._host import _count_cpu

__all__ = ["expert_load", "LOAD_DTYPE"]

#: Counter dtype: int64, so a long accumulation window (2**31 tokens) cannot overflow.
LOAD_DTYPE = np.int64


def _check_out(out_entry, num_experts, on_device):
    """TypeError/ValueError unless ``out`` (its boundary ``out_entry``) is an int64
    [num_experts] counter on the side of the ids."""
    out = out_entry.array
    shape = tuple(out.shape)
    if shape != (num_experts,):
        raise ValueError(f"out has shape {shape}; it must be ({num_experts},) = [num_experts]")
    name = dtype_name(out.dtype)
    if name != "int64":
        raise TypeError(f"out must hold int64 counters, got dtype {name}")
    if out_entry.on_device != on_device:
        where = "device" if on_device else "host"
        raise TypeError(f"out must live where ids live (on the {where}), got {type(out).__name__}")


def expert_load(ids, num_experts, *, out=None, stream=None):
    """Count the entries routed to each expert (per-expert load for EPLB).

    Parameters
    ----------
    ids : array, any shape, integer
        Expert ids, e.g. topk_ids [T, K] (logical) or the physical ids of
        `append_shared_slots` [T, K + S]. NumPy or CPU torch (any integer dtype) runs on
        the CPU; a device array (int32/int64, C-contiguous; torch CUDA, CuPy, numba) on the
        GPU. The counts come back in the framework of ``ids``.
    num_experts : int
        Size of the id space, >= 1; ids outside ``[0, num_experts)`` are not counted.
    out : array int64 [num_experts], optional
        A counter to add into (same side as ``ids``: a NumPy array or CPU torch tensor, or
        a device array).
        Default: fresh zeroed counters.
    stream : optional
        Device inputs only; default: the current stream of the input's framework.

    Returns
    -------
    counts : int64 [num_experts]
        ``out`` when given (counts added in place), else a new array in the input's
        framework and device.

    Raises
    ------
    TypeError
        Non-integer ``ids``; ``num_experts`` not an integer; ``out`` not int64 or not on
        the side of ``ids``.
    ValueError
        ``num_experts`` < 1; ``out`` not of shape [num_experts] or sharing memory with
        ``ids``; device ``ids`` not C-contiguous.

    Examples
    --------
    >>> expert_load(np.array([[0, 2], [2, -1]]), 4).tolist()
    [1, 0, 2, 0]
    """
    num_experts = integer("num_experts", num_experts, 1)
    entry = enter(ids, "ids")
    out_entry = None if out is None else enter(out, "out")
    if entry.on_device:
        view = _sort.device_ids("ids", entry, ndim=None)
        if not view.is_c_contiguous():
            raise ValueError("ids on the device must be C-contiguous")
        launch_stream = entry.stream(stream)
        if out is None:
            counts, counts_view = entry.empty((num_experts,), LOAD_DTYPE)
            blocks, threads = _sort.launch_config(num_experts)
            _launcher.launch(_kernel("zero"), None, blocks, threads, launch_stream, (counts_view,))
        else:
            _check_out(out_entry, num_experts, True)
            check_no_overlap({"out": out}, {"ids": ids})
            counts, counts_view = out, out_entry.kernel()
        size = int(np.prod(view.shape, dtype=np.int64))
        if size:
            blocks, threads = _sort.launch_config(size)
            _launcher.launch(_kernel("count"), None, blocks, threads, launch_stream, (view.reshape(size), counts_view))
        return counts
    if out_entry is not None and out_entry.on_device:
        raise TypeError(
            "out is a device array but ids are on the host; pass both on the device or both as NumPy arrays"
        )
    host = _sort.host_ids("ids", entry, ndim=None)
    if out is None:
        counts = np.zeros(num_experts, LOAD_DTYPE)
        _count_cpu(host.reshape(-1), counts)
        return entry.wrap(counts)
    if isinstance(out, (list, tuple)) or not hasattr(out, "shape"):
        raise TypeError(f"out must be a NumPy (or CPU torch) int64 array for host ids, got {type(out).__name__}")
    _check_out(out_entry, num_experts, False)
    counts = out_entry.host()  # a CPU torch counter is viewed, not copied
    if not counts.flags.c_contiguous or not counts.flags.writeable:
        raise ValueError("out must be a writable C-contiguous array")
    check_no_overlap({"out": out}, {"ids": ids})  # counting into the ids would change them
    _count_cpu(host.reshape(-1), counts)
    return out
