"""Expert parallelism on torch.distributed: the all2all and allgather dispatchers.

Both implement `moeroute.bindings.torch.dispatch.Dispatcher` with the collectives every torch
backend offers on its devices (gloo on CPU, NCCL on GPU); nothing here owns a transport, a
thread or a timeout of its own. Every collective runs on the process group given at
construction and inherits that group's timeout, so a dead or stalled peer makes the
surviving ranks raise instead of hanging. What each dispatcher moves, the debug checks
(`CheckedDispatcher`), the byte counts (`TransferStats`) and the rank-agreement signature
(`RankMismatchError`): docs/semantics.md section 6; FP8 rows (``FP8Activations``, one uint8
row of values then scales): docs/quant.md, "FP8 dispatch".

allgather pads every rank's rows to the largest count, as gloo's all-gather needs equal sizes.
Its combine returns each home rank's rows with one ``all_to_all_single`` rather than an
all-reduce of the padded buffer, which would send about twice as much and leave every rank
holding every token's result: the exchange sends (E-1)/E of the gathered partials per rank,
as a reduce-scatter would, and unlike one keeps the reduction in float32 when the partials
are bfloat16 (NCCL would sum in bfloat16).

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


def make_dispatcher(
    layout: ExpertLayout, ep_group: Any = None, dispatch: str | None = None, *, debug: bool = False
) -> Dispatcher:
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
