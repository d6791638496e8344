"""Expert load balancing: how balanced each placement is, and how long planning takes.

DeepSeek-V3's shape: N = 256 logical experts in 8 groups, 32 redundant experts (P = 288),
on 8 and 32 ranks over 1 and 4 nodes, 61 MoE layers. Loads are Zipf samples (exponents
0.8 to 1.4: the popularity of the i-th most popular expert is 1 / i**s, experts shuffled per
layer, 65536 tokens x top-8 per layer). For each setting:

* balancedness (mean rank load / max rank load, averaged over the layers) of the linear
  placement (``ExpertLayout``'s default, replicas p -> p % N), of DeepSeek's greedy (the
  plain-Python definition of the tests, tests/eplb/_eplb_reference.py) and of
  ``moeroute.eplb.rebalance``;
* experts moved when the load drifts by +-10 % and the plan follows the previous one
  (``previous=``) against a fresh plan;
* the time to rebalance all 61 layers (median of several calls), and its ratio to the
  plain-Python greedy (interleaved, median of the per-pair ratios);
* on 4 gloo ranks (``moeroute run --eplb`` machinery: a DeepSeek-V3-routed layer at a small
  hidden size, skewed router logits), the heaviest rank's tokens and the layer time before
  and after one live rebalance; the old and the rebalanced layer are timed in turn on every
  rank (median of the per-pair ratios).

    python bench/eplb.py              # table + bench/results/eplb.json
    python bench/eplb.py --quick      # fewer layers and settings (the test suite's smoke run)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "tests" / "eplb"))

from _common import interleaved, median_time, print_table, write_results  # noqa: E402
import _eplb_reference as reference  # noqa: E402

from moeroute.eplb import balancedness, linear_placement, rebalance  # noqa: E402
from moeroute.eplb.cli import synthetic_load  # noqa: E402

NUM_EXPERTS = 256
NUM_GROUPS = 8
NUM_REDUNDANT = 32
NUM_LAYERS = 61
#: Routed (token, expert) pairs per layer: 65536 tokens x top-8.
PAIRS_PER_LAYER = 65536 * 8
EXPONENTS = (0.8, 1.0, 1.2, 1.4)
RANKS = (8, 32)
NODES = (1, 4)
#: Relative drift of the load between two plans (uniform, per expert).
DRIFT = 0.1


def greedy_balancedness(load: np.ndarray, p: int, e: int, nodes: int) -> np.ndarray:
    return np.array(
        [reference.balancedness(reference.greedy_rank_loads(row.tolist(), p, e, nodes, NUM_GROUPS)) for row in load]
    )


def run(quick: bool) -> dict:
    layers = 4 if quick else NUM_LAYERS
    exponents = EXPONENTS[::3] if quick else EXPONENTS
    p = NUM_EXPERTS + NUM_REDUNDANT
    rows, records = [], []
    for exponent in exponents:
        load = synthetic_load(f"zipf:{exponent},layers:{layers},tokens:{PAIRS_PER_LAYER},experts:{NUM_EXPERTS},seed:0")
        drifted = load * np.random.default_rng(1).uniform(1 - DRIFT, 1 + DRIFT, size=load.shape)
        for e in RANKS:
            for nodes in NODES:
                plan = rebalance(load, p, e, num_nodes=nodes, num_groups=NUM_GROUPS)
                linear = balancedness(load, linear_placement(NUM_EXPERTS, p, layers), e)
                greedy = greedy_balancedness(load, p, e, nodes)
                ours = balancedness(load, plan, e)
                fresh = rebalance(drifted, p, e, num_nodes=nodes, num_groups=NUM_GROUPS)
                kept = rebalance(drifted, p, e, num_nodes=nodes, num_groups=NUM_GROUPS, previous=plan)
                seconds = median_time(
                    lambda: rebalance(load, p, e, num_nodes=nodes, num_groups=NUM_GROUPS),
                    repeats=3 if quick else 7,
                    warmup=1,
                )
                record = {
                    "zipf": exponent,
                    "ep_size": e,
                    "num_nodes": nodes,
                    "layers": layers,
                    "num_logical_experts": NUM_EXPERTS,
                    "num_physical_experts": p,
                    "num_groups": NUM_GROUPS,
                    "policy": plan.policy,
                    "balancedness_linear": float(linear.mean()),
                    "balancedness_greedy": float(greedy.mean()),
                    "balancedness_moeroute": float(ours.mean()),
                    "layers_better_than_greedy": int((ours > greedy * (1 + 1e-9)).sum()),
                    "layers_worse_than_greedy": int((ours < greedy * (1 - 1e-9)).sum()),
                    "duplicates_per_layer": float(plan.duplicates().mean()),
                    "moved_fresh_per_layer": float(fresh.moved(plan).mean()),
                    "moved_with_previous_per_layer": float(kept.moved(plan).mean()),
                    "rebalance_seconds": seconds,
                }
                records.append(record)
                rows.append(
                    (
                        exponent,
                        e,
                        nodes,
                        record["balancedness_linear"],
                        record["balancedness_greedy"],
                        record["balancedness_moeroute"],
                        record["duplicates_per_layer"],
                        record["moved_fresh_per_layer"],
                        record["moved_with_previous_per_layer"],
                        seconds * 1e3,
                    )
                )
    print_table(
        ("zipf", "E", "nodes", "linear", "greedy", "moeroute", "dups/layer", "moved fresh", "moved w/ previous", "ms"),
        rows,
    )

    # moeroute against the plain-Python greedy, interleaved on the same load.
    load = synthetic_load(f"zipf:1.1,layers:{layers},tokens:{PAIRS_PER_LAYER},experts:{NUM_EXPERTS},seed:2")
    ratio = interleaved(
        lambda: [reference.greedy_rank_loads(row.tolist(), p, 32, 4, NUM_GROUPS) for row in load],
        lambda: rebalance(load, p, 32, num_nodes=4, num_groups=NUM_GROUPS),
        repeats=3,
        warmup=1,
    )
    print(f"rebalance of {layers} layers vs the plain-Python greedy (E=32, 4 nodes): {ratio['speedup']:.1f}x faster")
    return {"settings": records, "versus_python_greedy": {"layers": layers, **ratio}}


#: The live run: ``moeroute run`` arguments (DeepSeek-V3 routing, 4 ranks, 4 replicas).
LIVE_ARGS = [
    "--preset",
    "deepseek-v3",
    "--ep",
    "4",
    "--redundant",
    "4",
    "--tokens",
    "512",
    "--hidden",
    "128",
    "--intermediate",
    "64",
    "--repeat",
    "9",
    "--eplb",
]


def live_rebalance() -> dict:
    from moeroute.eplb.run import add_arguments, spawn_reports

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(LIVE_ARGS)
    reports = spawn_reports(args)
    first = reports[0]
    record = {
        "args": " ".join(LIVE_ARGS),
        "balancedness_before": first["balancedness_before"],
        "balancedness_after": first["balancedness_after"],
        "rank_tokens_before": first["rank_tokens_before"],
        "rank_tokens_after": first["rank_tokens_after"],
        "heaviest_rank_tokens_before": max(first["rank_tokens_before"]),
        "heaviest_rank_tokens_after": max(first["rank_tokens_after"]),
        "forward_ms_before": [r["forward_ms_before"] for r in reports],
        "forward_ms_after": [r["forward_ms_after"] for r in reports],
        "layer_speedup_per_rank": [r["speedup"] for r in reports],
        "experts_moved": first["experts_moved"],
        "expert_bytes_moved": sum(r["bytes_received"] for r in reports),
        "max_rel_error_after": max(r["error_after"] for r in reports),
    }
    print(
        f"live rebalance on 4 gloo ranks: heaviest rank {record['heaviest_rank_tokens_before']:.0f} "
        f"-> {record['heaviest_rank_tokens_after']:.0f} tokens, balancedness "
        f"{record['balancedness_before']:.3f} -> {record['balancedness_after']:.3f}, layer time "
        f"ratio old/new per rank {[round(v, 2) for v in record['layer_speedup_per_rank']]}"
    )
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 layers, 2 exponents, no live run")
    args = parser.parse_args()
    payload = run(args.quick)
    if not args.quick:
        payload["live_rebalance"] = live_rebalance()
        print("wrote", write_results("eplb", payload))
    elif os.environ.get("MOEROUTE_BENCH_RESULTS"):  # the test suite's smoke run
        print("wrote", write_results("eplb_quick", payload))


if __name__ == "__main__":
    main()
