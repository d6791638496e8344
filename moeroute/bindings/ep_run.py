"""``moeroute run``: a preset-shaped MoE layer on E expert-parallel ranks, checked and timed.

    moeroute run --preset qwen3.5-moe --ep 8 --dispatch all2all --shared auto --tokens 64

Spawns E gloo processes on this machine, or, when launched by torchrun (RANK, WORLD_SIZE
and MASTER_ADDR in the environment), joins that group (NCCL on GPUs, gloo otherwise). Every
rank builds the same layer, shaped like the preset (experts, top-k, routing, shared expert
and gate) at a small hidden/intermediate size with random weights, runs the expert-parallel
`moeroute.bindings.torch.MoE` on its own tokens and the single-process layer on the same
tokens, and reports its load, the bytes it sent and the forward time. The exit status is
nonzero when any rank's output differs from the single-process result.

With ``--quant fp8_block`` (or ``fp8_tensor``) the routed experts are FP8 (the random weights
quantized with `moeroute.quant.quantize_experts`), ``--dispatch-dtype fp8`` sends the tokens
as e4m3 rows with their scales, and every rank also checks its output against the plain-torch
w8a8 definition of `moeroute.quant.reference` (routing from the NumPy reference, the shared
expert in float64 or, fused, as FP8 slots), printing the max relative error and PASS/FAIL.
``--quant int4`` quantizes the experts as ``QuantConfig("int4")`` (symmetric, groups of 128
input columns, bfloat16 scales: --hidden and --intermediate multiples of 128) and checks
against the w4a16 reference (the INT4 weights dequantized, summed in float64).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, NamedTuple

from moeroute._args import check_fits_in_memory, non_negative_int, positive_int
from moeroute.config import PRESETS, get_preset
from moeroute.layout import PLACEMENTS, SCALING_REGIMES, SHARED_MODES, ExpertLayout

__all__ = ["add_arguments", "run", "main", "EXIT_MISMATCH", "EXIT_USAGE", "EXIT_FAILURE"]

#: A rank's output differs from the single-process layer.
EXIT_MISMATCH = 1
#: The request cannot work (impossible layout, bad arguments).
EXIT_USAGE = 2
#: A rank failed (exception, dead peer, timeout).
EXIT_FAILURE = 3
#: Relative error (max |ep - single| / max |single|) allowed per activation dtype: float32
#: differs only by summation order; bfloat16 rounds every partial output to 8 bits.
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}
#: FP8 layers against the w8a8 reference of moeroute.quant.reference (docs/quant.md): float32
#: activations differ by float32 summation order and the odd e4m3 rounding tie; bfloat16 ones
#: also round the intermediate and the outputs.
QUANT_TOLERANCE = {"float32": 2e-2, "bfloat16": 4e-2}
#: INT4 layers against the w4a16 reference (the same INT4 weights dequantized exactly): float32
#: activations differ by float32 summation order only; bfloat16 ones also round the
#: intermediate and the outputs.
INT4_TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}
#: Environment variables torchrun sets; all present means "join, don't spawn".
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR")
#: Scale of the random correction bias: small next to the spread of sigmoid scores, so it
#: shifts a few picks instead of dominating the choice.
CORRECTION_BIAS_SCALE = 0.01
#: Untimed forwards before the timed ones (first-call compilation and allocation).
WARMUP_FORWARDS = 2
#: Activation-sized buffers a rank holds per token of the group (inputs, received rows,
#: partials, outputs of both layers), for the memory estimate made before spawning.
RANK_ACTIVATION_BUFFERS = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``moeroute run``."""
    parser.add_argument("--preset", required=True, metavar="NAME", help=f"model preset: {', '.join(PRESETS)}")
    parser.add_argument(
        "--ep",
        type=positive_int,
        default=None,
        metavar="N",
        help="expert-parallel ranks to spawn (default: WORLD_SIZE under torchrun, else 2)",
    )
    parser.add_argument(
        "--dispatch", choices=("all2all", "allgather"), default="all2all", help="token dispatch (default all2all)"
    )
    parser.add_argument(
        "--shared", choices=SHARED_MODES, default="auto", help="who computes the shared expert (default auto)"
    )
    parser.add_argument("--tokens", type=non_negative_int, required=True, metavar="T", help="tokens per rank")
    parser.add_argument(
        "--hidden", type=positive_int, default=64, metavar="H", help="hidden size of the small layer (default 64)"
    )
    parser.add_argument(
        "--intermediate",
        type=positive_int,
        default=32,
        metavar="I",
        help="routed expert intermediate size (default 32)",
    )
    parser.add_argument(
        "--redundant", type=non_negative_int, default=0, metavar="R", help="redundant (replica) experts (default 0)"
    )
    parser.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default="linear",
        help="which logical experts each rank holds (default linear)",
    )
    parser.add_argument(
        "--regime",
        choices=SCALING_REGIMES,
        default="router",
        help="where routed_scaling_factor is applied (default router)",
    )
    parser.add_argument(
        "--dtype", choices=tuple(TOLERANCE), default="float32", help="activation and weight dtype (default float32)"
    )
    parser.add_argument(
        "--repeat", type=positive_int, default=5, metavar="R", help="timed forwards per rank (default 5)"
    )
    parser.add_argument("--seed", type=non_negative_int, default=0, help="random seed, an integer >= 0 (default 0)")
    parser.add_argument(
        "--timeout", type=positive_int, default=120, metavar="S", help="process-group timeout in seconds (default 120)"
    )
    parser.add_argument(
        "--debug", action="store_true", help="check every (token, slot) is dispatched and combined once"
    )
    parser.add_argument(
        "--quant",
        choices=("fp8_block", "fp8_tensor", "int4"),
        default=None,
        help="quantized routed experts (fp8_block: 128x128 blocks; int4: symmetric, groups of 128), "
        "also checked against the w8a8 (FP8) or w4a16 (INT4) reference",
    )
    parser.add_argument(
        "--dispatch-dtype",
        choices=("auto", "fp8"),
        default="auto",
        help="fp8: send the tokens as e4m3 rows with their scales (needs --quant fp8_block or fp8_tensor)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object on stdout instead of the text (keys: docs/cli.md)"
    )


