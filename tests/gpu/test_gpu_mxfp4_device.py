"""MXFP4 routed experts (moe_gemm_mxfp4.cu) on a GPU against a float64 reference that decodes the
packed bytes from the format's definition. Skipped without a CUDA device (bench/gpu_check.py runs
these on a GPU machine)."""

import pytest
import torch

from gpu_reference import cuda_device_available
from helpers.reference import dense_experts, dequantize_mxfp4
from moeroute.gpu import fused_experts
from moeroute.gpu import gemm_mxfp4 as G
from moeroute.quant import QuantConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_device_available(), reason="no CUDA device (run bench/gpu_check.py on a GPU machine)"),
]

# max |kernel - reference| / max |reference| (see test_gpu_mxfp4_host.py for the reasoning).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _paths(dtype):
    paths = ["simt"]
    if dtype == torch.bfloat16 and cuda_device_available() and torch.cuda.get_device_capability() >= (8, 0):
        paths.append("mma")
    return paths


def _problem(T=96, H=288, I=160, E=8, K=2, seed=7):
    # H = 9 and I = 5 scale blocks: both GEMMs end on a half-full 64-wide k slice of the mma kernel;
    # 5% of the slots belong to other ranks.
    g = torch.Generator().manual_seed(seed)
    gate_up = (
        torch.randint(0, 256, (E, 2 * I, H // 32, 16), generator=g, dtype=torch.uint8),
        torch.randint(120, 124, (E, 2 * I, H // 32), generator=g, dtype=torch.uint8),
    )
    down = (
        torch.randint(0, 256, (E, H, I // 32, 16), generator=g, dtype=torch.uint8),
        torch.randint(119, 123, (E, H, I // 32), generator=g, dtype=torch.uint8),
    )
    x = torch.randn(T, H, generator=g)
    topk_ids = torch.randint(0, E, (T, K), generator=g, dtype=torch.int32)
    topk_ids[torch.rand(T, K, generator=g) < 0.05] = -1
    topk_weights = torch.rand(T, K, generator=g)
    bias = (torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g))
    return x, topk_ids, topk_weights, gate_up, down, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["swigluoai", "silu"])
def test_mxfp4_experts_on_device_match_reference(dtype, activation):
    x, topk_ids, topk_weights, gate_up, down, bias = _problem()
    x = x.to(dtype)
    expected = dense_experts(
        x.double(), topk_weights, topk_ids, dequantize_mxfp4(*gate_up), dequantize_mxfp4(*down), activation, *bias
    )
    cuda = lambda pair: tuple(t.cuda() for t in pair)  # noqa: E731
    for path in _paths(dtype):
        out = G.fused_experts_mxfp4(
            x.cuda(),
            cuda(gate_up),
            cuda(down),
            topk_weights.cuda(),
            topk_ids.cuda(),
            gate_up_bias=bias[0].cuda(),
            down_bias=bias[1].cuda(),
            activation=activation,
            path=path,
        )
        torch.cuda.synchronize()
        error = float((out.double().cpu() - expected).abs().max() / expected.abs().max())
        assert error <= TOLERANCE[dtype], f"{dtype} {activation} {path}: relative error {error:.3g}"


def test_fused_experts_front_door_takes_the_pairs():
    x, topk_ids, topk_weights, gate_up, down, bias = _problem(T=16)
    x = x.to(torch.bfloat16)
    cuda = lambda pair: tuple(t.cuda() for t in pair)  # noqa: E731
    out = fused_experts(
        x.cuda(),
        cuda(gate_up),
        cuda(down),
        topk_weights.cuda(),
        topk_ids.cuda(),
        activation="swigluoai",
        gate_up_bias=bias[0].cuda().to(torch.bfloat16),
        down_bias=bias[1].cuda().to(torch.bfloat16),
        quant=QuantConfig(format="mxfp4"),
    )
    expected = dense_experts(
        x.double(),
        topk_weights,
        topk_ids,
        dequantize_mxfp4(*gate_up),
        dequantize_mxfp4(*down),
        "swigluoai",
        bias[0].to(torch.bfloat16),
        bias[1].to(torch.bfloat16),
    )
    error = float((out.double().cpu() - expected).abs().max() / expected.abs().max())
    assert out.dtype == torch.bfloat16 and error <= TOLERANCE[torch.bfloat16], error


def test_mxfp4_experts_forward_runs_cuda_tensors_on_the_kernels(monkeypatch):
    from moeroute.experts.formats import mxfp4 as mxfp4_experts
    from moeroute.gpu import gemm_mxfp4

    launched = []
    original = gemm_mxfp4.run_mxfp4_experts
    monkeypatch.setattr(gemm_mxfp4, "run_mxfp4_experts", lambda *a, **k: launched.append(1) or original(*a, **k))
    x, topk_ids, topk_weights, gate_up, down, bias = _problem(T=16)
    x = x.to(torch.bfloat16)
    packed = [t.cuda() for t in (*gate_up, *down)]
    out = mxfp4_experts.mxfp4_experts_forward(
        x.cuda(), topk_weights.cuda(), topk_ids.cuda(), *packed, bias[0].cuda(), bias[1].cuda(), activation="swigluoai"
    )
    expected = dense_experts(
        x.double(), topk_weights, topk_ids, dequantize_mxfp4(*gate_up), dequantize_mxfp4(*down), "swigluoai", *bias
    )
    error = float((out.double().cpu() - expected).abs().max() / expected.abs().max())
    assert launched and error <= TOLERANCE[torch.bfloat16], error
