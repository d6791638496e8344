"""Bodies of the spawned processes of test_ep.py (spawned by helpers.gloo.spawn_group).

Process start-up (torch import) dominates on a small machine, so one spawned group runs
many configurations in a loop and returns plain records; the test functions assert on
them. Every worker computes its reference independently: a dense single-process MoE layer
written here in plain torch (float64), never the code under test.
"""

from __future__ import annotations

import dataclasses
import os
import time
import traceback

import numpy as np
import torch
import torch.distributed as dist

from helpers.reference import dense_experts, rel_error
from moeroute.bindings.torch.mlp import GatedMLP
from moeroute.layout import ExpertLayout
from moeroute.routing import reference

#: Timeout of the dead/stalled-peer runs: the survivors must raise within it.
SHORT_TIMEOUT_S = 3
#: fp32 relative error allowed against the float64 dense reference.
FP32_TOLERANCE = 1e-5
#: bf16 activations round every hidden row and partial output to 8 mantissa bits.
BF16_TOLERANCE = 2e-2


# --------------------------------------------------------------------------- the layer


@dataclasses.dataclass
class Layer:
    """A small MoE layer in float32: HF stacked expert weights, SwiGLU, optional shared MLP."""

    router: torch.Tensor  # [N, H]
    gate_up: torch.Tensor  # [N, 2I, H], gate rows first
    down: torch.Tensor  # [N, H, I]
    shared_gate_up: torch.Tensor  # [2*S*I, H]
    shared_down: torch.Tensor  # [H, S*I]
    shared_gate: torch.Tensor | None  # [H] per-token sigmoid gate
    intermediate: int
    num_shared: int


def make_layer(seed, num_experts, hidden, intermediate, num_shared, gated):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    return Layer(
        router=rand(num_experts, hidden),
        gate_up=rand(num_experts, 2 * intermediate, hidden, scale=hidden**-0.5),
        down=rand(num_experts, hidden, intermediate, scale=intermediate**-0.5),
        shared_gate_up=rand(2 * num_shared * intermediate, hidden, scale=hidden**-0.5),
        shared_down=rand(hidden, num_shared * intermediate, scale=intermediate**-0.5),
        shared_gate=rand(hidden) if gated and num_shared else None,
        intermediate=intermediate,
        num_shared=num_shared,
    )


def swiglu(x, gate_up, down):
    gate, up = (x @ gate_up.t()).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ down.t()


def shared_gate_values(layer, x):
    """[T, 1] per-token gate, or None for an ungated shared expert."""
    if layer.shared_gate is None:
        return None
    return torch.sigmoid(x @ layer.shared_gate.to(x.dtype))[:, None]


def route(layer, x, top_k, rsf, force_expert=None):
    """Softmax top-k with renormalisation, rsf folded in: (ids int32 [T, K], w float32)."""
    logits = x.float() @ layer.router.t()
    if force_expert is not None:
        logits[:, force_expert] += 1e4  # every token's first choice
    probs = logits.softmax(dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32), (weights * rsf).to(torch.float32)


def dense_reference(layer, x, ids, weights):
    """float64 ``sum_k w_k expert_k(x) + g * shared(x)`` for every token."""
    out = dense_experts(x, weights, ids, layer.gate_up, layer.down)
    x = x.double()
    if layer.num_shared:
        shared = swiglu(x, layer.shared_gate_up.double(), layer.shared_down.double())
        gate = shared_gate_values(layer, x)
        out += shared if gate is None else gate * shared
    return out


def local_expert_weights(layer, layout, rank, local_id):
    """(gate_up [2I, H], down [H, I]) of ``rank``'s local expert ``local_id``."""
    start, count = layout.routed_range(rank)
    if local_id < count:
        logical = int(layout.physical_to_logical[start + local_id])
        return layer.gate_up[logical], layer.down[logical]
    j, inter = local_id - count, layer.intermediate
    total = layer.num_shared * inter
    gate_up = torch.cat(
        [
            layer.shared_gate_up[j * inter : (j + 1) * inter],
            layer.shared_gate_up[total + j * inter : total + (j + 1) * inter],
        ]
    )
    return gate_up, layer.shared_down[:, j * inter : (j + 1) * inter]


def local_compute(layer, layout, rank, recv_hidden, recv_weights, recv_local_ids):
    """Per received row, the sum over its local slots of w * expert(x), in float32."""
    partial = torch.zeros(recv_hidden.shape, dtype=torch.float32)
    x = recv_hidden.float()
    for local_id in range(layout.num_local_experts(rank)):
        rows, slots = (recv_local_ids == local_id).nonzero(as_tuple=True)
        if rows.numel():
            gate_up, down = local_expert_weights(layer, layout, rank, local_id)
            y = swiglu(x[rows], gate_up, down) * recv_weights[rows, slots, None]
            partial.index_add_(0, rows, y)
    return partial.to(recv_hidden.dtype)


