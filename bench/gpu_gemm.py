"""Expert GEMMs on a GPU: moeroute's grouped kernels against torch, bfloat16.

Every expert of a rank gets exactly m (token, slot) rows (tokens per expert), for the
DeepSeek-V3 (H=7168, I=2048) and Qwen3-30B-A3B (H=2048, I=768) expert shapes. Implementations:

    moeroute_gemm           the two grouped GEMMs (gate_up + fused SiLU-and-mul, down), rows read
                            through sorted_token_ids; the path the launcher picks (mma on sm_80+)
    moeroute_gemm_simt      the same with the SIMT kernels (the fallback path)
    moeroute_gemm_sm80_tiles  on sm_90+ only: the mma path with the sm_80 tile table
                            (launch.MMA_TILES) instead of the Hopper one (MMA_TILES_SM90), so
                            speedup_vs_sm80_tiles measures the Hopper configuration
    moeroute_fused_experts  the public call: align + both GEMMs + the top-k sum
    torch_loop              per expert: x_e @ w_gate_up[e].T, silu(gate) * up, @ w_down[e].T, on
                            rows already gathered per expert (no gather, no weights, no sum)
    torch_grouped_mm        the same with torch._grouped_mm, where torch has it
    cublas_dense            one torch.mm pair over all E*m rows with a single expert's weights:
                            the same FLOPs at cuBLAS's dense rate (a ceiling, not a MoE layer)

TFLOP/s count 6 * E * m * I * H (both GEMMs). Each sample times `inner` back-to-back calls
between CUDA events after warm-up; implementations are interleaved sample by sample and the
ratios are medians of per-sample ratios. Results are checked against torch_loop before timing.

    python bench/gpu_gemm.py [--repeats 20]     # table + bench/results/gpu_gemm.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import calls_per_sample, cuda_events, median_ratio, print_table, rotated  # noqa: E402

from moeroute.gpu import fused_experts, loader  # noqa: E402
from moeroute.gpu import launch as L  # noqa: E402
from moeroute.gpu.gemm import CupyBackend, _torch_as_cupy, check_fused_experts_args  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "gpu_gemm.json"
MODELS = {"deepseek-v3": (7168, 2048), "qwen3-30b-a3b": (2048, 768)}
TOKENS_PER_EXPERT = (1, 16, 256, 4096)
NUM_EXPERTS = 8  # local experts of one rank (e.g. 256 experts on 32 ranks)
SAMPLE_MS = 2.0  # each timed sample runs enough calls to last about this long
CHECK_TOLERANCE = 2e-2  # relative Frobenius difference from torch_loop (bf16 rounding of the intermediate)
TARGET_FRACTION_OF_DENSE = 0.5  # at 4096 tokens per expert
TARGET_SPEEDUP_VS_LOOP = 1.5  # at 16 tokens per expert
DTYPE = torch.bfloat16


def build_case(hidden_size, intermediate_size, tokens_per_expert, num_experts, seed=0):
    """Token t uses every expert: topk_ids[t, k] = k, so each expert gets exactly m rows."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    T, E, H, I = tokens_per_expert, num_experts, hidden_size, intermediate_size
    x = torch.randn(T, H, device="cuda", generator=g).to(DTYPE)
    w_gate_up = (torch.randn(E, 2 * I, H, device="cuda", generator=g) / H**0.5).to(DTYPE)
    w_down = (torch.randn(E, H, I, device="cuda", generator=g) / I**0.5).to(DTYPE)
    topk_ids = torch.arange(E, device="cuda", dtype=torch.int32).repeat(T, 1).contiguous()
    topk_weights = torch.ones(T, E, device="cuda", dtype=torch.float32)
    return x, w_gate_up, w_down, topk_weights, topk_ids


