"""The moeroute command line (``moeroute`` / ``python -m moeroute``).

Commands
--------
plan      show the expert layout and shared-expert plan of a model on E ranks (--json: one object)
route     route random logits with a preset and show the expert and rank load (--json: one object)
warmup    compile the CPU kernels into Numba's on-disk cache (NUMBA_CACHE_DIR)
eplb      plan an expert placement from a measured or synthetic load
--list-presets
          list the built-in model presets

Adding a command: append a `Command` to `COMMANDS`. Its module is imported only
when that command runs (or its ``--help`` is asked for), so a command needing
torch costs nothing to the others. The module provides ``add_arguments(parser)``
and ``run(args) -> int`` (or the names given in the `Command`).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from moeroute import __version__
from moeroute._args import check_fits_in_memory, non_negative_int, physical_memory_bytes, positive_int
from moeroute.config import PRESETS, SCORING_FUNCTIONS, ModelPreset, get_preset
from moeroute.layout import DISPATCH_MODES, PLACEMENTS, SCALING_REGIMES, SHARED_MODES, SHARED_SLOT_MODES

__all__ = [
    "Command",
    "COMMANDS",
    "main",
    "build_parser",
    "positive_int",
    "non_negative_int",
    "check_fits_in_memory",
    "physical_memory_bytes",
]

#: Exit status for a request that cannot work (impossible layout, bad config).
EXIT_USAGE = 2
#: Width in characters of the longest histogram bar.
HISTOGRAM_WIDTH = 40
#: Scale of the random correction bias: small next to the spread of sigmoid scores
#: (about 0.2), so it shifts a few picks instead of dominating the choice.
CORRECTION_BIAS_SCALE = 0.01
#: Bytes per routed token of ``route``: its float32 logits row, plus float32 weights and
#: int32 ids per pick (the outputs).
ROUTE_BYTES_PER_LOGIT = 4
ROUTE_BYTES_PER_PICK = 8
#: Bytes per physical expert of ``plan``'s layout tables (a handful of int32 arrays and
#: the describe() text), and per rank (one expert map and one line of text each).
PLAN_BYTES_PER_EXPERT = 64
PLAN_BYTES_PER_RANK = 256


@dataclasses.dataclass(frozen=True)
class Command:
    """A subcommand whose module is imported only when it is used.

    Attributes
    ----------
    name : str
        Subcommand name on the command line.
    help : str
        One line shown by ``moeroute --help``.
    module : str
        Module holding the two functions below.
    add_arguments : str
        Name of ``f(parser: argparse.ArgumentParser) -> None`` in ``module``.
    run : str
        Name of ``f(args: argparse.Namespace) -> int`` in ``module``.
    """

    name: str
    help: str
    module: str
    add_arguments: str = "add_arguments"
    run: str = "run"

    def load(self, attribute: str) -> Any:
        return getattr(importlib.import_module(self.module), getattr(self, attribute))


COMMANDS: list[Command] = [
    Command(
        "plan", "show the expert layout and shared-expert plan of a model", __name__, "add_plan_arguments", "run_plan"
    ),
    Command(
        "route",
        "route random logits with a preset and show the expert and rank load",
        __name__,
        "add_route_arguments",
        "run_route",
    ),
    Command(
        "demo",
        "run a DeepSeek-V3- and a Qwen3.5-shaped layer in every shared mode and check each against the dense reference",
        "moeroute.demo",
    ),
    Command(
        "run",
        "run a preset-shaped MoE layer on N expert-parallel ranks and check it against one rank",
        "moeroute.eplb.run",
    ),  # moeroute.bindings.ep_run + --eplb
    Command("eplb", "plan an expert placement (EPLB) from a measured or synthetic load", "moeroute.eplb.cli"),
    Command(
        "warmup",
        "compile the CPU kernels the presets use into Numba's on-disk cache (float32; more with --dtypes, --formats)",
        "moeroute.runtime",
        "add_warmup_arguments",
        "run_warmup",
    ),
]


# ---------------------------------------------------------------------------
# Shared argument helpers


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--preset", metavar="NAME", help=f"built-in model preset: {', '.join(PRESETS)}")
    model.add_argument("--config", metavar="PATH", help="Hugging Face config.json (or the directory holding it)")


def _load_model(args: argparse.Namespace) -> ModelPreset:
    if args.preset is not None:
        return get_preset(args.preset)
    return ModelPreset.from_hf(args.config)


def _describe_model(preset: ModelPreset) -> list[str]:
    router = preset.router
    shared = "no shared expert"
    if preset.num_shared_experts:
        shared = (
            f"shared expert: intermediate {preset.shared_intermediate_size} = "
            f"{preset.num_shared_experts} slot(s) x {preset.moe_intermediate_size}"
            f"{', sigmoid-gated' if preset.shared_gated else ''}"
        )
        if preset.shared_unfusable_reason:
            shared = (
                f"shared expert: intermediate {preset.shared_intermediate_size}"
                f"{', sigmoid-gated' if preset.shared_gated else ''} "
                f"(not fusable: {preset.shared_unfusable_reason})"
            )
    return [
        f"model: {preset.name} ({preset.model_type}), hidden {preset.hidden_size}, "
        f"expert intermediate {preset.moe_intermediate_size}",
        f"router: {router.num_experts} experts, top_k {router.top_k}, {router.scoring}"
        f"{' + correction bias' if preset.has_correction_bias else ''}, "
        f"groups {router.num_expert_group} (topk_group {router.topk_group}), "
        f"renormalize {router.renormalize}, routed_scaling_factor {router.routed_scaling_factor:g}",
        shared,
    ]


def _model_json(preset: ModelPreset) -> dict[str, Any]:
    """The model fields both ``--json`` outputs share (the text's "model:" and "router:" lines)."""
    router = preset.router
    return {
        "name": preset.name,
        "model_type": preset.model_type,
        "hidden_size": preset.hidden_size,
        "moe_intermediate_size": preset.moe_intermediate_size,
        "num_experts": router.num_experts,
        "top_k": router.top_k,
        "scoring": router.scoring,
        "correction_bias": bool(preset.has_correction_bias),
        "num_expert_group": router.num_expert_group,
        "topk_group": router.topk_group,
        "renormalize": bool(router.renormalize),
        "routed_scaling_factor": float(router.routed_scaling_factor),
        "num_shared_experts": preset.num_shared_experts,
        "shared_intermediate_size": preset.shared_intermediate_size,
        "shared_gated": bool(preset.shared_gated),
        "shared_unfusable_reason": preset.shared_unfusable_reason,
    }


def _print_json(value: dict[str, Any]) -> None:
    print(json.dumps(value))


def _add_json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object on stdout instead of the text (keys: docs/cli.md, --json)",
    )