def ep_forward(dispatcher, layer, layout, rank, x, ids, weights, rsf, overlap):
    """The EP pipeline on this rank's tokens: append slots, dispatch, compute, combine.

    ``weights`` carry rsf (the "router" regime); under the "output" regime it is divided
    out here and applied after the combine, as an engine using that regime would.
    """
    regime = layout.scaling_regime
    routed_weights = weights / rsf if regime == "output" else weights
    gate = shared_gate_values(layer, x.float())
    slot_weight = layout.shared_slot_weight(gate, rsf)
    if isinstance(slot_weight, torch.Tensor):
        slot_weight = slot_weight.numpy()
    phys_weights, phys_ids = reference.append_shared_slots(
        routed_weights.numpy(), ids.numpy(), layout, rank, slot_weight
    )
    handle = dispatcher.dispatch(x, torch.from_numpy(phys_weights), torch.from_numpy(phys_ids), async_op=overlap)
    in_flight = not handle.is_completed()
    shared_out = None
    if layout.shared in ("runner", "overlap"):
        shared_out = swiglu(x.float(), layer.shared_gate_up, layer.shared_down)
        if gate is not None:
            shared_out = gate * shared_out
    recv = handle.wait()
    partial = local_compute(layer, layout, rank, *recv)
    out = dispatcher.combine(partial, handle).float()
    if regime == "output":
        out = out * rsf
    if shared_out is not None:
        out = out + shared_out
    return out, phys_ids, in_flight


# --------------------------------------------------------------------------- configurations

_COUNT_PATTERNS = {
    2: [(5, 3), (0, 6), (7, 0), (4, 4), (1, 9)],
    4: [(5, 0, 3, 7), (2, 2, 2, 2), (0, 0, 6, 1), (3, 9, 1, 0), (4, 1, 0, 2)],
}


def dispatcher_configs(world_size):
    """Named configurations of the dispatcher runs; each record's name is one of these."""
    configs = []
    counts = _COUNT_PATTERNS[world_size]

    def add(name, **kw):
        base = dict(
            N=8,
            R=0,
            K=2,
            S=0,
            gated=False,
            shared="auto",
            slots=None,
            regime="router",
            rsf=2.5,
            force_expert=None,
            dtype="float32",
            counts=counts[len(configs) % len(counts)],
            placement="linear",
            table=None,
        )
        base.update(kw)
        configs.append(dict(name=name, **base))

    for dispatch in ("all2all", "allgather"):
        add(f"{dispatch}-noshared", dispatch=dispatch)
        owners = [("runner", None), ("overlap", None), ("fused", "per_rank")]
        if dispatch == "allgather":
            owners.append(("fused", "global"))
        for shared, slots in owners:
            for num_shared in (1, 2):
                for gated in (False, True):
                    for regime in ("router", "output"):
                        add(
                            f"{dispatch}-{shared}{'-' + slots if slots else ''}-S{num_shared}"
                            f"-{'gate' if gated else 'nogate'}-{regime}",
                            dispatch=dispatch,
                            shared=shared,
                            slots=slots,
                            S=num_shared,
                            gated=gated,
                            regime=regime,
                        )
        zero = tuple(0 for _ in range(world_size))
        add(f"{dispatch}-no-tokens-anywhere", dispatch=dispatch, S=1, counts=zero)
        add(
            f"{dispatch}-all-to-one-expert-K1",
            dispatch=dispatch,
            K=1,
            force_expert=5,
            counts=tuple(6 for _ in range(world_size)),
        )
        add(
            f"{dispatch}-all-to-one-expert-K3",
            dispatch=dispatch,
            K=3,
            S=1,
            force_expert=0,
            counts=tuple(6 for _ in range(world_size)),
        )
        add(
            f"{dispatch}-redundant-eplb",
            dispatch=dispatch,
            N=6,
            R=world_size,
            K=3,
            S=1,
            gated=True,
            counts=tuple(9 for _ in range(world_size)),
        )
        add(f"{dispatch}-uneven-placement", dispatch=dispatch, N=2 * world_size + 1, K=3, S=2, shared="fused")
        add(f"{dispatch}-bf16", dispatch=dispatch, S=1, gated=True, dtype="bfloat16")
        add(f"{dispatch}-round-robin", dispatch=dispatch, N=9, K=3, S=1, gated=True, placement="round_robin")
        add(
            f"{dispatch}-round-robin-redundant",
            dispatch=dispatch,
            N=6,
            R=world_size + 1,
            K=3,
            placement="round_robin",
            counts=tuple(9 for _ in range(world_size)),
        )
        # An EPLB table: logical 0 on every rank, the others once, in reverse order.
        add(
            f"{dispatch}-physical-to-logical-table",
            dispatch=dispatch,
            N=6,
            K=3,
            S=1,
            table=[5, 4, 3, 2, 1, 0] + [0] * (world_size - 1),
            counts=tuple(9 for _ in range(world_size)),
        )
    return configs


def _expected_bytes(layout, ids_by_rank, rank, hidden, element_size, top_k):
    """Dispatch/combine bytes computed from expert_map alone (not the dispatcher's tables)."""
    maps = [layout.expert_map(r) for r in range(layout.ep_size)]
    if layout.dispatch == "allgather":
        counts = [ids.shape[0] for ids in ids_by_rank]
        rows = (layout.ep_size - 1) * max(counts)
        returned = sum(counts) - counts[rank]
        return rows * (hidden * element_size + 8 * top_k), returned * hidden * element_size

    def destinations(home, row):
        # all2all never has global slots over several ranks (the layout refuses them).
        return {d for d in range(layout.ep_size) for p in row if maps[d][p] >= 0}

    sent = sum(1 for row in ids_by_rank[rank] for d in destinations(rank, row) if d != rank)
    received = sum(
        1 for home, ids in enumerate(ids_by_rank) if home != rank for row in ids if rank in destinations(home, row)
    )
    return sent * (hidden * element_size + 8 * top_k), received * hidden * element_size


