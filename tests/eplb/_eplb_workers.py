"""Bodies of the spawned gloo ranks of test_eplb_live.py (one group runs many cases).

Every check is computed here from plain definitions: the logical top-k picks with
torch.topk, the weights a slot must hold from the full stacked weights, the bytes a rank
must receive from the old and new tables. helpers.gloo.spawn_group spawns them.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch
import torch.distributed as dist

from helpers.modules import CountingMLP

#: Timeout of the dead-peer run: the survivors must raise within it.
SHORT_TIMEOUT_S = 3
N, K, HIDDEN, INTER = 8, 2, 16, 8
#: float32 outputs of the same logical weights computed on other ranks / in another order.
TOLERANCE = 1e-6


# --------------------------------------------------------------------------- the layers


def build_layers(world_size, dispatch, shared, num_layers=2, record_load=True, placement="linear"):
    """``num_layers`` MoE layers on the world group, the same weights on every rank, and
    the full stacked routed weights of each layer."""
    from moeroute.bindings.torch.moe import MoE
    from moeroute.config import RouterConfig

    layers, weights = [], []
    redundant = -N % world_size + world_size  # P = N + redundant, a multiple of E
    for index in range(num_layers):
        torch.manual_seed(40 + index)  # identical on every rank
        shared_mlp = CountingMLP(HIDDEN, INTER)
        gate = torch.nn.Linear(HIDDEN, 1, bias=False)
        full = (torch.randn(N, 2 * INTER, HIDDEN) * HIDDEN**-0.5, torch.randn(N, HIDDEN, INTER) * INTER**-0.5)
        layer = MoE(
            RouterConfig(N, K),
            HIDDEN,
            INTER,
            shared_mlp,
            gate,
            shared=shared,
            ep_group=dist.group.WORLD,
            dispatch=dispatch,
            num_redundant_experts=redundant,
            record_load=record_load,
            placement=placement,
        )
        layer.load_routed_weights(*full)
        layers.append(layer)
        weights.append(full)
    return layers, weights


def skewed_inputs(rank, step, tokens=24):
    """This rank's hidden states and router logits: experts 0 and 1 hot."""
    generator = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(tokens + rank, HIDDEN, generator=generator)
    logits = torch.randn(tokens + rank, N, generator=generator)
    logits[:, 0] += 3.0
    logits[:, 1] += 2.0
    return x, logits


def _scale_rows(logical):
    """float32 [len, 2, 3] rows that name their logical expert."""
    return logical.float()[:, None, None] * 10 + torch.arange(6.0).reshape(1, 2, 3)


def _logical_counts(logits):
    ids = torch.topk(torch.softmax(logits, dim=-1), K, dim=-1).indices
    return torch.bincount(ids.reshape(-1), minlength=N)


def _expected_received_bytes(old, new, ep_size, rank, row_bytes):
    slots = len(old) // ep_size
    block = range(rank * slots, (rank + 1) * slots)
    held_before = {int(old[p]) for p in block}
    return sum(row_bytes for p in block if new[p] != old[p] and int(new[p]) not in held_before)


def _forward_all(layers, x, logits):
    with torch.no_grad():
        return [layer(x, logits) for layer in layers]


def _max_error(a_list, b_list):
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(a_list, b_list))


