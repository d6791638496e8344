"""Debug mode: `CheckedDispatcher` wraps an expert-parallel dispatcher and checks each forward.

The dispatchers themselves never check (their dispatch and combine have no debug branch);
the wrapper checks what they produced, with collectives of its own:

dispatch
    Every rank sends the local ids it received (``recv_local_ids``) back to the tokens'
    home ranks along the path the partial outputs take (`_EPDispatcher._return_home`).
    At home, every (token, slot) with a valid id must be live on exactly one rank, under a
    local id that rank holds and that maps back to the slot's physical id there.
combine
    After the inner combine, every rank sends the mask of its live slots home along the
    same path, through the index the combine summed with; each (token, slot) with a valid
    id must be counted exactly once.

Each check is one extra all-to-all (two per forward) plus host syncs: tests only. Every
rank runs the check collectives before any rank raises, so the ranks stay matched; only the
rank whose tokens are wrong raises `DispatchCheckError`, naming the token row, slot and
(where known) the rank that received it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from moeroute.bindings.ep._base import _EPDispatcher, _ForwardState
from moeroute.bindings.ep.stats import TransferStats
from moeroute.bindings.torch.dispatch import DispatchHandle, Dispatcher

__all__ = ["CheckedDispatcher", "DispatchCheckError"]

#: The count check's wording per mode. allgather hands every token to every rank, so its
#: count sums the ranks that kept a slot live.
_DISPATCHED = {"all2all": "dispatched", "allgather": "dispatched (summed over ranks)"}


class DispatchCheckError(RuntimeError):
    """Debug mode found a (token, slot) dispatched or combined other than exactly once."""


@dataclasses.dataclass
class _CheckedForward:
    """What the wrapper's `combine` needs from its `dispatch`; lives in ``DispatchHandle.state``."""

    dispatcher: CheckedDispatcher
    inner_handle: DispatchHandle
    topk_ids: torch.Tensor  # [T, K'] int32, as dispatched
    valid: torch.Tensor  # [T, K'] bool: slots with an id in [0, num_physical)

    @property
    def inner_state(self) -> _ForwardState:
        return self.inner_handle.state


