"""Live EPLB on torch: read the load windows of the EP group, move experts to a new placement.

`gather_load` sums the `LoadRecorder` windows of MoE layers over the EP ranks and folds the
replicas into logical experts; `apply` moves the expert weights of live layers to a new
`Placement` and swaps each layer's `ExpertLayout`.

How `apply` moves the weights (every rank of the EP group calls it with the same arguments):

1. Agreement: the ranks exchange everything they act on (`_agreement_fields`: the new
   placement's table, N, P and E, the layer count, their current placements, layouts, sizes,
   dtypes and formats, the shapes and dtypes of their expert tensors, the async flag;
   `moeroute.bindings.ep.check_ranks_agree`); a disagreement raises the same
   `RankMismatchError` on every rank before anything moves, and a request the ranks agree
   on is refused by all of them or by none.
2. Plan (computed alike on every rank from the old and new tables): a physical slot whose
   logical expert changes needs that expert's weights. When its rank already holds the
   expert, the rows are copied locally; otherwise they come from the rank holding old
   replica ``replicas[dst_rank % count]`` of it. Slots that keep their expert move nothing.
3. Transfer: ONE ``all_to_all_single`` of a flat byte buffer carries every received row of
   every layer and every expert tensor (weights, biases, quantization scales: each
   parameter or buffer of ``module.experts`` whose first dimension is the local expert
   count), so formats need no code of their own.
4. Commit: a one-integer ``all_reduce`` confirms that every rank received everything; only
   then does each layer get its new rows (written in place into its expert tensors) and a
   new layout and dispatcher, and its load window is cleared. A failure anywhere before the
   commit leaves every layer of every rank on its old placement, untouched.

``async_op=True`` posts the transfer and returns; forwards go on with the old placement.
At each forward of the first layer while the transfer is pending, the ranks agree with a
one-integer ``all_reduce`` whether every rank's transfer finished; the first forward at
which it has swaps all layers on every rank together. A failed transfer is dropped on every
rank (the old placement stays) and reported by the handle's ``error``.

Threads sharing a layer: every swap (synchronous, at a forward, or at ``handle.wait()``)
holds each layer's placement guard (`moeroute.bindings.torch.placement_guard`) exclusively
while it writes. A forward holds it shared from its routing to its output, so a forward in
flight finishes on the placement it routed with, and forwards starting meanwhile wait for
the swap.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import threading
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from moeroute.bindings.ep import CollectiveError, check_ranks_agree, make_dispatcher
from moeroute.bindings.torch.dispatch import LocalDispatcher
from moeroute.eplb.placement import Placement
from moeroute.layout import ExpertLayout

__all__ = ["gather_load", "apply", "ApplyHandle", "TransferPlan", "moe_layers"]


def moe_layers(modules: Any) -> list:
    """The MoE layers of ``modules``: one MoE, a sequence of them, or any nn.Module holding
    them (in ``.modules()`` order). TypeError when there is none."""
    from moeroute.bindings.torch.moe import MoE

    if isinstance(modules, MoE):
        layers = [modules]
    elif isinstance(modules, nn.Module):
        layers = [m for m in modules.modules() if isinstance(m, MoE)]
    else:
        try:
            layers = list(modules)
        except TypeError:
            raise TypeError(
                f"modules must be an MoE, a sequence of MoE layers or an nn.Module "
                f"holding them, got {type(modules).__name__}"
            ) from None
    if not layers or not all(isinstance(m, MoE) for m in layers):
        raise TypeError("modules must hold at least one moeroute MoE layer (and nothing else)")
    return layers


def _comm_device(group: Any, device: torch.device) -> torch.device:
    """Where a collective's tensors must live: the layers' device under NCCL, else the CPU
    (gloo's all_to_all serves CPU tensors)."""
    if group is not None and dist.get_backend(group) == "nccl":
        return device
    return torch.device("cpu")


def _group_of(layers: list, group: Any):
    """The EP process group of the layers (None when they run on one rank)."""
    if group is not None:
        return group
    dispatcher = layers[0].dispatcher
    if isinstance(dispatcher, LocalDispatcher):
        return None
    return dispatcher.group


# --------------------------------------------------------------------------- gather_load


def gather_load(modules: Any, group: Any = None) -> np.ndarray:
    """Tokens per logical expert of each layer over its load window, summed over the EP group.

    Parameters
    ----------
    modules : MoE, sequence of MoE, or nn.Module holding them
        Built with ``record_load=True``; L layers.
    group : torch.distributed.ProcessGroup, optional
        Default: the layers' EP group (no reduction when they run on one rank).

    Returns
    -------
    numpy.ndarray int64 [L, N]: every rank gets the same sums (the input of `rebalance`).

    Raises
    ------
    TypeError
        ``modules`` holds no MoE layer.
    ValueError
        A layer without ``record_load=True``, or layers with different N.
    CollectiveError
        A peer failed during the reduction.
    """
    layers = moe_layers(modules)
    for index, layer in enumerate(layers):
        if layer.load_recorder is None:
            raise ValueError(f"layer {index} records no load; build it with record_load=True")
    n = layers[0].layout.num_routed_experts
    if any(layer.layout.num_routed_experts != n for layer in layers):
        raise ValueError("the layers have different numbers of routed experts; gather them apart")
    physical = [layer.load_recorder.physical_load(layer.layout) for layer in layers]
    device = (
        layers[0].load_recorder.counts.device if layers[0].load_recorder.counts is not None else torch.device("cpu")
    )
    widths = [t.numel() for t in physical]
    group = _group_of(layers, group)
    flat = torch.cat([t.to(_comm_device(group, device)) for t in physical])
    if group is not None:
        try:
            dist.all_reduce(flat, group=group)
        except RuntimeError as error:
            raise CollectiveError(f"gather_load: the load reduction failed ({error})") from error
    out = np.zeros((len(layers), n), dtype=np.int64)
    for index, (layer, chunk) in enumerate(zip(layers, flat.cpu().split(widths))):
        np.add.at(out[index], np.asarray(layer.layout.physical_to_logical, dtype=np.int64), chunk.numpy())
    return out


# --------------------------------------------------------------------------- plan


def _expert_tensors(layer) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every expert parameter/buffer with one row per local expert."""
    experts = layer.experts
    count = experts.num_local_experts
    found = [
        (name, t)
        for name, t in list(experts.named_parameters(recurse=False)) + list(experts.named_buffers(recurse=False))
        if t is not None and t.dim() >= 1 and t.shape[0] == count
    ]
    return sorted(found, key=lambda item: item[0])


def _row_bytes(tensor: torch.Tensor) -> int:
    return tensor[0].numel() * tensor.element_size()


@dataclasses.dataclass
class TransferPlan:
    """What one rank sends, receives and copies to switch one layer's placement.

    Attributes
    ----------
    send : dict[int, list[tuple[int, int]]]
        Destination rank -> [(source local slot, destination local slot)], destination
        slots ascending.
    receive : dict[int, list[int]]
        Source rank -> destination local slots on this rank, ascending.
    local : list[tuple[int, int]]
        (source local slot, destination local slot) copied on this rank.
    moved : int
        Slots of the whole group whose logical expert changes.
    """

    send: dict
    receive: dict
    local: list
    moved: int


def plan_transfer(old: np.ndarray, new: np.ndarray, ep_size: int, rank: int) -> TransferPlan:
    """The `TransferPlan` of ``rank`` for tables ``old`` -> ``new`` ([P] each, P % E == 0)."""
    p = old.shape[0]
    slots = p // ep_size
    replicas: dict[int, list[int]] = {}
    for physical, logical in enumerate(old.tolist()):
        replicas.setdefault(logical, []).append(physical)
    send: dict[int, list] = {}
    receive: dict[int, list] = {}
    local: list = []
    moved = 0
    for physical in range(p):
        logical = int(new[physical])
        if logical == int(old[physical]):
            continue
        moved += 1
        dst_rank, dst_slot = divmod(physical, slots)
        held_here = [q for q in replicas[logical] if q // slots == dst_rank]
        if held_here:
            if dst_rank == rank:
                local.append((held_here[0] - rank * slots, dst_slot))
            continue
        options = replicas[logical]
        source = options[dst_rank % len(options)]
        src_rank, src_slot = divmod(source, slots)
        if src_rank == rank:
            send.setdefault(dst_rank, []).append((src_slot, dst_slot))
        if dst_rank == rank:
            receive.setdefault(src_rank, []).append(dst_slot)
    return TransferPlan(send, receive, local, moved)


def _digest(array: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(array, dtype=np.int64).tobytes(), digest_size=8).hexdigest()


def _new_layout(layout: ExpertLayout, table: np.ndarray) -> ExpertLayout:
    """``layout`` with another physical_to_logical table (everything else resolved alike)."""
    shared = layout.shared if layout.shared != "none" else "auto"
    return ExpertLayout(
        layout.num_routed_experts,
        layout.num_shared_experts,
        ep_size=layout.ep_size,
        dispatch=layout.dispatch,
        shared=shared,
        shared_slots=layout.shared_slots,
        scaling_regime=layout.scaling_regime,
        unfusable_reason=layout.unfusable_reason,
        physical_to_logical=np.asarray(table, dtype=np.int64),
    )


# --------------------------------------------------------------------------- apply


class ApplyHandle:
    """The result of `apply`.

    Attributes
    ----------
    bytes_sent, bytes_received : int
        Expert bytes this rank sent to / received from other ranks.
    experts_moved : int
        Slots (all ranks, all layers) whose logical expert changed.
    experts_received, experts_copied : int
        Slots of this rank filled over the network / by a local copy.
    done : bool
        The new placement is in use (always True after a synchronous apply).
    error : BaseException or None
        Why an asynchronous transfer was dropped.
    """

    def __init__(self) -> None:
        self.bytes_sent = self.bytes_received = 0
        self.experts_moved = self.experts_received = self.experts_copied = 0
        self.done = False
        self.error: BaseException | None = None
        self._pending: _Pending | None = None

    def wait(self) -> "ApplyHandle":
        """Block until the transfer finished and swap now (a collective: every rank calls it
        at the same point). Raises what the transfer raised."""
        if self._pending is not None and not self.done:
            self._pending.finish(block=True)
        if self.error is not None:
            raise self.error
        return self

    def as_dict(self) -> dict:
        return {
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "experts_moved": self.experts_moved,
            "experts_received": self.experts_received,
            "experts_copied": self.experts_copied,
            "done": self.done,
        }


class _Pending:
    """A posted transfer and what the swap needs; shared by every layer of one `apply`."""

    def __init__(self, layers, tables, plans, names, received, work, recv_buffer, group, handle) -> None:
        self.layers, self.tables, self.plans = layers, tables, plans
        self.names, self.received, self.work = names, received, work
        self.recv_buffer, self.group, self.handle = recv_buffer, group, handle
        self.comm_device = recv_buffer.device
        # One thread finishes (agrees and swaps); another forward's at_forward waits for it.
        self._finishing = threading.Lock()
        self._settled = self._warned = False
        self.local_rows = [
            self._local_rows(layer, plan, layer_names) for layer, plan, layer_names in zip(layers, plans, names)
        ]

    @staticmethod
    def _local_rows(layer, plan, names):
        """Rows copied on this rank, read now (before any slot is overwritten)."""
        if not plan.local:
            return None
        sources = torch.tensor([s for s, _ in plan.local], dtype=torch.long)
        current = dict(_expert_tensors(layer))
        return {
            name: _storage(current[name]).index_select(0, sources.to(current[name].device)).view(current[name].dtype)
            for name in names
        }

    def _transfer_state(self) -> int:
        """1 finished, 0 in flight, -1 failed (this rank)."""
        if self.work is None:
            return 1
        if not self.work.is_completed():
            return 0
        try:
            self.work.wait()
        except RuntimeError as error:
            self.handle.error = CollectiveError(
                f"the EPLB expert transfer failed ({error}); every layer keeps its old placement"
            )
            return -1
        return 1

    def _agree(self, state: int) -> int:
        if self.group is None:
            return state
        flag = torch.tensor([state], dtype=torch.int64, device=self.comm_device)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        except RuntimeError as error:
            raise CollectiveError(
                f"the EPLB commit failed: a peer rank exited or missed the process group's "
                f"timeout ({error}); every layer keeps its old placement"
            ) from error
        return int(flag.item())

    def finish(self, block: bool) -> bool:
        """Swap every layer when every rank's transfer finished; True when swapped."""
        with self._finishing:
            if self._settled:  # another thread swapped or dropped it while this one waited
                return self.handle.done
            return self._finish(block)

    def _finish(self, block: bool) -> bool:
        if block and self.work is not None:
            try:
                self.work.wait()
            except RuntimeError as error:
                self.handle.error = CollectiveError(
                    f"the EPLB expert transfer failed ({error}); every layer keeps its old placement"
                )
        state = -1 if self.handle.error is not None else self._transfer_state()
        agreed = self._agree(state)
        if agreed == 0:
            return False
        self._detach()
        self._settled = True
        if agreed < 0:
            if self.handle.error is None:
                self.handle.error = CollectiveError(
                    "the EPLB expert transfer failed on another rank; every layer keeps its old placement"
                )
            return False
        self._swap()
        self.handle.done = True
        return True

    def at_forward(self, layer) -> None:
        """Called by an MoE forward while this transfer is pending (see the module docstring)."""
        if layer is not self.layers[0]:
            return
        if not self.finish(block=False) and self.handle.error is not None and not self._warned:
            self._warned = True
            warnings.warn(str(self.handle.error), RuntimeWarning, stacklevel=3)

    def _detach(self) -> None:
        for layer in self.layers:
            if layer.pending_placement is self:
                layer.pending_placement = None

    def _swap(self) -> None:
        """Every layer to its new placement. All that can fail (new layouts, dispatchers,
        row buffers) is built first; then the rows are written in place and the layouts
        assigned, steps that allocate nothing, each layer's placement guard held
        exclusively: the forwards in flight (other threads) finish on the old placement
        first, and none starts until the swap is done."""
        prepared = []
        with torch.no_grad():
            for index, layer in enumerate(self.layers):
                plan, names = self.plans[index], self.names[index]
                current = dict(_expert_tensors(layer))
                slots = [dst for _, dst in plan.local]
                for src in sorted(plan.receive):
                    slots += plan.receive[src]
                writes = []
                for name in names:
                    parts = ([self.local_rows[index][name]] if plan.local else []) + list(
                        self.received[index].get(name, [])
                    )
                    if slots:
                        tensor = current[name]
                        rows = torch.cat([part.to(tensor.device) for part in parts])
                        where = torch.tensor(slots, dtype=torch.long, device=tensor.device)
                        writes.append((tensor, where, rows))
                layout = _new_layout(layer.layout, self.tables[index])
                old = layer.dispatcher
                dispatcher = (
                    LocalDispatcher(layout)
                    if isinstance(old, LocalDispatcher)
                    else make_dispatcher(layout, old.group, layout.dispatch, debug=old.debug)
                )
                prepared.append((layer, writes, layout, dispatcher))
            with contextlib.ExitStack() as guards:
                for layer in self.layers:  # in layer order, as every swap takes them
                    guards.enter_context(layer.placement_guard.swap())
                for layer, writes, layout, dispatcher in prepared:
                    for tensor, where, rows in writes:
                        _storage(tensor).index_copy_(0, where, _storage(rows))
                    layer.layout, layer.dispatcher = layout, dispatcher
                    if layer.load_recorder is not None:
                        layer.load_recorder.reset()
                for layer, writes, _, _ in prepared:
                    if writes and getattr(layer.experts, "pack_cpu", False):
                        layer.experts.pack_cpu_weights(True)  # the oneDNN copies are snapshots


def _agreement_fields(layers, placement, async_op: bool, group) -> dict:
    """Everything a rank of `apply` acts on, as plain values: the placement (table, N, P,
    E), every layer's current placement, layout, sizes, dtypes and format
    (`MoE.ep_fingerprint`), its expert tensors' names, shapes and dtypes, the async flag and
    whether the layers' ranks are this group's. Ranks that agree on these all plan the same
    transfer, or all refuse the request with the same error; one field left out would let
    one rank refuse alone while the others start the transfer."""
    fields = {
        "eplb.layers": len(layers),
        "eplb.placement": (placement.physical_to_logical.shape, _digest(placement.physical_to_logical)),
        "eplb.placement.ep_size": placement.ep_size,
        "eplb.placement.num_logical_experts": placement.num_logical_experts,
        "eplb.placement.num_physical_experts": placement.num_physical_experts,
        "eplb.current_placement": _digest(np.stack([layer.layout.physical_to_logical for layer in layers])),
        "eplb.expert_tensors": tuple(
            tuple((name, tuple(t.shape), str(t.dtype)) for name, t in _expert_tensors(layer)) for layer in layers
        ),
        "eplb.async_op": async_op,
        "eplb.layers_on_group_ranks": all(layer.rank == dist.get_rank(group) for layer in layers),
    }
    for index, layer in enumerate(layers):
        for name, value in layer.ep_fingerprint().items():
            if name != "layout.physical_to_logical":  # in eplb.current_placement's digest
                fields[f"eplb.layer{index}.{name}"] = value
    return fields


def _check_request(layers, placement) -> np.ndarray:
    if placement.num_layers != len(layers):
        raise ValueError(
            f"placement has {placement.num_layers} layer(s) for {len(layers)} MoE "
            f"layer(s); pass one placement row per layer"
        )
    for index, layer in enumerate(layers):
        layout = layer.layout
        expected = (layout.num_routed_experts, layout.num_routed_physical, layout.ep_size)
        got = (placement.num_logical_experts, placement.num_physical_experts, placement.ep_size)
        if expected != got:
            raise ValueError(
                f"placement (N, P, E) = {got} does not fit layer {index}, whose layout has "
                f"(N, P, E) = {expected}; plan with rebalance(load, {expected[1]}, {expected[2]})"
            )
    return np.asarray(placement.physical_to_logical, dtype=np.int64)


def _storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as torch can index-copy it: 1-byte float formats (FP8 weights) as their
    uint8 bytes (torch's CPU index_copy_ has no float8 kernel), everything else as it is."""
    if tensor.dtype.is_floating_point and tensor.element_size() == 1:
        return tensor.view(torch.uint8)
    return tensor


def _byte_rows(tensor: torch.Tensor, slots: list[int], device: torch.device) -> torch.Tensor:
    """Rows ``slots`` of ``tensor`` as one flat uint8 tensor on ``device``."""
    rows = _storage(tensor.detach()).index_select(0, torch.tensor(slots, dtype=torch.long, device=tensor.device))
    return rows.contiguous().to(device).reshape(-1).view(torch.uint8)


def apply(modules: Any, placement: Placement, group: Any = None, async_op: bool = False) -> ApplyHandle:
    """Move the expert weights of live MoE layers to ``placement`` and swap their layouts.

    A collective: every rank of the EP group calls it with the same placement, at the same
    point of its program (between forwards).

    Parameters
    ----------
    modules : MoE, sequence of MoE, or nn.Module holding them
        L layers; layer l takes ``placement.physical_to_logical[l]``.
    placement : Placement
        Same N, P and E as the layers' layouts (``rebalance(load, P, E, ...)``).
    group : torch.distributed.ProcessGroup, optional
        Default: the layers' EP group.
    async_op : bool
        False: returns after every layer swapped. True: returns after posting the
        transfer; the swap happens at the first forward after every rank's transfer
        finished (see the module docstring), or at ``handle.wait()``.

    Returns
    -------
    ApplyHandle
        Bytes sent and received by this rank, experts moved, copied and received.

    The expert tensors are written in place (no second copy of the weights): a layer built to
    share its weights with the caller's tensors (``expert_weights`` on a rank holding exactly
    the N experts) reorders those tensors too.

    Raises
    ------
    TypeError
        ``modules`` holds no MoE layer; ``placement`` is not a Placement.
    ValueError
        A placement whose layer count, N, P or E does not fit the layers; a layer with a
        transfer still pending.
    moeroute.bindings.ep.RankMismatchError
        The ranks disagree on anything a rank acts on: the placement (its table, N, P or
        E), the layer count, their current placements, layouts, sizes, dtypes, formats or
        expert tensors, the async flag: raised on every rank, naming the fields, nothing
        moved.
    CollectiveError
        A peer failed during the transfer or the commit: every layer keeps its old
        placement.
    """
    layers = moe_layers(modules)
    if not isinstance(placement, Placement):
        raise TypeError(f"placement must be a moeroute.eplb.Placement, got {type(placement).__name__}")
    if not isinstance(async_op, bool):
        raise TypeError(f"async_op={async_op!r} must be a bool")
    if any(layer.pending_placement is not None for layer in layers):
        raise ValueError("an asynchronous apply is still pending on these layers; call its handle's wait() first")
    group = _group_of(layers, group)
    if group is not None:
        # First, so that a placement one rank refuses cannot leave the others waiting.
        check_ranks_agree(_agreement_fields(layers, placement, async_op, group), group, "the EPLB placement")
        if any(layer.rank != dist.get_rank(group) for layer in layers):  # agreed: every rank raises
            raise ValueError(
                f"the layers' ranks {[layer.rank for layer in layers]} are not this process's "
                f"rank {dist.get_rank(group)} in group; pass the layers' EP group"
            )
    tables = _check_request(layers, placement)
    ep_size = layers[0].layout.ep_size
    rank = layers[0].rank

    handle = ApplyHandle()
    comm_device = _comm_device(group, layers[0].experts.w_gate_up.device)
    plans = []
    send_chunks: list[list[torch.Tensor]] = [[] for _ in range(ep_size)]
    receive_sizes = [0] * ep_size
    for index, layer in enumerate(layers):
        old = np.asarray(layer.layout.physical_to_logical, dtype=np.int64)
        plan = plan_transfer(old, tables[index], ep_size, rank)
        plans.append(plan)
        handle.experts_moved += plan.moved
        handle.experts_copied += len(plan.local)
        named = _expert_tensors(layer)
        row_bytes = sum(_row_bytes(t) for _, t in named)
        for dst in sorted(plan.send):
            for _, t in named:
                send_chunks[dst].append(_byte_rows(t, [s for s, _ in plan.send[dst]], comm_device))
        for src, dsts in plan.receive.items():
            receive_sizes[src] += len(dsts) * row_bytes
            handle.experts_received += len(dsts)
    send_sizes = [sum(c.numel() for c in chunks) for chunks in send_chunks]
    handle.bytes_sent = sum(send_sizes)
    handle.bytes_received = sum(receive_sizes)
    empty = torch.zeros(0, dtype=torch.uint8, device=comm_device)
    send_buffer = torch.cat([c for chunks in send_chunks for c in chunks] or [empty])
    recv_buffer = torch.empty(sum(receive_sizes), dtype=torch.uint8, device=comm_device)
    work = None
    if group is not None:
        try:
            work = _all_to_all(recv_buffer, send_buffer, receive_sizes, send_sizes, group)
        except RuntimeError as error:
            raise CollectiveError(
                f"the EPLB expert transfer failed ({error}); every layer keeps its old placement"
            ) from error
    received = _ReceivedRows(layers, plans, recv_buffer, receive_sizes)
    pending = _Pending(
        layers,
        tables,
        plans,
        [[name for name, _ in _expert_tensors(layer)] for layer in layers],
        received,
        work,
        recv_buffer,
        group,
        handle,
    )
    handle._pending = pending
    if async_op:
        for layer in layers:
            layer.pending_placement = pending
        return handle
    pending.finish(block=True)
    if handle.error is not None:
        raise handle.error
    return handle


def _all_to_all(recv_buffer, send_buffer, receive_sizes, send_sizes, group):
    """The one transfer of `apply` (posted asynchronously; its Work is returned)."""
    return dist.all_to_all_single(
        recv_buffer,
        send_buffer,
        output_split_sizes=receive_sizes,
        input_split_sizes=send_sizes,
        group=group,
        async_op=True,
    )


class _ReceivedRows:
    """The received byte buffer cut into rows per layer and tensor (read at the swap, once
    the transfer finished)."""

    def __init__(self, layers, plans, buffer, receive_sizes) -> None:
        self.layers, self.plans, self.buffer = layers, plans, buffer
        self.receive_sizes = receive_sizes
        self._cut = None

    def _cut_rows(self):
        cut = [dict() for _ in self.layers]
        starts = np.concatenate([[0], np.cumsum(self.receive_sizes)]).tolist()
        for src in range(len(self.receive_sizes)):
            offset = int(starts[src])
            for index, layer in enumerate(self.layers):
                dsts = self.plans[index].receive.get(src, [])
                if not dsts:
                    continue
                for name, tensor in _expert_tensors(layer):
                    size = len(dsts) * _row_bytes(tensor)
                    raw = self.buffer[offset : offset + size]
                    if offset % tensor.element_size():
                        raw = raw.clone()  # a dtype view needs an aligned offset
                    rows = raw.view(tensor.dtype).reshape(len(dsts), *tensor.shape[1:])
                    cut[index].setdefault(name, []).append(rows)
                    offset += size
        return cut

    def __getitem__(self, index):
        if self._cut is None:
            self._cut = self._cut_rows()
        return self._cut[index]
