"""INT4 routed experts (moe_gemm_int4.cu) and FP8 w8a16 experts (moe_gemm_fp8.cu's
moe_gemm_fp8w16_simt) on a GPU, against float64 references on the dequantized weights written
from the formats' definitions. Skipped without a CUDA device (bench/gpu_check.py runs these on a
GPU machine)."""

import pytest
import torch

from gpu_reference import cuda_device_available
from helpers.reference import dense_experts
from moeroute.gpu import fused_experts
from moeroute.gpu import gemm_int4 as G
from moeroute.quant import QuantConfig
from test_gpu_fp8_w8a16_host import dequantize_blocks
from test_gpu_int4_host import dequantize

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_device_available(), reason="no CUDA device (run bench/gpu_check.py on a GPU machine)"),
]

# max |kernel - reference| / max |reference| (test_gpu_int4_host.py gives the reasoning).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def _paths(dtype):
    paths = ["simt"]
    if dtype != torch.float32 and torch.cuda.get_device_capability() >= (8, 0):
        paths.append("mma")
    return paths


def _int4(rows, cols, group_size, symmetric, scale_dtype, g, E):
    packed = torch.randint(0, 256, (E, rows, cols // 2), generator=g, dtype=torch.uint8)
    scales = ((0.5 + torch.rand(E, rows, cols // group_size, generator=g)) / (8 * cols**0.5)).to(scale_dtype)
    zeros = None if symmetric else torch.randint(0, 16, (E, rows, cols // group_size), generator=g, dtype=torch.uint8)
    return (packed, scales) if symmetric else (packed, scales, zeros)


def _problem(group_size, symmetric, scale_dtype, T=96, H=384, I=256, E=8, K=2, seed=7):
    # 5% of the slots belong to other ranks.
    g = torch.Generator().manual_seed(seed)
    gate_up = _int4(2 * I, H, group_size, symmetric, scale_dtype, g, E)
    down = _int4(H, I, group_size, symmetric, scale_dtype, g, E)
    x = torch.randn(T, H, generator=g)
    topk_ids = torch.randint(0, E, (T, K), generator=g, dtype=torch.int32)
    topk_ids[torch.rand(T, K, generator=g) < 0.05] = -1
    topk_weights = torch.rand(T, K, generator=g)
    return x, topk_ids, topk_weights, gate_up, down


def _expected(x, topk_ids, topk_weights, gate_up, down, group_size):
    full = lambda w: dequantize(w[0], w[1], w[2] if len(w) == 3 else None, group_size)  # noqa: E731
    return dense_experts(x.double(), topk_weights, topk_ids, full(gate_up), full(down))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "group_size, symmetric, scale_dtype",
    [(32, True, torch.bfloat16), (128, False, torch.float32), (64, False, torch.float16)],
)
def test_int4_experts_on_device_match_reference(dtype, group_size, symmetric, scale_dtype):
    x, topk_ids, topk_weights, gate_up, down = _problem(group_size, symmetric, scale_dtype)
    x = x.to(dtype)
    expected = _expected(x, topk_ids, topk_weights, gate_up, down, group_size)
    cuda = lambda weight: tuple(t.cuda() for t in weight)  # noqa: E731
    for path in _paths(dtype):
        out = G.fused_experts_int4(
            x.cuda(),
            cuda(gate_up),
            cuda(down),
            topk_weights.cuda(),
            topk_ids.cuda(),
            group_size=group_size,
            path=path,
        )
        torch.cuda.synchronize()
        error = float((out.double().cpu() - expected).abs().max() / expected.abs().max())
        assert error <= TOLERANCE[dtype], f"{dtype} g={group_size} sym={symmetric} {path}: relative error {error:.3g}"


def test_int4_experts_forward_runs_cuda_tensors_on_the_kernels(monkeypatch):
    from moeroute.experts.formats import int4 as int4_experts

    launched = []
    original = G.run_int4_experts
    monkeypatch.setattr(G, "run_int4_experts", lambda *a, **k: launched.append(1) or original(*a, **k))
    x, topk_ids, topk_weights, gate_up, down = _problem(32, False, torch.bfloat16, T=16)
    x = x.to(torch.bfloat16)
    out = int4_experts.int4_experts_forward(
        hidden_states=x.cuda(),
        local_ids=topk_ids.cuda(),
        weights=topk_weights.cuda(),
        gate_up=tuple(t.cuda() for t in gate_up),
        down=tuple(t.cuda() for t in down),
        group_size=32,
    )
    expected = _expected(x, topk_ids, topk_weights, gate_up, down, 32)
    error = float((out.double().cpu() - expected).abs().max() / expected.abs().max())
    assert launched and error <= TOLERANCE[torch.bfloat16], error


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fp8_w8a16_experts_on_device_match_reference(dtype):
    from moeroute.gpu.gemm_fp8 import fused_experts_fp8
    from moeroute.quant.fp8 import quantize_experts

    g = torch.Generator().manual_seed(3)
    T, H, I, E, K = 64, 384, 192, 8, 2
    quant = QuantConfig("fp8_block", activation="none")
    q_gu, s_gu, q_d, s_d = quantize_experts(
        torch.randn(E, 2 * I, H, generator=g) / H**0.5, torch.randn(E, H, I, generator=g) / I**0.5, quant
    )
    x = torch.randn(T, H, generator=g).to(dtype)
    topk_ids = torch.randint(0, E, (T, K), generator=g, dtype=torch.int32)
    topk_weights = torch.rand(T, K, generator=g)
    expected = dense_experts(
        x.double(),
        topk_weights,
        topk_ids,
        dequantize_blocks(q_gu, s_gu, quant.block_size, 2),
        dequantize_blocks(q_d, s_d, quant.block_size, 1),
    )
    cuda = [t.cuda() for t in (x, q_gu, s_gu, q_d, s_d, topk_weights, topk_ids)]
    for path in _paths(dtype):
        out = fused_experts_fp8(*cuda, quant=quant, path=path)
        error = float((out.double().cpu() - expected).abs().max() / expected.abs().max())
        assert out.dtype == dtype and error <= TOLERANCE[dtype], f"{dtype} {path}: relative error {error:.3g}"
    # The front door takes it too (the launcher's own path choice).
    out = fused_experts(
        cuda[0], cuda[1], cuda[3], cuda[5], cuda[6], quant=quant, gate_up_scale=cuda[2], down_scale=cuda[4]
    )
    error = float((out.double().cpu() - expected).abs().max() / expected.abs().max())
    assert error <= TOLERANCE[dtype], f"{dtype} fused_experts: relative error {error:.3g}"


@pytest.mark.parametrize("symmetric", [True, False])
def test_moe_int4_on_cuda_reaches_the_kernels_and_matches_cpu(monkeypatch, symmetric):
    # MoE(quant=int4) moved to CUDA: the chooser takes the INT4 kernels (not "blocks"), and the
    # output equals the CPU module's (float32 on both sides, sums in another order).
    from moeroute.bindings.torch import MoE
    from moeroute.config import RouterConfig
    from moeroute.quant import quantize_int4

    launched = []
    original = G.run_int4_experts
    monkeypatch.setattr(G, "run_int4_experts", lambda *a, **k: launched.append(1) or original(*a, **k))
    H, I, N, K = 256, 128, 8, 2
    g = torch.Generator().manual_seed(5)
    quant = QuantConfig("int4", group_size=32, symmetric=symmetric)
    module = MoE(RouterConfig(N, K), H, I, quant=quant)
    module.load_routed_weights(
        quantize_int4(torch.randn(N, 2 * I, H, generator=g) / 16, group_size=32, symmetric=symmetric),
        quantize_int4(torch.randn(N, H, I, generator=g) / 11, group_size=32, symmetric=symmetric),
    )
    with torch.no_grad():
        module.router_weight.copy_(torch.randn(N, H, generator=g))
        x = torch.randn(33, H, generator=g)
        expected = module(x)
        out = module.to("cuda")(x.cuda())
    error = float((out.double().cpu() - expected.double()).abs().max() / expected.double().abs().max())
    assert launched and out.device.type == "cuda" and error <= 1e-4, error
