"""The dispatcher interface: how routed tokens reach the ranks holding their experts.

A `Dispatcher` moves each token's hidden state, with its slot ids and weights, to the
ranks that hold the experts (`dispatch`), and brings the already-weighted partial
outputs back home and sums them (`combine`). The MoE module only talks to this
interface; `LocalDispatcher` serves one rank (no communication), and the
expert-parallel dispatchers on torch.distributed live in `moeroute.bindings.ep`.

Contract (every implementation)
-------------------------------
``dispatch(hidden_states, topk_weights, topk_ids, *, async_op=False) -> DispatchHandle``
    hidden_states [T, H], activation dtype; topk_weights [T, K'] float32; topk_ids
    [T, K'] int32 in the layout's physical id space (after ``append_shared_slots``: routed
    + fused shared slots). Weights come before ids, as everywhere in moeroute: a call in
    the order before 0.2 is refused by dtype. ``handle.wait()`` returns
    ``(recv_hidden [Tr, H], recv_weights [Tr, K'] float32, recv_local_ids [Tr, K'] int32)``
    where ``recv_local_ids`` holds this rank's local expert id of each slot, -1 where the
    slot's expert is not held here. With ``async_op=True`` the call returns while the
    transfer may still be in flight; ``wait()`` blocks until it has landed.
``combine(partial_out, handle) -> out [T, H]``
    partial_out [Tr, H]: for each received row, the sum over its local slots of
    ``w * expert(x)`` (already weighted). Returns, for this rank's own T tokens, the sum
    of the partial outputs of every rank, in the dtype of ``partial_out``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from moeroute._validate import weights_then_ids
from moeroute.layout import ExpertLayout

__all__ = [
    "DispatchHandle",
    "Dispatcher",
    "LocalDispatcher",
    "check_dispatch_inputs",
    "register_ep_dispatcher_factory",
    "ep_dispatcher_factory",
]


class DispatchHandle:
    """The result of `Dispatcher.dispatch`, possibly still in flight.

    Parameters
    ----------
    received : tuple of three tensors, optional
        ``(recv_hidden, recv_weights, recv_local_ids)`` when they are already available.
    wait_fn : callable () -> tuple of three tensors, optional
        Called once by the first `wait` when the transfer is asynchronous; exactly one
        of ``received`` and ``wait_fn`` must be given.
    state : any
        Whatever the dispatcher needs in `Dispatcher.combine` (send counts, index maps).

    Raises
    ------
    ValueError
        Neither or both of ``received`` and ``wait_fn`` given, or ``received`` (or what
        ``wait_fn`` returns) is not a tuple of three.
    TypeError
        ``recv_weights`` is not floating or ``recv_local_ids`` not integer (the two in the
        order before 0.2): checked when the entries are set, so that no consumer reads
        ids as weights.
    """

    __slots__ = ("_received", "_wait_fn", "state", "num_tokens")

    def __init__(
        self,
        received: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        *,
        wait_fn: Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
        state: Any = None,
        num_tokens: int | None = None,
    ) -> None:
        if (received is None) == (wait_fn is None):
            raise ValueError(
                "DispatchHandle needs exactly one of received=(recv_hidden, recv_weights, "
                f"recv_local_ids) and wait_fn; got received={'set' if received is not None else None}, "
                f"wait_fn={'set' if wait_fn is not None else None}"
            )
        self._received = None if received is None else _checked_received(received)
        self._wait_fn = wait_fn
        self.state = state
        #: T, the number of tokens this rank dispatched (the row count `combine` returns).
        self.num_tokens = num_tokens

    def is_completed(self) -> bool:
        """True once `wait` has returned (or when the dispatch was synchronous)."""
        return self._received is not None

    def wait(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Block until the tokens have arrived; idempotent.

        Returns
        -------
        recv_hidden : Tensor [Tr, H], activation dtype
        recv_weights : Tensor [Tr, K'] float32
        recv_local_ids : Tensor [Tr, K'] int32, local expert id per slot, -1 = not here
        """
        if self._received is None:
            self._received = _checked_received(self._wait_fn())
            self._wait_fn = None
        return self._received


def _checked_received(received) -> tuple:
    """``received`` if it is ``(recv_hidden, recv_weights, recv_local_ids)``, weights floating and ids integer."""
    if not isinstance(received, tuple) or len(received) != 3:
        raise ValueError(
            "a dispatch must deliver (recv_hidden, recv_weights, recv_local_ids), got "
            f"{type(received).__name__} of length {len(received) if isinstance(received, tuple) else '-'}"
        )
    weights_then_ids(received[1], received[2], "recv_weights", "recv_local_ids")
    return received