def _under_torchrun() -> bool:
    return all(name in os.environ for name in TORCHRUN_ENV)


def _check_request(args: argparse.Namespace) -> tuple[Any, ExpertLayout]:
    """The preset and the layout the ranks will build; ValueError (LayoutError) if impossible."""
    preset = get_preset(args.preset)
    quant = getattr(args, "quant", None)
    if quant is not None and preset.expert_bias:
        raise ValueError(
            f"--quant {quant} is not served for preset {args.preset!r}: its experts carry "
            "biases, which quantized experts do not"
        )
    if getattr(args, "dispatch_dtype", "auto") == "fp8" and quant not in ("fp8_block", "fp8_tensor"):
        raise ValueError("--dispatch-dtype fp8 needs FP8 experts: --quant fp8_block (or fp8_tensor)")
    if quant == "int4":
        group = _quant_config(args).group_size
        for option, size in (("--hidden", args.hidden), ("--intermediate", args.intermediate)):
            if size % group:
                raise ValueError(
                    f"--quant int4 quantizes groups of {group} input columns: {option} {size} is not a multiple of {group}"
                )
    fusable = preset.shared_unfusable_reason is None
    # Per spawned rank: the EP and the single-process layer (all N experts: gate_up, down),
    # this rank's tokens and a few activation-sized buffers of every rank's tokens.
    element = 2 if args.dtype == "bfloat16" else 4
    weights = 2 * preset.router.num_experts * 3 * args.intermediate * args.hidden
    activations = RANK_ACTIVATION_BUFFERS * args.ep * args.tokens * args.hidden
    ranks_here = 1 if _under_torchrun() else args.ep
    check_fits_in_memory(
        f"--ep {args.ep} ranks of --tokens {args.tokens} x --hidden {args.hidden} with "
        f"{preset.router.num_experts} experts of --intermediate {args.intermediate}",
        ranks_here * (weights + activations) * element,
    )
    return preset, ExpertLayout(
        preset.router.num_experts,
        preset.num_shared_experts,
        ep_size=args.ep,
        dispatch=args.dispatch,
        shared=args.shared,
        num_redundant_experts=args.redundant,
        scaling_regime=args.regime,
        unfusable_reason=None if fusable else preset.shared_unfusable_reason,
        placement=args.placement,
    )


# --------------------------------------------------------------------------- one rank


def _quant_config(args):
    from moeroute.quant import QuantConfig

    quant = getattr(args, "quant", None)
    return None if quant is None else QuantConfig(quant)


