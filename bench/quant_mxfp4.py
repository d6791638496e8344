"""MXFP4 experts on the CPU: the gpt-oss MXFP4 layer against the same layer in bfloat16.

The gpt-oss-20b expert shape (H = 2880, I = 2880, N = 32, K = 4, swigluoai, expert and
router biases) at T = 1, 8 and 512 tokens, bfloat16 activations. Both layers share the
router (so the same experts are hit) and hold the same weights: the MXFP4 layer the packed
bytes, the bfloat16 layer their dequantized values. They run interleaved, call by call, in
one process; the figure is the median of the per-call time ratios (bf16 time / MXFP4 time).
Also the MXFP4 layer's packed bytes read per second (3*H*I/2 + 3*H*I/32 per hit expert)
against the host copy bandwidth (bytes read plus written by a large np.copyto).

JSON goes to bench/results/quant_mxfp4.json. Run: ``python bench/quant_mxfp4.py [--quick]``.
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
from moeroute.quant import QuantConfig, dequantize_mxfp4, quantize_mxfp4  # noqa: E402

SHAPE = dict(hidden=2880, inter=2880, experts=32, top_k=4)  # gpt-oss-20b
TOKENS = (1, 8, 512)
QUANT = QuantConfig("mxfp4")
REPEATS = {1: 15, 8: 15, 512: 2}
#: Experts quantized per step while building (bounds the float temporaries).
BUILD_STEP = 4


def build(seed=0):
    h, inter, n, k = SHAPE["hidden"], SHAPE["inter"], SHAPE["experts"], SHAPE["top_k"]
    router = RouterConfig(n, k, "softmax", renormalize=True)
    options = dict(activation="swigluoai", expert_bias=True, router_bias=True)
    bf16 = MoE(router, h, inter, dtype=torch.bfloat16, **options)
    mxfp4 = MoE(router, h, inter, quant=QUANT, **options)
    generator = torch.Generator().manual_seed(seed)
    router_weight = torch.randn(n, h, generator=generator) * 0.02
    with torch.no_grad():
        for module in (bf16, mxfp4):
            module.router_weight.copy_(router_weight)
        for first in range(0, n, BUILD_STEP):
            rows = slice(first, min(n, first + BUILD_STEP))
            count = rows.stop - rows.start
            gate_up = quantize_mxfp4(torch.randn(count, 2 * inter, h, generator=generator) * 0.02)
            down = quantize_mxfp4(torch.randn(count, h, inter, generator=generator) * 0.02)
            bf16.experts.w_gate_up[rows] = dequantize_mxfp4(*gate_up)
            bf16.experts.w_down[rows] = dequantize_mxfp4(*down)
            mxfp4.experts.w_gate_up[rows], mxfp4.experts.gate_up_scale[rows] = gate_up
            mxfp4.experts.w_down[rows], mxfp4.experts.down_scale[rows] = down
    return bf16, mxfp4


def hit_experts(module, x) -> int:
    from moeroute.bindings.torch import arrays

    _, ids = arrays.select_experts(module.compute_router_logits(x), module.router, None)
    return len(set(ids.reshape(-1).tolist()))


def run(quick: bool) -> dict:
    copy_gbs = host_copy_bandwidth()
    print(f"host copy bandwidth {copy_gbs:.1f} GB/s (read + write)")
    bf16, mxfp4 = build()
    per_expert_bytes = QUANT.expert_bytes(SHAPE["hidden"], SHAPE["inter"])
    rows, results = [], []
    header = ["T", "bf16 ms", "mxfp4 ms", "bf16/mxfp4", "mxfp4 GB/s", "of copy"]
    for tokens in TOKENS:
        if quick and tokens == 512:
            continue
        x = torch.randn(tokens, SHAPE["hidden"], generator=torch.Generator().manual_seed(tokens)).bfloat16()
        with torch.no_grad():
            timing = interleaved(lambda: bf16(x), lambda: mxfp4(x), repeats=REPEATS[tokens], warmup=1)
        hit = hit_experts(mxfp4, x)
        gbs = hit * per_expert_bytes / (timing["candidate_us"] / 1e6) / 1e9
        entry = {
            "tokens": tokens,
            "bf16_ms": timing["baseline_us"] / 1e3,
            "mxfp4_ms": timing["candidate_us"] / 1e3,
            "speedup": timing["speedup"],
            "speedup_range": timing["speedup_range"],
            "repeats": timing["repeats"],
            "experts_hit": hit,
            "mxfp4_packed_gbs": gbs,
            "mxfp4_share_of_copy_bandwidth": gbs / copy_gbs,
        }
        results.append(entry)
        rows.append([tokens, entry["bf16_ms"], entry["mxfp4_ms"], entry["speedup"], gbs, gbs / copy_gbs])
        print_table(header, rows[-1:])
    print()
    print_table(header, rows)
    return {
        "host_copy_gbs": copy_gbs,
        "quant": repr(QUANT),
        "activation_dtype": "bfloat16",
        "shape": SHAPE,
        "results": results,
        "threads": torch.get_num_threads(),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="decode sizes only (T = 1, 8)")
    args = parser.parse_args(argv)
    path = write_results("quant_mxfp4" + isa_suffix(), run(args.quick))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
