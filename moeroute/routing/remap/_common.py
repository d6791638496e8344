"""What both remap kernels compile or read: the logical -> physical rule, and the replica
tables a launch uses."""

import numpy as np

from moeroute.layout import REPLICA_HASH_MULTIPLIER, ExpertLayout

#: The replica hash is taken modulo 2**32 on every backend (uint32 arithmetic in engines).
_HASH_MASK = 0xFFFFFFFF


def _physical_id(logical, token_row, num_routed, replica_offsets, replica_ids, routed_id_map):
    """Physical id of logical id ``logical`` for token row ``token_row``; -1 outside [0, N).

    Compiled twice from this one definition: for the CPU kernels (njit) and as a CUDA
    device function.
    """
    if logical < 0 or logical >= num_routed:
        return -1
    first = replica_offsets[logical]
    count = replica_offsets[logical + 1] - first
    replica = replica_ids[first]
    if count > 1:
        hashed = (np.int64(token_row) * REPLICA_HASH_MULTIPLIER) & _HASH_MASK
        replica = replica_ids[first + hashed % count]
    return routed_id_map[replica]


def _replica_tables(layout: ExpertLayout, prefer_rank):
    """(replica_offsets, replica_ids) of ``layout``, or its `preferred_replicas` of a rank."""
    if prefer_rank is None:
        return layout.replica_offsets, layout.replica_ids
    return layout.preferred_replicas(prefer_rank)
