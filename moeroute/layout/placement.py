"""Placement: which rank holds which physical expert, and which logical expert each computes.

The tables `moeroute.layout.ExpertLayout` is built from (docs/semantics.md section 2):
the replica table (``physical_to_logical`` [P] and its CSR by logical expert), the
per-rank blocks of the physical id space, and the maps between id spaces. Pure functions
of counts and arrays; every array they return is int32.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from moeroute.layout._checks import ID_DTYPE, LayoutError, readonly

#: How logical experts spread over the ranks: "linear" (rank r holds a contiguous run of
#: logical ids) or "round_robin" (rank r holds logical r, r+E, r+2E, ...).
PLACEMENTS = ("linear", "round_robin")
#: Requirements `ExpertLayout.check_backend` knows.
BACKEND_REQUIREMENTS = ("equal_blocks",)

#: Knuth's multiplicative hash constant, floor(2**32 / golden ratio): consecutive
#: token rows land on well-spread replicas without any per-token state.
REPLICA_HASH_MULTIPLIER = 2654435769
#: The replica hash works modulo 2**32 so every backend computes it in uint32.
REPLICA_HASH_MODULUS = 2**32


@dataclasses.dataclass(frozen=True)
class Replicas:
    """The replica table of a layout; read-only int32 arrays.

    Attributes
    ----------
    physical_to_logical : [P]
        The logical expert each routed physical expert computes.
    offsets : [N + 1]
        CSR offsets into ``ids`` per logical expert.
    ids : [P]
        Routed physical ids grouped by logical expert, ascending within each.
    replica_table : [R]
        The ``replica_table`` given (empty when none was).
    has_replica_table : bool
        A ``replica_table`` was given.
    """

    physical_to_logical: np.ndarray
    offsets: np.ndarray
    ids: np.ndarray
    replica_table: np.ndarray
    has_replica_table: bool


def check_physical_to_logical(table: Any, num_routed: int) -> np.ndarray:
    """``table`` as an int64 [P] array, P >= N, every logical id present; LayoutError otherwise."""
    array = np.asarray(table)
    if array.ndim != 1 or array.shape[0] < num_routed:
        raise LayoutError(
            f"physical_to_logical has shape {array.shape}; it needs one logical id per routed "
            f"physical expert, shape [P] with P >= num_routed_experts={num_routed}"
        )
    if not np.issubdtype(array.dtype, np.integer):
        raise LayoutError(f"physical_to_logical must hold integers, got dtype {array.dtype}")
    bad = (array < 0) | (array >= num_routed)
    if bad.any():
        index = int(np.argmax(bad))
        raise LayoutError(
            f"physical_to_logical[{index}]={int(array[index])} is not a logical expert id; "
            f"ids must be in [0, {num_routed})"
        )
    missing = np.flatnonzero(np.bincount(array, minlength=num_routed) == 0)
    if missing.size:
        raise LayoutError(
            f"physical_to_logical holds no replica of logical expert(s) "
            f"{missing[:8].tolist()}{' ...' if missing.size > 8 else ''}; every logical id in "
            f"[0, {num_routed}) must appear at least once"
        )
    return array.astype(np.int64)


def build_replicas(
    n: int, r: int, ep_size: int, placement: str, replica_table: Any, full_table: np.ndarray | None = None
) -> Replicas:
    """The replica table of N logical and R redundant experts over ``ep_size`` ranks.

    ``full_table`` (checked by `check_physical_to_logical`) is used as it is; otherwise
    physical N + i replicates ``replica_table[i]`` (default ``(N + i) % N``), and
    "round_robin" reorders the linear sequence so that rank r holds its entries r, r+E, ...

    Raises
    ------
    LayoutError
        A replica table that is not R integers in [0, N).
    """
    empty = np.zeros(0, dtype=ID_DTYPE)
    if full_table is not None:
        return _replica_index(full_table.astype(np.int64), n, empty, False)
    if replica_table is None:
        table = np.arange(n, n + r, dtype=np.int64) % n
        has_table, values = False, empty
    else:
        table = np.asarray(replica_table)
        if table.ndim != 1 or table.shape[0] != r:
            raise LayoutError(
                f"replica_table has shape {table.shape}; it needs one logical id per redundant expert, shape [{r}]"
            )
        if r and not np.issubdtype(table.dtype, np.integer):
            raise LayoutError(f"replica_table must hold integers, got dtype {table.dtype}")
        bad = (table < 0) | (table >= n)
        if bad.any():
            raise LayoutError(
                f"replica_table[{int(np.argmax(bad))}]={int(table[bad][0])} is not a "
                f"logical expert id; ids must be in [0, {n})"
            )
        has_table, values = True, table.astype(ID_DTYPE)
    logical = np.concatenate([np.arange(n, dtype=np.int64), table.astype(np.int64)])
    if placement == "round_robin":
        # Rank r's block [a_r, a_r + L_r) takes entries r, r+E, r+2E, ... of the linear
        # sequence: L_r of them, exactly the block's length.
        logical = np.concatenate([logical[rank::ep_size] for rank in range(ep_size)])
    return _replica_index(logical, n, values, has_table)


def _replica_index(logical: np.ndarray, n: int, values: np.ndarray, has_table: bool) -> Replicas:
    """The replica CSR (offsets, ids) of the table ``logical`` [P]."""
    # Stable sort keeps each logical expert's replicas in ascending physical order.
    order = np.argsort(logical, kind="stable")
    ids = readonly(order.astype(ID_DTYPE))
    counts = np.bincount(logical, minlength=n)
    offsets = np.zeros(n + 1, dtype=ID_DTYPE)
    np.cumsum(counts, out=offsets[1:])
    return Replicas(readonly(logical.astype(ID_DTYPE)), readonly(offsets), ids, values, has_table)


@dataclasses.dataclass(frozen=True)
class RankBlocks:
    """How the physical id space is tiled over the ranks; read-only int32 arrays.

    Attributes
    ----------
    routed_starts, routed_counts : [E]
        Rank r's routed physical experts are [a_r, a_r + L_r).
    block_starts : [E]
        b_r, the first physical id of rank r's block (a_r + r*S with per_rank slots).
    routed_id_map : [P]
        Routed physical id -> physical id.
    owner_rank : [num_physical_experts]
        The rank holding each physical id; -1 for global shared slots.
    """

    routed_starts: np.ndarray
    routed_counts: np.ndarray
    block_starts: np.ndarray
    routed_id_map: np.ndarray
    owner_rank: np.ndarray


def rank_blocks(p: int, e: int, s: int, shared_slots: str | None) -> RankBlocks:
    """Tile P routed physical experts (and S shared slots) over E ranks.

    L_r = P // E + (1 if r < P % E else 0), a_r = r * (P // E) + min(r, P % E); with
    per_rank slots each rank's block holds its L_r routed experts then its S slots.
    """
    base, extra = divmod(p, e)
    ranks = np.arange(e, dtype=np.int64)
    counts = base + (ranks < extra)
    starts = ranks * base + np.minimum(ranks, extra)
    routed_owner = np.repeat(ranks, counts)
    per_rank_s = s if shared_slots == "per_rank" else 0
    if shared_slots == "per_rank":
        owner = np.repeat(ranks, counts + s)
    elif shared_slots == "global":
        owner = np.concatenate([routed_owner, np.full(s, -1, dtype=np.int64)])
    else:
        owner = routed_owner
    return RankBlocks(
        routed_starts=readonly(starts.astype(ID_DTYPE)),
        routed_counts=readonly(counts.astype(ID_DTYPE)),
        block_starts=readonly((starts + ranks * per_rank_s).astype(ID_DTYPE)),
        routed_id_map=readonly((np.arange(p, dtype=np.int64) + routed_owner * per_rank_s).astype(ID_DTYPE)),
        owner_rank=readonly(owner.astype(ID_DTYPE)),
    )


def num_physical_experts(p: int, e: int, s: int, shared_slots: str | None) -> int:
    """Size of the physical id space: P, P + S (global) or P + E*S (per_rank)."""
    if shared_slots == "global":
        return p + s
    if shared_slots == "per_rank":
        return p + e * s
    return p


def preferred_replicas(
    offsets: np.ndarray, ids: np.ndarray, n: int, start: int, count: int
) -> tuple[np.ndarray, np.ndarray]:
    """The replica CSR (``offsets``, ``ids``) of N logical experts narrowed to the replicas in
    [start, start + count) for each logical expert that has any there; read-only arrays."""
    lists = []
    for logical in range(n):
        held = ids[offsets[logical] : offsets[logical + 1]]
        local = held[(held >= start) & (held < start + count)]
        lists.append(local if local.size else held)
    new_offsets = np.zeros(n + 1, dtype=ID_DTYPE)
    np.cumsum([len(x) for x in lists], out=new_offsets[1:])
    return readonly(new_offsets), readonly(np.concatenate(lists).astype(ID_DTYPE))


def expert_map(size: int, start: int, count: int, block: int, p: int, s: int, shared_slots: str | None) -> np.ndarray:
    """Physical id -> local id on the rank holding routed [start, start + count) and the
    block starting at ``block``; -1 elsewhere. int32 [size], fresh and writable."""
    result = np.full(size, -1, dtype=ID_DTYPE)
    if shared_slots == "per_rank":
        result[block : block + count + s] = np.arange(count + s, dtype=ID_DTYPE)
    else:
        result[start : start + count] = np.arange(count, dtype=ID_DTYPE)
        if shared_slots == "global":
            result[p : p + s] = np.arange(count, count + s, dtype=ID_DTYPE)
    return result


def hashed_replica(offsets: np.ndarray, ids: np.ndarray, logical_id: int, token_row: int) -> int:
    """``ids[offsets[l] + ((t * REPLICA_HASH_MULTIPLIER) mod 2**32) % count]``."""
    first = int(offsets[logical_id])
    count = int(offsets[logical_id + 1]) - first
    hashed = (int(token_row) * REPLICA_HASH_MULTIPLIER) % REPLICA_HASH_MODULUS
    return int(ids[first + hashed % count])


def equal_blocks_problems(p: int, e: int, s: int, shared_slots: str | None) -> list[str]:
    """Why a layout does not suit equal-block backends; one sentence each, empty if it does."""
    problems = []
    if p % e:
        pad = -p % e
        problems.append(
            f"P % E != 0: {p} routed physical experts over {e} ranks leave a remainder "
            f"of {p % e}, so ranks hold {p // e + 1} or {p // e} routed experts; "
            f"equal-block backends need P divisible by E (add {pad} redundant experts "
            f"for P = {p + pad})"
        )
    if shared_slots == "global" and e > 1:
        problems.append(
            f"global shared slots (ids {p}..{p + s - 1}) are held "
            f"by all {e} ranks, outside the per-rank blocks; equal-block backends need "
            "shared_slots='per_rank'"
        )
    return problems
