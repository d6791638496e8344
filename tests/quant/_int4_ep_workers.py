"""Spawned gloo ranks of test_int4_ep.py: INT4 (w4a16) MoE layers under expert parallelism.

Every rank builds the same INT4 layer (its own experts only) and, beside it, the same layer
with float experts (the INT4 weights dequantized), both with a counting shared MLP; it loads
the full packed tensors, runs its own tokens through both and reports its inputs, outputs,
held experts and the shared MLP's calls. The test compares with the single-process float64
reference on the dequantized weights.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from helpers.modules import CountingMLP
from helpers.reference import randn
from moeroute.bindings.torch import MoE
from moeroute.config import RouterConfig
from moeroute.quant import QuantConfig, dequantize_int4, quantize_int4

H, N, K, T = 256, 6, 2, 7
ROUTER = RouterConfig(N, K, "softmax", renormalize=True)
#: Both ranks' case loops must finish within this: a loaded 2-core machine, where both ranks
#: may first compile the INT4 kernels (a cold Numba cache, after any edit of the package).
JOIN_TIMEOUT_S = 600
#: (group_size, symmetric, I, dispatch, shared, placement, physical_to_logical, dtype)
CASES = (
    (32, True, 64, "all2all", "runner", "linear", None, torch.float32),
    (64, False, 128, "allgather", "overlap", "round_robin", None, torch.float32),
    (128, True, 128, "all2all", "fused", "linear", [5, 0, 3, 1, 4, 2], torch.float32),
    (32, False, 96, "allgather", "runner", "linear", None, torch.bfloat16),
    (128, False, 128, "all2all", "fused", "round_robin", None, torch.bfloat16),
)


def weights(group, symmetric, inter):
    """The full packed experts, router, shared MLP and its gate: the same on every rank."""
    kwargs = {"group_size": group, "symmetric": symmetric}
    return {
        "gate_up": quantize_int4(randn(N, 2 * inter, H, seed=1, scale=0.1), **kwargs),
        "down": quantize_int4(randn(N, H, inter, seed=2, scale=0.1), **kwargs),
        "router_weight": randn(N, H, seed=3),
        "shared": [randn(inter, H, seed=4, scale=0.1), randn(inter, H, seed=5, scale=0.1)]
        + [randn(H, inter, seed=6, scale=0.1)],
        "shared_gate": randn(1, H, seed=7, scale=0.1),
    }


def _layer(quant, inter, dispatch, shared, placement, table, w, dtype):
    shared_mlp = CountingMLP(H, inter)
    gate = nn.Linear(H, 1, bias=False)
    with torch.no_grad():
        for linear, value in zip((shared_mlp.gate_proj, shared_mlp.up_proj, shared_mlp.down_proj), w["shared"]):
            linear.weight.copy_(value)
        gate.weight.copy_(w["shared_gate"])
    shared_mlp.to(dtype)
    gate.to(dtype)
    module = MoE(
        ROUTER,
        H,
        inter,
        shared_experts=shared_mlp,
        shared_expert_gate=gate,
        shared=shared,
        ep_group=dist.group.WORLD,
        dispatch=dispatch,
        placement=placement,
        physical_to_logical=table,
        quant=quant,
    )
    with torch.no_grad():
        module.router_weight.copy_(w["router_weight"])
    return module, shared_mlp


def _case(rank, group, symmetric, inter, dispatch, shared, placement, table, dtype):
    w = weights(group, symmetric, inter)
    quant = QuantConfig("int4", group_size=group, symmetric=symmetric)
    module, shared_mlp = _layer(quant, inter, dispatch, shared, placement, table, w, dtype)
    module.load_routed_weights(w["gate_up"], w["down"])
    # The same layer with float experts: the shared MLP's plan must not depend on the format.
    float_module, float_shared_mlp = _layer(None, inter, dispatch, shared, placement, table, w, dtype)
    float_module.load_routed_weights(
        dequantize_int4(*w["gate_up"], group_size=group), dequantize_int4(*w["down"], group_size=group)
    )
    float_module.to(dtype)
    x = randn(T, H, seed=10 + rank).to(dtype)
    with torch.no_grad():
        out = module(x)
        float_module(x)
    ids = module.routed_expert_ids()
    return {
        "case": (group, symmetric, inter, dispatch, shared, placement, table, str(dtype)),
        "rank": rank,
        "x": x,
        "out": out,
        "shared_plan": module.layout.shared,
        "float_shared_plan": float_module.layout.shared,
        "shared_calls": shared_mlp.calls,
        "shared_rows": shared_mlp.rows,
        "float_shared_calls": float_shared_mlp.calls,
        "float_shared_rows": float_shared_mlp.rows,
        "local_experts": ids,
        "holds_only_local": all(
            torch.equal(getattr(module.experts, name)[: len(ids)], full[ids])
            for name, full in (("w_gate_up", w["gate_up"][0]), ("w_down", w["down"][0]))
        ),
    }


def worker(rank, world_size, payload=None):
    return [_case(rank, *case) for case in CASES]