def check_dispatch_inputs(hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> None:
    """Validate the arguments of `Dispatcher.dispatch`.

    Raises
    ------
    TypeError
        An argument is not a torch.Tensor, or topk_weights is not floating or topk_ids not
        integer (the pair in the order before 0.2, ids first; checked first).
    ValueError
        hidden_states not 2-D; topk_ids not int32 [T, K']; topk_weights not float32 of
        the shape of topk_ids; the three on different devices.
    """
    weights_then_ids(topk_weights, topk_ids)
    for name, value in (("hidden_states", hidden_states), ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be 2-D [T, H], got shape {tuple(hidden_states.shape)}")
    num_tokens = hidden_states.shape[0]
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids must be [T={num_tokens}, K'], got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype != torch.int32:
        raise ValueError(f"topk_ids must be int32, got {topk_ids.dtype}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(
            f"topk_weights shape {tuple(topk_weights.shape)} must equal topk_ids shape {tuple(topk_ids.shape)}"
        )
    if topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights must be float32, got {topk_weights.dtype}")
    devices = {hidden_states.device, topk_ids.device, topk_weights.device}
    if len(devices) != 1:
        raise ValueError(
            "hidden_states, topk_ids and topk_weights must be on one device, got "
            f"{hidden_states.device}, {topk_ids.device}, {topk_weights.device}"
        )


class Dispatcher:
    """Interface: move tokens to the ranks holding their experts and bring results home.

    Attributes
    ----------
    layout : ExpertLayout
        The placement the physical ids refer to.
    rank : int
        This process's expert-parallel rank in [0, layout.ep_size).
    """

    layout: ExpertLayout
    rank: int

    def dispatch(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        async_op: bool = False,
    ) -> DispatchHandle:
        """Send each token to the ranks that hold its slots' experts.

        Parameters
        ----------
        hidden_states : Tensor [T, H], activation dtype
        topk_weights : Tensor [T, K'] float32
        topk_ids : Tensor [T, K'] int32, physical ids (routed + fused shared slots)
        async_op : bool
            Return before the transfer completes; ``handle.wait()`` completes it.

        Returns
        -------
        DispatchHandle
            ``wait()`` -> (recv_hidden [Tr, H], recv_weights [Tr, K'] float32,
            recv_local_ids [Tr, K'] int32).
        """
        raise NotImplementedError

    def combine(self, partial_out: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Return every rank's weighted partial outputs to the tokens' home rank, summed.

        Parameters
        ----------
        partial_out : Tensor [Tr, H]
            Per received row: sum over its local slots of ``w * expert(x)``.
        handle : DispatchHandle
            The handle of the matching `dispatch`.

        Returns
        -------
        Tensor [T, H], dtype of ``partial_out``, for this rank's own tokens.
        """
        raise NotImplementedError


class LocalDispatcher(Dispatcher):
    """One rank (E == 1): nothing travels; ids become local through ``layout.expert_map(0)``.

    Parameters
    ----------
    layout : ExpertLayout
        A layout with ``ep_size == 1``.

    Raises
    ------
    ValueError
        ``layout.ep_size != 1`` (use ``moeroute.bindings.ep.make_dispatcher``).
    TypeError
        ``layout`` is not an ExpertLayout.
    """

    def __init__(self, layout: ExpertLayout) -> None:
        if not isinstance(layout, ExpertLayout):
            raise TypeError(f"layout must be an ExpertLayout, got {type(layout).__name__}")
        if layout.ep_size != 1:
            raise ValueError(
                f"LocalDispatcher serves ep_size=1, got layout.ep_size={layout.ep_size}; "
                "use moeroute.bindings.ep.make_dispatcher(layout, group, dispatch)"
            )
        self.layout = layout
        self.rank = 0
        self._expert_map = layout.expert_map(0)
        self._expert_map_on: dict[torch.device, Any] = {}

    def _map_for(self, device: torch.device):
        table = self._expert_map_on.get(device)
        if table is None:
            from moeroute.bindings.torch.arrays import expert_map_for_device

            table = expert_map_for_device(self._expert_map, device)
            self._expert_map_on[device] = table
        return table

    def dispatch(self, hidden_states, topk_weights, topk_ids, *, async_op=False):
        """See `Dispatcher.dispatch`; here Tr == T and recv_hidden is hidden_states itself."""
        from moeroute.bindings.torch.arrays import remap_to_local

        check_dispatch_inputs(hidden_states, topk_weights, topk_ids)
        local_ids = remap_to_local(topk_ids, self._map_for(hidden_states.device))
        return DispatchHandle((hidden_states, topk_weights, local_ids), num_tokens=hidden_states.shape[0])

    def combine(self, partial_out, handle):
        """See `Dispatcher.combine`; here the partial output already is the result."""
        if not isinstance(handle, DispatchHandle):
            raise TypeError(f"handle must be a DispatchHandle, got {type(handle).__name__}")
        if partial_out.shape[0] != handle.num_tokens:
            raise ValueError(
                f"partial_out has {partial_out.shape[0]} rows; the dispatch sent {handle.num_tokens} tokens"
            )
        return partial_out


#: The factory building a dispatcher for an expert-parallel layer: ``factory(layout, group,
#: dispatch) -> Dispatcher``. The torch module is given it (``MoE(dispatcher_factory=...)``)
#: or takes the one `moeroute.bindings.ep` registers here, so this layer never imports the
#: dispatchers built on top of it.
_EP_DISPATCHER_FACTORY = None


def register_ep_dispatcher_factory(factory) -> None:
    """Make ``factory(layout, group, dispatch)`` the default builder of EP dispatchers."""
    global _EP_DISPATCHER_FACTORY
    if not callable(factory):
        raise TypeError(f"factory must be callable, got {type(factory).__name__}")
    _EP_DISPATCHER_FACTORY = factory


def ep_dispatcher_factory():
    """The registered default factory (`moeroute.bindings.ep.make_dispatcher`).

    Raises
    ------
    RuntimeError
        None is registered: ``moeroute.bindings`` registers it when imported, so this only
        happens when the dispatch module was loaded by hand without its package.
    """
    if _EP_DISPATCHER_FACTORY is None:
        raise RuntimeError(
            "no expert-parallel dispatcher is registered; import moeroute.bindings.ep "
            "or pass MoE(dispatcher_factory=...)"
        )
    return _EP_DISPATCHER_FACTORY
