"""End-to-end MoE layer on the CPU: moeroute's MoE vs the transformers block, same weights and input.

A Qwen3-MoE-like block (H=1024, I=384, N=64, K=8, float32) at T in {16, 512, 2048}.
moeroute's MoE runs with ``pack_cpu_weights()`` (oneDNN-packed expert weights, a second
copy in memory); the same module with plain weights is timed against hf_eager as well.
Baselines, each timed interleaved with moeroute in one process (the order alternates
every repetition), reported as the median of per-repetition time ratios:

* ``hf_eager``: ``Qwen3MoeSparseMoeBlock`` as a standalone module (its experts loop over
  the hit experts with index/where/index_add, the transformers default for a block);
* ``hf_grouped_mm``: the same block with ``experts_implementation="grouped_mm"``, what
  transformers picks for a whole model on torch >= 2.9.

Also the time split of moeroute's layer (routing = router linear + select_experts +
shared-slot append + local remap; permute; expert GEMMs; combine), the share spent beyond
the GEMMs, and the expert-GEMM strategies side by side against the per-expert torch.mm
loop on contiguous slices: the same loop on oneDNN, the padded torch.bmm batch,
torch._grouped_mm. torch keeps its default thread count on both sides.

Decode sizes: T = 1 and T = 8 on this shape and on a Qwen3-30B-A3B block (H=2048, I=768,
N=128, K=8), float32 and bfloat16, against hf_eager (``--decode-only`` runs just these).

JSON goes to bench/results/layer.json. Run: ``python bench/layer.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from _common import RESULTS_DIR, interleaved, print_table, wall_clock, write_results  # noqa: E402

from moeroute.bindings.torch import arrays  # noqa: E402
from moeroute.experts.activations import gated_activation  # noqa: E402
from moeroute.experts.choose import choose  # noqa: E402
from moeroute.experts.formats.unquantized import (  # noqa: E402
    cpu_experts,
    expert_mlp,
    onednn_linear_serves,
    padded_expert_mlp,
    rows_expert_mlp,
    streamed_expert_mlp,
)
from moeroute.bindings.torch.moe import MoE  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K = 1024, 384, 64, 8
#: Decode-sized batches: (name, H, I, N, K) shapes, token counts and dtypes ("readme" is the
#: Qwen3-MoE-like block above, the name bench/results/layer.json keeps).
DECODE_SHAPES = (("readme", HIDDEN, INTER, EXPERTS, TOP_K), ("qwen3-30b-a3b", 2048, 768, 128, 8))
DECODE_TOKENS = (1, 8)
DECODE_DTYPES = ("float32", "bfloat16")
DECODE_REPEATS, QUICK_DECODE_REPEATS = 41, 9
#: Output tolerance against the block, relative to its largest output, per dtype.
DECODE_RTOL = {"float32": 1e-4, "bfloat16": 3e-2}
TOKENS = (16, 512, 2048)
#: Interleaved repetitions per size: enough for a stable median on a shared 2-core box.
REPEATS = {16: 41, 512: 11, 2048: 11}
QUICK_REPEATS = {16: 9, 512: 3, 2048: 3}
#: Warm-up passes of the stage split: compiles the Numba kernels, faults in the weights.
WARMUP = 2
WEIGHT_SCALE = 0.02
RESULTS = RESULTS_DIR / "layer.json"


def build_block(hidden=HIDDEN, inter=INTER, experts=EXPERTS, top_k=TOP_K):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=hidden,
        moe_intermediate_size=inter,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
    )
    block = Qwen3MoeSparseMoeBlock(config).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * WEIGHT_SCALE)
    return block


def set_experts_implementation(block, name):
    block.experts.config._experts_implementation = name


def as_ms(result):
    """_common.interleaved's result with times in ms (baseline first, moeroute second)."""
    return {
        "base_ms": result["baseline_us"] / 1e3,
        "moeroute_ms": result["candidate_us"] / 1e3,
        "speedup_median_of_ratios": result["speedup"],
        "repeats": result["repeats"],
    }


