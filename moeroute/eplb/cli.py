"""``moeroute eplb``: plan an expert placement from a measured or synthetic load.

    moeroute eplb --load FILE | --synthetic zipf:1.1,layers:4,tokens:65536
                  --ep 8 [--redundant 32] [--nodes 2 --groups 8] [--previous FILE]
                  [--out FILE] [--json]

Per layer it prints the balancedness (mean rank load / max rank load) of the linear and
round-robin placements and of the plan, the heaviest rank's tokens before (linear) and
after, and the experts moved (from ``--previous`` when given, else from the linear
placement). ``--out`` writes the plan: ``.npy`` the int32 [L, P] table, ``.json`` the
`Placement.to_dict` fields. Every argument error exits with status 2 and one line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import numpy as np

from moeroute.eplb.placement import (Placement, balancedness, linear_placement, rank_load,
                                     rebalance, round_robin_placement)

__all__ = ["add_arguments", "run", "synthetic_load", "read_load", "SYNTHETIC_KEYS"]

#: Exit status of a request that cannot work (the command line's usage status).
EXIT_USAGE = 2
#: ``--synthetic`` keys and their defaults (zipf: the exponent of the expert popularity).
SYNTHETIC_KEYS = {"zipf": 1.1, "layers": 4, "tokens": 65536, "experts": 256, "seed": 0}
#: File suffixes ``--load`` / ``--previous`` read and ``--out`` writes.
LOAD_SUFFIXES = (".npy", ".pt", ".json")
OUT_SUFFIXES = (".npy", ".json")


def _fail(message: str) -> None:
    print(f"moeroute eplb: error: {message}", file=sys.stderr)
    sys.exit(EXIT_USAGE)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``eplb`` arguments; parse errors print one line and exit 2 (no usage block)."""
    parser.error = _fail  # one line, not argparse's usage block
    parse_known = parser.parse_known_args

    def parse_strict(args=None, namespace=None):
        # Unknown arguments would otherwise reach the top-level parser's usage block.
        namespace, extras = parse_known(args, namespace)
        if extras:
            _fail(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras

    parser.parse_known_args = parse_strict
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--load", metavar="FILE",
                        help="tokens per logical expert, [N] or [L, N]: .npy, .pt or .json")
    source.add_argument("--synthetic", metavar="SPEC",
                        help="a skewed load, e.g. zipf:1.1,layers:4,tokens:65536 "
                             "(also experts:N, seed:S)")
    parser.add_argument("--ep", type=int, required=True, metavar="E", help="expert-parallel ranks")
    parser.add_argument("--redundant", type=int, default=0, metavar="R",
                        help="redundant experts: P = N + R physical experts (default 0)")
    parser.add_argument("--nodes", type=int, default=1, help="nodes the ranks span (default 1)")
    parser.add_argument("--groups", type=int, default=1,
                        help="expert groups (DeepSeek-V3: 8; default 1)")
    parser.add_argument("--previous", metavar="FILE",
                        help="the placement in use ([L, P] or [P]; .npy, .pt or .json)")
    parser.add_argument("--out", metavar="FILE", help="write the plan (.npy or .json)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def synthetic_load(spec: str) -> np.ndarray:
    """float64 [layers, experts]: ``tokens`` draws per layer from a Zipf popularity.

    Expert popularity ``1 / rank ** zipf`` over a random permutation of the experts per
    layer, sampled multinomially (seeded by ``seed``).

    Raises
    ------
    ValueError
        An unknown key, a malformed ``key:value`` item or a value out of range.
    """
    fields = dict(SYNTHETIC_KEYS)
    for item in spec.split(","):
        key, sep, value = item.partition(":")
        key = key.strip()
        if not sep or key not in SYNTHETIC_KEYS:
            raise ValueError(f"--synthetic item {item!r} is not key:value with a key among "
                             f"{', '.join(SYNTHETIC_KEYS)}")
        try:
            fields[key] = float(value) if key == "zipf" else int(value)
        except ValueError:
            raise ValueError(f"--synthetic {key}:{value!r} is not a number") from None
    if not fields["zipf"] >= 0 or not np.isfinite(fields["zipf"]):
        raise ValueError(f"--synthetic zipf:{fields['zipf']} must be a finite exponent >= 0")
    for key in ("layers", "experts"):
        if fields[key] < 1:
            raise ValueError(f"--synthetic {key}:{fields[key]} must be >= 1")
    for key in ("tokens", "seed"):
        if fields[key] < 0:
            raise ValueError(f"--synthetic {key}:{fields[key]} must be >= 0")
    rng = np.random.default_rng(fields["seed"])
    popularity = 1.0 / np.arange(1, fields["experts"] + 1) ** fields["zipf"]
    popularity /= popularity.sum()
    rows = [rng.multinomial(fields["tokens"], popularity[rng.permutation(fields["experts"])])
            for _ in range(fields["layers"])]
    return np.array(rows, dtype=np.float64)


def read_load(path: str, what: str = "--load") -> Any:
    """The array stored in ``path`` (.npy, .pt or .json); ValueError saying what is wrong."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in LOAD_SUFFIXES:
        raise ValueError(f"{what} {path!r} must end in one of {', '.join(LOAD_SUFFIXES)}")
    if not os.path.isfile(path):
        raise ValueError(f"{what} {path!r} does not exist")
    try:
        if suffix == ".npy":
            return np.load(path, allow_pickle=False)
        if suffix == ".json":
            with open(path) as handle:
                value = json.load(handle)
            return value
        import torch  # only .pt files need torch

        value = torch.load(path, map_location="cpu", weights_only=True)
        return value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    except (OSError, ValueError, RuntimeError, TypeError) as error:
        raise ValueError(f"{what} {path!r} cannot be read: {str(error).splitlines()[0]}") from None


def _previous_table(value: Any) -> Any:
    if isinstance(value, dict):
        if "physical_to_logical" not in value:
            raise ValueError("--previous JSON must be a table or an object with physical_to_logical")
        return value["physical_to_logical"]
    return value


def _write(path: str, plan: Placement) -> None:
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".npy":
        np.save(path, plan.physical_to_logical)
    else:
        with open(path, "w") as handle:
            json.dump(plan.to_dict(), handle)


def _report(load: np.ndarray, args: argparse.Namespace, plan: Placement, previous) -> dict:
    layers, n = load.shape
    p, e = plan.num_physical_experts, args.ep
    linear = linear_placement(n, p, layers)
    robin = round_robin_placement(n, p, e, layers)
    before = rank_load(load, linear, e)
    after = rank_load(load, plan, e)
    moved = plan.moved(previous if previous is not None else linear)
    rows = []
    for layer in range(layers):
        rows.append({
            "layer": layer,
            "balancedness_linear": float(balancedness(load[layer], linear[layer], e)),
            "balancedness_round_robin": float(balancedness(load[layer], robin[layer], e)),
            "balancedness_after": float(balancedness(load[layer], plan.layer(layer), e)),
            "heaviest_rank_tokens_before": float(before[layer].max()),
            "heaviest_rank_tokens_after": float(after[layer].max()),
            "experts_moved": int(moved[layer]),
            "duplicates": int(plan.duplicates()[layer]),
        })
    return {"num_logical_experts": n, "num_physical_experts": p, "ep_size": e,
            "num_nodes": args.nodes, "num_groups": args.groups, "policy": plan.policy,
            "moved_from": "previous" if previous is not None else "linear", "layers": rows}


def _format(report: dict) -> str:
    lines = [f"eplb: N={report['num_logical_experts']} -> P={report['num_physical_experts']} "
             f"physical experts on {report['ep_size']} ranks, {report['num_nodes']} node(s), "
             f"{report['num_groups']} group(s), {report['policy']} policy; experts moved "
             f"from the {report['moved_from']} placement"]
    header = ("layer", "linear", "round_robin", "after", "heaviest before", "heaviest after",
              "moved", "duplicates")
    rows = [header]
    for row in report["layers"]:
        rows.append((str(row["layer"]), f"{row['balancedness_linear']:.3f}",
                     f"{row['balancedness_round_robin']:.3f}", f"{row['balancedness_after']:.3f}",
                     f"{row['heaviest_rank_tokens_before']:.0f}",
                     f"{row['heaviest_rank_tokens_after']:.0f}", str(row["experts_moved"]),
                     str(row["duplicates"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Plan, print, optionally write; 0 on success, 2 (one line on stderr) on bad input."""
    try:
        if args.load is not None:
            raw = read_load(args.load)
            try:
                load = np.atleast_2d(np.asarray(raw, dtype=np.float64))
            except (TypeError, ValueError):
                raise ValueError(f"--load {args.load!r} must hold numbers, [N] or [L, N]") from None
        else:
            load = synthetic_load(args.synthetic)
        if load.ndim != 2:
            raise ValueError(f"--load holds shape {load.shape}; use [N] or [L, N]")
        if args.redundant < 0:
            raise ValueError(f"--redundant {args.redundant} must be >= 0")
        previous = None
        if args.previous is not None:
            previous = np.asarray(_previous_table(read_load(args.previous, "--previous")))
        if args.out is not None and os.path.splitext(args.out)[1].lower() not in OUT_SUFFIXES:
            raise ValueError(f"--out {args.out!r} must end in one of {', '.join(OUT_SUFFIXES)}")
        plan = rebalance(load, load.shape[1] + args.redundant, args.ep, num_nodes=args.nodes,
                         num_groups=args.groups, previous=previous)
    except ValueError as error:
        message = str(error)
        for name, flag in (("num_physical_experts", "N + --redundant"), ("ep_size", "--ep"),
                           ("num_nodes", "--nodes"), ("num_groups", "--groups")):
            message = message.replace(name, flag)
        if message.startswith("previous"):
            message = "--" + message
        print(f"moeroute eplb: error: {message}", file=sys.stderr)
        return EXIT_USAGE
    report = _report(load, args, plan, previous)
    if args.out is not None:
        _write(args.out, plan)
        report["out"] = args.out
    print(json.dumps(report, indent=2) if args.json else _format(report))
    return 0