def _error(message: str) -> int:
    print(f"moeroute: error: {message}", file=sys.stderr)
    return EXIT_USAGE


# ---------------------------------------------------------------------------
# plan


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``moeroute plan``."""
    _add_model_arguments(parser)
    parser.add_argument("--ep", type=positive_int, default=1, metavar="E", help="expert-parallel size (default 1)")
    parser.add_argument(
        "--dispatch",
        choices=DISPATCH_MODES,
        default=None,
        help="token dispatch (default: none for --ep 1, else all2all)",
    )
    parser.add_argument(
        "--shared", choices=SHARED_MODES, default="auto", help="who computes the shared expert (default auto)"
    )
    parser.add_argument(
        "--slots",
        choices=SHARED_SLOT_MODES,
        default=None,
        help="where fused shared slots live (default: derived from dispatch)",
    )
    parser.add_argument(
        "--redundant",
        type=non_negative_int,
        default=0,
        metavar="R",
        help="number of redundant (replica) experts (default 0)",
    )
    parser.add_argument(
        "--regime",
        choices=SCALING_REGIMES,
        default="router",
        help="where routed_scaling_factor is applied (default router)",
    )
    parser.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default="linear",
        help="which logical experts each rank holds (default linear; round_robin: rank r holds r, r+E, ...)",
    )
    parser.add_argument(
        "--quant",
        choices=("fp8_block", "fp8_tensor", "int4"),
        default=None,
        help="report expert bytes per rank in this format (fp8_block: 128x128 blocks; int4: symmetric, "
        "groups of 128 with bfloat16 scales) beside bfloat16",
    )
    _add_json_argument(parser)


def _expert_bytes(preset, layout, quant_format) -> list[tuple[int, int, int]]:
    """(local experts, bytes in ``quant_format``, bytes in bfloat16) of each rank's expert weights."""
    from moeroute.quant.config import QuantConfig

    hidden, inter = preset.hidden_size, preset.moe_intermediate_size
    per_expert = QuantConfig(quant_format).expert_bytes(hidden, inter)
    bfloat16_per_expert = 3 * hidden * inter * 2  # gate, up and down projections, 2 bytes each
    return [
        (local, local * per_expert, local * bfloat16_per_expert)
        for local in (layout.num_local_experts(rank) for rank in range(layout.ep_size))
    ]


