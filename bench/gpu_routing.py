"""Routing on one CUDA GPU: moeroute's kernels against torch-native ops on the same device.

select_experts (DeepSeek-V3 and Qwen3.5 routing) and align_block_size at T in
{1, 64, 1024, 16384, 65536}, on torch CUDA tensors (zero-copy into the numba kernels, launched
on torch's current stream). Each figure is timed with CUDA events after a warm-up, baseline
and candidate alternating call by call; the table gives medians, the median of the per-pair
ratios, the host wall time per call (Python launch overhead included) and the achieved logits
bandwidth against the device copy bandwidth measured first.

Launch overhead: select_experts, the fused route and align_block_size at T in {1, 8, 64}
through numba's dispatcher and through the cached launcher (MOEROUTE_CUDA_LAUNCHER=numba / cached), as host microseconds per
call of HOST_LOOP_CALLS back-to-back calls followed by one synchronize, alternating.

    python bench/gpu_routing.py [--repeats 50] [--quick]

Without a CUDA GPU it exits with a message saying so.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from _common import (  # noqa: E402
    calls_per_sample,
    cuda_events,
    interleaved,
    print_table,
    wall_clock,
    write_results,
)

TOKEN_COUNTS = [1, 64, 1024, 16384, 65536]
PRESET_NAMES = ["deepseek-v3", "qwen3.5-moe"]
WARMUP_CALLS = 10  # compile, allocator and cache warm-up before timing
COPY_BYTES = 1 << 30  # device copy buffer: far past L2 (H100/H200: 50-60 MiB)
HOST_LOOP_CALLS = 50  # back-to-back calls timed on the host clock for the per-call wall time
ALIGN_BLOCK_SIZE = 64
LAUNCHER_TOKEN_COUNTS = [1, 8, 64]
LAUNCHER_PRESET = "deepseek-v3"
# Targets of the routing kernel (design goals; this script reports whether they are met).
SMALL_BATCH_US = 10.0  # per call for T <= 64
COPY_FRACTION_AT_65536 = 0.5
SPEEDUP_AT_16384 = 5.0


def require_gpu():
    """torch and numba.cuda with a visible CUDA device, or SystemExit with the reason."""
    try:
        import torch
        from numba import cuda
    except ImportError as error:
        raise SystemExit(f"gpu_routing needs torch and numba-cuda: {error}") from None
    if not torch.cuda.is_available():
        raise SystemExit(
            "gpu_routing needs a CUDA GPU: torch.cuda.is_available() is False "
            "(a CPU build of torch, or no device). Run bench/routing.py for the CPU."
        )
    if not cuda.is_available():
        raise SystemExit("gpu_routing needs a CUDA GPU: numba.cuda.is_available() is False")
    return torch


def event_pair(torch, baseline, candidate, repeats):
    """`interleaved` on CUDA events: (baseline us, candidate us, median of per-pair ratios)."""
    result = interleaved(baseline, candidate, repeats, warmup=WARMUP_CALLS, timer=cuda_events(torch))
    return result["baseline_us"], result["candidate_us"], result["speedup"]


def host_us_per_call(torch, function):
    """Host wall time per call over HOST_LOOP_CALLS back-to-back calls, synchronized."""
    batch = calls_per_sample(function, HOST_LOOP_CALLS)

    def synchronized():
        torch.cuda.synchronize()
        batch()
        torch.cuda.synchronize()

    return wall_clock(synchronized) / HOST_LOOP_CALLS * 1e6


def device_copy_gbps(torch):
    source = torch.ones(COPY_BYTES // 4, dtype=torch.float32, device="cuda")
    target = torch.empty_like(source)
    timer = cuda_events(torch)
    for _ in range(3):
        target.copy_(source)
    best = min(timer(lambda: target.copy_(source)) for _ in range(10))
    return 2 * COPY_BYTES / best / 1e9


def select_rows(torch, repeats, copy_gbps, token_counts):
    from routing import torch_select

    from moeroute.config import PRESETS
    from moeroute.routing.select import select_experts

    rows = []
    for name in PRESET_NAMES:
        preset = PRESETS[name]
        config = preset.router
        generator = torch.Generator(device="cuda").manual_seed(0)
        bias = None
        if preset.has_correction_bias:
            bias = 0.1 * torch.randn(config.num_experts, device="cuda", generator=generator)
        for tokens in token_counts:
            logits = torch.randn(tokens, config.num_experts, device="cuda", generator=generator)
            ours = select_experts(logits, config, bias)
            theirs = torch_select(logits, config, bias)
            same = (ours[1].sort(dim=1).values == theirs[1].sort(dim=1).values).all(dim=1)
            base_us, cand_us, speedup = event_pair(
                torch, lambda: torch_select(logits, config, bias), lambda: select_experts(logits, config, bias), repeats
            )
            wall_us = host_us_per_call(torch, lambda: select_experts(logits, config, bias))
            gbps = logits.numel() * 4 / (cand_us * 1e-6) / 1e9
            rows.append(
                {
                    "op": "select_experts",
                    "preset": name,
                    "num_tokens": tokens,
                    "moeroute_us": cand_us,
                    "torch_us": base_us,
                    "speedup": speedup,
                    "moeroute_host_us_per_call": wall_us,
                    "logits_gbps": gbps,
                    "fraction_of_copy_bandwidth": gbps / copy_gbps,
                    "same_expert_sets": float(same.float().mean()),
                    "repeats": repeats,
                }
            )
    return rows


def launcher_calls(torch, tokens):
    """op name -> a call on ``tokens`` rows (the ops of one routing step, T small)."""
    from moeroute.config import PRESETS
    from moeroute.layout import ExpertLayout
    from moeroute.routing import align_block_size, route, select_experts

    config = PRESETS[LAUNCHER_PRESET].router
    layout = ExpertLayout(config.num_experts, 1, ep_size=8, dispatch="all2all")
    generator = torch.Generator(device="cuda").manual_seed(2)
    logits = torch.randn(tokens, config.num_experts, device="cuda", generator=generator)
    bias = 0.1 * torch.randn(config.num_experts, device="cuda", generator=generator)
    ids = select_experts(logits, config, bias)[1]
    return {
        "select_experts": lambda: select_experts(logits, config, bias),
        "route": lambda: route(logits, config, layout, 3, bias, None, 3),
        "align_block_size": lambda: align_block_size(ids, config.num_experts, ALIGN_BLOCK_SIZE),
    }


def launcher_rows(torch, repeats, token_counts):
    """Host us per call of each routing op, numba dispatch vs the cached launcher."""
    import os

    from moeroute.routing import _launcher

    reason = _launcher.cached_unavailable_reason()
    if reason is not None:
        print(f"cached launcher not measured: {reason}")
        return []
    previous = os.environ.get(_launcher.LAUNCHER_ENV)
    rows = []
    try:
        for tokens in token_counts:
            for op, call in launcher_calls(torch, tokens).items():
                results = {}

                def run_with(launcher, call=call, results=results):
                    batch = calls_per_sample(call, HOST_LOOP_CALLS)

                    def run():
                        os.environ[_launcher.LAUNCHER_ENV] = launcher
                        batch()
                        results[launcher] = call()

                    return run

                def synchronized(fn):
                    torch.cuda.synchronize()
                    return wall_clock(lambda: (fn(), torch.cuda.synchronize()))

                result = interleaved(
                    run_with("numba"), run_with("cached"), repeats, warmup=WARMUP_CALLS, timer=synchronized
                )
                same = all(bool((a == b).all()) for a, b in zip(results["numba"], results["cached"]))
                rows.append(
                    {
                        "op": f"{op} launch",
                        "preset": LAUNCHER_PRESET,
                        "num_tokens": tokens,
                        "numba_host_us_per_call": result["baseline_us"] / (HOST_LOOP_CALLS + 1),
                        "cached_host_us_per_call": result["candidate_us"] / (HOST_LOOP_CALLS + 1),
                        "speedup": result["speedup"],
                        "same_outputs": same,
                        "repeats": repeats,
                        "calls_per_sample": HOST_LOOP_CALLS + 1,
                    }
                )
    finally:
        if previous is None:
            os.environ.pop(_launcher.LAUNCHER_ENV, None)
        else:
            os.environ[_launcher.LAUNCHER_ENV] = previous
    return rows


def align_rows(torch, repeats, token_counts):
    from align import torch_align_block_size

    from moeroute.routing.align import align_block_size

    rows = []
    num_experts, top_k = 256, 8
    for tokens in token_counts:
        generator = torch.Generator(device="cuda").manual_seed(1)
        ids = torch.randint(0, num_experts, (tokens, top_k), device="cuda", generator=generator, dtype=torch.int32)
        base_us, cand_us, speedup = event_pair(
            torch,
            lambda: torch_align_block_size(ids, num_experts, ALIGN_BLOCK_SIZE),
            lambda: align_block_size(ids, num_experts, ALIGN_BLOCK_SIZE),
            repeats,
        )
        rows.append(
            {
                "op": "align_block_size",
                "num_tokens": tokens,
                "top_k": top_k,
                "num_experts": num_experts,
                "block_size": ALIGN_BLOCK_SIZE,
                "moeroute_us": cand_us,
                "torch_us": base_us,
                "speedup": speedup,
                "repeats": repeats,
            }
        )
    return rows


def targets(rows):
    select = [r for r in rows if r["op"] == "select_experts"]
    found = []
    for name in PRESET_NAMES:
        mine = {r["num_tokens"]: r for r in select if r["preset"] == name}
        small = [mine[t]["moeroute_us"] for t in (1, 64) if t in mine]
        if small:
            found.append(
                {
                    "model": name,
                    "target": f"<= {SMALL_BATCH_US} us per call, T <= 64",
                    "value": max(small),
                    "met": max(small) <= SMALL_BATCH_US,
                }
            )
        if 65536 in mine:
            value = mine[65536]["fraction_of_copy_bandwidth"]
            found.append(
                {
                    "model": name,
                    "target": ">= 50% of copy bandwidth at T = 65536",
                    "value": value,
                    "met": value >= COPY_FRACTION_AT_65536,
                }
            )
        if 16384 in mine:
            value = mine[16384]["speedup"]
            found.append(
                {
                    "model": name,
                    "target": ">= 5x torch-native at T = 16384",
                    "value": value,
                    "met": value >= SPEEDUP_AT_16384,
                }
            )
    return found


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=50, help="timed pairs per figure")
    parser.add_argument("--quick", action="store_true", help="10 repeats")
    args = parser.parse_args(argv)
    repeats = 10 if args.quick else args.repeats
    torch = require_gpu()
    copy_gbps = device_copy_gbps(torch)
    print(f"{torch.cuda.get_device_name()}: device copy bandwidth {copy_gbps:.0f} GB/s")
    select = select_rows(torch, repeats, copy_gbps, TOKEN_COUNTS)
    print_table(
        ["preset", "T", "moeroute us", "host us/call", "torch us", "speedup", "GB/s", "of copy"],
        [
            [
                r["preset"],
                r["num_tokens"],
                r["moeroute_us"],
                r["moeroute_host_us_per_call"],
                r["torch_us"],
                r["speedup"],
                r["logits_gbps"],
                f"{100 * r['fraction_of_copy_bandwidth']:.0f}%",
            ]
            for r in select
        ],
    )
    launch = launcher_rows(torch, repeats, LAUNCHER_TOKEN_COUNTS)
    if launch:
        print_table(
            ["launch", "T", "numba us/call", "cached us/call", "speedup", "same outputs"],
            [
                [
                    r["op"],
                    r["num_tokens"],
                    r["numba_host_us_per_call"],
                    r["cached_host_us_per_call"],
                    r["speedup"],
                    r["same_outputs"],
                ]
                for r in launch
            ],
        )
    align = align_rows(torch, repeats, TOKEN_COUNTS)
    if align:
        print_table(
            ["align T", "moeroute us", "torch us", "speedup"],
            [[r["num_tokens"], r["moeroute_us"], r["torch_us"], r["speedup"]] for r in align],
        )
    found = targets(select)
    for target in found:
        print(f"{target['model']}: {target['target']}: {target['value']:.2f} ({'met' if target['met'] else 'NOT met'})")
    path = write_results(
        "gpu_routing",
        {
            "device": torch.cuda.get_device_name(),
            "device_copy_gbps": copy_gbps,
            "results": select + launch + align,
            "targets": found,
            "numpy": np.__version__,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