def _build_layers(args, preset, group, device, keep=None):
    """(ep_module, single_module) with identical random weights on every rank.

    ``keep``: a dict that receives the weights (router, bias, quantized tensors, shared MLP and
    gate) for the reference check.
    """
    import torch
    from torch import nn

    from moeroute.bindings.torch.mlp import GatedMLP
    from moeroute.bindings.torch.moe import MoE
    from moeroute.quant import quantize_experts, quantize_int4

    dtype = getattr(torch, args.dtype)
    hidden, inter = args.hidden, args.intermediate
    n = preset.router.num_experts
    gen = torch.Generator().manual_seed(args.seed)

    def rand(*shape, scale):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    shared_mlp = gate = None
    if preset.num_shared_experts:
        # Keep the preset's slot count; a preset whose shared MLP does not split keeps
        # not splitting (one extra row).
        shared_inter = preset.num_shared_experts * inter
        if preset.shared_unfusable_reason is not None:
            shared_inter += 1
        shared_mlp = GatedMLP(hidden, shared_inter, dtype=dtype, device=device).requires_grad_(False)
        with torch.no_grad():
            for parameter in shared_mlp.parameters():
                parameter.copy_(rand(*parameter.shape, scale=parameter.shape[1] ** -0.5))
        if preset.shared_gated:
            gate = nn.Linear(hidden, 1, bias=False, dtype=dtype, device=device)
            gate.requires_grad_(False)
            with torch.no_grad():
                gate.weight.copy_(rand(1, hidden, scale=hidden**-0.5))
    w_gate_up = rand(n, 2 * inter, hidden, scale=hidden**-0.5)
    w_down = rand(n, hidden, inter, scale=inter**-0.5)
    router_weight = rand(n, hidden, scale=1.0).float()
    bias = (torch.randn(n, generator=gen) * CORRECTION_BIAS_SCALE).to(device)
    # gpt-oss-style presets: biased experts and router, their own activation.
    expert_biases = ()
    if preset.expert_bias:
        expert_biases = (rand(n, 2 * inter, scale=1.0), rand(n, hidden, scale=1.0))
        router_bias = rand(n, scale=1.0).float()

    quant = _quant_config(args)
    routed = (w_gate_up, w_down)
    if quant is not None and quant.format == "int4":
        # Each stacked weight as quantize_int4 returns it: (packed, scales).
        routed = tuple(
            quantize_int4(w, group_size=quant.group_size, symmetric=quant.symmetric) for w in (w_gate_up, w_down)
        )
    elif quant is not None:
        # Quantized from the weights' own dtype, a step at a time: no float32 copy of the layer.
        q = quantize_experts(w_gate_up, w_down, quant)
        routed = (q[0], q[2], q[1], q[3])  # w_gate_up, w_down, gate_up_scale, down_scale
    if keep is not None:
        keep.update(
            router=router_weight,
            bias=bias if preset.has_correction_bias else None,
            routed=routed,
            shared=shared_mlp,
            gate=gate,
        )
    modules = []
    for ep_group in (group, None):
        module = MoE(
            preset.router,
            hidden,
            inter,
            shared_experts=shared_mlp,
            shared_expert_gate=gate,
            shared=args.shared,
            ep_group=ep_group,
            dispatch=args.dispatch,
            scaling_regime=args.regime,
            num_redundant_experts=args.redundant if ep_group is not None else 0,
            placement=args.placement if ep_group is not None else "linear",
            correction_bias=preset.has_correction_bias,
            dtype=dtype,
            device=device,
            activation=preset.activation,
            expert_bias=preset.expert_bias,
            router_bias=preset.expert_bias,
            quant=quant,
            dispatch_dtype=getattr(args, "dispatch_dtype", "auto"),
        )
        with torch.no_grad():
            module.router_weight.copy_(router_weight)
            if preset.has_correction_bias:
                module.correction_bias.copy_(bias)
            if preset.expert_bias:
                module.router_bias.copy_(router_bias)
        if quant is None:
            module.load_routed_weights(w_gate_up, w_down, *expert_biases)
        elif quant.format == "int4":
            module.load_routed_weights(*routed)
        else:
            module.load_routed_weights(routed[0], routed[1], gate_up_scale=routed[2], down_scale=routed[3])
        modules.append(module)
    return modules


