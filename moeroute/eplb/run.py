"""``moeroute run --eplb``: rebalance a live expert-parallel layer once and show the effect.

    moeroute run --preset deepseek-v3 --ep 4 --redundant 4 --tokens 256 --eplb [--skew 1.2]

Without ``--eplb`` this is ``moeroute run`` (`moeroute.bindings.ep_run`). With it, every
rank builds the preset-shaped layer with ``record_load=True``, routes its tokens with
skewed router logits (logical expert j gets ``-skew * log(1 + j)`` added, a Zipf-like
popularity), runs ``--repeat`` forwards, then gathers the load (`gather_load`), plans
(`rebalance`), moves the experts live (`apply`) and runs the same forwards again. It prints
the balancedness and each rank's tokens (routed slots computed) before and after, the
experts and bytes moved and the forward time, and checks that every output after equals
the output before and the single-process layer's.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

from moeroute.bindings import ep_run

__all__ = ["add_arguments", "run", "spawn_reports", "DEFAULT_SKEW"]

#: Router logit offset scale of the skewed routing: expert j gets -skew * log(1 + j).
DEFAULT_SKEW = 1.2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``moeroute run``'s arguments plus ``--eplb`` and ``--skew``."""
    ep_run.add_arguments(parser)
    parser.add_argument(
        "--eplb",
        action="store_true",
        help="route skewed tokens, rebalance the experts live once and print "
        "the balancedness and per-rank tokens before and after",
    )
    parser.add_argument(
        "--skew",
        type=float,
        default=DEFAULT_SKEW,
        metavar="S",
        help=f"--eplb: logit offset -S*log(1+j) of expert j (default {DEFAULT_SKEW})",
    )


def _check(args: argparse.Namespace):
    if getattr(args, "json", False):
        raise ValueError("--json is not served with --eplb; leave it out for the text table")
    preset, layout = ep_run._check_request(args)
    p, e = layout.num_routed_physical, layout.ep_size
    if p % e:
        raise ValueError(
            f"--eplb places P = N + --redundant = {p} physical experts in equal "
            f"blocks over --ep {e} ranks; use --redundant {args.redundant + (-p % e)}"
        )
    if not math.isfinite(args.skew) or args.skew < 0:
        raise ValueError(f"--skew {args.skew} must be a finite number >= 0")
    return preset


def _rank_report(args, preset, rank: int, world: int, group, device) -> dict:
    import torch
    import torch.distributed as dist

    from moeroute.eplb import apply, balancedness_from_physical, gather_load, rebalance
    from moeroute.bindings.torch.load_window import LoadRecorder

    ep_module, single = ep_run._build_layers(args, preset, group, device)
    # The same layer again, left on the old placement: forwards of the two are timed in
    # turn after the rebalance, so machine noise hits both alike.
    old_module, _ = ep_run._build_layers(args, preset, group, device)
    ep_module.load_recorder = LoadRecorder(args.repeat)
    n = preset.router.num_experts
    gen = torch.Generator().manual_seed(args.seed + 1 + rank)
    dtype = getattr(torch, args.dtype)
    x = torch.randn(args.tokens, args.hidden, generator=gen).to(device=device, dtype=dtype)
    offsets = -args.skew * torch.log1p(torch.arange(n, dtype=torch.float32))
    logits = (torch.randn(args.tokens, n, generator=gen) + offsets).to(device)

    def timed(module):
        start = time.perf_counter()
        out = module(x, logits)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return out, time.perf_counter() - start

    def physical_load():
        physical = ep_module.load_recorder.physical_load(ep_module.layout).to(device)
        dist.all_reduce(physical, group=group)
        return physical.cpu().numpy()

    with torch.no_grad():
        expected = single(x, logits)
        for module in (ep_module, old_module):
            module(x, logits)  # first-call compilation, untimed
        ep_module.load_recorder.reset()
        for _ in range(args.repeat):
            out_before = ep_module(x, logits)
        physical_before = physical_load()
        load = gather_load(ep_module, group)
        layout = ep_module.layout
        placement = rebalance(load, layout.num_routed_physical, layout.ep_size)
        handle = apply(ep_module, placement, group)
        before_s, after_s = [], []
        for _ in range(args.repeat):
            _, seconds = timed(old_module)
            before_s.append(seconds)
            out_after, seconds = timed(ep_module)
            after_s.append(seconds)
        physical_after = physical_load()
    ms_before, ms_after = 1e3 * statistics.median(before_s), 1e3 * statistics.median(after_s)
    speedup = statistics.median(b / a for b, a in zip(before_s, after_s))

    def error(out):
        if not out.numel():
            return 0.0
        scale = float(expected.double().abs().max()) or 1.0
        return float((out.double() - expected.double()).abs().max()) / scale

    def per_rank(physical):
        return physical.reshape(world, -1).sum(axis=1).tolist()

    return dict(
        rank=rank,
        tokens=args.tokens,
        rank_tokens_before=per_rank(physical_before),
        rank_tokens_after=per_rank(physical_after),
        balancedness_before=float(balancedness_from_physical(physical_before, world)),
        balancedness_after=float(balancedness_from_physical(physical_after, world)),
        forward_ms_before=ms_before,
        forward_ms_after=ms_after,
        speedup=speedup,
        error_before=error(out_before),
        error_after=error(out_after),
        experts_moved=handle.experts_moved,
        bytes_received=handle.bytes_received,
        bytes_sent=handle.bytes_sent,
    )