def moeroute_gemm(x, w_gate_up, w_down, topk_weights, topk_ids, path=None, compute_capability=None):
    """A closure launching the two GEMM kernels (align and buffers prepared once), and the
    per-slot output [T*K, H] it writes. ``compute_capability`` picks the mma tile table
    (default: the device's)."""
    import cupy

    problem = check_fused_experts_args(x, w_gate_up, w_down, topk_weights, topk_ids, apply_router_weight=False)
    T, H, I, E, K = (
        problem.num_tokens,
        problem.hidden_size,
        problem.intermediate_size,
        problem.num_experts,
        problem.top_k,
    )

    def allocate(shape, dtype):
        return _torch_as_cupy(torch.empty(shape, dtype=getattr(torch, dtype), device="cuda"))

    backend = CupyBackend(allocate)
    block_size = L.choose_block_size(T * K, E)
    sorted_ids, expert_ids = backend.align_block_size(_torch_as_cupy(topk_ids), E, block_size)
    intermediate = torch.empty(T * K, I, dtype=DTYPE, device="cuda")
    expert_out = torch.empty(T * K, H, dtype=DTYPE, device="cuda")
    a, b13, b2, inter, out = (_torch_as_cupy(v) for v in (x, w_gate_up, w_down, intermediate, expert_out))
    if path is None:
        pointers = [int(v.data.ptr) for v in (a, b13, b2, inter)]
        eligible = L.mma_eligible(problem.dtype, backend.compute_capability, backend.is_hip, H, I, pointers)
        path = "mma" if eligible else "simt"
    if compute_capability is None:
        compute_capability = backend.compute_capability
    common = dict(
        path=path,
        dtype=problem.dtype,
        block_size=block_size,
        sorted_token_ids=sorted_ids,
        compute_capability=compute_capability,
        expert_ids=expert_ids,
        topk_weights=_torch_as_cupy(topk_weights).reshape(-1),
        numel=T * K,
    )
    plans = [
        L.plan_expert_gemm(gated=True, a=a, b=b13, c=inter, top_k=K, n=I, k=H, **common),
        L.plan_expert_gemm(gated=False, a=inter, b=b2, c=out, top_k=1, n=H, k=I, **common),
    ]
    kernels = [loader.get_kernel(L.KERNEL_FILE, p.name, p.shared_memory) for p in plans]
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)

    def run():
        with stream:
            for kernel, plan in zip(kernels, plans):
                kernel(plan.grid, plan.block, plan.args, shared_mem=plan.shared_memory)

    return run, expert_out, path


def torch_baselines(x, w_gate_up, w_down, num_experts):
    """Closures for the torch implementations on rows gathered per expert, and their outputs."""
    T, H = x.shape
    I = w_down.shape[2]
    x_sorted = x.repeat(num_experts, 1)  # expert e owns rows e*T .. (e+1)*T - 1
    outputs = {}

    def loop():
        ys = []
        for e in range(num_experts):
            h = x_sorted[e * T : (e + 1) * T] @ w_gate_up[e].T
            ys.append((F.silu(h[:, :I]) * h[:, I:]) @ w_down[e].T)
        outputs["torch_loop"] = ys
        return ys

    runs = {"torch_loop": loop}
    grouped_mm = getattr(torch, "_grouped_mm", None)
    if grouped_mm is not None:
        offsets = torch.arange(1, num_experts + 1, device="cuda", dtype=torch.int32) * T
        w13_t, w2_t = w_gate_up.transpose(1, 2), w_down.transpose(1, 2)

        def grouped():
            h = grouped_mm(x_sorted, w13_t, offs=offsets)
            y = grouped_mm((F.silu(h[:, :I]) * h[:, I:]).contiguous(), w2_t, offs=offsets)
            outputs["torch_grouped_mm"] = y
            return y

        try:
            grouped()
            runs["torch_grouped_mm"] = grouped
        except RuntimeError as error:  # layouts or dtypes this torch build's grouped GEMM refuses
            print(f"torch._grouped_mm skipped: {error}".splitlines()[0])

    dense_gate_up, dense_down = w_gate_up[0].T, w_down[0].T

    def dense():
        h = torch.mm(x_sorted, dense_gate_up)
        return torch.mm(F.silu(h[:, :I]) * h[:, I:], dense_down)

    runs["cublas_dense"] = dense
    return runs, outputs