def quant_reference(args, preset, layout, weights, x):
    """float32 [T, H] of the quantized layer written from the definitions, on the CPU.

    Routing from `moeroute.routing.reference` (NumPy), the routed experts from
    `moeroute.quant.reference.moe_experts_reference` on the FP8 tensors (or
    `int4_moe_experts_reference` on the INT4 ones: dequantized, summed in float64), the
    shared expert in float64 (runner/overlap) or as S slots quantized from its weights as the
    experts are (fused), with the scaling regime applied as docs/semantics.md section 3 defines it.
    """
    import dataclasses

    import torch

    from moeroute.quant import quantize_experts, quantize_int4
    from moeroute.quant.reference import _act, int4_moe_experts_reference, moe_experts_reference
    from moeroute.routing import reference

    quant = _quant_config(args)
    dtype = getattr(torch, args.dtype)
    x = x.cpu()
    router, rsf = preset.router, preset.router.routed_scaling_factor
    output_regime = args.regime == "output"
    if output_regime:
        router = dataclasses.replace(router, routed_scaling_factor=1.0)
    logits = (x.float() @ weights["router"].cpu().T).numpy()
    bias = None if weights["bias"] is None else weights["bias"].cpu().numpy()
    topk_weights, topk_ids = reference.select_experts(logits, router, bias)
    act = preset.activation

    def experts(slot_weights, ids, gate_up, down):
        """The quantized experts' reference; gate_up, down: the format's tensors of each weight."""
        if quant.format == "int4":
            return int4_moe_experts_reference(
                x, slot_weights, ids, gate_up, down, quant.group_size, act, intermediate_dtype=dtype
            ).double()
        return moe_experts_reference(
            x, slot_weights, ids, *gate_up, *down, quant.block_size, quant.scale_fmt, act, intermediate_dtype=dtype
        ).double()

    def quantized(gate_up, down):
        """(gate_up's tensors, down's tensors) of float weights in the layer's format."""
        if quant.format == "int4":
            return tuple(
                quantize_int4(w, group_size=quant.group_size, symmetric=quant.symmetric) for w in (gate_up, down)
            )
        q = quantize_experts(gate_up, down, quant)
        return (q[0], q[1]), (q[2], q[3])

    routed = weights["routed"]
    if quant.format == "int4":  # (packed, scales) of each weight
        gate_up_q, down_q = (tuple(t.cpu() for t in weight) for weight in routed)
    else:  # w_gate_up, w_down, gate_up_scale, down_scale
        gate_up_q, down_q = (routed[0].cpu(), routed[2].cpu()), (routed[1].cpu(), routed[3].cpu())
    out = experts(torch.from_numpy(topk_weights), torch.from_numpy(topk_ids).long(), gate_up_q, down_q)
    shared_mlp, gate = weights["shared"], weights["gate"]
    if shared_mlp is not None:
        x64 = x.double()
        g = torch.ones(x.shape[0], 1, dtype=torch.float64)
        if gate is not None:
            g = torch.sigmoid(x64 @ gate.weight.detach().cpu().double().T)
        gate_w, up_w, down_w = (
            getattr(shared_mlp, name).weight.detach().cpu().float() for name in ("gate_proj", "up_proj", "down_proj")
        )
        if layout.shared == "fused":  # S slots of the routed size, quantized as the experts are
            inter, slots = args.intermediate, layout.num_shared_experts
            gate_up = torch.stack(
                [
                    torch.cat([gate_w[j * inter : (j + 1) * inter], up_w[j * inter : (j + 1) * inter]])
                    for j in range(slots)
                ]
            )
            down = torch.stack([down_w[:, j * inter : (j + 1) * inter] for j in range(slots)])
            slot_weight = (g / rsf if output_regime else g).float().expand(-1, slots).contiguous()
            out += experts(slot_weight, torch.arange(slots).expand(x.shape[0], -1), *quantized(gate_up, down))
        if output_regime:
            out *= rsf
        if layout.shared != "fused":
            h_gate, h_up = x64 @ gate_w.double().T, x64 @ up_w.double().T
            out += g * (_act(h_gate, h_up, act) @ down_w.double().T)
    elif output_regime:
        out *= rsf
    return out.float()