def _format(args, reports: list[dict]) -> tuple[str, int]:
    tolerance = ep_run.TOLERANCE[args.dtype]
    first = reports[0]
    lines = [
        f"moeroute run --eplb: preset {args.preset}, ep {args.ep}, dispatch {args.dispatch}, "
        f"{args.redundant} redundant, {args.tokens} tokens per rank, skew {args.skew:g}",
        f"balancedness (mean/max rank tokens): before {first['balancedness_before']:.3f}, "
        f"after {first['balancedness_after']:.3f}; experts moved: {first['experts_moved']}, "
        f"expert bytes moved: {sum(r['bytes_received'] for r in reports)}",
        "forward times: the old and the new placement timed in turn, per-pair median",
        "rank  tokens_before  tokens_after  forward_ms_before  forward_ms_after  rel_error_after  check",
    ]
    status = 0
    for r in reports:
        ok = max(r["error_before"], r["error_after"]) < tolerance
        status = status if ok else ep_run.EXIT_MISMATCH
        rank = r["rank"]
        lines.append(
            f"{rank:>4}  {first['rank_tokens_before'][rank]:>13.0f}  "
            f"{first['rank_tokens_after'][rank]:>12.0f}  {r['forward_ms_before']:>17.3f}  "
            f"{r['forward_ms_after']:>16.3f}  {r['error_after']:>15.2e}  "
            f"{'ok' if ok else 'MISMATCH'}"
        )
    lines.append(
        "result: "
        + (
            "every rank matches the single-process layer before and after"
            if status == 0
            else f"MISMATCH above tolerance {tolerance:g}"
        )
    )
    return "\n".join(lines), status


#: ``moeroute run --eplb``: spawned or joined like ``moeroute run`` (`ep_run.launch`).
EPLB_STEPS = ep_run.RunSteps(_check, _rank_report, _format)


def spawn_reports(args) -> list[dict]:
    """Every spawned rank's report (``--ep`` gloo ranks on this machine); RuntimeError with
    the failing ranks' tracebacks otherwise."""
    return ep_run.spawn_reports(args, EPLB_STEPS)


def run(args: argparse.Namespace) -> int:
    """``moeroute run`` (without ``--eplb``) or the live rebalancing run; the exit status."""
    return ep_run.launch(args, EPLB_STEPS if args.eplb else ep_run.RUN_STEPS)
