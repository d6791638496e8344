"""moeroute's CPU parallelism next to torch: the options, each in a fresh process with torch.

Each option runs in its own process (a threading layer is chosen once per process), with
torch imported and ``torch.set_num_threads(--torch-threads)``:

* ``numba-omp`` (the default), ``numba-workqueue``, ``numba-tbb``: Numba's ``prange`` kernel on that
  threading layer (tbb only where the tbb package is installed);
* ``python-pool``: a pool of Python threads, each running the serial kernel with the GIL
  released on its share of the rows;
* ``control``: no moeroute call at all, torch's own routing in its place: the drift of the
  model's forward time between "before" and "after" that owes nothing to moeroute.

Per option: the forward of an unpatched transformers Qwen3-MoE model (median of
``--forwards``) before any moeroute call, then select_experts at T = 8192 for Qwen3.5 and
DeepSeek-V3 interleaved call by call with the torch-native formulation (bench/routing.py's
``torch_select``; median of per-pair ratios), then the model's forward again: after/before
should stay near 1 (moeroute leaves no threads competing with torch's).

    python bench/threads.py                      # every option available here
    python bench/threads.py --options numba-omp numba-workqueue
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from _common import median_time, print_table, write_results  # noqa: E402

OPTIONS = ("numba-omp", "numba-workqueue", "numba-tbb", "python-pool", "control")
PRESETS = ("qwen3.5-moe", "deepseek-v3")
TOKENS = 8192
#: The unpatched model timed before and after moeroute runs: "small", a causal LM whose
#: forward (~20 ms on 2 cores) is mostly torch GEMMs and attention, or "tiny", one layer at
#: T = 8 (~1-2 ms a forward), where any thread left competing with torch's shows most.
MODELS = {
    "small": (
        dict(
            vocab_size=1024,
            hidden_size=512,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=4,
            intermediate_size=1024,
            moe_intermediate_size=256,
            num_experts=16,
            num_experts_per_tok=4,
            max_position_embeddings=512,
        ),
        128,
    ),
    "tiny": (
        dict(
            vocab_size=1024,
            hidden_size=256,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=512,
            moe_intermediate_size=128,
            num_experts=8,
            num_experts_per_tok=2,
            max_position_embeddings=512,
        ),
        8,
    ),
}


def _option_env(option: str) -> dict:
    env = dict(os.environ)
    if option.startswith("numba-"):
        env["NUMBA_THREADING_LAYER"] = option.split("-", 1)[1]
    return env


def _python_pool_select(threads: int):
    """select_experts on a pool of Python threads running the serial kernel without the GIL."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    from numba import njit

    from moeroute.routing import select as sel

    @njit(nogil=True, cache=True, error_model="numpy")
    def rows_nogil(
        logits, table, bias, has_bias, sigmoid, groups, topk_group, top_k, renormalize, rsf, start, stop, out_w, out_ids
    ):
        sel._select_rows(
            logits,
            table,
            bias,
            has_bias,
            sigmoid,
            groups,
            topk_group,
            top_k,
            renormalize,
            rsf,
            start,
            stop,
            out_w,
            out_ids,
        )

    pool = ThreadPoolExecutor(max(1, threads - 1))

    def select(logits, config, bias):
        tokens = logits.shape[0]
        out_w = np.empty((tokens, config.top_k), np.float32)
        out_ids = np.empty((tokens, config.top_k), np.int32)
        args = (
            logits,
            sel._HALF_TO_FLOAT,
            sel._EMPTY_BIAS if bias is None else bias,
            bias is not None,
            config.scoring == "sigmoid",
            config.num_expert_group,
            config.topk_group,
            config.top_k,
            config.renormalize,
            np.float32(config.routed_scaling_factor),
        )
        bounds = [tokens * i // threads for i in range(threads + 1)]
        futures = [pool.submit(rows_nogil, *args, bounds[i], bounds[i + 1], out_w, out_ids) for i in range(1, threads)]
        rows_nogil(*args, bounds[0], bounds[1], out_w, out_ids)
        for future in futures:
            future.result()
        return out_w, out_ids

    return select


def child(option: str, torch_threads: int, forwards: int, repeats: int, model_name: str = "small") -> dict:
    import numpy as np
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from _common import interleaved
    from routing import torch_select

    torch.set_num_threads(torch_threads)
    torch.manual_seed(0)
    model_config, model_tokens = MODELS[model_name]
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**model_config)).eval()
    input_ids = torch.randint(0, model_config["vocab_size"], (1, model_tokens))

    def forward():
        with torch.inference_mode():
            model(input_ids)

    result = {
        "option": option,
        "model": model_name,
        "torch_threads": torch.get_num_threads(),
        "load_before": os.getloadavg()[0],
    }
    # As many untimed forwards first: torch's first calls (allocator, dispatch caches) would
    # otherwise inflate "before" alone.
    result["forward_before_ms"] = median_time(forward, forwards, warmup=forwards) * 1e3

    from moeroute.config import PRESETS as ALL_PRESETS
    from moeroute.routing.select import select_experts

    select = _python_pool_select(torch_threads) if option == "python-pool" else select_experts
    if option == "control":  # the same process and calls with torch's routing in moeroute's place

        def select(logits, config, bias):
            weights, ids = torch_select(
                torch.from_numpy(logits), config, None if bias is None else torch.from_numpy(bias)
            )
            return weights.numpy(), ids.numpy()

    rng = np.random.default_rng(0)
    for name in PRESETS:
        preset = ALL_PRESETS[name]
        config = preset.router
        logits = rng.standard_normal((TOKENS, config.num_experts)).astype(np.float32)
        bias = None
        if preset.has_correction_bias:
            bias = (0.1 * rng.standard_normal(config.num_experts)).astype(np.float32)
        logits_t = torch.from_numpy(logits)
        bias_t = None if bias is None else torch.from_numpy(bias)
        if option != "control":
            expected = select_experts(logits, config, bias)
            actual = select(logits, config, bias)
            if not (np.array_equal(actual[1], expected[1]) and np.array_equal(actual[0], expected[0])):
                raise AssertionError(f"{option}: {name} routing differs from select_experts")
        timing = interleaved(
            lambda: torch_select(logits_t, config, bias_t), lambda: select(logits, config, bias), repeats
        )
        result[name] = {
            "speedup": timing["speedup"],
            "moeroute_us": timing["candidate_us"],
            "torch_us": timing["baseline_us"],
            "moeroute_alone_us": median_time(lambda: select(logits, config, bias), repeats) * 1e6,
        }
    result["forward_after_ms"] = median_time(forward, forwards, warmup=0) * 1e3
    result["after_over_before"] = result["forward_after_ms"] / result["forward_before_ms"]
    import numba

    if option.startswith("numba-"):
        result["threading_layer"] = numba.threading_layer()
    result["load_after"] = os.getloadavg()[0]
    return result