def _rank_report(args, preset, rank: int, world: int, group, device) -> dict:
    """Run this rank's check and timing; returns a plain dict (picklable)."""
    import torch

    from moeroute.bindings.ep import make_dispatcher

    weights = {}
    ep_module, single = _build_layers(args, preset, group, device, keep=weights)
    if args.debug:
        ep_module.dispatcher = make_dispatcher(ep_module.layout, group, args.dispatch, debug=True)
    num_local = ep_module.layout.num_local_experts(rank)
    load = torch.zeros(num_local, dtype=torch.int64)
    received_rows = []

    def count_load(_module, inputs):
        _, _, local_ids = inputs  # the experts take (hidden, weights, ids)
        held = local_ids[(local_ids >= 0) & (local_ids < num_local)].long().cpu()
        load.add_(torch.bincount(held, minlength=num_local))
        received_rows.append(local_ids.shape[0])

    gen = torch.Generator().manual_seed(args.seed + 1 + rank)
    x = torch.randn(args.tokens, args.hidden, generator=gen).to(device=device, dtype=getattr(torch, args.dtype))
    hook = ep_module.experts.register_forward_pre_hook(count_load)
    with torch.no_grad():
        out = ep_module(x)
        hook.remove()
        expected = single(x)
        stats = ep_module.dispatcher.last_stats
        times = []
        for i in range(WARMUP_FORWARDS + args.repeat):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            ep_module(x)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= WARMUP_FORWARDS:
                times.append(time.perf_counter() - start)

    def relative_error(reference):
        if not out.numel():
            return 0.0
        scale = float(reference.double().abs().max()) or 1.0
        return float((out.double().cpu() - reference.double().cpu()).abs().max()) / scale

    error = relative_error(expected)
    reference_error = None
    if _quant_config(args) is not None:
        reference_error = relative_error(quant_reference(args, preset, ep_module.layout, weights, x))
    return dict(
        reference_error=reference_error,
        rank=rank,
        tokens=args.tokens,
        received_rows=received_rows[0],
        slots_computed=int(load.sum()),
        max_expert_load=int(load.max()) if num_local else 0,
        local_experts=num_local,
        bytes=None if stats is None else stats.as_dict(),
        forward_ms=1e3 * statistics.median(times),
        error=error,
        shared=ep_module.layout.shared,
        shared_reason=ep_module.layout.shared_reason,
    )


def _init_group(args, rank: int, world: int, init_method: str, backend: str):
    import torch.distributed as dist

    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=args.timeout)
    )
    return dist.group.WORLD


# --------------------------------------------------------------------------- reporting


class _Checks(NamedTuple):
    """The verdicts both the text and the JSON report: one per rank, the w8a8 one, the status."""

    rank_ok: list[bool]
    #: With --quant: (worst relative error, bound, passed, scale bytes sent); else None.
    reference: tuple[float, float, bool, int] | None
    status: int


def _checks(args, reports: list[dict]) -> _Checks:
    tolerance = TOLERANCE[args.dtype]
    rank_ok = [r["error"] < tolerance for r in reports]
    status = 0 if all(rank_ok) else EXIT_MISMATCH
    reference = None
    if getattr(args, "quant", None) is not None:
        bound = (INT4_TOLERANCE if args.quant == "int4" else QUANT_TOLERANCE)[args.dtype]
        worst = max(r["reference_error"] for r in reports)
        passed = worst < bound
        status = status if passed else EXIT_MISMATCH
        scales = sum((r["bytes"] or {}).get("scale_bytes", 0) for r in reports)
        reference = (worst, bound, passed, scales)
    return _Checks(rank_ok, reference, status)


def _total_bytes(reports: list[dict]) -> int:
    return sum((r["bytes"] or {}).get("total_bytes", 0) for r in reports)


