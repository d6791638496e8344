"""Expert parallelism on torch.distributed: the all2all and allgather dispatchers.

Both implement `moeroute.bindings.torch.dispatch.Dispatcher` (docs/semantics.md section 6) with the
collectives every torch backend offers on its devices (gloo on CPU, NCCL on GPU); nothing
here owns a transport, a thread or a timeout of its own. Every collective runs on the
process group given at construction and inherits that group's timeout, so a dead or stalled
peer makes the surviving ranks raise instead of hanging.

all2all (DeepEP-style)
    1. The per-destination row counts are exchanged in one ``all_to_all_single``.
    2. Each token travels ONCE to each rank that holds at least one of its slots (not once
       per slot), together with its metadata for that rank: the local expert id of every
       slot held there (-1 for slots held elsewhere) and the slot weights.
    3. ``combine`` sends the already-weighted partial outputs back with the inverse
       ``all_to_all_single`` and sums them per token in float32 (``index_add_``).
    A token's per-rank shared slots belong to its home rank, so they are computed at home
    and never travel.

allgather
    1. Token counts are all-gathered; every rank pads its rows to the largest count
       (gloo's all-gather needs equal sizes) and all-gathers hidden states and metadata
       (physical ids + weights).
    2. Each rank maps every gathered slot to its local expert id; global shared slots
       (held by every rank) are kept only on the token's home rank
       (``layout.home_rank_masked``), so the shared expert is computed once.
    3. ``combine`` returns each home rank's rows with one ``all_to_all_single`` (exact,
       unpadded splits) and sums the E contributions in float32 at home. This sends
       (E-1)/E of the gathered partials per rank, as a reduce-scatter would, while an
       all-reduce of the padded buffer would send about twice that and leave every rank
       holding every token's result; unlike a reduce-scatter it also keeps the reduction
       in float32 when the partials are bfloat16 (NCCL would sum in bfloat16).

FP8 dispatch: ``dispatch`` also takes the rows as
`moeroute.bindings.torch.fp8_experts.FP8Activations` (e4m3 values with their float32 scales per
token group, quantized once by the sender; ``MoE(..., dispatch_dtype="fp8")``). Both travel in
one uint8 buffer per row (H bytes of values, then 4 x groups bytes of scales) through the same
collectives as float rows, and the receiver gets FP8Activations back, bit for bit; the
partial outputs still return in the activation dtype.

Byte accounting: each forward (one dispatch and its combine) records a `TransferStats`
with the bytes this rank sent to OTHER ranks (rows a rank keeps for itself are copied,
not sent): ``dispatcher.last_stats`` and the running ``dispatcher.cumulative_stats``.

Agreement between ranks: every rank must run the same layer. Before every exchange the
ranks compare a fixed-size signature (hidden size, activation dtype, slots per token, debug
flag and a digest of the layout) carried by the size exchange that starts each dispatch
(all2all: the row counts; allgather: the token counts), so a disagreement is found before
any transfer whose sizes depend on it. Every rank then sees every rank's signature and
raises the same `RankMismatchError` naming the field and each rank's value, where gloo would
otherwise abort the process ("Received data size doesn't match") or, for sizes that happen
to line up, return a wrong result. `check_ranks_agree` compares any set of named fields
(the MoE module exchanges its full configuration with it once, at construction).

Debug mode (``make_dispatcher(..., debug=True)``, same value on every rank) is a wrapper,
`CheckedDispatcher`, around the plain dispatcher; the dispatchers' own dispatch and
combine have no debug branch. After the dispatch, every rank sends the local ids it
received back to the tokens' home ranks along the partial outputs' path, and the home rank
checks that every (token, slot) with a valid id is live on exactly one rank, under a local
id that maps back to the slot's physical id there; after the combine, the receivers' slot
masks travel home the same way and each (token, slot) must be counted exactly once. A
mismatch raises `DispatchCheckError` naming the token row, slot and rank. The checks cost
one extra all-to-all each (two per forward) and host syncs: tests only. They are not
counted in the transfer statistics, which stay the plain dispatcher's. The debug flag is
part of the agreement signature, so ranks that disagree on it raise `RankMismatchError`.

Modules: `moeroute.bindings.ep.stats` (`TransferStats`), `moeroute.bindings.ep.all2all`,
`moeroute.bindings.ep.allgather`, `moeroute.bindings.ep.checked` (debug mode), and
``_base`` (what both dispatchers share: checks, tables, the agreement signature, the hooks
debug mode checks through); the rank-agreement fields themselves are
`moeroute.bindings.torch.group`'s. Every name is importable from `moeroute.bindings.ep`.
"""

