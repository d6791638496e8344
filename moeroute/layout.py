"""Expert layout: which rank holds which expert, and who computes the shared expert.

`ExpertLayout` is built once from the expert counts, the expert-parallel size, the
dispatch mode and the requested shared-expert mode, validated at construction, and
immutable afterwards (docs/semantics.md sections 2 and 3). Every code path that places experts,
appends shared slots or decides who runs the shared MLP reads this one object.

Id spaces
---------
logical id
    0..N-1, what the router outputs.
routed physical id
    0..P-1 with P = N + R: a logical expert or one of its replicas (EPLB).
    Physical p >= N replicates logical ``p % N`` unless a replica table is given. Rank r
    always holds a contiguous run of them; the placement ("linear", "round_robin" or a
    ``physical_to_logical`` table) says which logical expert each one computes.
physical id
    0..num_physical_experts-1, the id space of the grouped GEMM across all ranks:
    the routed physical ids plus the shared slots when the shared expert is fused.
    With ``per_rank`` slots, routed physical p held by rank r becomes p + r*S.
local id
    0..num_local_experts(rank)-1, the expert index within one rank's weights.

All id arrays are int32 NumPy arrays. Arrays held as attributes are read-only;
methods return fresh arrays. This module does not import torch.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from moeroute._validate import integer

__all__ = [
    "LayoutError",
    "ExpertLayout",
    "DISPATCH_MODES",
    "EP_DISPATCH_MODES",
    "SHARED_MODES",
    "SHARED_SLOT_MODES",
    "SCALING_REGIMES",
    "BACKEND_REQUIREMENTS",
    "PLACEMENTS",
    "REPLICA_HASH_MULTIPLIER",
    "MAX_PHYSICAL_EXPERTS",
]

#: "none": one rank; "all2all": tokens travel to the ranks holding their experts
#: (DeepEP-style); "allgather": every rank sees every token and results are reduced.
DISPATCH_MODES = ("none", "all2all", "allgather")
#: The dispatch modes that move tokens between ranks (torch.distributed dispatchers; "none"
#: is the single-rank pass-through).
EP_DISPATCH_MODES = tuple(mode for mode in DISPATCH_MODES if mode != "none")
#: Requested shared-expert owner; "auto" resolves to one of the other three.
SHARED_MODES = ("auto", "runner", "overlap", "fused")
#: Where fused shared slots live in the physical id space.
SHARED_SLOT_MODES = ("global", "per_rank")
#: "router": rsf is folded into the routed weights; "output": the combined routed
#: sum is multiplied by rsf afterwards.
SCALING_REGIMES = ("router", "output")
#: Requirements `ExpertLayout.check_backend` knows.
BACKEND_REQUIREMENTS = ("equal_blocks",)
#: How logical experts spread over the ranks: "linear" (rank r holds a contiguous run of
#: logical ids) or "round_robin" (rank r holds logical r, r+E, r+2E, ...).
PLACEMENTS = ("linear", "round_robin")

#: Knuth's multiplicative hash constant, floor(2**32 / golden ratio): consecutive
#: token rows land on well-spread replicas without any per-token state.
REPLICA_HASH_MULTIPLIER = 2654435769
#: The replica hash works modulo 2**32 so every backend computes it in uint32.
REPLICA_HASH_MODULUS = 2**32

_ID_DTYPE = np.int32
#: Largest physical expert count: ids are int32 (-1 marks "not held"), so every id in
#: [0, count) must fit in int32.
MAX_PHYSICAL_EXPERTS = int(np.iinfo(_ID_DTYPE).max)


class LayoutError(ValueError):
    """An expert layout that cannot work; the message says why and what to use instead."""


def _readonly(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


def _count(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int >= ``minimum`` (`moeroute._validate.integer`), LayoutError
    naming ``name`` otherwise."""
    return integer(name, value, minimum, error=LayoutError, type_error=LayoutError)


def _choice(name: str, value: Any, allowed: tuple, extra: str = "") -> None:
    if not isinstance(value, str) or value not in allowed:
        allowed_text = ", ".join(repr(a) for a in allowed)
        raise LayoutError(f"unknown {name}={value!r}; use one of {allowed_text}{extra}")