def _format(args, reports: list[dict]) -> tuple[str, int]:
    """The printed table and the exit status."""
    tolerance = TOLERANCE[args.dtype]
    first = reports[0]
    quant = getattr(args, "quant", None)
    checks = _checks(args, reports)
    lines = [
        f"moeroute run: preset {args.preset}, ep {args.ep}, dispatch {args.dispatch}, "
        f"{args.tokens} tokens per rank, H={args.hidden}, I={args.intermediate}, {args.dtype}"
        + ("" if quant is None else f", experts {quant}, dispatch dtype {args.dispatch_dtype}"),
        f"shared expert: {first['shared']}. {first['shared_reason']}",
        "rank  tokens  rows_in  slots  experts  max_load  sent_rows_B  sent_meta_B  "
        "sent_combine_B  forward_ms  rel_error  check",
    ]
    for r, ok in zip(reports, checks.rank_ok):
        b = r["bytes"] or {}
        lines.append(
            f"{r['rank']:>4}  {r['tokens']:>6}  {r['received_rows']:>7}  {r['slots_computed']:>5}  "
            f"{r['local_experts']:>7}  {r['max_expert_load']:>8}  "
            f"{b.get('hidden_bytes', 0):>11}  {b.get('metadata_bytes', 0):>11}  "
            f"{b.get('combine_bytes', 0):>14}  {r['forward_ms']:>10.3f}  "
            f"{r['error']:>9.2e}  {'ok' if ok else 'MISMATCH'}"
        )
    if checks.reference is not None:
        worst, bound, passed, scales = checks.reference
        lines.append(
            f"{'w4a16' if quant == 'int4' else 'w8a8'} reference (moeroute.quant.reference): "
            f"max relative error {worst:.2e} over "
            f"{len(reports)} ranks (< {bound:g}): {'PASS' if passed else 'FAIL'}"
            + (f"; FP8 rows sent with {scales} bytes of scales" if scales else "")
        )
    lines.append(
        f"bytes sent by all ranks per forward (rows, scales, metadata, counts, combine): {_total_bytes(reports)}"
    )
    lines.append(
        "result: "
        + (
            "every rank matches the single-process layer"
            if checks.status == 0
            else f"MISMATCH above tolerance {tolerance:g}"
        )
    )
    return "\n".join(lines), checks.status


def _json(args, reports: list[dict]) -> dict[str, Any]:
    """``run --json``: the text's values as one object (keys documented in docs/cli.md)."""
    first = reports[0]
    checks = _checks(args, reports)
    reference = None
    if checks.reference is not None:
        worst, bound, passed, scales = checks.reference
        reference = {"max_relative_error": worst, "tolerance": bound, "passed": passed, "scale_bytes": scales}
    return {
        "preset": args.preset,
        "ep_size": args.ep,
        "dispatch": args.dispatch,
        "tokens": args.tokens,
        "hidden": args.hidden,
        "intermediate": args.intermediate,
        "dtype": args.dtype,
        "quant": getattr(args, "quant", None),
        "dispatch_dtype": getattr(args, "dispatch_dtype", "auto"),
        "shared": first["shared"],
        "shared_reason": first["shared_reason"],
        "tolerance": TOLERANCE[args.dtype],
        "ranks": [
            {
                "rank": r["rank"],
                "tokens": r["tokens"],
                "received_rows": r["received_rows"],
                "slots_computed": r["slots_computed"],
                "local_experts": r["local_experts"],
                "max_expert_load": r["max_expert_load"],
                "bytes": r["bytes"],
                "forward_ms": r["forward_ms"],
                "relative_error": r["error"],
                "ok": ok,
            }
            for r, ok in zip(reports, checks.rank_ok)
        ],
        "reference": reference,
        "total_bytes": _total_bytes(reports),
        "matches": checks.status == 0,
    }


# --------------------------------------------------------------------------- launching


class RunSteps(NamedTuple):
    """What one kind of rank run does; `launch` and `spawn_reports` do the rest (spawning
    or joining torchrun's group, collecting the reports, exit statuses). Module-level
    functions only: spawned ranks receive them pickled."""

    #: args -> the preset; ValueError (LayoutError included) when the request is impossible.
    check: Callable[[argparse.Namespace], Any]
    #: (args, preset, rank, world, group, device) -> this rank's report, a picklable dict.
    rank_report: Callable[..., dict]
    #: (args, every rank's report) -> (the printed text, the exit status).
    format: Callable[[argparse.Namespace, list], tuple[str, int]]
    #: (args, every rank's report) -> the ``--json`` object; None: --json is not served.
    to_json: Callable[[argparse.Namespace, list], dict] | None = None


def _check_preset(args: argparse.Namespace):
    return _check_request(args)[0]


#: ``moeroute run`` itself.
RUN_STEPS = RunSteps(_check_preset, _rank_report, _format, _json)


def _spawned_rank(rank: int, args: argparse.Namespace, init_file: str, result_dir: str, steps: RunSteps) -> None:
    import torch

    torch.set_num_threads(1)  # E processes share this machine's cores
    try:
        preset = steps.check(args)
        group = _init_group(args, rank, args.ep, f"file://{init_file}", "gloo")
        result = {"ok": True, "report": steps.rank_report(args, preset, rank, args.ep, group, torch.device("cpu"))}
    except BaseException:
        result = {"ok": False, "error": traceback.format_exc()}
    with open(os.path.join(result_dir, f"rank{rank}.pkl"), "wb") as handle:
        pickle.dump(result, handle)
    # Skip the group teardown: a failed peer could block it.
    os._exit(0)


