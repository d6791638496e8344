"""align_block_size on the CPU: moeroute's Numba counting sort against a torch implementation.

The baseline is what an engine without a custom kernel writes: a stable ``torch.argsort``
of the expert ids, ``torch.bincount`` for the counts and index arithmetic for the padding.
Both run on the same inputs in one process, interleaved call by call; the figure is the
median of the per-pair time ratios (robust to the machine's other load). Both outputs are
checked against each other before timing.

    python bench/align.py            # table + bench/results/align.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from _common import interleaved, print_table, write_results  # noqa: E402

from moeroute.routing.align import align_block_size  # noqa: E402

#: (num_tokens, top_k, num_experts, block_size) of the table: decode, prefill, DeepSeek-V3,
#: Qwen3-Next with 8 per-rank shared slots (520 experts).
TABLE = [
    (64, 8, 256, 64),
    (1024, 8, 256, 64),
    (8192, 8, 256, 64),
    (8192, 10, 520, 128),
    (32768, 8, 256, 64),
]


def torch_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_size: int):
    """docs/semantics.md section 4 with torch ops on the ids' device: stable argsort + bincount + padding."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    numel = flat.numel()
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))  # dropped ids sort last
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    padded = (counts + block_size - 1) // block_size * block_size
    padded_starts = torch.cumsum(padded, 0) - padded
    starts = torch.cumsum(counts, 0) - counts
    kept = int(counts.sum())
    entries = order[:kept]
    experts = key[entries]
    positions = padded_starts[experts] + torch.arange(kept, device=device) - starts[experts]
    capacity = -(-(numel + num_experts * (block_size - 1)) // block_size) * block_size
    sorted_token_ids = torch.full((capacity,), numel, dtype=torch.int32, device=device)
    sorted_token_ids[positions] = entries.int()
    total = int(padded.sum())
    expert_ids = torch.full((capacity // block_size,), -1, dtype=torch.int32, device=device)
    expert_ids[: total // block_size] = torch.repeat_interleave(
        torch.arange(num_experts, dtype=torch.int32, device=device), padded // block_size
    )
    return sorted_token_ids, expert_ids, total


def routed_ids(num_tokens: int, top_k: int, num_experts: int, seed: int) -> np.ndarray:
    """top_k distinct experts per token, skewed towards low ids like a real router."""
    rng = np.random.default_rng(seed)
    popularity = 1.0 / (np.arange(num_experts) + 1.0) ** 0.5
    keys = rng.random((num_tokens, num_experts)) ** (1.0 / popularity)  # weighted sampling
    return np.argsort(-keys, axis=1)[:, :top_k].astype(np.int32)


def run_align(num_tokens=8192, top_k=8, num_experts=256, block_size=64, repeats=50, seed=0, torch_threads=1):
    """Time moeroute's CPU align_block_size against the torch baseline.

    ``torch_threads`` (default 1) sets torch's intra-op threads for the run: both sides
    single-threaded, and the baseline is spared thread-pool oversubscription on a shared
    machine (with 2 threads under load it was 5x slower still). None keeps torch's setting.

    Returns
    -------
    dict
        Inputs, median microseconds of each implementation, ``speedup`` (median over
        interleaved pairs of torch_time / moeroute_time), repeats, torch thread count.
    """
    previous_threads = torch.get_num_threads()
    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
    try:
        return _run_align(num_tokens, top_k, num_experts, block_size, repeats, seed)
    finally:
        torch.set_num_threads(previous_threads)


def _run_align(num_tokens, top_k, num_experts, block_size, repeats, seed):
    ids = routed_ids(num_tokens, top_k, num_experts, seed)
    ids_tensor = torch.from_numpy(ids)
    ours = align_block_size(ids, num_experts, block_size)
    theirs = torch_align_block_size(ids_tensor, num_experts, block_size)
    if not (
        np.array_equal(ours[0], theirs[0].numpy())
        and np.array_equal(ours[1], theirs[1].numpy())
        and ours[2] == theirs[2]
    ):
        raise AssertionError("moeroute and torch align_block_size disagree")
    timing = interleaved(
        lambda: torch_align_block_size(ids_tensor, num_experts, block_size),
        lambda: align_block_size(ids, num_experts, block_size),
        repeats,
    )
    return {
        "op": "align_block_size",
        "num_tokens": num_tokens,
        "top_k": top_k,
        "num_experts": num_experts,
        "block_size": block_size,
        "moeroute_us": timing["candidate_us"],
        "torch_us": timing["baseline_us"],
        "speedup": timing["speedup"],
        "repeats": repeats,
        "torch_threads": torch.get_num_threads(),
        "baseline": "torch.argsort(stable) + bincount + padding",
    }


def main() -> None:
    rows = [run_align(*config) for config in TABLE]
    print_table(
        ["tokens", "top_k", "experts", "B", "moeroute us", "torch us", "speedup"],
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
            for r in rows
        ],
    )
    print(f"wrote {write_results('align', {'results': rows})}")


if __name__ == "__main__":
    main()