def run_config(config, rank, world_size, debug=True):
    from moeroute.bindings.ep import make_dispatcher

    hidden, inter = 16, 8
    dtype = getattr(torch, config["dtype"])
    layout = ExpertLayout(
        config["N"],
        config["S"],
        ep_size=world_size,
        dispatch=config["dispatch"],
        shared=config["shared"],
        shared_slots=config["slots"],
        num_redundant_experts=config["R"],
        scaling_regime=config["regime"],
        placement=config["placement"],
        physical_to_logical=config["table"],
    )
    layer = make_layer(1234, config["N"], hidden, inter, config["S"], config["gated"])
    counts = config["counts"]
    gen = torch.Generator().manual_seed(99)
    x_all = torch.randn(sum(counts), hidden, generator=gen).to(dtype)
    ids_all, w_all = route(layer, x_all, config["K"], config["rsf"], config["force_expert"])
    start = sum(counts[:rank])
    mine = slice(start, start + counts[rank])

    dispatcher = make_dispatcher(layout, None, config["dispatch"], debug=debug)
    out, phys_ids, in_flight = ep_forward(
        dispatcher,
        layer,
        layout,
        rank,
        x_all[mine],
        ids_all[mine],
        w_all[mine],
        config["rsf"],
        overlap=layout.shared == "overlap",
    )
    expected = dense_reference(layer, x_all[mine], ids_all[mine], w_all[mine])
    scale = float(expected.abs().max()) if expected.numel() else 1.0
    error = float((out.double() - expected).abs().max()) / scale if out.numel() else 0.0

    # Every rank's physical ids, for the independent byte count.
    ids_by_rank = []
    for r in range(world_size):
        s = sum(counts[:r])
        routed_w = w_all[s : s + counts[r]]
        _, ids_r = reference.append_shared_slots(routed_w.numpy(), ids_all[s : s + counts[r]].numpy(), layout, r, None)
        ids_by_rank.append(ids_r)
    assert np.array_equal(ids_by_rank[rank], phys_ids)
    expected_dispatch, expected_combine = _expected_bytes(
        layout, ids_by_rank, rank, hidden, x_all.element_size(), phys_ids.shape[1]
    )
    stats = dispatcher.last_stats
    return dict(
        name=config["name"],
        shared=layout.shared,
        shape=tuple(out.shape),
        expected_shape=(counts[rank], hidden),
        error=error,
        tolerance=BF16_TOLERANCE if dtype == torch.bfloat16 else FP32_TOLERANCE,
        dispatch_bytes=stats.dispatch_bytes,
        expected_dispatch_bytes=expected_dispatch,
        combine_bytes=stats.combine_bytes,
        expected_combine_bytes=expected_combine,
        replica_slots=int(np.isin(phys_ids[:, : config["K"]], layout.routed_id_map[layout.num_routed_experts :]).sum()),
        logical_experts=[layout.logical_experts(r).tolist() for r in range(world_size)],
        in_flight=in_flight,
        overlap=layout.shared == "overlap",
        forced_expert_slots=(
            int((ids_all[mine][:, 0] == config["force_expert"]).sum()) if config["force_expert"] is not None else None
        ),
    )


def _outcome(fn):
    """(exception type name, message) of ``fn()``, or (None, None) when it returns."""
    try:
        fn()
    except Exception as error:  # recorded and asserted by the parent test
        return type(error).__name__, str(error)
    return None, None


def invalid_argument_cases(rank, world_size):
    from moeroute.bindings.ep import All2AllDispatcher, AllGatherDispatcher, make_dispatcher

    layout = ExpertLayout(8, 0, ep_size=world_size, dispatch="all2all")
    dispatcher = make_dispatcher(layout, None, "all2all")
    x = torch.zeros(3, 4)
    ids = torch.zeros(3, 2, dtype=torch.int32)
    w = torch.zeros(3, 2)
    cases = {
        "layout-type": lambda: make_dispatcher("all2all", None, "all2all"),
        "dispatch-unknown": lambda: make_dispatcher(layout, None, "ring"),
        "dispatch-mismatch": lambda: make_dispatcher(layout, None, "allgather"),
        "allgather-class-mismatch": lambda: AllGatherDispatcher(layout),
        "group-size": lambda: All2AllDispatcher(ExpertLayout(8, 0, ep_size=world_size + 1, dispatch="all2all")),
        "debug-type": lambda: make_dispatcher(layout, None, "all2all", debug="yes"),
        "ids-dtype": lambda: dispatcher.dispatch(x, w, ids.long()),
        "weights-shape": lambda: dispatcher.dispatch(x, w[:, :1], ids),
        "hidden-not-tensor": lambda: dispatcher.dispatch(x.numpy(), w, ids),
        "hidden-rank": lambda: dispatcher.dispatch(x[None], w, ids),
        "async-type": lambda: dispatcher.dispatch(x, w, ids, async_op=1),
        "old-order": lambda: dispatcher.dispatch(x, ids, w),
        "old-order-debug": lambda: make_dispatcher(layout, None, "all2all", debug=True).dispatch(x, ids, w),
    }
    out = {name: _outcome(fn) for name, fn in cases.items()}

    # Combine misuse (after a real, collective dispatch on every rank).
    handle = dispatcher.dispatch(x, w, ids)
    other = make_dispatcher(layout, None, "all2all")
    recv_rows = handle.wait()[0].shape[0]
    out["combine-foreign-handle"] = _outcome(lambda: other.combine(torch.zeros(recv_rows, 4), handle))
    out["combine-rows"] = _outcome(lambda: dispatcher.combine(torch.zeros(recv_rows + 1, 4), handle))
    out["combine-handle-type"] = _outcome(lambda: dispatcher.combine(torch.zeros(1, 4), None))
    dispatcher.combine(torch.zeros(recv_rows, 4), handle)
    out["combine-twice"] = _outcome(lambda: dispatcher.combine(torch.zeros(recv_rows, 4), handle))
    return out


