"""append_shared_slots on the CPU (Numba ``njit``)."""

from numba import njit

from moeroute.routing.remap._host import physical_id_cpu


@njit(cache=True)
def _append_cpu(
    topk_ids,
    topk_weights,
    num_routed,
    replica_offsets,
    replica_ids,
    routed_id_map,
    first_slot,
    slot_weights,
    use_row,
    use_col,
    scalar_weight,
    has_array,
    out_ids,
    out_weights,
):
    rows, top_k = topk_ids.shape
    slots = out_ids.shape[1] - top_k
    for t in range(rows):
        for k in range(top_k):
            out_ids[t, k] = physical_id_cpu(topk_ids[t, k], t, num_routed, replica_offsets, replica_ids, routed_id_map)
            out_weights[t, k] = topk_weights[t, k]
        for j in range(slots):
            out_ids[t, top_k + j] = first_slot + j
            if has_array:
                out_weights[t, top_k + j] = slot_weights[t * use_row, j * use_col]
            else:
                out_weights[t, top_k + j] = scalar_weight
