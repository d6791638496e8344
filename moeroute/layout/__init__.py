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
methods return fresh arrays. This package does not import torch.

Rooms
-----
`moeroute.layout.policy`
    The shared-expert policy: who computes the shared expert, the fused slot weight.
`moeroute.layout.placement`
    Replica tables, the per-rank blocks of the physical id space, expert maps.
`moeroute.layout.describe`
    The readable summary (`ExpertLayout.describe`).

`ExpertLayout` (here) checks its arguments, builds itself from those rooms once and
answers every question about the layout.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moeroute._validate import integer
from moeroute.layout import describe as _describe
from moeroute.layout import placement as _placement
from moeroute.layout._checks import ID_DTYPE as _ID_DTYPE
from moeroute.layout._checks import MAX_PHYSICAL_EXPERTS, LayoutError
from moeroute.layout._checks import choice as _choice
from moeroute.layout._checks import count as _count
from moeroute.layout.placement import (
    BACKEND_REQUIREMENTS,
    PLACEMENTS,
    REPLICA_HASH_MODULUS,  # noqa: F401  (re-exported: part of moeroute.layout's names)
    REPLICA_HASH_MULTIPLIER,
)
from moeroute.layout.policy import (
    DISPATCH_MODES,
    EP_DISPATCH_MODES,
    SCALING_REGIMES,
    SHARED_MODES,
    SHARED_SLOT_MODES,
    resolve_shared,
    shared_slot_weight,
)

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
            table = _placement.check_physical_to_logical(physical_to_logical, n)
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
        if unfusable_reason is not None and (not isinstance(unfusable_reason, str) or not unfusable_reason.strip()):
            raise LayoutError(f"unfusable_reason={unfusable_reason!r} must be None or a non-empty sentence")
        if dispatch == "none" and e > 1:
            raise LayoutError(
                f"dispatch='none' serves a single rank but ep_size={e}; use dispatch='all2all' or dispatch='allgather'"
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
        replicas = _placement.build_replicas(n, r, e, placement, replica_table, table)
        self._physical_to_logical = replicas.physical_to_logical
        self._replica_offsets, self._replica_ids = replicas.offsets, replicas.ids
        self._replica_table_values = replicas.replica_table
        self._has_replica_table = replicas.has_replica_table
        self._preferred_replicas = {}  # prefer_rank -> (offsets, ids), built on demand
        plan = resolve_shared(s, e, dispatch, unfusable_reason, shared, shared_slots)
        self._shared, self._shared_slots = plan.shared, plan.shared_slots
        self._home_rank_masked, self._shared_reason = plan.home_rank_masked, plan.reason
        blocks = _placement.rank_blocks(p, e, s, self._shared_slots)
        self._routed_starts, self._routed_counts = blocks.routed_starts, blocks.routed_counts
        self._block_starts = blocks.block_starts
        self._routed_id_map, self._owner_rank = blocks.routed_id_map, blocks.owner_rank
        self._frozen = True

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
        """ "none", "all2all" or "allgather"."""
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
        """ "router" (rsf in the routed weights) or "output" (rsf after combine)."""
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
        """ "global" or "per_rank" when the shared expert is fused, else None."""
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
        return _placement.num_physical_experts(
            self.num_routed_physical, self._ep_size, self._num_shared_experts, self._shared_slots
        )

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
        """ "linear", "round_robin", or "table" (built from ``physical_to_logical``)."""
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
        return self._physical_to_logical[start : start + count].copy()

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
        cached = _placement.preferred_replicas(
            self._replica_offsets, self._replica_ids, self._num_routed_experts, start, count
        )
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
        return _placement.expert_map(
            self.num_physical_experts,
            start,
            count,
            int(self._block_starts[rank]),
            self.num_routed_physical,
            self._num_shared_experts,
            self._shared_slots,
        )

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
        return _placement.hashed_replica(self._replica_offsets, self._replica_ids, logical_id, token_row)

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
                f"unknown requirement={requirement!r}; use one of " + ", ".join(repr(r) for r in BACKEND_REQUIREMENTS)
            )
        return _placement.equal_blocks_problems(
            self.num_routed_physical, self._ep_size, self._num_shared_experts, self._shared_slots
        )

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
        return shared_slot_weight(self._scaling_regime, gate, routed_scaling_factor)

    def describe(self) -> str:
        """Readable summary: physical count, per-rank table, shared slots, owner, backend.

        Returns
        -------
        str
            Multi-line text; each rank's row gives its physical id range, local
            expert count, routed physical range and shared slot ids.
        """
        return _describe.describe(self)

    # ------------------------------------------------------------- identity

    def _key(self) -> tuple:
        return (
            self._num_routed_experts,
            self._num_shared_experts,
            self._ep_size,
            self._dispatch,
            self._shared,
            self._shared_slots,
            self._num_redundant_experts,
            # The full table: it says what every placement (linear, round-robin, any table) does.
            tuple(self._physical_to_logical.tolist()),
            self._scaling_regime,
            self._unfusable_reason,
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
            parts.append("replica_table=" + repr(self._replica_table_values.tolist()))
        if self._placement == "round_robin":
            parts.append("placement='round_robin'")
        if self._scaling_regime != "router":
            parts.append(f"scaling_regime={self._scaling_regime!r}")
        if self._unfusable_reason is not None:
            parts.append(f"unfusable_reason={self._unfusable_reason!r}")
        return f"ExpertLayout({', '.join(parts)})"