def stage_split(moe, x, repeats):
    """Median time of each stage of moeroute's forward, run stage by stage on the same data.

    The "loop" strategy streams the experts (gather, MLP, sum per expert): its permute is
    the expert sort plus the per-expert gathers, its combine the per-expert sums plus the
    loop's own bookkeeping; "padded" runs permute, the batched MLPs and combine in turn.
    """
    stages = {"routing": [], "permute": [], "gemm": [], "combine": [], "total": []}
    experts = moe.experts
    for r in range(repeats + WARMUP):
        t0 = time.perf_counter()
        logits = moe.compute_router_logits(x)
        # One rank, as the forward runs it: route gives the local ids, nothing is dispatched.
        recv_weights, local_ids = arrays.route(logits, moe._selection_router, moe.layout, 0, moe.correction_bias)
        recv_hidden = x
        t1 = time.perf_counter()
        sorted_slots, offsets, inverse = arrays.sort_by_expert(local_ids, experts.num_local_experts)
        offsets_list = offsets.tolist()
        strategy = choose(
            "float",
            "cpu",
            [b - a for a, b in zip(offsets_list[:-1], offsets_list[1:])],
            dtype=x.dtype,
            onednn=onednn_linear_serves(x.dtype),
        )
        t2 = time.perf_counter()
        if strategy == "rows":  # the row kernels add into the sums as they go: gemm includes combine
            rows_expert_mlp(recv_hidden, recv_weights, local_ids, experts.w_gate_up, experts.w_down, experts.activation)
            permute, gemm, combine = t2 - t1, time.perf_counter() - t2, 0.0
        elif strategy == "loop":
            seconds = {}
            w_gate_up, w_down = experts.cpu_weights()
            streamed_expert_mlp(
                recv_hidden,
                sorted_slots,
                offsets_list,
                recv_weights,
                w_gate_up,
                w_down,
                experts.activation,
                stage_seconds=seconds,
            )
            t3 = time.perf_counter()
            permute = t2 - t1 + seconds["permute"]
            gemm = seconds["gemm"]
            combine = t3 - t2 - seconds["permute"] - seconds["gemm"]
        else:
            hidden_sorted, _, _ = arrays.permute(recv_hidden, local_ids, experts.num_local_experts)
            t3 = time.perf_counter()
            out = padded_expert_mlp(hidden_sorted, offsets_list, experts.w_gate_up, experts.w_down, experts.activation)
            t4 = time.perf_counter()
            arrays.combine(out, inverse, recv_weights)
            permute, gemm, combine = t3 - t1, t4 - t3, time.perf_counter() - t4
        total = wall_clock(lambda: moe(x))
        if r >= WARMUP:
            for name, value in zip(stages, (t1 - t0, permute, gemm, combine, total)):
                stages[name].append(value)
    medians = {name: statistics.median(values) * 1e3 for name, values in stages.items()}
    staged = sum(medians[name] for name in ("routing", "permute", "gemm", "combine"))
    medians["beyond_gemm_fraction"] = 1.0 - medians["gemm"] / staged
    return {f"{k}_ms" if k != "beyond_gemm_fraction" else k: v for k, v in medians.items()}


