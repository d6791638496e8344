"""expert_load on a CUDA device: one thread per entry, integer atomics into the int64
counters (a sum: the result does not depend on the order)."""

from moeroute.routing import _sort

try:
    from numba import cuda
except ImportError:  # pragma: no cover - CPU-only installs
    cuda = None


def _zero_kernel(counts):
    i = cuda.grid(1)
    if i < counts.shape[0]:
        counts[i] = 0


def _count_kernel(ids, counts):
    i = cuda.grid(1)
    if i < ids.shape[0]:
        e = ids[i]
        if e >= 0 and e < counts.shape[0]:
            cuda.atomic.add(counts, e, 1)


def _kernel(name: str):
    return _sort.jit_kernel({"zero": _zero_kernel, "count": _count_kernel}[name])
