"""FP8 routed experts (moe_gemm_fp8.cu) on a GPU against the plain-torch w8a8 reference, and the
device quantizer against moeroute.quant bit for bit. Skipped without a CUDA device
(bench/gpu_check.py runs these on a GPU machine)."""

import pytest
import torch

from gpu_reference import cuda_device_available
from moeroute.gpu import gemm_fp8 as G
from moeroute.quant import QuantConfig
from moeroute.quant.fp8 import quantize_experts, quantize_fp8_activations
from moeroute.quant.reference import moe_experts_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_device_available(), reason="no CUDA device (run bench/gpu_check.py on a GPU machine)"),
]

# max |kernel - reference| / max |reference| (see test_gpu_fp8_host.py for the reasoning).
TOLERANCE = {torch.float32: 5e-3, torch.bfloat16: 2e-2}
FORMATS = [("fp8_block", (128, 128), "float"), ("fp8_block", (64, 128), "ue8m0"), ("fp8_tensor", None, "float")]


def _paths():
    paths = ["simt"]
    if cuda_device_available() and torch.cuda.get_device_capability() >= (8, 9):
        paths.append("mma")
    return paths


@pytest.mark.parametrize("path", _paths())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("format, block_size, scale_fmt", FORMATS)
def test_fp8_experts_on_device_match_reference(path, dtype, format, block_size, scale_fmt):
    # I = 200: a partial last weight block in both GEMMs; 5% of the slots belong to other ranks.
    T, H, I, E, K = 96, 384, 200, 8, 2
    g = torch.Generator().manual_seed(7)
    config = QuantConfig(format=format, block_size=block_size, scale_fmt=scale_fmt)
    q_gu, s_gu, q_d, s_d = quantize_experts(
        torch.randn(E, 2 * I, H, generator=g) / H**0.5, torch.randn(E, H, I, generator=g) / I**0.5, config
    )
    x = torch.randn(T, H, generator=g).to(dtype)
    topk_ids = torch.randint(0, E, (T, K), generator=g, dtype=torch.int32)
    topk_ids[torch.rand(T, K, generator=g) < 0.05] = -1
    topk_weights = torch.rand(T, K, generator=g)
    cuda = [t.cuda() for t in (x, q_gu, s_gu, q_d, s_d, topk_weights, topk_ids)]
    out = G.fused_experts_fp8(*cuda[:5], cuda[5], cuda[6], quant=config, path=path)
    torch.cuda.synchronize()
    expected = moe_experts_reference(
        x.float(),
        topk_weights,
        topk_ids.long(),
        q_gu,
        s_gu,
        q_d,
        s_d,
        block_size=block_size,
        scale_fmt=scale_fmt,
        intermediate_dtype=dtype,
    )
    error = float((out.float().cpu() - expected).abs().max() / expected.abs().max())
    assert error <= TOLERANCE[dtype], f"{format} {block_size} {dtype} {path}: relative error {error:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_device_quantizer_matches_quantize_fp8_activations(dtype, scale_fmt):
    import cupy

    from moeroute.gpu.gemm import _torch_as_cupy

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(33, 300, generator=g) * torch.exp2(torch.randint(-8, 4, (33, 300), generator=g).float())).to(dtype)
    x[4] = 0
    x_cuda = x.cuda()
    q = torch.empty(x.shape, dtype=torch.uint8, device="cuda")
    scales = torch.empty(33, 3, dtype=torch.float32, device="cuda")
    backend = G.CupyFp8Backend(lambda shape, name: None)
    with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
        backend.launch(
            G.plan_quantize(
                dtype=str(dtype).removeprefix("torch."),
                x=_torch_as_cupy(x_cuda),
                q=_torch_as_cupy(q),
                scales=_torch_as_cupy(scales),
                rows=33,
                cols=300,
                group_size=128,
                ue8m0=scale_fmt == "ue8m0",
            )
        )
    torch.cuda.synchronize()
    q_ref, s_ref = quantize_fp8_activations(x, 128, scale_fmt)
    assert torch.equal(scales.cpu(), s_ref)
    assert torch.equal(q.cpu(), q_ref.view(torch.uint8))


def test_fused_experts_quant_routes_to_the_fp8_kernels():
    from moeroute.gpu import fused_experts

    T, H, I, E, K = 40, 256, 136, 4, 2
    g = torch.Generator().manual_seed(9)
    config = QuantConfig(format="fp8_block", block_size=(128, 128))
    q_gu, s_gu, q_d, s_d = quantize_experts(
        torch.randn(E, 2 * I, H, generator=g) / H**0.5, torch.randn(E, H, I, generator=g) / I**0.5, config
    )
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    topk_ids = torch.randint(0, E, (T, K), generator=g, dtype=torch.int32)
    topk_weights = torch.rand(T, K, generator=g)
    out = fused_experts(
        x.cuda(),
        q_gu.cuda(),
        q_d.cuda(),
        topk_weights.cuda(),
        topk_ids.cuda(),
        quant=config,
        gate_up_scale=s_gu.cuda(),
        down_scale=s_d.cuda(),
    )
    expected = moe_experts_reference(
        x.float(),
        topk_weights,
        topk_ids.long(),
        q_gu,
        s_gu,
        q_d,
        s_d,
        block_size=(128, 128),
        intermediate_dtype=torch.bfloat16,
    )
    error = float((out.float().cpu() - expected).abs().max() / expected.abs().max())
    assert out.dtype == torch.bfloat16 and error <= TOLERANCE[torch.bfloat16], error


@pytest.mark.parametrize("path", _paths())
def test_static_activation_scales_on_device(path):
    T, H, I, E, K = 64, 256, 136, 4, 2
    g = torch.Generator().manual_seed(13)
    config = QuantConfig(format="fp8_tensor", activation="static")
    q_gu, s_gu, q_d, s_d = quantize_experts(
        torch.randn(E, 2 * I, H, generator=g) / H**0.5, torch.randn(E, H, I, generator=g) / I**0.5, config
    )
    x = torch.randn(T, H, generator=g)
    topk_ids = torch.randint(0, E, (T, K), generator=g, dtype=torch.int32)
    topk_weights = torch.rand(T, K, generator=g)
    input_scale = torch.tensor([[0.004 * 4.0**e, 0.0005 * 2.0**e] for e in range(E)], dtype=torch.float32)
    cuda = [t.cuda() for t in (x, q_gu, s_gu, q_d, s_d, topk_weights, topk_ids)]
    out = G.fused_experts_fp8(*cuda, quant=config, path=path, input_scale=input_scale.cuda())
    expected = moe_experts_reference(x, topk_weights, topk_ids.long(), q_gu, s_gu, q_d, s_d, input_scale=input_scale)
    error = float((out.cpu() - expected).abs().max() / expected.abs().max())
    assert error <= TOLERANCE[torch.float32], error
