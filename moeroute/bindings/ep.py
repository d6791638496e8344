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

Debug mode (``debug=True``, same value on every rank): every (token, slot) with a valid id
is checked to be dispatched to exactly one rank, with a local id that maps back to the
slot's physical id, and to be combined exactly once at home (the receivers' slot masks
travel back along the partial outputs and are counted). A mismatch raises
`DispatchCheckError`. The checks cost extra collectives and host syncs: tests only.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from moeroute.bindings.torch.dispatch import (
    DispatchHandle,
    Dispatcher,
    LocalDispatcher,
    check_dispatch_inputs,
    register_ep_dispatcher_factory,
)
from moeroute.bindings.torch.fp8_experts import FP8_DTYPE, FP8Activations
from moeroute.bindings.torch.group import (
    CollectiveError,
    RankMismatchError,
    check_ranks_agree,
    ep_group_size_and_rank,
    fields_digest,
    layout_fingerprint,
)
from moeroute.layout import EP_DISPATCH_MODES, ExpertLayout

__all__ = [
    "All2AllDispatcher",
    "AllGatherDispatcher",
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

#: Each slot travels with an int32 id (local id for all2all, physical id for allgather)
#: and a float32 weight.
METADATA_BYTES_PER_SLOT = 8
#: Row counts travel as int64: the dtype every backend supports for all-to-all of counts.
_COUNT_DTYPE = torch.int64
_COUNT_BYTES = 8
# torch 2.13 renamed all_gather_into_tensor (same signature); older releases lack the new name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class DispatchCheckError(RuntimeError):
    """Debug mode found a (token, slot) dispatched or combined other than exactly once."""


@dataclasses.dataclass
class TransferStats:
    """Bytes one rank sent to other ranks in one forward (dispatch + combine).

    Attributes
    ----------
    rows_sent : int
        Token rows sent to other ranks by the dispatch (allgather: padded rows x (E-1)).
    hidden_bytes : int
        Hidden-state bytes of those rows: rows_sent x H x element size (1 with FP8
        dispatch).
    metadata_bytes : int
        Slot ids and weights that travel with the rows: rows_sent x K' x
        `METADATA_BYTES_PER_SLOT`.
    count_bytes : int
        The row-count exchange that precedes the rows.
    combine_bytes : int
        Partial outputs sent back to their home ranks (0 until `combine` runs).
    scale_bytes : int
        FP8 dispatch: the float32 activation scales of those rows, rows_sent x groups x 4
        (0 for float rows).
    """

    rows_sent: int = 0
    hidden_bytes: int = 0
    metadata_bytes: int = 0
    count_bytes: int = 0
    combine_bytes: int = 0
    scale_bytes: int = 0

    @property
    def token_bytes(self) -> int:
        """The token rows as they travel: values plus (FP8) their scales."""
        return self.hidden_bytes + self.scale_bytes

    @property
    def dispatch_bytes(self) -> int:
        """Token rows, their scales and their metadata: what the dispatch itself moves."""
        return self.hidden_bytes + self.scale_bytes + self.metadata_bytes

    @property
    def total_bytes(self) -> int:
        """Every byte of the forward: dispatch, counts and combine."""
        return self.dispatch_bytes + self.count_bytes + self.combine_bytes

    def __add__(self, other: TransferStats) -> TransferStats:
        if not isinstance(other, TransferStats):
            return NotImplemented
        return TransferStats(*(a + b for a, b in zip(dataclasses.astuple(self),
                                                     dataclasses.astuple(other))))

    def as_dict(self) -> dict[str, int]:
        """All fields plus ``token_bytes``, ``dispatch_bytes`` and ``total_bytes`` (for JSON)."""
        out = dataclasses.asdict(self)
        out["token_bytes"] = self.token_bytes
        out["dispatch_bytes"] = self.dispatch_bytes
        out["total_bytes"] = self.total_bytes
        return out


# --------------------------------------------------------------------------- construction


def _check_group(layout: ExpertLayout, group: Any) -> tuple[Any, int]:
    """The process group (default group when None) and this rank in it."""
    if group is not None:
        ep_group_size_and_rank(group)  # TypeError for what is not a process group
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "ep_group needs an initialized torch.distributed process group; call "
            "torch.distributed.init_process_group first"
        )
    world = dist.get_world_size(group)
    if world != layout.ep_size:
        raise ValueError(
            f"ep_group has {world} ranks but layout.ep_size={layout.ep_size}; build the "
            f"layout with ep_size={world} or pass a group of {layout.ep_size} ranks"
        )
    return group, dist.get_rank(group)