class ExpertLayout:
    """Placement of routed experts and shared slots over expert-parallel ranks.

    Parameters
    ----------
    num_routed_experts : int
        N, the number of routed (logical) experts; >= 1.
    num_shared_experts : int
        S, the number of shared expert slots (each of the routed intermediate
        size); 0 when the model has no shared expert.
    ep_size : int
        E, the number of expert-parallel ranks; >= 1.
    dispatch : {"none", "all2all", "allgather"}
        How tokens reach the experts; "none" requires E == 1.
    shared : {"auto", "runner", "overlap", "fused"}
        Who computes the shared expert. "auto" resolves to "fused" when fusion
        is valid, else "overlap" when E > 1, else "runner". With S == 0 every
        request resolves to "none".
    shared_slots : {"global", "per_rank"} or None
        Where fused shared slots live. None derives it from the dispatch:
        "global" for "none", "per_rank" for "all2all" and "allgather".
        A request implies fusion: it is refused when the shared expert cannot
        be fused or the dispatch cannot serve it.
    num_redundant_experts : int
        R, the number of replica experts; P = N + R routed physical experts.
    replica_table : array_like of int, shape [R], optional
        Logical id replicated by routed physical expert N + i. Default: ``(N + i) % N``.
    placement : {"linear", "round_robin"}
        Which logical experts each rank holds. The physical id space is always tiled into
        contiguous per-rank blocks (docs/semantics.md section 2); placement decides which logical expert
        each physical id computes. "linear": physical p computes logical p (p < N), or its
        replica table entry. "round_robin": take the P-long sequence of "linear"; rank r
        holds its entries r, r+E, r+2E, ... in that order (vLLM's round-robin placement:
        with R = 0, rank r holds logical r, r+E, ...).
    physical_to_logical : array_like of int, shape [P], optional
        Any EPLB table: the logical expert each routed physical expert computes, P >= N,
        every logical id present at least once. P - N is the number of redundant experts
        (``num_redundant_experts`` may be left 0 or must equal it); excludes
        ``replica_table`` and ``placement="round_robin"``.
    scaling_regime : {"router", "output"}
        Where rsf is applied; decides the fused shared slot weight
        (see `shared_slot_weight`).
    unfusable_reason : str, optional
        Why the shared MLP cannot become expert slots (it does not split into S
        slots of the routed size, or a routed_input_transform is set). "auto"
        then avoids "fused"; an explicit "fused" raises LayoutError quoting it.

    Raises
    ------
    LayoutError
        ep_size < 1; N < 1; negative S or R; N + R + E*S above `MAX_PHYSICAL_EXPERTS`
        (2**31 - 1: ids are int32), checked before anything is allocated; dispatch "none" with E > 1; P < E
        (a rank would hold no routed expert); an unknown dispatch, shared,
        shared_slots, scaling_regime or placement value; a replica table of the wrong
        length or with ids outside [0, N); a physical_to_logical table that is not a 1-D
        integer array of length P >= N with ids in [0, N) covering every logical id, or
        given with replica_table, placement="round_robin" or a disagreeing
        num_redundant_experts; "fused" (explicit, or implied by a
        shared_slots request) with an unfusable_reason; shared_slots with an
        explicit non-fused mode; "global" slots under all2all with E > 1.

    Examples
    --------
    N=8, S=1, E=2, all2all (per_rank slots): rank 0 holds ids 0..4 (routed 0..3,
    shared 4), rank 1 ids 5..9 (routed 4..7 -> 5..8, shared 9); a token from
    rank 1 gets shared id 9.

    >>> layout = ExpertLayout(8, 1, ep_size=2, dispatch="all2all")
    >>> layout.shared, layout.shared_slots, layout.num_physical_experts
    ('fused', 'per_rank', 10)
    >>> layout.shared_slot_ids(1).tolist()
    [9]
    """

    def __init__(
        self,
        num_routed_experts: int,
        num_shared_experts: int = 0,
        ep_size: int = 1,
        dispatch: str = "none",
        shared: str = "auto",
        shared_slots: str | None = None,
        num_redundant_experts: int = 0,
        *,
        replica_table: Any = None,
        scaling_regime: str = "router",
        unfusable_reason: str | None = None,
        placement: str = "linear",
        physical_to_logical: Any = None,
    ) -> None:
        n = _count("num_routed_experts", num_routed_experts, 1)
        s = _count("num_shared_experts", num_shared_experts, 0)
        e = _count("ep_size", ep_size, 1)
        r = _count("num_redundant_experts", num_redundant_experts, 0)
        _choice("placement", placement, PLACEMENTS)
        table = None
        if physical_to_logical is not None:
            table = _check_physical_to_logical(physical_to_logical, n)
            if replica_table is not None:
                raise LayoutError(
                    "physical_to_logical and replica_table both give the replicas; pass only "
                    "physical_to_logical (it covers every routed physical expert)"
                )
            if placement != "linear":
                raise LayoutError(
                    f"placement={placement!r} cannot be combined with physical_to_logical: the "
                    "table already says which logical expert each physical id computes; "
                    "reorder the table instead"
                )
            if r not in (0, table.shape[0] - n):
                raise LayoutError(
                    f"num_redundant_experts={r} disagrees with physical_to_logical of length "
                    f"{table.shape[0]} = N + {table.shape[0] - n}; leave it 0 or pass "
                    f"{table.shape[0] - n}"
                )
            r = table.shape[0] - n
        _choice("dispatch", dispatch, DISPATCH_MODES)
        _choice("shared", shared, SHARED_MODES)
        if shared_slots is not None:
            _choice("shared_slots", shared_slots, SHARED_SLOT_MODES, " or None (derived)")
        _choice("scaling_regime", scaling_regime, SCALING_REGIMES)
        if unfusable_reason is not None and (
            not isinstance(unfusable_reason, str) or not unfusable_reason.strip()
        ):
            raise LayoutError(
                f"unfusable_reason={unfusable_reason!r} must be None or a non-empty sentence"
            )
        if dispatch == "none" and e > 1:
            raise LayoutError(
                f"dispatch='none' serves a single rank but ep_size={e}; "
                "use dispatch='all2all' or dispatch='allgather'"
            )
        p = n + r
        # Checked before any table is allocated: the largest physical id space (per-rank
        # slots) must fit the int32 ids.
        if p + e * s > MAX_PHYSICAL_EXPERTS:
            raise LayoutError(
                f"N={n} + R={r} + ep_size*S={e}*{s} = {p + e * s} physical experts exceed the "
                f"int32 id limit {MAX_PHYSICAL_EXPERTS}; ids are int32"
            )
        if p < e:
            raise LayoutError(
                f"{p} routed physical experts (N={n} + R={r}) over ep_size={e} ranks would "
                f"leave a rank with no routed expert; use ep_size <= {p} or add "
                f"{e - p} redundant experts"
            )

        self._num_routed_experts = n
        self._num_shared_experts = s
        self._ep_size = e
        self._dispatch = dispatch
        self._num_redundant_experts = r
        self._scaling_regime = scaling_regime
        self._unfusable_reason = unfusable_reason
        self._requested_shared = shared
        self._requested_slots = shared_slots
        self._placement = placement if table is None else "table"
        self._physical_to_logical = self._build_replicas(replica_table, table)
        self._preferred_replicas = {}  # prefer_rank -> (offsets, ids), built on demand
        self._resolve_shared(shared, shared_slots)
        self._build_placement()
        self._frozen = True

    # ------------------------------------------------------------------ build

    def _build_replicas(self, replica_table: Any, full_table: np.ndarray | None = None) -> np.ndarray:
        n, r = self._num_routed_experts, self._num_redundant_experts
        self._replica_table_values = np.zeros(0, dtype=_ID_DTYPE)
        if full_table is not None:
            self._has_replica_table = False
            return self._replica_index(full_table.astype(np.int64))
        if replica_table is None:
            table = np.arange(n, n + r, dtype=np.int64) % n
            self._has_replica_table = False
        else:
            table = np.asarray(replica_table)
            if table.ndim != 1 or table.shape[0] != r:
                raise LayoutError(
                    f"replica_table has shape {table.shape}; it needs one logical id per "
                    f"redundant expert, shape [{r}]"
                )
            if r and not np.issubdtype(table.dtype, np.integer):
                raise LayoutError(f"replica_table must hold integers, got dtype {table.dtype}")
            bad = (table < 0) | (table >= n)
            if bad.any():
                raise LayoutError(
                    f"replica_table[{int(np.argmax(bad))}]={int(table[bad][0])} is not a "
                    f"logical expert id; ids must be in [0, {n})"
                )
            self._has_replica_table = True
            self._replica_table_values = table.astype(_ID_DTYPE)
        logical = np.concatenate([np.arange(n, dtype=np.int64), table.astype(np.int64)])
        if self._placement == "round_robin":
            # Rank r's block [a_r, a_r + L_r) takes entries r, r+E, r+2E, ... of the linear
            # sequence: L_r of them, exactly the block's length.
            e = self._ep_size
            logical = np.concatenate([logical[rank::e] for rank in range(e)])
        return self._replica_index(logical)

    def _replica_index(self, logical: np.ndarray) -> np.ndarray:
        """Set the replica CSR (offsets, ids) of the table ``logical`` [P]; return it int32."""
        n = self._num_routed_experts
        # Stable sort keeps each logical expert's replicas in ascending physical order.
        order = np.argsort(logical, kind="stable")
        self._replica_ids = _readonly(order.astype(_ID_DTYPE))
        counts = np.bincount(logical, minlength=n)
        offsets = np.zeros(n + 1, dtype=_ID_DTYPE)
        np.cumsum(counts, out=offsets[1:])
        self._replica_offsets = _readonly(offsets)
        return _readonly(logical.astype(_ID_DTYPE))

    def _resolve_shared(self, shared: str, shared_slots: str | None) -> None:
        s, e, dispatch = self._num_shared_experts, self._ep_size, self._dispatch
        reason = self._unfusable_reason
        self._home_rank_masked = False
        if s == 0:
            self._shared, self._shared_slots = "none", None
            self._shared_reason = (
                "There is no shared expert (num_shared_experts=0), so nothing computes one."
            )
            return
        if shared in ("runner", "overlap"):
            if shared_slots is not None:
                raise LayoutError(
                    f"shared_slots={shared_slots!r} was requested with shared={shared!r}, but "
                    "shared slots only exist when the shared expert is fused; drop shared_slots "
                    "or use shared='fused'"
                )
            self._shared, self._shared_slots = shared, None
            self._shared_reason = self._owner_sentence(shared, "requested")
            return

        fallback = "overlap" if e > 1 else "runner"
        fused_requested = shared == "fused" or shared_slots is not None
        if reason is not None:
            if fused_requested:
                what = (
                    "shared='fused'" if shared == "fused"
                    else f"shared_slots={shared_slots!r} (which needs a fused shared expert)"
                )
                raise LayoutError(
                    f"{what} is impossible: {reason}. Use shared='overlap' or "
                    f"shared='runner' (shared='auto' picks {fallback!r} here)"
                )
            self._shared, self._shared_slots = fallback, None
            self._shared_reason = self._owner_sentence(fallback, f"auto: {reason}, so")
            return

        slots = shared_slots if shared_slots is not None else (
            "global" if dispatch == "none" else "per_rank"
        )
        if slots == "global" and dispatch == "all2all" and e > 1:
            raise LayoutError(
                f"shared_slots='global' cannot be served by dispatch='all2all' over {e} ranks: "
                "all-to-all backends tile the physical id space into contiguous per-rank "
                "blocks, so one global shared id would reach a single rank. Use "
                "shared_slots='per_rank' (one set of shared slots per rank), or "
                "shared='runner' / shared='overlap' to compute the shared expert outside "
                "the grouped GEMM"
            )
        self._shared, self._shared_slots = "fused", slots
        self._home_rank_masked = slots == "global" and dispatch == "allgather" and e > 1
        how = "requested" if shared == "fused" else (
            "auto: the shared expert splits into expert slots, so"
        )
        self._shared_reason = self._owner_sentence("fused", how)

    def _owner_sentence(self, mode: str, why: str) -> str:
        s, e, dispatch = self._num_shared_experts, self._ep_size, self._dispatch
        if why == "requested":
            prefix = f"shared={mode!r} was requested: "
        else:
            prefix = why[0].upper() + why[1:] + " "
        if mode == "fused":
            where = {
                "global": "global slots held by every rank",
                "per_rank": "per-rank slots, one set in each rank's block",
            }[self._shared_slots]
            tail = (
                "; a token's slots are computed only on its home rank"
                if self._home_rank_masked else ""
            )
            return (
                f"{prefix}the grouped GEMM computes the shared expert as {s} extra expert "
                f"slot(s) ({where}){tail}."
            )
        if mode == "overlap":
            during = (
                f"while the {dispatch} dispatch over {e} ranks is in flight"
                if dispatch != "none" else "inside the pipeline, once (there is no dispatch)"
            )
            return f"{prefix}the pipeline runs the shared MLP {during}."
        return (
            f"{prefix}the torch adapter runs the shared MLP on the local hidden states "
            "and adds it."
        )

    def _build_placement(self) -> None:
        p, e, s = self.num_routed_physical, self._ep_size, self._num_shared_experts
        base, extra = divmod(p, e)
        ranks = np.arange(e, dtype=np.int64)
        counts = base + (ranks < extra)
        starts = ranks * base + np.minimum(ranks, extra)
        self._routed_starts = _readonly(starts.astype(_ID_DTYPE))
        self._routed_counts = _readonly(counts.astype(_ID_DTYPE))
        routed_owner = np.repeat(ranks, counts)

        slots = self._shared_slots
        per_rank_s = s if slots == "per_rank" else 0
        self._block_starts = _readonly((starts + ranks * per_rank_s).astype(_ID_DTYPE))
        self._routed_id_map = _readonly(
            (np.arange(p, dtype=np.int64) + routed_owner * per_rank_s).astype(_ID_DTYPE)
        )
        if slots == "per_rank":
            owner = np.repeat(ranks, counts + s)
        elif slots == "global":
            owner = np.concatenate([routed_owner, np.full(s, -1, dtype=np.int64)])
        else:
            owner = routed_owner
        self._owner_rank = _readonly(owner.astype(_ID_DTYPE))

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_frozen", False):
            raise AttributeError(f"ExpertLayout is immutable; cannot set {name!r}")
        object.__setattr__(self, name, value)

    # ------------------------------------------------------------ attributes

    @property
    def num_routed_experts(self) -> int:
        """N, the number of routed (logical) experts."""
        return self._num_routed_experts

    @property
    def num_shared_experts(self) -> int:
        """S, the number of shared expert slots."""
        return self._num_shared_experts

    @property
    def ep_size(self) -> int:
        """E, the number of expert-parallel ranks."""
        return self._ep_size

    @property
    def dispatch(self) -> str:
        """"none", "all2all" or "allgather"."""
        return self._dispatch

    @property
    def num_redundant_experts(self) -> int:
        """R, the number of replica (redundant) routed experts."""
        return self._num_redundant_experts

    @property
    def num_routed_physical(self) -> int:
        """P = N + R, the number of routed physical experts."""
        return self._num_routed_experts + self._num_redundant_experts

    @property
    def scaling_regime(self) -> str:
        """"router" (rsf in the routed weights) or "output" (rsf after combine)."""
        return self._scaling_regime

    @property
    def unfusable_reason(self) -> str | None:
        """Why the shared MLP cannot be fused, as given; None when it can."""
        return self._unfusable_reason

    @property
    def shared(self) -> str:
        """Resolved owner of the shared expert: "none", "runner", "overlap" or "fused"."""
        return self._shared

    @property
    def shared_reason(self) -> str:
        """One sentence saying who computes the shared expert and why."""
        return self._shared_reason

    @property
    def shared_slots(self) -> str | None:
        """"global" or "per_rank" when the shared expert is fused, else None."""
        return self._shared_slots

    @property
    def home_rank_masked(self) -> bool:
        """True when a token's (global) shared slots are computed only on its home rank.

        Global slots under allgather with E > 1: every rank holds the slots and sees
        every token, so the other ranks must drop the token's shared slots.
        """
        return self._home_rank_masked

    @property
    def num_physical_experts(self) -> int:
        """Size of the physical id space: P, P + S (global) or P + E*S (per_rank)."""
        p, s = self.num_routed_physical, self._num_shared_experts
        if self._shared_slots == "global":
            return p + s
        if self._shared_slots == "per_rank":
            return p + self._ep_size * s
        return p

    @property
    def routed_id_map(self) -> np.ndarray:
        """int32 [P], read-only: routed physical id -> physical id.

        ``p + owner(p) * S`` with per_rank slots, the identity otherwise.
        """
        return self._routed_id_map

    @property
    def owner_rank(self) -> np.ndarray:
        """int32 [num_physical_experts], read-only: the rank holding each physical id.

        -1 for global shared slots, which every rank holds.
        """
        return self._owner_rank

    @property
    def replica_offsets(self) -> np.ndarray:
        """int32 [N + 1], read-only: CSR offsets into `replica_ids` per logical expert."""
        return self._replica_offsets

    @property
    def replica_ids(self) -> np.ndarray:
        """int32 [P], read-only: routed physical ids grouped by logical expert.

        The replicas of logical l are ``replica_ids[replica_offsets[l]:replica_offsets[l+1]]``,
        ascending; with linear placement and no table the first one is l itself.
        """
        return self._replica_ids

    @property
    def physical_to_logical(self) -> np.ndarray:
        """int32 [P], read-only: the logical expert each routed physical expert computes."""
        return self._physical_to_logical

    @property
    def placement(self) -> str:
        """"linear", "round_robin", or "table" (built from ``physical_to_logical``)."""
        return self._placement

    def logical_experts(self, rank: int) -> np.ndarray:
        """int32 [L_r]: the logical expert of each routed local expert of ``rank``, in local
        id order (replicas included).

        Raises
        ------
        ValueError
            ``rank`` outside [0, E).
        """
        start, count = self.routed_range(rank)
        return self._physical_to_logical[start:start + count].copy()

    def preferred_replicas(self, prefer_rank: int) -> tuple[np.ndarray, np.ndarray]:
        """Replica CSR (offsets int32 [N + 1], ids int32 [P']) that keeps traffic on a rank.

        Logical l lists the replicas held by ``prefer_rank`` when it holds any, else all
        its replicas (as `replica_offsets` / `replica_ids`); ascending physical order.
        `logical_to_physical(..., prefer_rank=r)` hashes over these lists. Read-only arrays,
        built once per rank.

        Raises
        ------
        ValueError
            ``prefer_rank`` outside [0, E).
        """
        rank = self._check_rank("prefer_rank", prefer_rank)
        cached = self._preferred_replicas.get(rank)
        if cached is not None:
            return cached
        start, count = self.routed_range(rank)
        offsets, ids = self._replica_offsets, self._replica_ids
        lists = []
        for logical in range(self._num_routed_experts):
            replicas = ids[offsets[logical]:offsets[logical + 1]]
            local = replicas[(replicas >= start) & (replicas < start + count)]
            lists.append(local if local.size else replicas)
        new_offsets = np.zeros(self._num_routed_experts + 1, dtype=_ID_DTYPE)
        np.cumsum([len(x) for x in lists], out=new_offsets[1:])
        cached = (_readonly(new_offsets), _readonly(np.concatenate(lists).astype(_ID_DTYPE)))
        self._preferred_replicas[rank] = cached
        return cached

    # --------------------------------------------------------------- methods

    def _check_rank(self, name: str, rank: Any) -> int:
        rank = integer(name, rank)
        if not 0 <= rank < self._ep_size:
            raise ValueError(f"{name}={rank} is outside [0, {self._ep_size}) for ep_size={self._ep_size}")
        return int(rank)

    def routed_range(self, rank: int) -> tuple[int, int]:
        """Routed physical experts of ``rank``: ``(a_r, L_r)`` for ids [a_r, a_r + L_r).

        L_r = P // E + (1 if r < P % E else 0), a_r = r * (P // E) + min(r, P % E).

        Raises
        ------
        ValueError
            ``rank`` outside [0, E).
        """
        rank = self._check_rank("rank", rank)
        return int(self._routed_starts[rank]), int(self._routed_counts[rank])

    def num_local_experts(self, rank: int) -> int:
        """Experts whose weights ``rank`` holds: L_r, plus S when fused (both slot modes).

        Raises
        ------
        ValueError
            ``rank`` outside [0, E).
        """
        _, count = self.routed_range(rank)
        return count + (self._num_shared_experts if self._shared == "fused" else 0)

    def expert_map(self, rank: int) -> np.ndarray:
        """Physical id -> local id on ``rank``, -1 where ``rank`` does not hold the expert.

        Returns
        -------
        numpy.ndarray
            int32 [num_physical_experts], a fresh writable array. per_rank: the block
            [b_r, b_r + L_r + S) maps to 0..L_r+S-1. global: routed a_r.. -> 0..L_r-1
            and shared P+j -> L_r+j. Not fused: routed a_r.. -> 0..L_r-1.

        Raises
        ------
        ValueError
            ``rank`` outside [0, E).
        """
        start, count = self.routed_range(rank)
        result = np.full(self.num_physical_experts, -1, dtype=_ID_DTYPE)
        s = self._num_shared_experts
        if self._shared_slots == "per_rank":
            block = int(self._block_starts[rank])
            result[block : block + count + s] = np.arange(count + s, dtype=_ID_DTYPE)
        else:
            result[start : start + count] = np.arange(count, dtype=_ID_DTYPE)
            if self._shared_slots == "global":
                p = self.num_routed_physical
                result[p : p + s] = np.arange(count, count + s, dtype=_ID_DTYPE)
        return result

    def shared_slot_ids(self, home_rank: int) -> np.ndarray:
        """Physical ids of the shared slots used by tokens from ``home_rank``.

        Returns
        -------
        numpy.ndarray
            int32 [S]: global ``P + j``; per_rank ``b_h + L_h + j``; int32 [0] when
            the shared expert is not fused.

        Raises
        ------
        ValueError
            ``home_rank`` outside [0, E).
        """
        home_rank = self._check_rank("home_rank", home_rank)
        s = self._num_shared_experts
        if self._shared_slots == "global":
            first = self.num_routed_physical
        elif self._shared_slots == "per_rank":
            first = int(self._block_starts[home_rank]) + int(self._routed_counts[home_rank])
        else:
            return np.zeros(0, dtype=_ID_DTYPE)
        return np.arange(first, first + s, dtype=_ID_DTYPE)

    def choose_replica(self, logical_id: int, token_row: int) -> int:
        """Routed physical replica of ``logical_id`` that serves token row ``token_row``.

        Plain Python reference of the EPLB rule:
        ``replicas[((t * REPLICA_HASH_MULTIPLIER) mod 2**32) % count]``.

        Returns
        -------
        int
            A routed physical id in [0, P) (map it with `routed_id_map` to the
            physical id space).

        Raises
        ------
        ValueError
            ``logical_id`` outside [0, N) or a negative ``token_row``.
        """
        n = self._num_routed_experts
        if not 0 <= integer("logical_id", logical_id) < n:
            raise ValueError(f"logical_id={logical_id!r} must be an integer in [0, {n})")
        token_row = integer("token_row", token_row, 0)
        first = int(self._replica_offsets[logical_id])
        count = int(self._replica_offsets[logical_id + 1]) - first
        hashed = (int(token_row) * REPLICA_HASH_MULTIPLIER) % REPLICA_HASH_MODULUS
        return int(self._replica_ids[first + hashed % count])

    def check_backend(self, requirement: str = "equal_blocks") -> list[str]:
        """Explicit incompatibilities of this layout with a backend requirement.

        Parameters
        ----------
        requirement : {"equal_blocks"}
            "equal_blocks": every rank holds one contiguous block of the physical
            id space, all blocks the same size (DeepEP-, MoRI-style all-to-all).

        Returns
        -------
        list of str
            One sentence per incompatibility; empty when compatible.

        Raises
        ------
        ValueError
            Unknown ``requirement``; the message lists the allowed ones.
        """
        if requirement not in BACKEND_REQUIREMENTS:
            raise ValueError(
                f"unknown requirement={requirement!r}; use one of "
                + ", ".join(repr(r) for r in BACKEND_REQUIREMENTS)
            )
        problems = []
        p, e = self.num_routed_physical, self._ep_size
        if p % e:
            pad = -p % e
            problems.append(
                f"P % E != 0: {p} routed physical experts over {e} ranks leave a remainder "
                f"of {p % e}, so ranks hold {p // e + 1} or {p // e} routed experts; "
                f"equal-block backends need P divisible by E (add {pad} redundant experts "
                f"for P = {p + pad})"
            )
        if self._shared_slots == "global" and e > 1:
            problems.append(
                f"global shared slots (ids {p}..{p + self._num_shared_experts - 1}) are held "
                f"by all {e} ranks, outside the per-rank blocks; equal-block backends need "
                "shared_slots='per_rank'"
            )
        return problems

    def shared_slot_weight(self, gate: Any = None, routed_scaling_factor: float = 1.0) -> Any:
        """Weight of a fused shared slot: the one place it is computed (docs/semantics.md section 3).

        Parameters
        ----------
        gate : float, numpy.ndarray or tensor, optional
            Per-token shared gate g (e.g. sigmoid(x @ w_gate), shape [T] or [T, 1]);
            None for an ungated shared expert (g = 1).
        routed_scaling_factor : float
            rsf of the router configuration; finite and > 0.

        Returns
        -------
        float or the type of ``gate``
            ``gate * c`` (``c`` when ``gate`` is None), with c = 1.0 for the "router"
            regime (rsf already in the routed weights) and 1 / rsf for the "output"
            regime (the whole combined sum, shared slots included, is multiplied by
            rsf afterwards). The multiply is duck-typed; dtype and device follow ``gate``.

        Raises
        ------
        ValueError
            A non-finite or non-positive ``routed_scaling_factor``.
        """
        rsf = routed_scaling_factor
        if isinstance(rsf, bool) or not isinstance(rsf, numbers.Real) \
                or not math.isfinite(rsf) or rsf <= 0:
            raise ValueError(
                f"routed_scaling_factor={rsf!r} must be a finite real number > 0"
            )
        scale = 1.0 if self._scaling_regime == "router" else 1.0 / float(rsf)
        if gate is None:
            return scale
        return gate * scale

    def describe(self) -> str:
        """Readable summary: physical count, per-rank table, shared slots, owner, backend.

        Returns
        -------
        str
            Multi-line text; each rank's row gives its physical id range, local
            expert count, routed physical range and shared slot ids.
        """
        n, s, e = self._num_routed_experts, self._num_shared_experts, self._ep_size
        p, r = self.num_routed_physical, self._num_redundant_experts
        lines = [
            f"ExpertLayout: {n} routed + {s} shared expert(s), {r} redundant, "
            f"ep_size={e}, dispatch={self._dispatch}",
        ]
        if self._shared_slots == "per_rank":
            composition = f"{p} routed + {e} x {s} per-rank shared slots"
        elif self._shared_slots == "global":
            composition = f"{p} routed + {s} global shared slots"
        else:
            composition = f"{p} routed, no shared slots"
        lines.append(f"physical experts: {self.num_physical_experts} ({composition})")

        rows = [("rank", "physical ids", "local experts", "routed physical", "shared slot ids")]
        for rank in range(e):
            start, count = self.routed_range(rank)
            slot_ids = self.shared_slot_ids(rank)
            if self._shared_slots == "per_rank":
                block = int(self._block_starts[rank])
                physical = f"[{block}, {block + count + s})"
                routed = f"[{start}, {start + count}) -> [{block}, {block + count})"
            else:
                physical = f"[{start}, {start + count})"
                if self._shared_slots == "global":
                    physical += f" + [{p}, {p + s})"
                routed = f"[{start}, {start + count})"
            slots_text = _id_span(slot_ids) if slot_ids.size else "-"
            rows.append((str(rank), physical, str(self.num_local_experts(rank)), routed, slots_text))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                  for row in rows]

        if self._shared_slots == "per_rank":
            lines.append(
                f"shared slots: per_rank; each rank's block ends with its own {s} slot(s) "
                "and a token uses the slots of its home rank"
            )
        elif self._shared_slots == "global":
            masked = " (computed only on the token's home rank)" if self._home_rank_masked else ""
            local = "local id L_r" if s == 1 else f"local ids L_r..L_r+{s - 1}"
            lines.append(
                f"shared slots: global ids {_id_span(self.shared_slot_ids(0))}, held by every "
                f"rank as {local}{masked}"
            )
        else:
            lines.append("shared slots: none (the shared expert is not fused)")
        lines.append(f"shared expert: {self._shared}. {self._shared_reason}")
        if self._placement == "linear":
            if r:
                replicas = ", ".join(
                    f"{n + i}->{int(self._physical_to_logical[n + i])}" for i in range(min(r, 16))
                )
                more = f", ... ({r - 16} more)" if r > 16 else ""
                lines.append(f"replicas (physical->logical): {replicas}{more}")
        else:
            how = ("round_robin: rank r holds entries r, r+E, r+2E, ... of the linear sequence"
                   if self._placement == "round_robin" else "physical_to_logical table")
            lines.append(f"placement: {how}; logical experts of each rank, in local id order:")
            for rank in range(e):
                logical = self.logical_experts(rank).tolist()
                shown = ", ".join(str(x) for x in logical[:_DESCRIBE_MAX_IDS])
                more = f", ... ({len(logical) - _DESCRIBE_MAX_IDS} more)" \
                    if len(logical) > _DESCRIBE_MAX_IDS else ""
                lines.append(f"  rank {rank}: {shown}{more}")
        lines.append(f"scaling regime: {self._scaling_regime}")
        problems = self.check_backend("equal_blocks")
        lines.append(
            "equal-block backends (DeepEP/MoRI-style): "
            + ("compatible" if not problems else "incompatible: " + "; ".join(problems))
        )
        return "\n".join(lines)

    # ------------------------------------------------------------- identity

    def _key(self) -> tuple:
        return (
            self._num_routed_experts, self._num_shared_experts, self._ep_size,
            self._dispatch, self._shared, self._shared_slots, self._num_redundant_experts,
            # The full table: it says what every placement (linear, round-robin, any table) does.
            tuple(self._physical_to_logical.tolist()),
            self._scaling_regime, self._unfusable_reason,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ExpertLayout):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        parts = [
            f"num_routed_experts={self._num_routed_experts}",
            f"num_shared_experts={self._num_shared_experts}",
            f"ep_size={self._ep_size}",
            f"dispatch={self._dispatch!r}",
        ]
        if self._shared != "none":
            # The resolved mode: the repr rebuilds an equal layout.
            parts.append(f"shared={self._shared!r}")
        if self._shared_slots is not None:
            parts.append(f"shared_slots={self._shared_slots!r}")
        parts.append(f"num_redundant_experts={self._num_redundant_experts}")
        if self._placement == "table":
            parts.append(f"physical_to_logical={self._physical_to_logical.tolist()!r}")
        elif self._has_replica_table:
            parts.append(
                "replica_table="
                + repr(self._replica_table_values.tolist())
            )
        if self._placement == "round_robin":
            parts.append("placement='round_robin'")
        if self._scaling_regime != "router":
            parts.append(f"scaling_regime={self._scaling_regime!r}")
        if self._unfusable_reason is not None:
            parts.append(f"unfusable_reason={self._unfusable_reason!r}")
        return f"ExpertLayout({', '.join(parts)})"


#: describe() lists at most this many logical ids per rank.
_DESCRIBE_MAX_IDS = 16


def _check_physical_to_logical(table: Any, num_routed: int) -> np.ndarray:
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


def _id_span(ids: np.ndarray) -> str:
    """'9' for one id, '9..12' for a contiguous run."""
    first, last = int(ids[0]), int(ids[-1])
    return str(first) if first == last else f"{first}..{last}"