def grouped_expert_mlp(
    hidden_sorted: torch.Tensor,
    expert_offsets: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """`expert_mlp` through ``torch._grouped_mm`` (one call per projection): a comparison point
    of `gemm_strategies` only, never one of moeroute's strategies ("auto" has no use for it).

    Same parameters and result as `expert_mlp`, with ``expert_offsets`` a tensor
    [L + 1] (int32). Raises AttributeError on torch builds without ``torch._grouped_mm``;
    `gemm_strategies` checks its result against the torch.mm loop before timing it.
    """
    rows, hidden = hidden_sorted.shape
    inter = w_down.shape[2]
    if rows == 0:
        return hidden_sorted.new_empty((0, hidden))
    ends = expert_offsets[1:].to(torch.int32)
    gate_up = torch._grouped_mm(hidden_sorted, w_gate_up.transpose(-2, -1), offs=ends)
    act = gated_activation(gate_up[:, :inter], gate_up[:, inter:], activation)
    return torch._grouped_mm(act, w_down.transpose(-2, -1), offs=ends)


def gemm_strategies(moe, x, repeats):
    """Expert-GEMM strategies on the same expert-sorted rows, each interleaved with the plain
    per-expert torch.mm loop: the oneDNN loop, the padded torch.bmm batch, torch._grouped_mm."""
    experts = moe.experts
    logits = moe.compute_router_logits(x)
    weights, ids = arrays.select_experts(logits, moe._selection_router, None)
    hidden_sorted, offsets, _ = arrays.permute(x, ids, experts.num_local_experts)
    offsets_list = offsets.tolist()
    args = (experts.w_gate_up, experts.w_down, "silu")
    loop_mm = lambda: expert_mlp(hidden_sorted, offsets_list, *args, linear="mm")  # noqa: E731
    others = {
        "loop_onednn": lambda: expert_mlp(hidden_sorted, offsets_list, *args, linear="onednn"),
        "padded": lambda: padded_expert_mlp(hidden_sorted, offsets_list, *args),
        "grouped_mm": lambda: grouped_expert_mlp(hidden_sorted, offsets, *args),
    }
    if not onednn_linear_serves(x.dtype):
        del others["loop_onednn"]
    result = {
        "auto_choice": choose(
            "float",
            "cpu",
            [b - a for a, b in zip(offsets_list[:-1], offsets_list[1:])],
            dtype=x.dtype,
            onednn=onednn_linear_serves(x.dtype),
        ),
        "rows": len(hidden_sorted),
    }
    for name, fn in others.items():
        torch.testing.assert_close(fn(), loop_mm(), rtol=1e-4, atol=1e-5)
        timing = interleaved(loop_mm, fn, repeats)
        result[f"{name}_ms"] = timing["candidate_us"] / 1e3
        result[f"loop_mm_ms_vs_{name}"] = timing["baseline_us"] / 1e3
        result[f"{name}_speedup_over_loop_mm_median_of_ratios"] = timing["speedup"]
    return result


def decode_rows(repeats):
    """moeroute's MoE against hf_eager at decode sizes: every shape, dtype and T."""
    rows = []
    for name, hidden, inter, experts, top_k in DECODE_SHAPES:
        block32 = build_block(hidden, inter, experts, top_k)
        set_experts_implementation(block32, "eager")
        for dtype_name in DECODE_DTYPES:
            block = (
                block32
                if dtype_name == "float32"
                else build_block(hidden, inter, experts, top_k).to(getattr(torch, dtype_name))
            )
            set_experts_implementation(block, "eager")
            # Packed oneDNN weights where oneDNN serves the dtype, as the main table runs.
            moe = MoE.from_hf(block).pack_cpu_weights(onednn_linear_serves(block.gate.weight.dtype))
            for tokens in DECODE_TOKENS:
                x = torch.randn(1, tokens, hidden, generator=torch.Generator().manual_seed(tokens))
                x = x.to(block.gate.weight.dtype)
                with torch.inference_mode():
                    expected, actual = block(x), moe(x)
                    error = float((actual.float() - expected.float()).abs().max() / expected.float().abs().max())
                    if not error < DECODE_RTOL[dtype_name]:
                        raise AssertionError(f"{name} {dtype_name} T={tokens}: relative error {error}")
                    timing = interleaved(lambda: block(x), lambda: moe(x), repeats)
                    # The forward against its experts alone (same routed rows): what is left is
                    # the router linear, route and the glue around them.
                    flat = x.reshape(-1, hidden)
                    weights, ids = arrays.route(
                        moe.compute_router_logits(flat), moe._selection_router, moe.layout, 0, moe.correction_bias
                    )
                    split = interleaved(lambda: moe(x), lambda: moe.experts(flat, weights, ids), repeats)
                rows.append(
                    {
                        "shape": name,
                        "hidden": hidden,
                        "intermediate": inter,
                        "experts": experts,
                        "top_k": top_k,
                        "dtype": dtype_name,
                        "tokens": tokens,
                        "moeroute_ms": timing["candidate_us"] / 1e3,
                        "hf_eager_ms": timing["baseline_us"] / 1e3,
                        "speedup": timing["speedup"],
                        "speedup_range": timing["speedup_range"],
                        "repeats": repeats,
                        "relative_error": error,
                        "experts_ms": split["candidate_us"] / 1e3,
                        "beyond_experts_ms": (split["baseline_us"] - split["candidate_us"]) / 1e3,
                    }
                )
                row = rows[-1]
                print(
                    f"decode {name} {dtype_name} T={tokens}: moeroute {row['moeroute_ms']:.2f} ms "
                    f"({row['beyond_experts_ms']:.3f} ms outside the experts), "
                    f"hf eager {row['hf_eager_ms']:.2f} ms, x{row['speedup']:.2f}",
                    flush=True,
                )
            del moe, block
    print_table(
        ["shape", "dtype", "T", "moeroute ms", "outside experts ms", "hf eager ms", "speedup", "range"],
        [
            [
                r["shape"],
                r["dtype"],
                r["tokens"],
                r["moeroute_ms"],
                r["beyond_experts_ms"],
                r["hf_eager_ms"],
                r["speedup"],
                "{:.2f}-{:.2f}".format(*r["speedup_range"]),
            ]
            for r in rows
        ],
    )
    return rows


#: The row kernels against the streamed loop: token counts (mean rows per hit expert from
#: 1 to 64 on the Qwen3-MoE-like block of `HIDDEN`, `INTER`, `EXPERTS`, `TOP_K`) and repeats.
ROWS_TOKENS = (1, 8, 32, 64, 128, 256, 512)
ROWS_REPEATS = {1: 41, 8: 31, 32: 15, 64: 11, 128: 7, 256: 5, 512: 5}


def rows_crossover(quick: bool) -> list[dict]:
    """The experts body with gemm="rows" against gemm="loop" (oneDNN-packed weights where oneDNN
    serves the dtype), same routing, interleaved: where the row kernels stop paying
    (`moeroute.experts.choose.ROWS_MAX_MEAN_ROWS`)."""
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        moe = MoE.from_hf(build_block()).to(dtype)
        experts = moe.experts.pack_cpu_weights(onednn_linear_serves(dtype))
        for tokens in ROWS_TOKENS:
            x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)).to(dtype)
            with torch.inference_mode():
                weights, ids = arrays.select_experts(moe.compute_router_logits(x), moe._selection_router, None)
            counts = torch.bincount(ids.flatten().long(), minlength=EXPERTS)
            mean_rows = float(counts.sum() / (counts > 0).sum())
            loop_weights = experts.cpu_weights() if experts.pack_cpu else None
            args = (x, weights, ids, experts.w_gate_up, experts.w_down, "silu")
            loop = lambda: cpu_experts(*args, "loop", loop_weights=loop_weights)  # noqa: E731
            rows_fn = lambda: cpu_experts(*args, "rows")  # noqa: E731
            expected, got = loop().float(), rows_fn().float()
            error = float((expected - got).abs().max() / expected.abs().max())
            timing = interleaved(loop, rows_fn, 3 if quick else ROWS_REPEATS[tokens])
            rows.append(
                {
                    "dtype": str(dtype).removeprefix("torch."),
                    "tokens": tokens,
                    "mean_rows_per_hit_expert": mean_rows,
                    "loop_ms": timing["baseline_us"] / 1e3,
                    "rows_ms": timing["candidate_us"] / 1e3,
                    "speedup": timing["speedup"],
                    "speedup_range": timing["speedup_range"],
                    "relative_difference": error,
                    "load_average": os.getloadavg()[0],
                }
            )
            print(
                f"rows vs loop {rows[-1]['dtype']} T={tokens} ({mean_rows:.1f} rows/expert): "
                f"{rows[-1]['rows_ms']:.2f} ms vs {rows[-1]['loop_ms']:.2f} ms, x{timing['speedup']:.2f}",
                flush=True,
            )
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    parser.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    parser.add_argument("--decode-only", action="store_true", help="only the T = 1 and 8 table")
    parser.add_argument("--no-decode", action="store_true", help="skip the T = 1 and 8 table")
    parser.add_argument(
        "--rows-only",
        action="store_true",
        help="only the row kernels against the streamed loop (gemm 'rows' vs 'loop')",
    )
    args = parser.parse_args(argv)
    if args.rows_only:
        previous = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
        previous["rows_vs_loop"] = rows_crossover(args.quick)
        previous.pop("machine", None)
        print(f"wrote {write_results('layer', previous)}")
        return 0
    repeats = QUICK_REPEATS if args.quick else REPEATS
    if args.decode_only:
        args.tokens = []

    block = build_block()
    moe = MoE.from_hf(block).pack_cpu_weights()
    plain = MoE.from_hf(block)  # the same module without packed weights
    report = {
        "benchmark": "layer",
        "shape": {"hidden": HIDDEN, "intermediate": INTER, "experts": EXPERTS, "top_k": TOP_K, "dtype": "float32"},
        "note": "a shared 2-core machine: each size records the 1-minute load average before and after it ran",
        "results": {},
    }
    previous = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if set(map(str, args.tokens)) != set(map(str, TOKENS)):
        # A partial run (some --tokens) updates those sizes and keeps the others.
        report["results"] = previous.get("results", {})
    report["decode"] = previous.get("decode", [])
    report["rows_vs_loop"] = previous.get("rows_vs_loop", [])
    with torch.inference_mode():
        for tokens in args.tokens:
            count = repeats.get(tokens, 5)
            x = torch.randn(1, tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
            set_experts_implementation(block, "eager")
            torch.testing.assert_close(moe(x), block(x), rtol=1e-4, atol=1e-6)
            entry = {"load_average_before": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
            entry["vs_hf_eager"] = as_ms(interleaved(lambda: block(x), lambda: moe(x), count))
            entry["vs_hf_eager_plain_weights"] = as_ms(interleaved(lambda: block(x), lambda: plain(x), count))
            set_experts_implementation(block, "grouped_mm")
            torch.testing.assert_close(moe(x), block(x), rtol=1e-4, atol=1e-6)
            entry["vs_hf_grouped_mm"] = as_ms(interleaved(lambda: block(x), lambda: moe(x), count))
            flat = x.reshape(tokens, HIDDEN)
            entry["split"] = stage_split(moe, flat, count)
            entry["gemm_strategies"] = gemm_strategies(moe, flat, max(3, count // 2))
            entry["load_average_after"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
            report["results"][str(tokens)] = entry
            eager, grouped, split = entry["vs_hf_eager"], entry["vs_hf_grouped_mm"], entry["split"]
            unpacked = entry["vs_hf_eager_plain_weights"]
            print(
                f"T={tokens:5d}: moeroute {eager['moeroute_ms']:8.2f} ms | hf eager {eager['base_ms']:8.2f} ms "
                f"(x{eager['speedup_median_of_ratios']:.2f}) | hf grouped_mm {grouped['base_ms']:8.2f} ms "
                f"(x{grouped['speedup_median_of_ratios']:.2f}) | plain weights vs hf eager "
                f"x{unpacked['speedup_median_of_ratios']:.2f}"
            )
            print(
                f"         split: routing {split['routing_ms']:.2f} ms, permute {split['permute_ms']:.2f} ms, "
                f"gemm {split['gemm_ms']:.2f} ms, combine {split['combine_ms']:.2f} ms; beyond GEMM "
                f"{split['beyond_gemm_fraction'] * 100:.1f}%",
                flush=True,
            )
            g = entry["gemm_strategies"]
            parts = [
                f"{name} {g[f'{name}_ms']:.2f} ms (x{g[f'{name}_speedup_over_loop_mm_median_of_ratios']:.2f})"
                for name in ("loop_onednn", "padded", "grouped_mm")
                if f"{name}_ms" in g
            ]
            print(
                f"         GEMMs vs the torch.mm loop (auto picks {g['auto_choice']}): " + ", ".join(parts), flush=True
            )
    if not args.no_decode:
        report["decode"] = decode_rows(QUICK_DECODE_REPEATS if args.quick else DECODE_REPEATS)
    path = write_results("layer", report)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