def debug_fault_cases(rank, world_size):
    """Faults injected on every rank alike (so collectives stay matched); each must raise."""
    from moeroute.bindings.ep import All2AllDispatcher, AllGatherDispatcher, CheckedDispatcher

    out = {}
    hidden = 4
    x = torch.randn(6, hidden, generator=torch.Generator().manual_seed(rank))
    # Every rank routes each token to an expert of every rank.
    layout = ExpertLayout(8, 1, ep_size=world_size, dispatch="all2all")
    per_rank = 8 // world_size
    ids_logical = np.stack([[0, 8 - 1]] * 6).astype(np.int32)
    weights, phys = reference.append_shared_slots(np.ones((6, 2), np.float32), ids_logical, layout, rank)
    ids, w = torch.from_numpy(phys), torch.from_numpy(weights)

    class DropsSharedSlot(All2AllDispatcher):
        def _destinations(self, valid, safe, tables):
            owner, local = super()._destinations(valid, safe, tables)
            local[:, -1] = -1  # the shared slot reaches its rank without a local id
            return owner, local

    class WrongLocalId(All2AllDispatcher):
        def _destinations(self, valid, safe, tables):
            owner, local = super()._destinations(valid, safe, tables)
            local[:, 0] = (local[:, 0] + 1) % per_rank  # a live id of the wrong expert
            return owner, local

    out["all2all-dropped-slot"] = _outcome(lambda: CheckedDispatcher(DropsSharedSlot(layout)).dispatch(x, w, ids))
    out["all2all-wrong-local-id"] = _outcome(lambda: CheckedDispatcher(WrongLocalId(layout)).dispatch(x, w, ids))

    def combine_with_duplicated_row():
        dispatcher = CheckedDispatcher(All2AllDispatcher(layout))
        handle = dispatcher.dispatch(x, w, ids)
        index = handle.state.inner_state.send_token_index
        index[1] = index[0]  # row 1 goes home to token 0: token 0 combined twice
        partial = torch.zeros(handle.wait()[0].shape)
        dispatcher.combine(partial, handle)

    out["all2all-combined-twice"] = _outcome(combine_with_duplicated_row)

    global_layout = ExpertLayout(8, 1, ep_size=world_size, dispatch="allgather", shared_slots="global")
    gweights, gphys = reference.append_shared_slots(np.ones((6, 2), np.float32), ids_logical, global_layout, rank)

    class NoHomeMask(AllGatherDispatcher):
        def _local_ids(self, recv_ids, sizes):
            tables = self._tables(recv_ids.device)
            valid, safe = self._valid_and_safe(recv_ids)
            local = tables.local[self.rank][safe]
            return torch.where(valid, local, torch.full_like(local, -1)).to(torch.int32)

    out["allgather-unmasked-global-slot"] = _outcome(
        lambda: CheckedDispatcher(NoHomeMask(global_layout)).dispatch(
            x, torch.from_numpy(gweights), torch.from_numpy(gphys)
        )
    )

    # The same faults without debug mode: no check, no error (the check is what raises).
    out["all2all-dropped-slot-nodebug"] = _outcome(lambda: DropsSharedSlot(layout).dispatch(x, w, ids).wait())
    out.update(output_fault_cases(rank, world_size))
    return out


def first_expert_of_each_rank(layout):
    """Per rank d, the physical id of d's local expert 0."""
    return [int(np.flatnonzero(layout.expert_map(d) == 0)[0]) for d in range(layout.ep_size)]


def output_fault_cases(rank, world_size):
    """Faults in what a plain dispatcher hands out (``recv_local_ids``), caught by the wrapper.

    Every token has one slot on every rank (slot d -> the first expert of rank d), so on
    every rank received row 0 is rank 0's token row 0 and its one live slot is slot
    ``rank``. Each rank corrupts that entry; only rank 0, the home of token row 0, raises.
    """
    from moeroute.bindings.ep import All2AllDispatcher, AllGatherDispatcher, CheckedDispatcher
    from moeroute.bindings.torch.dispatch import DispatchHandle

    w = torch.full((3, world_size), 0.5)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    faults = {
        "dropped": lambda local: -1,  # the slot arrives with no local id
        "wrong-id": lambda local: local + 1,  # the next local expert of this rank
        "out-of-range": lambda local: 8,
    }  # no rank holds 8 local experts here
    out = {}
    for cls in (All2AllDispatcher, AllGatherDispatcher):
        for fault, corrupt in faults.items():

            class Corrupted(cls):
                def dispatch(self, *args, _corrupt=corrupt, **kwargs):
                    handle = super().dispatch(*args, **kwargs)
                    recv_hidden, recv_weights, recv_local = handle.wait()
                    recv_local = recv_local.clone()
                    assert int(recv_local[0, self.rank]) == 0  # the first expert of this rank
                    recv_local[0, self.rank] = _corrupt(int(recv_local[0, self.rank]))
                    return DispatchHandle(
                        (recv_hidden, recv_weights, recv_local), state=handle.state, num_tokens=handle.num_tokens
                    )

            layout = ExpertLayout(8, 0, ep_size=world_size, dispatch=cls.mode)
            ids = torch.tensor([first_expert_of_each_rank(layout)] * 3, dtype=torch.int32)
            out[f"output-{cls.mode}-{fault}"] = _outcome(
                lambda: CheckedDispatcher(Corrupted(layout)).dispatch(x, w, ids)
            )
            out[f"output-{cls.mode}-{fault}-nodebug"] = _outcome(lambda: Corrupted(layout).dispatch(x, w, ids))
    return out


