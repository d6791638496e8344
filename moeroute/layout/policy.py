"""The shared-expert policy: who computes the shared expert, and the weight of a fused slot.

`resolve_shared` turns a requested shared mode (and slot mode) into the resolved one with
the sentence saying why (docs/semantics.md section 3); `shared_slot_weight` is the one
place a fused shared slot's weight is computed. Both are pure functions of the counts and
modes `moeroute.layout.ExpertLayout` was built with; the layout calls them once.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

from moeroute.layout._checks import LayoutError

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


@dataclasses.dataclass(frozen=True)
class SharedPlan:
    """The resolved shared-expert owner.

    Attributes
    ----------
    shared : {"none", "runner", "overlap", "fused"}
        Who computes the shared expert.
    shared_slots : {"global", "per_rank"} or None
        Where the fused slots live; None unless ``shared == "fused"``.
    home_rank_masked : bool
        A token's (global) shared slots are computed only on its home rank.
    reason : str
        One sentence saying who computes the shared expert and why.
    """

    shared: str
    shared_slots: str | None
    home_rank_masked: bool
    reason: str


def resolve_shared(
    num_shared_experts: int,
    ep_size: int,
    dispatch: str,
    unfusable_reason: str | None,
    shared: str,
    shared_slots: str | None,
) -> SharedPlan:
    """Resolve the requested ``shared`` / ``shared_slots`` (already known values).

    "auto" resolves to "fused" when fusion is valid, else "overlap" when E > 1, else
    "runner"; with S == 0 every request resolves to "none". A ``shared_slots`` request
    implies fusion.

    Raises
    ------
    LayoutError
        ``shared_slots`` with an explicit non-fused mode; "fused" (explicit, or implied by
        a ``shared_slots`` request) with an ``unfusable_reason``; "global" slots under
        all2all with E > 1.
    """
    s, e, reason = num_shared_experts, ep_size, unfusable_reason
    if s == 0:
        return SharedPlan(
            "none", None, False, "There is no shared expert (num_shared_experts=0), so nothing computes one."
        )
    if shared in ("runner", "overlap"):
        if shared_slots is not None:
            raise LayoutError(
                f"shared_slots={shared_slots!r} was requested with shared={shared!r}, but "
                "shared slots only exist when the shared expert is fused; drop shared_slots "
                "or use shared='fused'"
            )
        return SharedPlan(shared, None, False, _owner_sentence(shared, "requested", s, e, dispatch, None, False))

    fallback = "overlap" if e > 1 else "runner"
    fused_requested = shared == "fused" or shared_slots is not None
    if reason is not None:
        if fused_requested:
            what = (
                "shared='fused'"
                if shared == "fused"
                else f"shared_slots={shared_slots!r} (which needs a fused shared expert)"
            )
            raise LayoutError(
                f"{what} is impossible: {reason}. Use shared='overlap' or "
                f"shared='runner' (shared='auto' picks {fallback!r} here)"
            )
        return SharedPlan(
            fallback, None, False, _owner_sentence(fallback, f"auto: {reason}, so", s, e, dispatch, None, False)
        )

    slots = shared_slots if shared_slots is not None else ("global" if dispatch == "none" else "per_rank")
    if slots == "global" and dispatch == "all2all" and e > 1:
        raise LayoutError(
            f"shared_slots='global' cannot be served by dispatch='all2all' over {e} ranks: "
            "all-to-all backends tile the physical id space into contiguous per-rank "
            "blocks, so one global shared id would reach a single rank. Use "
            "shared_slots='per_rank' (one set of shared slots per rank), or "
            "shared='runner' / shared='overlap' to compute the shared expert outside "
            "the grouped GEMM"
        )
    masked = slots == "global" and dispatch == "allgather" and e > 1
    how = "requested" if shared == "fused" else ("auto: the shared expert splits into expert slots, so")
    return SharedPlan("fused", slots, masked, _owner_sentence("fused", how, s, e, dispatch, slots, masked))


def _owner_sentence(
    mode: str, why: str, s: int, e: int, dispatch: str, shared_slots: str | None, home_rank_masked: bool
) -> str:
    if why == "requested":
        prefix = f"shared={mode!r} was requested: "
    else:
        prefix = why[0].upper() + why[1:] + " "
    if mode == "fused":
        where = {
            "global": "global slots held by every rank",
            "per_rank": "per-rank slots, one set in each rank's block",
        }[shared_slots]
        tail = "; a token's slots are computed only on its home rank" if home_rank_masked else ""
        return f"{prefix}the grouped GEMM computes the shared expert as {s} extra expert slot(s) ({where}){tail}."
    if mode == "overlap":
        during = (
            f"while the {dispatch} dispatch over {e} ranks is in flight"
            if dispatch != "none"
            else "inside the pipeline, once (there is no dispatch)"
        )
        return f"{prefix}the pipeline runs the shared MLP {during}."
    return f"{prefix}the torch adapter runs the shared MLP on the local hidden states and adds it."


def shared_slot_weight(scaling_regime: str, gate: Any = None, routed_scaling_factor: float = 1.0) -> Any:
    """Weight of a fused shared slot (`moeroute.layout.ExpertLayout.shared_slot_weight`).

    ``gate * c`` (``c`` when ``gate`` is None), c = 1.0 for the "router" regime and
    1 / rsf for the "output" regime; ValueError for a non-finite or non-positive rsf.
    """
    rsf = routed_scaling_factor
    if isinstance(rsf, bool) or not isinstance(rsf, numbers.Real) or not math.isfinite(rsf) or rsf <= 0:
        raise ValueError(f"routed_scaling_factor={rsf!r} must be a finite real number > 0")
    scale = 1.0 if scaling_regime == "router" else 1.0 / float(rsf)
    if gate is None:
        return scale
    return gate * scale
