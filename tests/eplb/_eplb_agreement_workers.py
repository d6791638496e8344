"""Body of the spawned gloo ranks of test_eplb_agreement.py (one group runs every case)."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

N, K, HIDDEN, INTER = 8, 2, 16, 8
#: A permutation of the N experts over P = N physical slots: a valid table for E = 2 and 4.
TABLE = [3, 0, 6, 1, 7, 2, 5, 4]


def _layer():
    from moeroute.bindings.torch.moe import MoE
    from moeroute.config import RouterConfig

    torch.manual_seed(40)  # identical on every rank
    layer = MoE(RouterConfig(N, K), HIDDEN, INTER, ep_group=dist.group.WORLD, dispatch="all2all")
    layer.load_routed_weights(torch.randn(N, 2 * INTER, HIDDEN), torch.randn(N, HIDDEN, INTER))
    return layer


def _attempt(layer, placement):
    from moeroute.bindings.ep import RankMismatchError
    from moeroute.eplb import apply

    table = layer.layout.physical_to_logical.tolist()
    rows = layer.experts.w_gate_up.clone()
    try:
        apply(layer, placement)
        outcome = "applied"
    except RankMismatchError as error:
        outcome = str(error)
    return dict(
        outcome=outcome,
        table_kept=layer.layout.physical_to_logical.tolist() == table,
        rows_kept=bool(torch.equal(layer.experts.w_gate_up, rows)),
        table=layer.layout.physical_to_logical.tolist(),
    )


def agreement_worker(rank, world_size, payload):
    """Each case: what apply did on this rank, and whether its layer kept its placement."""
    from moeroute.eplb import Placement

    records = {}
    layer = _layer()
    # The same table, another ep_size on rank 1 (P = 8 divides by 2 and by 4).
    records["ep_size"] = _attempt(layer, Placement(np.array(TABLE), 4 if rank == 1 else world_size))
    # The same placement, rank 1's layer moved to another dtype since it was built.
    if rank == 1:
        layer.to(torch.bfloat16)
    records["dtype"] = _attempt(layer, Placement(np.array(TABLE), world_size))
    # Ranks that agree: the placement is applied on both (no field differs by rank).
    records["agreed"] = _attempt(_layer(), Placement(np.array(TABLE), world_size))
    return records
