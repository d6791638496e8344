"""permute's row gather on the CPU (Numba ``njit``; all cores above the size threshold)."""

from numba import njit, prange


@njit(cache=True)
def _gather_rows(source, sorted_slots, top_k, out):
    for r in range(sorted_slots.shape[0]):
        out[r, :] = source[sorted_slots[r] // top_k, :]


@njit(cache=True, parallel=True)
def _gather_rows_parallel(source, sorted_slots, top_k, out):
    for r in prange(sorted_slots.shape[0]):
        out[r, :] = source[sorted_slots[r] // top_k, :]