def _check_layout(layout: Any, dispatch: str) -> ExpertLayout:
    if not isinstance(layout, ExpertLayout):
        raise TypeError(f"layout must be an ExpertLayout, got {type(layout).__name__}")
    if layout.dispatch != dispatch:
        raise ValueError(
            f"layout.dispatch={layout.dispatch!r} but this dispatcher serves {dispatch!r}; "
            f"build the layout with dispatch={dispatch!r}"
        )
    return layout


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
        Count that every (token, slot) is dispatched and combined exactly once; raises
        `DispatchCheckError` otherwise. Must be the same on every rank.

    Returns
    -------
    Dispatcher
        `All2AllDispatcher`, `AllGatherDispatcher`, or `LocalDispatcher` for
        dispatch "none" (one rank, nothing travels).

    Raises
    ------
    TypeError
        ``layout`` is not an ExpertLayout.
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
    if dispatch == "none":
        return LocalDispatcher(layout)
    cls = All2AllDispatcher if dispatch == "all2all" else AllGatherDispatcher
    return cls(layout, ep_group, debug=debug)


# --------------------------------------------------------------------------- shared machinery


@dataclasses.dataclass
class _Tables:
    """Layout tables as int64 tensors on one device (index_select wants int64)."""

    owner: torch.Tensor          # [num_physical] owning rank, -1 = held by every rank
    local: torch.Tensor          # [E, num_physical] local id on each rank, -1 = not held
    local_to_physical: torch.Tensor  # [E, max_local] physical id of each local expert


@dataclasses.dataclass
class _ForwardState:
    """What `combine` needs from its `dispatch`; lives in ``DispatchHandle.state``."""

    dispatcher: Any
    num_tokens: int
    valid: torch.Tensor | None          # [T, K'] bool, debug only: slots with a valid id
    stats: TransferStats
    combined: bool = False
    received: tuple | None = None       # filled by wait()
    # all2all
    send_token_index: torch.Tensor | None = None   # [M] int64, token row of each sent row
    send_counts: list[int] | None = None           # rows to each rank
    recv_counts: list[int] | None = None           # rows from each rank
    # allgather
    sizes: list[int] | None = None                 # T of every rank


def _as_flag(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}={value!r} must be a bool, got {type(value).__name__}")
    return bool(value)