def _expert_bytes_lines(preset, layout, quant_format) -> list[str]:
    """Expert weight bytes each rank holds, in bfloat16 and (with --quant) the quantized format."""
    lines = [f"routed expert bytes per rank and layer ({quant_format}; bfloat16 for comparison):"]
    for rank, (local, quant_bytes, bfloat16_bytes) in enumerate(_expert_bytes(preset, layout, quant_format)):
        lines.append(
            f"  rank {rank}: {local} experts, {quant_bytes / 2**30:.2f} GiB {quant_format} "
            f"({bfloat16_bytes / 2**30:.2f} GiB bfloat16)"
        )
    return lines


def _plan_json(preset, layout, args, shared_slot_weight) -> dict[str, Any]:
    """``plan --json``: the model, the layout, each rank's experts and (with --quant) its bytes."""
    import numpy as np

    ranks = []
    for rank in range(layout.ep_size):
        expert_map = layout.expert_map(rank)
        held = np.flatnonzero(expert_map >= 0)
        ranks.append(
            {
                "rank": rank,
                "num_local_experts": layout.num_local_experts(rank),
                "local_to_physical": held[np.argsort(expert_map[held], kind="stable")].tolist(),
                "logical_experts": layout.logical_experts(rank).tolist(),
                "shared_slot_ids": layout.shared_slot_ids(rank).tolist(),
            }
        )
    expert_bytes = None
    if args.quant is not None:
        expert_bytes = {
            "format": args.quant,
            "ranks": [
                {"rank": rank, "num_local_experts": local, "bytes": quant_bytes, "bfloat16_bytes": bfloat16_bytes}
                for rank, (local, quant_bytes, bfloat16_bytes) in enumerate(_expert_bytes(preset, layout, args.quant))
            ],
        }
    return {
        "model": _model_json(preset),
        "layout": {
            "num_routed_experts": layout.num_routed_experts,
            "num_shared_experts": layout.num_shared_experts,
            "num_redundant_experts": layout.num_redundant_experts,
            "ep_size": layout.ep_size,
            "dispatch": layout.dispatch,
            "placement": layout.placement,
            "num_physical_experts": layout.num_physical_experts,
            "shared": layout.shared,
            "shared_reason": layout.shared_reason,
            "shared_slots": layout.shared_slots,
            "scaling_regime": layout.scaling_regime,
            "equal_block_problems": list(layout.check_backend("equal_blocks")),
        },
        "ranks": ranks,
        "shared_slot_weight": shared_slot_weight,
        "expert_bytes": expert_bytes,
    }


def run_plan(args: argparse.Namespace) -> int:
    """Print the router configuration and ``ExpertLayout.describe()``; 2 on an impossible layout."""
    from moeroute.layout import ExpertLayout

    try:
        preset = _load_model(args)
        dispatch = args.dispatch or ("none" if args.ep == 1 else "all2all")
        physical = preset.router.num_experts + args.redundant + args.ep * preset.num_shared_experts
        check_fits_in_memory(
            f"the layout of {physical} physical experts on --ep {args.ep} ranks",
            physical * PLAN_BYTES_PER_EXPERT + args.ep * PLAN_BYTES_PER_RANK,
        )
        layout = ExpertLayout(
            preset.router.num_experts,
            preset.num_shared_experts,
            args.ep,
            dispatch,
            args.shared,
            args.slots,
            args.redundant,
            scaling_regime=args.regime,
            unfusable_reason=preset.shared_unfusable_reason,
            placement=args.placement,
        )
        if args.quant is not None:  # a size the format cannot group (int4 on gpt-oss's 2880)
            _expert_bytes(preset, layout, args.quant)
    except ValueError as error:  # LayoutError included: an impossible layout
        return _error(str(error))
    shared_slot_weight = None
    if layout.shared == "fused":
        weight = "gate" if preset.shared_gated else "1"
        scale = "" if args.regime == "router" else f" / {preset.router.routed_scaling_factor:g}"
        shared_slot_weight = f"{weight}{scale}"
    if args.json:
        _print_json(_plan_json(preset, layout, args, shared_slot_weight))
        return 0
    print("\n".join(_describe_model(preset)))
    print(layout.describe())
    if shared_slot_weight is not None:
        print(f"shared slot weight: {shared_slot_weight}")
    if args.quant is not None:
        print("\n".join(_expert_bytes_lines(preset, layout, args.quant)))
    return 0


