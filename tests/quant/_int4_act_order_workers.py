"""Spawned gloo ranks of test_int4_act_order.py: a GPTQ act-order checkpoint loaded by an
expert-parallel INT4 layer (each rank its own experts), run on each rank's own tokens."""

from __future__ import annotations

import torch.distributed as dist

from moeroute.bindings.torch import MoE
from moeroute.config import RouterConfig
from moeroute.quant import QuantConfig


def worker(rank, world_size, payload):
    state, (h, i, n, k, g), x, logits = payload
    quant = QuantConfig("int4", group_size=g, symmetric=False, checkpoint="gptq_v2")
    layer = MoE(
        RouterConfig(n, k, "softmax", renormalize=True),
        h,
        i,
        quant=quant,
        ep_group=dist.group.WORLD,
        dispatch="all2all",
        placement="round_robin",
    )
    layer.load_state_dict({k[len("mlp.") :]: v for k, v in state.items()})
    perm = layer.experts.gate_up_perm
    return {
        "local_experts": layer.routed_expert_ids(),
        "gate_up_perm": None if perm is None else perm.clone(),
        "out": layer(x[rank], logits[rank]),
    }