class CheckedDispatcher(Dispatcher):
    """Debug mode around an expert-parallel dispatcher (same interface, same results).

    ``make_dispatcher(..., debug=True)`` returns one. Build it on every rank of the group
    or on none: it sets ``inner.debug``, which the inner dispatcher's rank-agreement
    signature carries, so ranks that disagree raise `RankMismatchError`.

    Parameters
    ----------
    inner : All2AllDispatcher or AllGatherDispatcher
        A dispatcher not yet wrapped; use it only through this wrapper from now on.

    Attributes
    ----------
    inner : the wrapped dispatcher.
    debug : bool
        Always True.
    last_stats, cumulative_stats : TransferStats
        The inner dispatcher's byte accounting: the dispatch and combine transfers only.
        The check collectives are not counted.

    Raises
    ------
    TypeError
        ``inner`` is not an all2all or allgather dispatcher.
    ValueError
        ``inner`` is already wrapped.
    """

    debug = True

    def __init__(self, inner: Any) -> None:
        if not isinstance(inner, _EPDispatcher):
            raise TypeError(f"inner must be an All2AllDispatcher or AllGatherDispatcher, got {type(inner).__name__}")
        if inner.debug:
            raise ValueError("inner is already wrapped by a CheckedDispatcher (inner.debug=True)")
        inner.debug = True
        self.inner = inner
        self.layout = inner.layout
        self.rank = inner.rank

    # ------------------------------------------------------------------ the inner's attributes

    @property
    def group(self) -> Any:
        return self.inner.group

    @property
    def ep_size(self) -> int:
        return self.inner.ep_size

    @property
    def mode(self) -> str:
        return self.inner.mode

    @property
    def carries_fp8(self) -> bool:
        return self.inner.carries_fp8

    @property
    def num_physical_experts(self) -> int:
        return self.inner.num_physical_experts

    @property
    def last_stats(self) -> TransferStats | None:
        return self.inner.last_stats

    @property
    def cumulative_stats(self) -> TransferStats:
        return self.inner.cumulative_stats

    @property
    def forward_count(self) -> int:
        return self.inner.forward_count

    @property
    def bytes_sent(self) -> int:
        return self.inner.bytes_sent

    # ------------------------------------------------------------------ dispatch and combine

    def dispatch(self, hidden_states, topk_weights, topk_ids, *, async_op=False):
        """The inner dispatch, then the dispatch check (in ``wait()`` when ``async_op``).

        Returns and raises as the inner dispatcher's `dispatch`, and also
        `DispatchCheckError` on this rank when one of its (token, slot) with a valid id
        was received live other than once, or under a local id that does not map back to
        the slot's physical id.
        """
        inner_handle = self.inner.dispatch(hidden_states, topk_weights, topk_ids, async_op=async_op)
        valid, _ = self.inner._valid_and_safe(topk_ids)
        forward = _CheckedForward(self, inner_handle, topk_ids, valid)

        def wait_fn():
            received = inner_handle.wait()
            self._check_dispatch(forward, received[2])
            return received

        if async_op:  # a bool: the inner dispatch checked it
            return DispatchHandle(wait_fn=wait_fn, state=forward, num_tokens=inner_handle.num_tokens)
        return DispatchHandle(wait_fn(), state=forward, num_tokens=inner_handle.num_tokens)

    def combine(self, partial_out, handle):
        """The inner combine, then the combine check.

        Returns and raises as the inner dispatcher's `combine`, and also
        `DispatchCheckError` on this rank when one of its (token, slot) with a valid id
        was combined other than once.
        """
        if not isinstance(handle, DispatchHandle):
            raise TypeError(f"handle must be a DispatchHandle, got {type(handle).__name__}")
        forward = handle.state
        if not isinstance(forward, _CheckedForward) or forward.dispatcher is not self:
            raise ValueError("handle was not returned by this dispatcher's dispatch()")
        recv_local = handle.wait()[2]  # runs the dispatch check if the handle was async
        out = self.inner.combine(partial_out, forward.inner_handle)
        live = (recv_local >= 0).to(torch.int32)
        returned = self.inner._return_home(live, forward.inner_state, "debug combine check")
        token, _ = self.inner._home_index(forward.inner_state, live.device)
        counts = torch.zeros(forward.valid.shape, dtype=torch.int32, device=live.device)
        counts.index_add_(0, token, returned)
        self._check_counts(counts, forward.valid, "combined")
        return out

    # ------------------------------------------------------------------ the checks

    def _check_dispatch(self, forward: _CheckedForward, recv_local: torch.Tensor) -> None:
        inner, device = self.inner, recv_local.device
        returned = inner._return_home(
            recv_local.to(torch.int32).contiguous(), forward.inner_state, "debug dispatch check"
        ).long()
        token, source = inner._home_index(forward.inner_state, device)
        tables = inner._tables(device)

        # Local ids each receiving rank holds: -1 (not here) or [0, num_local_experts).
        held = torch.tensor(
            [inner.layout.num_local_experts(r) for r in range(inner.ep_size)], dtype=torch.int64, device=device
        )
        out_of_range = (returned < -1) | (returned >= held[source][:, None])
        if bool(out_of_range.any()):
            row, k = (int(i) for i in out_of_range.nonzero()[0])
            d = int(source[row])
            raise DispatchCheckError(
                f"rank {self.rank}: token row {int(token[row])}, slot {k} was sent to rank {d} "
                f"as local id {int(returned[row, k])}; rank {d} holds local ids "
                f"[0, {int(held[d])})"
            )

        live = returned >= 0
        counts = torch.zeros(forward.valid.shape, dtype=torch.int64, device=device)
        counts.index_add_(0, token, live.long())
        self._check_counts(counts, forward.valid, _DISPATCHED[inner.mode])

        rows, slots = live.nonzero(as_tuple=True)
        physical = tables.local_to_physical[source[rows], returned[rows, slots]]
        ids = forward.topk_ids.to(device).long()
        wrong = physical != ids[token[rows], slots]
        if bool(wrong.any()):
            i = int(wrong.nonzero()[0, 0])
            t, k, d = int(token[rows[i]]), int(slots[i]), int(source[rows[i]])
            raise DispatchCheckError(
                f"rank {self.rank}: token row {t}, slot {k} (physical id {int(ids[t, k])}) "
                f"was sent to rank {d} as local id {int(returned[rows[i], k])}, which is "
                f"physical id {int(physical[i])} there"
            )

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