from __future__ import annotations

from typing import Any

from moeroute.bindings.ep._base import _as_flag
from moeroute.bindings.ep.all2all import All2AllDispatcher
from moeroute.bindings.ep.allgather import AllGatherDispatcher
from moeroute.bindings.ep.checked import CheckedDispatcher, DispatchCheckError
from moeroute.bindings.ep.stats import METADATA_BYTES_PER_SLOT, TransferStats
from moeroute.bindings.torch.dispatch import Dispatcher, LocalDispatcher, register_ep_dispatcher_factory
from moeroute.bindings.torch.group import (
    CollectiveError,
    RankMismatchError,
    check_ranks_agree,
    ep_group_size_and_rank,
    layout_fingerprint,
)
from moeroute.layout import EP_DISPATCH_MODES, ExpertLayout

__all__ = [
    "All2AllDispatcher",
    "AllGatherDispatcher",
    "CheckedDispatcher",
    "CollectiveError",
    "DispatchCheckError",
    "RankMismatchError",
    "check_ranks_agree",
    "layout_fingerprint",
    "ep_group_size_and_rank",
    "TransferStats",
    "make_dispatcher",
    "EP_DISPATCH_MODES",
    "METADATA_BYTES_PER_SLOT",
]


def make_dispatcher(layout: ExpertLayout, ep_group: Any = None, dispatch: str | None = None,
                    *, debug: bool = False) -> Dispatcher:
    """The dispatcher serving ``layout`` on ``ep_group``.

    Parameters
    ----------
    layout : ExpertLayout
        Placement the physical ids refer to; ``layout.ep_size`` must equal the group size.
    ep_group : torch.distributed.ProcessGroup, optional
        The expert-parallel group; None means the default (world) group.
    dispatch : {"all2all", "allgather", "none"}, optional
        Must equal ``layout.dispatch`` when given (None: take the layout's).
    debug : bool
        Wrap the dispatcher in a `CheckedDispatcher`, which checks that every (token, slot)
        is dispatched and combined exactly once and raises `DispatchCheckError` otherwise.
        Must be the same on every rank. Ignored for dispatch "none".

    Returns
    -------
    Dispatcher
        `All2AllDispatcher`, `AllGatherDispatcher` (wrapped in `CheckedDispatcher` when
        ``debug``), or `LocalDispatcher` for dispatch "none" (one rank, nothing travels).

    Raises
    ------
    TypeError
        ``layout`` is not an ExpertLayout, ``debug`` not a bool.
    ValueError
        Unknown ``dispatch``, ``dispatch`` differing from ``layout.dispatch``, no
        initialized process group, or a group size other than ``layout.ep_size``.
    """
    if not isinstance(layout, ExpertLayout):
        raise TypeError(f"layout must be an ExpertLayout, got {type(layout).__name__}")
    if dispatch is None:
        dispatch = layout.dispatch
    allowed = ("none",) + EP_DISPATCH_MODES
    if not isinstance(dispatch, str) or dispatch not in allowed:
        raise ValueError(f"unknown dispatch={dispatch!r}; use one of {allowed}")
    if dispatch != layout.dispatch:
        raise ValueError(
            f"dispatch={dispatch!r} differs from layout.dispatch={layout.dispatch!r}; the "
            "layout's shared slots and placement were resolved for its own dispatch mode"
        )
    debug = _as_flag("debug", debug)
    if dispatch == "none":
        return LocalDispatcher(layout)
    cls = All2AllDispatcher if dispatch == "all2all" else AllGatherDispatcher
    dispatcher = cls(layout, ep_group)
    return CheckedDispatcher(dispatcher) if debug else dispatcher


register_ep_dispatcher_factory(make_dispatcher)  # the torch module's default for ep_group