def tbb_available() -> bool:
    try:
        from numba.np.ufunc import tbbpool  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--options", nargs="+", choices=OPTIONS, default=list(OPTIONS))
    parser.add_argument("--torch-threads", type=int, default=2)
    parser.add_argument("--forwards", type=int, default=15, help="model forwards per median")
    parser.add_argument("--repeats", type=int, default=30, help="interleaved pairs per figure")
    parser.add_argument("--rounds", type=int, default=1, help="run every option this many times")
    parser.add_argument(
        "--model",
        choices=tuple(MODELS),
        default="small",
        help="the unpatched model timed before and after (default small)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.torch_threads, args.forwards, args.repeats, args.model)))
        return 0
    options = [o for o in args.options if o != "numba-tbb" or tbb_available()]
    rows = []
    for round_ in range(args.rounds):
        for option in options:
            command = [
                sys.executable,
                __file__,
                "--child",
                option,
                "--torch-threads",
                str(args.torch_threads),
                "--forwards",
                str(args.forwards),
                "--repeats",
                str(args.repeats),
                "--model",
                args.model,
            ]
            done = subprocess.run(command, env=_option_env(option), capture_output=True, text=True)
            if done.returncode != 0:
                print(f"{option}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
                continue
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            row = rows[-1]
            print(
                f"round {round_ + 1} {option}: "
                + ", ".join(f"{name} x{row[name]['speedup']:.2f}" for name in PRESETS)
                + f", forward after/before {row['after_over_before']:.2f}",
                flush=True,
            )
    summary = []
    for option in options:
        mine = [r for r in rows if r["option"] == option]
        if not mine:
            continue
        line = [option, len(mine)]
        for name in PRESETS:
            speedups = [r[name]["speedup"] for r in mine]
            line += [
                statistics.median(speedups),
                f"{min(speedups):.2f}-{max(speedups):.2f}",
                statistics.median(r[name]["moeroute_us"] for r in mine) / 1e3,
            ]
        ratios = [r["after_over_before"] for r in mine]
        line += [statistics.median(ratios), f"{min(ratios):.2f}-{max(ratios):.2f}"]
        summary.append(line)
    print_table(
        ["option", "runs", "Qwen3.5 x", "range", "ms", "DeepSeek-V3 x", "range", "ms", "fwd after/before", "range"],
        summary,
    )
    path = write_results(
        "threads" if args.model == "small" else f"threads_{args.model}",
        {"tokens": TOKENS, "torch_threads": args.torch_threads, "model": args.model, "runs": rows},
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
