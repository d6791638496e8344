"""logical_to_physical and remap_to_local on the CPU (Numba ``njit``)."""

from numba import njit

from moeroute.routing.remap._common import _physical_id

physical_id_cpu = njit(cache=True, inline="always")(_physical_id)


@njit(cache=True)
def logical_to_physical_cpu(topk_ids, num_routed, replica_offsets, replica_ids, routed_id_map, out):
    """Fill out[:, :K] with the physical ids of topk_ids [T, K]."""
    rows, cols = topk_ids.shape
    for t in range(rows):
        for k in range(cols):
            out[t, k] = physical_id_cpu(topk_ids[t, k], t, num_routed, replica_offsets, replica_ids, routed_id_map)


@njit(cache=True)
def _remap_cpu(ids, expert_map, out):
    size = expert_map.shape[0]
    for i in range(ids.shape[0]):
        physical = ids[i]
        out[i] = expert_map[physical] if physical >= 0 and physical < size else -1