# --------------------------------------------------------------------------- the MoE module


_SharedMLP = GatedMLP  # a gated shared MLP as transformers writes it (fusable into slots of size I)


def _relative_error(out, expected):
    return 0.0 if out.numel() == 0 else rel_error(out, expected)


def moe_module_cases(rank, world_size):
    """MoE(ep_group=...) on this rank's tokens against the single-process MoE on all tokens."""
    from moeroute.bindings.ep import make_dispatcher
    from moeroute.bindings.torch.moe import MoE
    from moeroute.config import RouterConfig

    hidden, inter, num_experts, top_k = 16, 8, 8, 2
    counts = _COUNT_PATTERNS[world_size][0]
    start = sum(counts[:rank])
    mine = slice(start, start + counts[rank])
    records = []
    for dispatch in ("all2all", "allgather"):
        for shared in ("runner", "overlap", "fused"):
            for num_shared, gated, regime in ((1, False, "router"), (2, True, "output")):
                torch.manual_seed(11)  # identical modules and weights on every rank
                shared_mlp = _SharedMLP(hidden, num_shared * inter)
                gate = torch.nn.Linear(hidden, 1, bias=False) if gated else None
                router = RouterConfig(num_experts, top_k, routed_scaling_factor=2.5)
                w_gate_up = torch.randn(num_experts, 2 * inter, hidden) * hidden**-0.5
                w_down = torch.randn(num_experts, hidden, inter) * inter**-0.5
                router_weight = torch.randn(num_experts, hidden)
                x_all = torch.randn(sum(counts), hidden)
                modules = []
                for group in (None, dist.group.WORLD):
                    module = MoE(
                        router,
                        hidden,
                        inter,
                        shared_mlp,
                        gate,
                        shared=shared,
                        ep_group=group,
                        dispatch=dispatch,
                        scaling_regime=regime,
                    )
                    with torch.no_grad():
                        module.router_weight.copy_(router_weight)
                    module.load_routed_weights(w_gate_up, w_down)
                    modules.append(module)
                single, ep = modules
                ep.dispatcher = make_dispatcher(ep.layout, None, dispatch, debug=True)
                with torch.no_grad():
                    expected = single(x_all)[mine]
                    out = ep(x_all[mine])
                records.append(
                    dict(
                        name=f"moe-{dispatch}-{shared}-S{num_shared}-{regime}",
                        error=_relative_error(out, expected),
                        shape=tuple(out.shape),
                        expected_shape=tuple(expected.shape),
                        shared=ep.layout.shared,
                        local_experts=ep.experts.w_gate_up.shape[0],
                        expected_local_experts=ep.layout.num_local_experts(rank),
                    )
                )
    return records


def _qwen3_5_block(hidden, inter, num_experts, top_k):
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    block = Qwen3_5MoeSparseMoeBlock(
        Qwen3_5MoeTextConfig(
            hidden_size=hidden,
            moe_intermediate_size=inter,
            shared_expert_intermediate_size=inter,
            num_experts=num_experts,
            num_experts_per_tok=top_k,
        )
    )
    gen = torch.Generator().manual_seed(21)  # the same block on every rank
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=gen) * 0.3)
    return block.eval()


