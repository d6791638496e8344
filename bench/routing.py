"""Routing on the CPU: moeroute's select_experts against the torch-native formulation.

The baseline is how transformers and vLLM route on a CPU: torch sigmoid/softmax, group
scores by ``topk``/``max`` over a [T, G, N/G] view, a group mask, ``masked_fill`` and
``topk`` (vLLM's ``grouped_topk``; ``fused_topk``'s softmax + topk without groups or bias).
Both run on the same float32 logits in one process that runs torch (torch on
``--torch-threads`` threads), interleaved call by call, as routing runs inside a model; the
figure is the median of the per-pair time ratios. moeroute's parallel kernel runs on Numba's
threads, as many as torch uses (moeroute/routing/_parallel.py). The achieved logits bandwidth
(logits bytes read per second) is set against the host copy bandwidth measured in the same run.
align_block_size against a torch argsort implementation comes from bench/align.py.

    python bench/routing.py                    # T = 8192, DeepSeek-V3 and Qwen3.5
    python bench/routing.py --tokens 2048 --all-presets
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from _common import host_copy_bandwidth, interleaved, print_table, write_results  # noqa: E402

from moeroute.config import PRESETS  # noqa: E402
from moeroute.routing.select import select_experts  # noqa: E402

DEFAULT_PRESETS = ["deepseek-v3", "qwen3.5-moe"]
# Routing with a bias or groups picks from the masked choices, as vLLM's grouped_topk does.
ALIGN_BLOCK_SIZE = 64  # DeepSeek-V3's fused-MoE block size in vLLM's tuned configs
TORCH_THREADS = 2  # the figures' setting: torch on the development machine's 2 cores


def torch_select(logits: torch.Tensor, config, bias: torch.Tensor | None):
    """docs/semantics.md section 1 with torch ops, as transformers/vLLM write it (grouped_topk/fused_topk)."""
    if config.scoring == "sigmoid":
        scores = logits.sigmoid()
    else:
        scores = torch.softmax(logits, dim=-1)
    if bias is None and config.num_expert_group == 1:
        weights, ids = torch.topk(scores, config.top_k, dim=-1)
    else:
        num_tokens = scores.shape[0]
        choice = scores if bias is None else scores + bias.unsqueeze(0)
        grouped = choice.view(num_tokens, config.num_expert_group, -1)
        if bias is not None:
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        group_ids = torch.topk(group_scores, k=config.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_ids, 1)
        score_mask = group_mask.unsqueeze(-1).expand(grouped.shape).reshape(num_tokens, -1)
        masked = choice.masked_fill(~score_mask.bool(), float("-inf"))
        ids = torch.topk(masked, k=config.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
    if config.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * config.routed_scaling_factor
    return weights.to(torch.float32), ids.to(torch.int32)


def agreement(ours, theirs) -> float:
    """Fraction of rows where both picked the same set of experts."""
    ours_ids = np.sort(ours[1], axis=1)
    their_ids = np.sort(theirs[1].numpy(), axis=1)
    return float((ours_ids == their_ids).all(axis=1).mean())


def run_select(preset_name: str, num_tokens: int, repeats: int, copy_gbps: float, seed=0):
    preset = PRESETS[preset_name]
    config = preset.router
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((num_tokens, config.num_experts)).astype(np.float32)
    bias = None
    if preset.has_correction_bias:
        bias = (0.1 * rng.standard_normal(config.num_experts)).astype(np.float32)
    logits_t = torch.from_numpy(logits)
    bias_t = None if bias is None else torch.from_numpy(bias)
    same = agreement(select_experts(logits, config, bias), torch_select(logits_t, config, bias_t))
    timing = interleaved(
        lambda: torch_select(logits_t, config, bias_t), lambda: select_experts(logits, config, bias), repeats
    )
    gbps = logits.nbytes / (timing["candidate_us"] * 1e-6) / 1e9
    return [
        {
            "op": "select_experts",
            "preset": preset_name,
            "num_tokens": num_tokens,
            "num_experts": config.num_experts,
            "top_k": config.top_k,
            "moeroute_us": timing["candidate_us"],
            "torch_us": timing["baseline_us"],
            "speedup": timing["speedup"],
            "speedup_range": timing["speedup_range"],
            "repeats": repeats,
            "logits_gbps": gbps,
            "fraction_of_copy_bandwidth": gbps / copy_gbps,
            "same_expert_sets": same,
            "baseline": "torch sigmoid/softmax + group topk/max + masked_fill + topk",
        }
    ]


def run_align_rows(num_tokens: int, repeats: int):
    """align_block_size vs torch argsort from bench/align.py (DeepSeek-V3 shapes)."""
    try:
        from align import run_align
    except ImportError as error:  # bench/align.py missing or broken: say so, keep routing
        print(f"align_block_size skipped: {error}")
        return []
    return [run_align(num_tokens, 8, 256, ALIGN_BLOCK_SIZE, repeats)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="T, tokens per call")
    parser.add_argument("--repeats", type=int, default=30, help="interleaved pairs per figure")
    parser.add_argument("--presets", nargs="+", default=DEFAULT_PRESETS, choices=sorted(PRESETS))
    parser.add_argument("--all-presets", action="store_true", help="every built-in preset")
    parser.add_argument("--no-align", action="store_true", help="skip align_block_size")
    parser.add_argument(
        "--torch-threads", type=int, default=TORCH_THREADS, help="torch.set_num_threads for the whole run"
    )
    args = parser.parse_args(argv)
    presets = list(PRESETS) if args.all_presets else args.presets
    torch.set_num_threads(args.torch_threads)

    copy_gbps = host_copy_bandwidth()
    print(f"host copy bandwidth: {copy_gbps:.1f} GB/s (read + write), torch threads {torch.get_num_threads()}")
    rows = [row for name in presets for row in run_select(name, args.tokens, args.repeats, copy_gbps)]
    print_table(
        ["preset", "T", "moeroute us", "torch us", "speedup", "range", "GB/s", "of copy", "same"],
        [
            [
                r["preset"],
                r["num_tokens"],
                r["moeroute_us"],
                r["torch_us"],
                r["speedup"],
                "{:.1f}-{:.1f}".format(*r["speedup_range"]),
                r["logits_gbps"],
                f"{100 * r['fraction_of_copy_bandwidth']:.0f}%",
                f"{100 * r['same_expert_sets']:.2f}%",
            ]
            for r in rows
        ],
    )
    align_rows = [] if args.no_align else run_align_rows(args.tokens, args.repeats)
    if align_rows:
        print_table(
            ["align T", "top_k", "experts", "B", "moeroute us", "torch us", "speedup"],
            [
                [
                    r["num_tokens"],
                    r["top_k"],
                    r["num_experts"],
                    r["block_size"],
                    r["moeroute_us"],
                    r["torch_us"],
                    r["speedup"],
                ]
                for r in align_rows
            ],
        )
    path = write_results(
        "routing", {"host_copy_gbps": copy_gbps, "select_experts": rows, "align_block_size": align_rows}
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
