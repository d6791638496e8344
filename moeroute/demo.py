"""``moeroute demo``: real routing shapes, every shared-expert mode, checked against a dense reference.

Two layers with the routing of real presets (DeepSeek-V3: 256 experts, top-8, sigmoid,
correction bias, 8 groups / top-4 groups, rsf 2.5, one shared expert; Qwen3.5-MoE: 512
experts, top-10, softmax, one sigmoid-gated shared expert) at small hidden sizes run in
every shared-expert mode. Each output is compared with the dense reference
``sum_k w_k * expert_k(x) + g * shared(x)`` computed in float64 from the NumPy routing
definitions; the demo prints the plan, the per-expert load, timings and PASS/FAIL, and
exits nonzero when any check fails. CPU by default; CUDA when a GPU is present.

A last check runs the DeepSeek-V3 layer with FP8 experts (fp8_block, 128x128 blocks, the
shared expert fused as FP8 slots) against the plain-torch w8a8 definition of
`moeroute.quant.reference` (docs/quant.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

#: The presets the demo runs: real N / K / scoring / groups / rsf / shared expert.
DEMO_PRESETS = ("deepseek-v3", "qwen3.5-moe")
#: Every requested shared-expert mode.
DEMO_SHARED_MODES = ("auto", "runner", "overlap", "fused")
#: Normwise relative error allowed against the float64 reference (float32 layer).
FP32_RTOL = 1e-5
#: Weight scale of the random layer: keeps activations O(1) through SiLU.
WEIGHT_SCALE = 0.05
#: Router weights ~ N(0, 1/H): logits O(1), so sigmoid scores do not saturate and the
#: load spreads over the experts as in a trained router.
ROUTER_SCALE_POWER = -0.5
#: Hottest experts listed in the load summary.
LOAD_TOP = 3
#: The FP8 check: its preset, and the relative error allowed against the w8a8 reference
#: (float32 summation order; docs/quant.md's bound).
FP8_PRESET = "deepseek-v3"
FP8_RTOL = 2e-2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options, added to ``parser`` (``moeroute demo`` and ``python -m moeroute.demo``)."""
    parser.add_argument("--tokens", type=int, default=128, help="tokens per forward (default 128)")
    parser.add_argument("--hidden-size", type=int, default=256, help="H (default 256)")
    parser.add_argument("--intermediate-size", type=int, default=128, help="I (default 128)")
    parser.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA when a GPU is present, else CPU"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed forwards per mode (median)")
    parser.add_argument("--seed", type=int, default=0)


def _check_args(parser: argparse.ArgumentParser | None, args) -> None:
    for name in ("tokens", "hidden_size", "intermediate_size", "repeats"):
        if getattr(args, name) < 1:
            message = f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1"
            if parser is not None:
                parser.error(message)
            raise SystemExit(f"moeroute demo: {message}")


def _device(requested: str):
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        raise SystemExit("moeroute demo: --device cuda was requested but torch sees no CUDA GPU")
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


class _SharedMLP:
    """Builds the shared MLP (and gate) of a preset as plain torch modules."""

    @staticmethod
    def build(hidden, inter, gated, generator):
        import torch
        from torch import nn

        from moeroute.bindings.torch.mlp import GatedMLP

        mlp = GatedMLP(hidden, inter)
        gate = nn.Linear(hidden, 1, bias=False) if gated else None
        with torch.no_grad():
            for module in (mlp, gate):
                for p in module.parameters() if module is not None else ():
                    p.copy_(torch.randn(p.shape, generator=generator) * WEIGHT_SCALE)
        return mlp, gate


def _layer_weights(preset, hidden, inter, seed):
    import torch

    generator = torch.Generator().manual_seed(seed)
    n = preset.router.num_experts
    weights = {
        "router": torch.randn(n, hidden, generator=generator) * hidden**ROUTER_SCALE_POWER,
        "bias": torch.randn(n, generator=generator) * 0.1 if preset.has_correction_bias else None,
        "w_gate_up": torch.randn(n, 2 * inter, hidden, generator=generator) * WEIGHT_SCALE,
        "w_down": torch.randn(n, hidden, inter, generator=generator) * WEIGHT_SCALE,
    }
    shared_size = preset.num_shared_experts * inter
    if shared_size:
        weights["shared"], weights["gate"] = _SharedMLP.build(hidden, shared_size, preset.shared_gated, generator)
    else:
        weights["shared"], weights["gate"] = None, None
    return weights


