"""The parts both torch.distributed dispatchers share: argument checks, the layout tables,
the rank-agreement signature exchanged before every transfer, the row formats (float or FP8),
the byte accounting and the two hooks debug mode (`moeroute.bindings.ep.checked`) checks
through (see `moeroute.bindings.ep`)."""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from moeroute.bindings.ep.stats import TransferStats
from moeroute.bindings.torch.dispatch import DispatchHandle, Dispatcher
from moeroute.experts.formats.fp8 import FP8_DTYPE, FP8Activations
from moeroute.bindings.torch.group import (
    CollectiveError,
    RankMismatchError,
    check_ranks_agree,
    ep_group_size_and_rank,
    fields_digest,
    layout_fingerprint,
)
from moeroute.layout import ExpertLayout

#: Row counts travel as int64: the dtype every backend supports for all-to-all of counts.
_COUNT_DTYPE = torch.int64
_COUNT_BYTES = 8
# torch 2.13 renamed all_gather_into_tensor (same signature); older releases lack the new name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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


@dataclasses.dataclass
class _Tables:
    """Layout tables as int64 tensors on one device (index_select wants int64)."""

    owner: torch.Tensor  # [num_physical] owning rank, -1 = held by every rank
    local: torch.Tensor  # [E, num_physical] local id on each rank, -1 = not held
    local_to_physical: torch.Tensor  # [E, max_local] physical id of each local expert


@dataclasses.dataclass
class _ForwardState:
    """What `combine` needs from its `dispatch`; lives in ``DispatchHandle.state``."""

    dispatcher: Any
    num_tokens: int
    stats: TransferStats
    combined: bool = False
    received: tuple | None = None  # filled by wait()
    # all2all
    send_token_index: torch.Tensor | None = None  # [M] int64, token row of each sent row
    send_counts: list[int] | None = None  # rows to each rank
    recv_counts: list[int] | None = None  # rows from each rank
    # allgather
    sizes: list[int] | None = None  # T of every rank


def _as_flag(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}={value!r} must be a bool, got {type(value).__name__}")
    return bool(value)


