"""Spawned gloo ranks of test_quant_ep.py: FP8 MoE layers under expert parallelism.

Every rank builds the same FP8 layer (its own experts only), loads the full stacked FP8
tensors, runs its own tokens and compares with the single-process w8a8 reference of
moeroute.quant.reference (plus the float shared MLP, once).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from helpers.modules import CountingMLP
from helpers.reference import randn
from moeroute.bindings.torch import MoE
from moeroute.config import RouterConfig
from moeroute.quant import QuantConfig, quantize_experts
from moeroute.quant.reference import moe_experts_reference
from moeroute.routing import reference

H, N, K, T = 256, 6, 2, 5
#: The whole case loop of both ranks must finish within this (a loaded 2-core machine).
JOIN_TIMEOUT_S = 400


_randn = functools.partial(randn, scale=0.1)


def _case(rank, world_size, quant, inter, dispatch, shared):
    router = RouterConfig(N, K, "softmax", renormalize=True)
    shared_mlp = CountingMLP(H, inter)
    with torch.no_grad():
        for i, p in enumerate(shared_mlp.parameters()):
            p.copy_(_randn(*p.shape, seed=100 + i))
    module = MoE(
        router,
        H,
        inter,
        shared_experts=shared_mlp,
        shared=shared,
        ep_group=dist.group.WORLD,
        dispatch=dispatch,
        quant=quant,
    )
    q = quantize_experts(_randn(N, 2 * inter, H, seed=1), _randn(N, H, inter, seed=2), quant)
    router_weight = _randn(N, H, seed=3, scale=1.0)
    with torch.no_grad():
        module.router_weight.copy_(router_weight)
    module.load_routed_weights(q[0], q[2], gate_up_scale=q[1], down_scale=q[3])
    x = _randn(T, H, seed=10 + rank, scale=1.0)
    with torch.no_grad():
        out = module(x)
    weights, ids = reference.select_experts((x @ router_weight.T).numpy(), router, None)
    expected = moe_experts_reference(
        x, torch.from_numpy(weights), torch.from_numpy(ids).long(), *q, quant.block_size, quant.scale_fmt
    )
    if module.layout.shared == "fused":
        slots_gu = torch.cat([shared_mlp.gate_proj.weight, shared_mlp.up_proj.weight])[None].detach()
        slots = quantize_experts(slots_gu, shared_mlp.down_proj.weight[None].detach(), quant)
        expected += moe_experts_reference(
            x, torch.ones(T, 1), torch.zeros(T, 1, dtype=torch.long), *slots, quant.block_size, quant.scale_fmt
        )
    else:
        with torch.no_grad():
            x64 = x.double()
            expected += (
                F.silu(x64 @ shared_mlp.gate_proj.weight.double().T)
                * (x64 @ shared_mlp.up_proj.weight.double().T)
                @ shared_mlp.down_proj.weight.double().T
            ).float()
    return {
        "format": quant.format,
        "inter": inter,
        "dispatch": dispatch,
        "shared": module.layout.shared,
        "rank": rank,
        "error": float((out - expected).abs().max() / expected.abs().max()),
        "shared_calls": shared_mlp.calls,
        "local_experts": module.routed_expert_ids(),
    }


def fp8_worker(rank, world_size, payload=None):
    cases = []
    for quant, inter in (
        (QuantConfig("fp8_block"), 200),
        (QuantConfig("fp8_block", block_size=(64, 128)), 100),
        (QuantConfig("fp8_tensor"), 100),
    ):
        for dispatch in ("all2all", "allgather"):
            for shared in ("runner", "overlap", "fused"):
                cases.append(_case(rank, world_size, quant, inter, dispatch, shared))
    return cases