def _reference(preset, weights, x, inter):
    """Dense float64 ``sum_k w_k * expert_k(x) + g * shared(x)`` with NumPy routing; also the ids.

    Runs single-threaded: it is hundreds of tiny float64 products, where torch's thread
    hand-off per op costs more than the op.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_single_thread(preset, weights, x, inter)
    finally:
        torch.set_num_threads(threads)


def _reference_single_thread(preset, weights, x, inter):
    import torch
    import torch.nn.functional as F

    from moeroute.routing import reference

    logits = F.linear(x.float().cpu(), weights["router"].float())
    bias = None if weights["bias"] is None else weights["bias"].numpy()
    topk_weights, topk_ids = reference.select_experts(logits.numpy(), preset.router, bias)
    x64 = x.double().cpu()
    out = torch.zeros_like(x64)
    ids = torch.from_numpy(topk_ids.astype("int64"))
    slot_weights = torch.from_numpy(topk_weights).double()
    w_gate_up, w_down = weights["w_gate_up"].double(), weights["w_down"].double()
    for e in torch.unique(ids).tolist():
        rows, slots = torch.nonzero(ids == e, as_tuple=True)
        h = x64[rows] @ w_gate_up[e].T
        y = (F.silu(h[:, :inter]) * h[:, inter:]) @ w_down[e].T
        out.index_add_(0, rows, slot_weights[rows, slots, None] * y)
    shared = weights["shared"]
    if shared is not None:
        s = F.silu(x64 @ shared.gate_proj.weight.double().T) * (x64 @ shared.up_proj.weight.double().T)
        s = s @ shared.down_proj.weight.double().T
        if weights["gate"] is not None:
            s = torch.sigmoid(x64 @ weights["gate"].weight.double().T) * s
        out += s
    return out, topk_ids


def _load_summary(topk_ids, num_experts) -> str:
    import numpy as np

    counts = np.bincount(topk_ids.reshape(-1), minlength=num_experts)
    hottest = np.argsort(-counts, kind="stable")[:LOAD_TOP]
    hot = ", ".join(f"#{int(e)}: {int(counts[e])}" for e in hottest)
    return (
        f"per-expert load (token slots): min {int(counts.min())}, mean {counts.mean():.1f}, "
        f"max {int(counts.max())}; idle experts {int((counts == 0).sum())}/{num_experts}; "
        f"hottest {hot}"
    )


def _build(preset, weights, hidden, inter, shared, device):
    import torch

    from moeroute.bindings.torch.moe import MoE

    module = MoE(
        preset.router,
        hidden,
        inter,
        shared_experts=weights["shared"],
        shared_expert_gate=weights["gate"],
        shared=shared,
        correction_bias=weights["bias"] is not None,
    )
    with torch.no_grad():
        module.router_weight.copy_(weights["router"])
        if weights["bias"] is not None:
            module.correction_bias.copy_(weights["bias"])
        module.load_routed_weights(weights["w_gate_up"], weights["w_down"])
    return module.to(device)


def main(argv=None) -> int:
    """Run the demo; returns 0 when every check passes, 1 otherwise."""
    parser = argparse.ArgumentParser(prog="moeroute demo", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    _check_args(parser, args)
    return run(args)


def run(args) -> int:
    """Run the demo with parsed arguments; returns 0 when every check passes, 1 otherwise."""
    _check_args(None, args)
    import torch

    from moeroute.config import get_preset

    device = _device(args.device)
    hidden, inter, tokens = args.hidden_size, args.intermediate_size, args.tokens
    steps = len(DEMO_PRESETS) * len(DEMO_SHARED_MODES) + 1  # + the FP8 check
    print(
        f"moeroute demo: {tokens} tokens, H={hidden}, I={inter}, float32, device {device}, "
        f"torch threads {torch.get_num_threads()}"
    )
    failures, step = 0, 0
    with torch.inference_mode():
        for layer_index, name in enumerate(DEMO_PRESETS):
            preset = get_preset(name)
            r = preset.router
            print(
                f"\n=== {name}: N={r.num_experts}, K={r.top_k}, {r.scoring}, groups "
                f"{r.num_expert_group}/top-{r.topk_group}, renormalize={r.renormalize}, "
                f"rsf={r.routed_scaling_factor}, correction bias={preset.has_correction_bias}, "
                f"S={preset.num_shared_experts}{' (gated)' if preset.shared_gated else ''}"
            )
            weights = _layer_weights(preset, hidden, inter, args.seed + layer_index)
            x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(args.seed + 100))
            expected, topk_ids = _reference(preset, weights, x, inter)
            print(_load_summary(topk_ids, r.num_experts))
            x_device = x.to(device)
            for shared in DEMO_SHARED_MODES:
                step += 1
                module = _build(preset, weights, hidden, inter, shared, device)
                print(f"\n[{step}/{steps}] {name}, shared={shared!r} -> plan:")
                print("  " + module.layout.describe().replace("\n", "\n  "))
                out = module(x_device)  # warm-up: compiles the kernels on first use
                times = []
                for _ in range(args.repeats):
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    start = time.perf_counter()
                    out = module(x_device)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    times.append(time.perf_counter() - start)
                error = float((out.double().cpu() - expected).abs().max() / expected.abs().max())
                passed = error < FP32_RTOL
                failures += not passed
                print(
                    f"  forward median {statistics.median(times) * 1e3:.2f} ms over {args.repeats}; "
                    f"max relative error {error:.2e} (< {FP32_RTOL:.0e}): {'PASS' if passed else 'FAIL'}"
                )
        step += 1
        failures += not _fp8_check(args, device, step, steps)
    print(f"\n{steps - failures}/{steps} checks passed")
    return 1 if failures else 0


def _fp8_check(args, device, step, steps) -> bool:
    """The DeepSeek-V3 layer with FP8 experts against `moeroute.quant.reference`; True when it passes."""
    import types

    import torch

    from moeroute.bindings.ep_run import quant_reference
    from moeroute.bindings.torch.moe import MoE
    from moeroute.config import get_preset
    from moeroute.quant import QuantConfig, quantize_experts

    preset = get_preset(FP8_PRESET)
    hidden, inter = args.hidden_size, args.intermediate_size
    weights = _layer_weights(preset, hidden, inter, args.seed)
    quant = QuantConfig("fp8_block")
    q = quantize_experts(weights["w_gate_up"], weights["w_down"], quant)
    module = MoE(
        preset.router,
        hidden,
        inter,
        shared_experts=weights["shared"],
        shared_expert_gate=weights["gate"],
        correction_bias=weights["bias"] is not None,
        quant=quant,
    )
    with torch.no_grad():
        module.router_weight.copy_(weights["router"])
        if weights["bias"] is not None:
            module.correction_bias.copy_(weights["bias"])
    module.load_routed_weights(q[0], q[2], gate_up_scale=q[1], down_scale=q[3])
    module = module.to(device)
    x = torch.randn(args.tokens, hidden, generator=torch.Generator().manual_seed(args.seed + 100))
    print(
        f"\n[{step}/{steps}] {FP8_PRESET} with FP8 experts ({quant.format}, blocks {quant.block_size}, "
        f"shared={module.layout.shared!r}): {q[0].numel() + q[2].numel()} one-byte weights"
    )
    start = time.perf_counter()
    out = module(x.to(device)).cpu()
    elapsed = time.perf_counter() - start
    settings = types.SimpleNamespace(quant=quant.format, dtype="float32", regime="router", intermediate=inter)
    expected = quant_reference(
        settings,
        preset,
        module.layout,
        dict(
            router=weights["router"],
            bias=weights["bias"],
            routed=(q[0], q[2], q[1], q[3]),
            shared=weights["shared"],
            gate=weights["gate"],
        ),
        x,
    )
    error = float((out - expected).abs().max() / expected.abs().max())
    passed = error < FP8_RTOL
    print(
        f"  forward {elapsed * 1e3:.2f} ms (first call); max relative error against the w8a8 reference "
        f"(moeroute.quant.reference) {error:.2e} (< {FP8_RTOL:.0e}): {'PASS' if passed else 'FAIL'}"
    )
    return passed


if __name__ == "__main__":
    sys.exit(main())