def live_worker(rank, world_size, payload):
    """Every (dispatch, shared) mode: gather_load, rebalance, apply; outputs, weights, bytes.
    With ``payload["more"]`` also the async and disagreement cases (one spawn for all)."""
    from moeroute.eplb import apply, gather_load, rebalance

    records = [dict(r, name="held-" + r["name"]) for r in held_async_worker(rank, world_size, None)]
    if payload and payload.get("more"):
        records += [dict(r, name="async-" + r["name"]) for r in async_worker(rank, world_size, None)]
        records.append(dict(disagree_worker(rank, world_size, None), name="disagree"))
    for dispatch in ("all2all", "allgather"):
        for shared in ("runner", "overlap", "fused"):
            # Several layers share one transfer: checked on 2 ranks; 4 ranks run one layer.
            # The overlap cases start from the round-robin placement, the others from linear.
            layers, weights = build_layers(
                world_size,
                dispatch,
                shared,
                num_layers=2 if world_size == 2 else 1,
                placement="round_robin" if shared == "overlap" else "linear",
            )
            # Stand-ins for a quantized format's per-expert tensors (scales, packed blocks):
            # any tensor of module.experts with one row per local expert travels with it.
            for layer in layers:
                logical = torch.tensor(
                    layer.routed_expert_ids() + [N] * layer.num_shared_experts * (layer.layout.shared == "fused")
                )
                layer.experts.register_buffer("scale_inv", _scale_rows(logical))
                layer.experts.register_buffer("blocks", logical[:, None].repeat(1, 5).to(torch.uint8))
            steps = 2
            local_counts = torch.zeros(N, dtype=torch.int64)
            for step in range(steps):
                x, logits = skewed_inputs(rank, step)
                before = _forward_all(layers, x, logits)
                local_counts += _logical_counts(logits)
            dist.all_reduce(local_counts)
            load = gather_load(layers)
            p = layers[0].layout.num_routed_physical
            placement = rebalance(load, p, world_size)
            old = [layer.layout.physical_to_logical.copy() for layer in layers]
            handle = apply(layers, placement)
            after = _forward_all(layers, x, logits)
            slots = p // world_size
            wrong_weights = 0
            for index, layer in enumerate(layers):
                for local, logical in enumerate(placement.layer(index)[rank * slots : (rank + 1) * slots]):
                    wrong_weights += not torch.equal(layer.experts.w_gate_up[local], weights[index][0][logical])
                    wrong_weights += not torch.equal(layer.experts.w_down[local], weights[index][1][logical])
            for index, layer in enumerate(layers):
                logical = torch.tensor(placement.layer(index)[rank * slots : (rank + 1) * slots].tolist())
                routed = logical.numel()
                wrong_weights += not torch.equal(layer.experts.scale_inv[:routed], _scale_rows(logical))
                wrong_weights += not torch.equal(
                    layer.experts.blocks[:routed], logical[:, None].repeat(1, 5).to(torch.uint8)
                )
            # gate_up + down float32 rows, scale_inv float32 [2, 3], blocks uint8 [5]
            row_bytes = (2 * INTER * HIDDEN + HIDDEN * INTER) * 4 + 6 * 4 + 5
            expected_bytes = sum(
                _expected_received_bytes(old[i], placement.layer(i), world_size, rank, row_bytes)
                for i in range(len(layers))
            )
            totals = torch.tensor([handle.bytes_sent, handle.bytes_received], dtype=torch.int64)
            dist.all_reduce(totals)
            records.append(
                dict(
                    name=f"{dispatch}-{shared}",
                    error=_max_error(after, before),
                    load=load.tolist(),
                    expected_load=[local_counts.tolist()] * len(layers),
                    tables=[layer.layout.physical_to_logical.tolist() for layer in layers],
                    expected_tables=placement.physical_to_logical.tolist(),
                    wrong_weights=wrong_weights,
                    bytes_received=handle.bytes_received,
                    expected_bytes_received=expected_bytes,
                    total_sent=int(totals[0]),
                    total_received=int(totals[1]),
                    experts_moved=handle.experts_moved,
                    expected_moved=int(placement.moved(np.stack(old)).sum()),
                    shared_mode=layers[0].layout.shared,
                    balancedness_before=_balancedness(load, np.stack(old), world_size),
                    balancedness_after=_balancedness(load, placement.physical_to_logical, world_size),
                )
            )
    return records


def _balancedness(load, tables, ep_size):
    from moeroute.eplb import balancedness

    return balancedness(load, tables, ep_size).tolist()


