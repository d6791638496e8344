"""``moeroute eplb``: plan an expert placement from a measured or synthetic load.

    moeroute eplb --load FILE | --synthetic zipf:1.1,layers:4,tokens:65536
                  --ep 8 [--redundant 32] [--nodes 2 --groups 8] [--previous FILE]
                  [--out FILE] [--json]

Per layer it prints the balancedness (mean rank load / max rank load) of the linear and
round-robin placements and of the plan, the heaviest rank's tokens before (linear) and
after, and the experts moved (from ``--previous`` when given, else from the linear
placement). ``--out`` writes the plan: ``.npy`` the int32 [L, P] table, ``.json`` the
`Placement.to_dict` fields. Every argument error exits with status 2 and one line on stderr,
never a traceback: a file that cannot be read as a load (garbage, a ``torch.save`` of
anything but one tensor, no numbers), an ``--out`` directory that does not exist (checked
before any work), a plan larger than `MAX_PLAN_ENTRIES`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import numpy as np

from moeroute.eplb.placement import (
    Placement,
    balancedness,
    linear_placement,
    rank_load,
    rebalance,
    round_robin_placement,
)

__all__ = ["add_arguments", "run", "synthetic_load", "read_load", "SYNTHETIC_KEYS"]

#: Exit status of a request that cannot work (the command line's usage status).
EXIT_USAGE = 2
#: ``--synthetic`` keys and their defaults (zipf: the exponent of the expert popularity).
SYNTHETIC_KEYS = {"zipf": 1.1, "layers": 4, "tokens": 65536, "experts": 256, "seed": 0}
#: File suffixes ``--load`` / ``--previous`` read and ``--out`` writes.
LOAD_SUFFIXES = (".npy", ".pt", ".json")
OUT_SUFFIXES = (".npy", ".json")
#: Largest plan, layers x physical experts, the command builds: far above any model
#: (DeepSeek-V3: 58 x 288), and a bound on what planning allocates (a few arrays of it).
MAX_PLAN_ENTRIES = 2**22
#: Largest ``tokens`` of ``--synthetic``: the multinomial draw counts in int64.
MAX_SYNTHETIC_TOKENS = 2**62
#: The first bytes of every .npy file.
NPY_MAGIC = b"\x93NUMPY"


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
    source.add_argument("--load", metavar="FILE", help="tokens per logical expert, [N] or [L, N]: .npy, .pt or .json")
    source.add_argument(
        "--synthetic",
        metavar="SPEC",
        help="a skewed load, e.g. zipf:1.1,layers:4,tokens:65536 (also experts:N, seed:S)",
    )
    parser.add_argument("--ep", type=int, required=True, metavar="E", help="expert-parallel ranks")
    parser.add_argument(
        "--redundant",
        type=int,
        default=0,
        metavar="R",
        help="redundant experts: P = N + R physical experts (default 0)",
    )
    parser.add_argument("--nodes", type=int, default=1, help="nodes the ranks span (default 1)")
    parser.add_argument("--groups", type=int, default=1, help="expert groups (DeepSeek-V3: 8; default 1)")
    parser.add_argument("--previous", metavar="FILE", help="the placement in use ([L, P] or [P]; .npy, .pt or .json)")
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
            raise ValueError(f"--synthetic item {item!r} is not key:value with a key among {', '.join(SYNTHETIC_KEYS)}")
        try:
            fields[key] = float(value) if key == "zipf" else _integer(value)
        except (ValueError, OverflowError):
            kind = "a number" if key == "zipf" else "an integer"
            raise ValueError(f"--synthetic {key}:{value!r} is not {kind}") from None
    if not fields["zipf"] >= 0 or not np.isfinite(fields["zipf"]):
        raise ValueError(f"--synthetic zipf:{fields['zipf']} must be a finite exponent >= 0")
    for key in ("layers", "experts"):
        if fields[key] < 1:
            raise ValueError(f"--synthetic {key}:{fields[key]} must be >= 1")
    for key in ("tokens", "seed"):
        if fields[key] < 0:
            raise ValueError(f"--synthetic {key}:{fields[key]} must be >= 0")
    if fields["layers"] * fields["experts"] > MAX_PLAN_ENTRIES:
        raise ValueError(
            f"--synthetic layers:{fields['layers']} x experts:{fields['experts']} exceeds "
            f"{MAX_PLAN_ENTRIES} loads (MAX_PLAN_ENTRIES); use fewer layers or experts"
        )
    if fields["tokens"] > MAX_SYNTHETIC_TOKENS:
        raise ValueError(f"--synthetic tokens:{fields['tokens']} exceeds {MAX_SYNTHETIC_TOKENS} (2**62)")
    rng = np.random.default_rng(fields["seed"])
    popularity = 1.0 / np.arange(1, fields["experts"] + 1) ** fields["zipf"]
    popularity /= popularity.sum()
    rows = [
        rng.multinomial(fields["tokens"], popularity[rng.permutation(fields["experts"])])
        for _ in range(fields["layers"])
    ]
    return np.array(rows, dtype=np.float64)


def _integer(text: str) -> int:
    """An integer key's value: digits, or a float spelling of an integer ("1e6")."""
    try:
        return int(text)
    except ValueError:
        value = float(text)
        if not value.is_integer():
            raise
        return int(value)


