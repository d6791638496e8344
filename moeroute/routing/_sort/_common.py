"""The sort's constants, argument checks, launch shapes and the one id rule both sides
compile (`_mapped_id`)."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

try:  # numba.cuda comes with the optional numba-cuda package
    from numba import cuda
except ImportError:  # pragma: no cover - CPU-only installs
    cuda = None

from moeroute.routing._arrays import Boundary, as_device_array, host_array

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


def check_cuda_available() -> None:
    """Raise RuntimeError when a device array arrives but numba.cuda is not installed."""
    if cuda is None:
        raise RuntimeError(
            "a device array was passed but numba.cuda is not available; install the 'cuda' extra (numba-cuda)"
        )


@lru_cache(maxsize=None)
def jit_kernel(function):
    """``cuda.jit(function)``, once per function: the ops' kernels are jitted on first use
    (RuntimeError naming the missing extra when numba.cuda is not installed)."""
    check_cuda_available()
    return cuda.jit(function)


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
        raise ValueError(
            f"width={width} needs {column_tiles} column tiles of {threads} threads; "
            f"at most {MAX_GRID_Y} fit in gridDim.y"
        )
    return (max(1, rows), max(1, column_tiles)), threads


def host_id_view(name: str, ids, ndim: int | None = 2) -> np.ndarray:
    """``ids`` (a host array or its `Boundary`) as a NumPy array, checked, never copied (a
    broadcast or expanded view stays one): callers check their size limits on its shape
    before `kernel_ids` copies.

    Raises
    ------
    TypeError
        A non-integer dtype.
    ValueError
        ``ndim`` given and the array has another number of dimensions.
    """
    array = ids.host() if isinstance(ids, Boundary) else host_array(ids)
    if array.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {array.dtype}")
    if ndim is not None and array.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {array.shape}")
    return array


def kernel_ids(array: np.ndarray) -> np.ndarray:
    """A C-contiguous int32 or int64 copy of ``array`` (a `host_id_view`), or ``array``
    itself when it already is one."""
    if array.dtype not in (np.int32, np.int64):
        # Other widths are rare; two specialisations keep the compiled cache small.
        array = array.astype(np.int64)
    return np.ascontiguousarray(array)


def host_ids(name: str, ids, ndim: int | None = 2) -> np.ndarray:
    """`kernel_ids` of `host_id_view` in one step, for ops with no size limit to check."""
    return kernel_ids(host_id_view(name, ids, ndim))


def device_ids(name: str, ids, ndim: int | None = 2):
    """A numba device array viewing the device array ``ids`` (or its `Boundary`; int32 or
    int64).

    Raises
    ------
    TypeError
        A dtype other than int32 or int64.
    ValueError
        ``ndim`` given and the array has another number of dimensions.
    """
    check_cuda_available()
    view = ids.kernel() if isinstance(ids, Boundary) else as_device_array(ids)
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


def _mapped_id(value, expert_map, use_map):
    """``expert_map[value]`` (-1 outside the map) when ``use_map``, else ``value``."""
    if not use_map:
        return value
    if value < 0 or value >= expert_map.shape[0]:
        return -1
    return expert_map[value]


#: The ``expert_map`` argument of the sort kernels when no map is used (never read).
NO_EXPERT_MAP = np.zeros(1, np.int32)
