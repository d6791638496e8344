"""The all2all dispatcher: each token travels once to each rank holding one of its slots
(DeepEP-style; `moeroute.bindings.ep` describes the protocol)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from moeroute.bindings.ep._base import (
    _COUNT_BYTES,
    _COUNT_DTYPE,
    _as_flag,
    _EPDispatcher,
    _pack_metadata,
    _row_bytes,
    _rows_as_received,
    _rows_as_sent,
    _Tables,
    _unpack_metadata,
)
from moeroute.bindings.ep.stats import METADATA_BYTES_PER_SLOT
from moeroute.bindings.torch.dispatch import check_dispatch_inputs

__all__ = ["All2AllDispatcher"]


class All2AllDispatcher(_EPDispatcher):
    """Tokens travel once to each rank holding one of their slots (docs/semantics.md section 6).

    Parameters
    ----------
    layout : ExpertLayout
        ``dispatch == "all2all"``; ``ep_size`` equal to the group size.
    group : torch.distributed.ProcessGroup, optional
        The expert-parallel group (None: the default group); its timeout bounds every
        collective.

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
        ``layout`` is not an ExpertLayout.
    ValueError
        ``layout.dispatch != "all2all"``, no initialized process group, or a group size
        other than ``layout.ep_size``.
    """

    mode = "all2all"

    def _destinations(
        self, valid: torch.Tensor, safe: torch.Tensor, tables: _Tables
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Owner rank and owner-local id of every slot, -1 for invalid slots.

        Slots held by every rank (global shared slots, E == 1 only here) stay at home.
        """
        owner = tables.owner[safe]
        owner = torch.where(owner < 0, torch.full_like(owner, self.rank), owner)
        owner = torch.where(valid, owner, torch.full_like(owner, -1))
        local = tables.local[owner.clamp(min=0), safe]
        return owner, torch.where(valid, local, torch.full_like(local, -1))

    def dispatch(self, hidden_states, topk_weights, topk_ids, *, async_op=False):
        """Send each token once to every rank holding one of its slots.

        Parameters
        ----------
        hidden_states : Tensor [T, H], activation dtype, or FP8Activations
            FP8 rows with their scales (FP8 dispatch): they travel as they are and
            ``recv_hidden`` is FP8Activations of the received rows.
        topk_weights : Tensor [T, K'] float32
        topk_ids : Tensor [T, K'] int32
            Physical ids; ids outside [0, num_physical_experts) are not routed.
        async_op : bool
            Return once the rows are in flight (the count exchange has completed);
            ``handle.wait()`` completes the transfer.

        Returns
        -------
        DispatchHandle
            ``wait()`` -> recv_hidden [Tr, H] (dtype of hidden_states), recv_weights
            [Tr, K'] float32 (0 where the local id is -1), recv_local_ids [Tr, K'] int32
            (-1 for slots held elsewhere). Rows are grouped by source rank, ascending,
            and within a source by token row.

        Raises
        ------
        TypeError, ValueError
            Bad arguments (see ``check_dispatch_inputs``); ``async_op`` not a bool.
        CollectiveError
            A collective failed (dead peer, timeout of the process group).
        """
        rows, fp8 = _rows_as_sent(hidden_states)
        check_dispatch_inputs(rows, topk_weights, topk_ids)
        async_op = _as_flag("async_op", async_op)
        device, e = rows.device, self.ep_size
        num_tokens, top_k = topk_ids.shape
        tables = self._tables(device)
        valid, safe = self._valid_and_safe(topk_ids)
        owner, local = self._destinations(valid, safe, tables)
        state = self._start_forward(num_tokens)

        # in_rank[t, d]: token t has a slot on rank d; column 0 absorbs invalid slots.
        in_rank = torch.zeros(num_tokens, e + 1, dtype=torch.bool, device=device)
        in_rank.scatter_(1, owner + 1, True)
        in_rank = in_rank[:, 1:]
        pairs = in_rank.t().nonzero()  # row-major: by destination, then token row
        send_dest, send_token = pairs[:, 0], pairs[:, 1]
        send_counts_t = in_rank.sum(dim=0, dtype=_COUNT_DTYPE)

        live = owner.index_select(0, send_token) == send_dest[:, None]
        send_local = torch.where(live, local.index_select(0, send_token), torch.full_like(live, -1, dtype=torch.int64))
        send_weights = torch.where(
            live, topk_weights.index_select(0, send_token), torch.zeros((), dtype=torch.float32, device=device)
        )

        # One collective of fixed width for the counts and this rank's signature, sent to
        # every rank alike.
        signature = torch.tensor(self._signature(hidden_states, top_k), dtype=_COUNT_DTYPE, device=device).expand(e, -1)
        counts_out = torch.cat([send_counts_t[:, None], signature], dim=1)
        counts_in = torch.empty_like(counts_out)
        self._collective("row-count exchange", dist.all_to_all_single, counts_in, counts_out)
        received = counts_in.tolist()
        self._check_signatures([row[1:] for row in received], hidden_states, top_k)
        send_counts = send_counts_t.tolist()
        recv_counts = [row[0] for row in received]
        state.send_token_index, state.send_counts, state.recv_counts = (send_token, send_counts, recv_counts)

        send_hidden = rows.index_select(0, send_token)
        send_meta = _pack_metadata(send_weights, send_local)
        num_recv = sum(recv_counts)
        recv_hidden = rows.new_empty((num_recv, rows.shape[1]))
        recv_meta = send_meta.new_empty((num_recv, 2 * top_k))
        works = [
            self._collective(
                "token dispatch",
                dist.all_to_all_single,
                recv_hidden,
                send_hidden,
                recv_counts,
                send_counts,
                async_op=True,
            ),
            self._collective(
                "metadata dispatch",
                dist.all_to_all_single,
                recv_meta,
                send_meta,
                recv_counts,
                send_counts,
                async_op=True,
            ),
        ]

        rows_out = send_token.shape[0] - send_counts[self.rank]
        stats = state.stats
        stats.rows_sent = rows_out
        value_bytes, scale_bytes = _row_bytes(hidden_states)
        stats.hidden_bytes, stats.scale_bytes = rows_out * value_bytes, rows_out * scale_bytes
        stats.metadata_bytes = rows_out * top_k * METADATA_BYTES_PER_SLOT
        stats.count_bytes = (e - 1) * counts_out.shape[1] * _COUNT_BYTES

        def finish():
            self._wait_all("token dispatch", works)
            recv_weights, recv_local = _unpack_metadata(recv_meta, top_k)
            return _rows_as_received(recv_hidden, fp8), recv_weights, recv_local

        return self._handle(state, finish, async_op)

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
        """
        state = self._check_combine_args(partial_out, handle)
        partial_out = partial_out.contiguous()
        hidden = partial_out.shape[1]
        returned = self._return_home(partial_out, state, "combine")
        rows_out = sum(state.recv_counts) - state.recv_counts[self.rank]
        state.stats.combine_bytes = rows_out * hidden * partial_out.element_size()
        out = torch.zeros((state.num_tokens, hidden), dtype=torch.float32, device=partial_out.device)
        out.index_add_(0, state.send_token_index, returned.to(torch.float32))
        self._finish_forward(state)
        return out.to(partial_out.dtype)

    def _return_home(self, rows, state, what):
        """Rows in send order: by destination rank, then token row (see `_home_index`)."""
        returned = rows.new_empty((state.send_token_index.shape[0], rows.shape[1]))
        self._collective(what, dist.all_to_all_single, returned, rows, state.send_counts, state.recv_counts)
        return returned

    def _home_index(self, state, device):
        source = torch.repeat_interleave(
            torch.arange(self.ep_size, device=device), torch.tensor(state.send_counts, device=device)
        )
        return state.send_token_index.to(device), source