def read_load(path: str, what: str = "--load") -> Any:
    """The array stored in ``path`` (.npy, .pt or .json); ValueError saying what is wrong.

    A ``.pt`` file must hold one tensor (or a list of numbers): ``torch.load`` runs with
    ``weights_only=True``, so a file cannot run code, and anything else is refused."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in LOAD_SUFFIXES:
        raise ValueError(f"{what} {path!r} must end in one of {', '.join(LOAD_SUFFIXES)}")
    if not os.path.isfile(path):
        raise ValueError(f"{what} {path!r} does not exist")
    try:
        if suffix == ".npy":
            with open(path, "rb") as handle:
                if handle.read(len(NPY_MAGIC)) != NPY_MAGIC:
                    raise ValueError("it is not a .npy file (no NumPy header); write it with numpy.save")
            return np.load(path, allow_pickle=False)
        if suffix == ".json":
            with open(path) as handle:
                value = json.load(handle)
            return value
        import torch  # only .pt files need torch

        try:
            value = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # torch's own message would suggest unsafe loading
            raise ValueError(f"it is not a torch.save file of a tensor ({type(error).__name__})") from None
        if isinstance(value, torch.Tensor):
            return value.detach().double().numpy() if value.is_floating_point() else value.numpy()
        if not isinstance(value, (list, tuple)):
            raise ValueError(
                f"it holds a {type(value).__name__}; save one tensor [N] or [L, N] (torch.save(load, path))"
            )
        return np.asarray(value)
    # Whatever a reader raises on a file that is not what it claims to be (torch.load alone
    # raises UnpicklingError, EOFError, RuntimeError, ...), the answer is this one line.
    except Exception as error:
        text = str(error).strip()
        first = text.splitlines()[0] if text else type(error).__name__
        raise ValueError(f"{what} {path!r} cannot be read: {first}") from None


def _previous_table(value: Any) -> Any:
    if isinstance(value, dict):
        if "physical_to_logical" not in value:
            raise ValueError("--previous JSON must be a table or an object with physical_to_logical")
        return value["physical_to_logical"]
    return value


def _check_out(path: str) -> None:
    """ValueError naming ``--out`` unless ``path`` has a written suffix and its directory exists."""
    if os.path.splitext(path)[1].lower() not in OUT_SUFFIXES:
        raise ValueError(f"--out {path!r} must end in one of {', '.join(OUT_SUFFIXES)}")
    directory = os.path.dirname(path) or "."
    if not os.path.isdir(directory):
        raise ValueError(f"--out {path!r}: the directory {directory!r} does not exist; create it first")
    if os.path.isdir(path):
        raise ValueError(f"--out {path!r} is a directory; name a file in it")


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
        rows.append(
            {
                "layer": layer,
                "balancedness_linear": float(balancedness(load[layer], linear[layer], e)),
                "balancedness_round_robin": float(balancedness(load[layer], robin[layer], e)),
                "balancedness_after": float(balancedness(load[layer], plan.layer(layer), e)),
                "heaviest_rank_tokens_before": float(before[layer].max()),
                "heaviest_rank_tokens_after": float(after[layer].max()),
                "experts_moved": int(moved[layer]),
                "duplicates": int(plan.duplicates()[layer]),
            }
        )
    return {
        "num_logical_experts": n,
        "num_physical_experts": p,
        "ep_size": e,
        "num_nodes": args.nodes,
        "num_groups": args.groups,
        "policy": plan.policy,
        "moved_from": "previous" if previous is not None else "linear",
        "layers": rows,
    }


def _format(report: dict) -> str:
    lines = [
        f"eplb: N={report['num_logical_experts']} -> P={report['num_physical_experts']} "
        f"physical experts on {report['ep_size']} ranks, {report['num_nodes']} node(s), "
        f"{report['num_groups']} group(s), {report['policy']} policy; experts moved "
        f"from the {report['moved_from']} placement"
    ]
    header = ("layer", "linear", "round_robin", "after", "heaviest before", "heaviest after", "moved", "duplicates")
    rows = [header]
    for row in report["layers"]:
        rows.append(
            (
                str(row["layer"]),
                f"{row['balancedness_linear']:.3f}",
                f"{row['balancedness_round_robin']:.3f}",
                f"{row['balancedness_after']:.3f}",
                f"{row['heaviest_rank_tokens_before']:.0f}",
                f"{row['heaviest_rank_tokens_after']:.0f}",
                str(row["experts_moved"]),
                str(row["duplicates"]),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Plan, print, optionally write; 0 on success, 2 (one line on stderr) on bad input."""
    try:
        if args.out is not None:  # before any work: a plan with nowhere to go is lost
            _check_out(args.out)
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
        if load.size == 0:
            raise ValueError(
                f"--load {args.load!r} holds no loads (shape {load.shape}); it needs [N] or "
                "[L, N] with N >= 1 tokens per logical expert"
            )
        if args.redundant < 0:
            raise ValueError(f"--redundant {args.redundant} must be >= 0")
        if load.shape[0] * (load.shape[1] + args.redundant) > MAX_PLAN_ENTRIES:
            raise ValueError(
                f"a plan of {load.shape[0]} layer(s) x {load.shape[1] + args.redundant} physical "
                f"experts (N + --redundant) exceeds {MAX_PLAN_ENTRIES} entries (MAX_PLAN_ENTRIES)"
            )
        with np.errstate(over="ignore", invalid="ignore"):
            totals = load.sum(axis=1)
        if np.isfinite(load).all() and not np.isfinite(totals).all():  # each finite, the sum not
            layer = int(np.flatnonzero(~np.isfinite(totals))[0])
            raise ValueError(
                f"--load {args.load!r}: layer {layer} sums to {totals[layer]}; the loads of a "
                "layer must have a finite sum (scale them down)"
            )
        previous = None
        if args.previous is not None:
            previous = np.asarray(_previous_table(read_load(args.previous, "--previous")))
        plan = rebalance(
            load,
            load.shape[1] + args.redundant,
            args.ep,
            num_nodes=args.nodes,
            num_groups=args.groups,
            previous=previous,
        )
        report = _report(load, args, plan, previous)
        if args.out is not None:
            try:
                _write(args.out, plan)
            except OSError as error:
                raise ValueError(f"--out {args.out!r} cannot be written: {error.strerror or error}") from None
            report["out"] = args.out
    except MemoryError:
        print(
            "moeroute eplb: error: not enough memory to plan this placement; use fewer layers, experts or --redundant",
            file=sys.stderr,
        )
        return EXIT_USAGE
    except ValueError as error:
        message = str(error)
        for name, flag in (
            ("num_physical_experts", "N + --redundant"),
            ("ep_size", "--ep"),
            ("num_nodes", "--nodes"),
            ("num_groups", "--groups"),
        ):
            message = message.replace(name, flag)
        if message.startswith("previous"):
            message = "--" + message
        print(f"moeroute eplb: error: {message}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(report, indent=2) if args.json else _format(report))
    return 0
