"""append_shared_slots on a CUDA device: one thread per output entry."""

from moeroute.routing import _sort

try:
    from numba import cuda

    from moeroute.routing.remap._cuda import physical_id_device
except ImportError:  # pragma: no cover - CPU-only installs
    cuda = None


def _append_kernel(
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
    """One thread per output entry (t, c), c < K + S."""
    i = cuda.grid(1)
    width = out_ids.shape[1]
    if i < out_ids.shape[0] * width:
        t = i // width
        c = i % width
        top_k = topk_ids.shape[1]
        if c < top_k:
            out_ids[t, c] = physical_id_device(
                topk_ids[t, c], t, num_routed, replica_offsets, replica_ids, routed_id_map
            )
            out_weights[t, c] = topk_weights[t, c]
        else:
            j = c - top_k
            out_ids[t, c] = first_slot + j
            if has_array:
                out_weights[t, c] = slot_weights[t * use_row, j * use_col]
            else:
                out_weights[t, c] = scalar_weight


def _kernel():
    return _sort.jit_kernel(_append_kernel)
