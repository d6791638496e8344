"""FP8 experts on the CPU: the FP8 MoE layer against the same layer in bfloat16.

Three shapes, each at T = 1, 8 and 512 tokens, bfloat16 activations:

* Qwen3-30B-A3B: H = 2048, I = 768, N = 128, K = 8;
* a DeepSeek-V3 expert shape: H = 7168, I = 2048, N = 16, K = 8;
* the gpt-oss-20b expert shape: H = 2880, I = 2880, N = 32, K = 4 (its sizes only: SiLU, no
  biases; H and I are not whole 128-column blocks, so the last block of each row is partial).

Both layers share the router weights (so the same experts are hit) and hold the same
weights: the bfloat16 layer the float values, the FP8 layer those quantized with
fp8_block 128x128. They run interleaved, call by call, in one process; the figure is the
median of the per-call time ratios (bf16 time / FP8 time). Also the FP8 layer's weight
bytes read per second (1 byte per weight of every hit expert) against the host copy
bandwidth (bytes read plus written by a large np.copyto), and the "rows"/"blocks" CPU
strategies against each other at T = 8 (at T = 512, "auto" takes blocks).

transformers' ``FP8Experts`` does not run on a CPU (its linear fetches a GPU kernel from
the kernels hub): the script says so instead of timing it.

``--w8a16``: instead, FP8 with unquantized activations (``QuantConfig("fp8_block",
activation="none")``) against the w8a8 layer on the same bytes, interleaved the same way
(the figure is w8a8 time / w8a16 time), on the Qwen3-30B-A3B shape at T = 1 and 8, torch on
2 threads; JSON to bench/results/quant_w8a16.json.

``--int4``: INT4 (w4a16, symmetric, bfloat16 scales) against the bfloat16 layer on the same
float weights (the figure is bfloat16 time / INT4 time), on the Qwen3-30B-A3B shape with
groups of 128 (GPTQ's usual group) and the Kimi-K2 expert shape (H = 7168, I = 2048, N = 16,
K = 8) with Kimi-K2's groups of 32, T = 1, 8 and 512
(``--quick``: 1 and 8), bfloat16 activations, torch on 2 threads, interleaved; also the packed
bytes read per second against the copy bandwidth; JSON to bench/results/quant_int4.json.

``--kernels`` (a CPU with AVX512-BF16): FP8's two row-kernel families against each other, the
bfloat16-dot kernels and the widened ones, on the Qwen3-30B-A3B and DeepSeek-V3 expert shapes
with each hit expert given 1 to 6 rows, w8a8 and w8a16, interleaved: where "auto" switches
between them (`FP8_WIDENED_MAX_MEAN_ROWS`); JSON to bench/results/quant_fp8_kernels.json.

``--shape NAME`` (repeatable): only those shapes (of `INT4_SHAPES` with ``--int4``). The JSON records the instruction-set path
the kernels took (``moeroute.cpu_isa()``, see `MOEROUTE_CPU_ISA`), so a run under
``MOEROUTE_CPU_ISA=avx2`` reports the AVX2 path's share of the copy bandwidth, and writes beside
the CPU's own run (quant_avx2.json, quant_int4_avx2.json); hold torch to AVX2 as well
(``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2``) for the bfloat16 layer of such a CPU.

JSON goes to bench/results/quant.json. Run:
``python bench/quant.py [--quick] [--shape NAME ...] [--w8a16] [--int4] [--kernels]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from _common import host_copy_bandwidth, interleaved, isa_suffix, print_table, write_results  # noqa: E402

from moeroute.bindings.torch import MoE  # noqa: E402
from moeroute.config import RouterConfig  # noqa: E402
from moeroute.quant import QuantConfig, quantize_experts, quantize_int4  # noqa: E402

SHAPES = {
    "qwen3_30b_a3b": dict(hidden=2048, inter=768, experts=128, top_k=8),
    "deepseek_v3_experts": dict(hidden=7168, inter=2048, experts=16, top_k=8),
    "gpt_oss_20b": dict(hidden=2880, inter=2880, experts=32, top_k=4),
}
TOKENS = (1, 8, 512)
QUANT = QuantConfig("fp8_block")
W8A16 = QuantConfig("fp8_block", activation="none")
#: The INT4 shapes: Qwen3-30B-A3B and Kimi-K2's experts (H = 7168, I = 2048, top-8; 16 of its
#: 384 experts held, as the DeepSeek-V3 shape does: a decode step reads at most 8 per row).
INT4_SHAPES = {
    "qwen3_30b_a3b": dict(SHAPES["qwen3_30b_a3b"], group=128),
    "kimi_k2_experts": dict(hidden=7168, inter=2048, experts=16, top_k=8, group=32),
}
#: Repeats per (shape, T): decode calls take milliseconds, prefill ones seconds.
REPEATS = {1: 15, 8: 15, 512: 2}
#: Experts quantized per step while building (bounds the float32 temporaries).
BUILD_STEP = 8


def build(shape, seed=0):
    h, inter, n, k = shape["hidden"], shape["inter"], shape["experts"], shape["top_k"]
    router = RouterConfig(n, k, "softmax", renormalize=True)
    generator = torch.Generator().manual_seed(seed)
    bf16 = MoE(router, h, inter, dtype=torch.bfloat16)
    fp8 = MoE(router, h, inter, quant=QUANT)
    router_weight = torch.randn(n, h, generator=generator) * 0.02
    with torch.no_grad():
        bf16.router_weight.copy_(router_weight)
        fp8.router_weight.copy_(router_weight)
        for first in range(0, n, BUILD_STEP):
            rows = slice(first, min(n, first + BUILD_STEP))
            count = rows.stop - rows.start
            w_gate_up = torch.randn(count, 2 * inter, h, generator=generator) * 0.02
            w_down = torch.randn(count, h, inter, generator=generator) * 0.02
            bf16.experts.w_gate_up[rows] = w_gate_up
            bf16.experts.w_down[rows] = w_down
            q_gu, s_gu, q_d, s_d = quantize_experts(w_gate_up, w_down, QUANT)
            fp8.experts.w_gate_up[rows] = q_gu
            fp8.experts.gate_up_scale[rows] = s_gu
            fp8.experts.w_down[rows] = q_d
            fp8.experts.down_scale[rows] = s_d
    return bf16, fp8


def hit_experts(module, x) -> int:
    from moeroute.bindings.torch import arrays

    _, ids = arrays.select_experts(module.compute_router_logits(x), module.router, None)
    return len(set(ids.reshape(-1).tolist()))


def run(quick: bool, shapes=None) -> dict:
    shapes = {name: SHAPES[name] for name in (shapes or SHAPES)}
    copy_gbs = host_copy_bandwidth()
    print(f"host copy bandwidth {copy_gbs:.1f} GB/s (read + write)")
    rows, results = [], {}
    for name, shape in shapes.items():
        bf16, fp8 = build(shape)
        per_expert_bytes = 3 * shape["hidden"] * shape["inter"]
        for tokens in TOKENS:
            if quick and tokens == 512:
                continue
            x = torch.randn(tokens, shape["hidden"], generator=torch.Generator().manual_seed(tokens)).bfloat16()
            with torch.no_grad():
                timing = interleaved(lambda: bf16(x), lambda: fp8(x), repeats=REPEATS[tokens], warmup=1)
            hit = hit_experts(fp8, x)
            fp8_gbs = hit * per_expert_bytes / (timing["candidate_us"] / 1e6) / 1e9
            entry = {
                "tokens": tokens,
                "bf16_ms": timing["baseline_us"] / 1e3,
                "fp8_ms": timing["candidate_us"] / 1e3,
                "speedup": timing["speedup"],
                "speedup_range": timing["speedup_range"],
                "repeats": timing["repeats"],
                "experts_hit": hit,
                "fp8_weight_gbs": fp8_gbs,
                "fp8_weight_share_of_copy_bandwidth": fp8_gbs / copy_gbs,
            }
            if tokens == 8:

                def with_strategy(strategy):
                    def call():
                        fp8.experts.strategy = strategy
                        return fp8(x)

                    return call

                with torch.no_grad():
                    split = interleaved(
                        with_strategy("blocks"), with_strategy("rows"), repeats=max(3, REPEATS[tokens] // 3), warmup=1
                    )
                fp8.experts.strategy = "auto"
                entry["rows_over_blocks_speedup"] = split["speedup"]
            results.setdefault(name, []).append(entry)
            rows.append(
                [
                    name,
                    tokens,
                    entry["bf16_ms"],
                    entry["fp8_ms"],
                    entry["speedup"],
                    fp8_gbs,
                    entry["fp8_weight_share_of_copy_bandwidth"],
                    entry.get("rows_over_blocks_speedup", float("nan")),
                ]
            )
            print_table(
                ["shape", "T", "bf16 ms", "fp8 ms", "bf16/fp8", "fp8 GB/s", "of copy", "blocks/rows"], rows[-1:]
            )
        del bf16, fp8
    print()
    print_table(["shape", "T", "bf16 ms", "fp8 ms", "bf16/fp8", "fp8 GB/s", "of copy", "blocks/rows"], rows)
    return {
        "host_copy_gbs": copy_gbs,
        "quant": repr(QUANT),
        "activation_dtype": "bfloat16",
        "shapes": shapes,
        "results": results,
        "transformers_fp8_experts": "not run: transformers' FP8Experts fetches a GPU kernel from the "
        "kernels hub and has no CPU path",
    }


def run_w8a16(repeats: int = 30) -> dict:
    """w8a8 against w8a16 over the same FP8 bytes, Qwen3-30B-A3B shape, T = 1 and 8."""
    torch.set_num_threads(2)
    shape = SHAPES["qwen3_30b_a3b"]
    _, w8a8 = build(shape)
    w8a16 = MoE(w8a8.router, shape["hidden"], shape["inter"], quant=W8A16)
    w8a16.load_state_dict(w8a8.state_dict())
    rows, results = [], []
    for tokens in (1, 8):
        x = torch.randn(tokens, shape["hidden"], generator=torch.Generator().manual_seed(tokens)).bfloat16()
        with torch.no_grad():
            timing = interleaved(lambda: w8a8(x), lambda: w8a16(x), repeats=repeats, warmup=3)
        entry = {
            "tokens": tokens,
            "w8a8_ms": timing["baseline_us"] / 1e3,
            "w8a16_ms": timing["candidate_us"] / 1e3,
            "w8a8_over_w8a16": timing["speedup"],
            "range": timing["speedup_range"],
            "repeats": timing["repeats"],
        }
        results.append(entry)
        rows.append(["qwen3_30b_a3b", tokens, entry["w8a8_ms"], entry["w8a16_ms"], entry["w8a8_over_w8a16"]])
    print_table(["shape", "T", "w8a8 ms", "w8a16 ms", "w8a8/w8a16"], rows)
    return {
        "quant": repr(QUANT),
        "w8a16": repr(W8A16),
        "activation_dtype": "bfloat16",
        "torch_threads": 2,
        "shape": shape,
        "results": results,
    }


#: Shapes of the FP8 kernel-family comparison: (name, H, I, hit experts).
KERNEL_SHAPES = (("qwen3_30b_a3b", 2048, 768, 32), ("deepseek_v3_experts", 7168, 2048, 8))
#: Rows per hit expert of that comparison (T = hit * rows / 8, top-8).
KERNEL_ROWS = (1, 2, 3, 4, 6)


def run_fp8_kernels(repeats: int = 15) -> dict:
    """FP8's two row-kernel families against each other where both run (a CPU with
    AVX512-BF16): the bfloat16-dot kernels (`choose.FP8_WIDENED_MAX_MEAN_ROWS` set to 0) and
    the widened ones (set to infinity), interleaved, "rows" strategy, bfloat16 activations,
    w8a8 and w8a16, each hit expert given the same number of rows (`KERNEL_ROWS`)."""
    from moeroute.experts import choose as experts_choose
    from moeroute.experts.cpu import fp8 as cpu_fp8
    from moeroute.experts.formats.fp8 import fp8_experts_forward

    if not cpu_fp8.BF16_DOT:
        raise SystemExit("--kernels compares FP8's bfloat16-dot kernels, which this CPU path does not run")
    torch.set_num_threads(2)
    bound = experts_choose.FP8_WIDENED_MAX_MEAN_ROWS
    generator = torch.Generator().manual_seed(0)
    rows, results = [], []
    try:
        for name, hidden, inter, hit in KERNEL_SHAPES:
            weights = quantize_experts(
                torch.randn(hit, 2 * inter, hidden, generator=generator) * 0.02,
                torch.randn(hit, hidden, inter, generator=generator) * 0.02,
                QUANT,
            )
            for per_expert in KERNEL_ROWS:
                tokens = hit * per_expert // 8
                ids = (torch.arange(tokens * 8) % hit).reshape(tokens, 8).int()
                slot_weights = torch.rand(tokens, 8, generator=generator)
                x = torch.randn(tokens, hidden, generator=generator).bfloat16()
                for quant in (QUANT, W8A16):

                    def family(limit, quant=quant, x=x, slot_weights=slot_weights, ids=ids):
                        def call():
                            experts_choose.FP8_WIDENED_MAX_MEAN_ROWS = limit
                            return fp8_experts_forward(x, slot_weights, ids, *weights, quant, strategy="rows")

                        return call

                    with torch.no_grad():
                        timing = interleaved(family(0.0), family(float("inf")), repeats=repeats, warmup=2)
                    entry = {
                        "shape": name,
                        "rows_per_expert": per_expert,
                        "tokens": tokens,
                        "activation": quant.activation,
                        "bf16_dot_ms": timing["baseline_us"] / 1e3,
                        "widened_ms": timing["candidate_us"] / 1e3,
                        "bf16_dot_over_widened": timing["speedup"],
                        "range": timing["speedup_range"],
                        "repeats": timing["repeats"],
                    }
                    results.append(entry)
                    rows.append(
                        [
                            name,
                            per_expert,
                            quant.activation,
                            entry["bf16_dot_ms"],
                            entry["widened_ms"],
                            entry["bf16_dot_over_widened"],
                        ]
                    )
                    print_table(
                        ["shape", "rows/expert", "activations", "dot ms", "widened ms", "dot/widened"], rows[-1:]
                    )
    finally:
        experts_choose.FP8_WIDENED_MAX_MEAN_ROWS = bound
    print()
    print_table(["shape", "rows/expert", "activations", "dot ms", "widened ms", "dot/widened"], rows)
    return {
        "bound": bound,
        "activation_dtype": "bfloat16",
        "torch_threads": 2,
        "shapes": {name: dict(hidden=h, inter=i, hit_experts=n, top_k=8) for name, h, i, n in KERNEL_SHAPES},
        "results": results,
    }


def build_int4(shape):
    """The bfloat16 layer and the INT4 layer on its weights (the shape's group, symmetric)."""
    bf16, _ = build(shape)
    group = shape["group"]
    int4 = MoE(bf16.router, shape["hidden"], shape["inter"], quant=QuantConfig("int4", group_size=group))
    with torch.no_grad():
        int4.router_weight.copy_(bf16.router_weight)
        for first in range(0, shape["experts"], BUILD_STEP):
            rows = slice(first, min(shape["experts"], first + BUILD_STEP))
            for name in ("gate_up", "down"):
                packed, scales = quantize_int4(getattr(bf16.experts, "w_" + name)[rows].float(), group_size=group)
                getattr(int4.experts, "w_" + name)[rows] = packed
                getattr(int4.experts, name + "_scale")[rows] = scales
    return bf16, int4


def run_int4(quick: bool, names=None, repeats: int = 30) -> dict:
    """The bfloat16 layer against INT4 (symmetric, each shape's group) on its weights,
    `INT4_SHAPES` (those of ``names`` when given), T = 1, 8 (and 512 unless ``quick``)."""
    torch.set_num_threads(2)
    copy_gbs = host_copy_bandwidth()
    print(f"host copy bandwidth {copy_gbs:.1f} GB/s (read + write)")
    rows, results = [], {}
    for name, shape in INT4_SHAPES.items():
        if names and name not in names:
            continue
        bf16, int4 = build_int4(shape)
        # half a byte per weight and a bfloat16 scale per group
        per_expert_bytes = 3 * shape["hidden"] * shape["inter"] * (0.5 + 2 / shape["group"])
        for tokens in TOKENS:
            if quick and tokens == 512:
                continue
            x = torch.randn(tokens, shape["hidden"], generator=torch.Generator().manual_seed(tokens)).bfloat16()
            with torch.no_grad():
                timing = interleaved(
                    lambda: bf16(x), lambda: int4(x), repeats=repeats if tokens < 512 else REPEATS[512], warmup=2
                )
            int4_gbs = hit_experts(int4, x) * per_expert_bytes / (timing["candidate_us"] / 1e6) / 1e9
            entry = {
                "tokens": tokens,
                "bfloat16_ms": timing["baseline_us"] / 1e3,
                "int4_ms": timing["candidate_us"] / 1e3,
                "bfloat16_over_int4": timing["speedup"],
                "range": timing["speedup_range"],
                "repeats": timing["repeats"],
                "int4_weight_gbs": int4_gbs,
                "int4_weight_share_of_copy_bandwidth": int4_gbs / copy_gbs,
            }
            results.setdefault(name, []).append(entry)
            rows.append(
                [
                    name,
                    tokens,
                    entry["bfloat16_ms"],
                    entry["int4_ms"],
                    entry["bfloat16_over_int4"],
                    int4_gbs,
                    int4_gbs / copy_gbs,
                ]
            )
            print_table(["shape", "T", "bf16 ms", "int4 ms", "bf16/int4", "int4 GB/s", "of copy"], rows[-1:])
    print_table(["shape", "T", "bf16 ms", "int4 ms", "bf16/int4", "int4 GB/s", "of copy"], rows)
    return {
        "int4": "symmetric, bfloat16 scales, groups of "
        + ", ".join(f"{shape['group']} ({name})" for name, shape in INT4_SHAPES.items()),
        "activation_dtype": "bfloat16",
        "torch_threads": 2,
        "host_copy_gbs": copy_gbs,
        "shapes": INT4_SHAPES,
        "results": results,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="decode sizes only (T = 1, 8)")
    parser.add_argument("--w8a16", action="store_true", help="w8a16 against w8a8 (Qwen3-30B-A3B, T = 1, 8)")
    parser.add_argument("--int4", action="store_true", help="INT4 w4a16 against bfloat16 (Qwen3-30B-A3B, Kimi-K2)")
    parser.add_argument(
        "--kernels", action="store_true", help="FP8's bfloat16-dot against its widened row kernels (AVX512-BF16)"
    )
    parser.add_argument(
        "--shape", action="append", choices=sorted({*SHAPES, *INT4_SHAPES}), help="only this shape (repeatable)"
    )
    args = parser.parse_args(argv)
    if args.int4:
        path = write_results("quant_int4" + isa_suffix(), run_int4(args.quick, args.shape))
        print(f"wrote {path}")
        return
    if args.kernels:
        path = write_results("quant_fp8_kernels" + isa_suffix(), run_fp8_kernels())
        print(f"wrote {path}")
        return
    if args.w8a16:
        path = write_results("quant_w8a16" + isa_suffix(), run_w8a16())
        print(f"wrote {path}")
        return
    path = write_results("quant" + isa_suffix(), run(args.quick, args.shape))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