def relative_difference(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def time_calls(fn, inner):
    """Device ms per call of ``fn``, from ``inner`` back-to-back calls between CUDA events."""
    return cuda_events(torch)(calls_per_sample(fn, inner)) * 1e3 / inner


def bench_case(model, hidden_size, intermediate_size, tokens_per_expert, num_experts, repeats, warmup, with_simt=True):
    x, w_gate_up, w_down, topk_weights, topk_ids = build_case(
        hidden_size, intermediate_size, tokens_per_expert, num_experts
    )
    runs, torch_outputs = torch_baselines(x, w_gate_up, w_down, num_experts)
    ours, expert_out, path = moeroute_gemm(x, w_gate_up, w_down, topk_weights, topk_ids)
    implementations = {"moeroute_gemm": ours}
    if with_simt and path != "simt":
        implementations["moeroute_gemm_simt"], simt_out, _ = moeroute_gemm(
            x, w_gate_up, w_down, topk_weights, topk_ids, path="simt"
        )
    sm80_tiles = path == "mma" and loader.compute_capability() >= L.HOPPER_COMPUTE_CAPABILITY
    if sm80_tiles:
        implementations["moeroute_gemm_sm80_tiles"], sm80_out, _ = moeroute_gemm(
            x, w_gate_up, w_down, topk_weights, topk_ids, path="mma", compute_capability=L.MMA_MIN_COMPUTE_CAPABILITY
        )
    implementations["moeroute_fused_experts"] = lambda: fused_experts(
        x, w_gate_up, w_down, topk_weights, topk_ids, apply_router_weight=False
    )
    implementations.update(runs)

    # Correctness before timing: per-slot outputs against the torch loop.
    for fn in implementations.values():
        fn()
    torch.cuda.synchronize()
    loop_out = torch.stack(torch_outputs["torch_loop"])  # [E, T, H]
    per_slot = expert_out.view(tokens_per_expert, num_experts, hidden_size).transpose(0, 1)
    checks = {"moeroute_gemm": relative_difference(per_slot, loop_out)}
    if "moeroute_gemm_simt" in implementations:
        checks["moeroute_gemm_simt"] = relative_difference(
            simt_out.view(tokens_per_expert, num_experts, hidden_size).transpose(0, 1), loop_out
        )
    if sm80_tiles:
        checks["moeroute_gemm_sm80_tiles"] = relative_difference(
            sm80_out.view(tokens_per_expert, num_experts, hidden_size).transpose(0, 1), loop_out
        )
    if "torch_grouped_mm" in torch_outputs:
        checks["torch_grouped_mm"] = relative_difference(
            torch_outputs["torch_grouped_mm"], loop_out.reshape(-1, hidden_size)
        )
    fused = implementations["moeroute_fused_experts"]()
    checks["moeroute_fused_experts"] = relative_difference(fused, loop_out.sum(dim=0))
    failed = {k: v for k, v in checks.items() if not v < CHECK_TOLERANCE}
    if failed:
        raise AssertionError(f"{model} m={tokens_per_expert}: results differ from torch_loop: {failed}")

    inner = {}
    for name, fn in implementations.items():
        for _ in range(warmup):
            fn()
        estimate = time_calls(fn, 1)
        inner[name] = max(1, min(100, math.ceil(SAMPLE_MS / max(estimate, 1e-3))))
    names = list(implementations)
    batches = {name: calls_per_sample(implementations[name], inner[name]) for name in names}
    seconds = rotated(batches, repeats, warmup=0, timer=cuda_events(torch))
    samples = {name: [s * 1e3 / inner[name] for s in seconds[name]] for name in names}  # ms per call

    flops = 6.0 * num_experts * tokens_per_expert * intermediate_size * hidden_size
    rows = []
    for name in names:
        ms = statistics.median(samples[name])
        rows.append(
            {
                "model": model,
                "hidden_size": hidden_size,
                "intermediate_size": intermediate_size,
                "num_experts": num_experts,
                "tokens_per_expert": tokens_per_expert,
                "impl": name,
                "median_ms": ms,
                "tflops": flops / (ms * 1e-3) / 1e12,
                "calls_per_sample": inner[name],
                "max_rel_diff_vs_torch_loop": checks.get(name),
            }
        )

    def ratio(numerator, denominator):
        if numerator not in samples or denominator not in samples:
            return None
        return median_ratio(samples[numerator], samples[denominator])

    summary = {
        "model": model,
        "tokens_per_expert": tokens_per_expert,
        "gemm_path": path,
        "block_size": L.choose_block_size(tokens_per_expert * num_experts, num_experts),
        "speedup_vs_torch_loop": ratio("torch_loop", "moeroute_gemm"),
        "speedup_vs_torch_grouped_mm": ratio("torch_grouped_mm", "moeroute_gemm"),
        "speedup_vs_simt": ratio("moeroute_gemm_simt", "moeroute_gemm"),
        "mma_tiles": "sm90" if sm80_tiles else "sm80",
        "speedup_vs_sm80_tiles": ratio("moeroute_gemm_sm80_tiles", "moeroute_gemm"),
        "fraction_of_dense_cublas": ratio("cublas_dense", "moeroute_gemm"),
    }
    return rows, summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="interleaved samples per implementation")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--tokens-per-expert", default=",".join(map(str, TOKENS_PER_EXPERT)))
    parser.add_argument("--experts", type=int, default=NUM_EXPERTS)
    parser.add_argument("--no-simt", action="store_true", help="skip the SIMT comparison")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 2

    rows, summaries = [], []
    for model in args.models.split(","):
        H, I = MODELS[model]
        for m in (int(v) for v in args.tokens_per_expert.split(",")):
            case_rows, summary = bench_case(
                model, H, I, m, args.experts, args.repeats, args.warmup, with_simt=not args.no_simt
            )
            rows += case_rows
            summaries.append(summary)
            print_table(
                ["model", "m", "path", "impl", "median ms", "TFLOP/s"],
                [[model, m, summary["gemm_path"], r["impl"], r["median_ms"], r["tflops"]] for r in case_rows],
            )
            print(
                f"vs torch loop x{summary['speedup_vs_torch_loop']:.2f}, of dense cuBLAS "
                f"{summary['fraction_of_dense_cublas']:.2f}",
                flush=True,
            )

    targets = []
    for s in summaries:
        if s["tokens_per_expert"] == 4096:
            targets.append(
                {
                    "model": s["model"],
                    "target": f">= {TARGET_FRACTION_OF_DENSE:.0%} of dense cuBLAS bf16 "
                    "TFLOP/s at 4096 tokens per expert",
                    "value": s["fraction_of_dense_cublas"],
                    "met": s["fraction_of_dense_cublas"] >= TARGET_FRACTION_OF_DENSE,
                }
            )
        if s["tokens_per_expert"] == 16:
            targets.append(
                {
                    "model": s["model"],
                    "target": f">= {TARGET_SPEEDUP_VS_LOOP}x the per-expert torch loop at 16 tokens per expert",
                    "value": s["speedup_vs_torch_loop"],
                    "met": s["speedup_vs_torch_loop"] >= TARGET_SPEEDUP_VS_LOOP,
                }
            )
    import cupy

    machine = {
        "device": torch.cuda.get_device_name(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cupy": cupy.__version__,
        "compute_capability": loader.compute_capability(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "machine": machine,
                "dtype": "bfloat16",
                "repeats": args.repeats,
                "results": rows,
                "summary": summaries,
                "targets": targets,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