class _EPDispatcher(Dispatcher):
    """Shared parts of the torch.distributed dispatchers."""

    mode: str = ""
    #: ``dispatch`` takes FP8Activations as well as float rows (``MoE(dispatch_dtype="fp8")``).
    carries_fp8 = True

    def __init__(self, layout: ExpertLayout, group: Any = None) -> None:
        self.layout = _check_layout(layout, self.mode)
        self.group, self.rank = _check_group(layout, group)
        #: True once a `CheckedDispatcher` wraps this dispatcher (it sets the flag). The
        #: dispatcher never reads it except into its rank-agreement signature, so ranks with
        #: and without debug mode raise RankMismatchError instead of mismatching collectives.
        self.debug = False
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
        return [
            hidden_states.shape[1],
            zlib.crc32(_row_format(hidden_states).encode()),
            top_k,
            int(self.debug),
            self._layout_digest,
        ]

    def _check_signatures(self, signatures: list[list[int]], hidden_states: torch.Tensor, top_k: int) -> None:
        """Raise `RankMismatchError` on every rank unless every rank sent the same signature.

        ``signatures[r]`` is rank r's `_signature`; every rank holds the same list, so all
        of them take the same branch and join the same detail exchange.
        """
        if all(row == signatures[0] for row in signatures[1:]):
            return
        fields = {
            "hidden_states.shape[1]": hidden_states.shape[1],
            "hidden_states.dtype": _row_format(hidden_states),
            "topk_ids.shape[1]": top_k,
            "debug": self.debug,
            **self._layout_fields,
        }
        check_ranks_agree(fields, self.group, f"the {self.mode} dispatch")
        raise RankMismatchError(  # the digests differ, the fields do not: never expected
            f"the expert-parallel ranks sent different {self.mode} signatures {signatures}", {"signature": signatures}
        )

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
            tables = _Tables(*(t.to(device) for t in (host.owner, host.local, host.local_to_physical)))
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

    def _start_forward(self, num_tokens: int) -> _ForwardState:
        stats = TransferStats()
        self.last_stats = stats
        self.forward_count += 1
        return _ForwardState(dispatcher=self, num_tokens=num_tokens, stats=stats)

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
            raise RuntimeError("this dispatch was already combined; each handle combines exactly once")
        if not isinstance(partial_out, torch.Tensor):
            raise TypeError(f"partial_out must be a torch.Tensor, got {type(partial_out).__name__}")
        recv_hidden = handle.wait()[0]
        if partial_out.dim() != 2 or partial_out.shape[0] != recv_hidden.shape[0]:
            raise ValueError(
                f"partial_out must be [Tr={recv_hidden.shape[0]}, H], one row per received "
                f"row, got shape {tuple(partial_out.shape)}"
            )
        if partial_out.device != recv_hidden.device:
            raise ValueError(f"partial_out is on {partial_out.device}, the dispatch on {recv_hidden.device}")
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

    # Hooks for `CheckedDispatcher`: the path `combine` sends rows home on, and where each
    # returned row belongs. The combine itself uses `_return_home`, so what the checks count
    # travels exactly as the partial outputs do.

    def _return_home(self, rows: torch.Tensor, state: _ForwardState, what: str) -> torch.Tensor:
        """Send each received row back to the rank it came from, unsummed.

        Parameters
        ----------
        rows : Tensor [Tr, C], contiguous
            One row per received row of the dispatch ``state`` belongs to.
        state : _ForwardState
        what : str
            The step, named in a `CollectiveError`.

        Returns
        -------
        Tensor [M, C], dtype of ``rows``: the rows this rank's tokens got back, in the
        order `_home_index` describes. Adds nothing to the transfer statistics.
        """
        raise NotImplementedError

    def _home_index(self, state: _ForwardState, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(token row [M] int64, source rank [M] int64) on ``device`` of each row
        `_return_home` returns."""
        raise NotImplementedError


def _pack_metadata(weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """int32 [rows, 2K']: the weights' float32 bits then the ids (one collective for both)."""
    return torch.cat([weights.to(torch.float32).view(torch.int32), ids.to(torch.int32)], dim=1)


def _unpack_metadata(meta: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [rows, K'] float32, ids [rows, K'] int32) of `_pack_metadata`'s rows."""
    return meta[:, :top_k].contiguous().view(torch.float32), meta[:, top_k:].contiguous()


def _rows_as_sent(hidden_states) -> tuple[torch.Tensor, Any]:
    """(the 2-D tensor the collectives move, how to read it back).

    Float rows travel as they are. FP8Activations travel as one uint8 row each: H bytes of
    e4m3 values, then the row's float32 scales as 4 x groups bytes (gloo and NCCL both move
    uint8; one collective instead of two).
    """
    if not isinstance(hidden_states, FP8Activations):
        return hidden_states, None
    hidden_states.check()
    rows = torch.cat([hidden_states.q.view(torch.uint8), hidden_states.scales.contiguous().view(torch.uint8)], dim=1)
    return rows, hidden_states


def _rows_as_received(rows: torch.Tensor, like) -> Any:
    """Inverse of `_rows_as_sent`: float rows, or FP8Activations shaped like ``like``'s."""
    if like is None:
        return rows
    hidden = like.q.shape[1]
    return FP8Activations(
        rows[:, :hidden].contiguous().view(FP8_DTYPE),
        rows[:, hidden:].contiguous().view(torch.float32),
        like.group_size,
        like.dtype,
    )


def _row_bytes(hidden_states) -> tuple[int, int]:
    """(value bytes, scale bytes) of one token row as it travels."""
    if isinstance(hidden_states, FP8Activations):
        return hidden_states.q.shape[1], hidden_states.scales.shape[1] * hidden_states.scales.element_size()
    return hidden_states.shape[1] * hidden_states.element_size(), 0


def _row_format(hidden_states) -> str:
    """How the token rows travel, for the ranks' agreement check."""
    if isinstance(hidden_states, FP8Activations):
        return (
            f"float8_e4m3fn with {hidden_states.scales.shape[1]} float32 scales per row "
            f"(activations {hidden_states.dtype})"
        )
    return str(hidden_states.dtype)
