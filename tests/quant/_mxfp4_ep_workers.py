"""Spawned gloo ranks of test_mxfp4_ep.py: MXFP4 gpt-oss layers under expert parallelism.

Every rank builds the same layer (its own experts only), loads the full packed tensors and
the biases, runs its own tokens, and reports its output with its inputs; the test compares
with the single-process float32 reference of test_mxfp4_moe.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from helpers.reference import randn
from moeroute.bindings.torch import MoE
from moeroute.config import RouterConfig
from moeroute.quant import QuantConfig, quantize_mxfp4

H, I, N, K, T = 128, 64, 6, 2, 7
ROUTER = RouterConfig(N, K, "softmax", renormalize=True)
#: Both ranks' case loops must finish within this (a loaded 2-core machine).
JOIN_TIMEOUT_S = 300
#: (dispatch, placement, physical_to_logical)
CASES = [("all2all", "linear", None), ("allgather", "round_robin", None), ("all2all", "linear", [5, 0, 3, 1, 4, 2])]


def weights():
    """The full packed experts, biases and router, the same on every rank."""
    return {
        "gate_up": quantize_mxfp4(randn(N, 2 * I, H, seed=1, scale=0.1)),
        "down": quantize_mxfp4(randn(N, H, I, seed=2, scale=0.1)),
        "gate_up_bias": randn(N, 2 * I, seed=3, scale=0.5),
        "down_bias": randn(N, H, seed=4, scale=0.5),
        "router_weight": randn(N, H, seed=5),
        "router_bias": randn(N, seed=6),
    }


def _case(rank, dispatch, placement, table, dtype):
    w = weights()
    module = MoE(
        ROUTER,
        H,
        I,
        activation="swigluoai",
        expert_bias=True,
        router_bias=True,
        ep_group=dist.group.WORLD,
        dispatch=dispatch,
        placement=placement,
        physical_to_logical=table,
        quant=QuantConfig("mxfp4"),
    )
    with torch.no_grad():
        module.router_weight.copy_(w["router_weight"])
        module.router_bias.copy_(w["router_bias"])
    module.load_routed_weights(
        w_gate_up=w["gate_up"], w_down=w["down"], gate_up_bias=w["gate_up_bias"], down_bias=w["down_bias"]
    )
    x = randn(T, H, seed=10 + rank).to(dtype)
    with torch.no_grad():
        out = module(x)
    ids = module.routed_expert_ids()
    return {
        "dispatch": dispatch,
        "placement": placement,
        "table": table,
        "dtype": str(dtype),
        "rank": rank,
        "x": x,
        "out": out,
        "local_experts": ids,
        "holds_only_local": torch.equal(module.experts.w_gate_up, w["gate_up"][0][ids])
        and torch.equal(module.experts.down_scale, w["down"][1][ids]),
    }


def worker(rank, world_size, payload=None):
    return [_case(rank, *case, dtype) for case in CASES for dtype in (torch.float32, torch.bfloat16)]