def spawn_reports(args: argparse.Namespace, steps: RunSteps = RUN_STEPS) -> list[dict]:
    """Every rank's report from ``args.ep`` gloo ranks spawned on this machine.

    Raises
    ------
    RuntimeError
        A rank died, exited without a report or raised (the message holds the tracebacks).
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="moeroute-run-") as tmp:
        init_file = os.path.join(tmp, "store")
        result_dir = os.path.join(tmp, "results")
        os.makedirs(result_dir)
        context = mp.start_processes(
            _spawned_rank, args=(args, init_file, result_dir, steps), nprocs=args.ep, join=False, start_method="spawn"
        )
        try:
            while not context.join():
                pass
        except Exception as error:  # a rank died without reporting
            raise RuntimeError(f"a rank failed: {error}") from None
        results = []
        for rank in range(args.ep):
            path = os.path.join(result_dir, f"rank{rank}.pkl")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {rank} exited without a result")
            with open(path, "rb") as handle:
                results.append(pickle.load(handle))
    failed = [f"rank {rank} failed:\n{r['error']}" for rank, r in enumerate(results) if not r["ok"]]
    if failed:
        raise RuntimeError("\n".join(failed))
    return [r["report"] for r in results]


def _output(args: argparse.Namespace, steps: RunSteps, reports: list[dict], text: str) -> str:
    """What is printed: the text, or with ``--json`` the one-line JSON object."""
    if getattr(args, "json", False) and steps.to_json is not None:
        return json.dumps(steps.to_json(args, reports))
    return text


def _run_spawned(args: argparse.Namespace, steps: RunSteps) -> int:
    try:
        reports = spawn_reports(args, steps)
    except RuntimeError as error:
        print(f"moeroute run: {error}", file=sys.stderr)
        return EXIT_FAILURE
    text, status = steps.format(args, reports)
    print(_output(args, steps, reports, text))
    return status


def _run_torchrun(args: argparse.Namespace, steps: RunSteps) -> int:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    preset = steps.check(args)
    group = _init_group(args, rank, world, "env://", backend)
    try:
        report = steps.rank_report(args, preset, rank, world, group, device)
        reports = [None] * world
        dist.all_gather_object(reports, report, group=group)
    finally:
        dist.destroy_process_group()
    text, status = steps.format(args, reports)
    if rank == 0:
        print(_output(args, steps, reports, text))
    return status


def launch(args: argparse.Namespace, steps: RunSteps) -> int:
    """Run ``steps`` on every rank: join torchrun's group (RANK, WORLD_SIZE and MASTER_ADDR
    set) or spawn ``--ep`` gloo ranks (default 2); returns the exit status.

    `EXIT_USAGE` with one line on stderr, before any rank starts: ``steps.check`` refuses
    the request, or --ep disagrees with torchrun's WORLD_SIZE; `EXIT_FAILURE`: a rank
    failed; otherwise ``steps.format``'s status.
    """
    torchrun = _under_torchrun()
    if args.ep is None:
        args.ep = int(os.environ["WORLD_SIZE"]) if torchrun else 2
    if torchrun and args.ep != int(os.environ["WORLD_SIZE"]):
        print(
            f"moeroute: error: --ep {args.ep} disagrees with torchrun's WORLD_SIZE={os.environ['WORLD_SIZE']}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        steps.check(args)
    except ValueError as error:  # LayoutError included
        print(f"moeroute: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    return _run_torchrun(args, steps) if torchrun else _run_spawned(args, steps)


def run(args: argparse.Namespace) -> int:
    """Run ``moeroute run`` with parsed arguments; returns the exit status.

    0: every rank matches the single-process layer; `EXIT_MISMATCH`: one does not;
    `EXIT_USAGE`: an impossible request (unknown preset, impossible layout, --ep
    disagreeing with torchrun's WORLD_SIZE); `EXIT_FAILURE`: a rank failed.
    """
    return launch(args, RUN_STEPS)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``moeroute run`` (``argv`` without the command name)."""
    parser = argparse.ArgumentParser(prog="moeroute run", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
