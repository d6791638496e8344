"""The allgather dispatcher: every rank sees every token, partial outputs return home
(`moeroute.bindings.ep` describes the protocol)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from moeroute.bindings.ep._base import (
    _COUNT_BYTES,
    _COUNT_DTYPE,
    _all_gather_single,
    _as_flag,
    _EPDispatcher,
    _pack_metadata,
    _row_bytes,
    _rows_as_received,
    _rows_as_sent,
    _unpack_metadata,
)
from moeroute.bindings.ep.stats import METADATA_BYTES_PER_SLOT
from moeroute.bindings.torch.dispatch import check_dispatch_inputs

__all__ = ["AllGatherDispatcher"]


class AllGatherDispatcher(_EPDispatcher):
    """Every rank sees every token and computes its local experts (docs/semantics.md section 6).

    Parameters
    ----------
    layout : ExpertLayout
        ``dispatch == "allgather"``; ``ep_size`` equal to the group size.
    group : torch.distributed.ProcessGroup, optional
        The expert-parallel group (None: the default group); its timeout bounds every
        collective.

    Attributes
    ----------
    last_stats : TransferStats or None
        Bytes of the latest forward: ``rows_sent`` = (E - 1) x the padded row count.
    cumulative_stats : TransferStats
        Sum over every forward.

    Raises
    ------
    TypeError
        ``layout`` is not an ExpertLayout.
    ValueError
        ``layout.dispatch != "allgather"``, no initialized process group, or a group
        size other than ``layout.ep_size``.
    """

    mode = "allgather"

    def dispatch(self, hidden_states, topk_weights, topk_ids, *, async_op=False):
        """All-gather every rank's tokens with their slot ids and weights.

        Parameters
        ----------
        hidden_states : Tensor [T, H], activation dtype, or FP8Activations
            FP8 rows with their scales (FP8 dispatch): they travel as they are and
            ``recv_hidden`` is FP8Activations of the received rows.
        topk_weights : Tensor [T, K'] float32
        topk_ids : Tensor [T, K'] int32
            Physical ids; ids outside [0, num_physical_experts) are not routed.
        async_op : bool
            Return once the gather is in flight (the size exchange has completed);
            ``handle.wait()`` completes it.

        Returns
        -------
        DispatchHandle
            ``wait()`` -> recv_hidden [Tr, H] with Tr = sum of every rank's T, rows of
            rank 0 first; recv_weights [Tr, K'] float32 (0 where the local id is -1);
            recv_local_ids [Tr, K'] int32 (-1 for slots held elsewhere, and for global
            shared slots of other ranks' tokens).

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
        width = rows.shape[1]
        state = self._start_forward(num_tokens)

        # The token counts travel with every rank's signature (one gather of fixed width).
        mine = [num_tokens] + self._signature(hidden_states, top_k)
        sizes_t = torch.empty(e * len(mine), dtype=_COUNT_DTYPE, device=device)
        self._collective(
            "token-count gather", _all_gather_single, sizes_t, torch.tensor(mine, dtype=_COUNT_DTYPE, device=device)
        )
        gathered = sizes_t.view(e, len(mine)).tolist()
        self._check_signatures([row[1:] for row in gathered], hidden_states, top_k)
        sizes = [row[0] for row in gathered]
        state.sizes = sizes
        padded_rows = max(sizes)

        send_hidden = rows.new_zeros((padded_rows, width))
        send_hidden[:num_tokens] = rows
        send_meta = torch.full((padded_rows, 2 * top_k), -1, dtype=torch.int32, device=device)
        send_meta[:num_tokens] = _pack_metadata(topk_weights, topk_ids)
        gathered_hidden = rows.new_empty((e * padded_rows, width))
        gathered_meta = send_meta.new_empty((e * padded_rows, 2 * top_k))
        works = [
            self._collective("token gather", _all_gather_single, gathered_hidden, send_hidden, async_op=True),
            self._collective("metadata gather", _all_gather_single, gathered_meta, send_meta, async_op=True),
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
                keep = torch.cat(
                    [
                        torch.arange(r * padded_rows, r * padded_rows + size, device=device)
                        for r, size in enumerate(sizes)
                    ]
                )
                recv_hidden = gathered_hidden.index_select(0, keep)
                recv_meta = gathered_meta.index_select(0, keep)
            recv_weights, recv_ids = _unpack_metadata(recv_meta, top_k)
            recv_local = self._local_ids(recv_ids, sizes)
            recv_weights = torch.where(
                recv_local >= 0, recv_weights, torch.zeros((), dtype=torch.float32, device=device)
            )
            return _rows_as_received(recv_hidden, fp8), recv_weights, recv_local

        return self._handle(state, finish, async_op)

    def _local_ids(self, recv_ids: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """This rank's local id of every gathered slot; global slots only for own tokens."""
        tables = self._tables(recv_ids.device)
        valid, safe = self._valid_and_safe(recv_ids)
        local = tables.local[self.rank][safe]
        keep = valid
        if self.layout.home_rank_masked:
            source = torch.repeat_interleave(
                torch.arange(self.ep_size, device=recv_ids.device), torch.tensor(sizes, device=recv_ids.device)
            )
            held_by_all = tables.owner[safe] < 0
            keep = keep & ~(held_by_all & (source != self.rank)[:, None])
        return torch.where(keep, local, torch.full_like(local, -1)).to(torch.int32)

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
        """
        state = self._check_combine_args(partial_out, handle)
        partial_out = partial_out.contiguous()
        hidden = partial_out.shape[1]
        returned = self._return_home(partial_out, state, "combine")
        # Every rank returns exactly T rows for this rank's T tokens: sum the E blocks.
        out = returned.view(self.ep_size, state.num_tokens, hidden).to(torch.float32).sum(0)
        rows_out = sum(state.sizes) - state.sizes[self.rank]
        state.stats.combine_bytes = rows_out * hidden * partial_out.element_size()
        self._finish_forward(state)
        return out.to(partial_out.dtype)

    def _return_home(self, rows, state, what):
        """Rows by source rank, each source's block holding this rank's T tokens in order."""
        returned = rows.new_empty((self.ep_size * state.num_tokens, rows.shape[1]))
        self._collective(what, dist.all_to_all_single, returned, rows, [state.num_tokens] * self.ep_size, state.sizes)
        return returned

    def _home_index(self, state, device):
        tokens = torch.arange(state.num_tokens, device=device)
        return (
            tokens.repeat(self.ep_size),
            torch.arange(self.ep_size, device=device).repeat_interleave(state.num_tokens),
        )