def from_hf_cases(rank, world_size):
    """MoE.from_hf(block, ep_group=...) against the block itself and the one-rank module."""
    from moeroute.bindings.ep import make_dispatcher
    from moeroute.bindings.torch.moe import MoE

    hidden, counts = 16, _COUNT_PATTERNS[world_size][4]
    block = _qwen3_5_block(hidden, 8, 8, 3)
    start = sum(counts[:rank])
    mine = slice(start, start + counts[rank])
    x_all = torch.randn(sum(counts), hidden, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        block_out = block(x_all[None])
        block_out = (block_out[0] if isinstance(block_out, tuple) else block_out)[0]
    single = MoE.from_hf(block)
    records = []
    for dispatch in ("all2all", "allgather"):
        for shared in ("auto", "overlap"):
            ep = MoE.from_hf(block, ep_group=dist.group.WORLD, shared=shared, dispatch=dispatch)
            ep.dispatcher = make_dispatcher(ep.layout, None, dispatch, debug=True)
            with torch.no_grad():
                out = ep(x_all[mine])
                expected = single(x_all)[mine]
            records.append(
                dict(
                    name=f"from_hf-{dispatch}-{shared}",
                    shared=ep.layout.shared,
                    error=_relative_error(out, expected),
                    error_vs_block=_relative_error(out, block_out[mine]),
                    shape=tuple(out.shape),
                    expected_shape=tuple(expected.shape),
                )
            )
    return records


def placement_module_cases(rank, world_size):
    """gpt-oss-shaped MoE (swigluoai, expert and router biases) with round-robin placement and
    an EPLB table, on ep_group, against the one-rank module on all tokens."""
    from moeroute.bindings.ep import make_dispatcher
    from moeroute.bindings.torch.moe import MoE
    from moeroute.config import RouterConfig

    hidden, inter, num_experts, top_k = 16, 8, 8, 2
    counts = _COUNT_PATTERNS[world_size][3]
    start = sum(counts[:rank])
    mine = slice(start, start + counts[rank])
    table = list(range(num_experts))[::-1] + [3] * world_size  # logical 3 on every rank
    records = []
    for dispatch in ("all2all", "allgather"):
        for name, placement_kwargs in (
            ("round_robin", dict(placement="round_robin")),
            ("table", dict(physical_to_logical=table)),
        ):
            torch.manual_seed(12)  # identical weights on every rank
            router = RouterConfig(num_experts, top_k)
            weights = (
                torch.randn(num_experts, 2 * inter, hidden),
                torch.randn(num_experts, hidden, inter) * 0.3,
                torch.randn(num_experts, 2 * inter),
                torch.randn(num_experts, hidden),
            )
            router_weight, router_bias = torch.randn(num_experts, hidden), torch.randn(num_experts)
            x_all = torch.randn(sum(counts), hidden)
            modules = []
            for group in (None, dist.group.WORLD):
                module = MoE(
                    router,
                    hidden,
                    inter,
                    ep_group=group,
                    dispatch=dispatch,
                    activation="swigluoai",
                    expert_bias=True,
                    router_bias=True,
                    **(placement_kwargs if group is not None else {}),
                )
                with torch.no_grad():
                    module.router_weight.copy_(router_weight)
                    module.router_bias.copy_(router_bias)
                module.load_routed_weights(*weights)
                modules.append(module)
            single, ep = modules
            ep.dispatcher = make_dispatcher(ep.layout, None, dispatch, debug=True)
            with torch.no_grad():
                expected = single(x_all)[mine]
                out = ep(x_all[mine])
            records.append(
                dict(
                    name=f"placement-{dispatch}-{name}",
                    error=_relative_error(out, expected),
                    shape=tuple(out.shape),
                    expected_shape=tuple(expected.shape),
                    logical_experts=ep.routed_expert_ids(),
                )
            )
    return records


# --------------------------------------------------------------------------- rank agreement


def _moe_mismatch_cases(world_size):
    """(name, base MoE kwargs, last rank's overrides, {field: (base value, last rank's value)}).

    The last rank builds its layer with the overrides; every field listed must be reported
    with exactly these per-rank values (the other ranks take the base value).
    """
    from moeroute.config import RouterConfig

    grouped = dict(num_expert_group=2, topk_group=1)
    transforms = lambda width: dict(  # noqa: E731 - a latent MoE of routed width ``width``
        routed_input_transform=torch.nn.Linear(16, width, bias=False),
        routed_output_transform=torch.nn.Linear(width, 16, bias=False),
    )
    return [
        (
            "num_experts",
            {},
            dict(router=RouterConfig(12, 2)),
            {"router.num_experts": (8, 12), "layout.num_routed_experts": (8, 12)},
        ),
        ("top_k", {}, dict(router=RouterConfig(8, 3)), {"router.top_k": (2, 3)}),
        ("scoring", {}, dict(router=RouterConfig(8, 2, scoring="sigmoid")), {"router.scoring": ("softmax", "sigmoid")}),
        ("num_expert_group", {}, dict(router=RouterConfig(8, 2, **grouped)), {"router.num_expert_group": (1, 2)}),
        (
            "topk_group",
            dict(router=RouterConfig(8, 2, **grouped)),
            dict(router=RouterConfig(8, 2, num_expert_group=2, topk_group=2)),
            {"router.topk_group": (1, 2)},
        ),
        ("renormalize", {}, dict(router=RouterConfig(8, 2, renormalize=False)), {"router.renormalize": (True, False)}),
        (
            "routed_scaling_factor",
            {},
            dict(router=RouterConfig(8, 2, routed_scaling_factor=2.5)),
            {"router.routed_scaling_factor": (1.0, 2.5)},
        ),
        ("hidden_size", {}, dict(hidden_size=32), {"hidden_size": (16, 32)}),
        (
            "intermediate_size",
            {},
            dict(intermediate_size=4),
            {"intermediate_size": (8, 4), "layout.num_shared_experts": (1, 2)},
        ),
        ("routed_hidden_size", transforms(8), transforms(12), {"routed_hidden_size": (8, 12)}),
        ("dtype", {}, dict(dtype=torch.bfloat16), {"dtype": ("torch.float32", "torch.bfloat16")}),
        ("router_dtype", {}, dict(router_dtype=torch.bfloat16), {"router_dtype": ("torch.float32", "torch.bfloat16")}),
        ("activation", {}, dict(activation="gelu"), {"activation": ("silu", "gelu")}),
        (
            "shared",
            {},
            dict(shared="runner"),
            {"layout.shared": ("fused", "runner"), "layout.shared_slots": ("per_rank", None)},
        ),
        ("dispatch", {}, dict(dispatch="allgather"), {"layout.dispatch": ("all2all", "allgather")}),
        ("scaling_regime", {}, dict(scaling_regime="output"), {"layout.scaling_regime": ("router", "output")}),
        (
            "num_redundant_experts",
            {},
            dict(num_redundant_experts=world_size),
            {"layout.num_redundant_experts": (0, world_size)},
        ),
        ("correction_bias", {}, dict(correction_bias=True), {"correction_bias": (False, True)}),
        ("shared_expert_gate", {}, dict(gated=True), {"shared_expert_gate": (False, True)}),
    ]


def _mismatch_outcome(fn):
    """(exception type, message, {field: per-rank values}) of ``fn()``; Nones when it ran."""
    try:
        fn()
    except Exception as error:  # the outcome under test
        return type(error).__name__, str(error), getattr(error, "fields", None)
    return None, None, None


def _build_moe(world_size, overrides):
    from moeroute.bindings.torch.moe import MoE
    from moeroute.config import RouterConfig

    kwargs = dict(router=RouterConfig(8, 2), hidden_size=16, intermediate_size=8, ep_group=dist.group.WORLD)
    kwargs.update(overrides)
    gated = kwargs.pop("gated", False)
    hidden = kwargs["hidden_size"]
    shared_mlp = _SharedMLP(hidden, 8)
    gate = torch.nn.Linear(hidden, 1, bias=False) if gated else None
    return MoE(shared_experts=shared_mlp, shared_expert_gate=gate, **kwargs)


def _dispatcher_mismatch_cases(rank, world_size, dispatch):
    """Dispatchers whose last rank differs in one exchanged size; each must raise on all."""
    from moeroute.bindings.ep import make_dispatcher

    last = rank == world_size - 1
    layout = ExpertLayout(8, 0, ep_size=world_size, dispatch=dispatch)
    other_layout = ExpertLayout(12 if last else 8, 0, ep_size=world_size, dispatch=dispatch)
    gen = torch.Generator().manual_seed(rank)

    def dispatch_once(layout=layout, hidden=8, dtype=torch.float32, top_k=2, debug=False):
        x = torch.randn(5, hidden, generator=gen).to(dtype)
        ids = torch.randint(0, 8, (5, top_k), generator=gen, dtype=torch.int32)
        w = torch.rand(5, top_k, generator=gen)
        dispatcher = make_dispatcher(layout, None, dispatch, debug=debug)
        handle = dispatcher.dispatch(x, w, ids)
        dispatcher.combine(torch.zeros_like(handle.wait()[0]), handle)

    cases = {
        "hidden_states.shape[1]": ((8, 4), lambda: dispatch_once(hidden=4 if last else 8)),
        "hidden_states.dtype": (
            ("torch.float32", "torch.bfloat16"),
            lambda: dispatch_once(dtype=torch.bfloat16 if last else torch.float32),
        ),
        "topk_ids.shape[1]": ((2, 3), lambda: dispatch_once(top_k=3 if last else 2)),
        "debug": ((False, True), lambda: dispatch_once(debug=last)),
        "layout.num_routed_experts": ((8, 12), lambda: dispatch_once(layout=other_layout)),
    }
    records = {}
    for field, (values, fn) in cases.items():
        records[f"{dispatch}:{field}"] = (field, values, _mismatch_outcome(fn))

    # The group is still usable: partial = row * (sum of its live weights) sums home to
    # x * (sum of the token's weights), every slot counted once.
    dispatcher = make_dispatcher(layout, None, dispatch, debug=True)
    x = torch.randn(5, 8, generator=gen)
    ids = torch.randint(0, 8, (5, 2), generator=gen, dtype=torch.int32)
    w = torch.rand(5, 2, generator=gen)
    handle = dispatcher.dispatch(x, w, ids)
    recv_hidden, recv_weights, _ = handle.wait()
    out = dispatcher.combine(recv_hidden * recv_weights.sum(1, keepdim=True), handle)
    records[f"{dispatch}:after"] = _relative_error(out, x.double() * w.double().sum(1, keepdim=True))
    return records


def agreement_cases(rank, world_size):
    """Ranks that disagree: every case must raise RankMismatchError on every rank."""
    records = {}
    last = rank == world_size - 1
    for name, base, override, fields in _moe_mismatch_cases(world_size):
        torch.manual_seed(5)
        kwargs = dict(base)
        if last:
            kwargs.update(override)
        records[f"moe:{name}"] = (fields, _mismatch_outcome(lambda: _build_moe(world_size, kwargs)))
    for dispatch in ("all2all", "allgather"):
        records.update(_dispatcher_mismatch_cases(rank, world_size, dispatch))

    # A layer converted on one rank after construction: caught by the check of the first
    # exchange of its forward.
    from moeroute.bindings.torch.moe import MoE  # noqa: F401 - imported for _build_moe

    torch.manual_seed(5)
    module = _build_moe(world_size, {})
    if last:
        module = module.to(torch.bfloat16)
    x = torch.randn(3, 16, dtype=module.experts.w_gate_up.dtype)
    with torch.no_grad():
        records["forward:dtype"] = (
            "hidden_states.dtype",
            ("torch.float32", "torch.bfloat16"),
            _mismatch_outcome(lambda: module(x)),
        )
    return records


# --------------------------------------------------------------------------- workers


def configs_worker(rank, world_size, payload):
    records = [run_config(config, rank, world_size) for config in dispatcher_configs(world_size)]
    result = {"records": records}
    if payload and payload.get("invalid"):
        result["invalid"] = invalid_argument_cases(rank, world_size)
    if payload and payload.get("faults"):
        result["faults"] = debug_fault_cases(rank, world_size)
    # The module cases run last: a failure there is recorded without losing the records
    # above, and this rank then exits, so its peers fail fast instead of waiting.
    for key, cases in (
        ("moe", moe_module_cases),
        ("from_hf", from_hf_cases),
        ("placement", placement_module_cases),
        ("agreement", agreement_cases),
        ("checkpoint", checkpoint_cases),
    ):
        if payload and payload.get(key):
            try:
                result[key] = cases(rank, world_size)
            except Exception:
                result[key + "_error"] = traceback.format_exc()
                return result
    dist.barrier()
    return result


def peer_failure_worker(rank, world_size, payload):
    """Rank 1 exits (or stalls) before the dispatch; the others must raise, not hang."""
    from moeroute.bindings.ep import make_dispatcher

    layout = ExpertLayout(8, 1, ep_size=world_size, dispatch=payload["dispatch"])
    dispatcher = make_dispatcher(layout, None, payload["dispatch"], debug=True)
    x = torch.randn(4, 8)
    ids, w = route(make_layer(0, 8, 8, 4, 1, False), x, 2, 1.0)
    weights, phys = reference.append_shared_slots(w.numpy(), ids.numpy(), layout, rank)
    dist.barrier()
    if payload["failure"] == "build":  # rank 1 dies before the layer's agreement check
        if rank == 1:
            os._exit(0)
        from moeroute.bindings.torch.moe import MoE
        from moeroute.config import RouterConfig

        start = time.monotonic()
        try:
            MoE(RouterConfig(8, 2), 8, 4, ep_group=dist.group.WORLD)
        except Exception as error:  # the outcome under test
            return dict(raised=type(error).__name__, message=str(error)[:300], elapsed=time.monotonic() - start)
        return dict(raised=None, elapsed=time.monotonic() - start)
    if rank == 1:
        if payload["failure"] == "exit":
            os._exit(0)
        time.sleep(payload["stall_s"])
        return "stalled"
    start = time.monotonic()
    try:
        handle = dispatcher.dispatch(x, torch.from_numpy(weights), torch.from_numpy(phys))
        dispatcher.combine(torch.zeros(handle.wait()[0].shape), handle)
    except Exception as error:  # the outcome under test
        return dict(raised=type(error).__name__, message=str(error)[:300], elapsed=time.monotonic() - start)
    return dict(raised=None, elapsed=time.monotonic() - start)


def qwen35_worker(rank, world_size, payload):
    """Qwen3.5-MoE shape: 512 routed experts, top-10, one gated shared expert, fused
    per-rank slots on 8 all2all ranks (the shared-expert case moeroute exists to get right: one shared slot per rank under all2all)."""
    from moeroute.bindings.ep import make_dispatcher

    num_experts, top_k, hidden, inter = 512, 10, 8, 4
    records = []
    for dispatch in ("all2all", "allgather"):
        layout = ExpertLayout(num_experts, 1, ep_size=world_size, dispatch=dispatch)
        layer = make_layer(7, num_experts, hidden, inter, 1, True)
        counts = [3 + (r % 3) for r in range(world_size)]
        x_all = torch.randn(sum(counts), hidden, generator=torch.Generator().manual_seed(5))
        ids_all, w_all = route(layer, x_all, top_k, 1.0)
        start = sum(counts[:rank])
        mine = slice(start, start + counts[rank])
        dispatcher = make_dispatcher(layout, None, dispatch, debug=True)
        out, phys, _ = ep_forward(
            dispatcher, layer, layout, rank, x_all[mine], ids_all[mine], w_all[mine], 1.0, overlap=False
        )
        expected = dense_reference(layer, x_all[mine], ids_all[mine], w_all[mine])
        error = float((out.double() - expected).abs().max() / expected.abs().max())
        records.append(
            dict(
                dispatch=dispatch,
                shared=layout.shared,
                slots=layout.shared_slots,
                num_physical=layout.num_physical_experts,
                error=error,
                shared_ids=sorted(set(phys[:, -1].tolist())),
                expected_shared_ids=layout.shared_slot_ids(rank).tolist(),
            )
        )
    return records


def checkpoint_cases(rank, world_size):
    """A from_hf module under EP and transformers checkpoints: the save of a partial block is
    refused, the full block's state dict loads this rank's experts, moeroute's names save them."""
    from moeroute.bindings.torch.moe import MoE

    block = _qwen3_5_block(16, 8, 8, 3)
    full = {name: -tensor for name, tensor in block.state_dict().items()}  # other values than the block's
    moe = MoE.from_hf(block, ep_group=dist.group.WORLD)
    try:
        moe.state_dict()
        refusal = None
    except RuntimeError as error:
        refusal = str(error)
    result = moe.load_state_dict(full, strict=True)
    moe.checkpoint_format = None
    own = moe.state_dict()
    ids = moe.routed_expert_ids()
    routed = len(ids)
    inter = moe.intermediate_size
    return dict(
        refusal=refusal,
        missing=list(result.missing_keys),
        unexpected=list(result.unexpected_keys),
        ids=ids,
        shared=moe.layout.shared,
        keys=sorted(own),
        routed_equal=bool(
            torch.equal(own["experts.w_gate_up"][:routed], full["experts.gate_up_proj"][ids])
            and torch.equal(own["experts.w_down"][:routed], full["experts.down_proj"][ids])
        ),
        slot_equal=bool(torch.equal(own["experts.w_gate_up"][routed, :inter], full["shared_expert.gate_proj.weight"])),
        router_equal=bool(torch.equal(own["router_weight"], full["gate.weight"])),
    )
