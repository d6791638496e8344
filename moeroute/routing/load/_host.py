"""expert_load on the CPU: one sequential pass over the ids (Numba ``njit``)."""

from numba import njit


@njit(cache=True)
def _count_cpu(ids, counts):
    size = counts.shape[0]
    for i in range(ids.shape[0]):
        e = ids[i]
        if e >= 0 and e < size:
            counts[e] += 1
