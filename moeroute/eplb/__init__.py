"""Expert load balancing (EPLB) as a closed loop: measure, rebalance, move the experts.

* `rebalance` computes a placement of P physical experts over E ranks from tokens per
  logical expert (DeepSeek's hierarchical / global policies, refined; see
  `moeroute.eplb.placement`).
* `balancedness` (mean rank load / max rank load) and its kin measure a placement, planned
  (`rank_load`, `balancedness`) or from physical counters (`rank_load_from_physical`,
  `balancedness_from_physical`, `fold_physical_load`).
* `gather_load` reads the windows of ``MoE(..., record_load=True)`` layers over the EP
  group; `apply` moves the expert weights of live layers to a new placement (torch; both
  live in `moeroute.eplb.live` and are imported when first used, so planning needs only
  NumPy and Numba).
"""

from moeroute.eplb.placement import (
    POLICIES,
    Placement,
    balancedness,
    balancedness_from_physical,
    fold_physical_load,
    linear_placement,
    rank_load,
    rank_load_from_physical,
    rebalance,
    round_robin_placement,
)

__all__ = [
    "POLICIES",
    "Placement",
    "apply",
    "balancedness",
    "balancedness_from_physical",
    "fold_physical_load",
    "gather_load",
    "linear_placement",
    "rank_load",
    "rank_load_from_physical",
    "rebalance",
    "round_robin_placement",
]

#: Names served by `moeroute.eplb.live` (torch), imported on first use.
_LIVE = ("apply", "gather_load")


def __getattr__(name):
    if name in _LIVE:
        from moeroute.eplb import live

        return getattr(live, name)
    raise AttributeError(f"module 'moeroute.eplb' has no attribute {name!r}")