def async_worker(rank, world_size, payload):
    """apply(async_op=True) with forwards going on: the forward index at which each rank
    swapped, and every output against the output of the old placement."""
    from moeroute.eplb import apply, gather_load, rebalance

    records = []
    for dispatch in ("all2all", "allgather"):
        layers, _ = build_layers(world_size, dispatch, "overlap")
        x, logits = skewed_inputs(rank, 0)
        reference = _forward_all(layers, x, logits)
        placement = rebalance(gather_load(layers), layers[0].layout.num_routed_physical, world_size)
        handle = apply(layers, placement, async_op=True)
        pending_after_apply = layers[0].pending_placement is not None
        swapped_at, errors = None, []
        for step in range(4):
            out = _forward_all(layers, x, logits)
            errors.append(_max_error(out, reference))
            if swapped_at is None and layers[0].pending_placement is None:
                swapped_at = step
        handle.wait()
        records.append(
            dict(
                name=dispatch,
                pending_after_apply=pending_after_apply,
                swapped_at=swapped_at,
                errors=errors,
                done=handle.done,
                tables=[layer.layout.physical_to_logical.tolist() for layer in layers],
                expected_tables=placement.physical_to_logical.tolist(),
            )
        )
    return records


class HeldTransfer:
    """Stands in for ``moeroute.eplb.live._all_to_all`` (the seam dead_peer_worker uses too):
    the transfer `apply` posts reports itself in flight (``is_completed()`` False) until
    `release`, whatever the network did, so forwards run during it without any timing.

    ``post_at_apply=True``: the real all_to_all is posted at once, as `apply` does, and its
    bytes may land while it is held. False: it is posted only at `release`, and until then the
    receive buffer holds 0xFF bytes (NaN in every float format): a forward that read received
    rows before the swap would return NaN.
    """

    def __init__(self, real, post_at_apply: bool) -> None:
        self.real, self.post_at_apply = real, post_at_apply
        self.args, self.work = None, None
        self.released = False
        self.waited_while_held = False

    def __call__(self, recv_buffer, send_buffer, receive_sizes, send_sizes, group):
        self.args = (recv_buffer, send_buffer, receive_sizes, send_sizes, group)
        if self.post_at_apply:
            self.work = self.real(*self.args)
        else:
            recv_buffer.fill_(0xFF)
        return self

    def is_completed(self) -> bool:
        return self.released

    def wait(self, *args) -> bool:
        if not self.released:
            self.waited_while_held = True
            self.release()
        return True

    def release(self) -> None:
        """Finish the transfer (a collective: every rank calls it at the same point)."""
        if self.work is None:
            self.work = self.real(*self.args)
        self.work.wait()
        self.released = True


#: (dispatch, shared mode, post_at_apply) of the held asynchronous applies.
HELD_CASES = [
    ("all2all", "overlap", True),
    ("all2all", "fused", False),
    ("allgather", "runner", False),
    ("allgather", "fused", True),
]
#: Forwards run while the transfer is held open.
HELD_FORWARDS = 3