# ---------------------------------------------------------------------------
# route


def add_route_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``moeroute route``."""
    _add_model_arguments(parser)
    parser.add_argument("--tokens", type=non_negative_int, required=True, metavar="T", help="number of tokens to route")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="random seed, an integer >= 0 (default 0)")
    parser.add_argument(
        "--ep", type=positive_int, default=1, metavar="E", help="expert-parallel size for the per-rank load (default 1)"
    )
    parser.add_argument(
        "--repeat", type=positive_int, default=10, metavar="R", help="timed calls after the first one (default 10)"
    )
    parser.add_argument(
        "--scoring", choices=SCORING_FUNCTIONS, default=None, help="override the preset's scoring function"
    )
    parser.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default="linear",
        help="expert placement for the per-rank load (default linear)",
    )
    _add_json_argument(parser)


def _load_select_experts():
    """The routing entry point: the compiled one when available, else the NumPy reference."""
    try:
        from moeroute.routing import select_experts
    except ImportError:
        from moeroute.routing.reference import select_experts
    return select_experts


def _histogram(labels: Sequence[str], counts: Sequence[int]) -> list[str]:
    peak = max(counts, default=0)
    width = max((len(label) for label in labels), default=0)
    lines = []
    for label, count in zip(labels, counts):
        bar = "#" * (round(HISTOGRAM_WIDTH * count / peak) if peak else 0)
        lines.append(f"  {label.ljust(width)} |{bar.ljust(HISTOGRAM_WIDTH)}| {count}")
    return lines


def run_route(args: argparse.Namespace) -> int:
    """Route random logits, print expert and rank load histograms and the median call time."""
    import numpy as np

    from moeroute.layout import ExpertLayout

    try:
        preset = _load_model(args)
        if args.scoring is not None:
            preset = dataclasses.replace(preset, router=dataclasses.replace(preset.router, scoring=args.scoring))
        router = preset.router
        check_fits_in_memory(
            f"routing --tokens {args.tokens} over {router.num_experts} experts",
            args.tokens * (router.num_experts * ROUTE_BYTES_PER_LOGIT + router.top_k * ROUTE_BYTES_PER_PICK),
        )
        layout = ExpertLayout(
            router.num_experts,
            ep_size=args.ep,
            dispatch="none" if args.ep == 1 else "all2all",
            placement=args.placement,
        )
    except ValueError as error:  # LayoutError included
        return _error(str(error))

    try:
        rng = np.random.default_rng(args.seed)
        logits = rng.standard_normal((args.tokens, router.num_experts), dtype=np.float32)
        bias = None
        if preset.has_correction_bias:
            bias = CORRECTION_BIAS_SCALE * rng.standard_normal(router.num_experts, dtype=np.float32)

        select_experts = _load_select_experts()
        start = time.perf_counter()
        weights, ids = select_experts(logits, router, bias)
        first = time.perf_counter() - start
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            select_experts(logits, router, bias)
            times.append(time.perf_counter() - start)
    except MemoryError:  # the estimate fit the machine, the free memory did not
        return _error(f"not enough free memory to route --tokens {args.tokens}; use fewer tokens")
    except ValueError as error:  # a size beyond a kernel's int32 limit
        return _error(str(error))

    ids = np.asarray(ids)
    counts = np.bincount(ids.ravel(), minlength=router.num_experts)
    total = int(counts.sum())
    mean = total / router.num_experts
    peak = int(counts.max(initial=0))
    rank_counts = [int(counts[layout.logical_experts(rank)].sum()) for rank in range(layout.ep_size)]
    rank_mean = total / layout.ep_size
    rank_peak = max(rank_counts)
    if args.json:
        _print_json(
            {
                "model": _model_json(preset),
                "tokens": args.tokens,
                "seed": args.seed,
                "ep_size": layout.ep_size,
                "placement": args.placement,
                "select_experts": f"{getattr(select_experts, '__module__', '?')}.select_experts",
                "first_call_ms": first * 1e3,
                "median_call_ms": float(np.median(times)) * 1e3,
                "repeat": args.repeat,
                "assignments": total,
                "expert_load": counts.tolist(),
                "expert_load_max_over_mean": peak / mean if mean else None,
                "rank_load": rank_counts,
                "rank_logical_experts": [layout.logical_experts(rank).tolist() for rank in range(layout.ep_size)],
                "rank_load_max_over_mean": rank_peak / rank_mean if rank_mean else None,
            }
        )
        return 0
    print("\n".join(_describe_model(preset)))
    print(
        f"routing: {args.tokens} tokens, seed {args.seed}, {getattr(select_experts, '__module__', '?')}.select_experts"
    )
    print(f"first call: {first * 1e3:.3f} ms (includes any compilation)")
    print(f"median time per call: {float(np.median(times)) * 1e3:.3f} ms over {args.repeat} calls")
    imbalance = f"{peak / mean:.2f}x mean" if mean else "n/a"
    print(
        f"per-expert load: {total} assignments = {args.tokens} tokens x top_k {router.top_k}; "
        f"mean {mean:.1f}, max {peak} ({imbalance})"
    )
    print("\n".join(_histogram([f"expert {e}" for e in range(router.num_experts)], counts.tolist())))

    rank_labels = []
    for rank in range(layout.ep_size):
        if args.placement == "linear":
            first_expert, count = layout.routed_range(rank)
            rank_labels.append(f"rank {rank} experts [{first_expert}, {first_expert + count})")
        else:
            rank_labels.append(f"rank {rank} experts {rank}, {rank + layout.ep_size}, ...")
    rank_imbalance = f"{rank_peak / rank_mean:.2f}x mean" if rank_mean else "n/a"
    print(
        f"per-rank load (ep {layout.ep_size}, {args.placement} placement): mean {rank_mean:.1f}, "
        f"max {rank_peak} ({rank_imbalance})"
    )
    print("\n".join(_histogram(rank_labels, rank_counts)))
    return 0


# ---------------------------------------------------------------------------
# --list-presets and the parser


def list_presets() -> str:
    """Table of the built-in presets and their key fields."""
    header = (
        "name",
        "model_type",
        "N",
        "K",
        "scoring",
        "bias",
        "G/topk_group",
        "renorm",
        "rsf",
        "S",
        "shared",
        "gated",
        "activation",
        "H",
        "I",
    )
    rows = [header]
    for preset in PRESETS.values():
        router = preset.router
        rows.append(
            (
                preset.name,
                preset.model_type,
                str(router.num_experts),
                str(router.top_k),
                router.scoring,
                "yes" if preset.has_correction_bias else "no",
                f"{router.num_expert_group}/{router.topk_group}",
                "yes" if router.renormalize else "no",
                f"{router.routed_scaling_factor:g}",
                str(preset.num_shared_experts),
                str(preset.shared_intermediate_size),
                "yes" if preset.shared_gated else "no",
                preset.activation + ("+biases" if preset.expert_bias else ""),
                str(preset.hidden_size),
                str(preset.moe_intermediate_size),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


class OneLineErrorParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr and exit status 2 (no
    usage block; ``--help`` shows it). Subcommand parsers are of this class too."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; only the ``selected`` command's module is imported."""
    parser = OneLineErrorParser(
        prog="moeroute",
        description="Mixture-of-Experts routing, expert layouts and dispatch.",
    )
    parser.add_argument("--list-presets", action="store_true", help="list the built-in model presets and exit")
    parser.add_argument("--version", action="version", version=f"moeroute {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        sub = subparsers.add_parser(command.name, help=command.help, description=command.help)
        if command.name == selected:
            command.load("add_arguments")(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 success, 2 usage or layout error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    names = {command.name: command for command in COMMANDS}
    # The first word that is not an option names the command: load only that one.
    selected = next((word for word in argv if not word.startswith("-")), None)
    parser = build_parser(selected if selected in names else None)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    if args.list_presets:
        print(list_presets())
        return 0
    if args.command is None:
        return _error("a command is required (or --list-presets); see moeroute --help")
    return int(names[args.command].load("run")(args))
