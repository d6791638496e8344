"""permute's row gather on a CUDA device: one block per (row, column tile)."""

from numba import uint32

from moeroute.routing import _sort

try:
    from numba import cuda
except ImportError:  # pragma: no cover - CPU-only installs
    cuda = None


def _gather_rows_kernel(source, sorted_slots, kept_count, top_k, out):
    """Block (r, c): columns ``c*blockDim + tid`` of output row r; rows from
    ``kept_count[0]`` on are not written. 32-bit index math: the row comes from blockIdx.x,
    the token from an unsigned 32-bit division (slots are < 2**31 by the index check)."""
    r = cuda.blockIdx.x
    h = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if r < kept_count[0] and h < out.shape[1]:
        token = uint32(sorted_slots[r]) // uint32(top_k)
        out[r, h] = source[token, h]


def _gather_kernel():
    return _sort.jit_kernel(_gather_rows_kernel)
