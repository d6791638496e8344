"""Spawned gloo ranks of test_fp8_dispatch.py: FP8 dispatch (``MoE(..., dispatch_dtype="fp8")``).

Every rank builds three layers with the same FP8 experts: the expert-parallel layer with FP8
dispatch, the same with float dispatch, and the single-rank layer (all experts, no group).
It runs its own tokens through each and returns plain records: the outputs' differences,
the dispatcher's TransferStats, and the rows this rank had to send counted independently
from the NumPy routing definition and the linear placement formula (docs/semantics.md
section 2), never from the dispatcher's tables.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from _quant_ep_workers import _randn
from helpers.modules import CountingMLP
from moeroute.bindings.torch import MoE
from moeroute.bindings.torch.group import RankMismatchError
from moeroute.config import RouterConfig
from moeroute.quant import QuantConfig, quantize_experts
from moeroute.quant.reference import moe_experts_reference
from moeroute.routing import reference

#: H = 320 is not a multiple of the 128-column activation group (groups of 128, 128, 64).
H, N, K, T = 320, 6, 2, 7

#: (format config, I, activation dtype, dispatch, shared mode); I = 200 is not a multiple
#: of the 128-row block, and each rank holds N / 2 experts.
CASES = (
    (QuantConfig("fp8_block"), 200, torch.float32, "all2all", "runner"),
    (QuantConfig("fp8_block"), 200, torch.float32, "all2all", "fused"),
    (QuantConfig("fp8_block"), 200, torch.float32, "allgather", "overlap"),
    (QuantConfig("fp8_block"), 200, torch.float32, "allgather", "fused"),
    (QuantConfig("fp8_block", block_size=(64, 128), scale_fmt="ue8m0"), 100, torch.bfloat16, "all2all", "fused"),
    (QuantConfig("fp8_block"), 200, torch.bfloat16, "allgather", "runner"),
    (QuantConfig("fp8_tensor"), 100, torch.float32, "all2all", "overlap"),
)


def _owner(expert: int, world_size: int) -> int:
    """Rank holding routed expert ``expert`` under the linear placement, from its formula."""
    base, extra = divmod(N, world_size)
    for rank in range(world_size):
        start = rank * base + min(rank, extra)
        if start <= expert < start + base + (1 if rank < extra else 0):
            return rank
    raise AssertionError(expert)


def _rows_sent(router, router_weight, rank, world_size, dispatch) -> int:
    """Token rows this rank sends to other ranks, from the routing definition alone."""
    if dispatch == "allgather":  # every rank pads to the largest T and sends it to E - 1 ranks
        return (world_size - 1) * T
    x = _randn(T, H, seed=10 + rank, scale=1.0)
    _, ids = reference.select_experts((x @ router_weight.T).numpy(), router, None)
    # Fused shared slots are computed at home; each token travels once per other rank.
    return sum(len({_owner(int(e), world_size) for e in row} - {rank}) for row in ids)


def _layers(quant, inter, dtype, dispatch, shared, q, router_weight, shared_mlp):
    router = RouterConfig(N, K, "softmax", renormalize=True)
    layers = {}
    for name, group, dispatch_dtype in (
        ("fp8", dist.group.WORLD, "fp8"),
        ("float", dist.group.WORLD, None),
        ("single", None, None),
    ):
        module = MoE(
            router,
            H,
            inter,
            shared_experts=shared_mlp,
            shared=shared,
            ep_group=group,
            dispatch=dispatch,
            quant=quant,
            dispatch_dtype=dispatch_dtype,
        )
        with torch.no_grad():
            module.router_weight.copy_(router_weight)
        module.load_routed_weights(q[0], q[2], gate_up_scale=q[1], down_scale=q[3])
        layers[name] = module
    return router, layers


def _case(rank, world_size, quant, inter, dtype, dispatch, shared):
    shared_mlp = CountingMLP(H, inter).to(dtype)
    with torch.no_grad():
        for i, p in enumerate(shared_mlp.parameters()):
            p.copy_(_randn(*p.shape, seed=100 + i))
    q = quantize_experts(_randn(N, 2 * inter, H, seed=1), _randn(N, H, inter, seed=2), quant)
    router_weight = _randn(N, H, seed=3, scale=1.0)
    router, layers = _layers(quant, inter, dtype, dispatch, shared, q, router_weight, shared_mlp)
    x = _randn(T, H, seed=10 + rank, scale=1.0).to(dtype)
    outs, shared_calls = {}, {}
    with torch.no_grad():
        for name, module in layers.items():
            before = shared_mlp.calls
            outs[name] = module(x).float()
            shared_calls[name] = shared_mlp.calls - before
    fp8_stats = layers["fp8"].dispatcher.last_stats
    float_stats = layers["float"].dispatcher.last_stats
    single = outs["single"]
    record = {
        "case": (
            quant.format,
            quant.block_size,
            quant.scale_fmt,
            inter,
            str(dtype),
            dispatch,
            layers["fp8"].layout.shared,
        ),
        "rank": rank,
        # FP8 dispatch against the single-rank FP8 layer (float32 summation order only).
        "error_vs_single": float((outs["fp8"] - single).abs().max() / single.abs().max()),
        # ... and against the same EP layer dispatching float rows (same q, same scales).
        "equal_to_float_dispatch": bool(torch.equal(outs["fp8"], outs["float"])),
        # The shared MLP ran once per forward, or never when fused (its slots computed it).
        "shared_calls": shared_calls["fp8"],
        "hidden_bytes": fp8_stats.hidden_bytes,
        "scale_bytes": fp8_stats.scale_bytes,
        "token_bytes": fp8_stats.token_bytes,
        "rows_sent": fp8_stats.rows_sent,
        "float_hidden_bytes": float_stats.hidden_bytes,
        "float_rows_sent": float_stats.rows_sent,
        "expected_rows": _rows_sent(router, router_weight, rank, world_size, dispatch),
        "groups": 1 if quant.activation_group_size is None else -(-H // quant.activation_group_size),
        "element_size": torch.empty((), dtype=dtype).element_size(),
    }
    if dtype == torch.float32 and quant.format == "fp8_block" and shared == "runner":
        # The independent w8a8 definition (plain torch) plus the float shared MLP, once.
        weights, ids = reference.select_experts((x @ router_weight.T).numpy(), router, None)
        expected = moe_experts_reference(
            x, torch.from_numpy(weights), torch.from_numpy(ids).long(), *q, quant.block_size, quant.scale_fmt
        )
        with torch.no_grad():
            expected += shared_mlp(x)
        record["error_vs_reference"] = float((outs["fp8"] - expected).abs().max() / expected.abs().max())
    return record


def _mismatch(rank, world_size):
    """Rank 0 asks for FP8 dispatch, rank 1 does not: every rank must refuse at construction."""
    try:
        MoE(
            RouterConfig(N, K, "softmax", renormalize=True),
            H,
            200,
            ep_group=dist.group.WORLD,
            quant=QuantConfig("fp8_block"),
            dispatch_dtype="fp8" if rank == 0 else None,
        )
    except RankMismatchError as error:
        return str(error)
    return None


def _float_only_dispatcher(rank, world_size):
    """A dispatcher_factory whose dispatcher does not carry FP8 rows: refused at construction."""

    class FloatOnly:
        pass

    try:
        MoE(
            RouterConfig(N, K, "softmax", renormalize=True),
            H,
            200,
            ep_group=dist.group.WORLD,
            quant=QuantConfig("fp8_block"),
            dispatch_dtype="fp8",
            dispatcher_factory=lambda layout, group, dispatch: FloatOnly(),
        )
    except ValueError as error:
        return str(error)
    return None


def fp8_dispatch_worker(rank, world_size, payload=None):
    records = [_case(rank, world_size, *case) for case in CASES]
    return {
        "cases": records,
        "mismatch": _mismatch(rank, world_size),
        "float_only": _float_only_dispatcher(rank, world_size),
    }


#: Both ranks' whole case loop must finish within this (a loaded 2-core machine).
JOIN_TIMEOUT_S = 300