def held_async_worker(rank, world_size, payload):
    """apply(async_op=True) whose transfer is held open (`HeldTransfer`) across
    ``HELD_FORWARDS`` forwards, then released: per forward, the error against the output of
    the old placement and the placement in use; after the release, one forward, the table
    and whether every slot holds its logical expert's weights."""
    from moeroute.eplb import apply, gather_load, live, rebalance

    records = []
    real = live._all_to_all
    try:
        for dispatch, shared, post_at_apply in HELD_CASES:
            layers, weights = build_layers(world_size, dispatch, shared)
            x, logits = skewed_inputs(rank, 0)
            reference = _forward_all(layers, x, logits)  # the old placement
            old_tables = [layer.layout.physical_to_logical.tolist() for layer in layers]
            old_rows = [layer.experts.w_gate_up.clone() for layer in layers]
            placement = rebalance(gather_load(layers), layers[0].layout.num_routed_physical, world_size)
            held = live._all_to_all = HeldTransfer(real, post_at_apply)
            handle = apply(layers, placement, async_op=True)
            during = []
            for _ in range(HELD_FORWARDS):
                out = _forward_all(layers, x, logits)
                during.append(
                    dict(
                        error=_max_error(out, reference),
                        done=handle.done,
                        pending=all(layer.pending_placement is not None for layer in layers),
                        tables=[layer.layout.physical_to_logical.tolist() for layer in layers],
                        rows_kept=all(
                            torch.equal(layer.experts.w_gate_up, rows) for layer, rows in zip(layers, old_rows)
                        ),
                    )
                )
            held.release()
            out = _forward_all(layers, x, logits)
            slots = layers[0].layout.num_routed_physical // world_size
            wrong_weights = 0
            for index, layer in enumerate(layers):
                block = placement.layer(index)[rank * slots : (rank + 1) * slots]
                for local, logical in enumerate(block.tolist()):
                    wrong_weights += not torch.equal(layer.experts.w_gate_up[local], weights[index][0][logical])
                    wrong_weights += not torch.equal(layer.experts.w_down[local], weights[index][1][logical])
            records.append(
                dict(
                    name=f"{dispatch}-{shared}-{'posted' if post_at_apply else 'deferred'}",
                    during=during,
                    old_tables=old_tables,
                    moved=int(placement.moved(np.array(old_tables)).sum()),
                    waited_while_held=held.waited_while_held,
                    after_error=_max_error(out, reference),
                    after_done=handle.done,
                    after_pending=any(layer.pending_placement is not None for layer in layers),
                    after_tables=[layer.layout.physical_to_logical.tolist() for layer in layers],
                    expected_tables=placement.physical_to_logical.tolist(),
                    wrong_weights=wrong_weights,
                    error=repr(handle.error),
                )
            )
            handle.wait()  # a no-op once swapped
    finally:
        live._all_to_all = real
    return records


def disagree_worker(rank, world_size, payload):
    """Rank 1 applies another placement: every rank raises the same error, nothing moves."""
    from moeroute.bindings.ep import RankMismatchError
    from moeroute.eplb import apply, rebalance

    layers, weights = build_layers(world_size, "all2all", "fused", num_layers=1)
    load = np.arange(1, N + 1)[None] * (3 if rank == 1 else 1) ** np.arange(N)[None]
    placement = rebalance(load, layers[0].layout.num_routed_physical, world_size)
    old_table = layers[0].layout.physical_to_logical.tolist()
    old_weights = layers[0].experts.w_gate_up.clone()
    try:
        apply(layers, placement)
        outcome = "applied"
    except RankMismatchError as error:
        outcome = str(error)
    x, logits = skewed_inputs(rank, 0)
    _forward_all(layers, x, logits)  # still usable
    return dict(
        outcome=outcome,
        table_kept=layers[0].layout.physical_to_logical.tolist() == old_table,
        weights_kept=bool(torch.equal(layers[0].experts.w_gate_up, old_weights)),
    )


def dead_peer_worker(rank, world_size, payload):
    """The last rank dies inside the transfer: the others raise in seconds, placement intact."""
    from moeroute.bindings.ep import CollectiveError
    from moeroute.eplb import apply, live, rebalance

    layers, _ = build_layers(world_size, "all2all", "runner", num_layers=1)
    placement = rebalance(np.arange(1, N + 1) ** 3, layers[0].layout.num_routed_physical, world_size)
    old_table = layers[0].layout.physical_to_logical.tolist()
    old_weights = layers[0].experts.w_gate_up.clone()
    if rank == world_size - 1:

        def die(*args, **kwargs):
            os._exit(1)

        live._all_to_all = die
    start = time.monotonic()
    try:
        apply(layers, placement)
        outcome = "applied"
    except CollectiveError as error:
        outcome = "CollectiveError: " + str(error)
    return dict(
        outcome=outcome,
        seconds=time.monotonic() - start,
        table_kept=layers[0].layout.physical_to_logical.tolist() == old_table,
        weights_kept=bool(torch.equal(layers[0].experts.w_gate_up, old_weights)),
        pending=layers[0].pending_placement is not None,
    )