class _EPDispatcher(Dispatcher):
    """Shared parts of the torch.distributed dispatchers."""

    mode: str = ""
    #: ``dispatch`` takes FP8Activations as well as float rows (``MoE(dispatch_dtype="fp8")``).
    carries_fp8 = True

    def __init__(self, layout: ExpertLayout, group: Any = None, *, debug: bool = False) -> None:
        self.layout = _check_layout(layout, self.mode)
        self.group, self.rank = _check_group(layout, group)
        self.debug = _as_flag("debug", debug)
        self.ep_size = layout.ep_size
        self.num_physical_experts = layout.num_physical_experts
        self.last_stats: TransferStats | None = None
        self.cumulative_stats = TransferStats()
        self.forward_count = 0
        self._host_tables = self._build_tables()
        self._tables_on: dict[torch.device, _Tables] = {}
        self._layout_fields = layout_fingerprint(layout)
        self._layout_digest = fields_digest(self._layout_fields)

    def _signature(self, hidden_states: torch.Tensor, top_k: int) -> list[int]:
        """What every rank must agree on before an exchange, as int64-safe integers."""
        return [hidden_states.shape[1], zlib.crc32(_row_format(hidden_states).encode()), top_k,
                int(self.debug), self._layout_digest]

    def _check_signatures(self, signatures: list[list[int]], hidden_states: torch.Tensor,
                          top_k: int) -> None:
        """Raise `RankMismatchError` on every rank unless every rank sent the same signature.

        ``signatures[r]`` is rank r's `_signature`; every rank holds the same list, so all
        of them take the same branch and join the same detail exchange.
        """
        if all(row == signatures[0] for row in signatures[1:]):
            return
        fields = {"hidden_states.shape[1]": hidden_states.shape[1],
                  "hidden_states.dtype": _row_format(hidden_states),
                  "topk_ids.shape[1]": top_k, "debug": self.debug, **self._layout_fields}
        check_ranks_agree(fields, self.group, f"the {self.mode} dispatch")
        raise RankMismatchError(  # the digests differ, the fields do not: never expected
            f"the expert-parallel ranks sent different {self.mode} signatures {signatures}",
            {"signature": signatures})

    def _build_tables(self) -> _Tables:
        layout, e = self.layout, self.ep_size
        local = np.stack([layout.expert_map(r) for r in range(e)]).astype(np.int64)
        max_local = max(layout.num_local_experts(r) for r in range(e))
        local_to_physical = np.full((e, max_local), -1, dtype=np.int64)
        for r in range(e):
            held = np.nonzero(local[r] >= 0)[0]
            local_to_physical[r, local[r, held]] = held
        return _Tables(
            owner=torch.from_numpy(layout.owner_rank.astype(np.int64)),
            local=torch.from_numpy(local),
            local_to_physical=torch.from_numpy(local_to_physical),
        )

    def _tables(self, device: torch.device) -> _Tables:
        tables = self._tables_on.get(device)
        if tables is None:
            host = self._host_tables
            tables = _Tables(*(t.to(device) for t in (host.owner, host.local,
                                                      host.local_to_physical)))
            self._tables_on[device] = tables
        return tables

    def _collective(self, what: str, fn, *args, **kwargs):
        """Run one torch.distributed call; a failure names the step and the likely cause."""
        try:
            return fn(*args, group=self.group, **kwargs)
        except RuntimeError as error:
            raise self._collective_error(what, error) from error

    def _wait_all(self, what: str, works) -> None:
        try:
            for work in works:
                work.wait()
        except RuntimeError as error:
            raise self._collective_error(what, error) from error

    def _collective_error(self, what: str, error: Exception) -> CollectiveError:
        return CollectiveError(
            f"{self.mode} rank {self.rank} of {self.ep_size}: {what} failed; a peer rank "
            f"exited or did not reach this collective within the process group's timeout "
            f"({error})"
        )

    @property
    def bytes_sent(self) -> int:
        """Bytes the last forward sent to other ranks (dispatch + counts + combine); 0 before."""
        return 0 if self.last_stats is None else self.last_stats.total_bytes

    def _valid_and_safe(self, topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots with an id in [0, num_physical) and the ids clamped for table lookups."""
        ids = topk_ids.long()
        valid = (ids >= 0) & (ids < self.num_physical_experts)
        return valid, torch.where(valid, ids, torch.zeros_like(ids))

    def _start_forward(self, num_tokens: int, valid: torch.Tensor) -> _ForwardState:
        stats = TransferStats()
        self.last_stats = stats
        self.forward_count += 1
        return _ForwardState(dispatcher=self, num_tokens=num_tokens,
                             valid=valid if self.debug else None, stats=stats)

    def _handle(self, state: _ForwardState, finish, async_op: bool) -> DispatchHandle:
        def wait_fn():
            state.received = finish()
            return state.received

        if async_op:
            return DispatchHandle(wait_fn=wait_fn, state=state, num_tokens=state.num_tokens)
        return DispatchHandle(wait_fn(), state=state, num_tokens=state.num_tokens)

    def _check_combine_args(self, partial_out: Any, handle: Any) -> _ForwardState:
        if not isinstance(handle, DispatchHandle):
            raise TypeError(f"handle must be a DispatchHandle, got {type(handle).__name__}")
        state = handle.state
        if not isinstance(state, _ForwardState) or state.dispatcher is not self:
            raise ValueError("handle was not returned by this dispatcher's dispatch()")
        if state.combined:
            raise RuntimeError(
                "this dispatch was already combined; each handle combines exactly once"
            )
        if not isinstance(partial_out, torch.Tensor):
            raise TypeError(f"partial_out must be a torch.Tensor, got {type(partial_out).__name__}")
        recv_hidden = handle.wait()[0]
        if partial_out.dim() != 2 or partial_out.shape[0] != recv_hidden.shape[0]:
            raise ValueError(
                f"partial_out must be [Tr={recv_hidden.shape[0]}, H], one row per received "
                f"row, got shape {tuple(partial_out.shape)}"
            )
        if partial_out.device != recv_hidden.device:
            raise ValueError(
                f"partial_out is on {partial_out.device}, the dispatch on {recv_hidden.device}"
            )
        # The dispatch checked that every rank sent rows of this width and dtype; holding the
        # partials to the same keeps the combine's transfer sizes equal on every rank.
        if partial_out.shape[1] != recv_hidden.shape[1] or partial_out.dtype != recv_hidden.dtype:
            raise ValueError(
                f"partial_out must have the dispatched rows' width and dtype "
                f"[Tr, {recv_hidden.shape[1]}] {recv_hidden.dtype}, got "
                f"{tuple(partial_out.shape)} {partial_out.dtype}"
            )
        return state

    def _finish_forward(self, state: _ForwardState) -> None:
        state.combined = True
        self.cumulative_stats = self.cumulative_stats + state.stats

    def _check_counts(self, counts: torch.Tensor, valid: torch.Tensor, what: str) -> None:
        """Raise DispatchCheckError unless ``counts`` is 1 at valid slots and 0 elsewhere."""
        bad = counts != valid.to(counts.dtype)
        if bool(bad.any()):
            t, k = (int(i) for i in bad.nonzero()[0])
            raise DispatchCheckError(
                f"rank {self.rank}: token row {t}, slot {k} was {what} "
                f"{int(counts[t, k])} time(s); expected {int(valid[t, k])} "
                f"({int(bad.sum())} (token, slot) entries wrong)"
            )


def _pack_metadata(ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """int32 [rows, 2K']: ids then the weights' float32 bits (one collective for both)."""
    return torch.cat([ids.to(torch.int32), weights.to(torch.float32).view(torch.int32)], dim=1)


def _unpack_metadata(meta: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return meta[:, :top_k].contiguous(), meta[:, top_k:].contiguous().view(torch.float32)


def _rows_as_sent(hidden_states) -> tuple[torch.Tensor, Any]:
    """(the 2-D tensor the collectives move, how to read it back).

    Float rows travel as they are. FP8Activations travel as one uint8 row each: H bytes of
    e4m3 values, then the row's float32 scales as 4 x groups bytes (gloo and NCCL both move
    uint8; one collective instead of two).
    """
    if not isinstance(hidden_states, FP8Activations):
        return hidden_states, None
    hidden_states.check()
    rows = torch.cat([hidden_states.q.view(torch.uint8), hidden_states.scales.contiguous().view(torch.uint8)],
                     dim=1)
    return rows, hidden_states


def _rows_as_received(rows: torch.Tensor, like) -> Any:
    """Inverse of `_rows_as_sent`: float rows, or FP8Activations shaped like ``like``'s."""
    if like is None:
        return rows
    hidden = like.q.shape[1]
    return FP8Activations(rows[:, :hidden].contiguous().view(FP8_DTYPE),
                          rows[:, hidden:].contiguous().view(torch.float32), like.group_size, like.dtype)


def _row_bytes(hidden_states) -> tuple[int, int]:
    """(value bytes, scale bytes) of one token row as it travels."""
    if isinstance(hidden_states, FP8Activations):
        return hidden_states.q.shape[1], hidden_states.scales.shape[1] * hidden_states.scales.element_size()
    return hidden_states.shape[1] * hidden_states.element_size(), 0


def _row_format(hidden_states) -> str:
    """How the token rows travel, for the ranks' agreement check."""
    if isinstance(hidden_states, FP8Activations):
        return (f"float8_e4m3fn with {hidden_states.scales.shape[1]} float32 scales per row "
                f"(activations {hidden_states.dtype})")
    return str(hidden_states.dtype)


# --------------------------------------------------------------------------- all2all


class All2AllDispatcher(_EPDispatcher):
    """Tokens travel once to each rank holding one of their slots (docs/semantics.md section 6).

    Parameters
    ----------
    layout : ExpertLayout
        ``dispatch == "all2all"``; ``ep_size`` equal to the group size.
    group : torch.distributed.ProcessGroup, optional
        The expert-parallel group (None: the default group); its timeout bounds every
        collective.
    debug : bool
        Check that every (token, slot) is dispatched and combined exactly once.

    Attributes
    ----------
    last_stats : TransferStats or None
        Bytes of the latest forward. ``rows_sent`` = unique (token, destination rank)
        pairs with a destination other than this rank.
    cumulative_stats : TransferStats
        Sum over every forward.

    Raises
    ------
    TypeError
        ``layout`` is not an ExpertLayout, ``debug`` not a bool.
    ValueError
        ``layout.dispatch != "all2all"``, no initialized process group, or a group size
        other than ``layout.ep_size``.
    """

    mode = "all2all"

    def _destinations(self, valid: torch.Tensor, safe: torch.Tensor,
                      tables: _Tables) -> tuple[torch.Tensor, torch.Tensor]:
        """Owner rank and owner-local id of every slot, -1 for invalid slots.

        Slots held by every rank (global shared slots, E == 1 only here) stay at home.
        """
        owner = tables.owner[safe]
        owner = torch.where(owner < 0, torch.full_like(owner, self.rank), owner)
        owner = torch.where(valid, owner, torch.full_like(owner, -1))
        local = tables.local[owner.clamp(min=0), safe]
        return owner, torch.where(valid, local, torch.full_like(local, -1))

    def dispatch(self, hidden_states, topk_ids, topk_weights, *, async_op=False):
        """Send each token once to every rank holding one of its slots.

        Parameters
        ----------
        hidden_states : Tensor [T, H], activation dtype, or FP8Activations
            FP8 rows with their scales (FP8 dispatch): they travel as they are and
            ``recv_hidden`` is FP8Activations of the received rows.
        topk_ids : Tensor [T, K'] int32
            Physical ids; ids outside [0, num_physical_experts) are not routed.
        topk_weights : Tensor [T, K'] float32
        async_op : bool
            Return once the rows are in flight (the count exchange has completed);
            ``handle.wait()`` completes the transfer.

        Returns
        -------
        DispatchHandle
            ``wait()`` -> recv_hidden [Tr, H] (dtype of hidden_states), recv_local_ids
            [Tr, K'] int32 (-1 for slots held elsewhere), recv_weights [Tr, K'] float32
            (0 where the local id is -1). Rows are grouped by source rank, ascending,
            and within a source by token row.

        Raises
        ------
        TypeError, ValueError
            Bad arguments (see ``check_dispatch_inputs``); ``async_op`` not a bool.
        DispatchCheckError
            Debug mode only: a slot dispatched other than once.
        CollectiveError
            A collective failed (dead peer, timeout of the process group).
        """
        rows, fp8 = _rows_as_sent(hidden_states)
        check_dispatch_inputs(rows, topk_ids, topk_weights)
        async_op = _as_flag("async_op", async_op)
        device, e = rows.device, self.ep_size
        num_tokens, top_k = topk_ids.shape
        tables = self._tables(device)
        valid, safe = self._valid_and_safe(topk_ids)
        owner, local = self._destinations(valid, safe, tables)
        state = self._start_forward(num_tokens, valid)

        # in_rank[t, d]: token t has a slot on rank d; column 0 absorbs invalid slots.
        in_rank = torch.zeros(num_tokens, e + 1, dtype=torch.bool, device=device)
        in_rank.scatter_(1, owner + 1, True)
        in_rank = in_rank[:, 1:]
        pairs = in_rank.t().nonzero()  # row-major: by destination, then token row
        send_dest, send_token = pairs[:, 0], pairs[:, 1]
        send_counts_t = in_rank.sum(dim=0, dtype=_COUNT_DTYPE)

        live = owner.index_select(0, send_token) == send_dest[:, None]
        send_local = torch.where(live, local.index_select(0, send_token),
                                 torch.full_like(live, -1, dtype=torch.int64))
        send_weights = torch.where(live, topk_weights.index_select(0, send_token),
                                   torch.zeros((), dtype=torch.float32, device=device))
        if self.debug:
            self._check_dispatched_once(topk_ids, valid, send_token, send_dest, send_local,
                                        tables)

        # One collective of fixed width for the counts, the live-slot counts per destination
        # (debug only, else 0) and this rank's signature, sent to every rank alike.
        live_per_dest = torch.zeros(e, dtype=_COUNT_DTYPE, device=device)
        if self.debug:
            live_per_dest.index_add_(0, send_dest, live.sum(dim=1, dtype=_COUNT_DTYPE))
        signature = torch.tensor(self._signature(hidden_states, top_k), dtype=_COUNT_DTYPE,
                                 device=device).expand(e, -1)
        counts_out = torch.cat([send_counts_t[:, None], live_per_dest[:, None], signature], dim=1)
        counts_in = torch.empty_like(counts_out)
        self._collective("row-count exchange", dist.all_to_all_single, counts_in, counts_out)
        received = counts_in.tolist()
        self._check_signatures([row[2:] for row in received], hidden_states, top_k)
        send_counts = send_counts_t.tolist()
        recv_counts = [row[0] for row in received]
        state.send_token_index, state.send_counts, state.recv_counts = (
            send_token, send_counts, recv_counts)

        send_hidden = rows.index_select(0, send_token)
        send_meta = _pack_metadata(send_local, send_weights)
        num_recv = sum(recv_counts)
        recv_hidden = rows.new_empty((num_recv, rows.shape[1]))
        recv_meta = send_meta.new_empty((num_recv, 2 * top_k))
        works = [
            self._collective("token dispatch", dist.all_to_all_single, recv_hidden,
                             send_hidden, recv_counts, send_counts, async_op=True),
            self._collective("metadata dispatch", dist.all_to_all_single, recv_meta,
                             send_meta, recv_counts, send_counts, async_op=True),
        ]

        rows_out = send_token.shape[0] - send_counts[self.rank]
        stats = state.stats
        stats.rows_sent = rows_out
        value_bytes, scale_bytes = _row_bytes(hidden_states)
        stats.hidden_bytes, stats.scale_bytes = rows_out * value_bytes, rows_out * scale_bytes
        stats.metadata_bytes = rows_out * top_k * METADATA_BYTES_PER_SLOT
        stats.count_bytes = (e - 1) * counts_out.shape[1] * _COUNT_BYTES

        expected_live = counts_in[:, 1].sum().item() if self.debug else None

        def finish():
            self._wait_all("token dispatch", works)
            recv_local, recv_weights = _unpack_metadata(recv_meta, top_k)
            if self.debug:
                self._check_received(recv_local, expected_live)
            return _rows_as_received(recv_hidden, fp8), recv_local, recv_weights

        return self._handle(state, finish, async_op)

    def _check_dispatched_once(self, topk_ids, valid, send_token, send_dest, send_local,
                               tables) -> None:
        """Every valid slot is live in exactly one sent row, under an id that maps back."""
        counts = torch.zeros(topk_ids.shape, dtype=torch.int64, device=topk_ids.device)
        counts.index_add_(0, send_token, (send_local >= 0).long())
        self._check_counts(counts, valid, "dispatched")
        rows, slots = (send_local >= 0).nonzero(as_tuple=True)
        physical = tables.local_to_physical[send_dest[rows], send_local[rows, slots]]
        wrong = physical != topk_ids.long()[send_token[rows], slots]
        if bool(wrong.any()):
            i = int(wrong.nonzero()[0, 0])
            t, k, d = int(send_token[rows[i]]), int(slots[i]), int(send_dest[rows[i]])
            raise DispatchCheckError(
                f"rank {self.rank}: token row {t}, slot {k} (physical id "
                f"{int(topk_ids[t, k])}) was sent to rank {d} as local id "
                f"{int(send_local[rows[i], k])}, which is physical id {int(physical[i])} there"
            )

    def _check_received(self, recv_local: torch.Tensor, expected_live: int) -> None:
        held = self.layout.num_local_experts(self.rank)
        out_of_range = (recv_local < -1) | (recv_local >= held)
        if bool(out_of_range.any()):
            raise DispatchCheckError(
                f"rank {self.rank} received local id {int(recv_local[out_of_range][0])}; "
                f"it holds local ids [0, {held})"
            )
        got = int((recv_local >= 0).sum())
        if got != expected_live:
            raise DispatchCheckError(
                f"rank {self.rank} received {got} live slots; the senders dispatched "
                f"{expected_live}"
            )

    def combine(self, partial_out, handle):
        """Send the weighted partial outputs home and sum them per token.

        Parameters
        ----------
        partial_out : Tensor [Tr, H]
            Per received row, the sum over its local slots of ``w * expert(x)``.
        handle : DispatchHandle
            From this dispatcher's `dispatch`; waited here if it was not yet.

        Returns
        -------
        Tensor [T, H], dtype of ``partial_out``: for each of this rank's tokens the sum
        of every rank's partial output, accumulated in float32.

        Raises
        ------
        TypeError
            ``partial_out`` not a tensor, ``handle`` not a DispatchHandle.
        ValueError
            A handle from another dispatcher, ``partial_out`` not [Tr, H] or on another
            device.
        RuntimeError
            The handle was already combined.
        CollectiveError
            A collective failed (dead peer, timeout of the process group).
        DispatchCheckError
            Debug mode only: a slot combined other than once.
        """
        state = self._check_combine_args(partial_out, handle)
        partial_out = partial_out.contiguous()
        hidden = partial_out.shape[1]
        returned = partial_out.new_empty((state.send_token_index.shape[0], hidden))
        self._collective("combine", dist.all_to_all_single, returned, partial_out,
                         state.send_counts, state.recv_counts)
        rows_out = sum(state.recv_counts) - state.recv_counts[self.rank]
        state.stats.combine_bytes = rows_out * hidden * partial_out.element_size()
        out = torch.zeros((state.num_tokens, hidden), dtype=torch.float32,
                          device=partial_out.device)
        out.index_add_(0, state.send_token_index, returned.to(torch.float32))
        if self.debug:
            self._check_combined_once(state, handle)
        self._finish_forward(state)
        return out.to(partial_out.dtype)

    def _check_combined_once(self, state: _ForwardState, handle: DispatchHandle) -> None:
        # The receivers' live masks travel home on the partials' path and are counted there.
        recv_local = handle.wait()[1]
        live = (recv_local >= 0).to(torch.int32)
        returned = live.new_empty((state.send_token_index.shape[0], live.shape[1]))
        self._collective("debug combine count", dist.all_to_all_single, returned, live,
                         state.send_counts, state.recv_counts)
        counts = torch.zeros(state.valid.shape, dtype=torch.int32, device=live.device)
        counts.index_add_(0, state.send_token_index, returned)
        self._check_counts(counts, state.valid, "combined")


# --------------------------------------------------------------------------- allgather


class AllGatherDispatcher(_EPDispatcher):
    """Every rank sees every token and computes its local experts (docs/semantics.md section 6).

    Parameters
    ----------
    layout : ExpertLayout
        ``dispatch == "allgather"``; ``ep_size`` equal to the group size.
    group : torch.distributed.ProcessGroup, optional
        The expert-parallel group (None: the default group); its timeout bounds every
        collective.
    debug : bool
        Check that every (token, slot) is computed on exactly one rank and combined once.

    Attributes
    ----------
    last_stats : TransferStats or None
        Bytes of the latest forward: ``rows_sent`` = (E - 1) x the padded row count.
    cumulative_stats : TransferStats
        Sum over every forward.

    Raises
    ------
    TypeError
        ``layout`` is not an ExpertLayout, ``debug`` not a bool.
    ValueError
        ``layout.dispatch != "allgather"``, no initialized process group, or a group
        size other than ``layout.ep_size``.
    """

    mode = "allgather"

    def dispatch(self, hidden_states, topk_ids, topk_weights, *, async_op=False):
        """All-gather every rank's tokens with their slot ids and weights.

        Parameters
        ----------
        hidden_states : Tensor [T, H], activation dtype, or FP8Activations
            FP8 rows with their scales (FP8 dispatch): they travel as they are and
            ``recv_hidden`` is FP8Activations of the received rows.
        topk_ids : Tensor [T, K'] int32
            Physical ids; ids outside [0, num_physical_experts) are not routed.
        topk_weights : Tensor [T, K'] float32
        async_op : bool
            Return once the gather is in flight (the size exchange has completed);
            ``handle.wait()`` completes it.

        Returns
        -------
        DispatchHandle
            ``wait()`` -> recv_hidden [Tr, H] with Tr = sum of every rank's T, rows of
            rank 0 first; recv_local_ids [Tr, K'] int32 (-1 for slots held elsewhere,
            and for global shared slots of other ranks' tokens); recv_weights [Tr, K']
            float32 (0 where the local id is -1).

        Raises
        ------
        TypeError, ValueError
            Bad arguments (see ``check_dispatch_inputs``); ``async_op`` not a bool.
        DispatchCheckError
            Debug mode only: a slot computed on other than exactly one rank.
        CollectiveError
            A collective failed (dead peer, timeout of the process group).
        """
        rows, fp8 = _rows_as_sent(hidden_states)
        check_dispatch_inputs(rows, topk_ids, topk_weights)
        async_op = _as_flag("async_op", async_op)
        device, e = rows.device, self.ep_size
        num_tokens, top_k = topk_ids.shape
        width = rows.shape[1]
        valid, _ = self._valid_and_safe(topk_ids)
        state = self._start_forward(num_tokens, valid)

        # The token counts travel with every rank's signature (one gather of fixed width).
        mine = [num_tokens] + self._signature(hidden_states, top_k)
        sizes_t = torch.empty(e * len(mine), dtype=_COUNT_DTYPE, device=device)
        self._collective("token-count gather", _all_gather_single, sizes_t,
                         torch.tensor(mine, dtype=_COUNT_DTYPE, device=device))
        gathered = sizes_t.view(e, len(mine)).tolist()
        self._check_signatures([row[1:] for row in gathered], hidden_states, top_k)
        sizes = [row[0] for row in gathered]
        state.sizes = sizes
        padded_rows = max(sizes)

        send_hidden = rows.new_zeros((padded_rows, width))
        send_hidden[:num_tokens] = rows
        send_meta = torch.full((padded_rows, 2 * top_k), -1, dtype=torch.int32, device=device)
        send_meta[:num_tokens] = _pack_metadata(topk_ids, topk_weights)
        gathered_hidden = rows.new_empty((e * padded_rows, width))
        gathered_meta = send_meta.new_empty((e * padded_rows, 2 * top_k))
        works = [
            self._collective("token gather", _all_gather_single, gathered_hidden,
                             send_hidden, async_op=True),
            self._collective("metadata gather", _all_gather_single, gathered_meta,
                             send_meta, async_op=True),
        ]

        stats = state.stats
        stats.rows_sent = (e - 1) * padded_rows
        value_bytes, scale_bytes = _row_bytes(hidden_states)
        stats.hidden_bytes, stats.scale_bytes = stats.rows_sent * value_bytes, stats.rows_sent * scale_bytes
        stats.metadata_bytes = stats.rows_sent * top_k * METADATA_BYTES_PER_SLOT
        stats.count_bytes = (e - 1) * len(mine) * _COUNT_BYTES

        def finish():
            self._wait_all("token gather", works)
            if all(size == padded_rows for size in sizes):
                recv_hidden, recv_meta = gathered_hidden, gathered_meta
            else:
                keep = torch.cat([
                    torch.arange(r * padded_rows, r * padded_rows + size, device=device)
                    for r, size in enumerate(sizes)
                ])
                recv_hidden = gathered_hidden.index_select(0, keep)
                recv_meta = gathered_meta.index_select(0, keep)
            recv_ids, recv_weights = _unpack_metadata(recv_meta, top_k)
            recv_local = self._local_ids(recv_ids, sizes)
            recv_weights = torch.where(recv_local >= 0, recv_weights,
                                       torch.zeros((), dtype=torch.float32, device=device))
            if self.debug:
                self._check_dispatched_once(recv_ids, recv_local)
            return _rows_as_received(recv_hidden, fp8), recv_local, recv_weights

        return self._handle(state, finish, async_op)

    def _local_ids(self, recv_ids: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """This rank's local id of every gathered slot; global slots only for own tokens."""
        tables = self._tables(recv_ids.device)
        valid, safe = self._valid_and_safe(recv_ids)
        local = tables.local[self.rank][safe]
        keep = valid
        if self.layout.home_rank_masked:
            source = torch.repeat_interleave(
                torch.arange(self.ep_size, device=recv_ids.device),
                torch.tensor(sizes, device=recv_ids.device))
            held_by_all = tables.owner[safe] < 0
            keep = keep & ~(held_by_all & (source != self.rank)[:, None])
        return torch.where(keep, local, torch.full_like(local, -1)).to(torch.int32)

    def _check_dispatched_once(self, recv_ids: torch.Tensor, recv_local: torch.Tensor) -> None:
        """Across ranks, every valid gathered slot is live on exactly one rank."""
        counts = (recv_local >= 0).to(torch.int32)
        self._collective("debug dispatch count", dist.all_reduce, counts)
        valid, _ = self._valid_and_safe(recv_ids)
        self._check_counts(counts, valid, "dispatched (summed over ranks)")

    def combine(self, partial_out, handle):
        """Return every rank's partial rows to their home ranks and sum them there.

        Parameters
        ----------
        partial_out : Tensor [Tr, H]
            Per gathered row, the sum over its local slots of ``w * expert(x)``.
        handle : DispatchHandle
            From this dispatcher's `dispatch`; waited here if it was not yet.

        Returns
        -------
        Tensor [T, H], dtype of ``partial_out``: for each of this rank's tokens the sum
        of the E ranks' partial outputs, accumulated in float32.

        Raises
        ------
        TypeError
            ``partial_out`` not a tensor, ``handle`` not a DispatchHandle.
        ValueError
            A handle from another dispatcher, ``partial_out`` not [Tr, H] or on another
            device.
        RuntimeError
            The handle was already combined.
        CollectiveError
            A collective failed (dead peer, timeout of the process group).
        DispatchCheckError
            Debug mode only: a slot combined other than once.
        """
        state = self._check_combine_args(partial_out, handle)
        partial_out = partial_out.contiguous()
        out = self._reduce_home(partial_out, state.sizes, state.num_tokens)
        hidden = partial_out.shape[1]
        rows_out = sum(state.sizes) - state.sizes[self.rank]
        state.stats.combine_bytes = rows_out * hidden * partial_out.element_size()
        if self.debug:
            live = (handle.wait()[1] >= 0).to(torch.int32)
            counts = self._reduce_home(live, state.sizes, state.num_tokens)
            self._check_counts(counts.round().to(torch.int32), state.valid, "combined")
        self._finish_forward(state)
        return out.to(partial_out.dtype)

    def _reduce_home(self, rows: torch.Tensor, sizes: list[int], num_tokens: int) -> torch.Tensor:
        """float32 [T, C]: the sum over ranks of each rank's rows for this rank's tokens."""
        returned = rows.new_empty((self.ep_size * num_tokens, rows.shape[1]))
        self._collective("combine", dist.all_to_all_single, returned, rows,
                         [num_tokens] * self.ep_size, sizes)
        return returned.view(self.ep_size, num_tokens, rows.shape[1]).to(torch.float32).sum(0)


register_ep_dispatcher_factory(make_dispatcher)  # the torch module's default for ep_group
