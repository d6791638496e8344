"""fused_experts on a GPU against torch in float64: every kernel path x dtype x block size,
torch and CuPy callers, streams, zero-copy inputs, determinism. Skipped without a CUDA device
(bench/gpu_check.py runs these on a GPU machine)."""

import numpy as np
import pytest
import torch

from gpu_reference import activation_reference, cuda_device_available
from moeroute.gpu import fused_experts
from moeroute.gpu import launch as L
from moeroute.gpu.align_fallback import align_block_size_array_api
from moeroute.gpu.gemm import CupyBackend, _torch_as_cupy, check_fused_experts_args, run_fused_experts
from moeroute.routing import reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_device_available(), reason="no CUDA device (run bench/gpu_check.py on a GPU machine)"),
]

# Relative Frobenius error against float64 torch on the same stored inputs. float16 / bfloat16
# also round the intermediate and each slot's output to the element type, as the kernels do.
RELATIVE_ERROR = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}
TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

PATH_CASES = [("simt", dtype, block_size) for dtype in L.DTYPES for block_size in L.BLOCK_SIZES] + [
    ("mma", dtype, block_size) for dtype in ("float16", "bfloat16") for block_size in L.BLOCK_SIZES
]
# H and I: multiples of 8 (mma-eligible) but of no tile width or k step.
SHAPE = dict(num_tokens=257, hidden_size=392, intermediate_size=200, num_experts=12, top_k=4)


def make_inputs(
    num_tokens, hidden_size, intermediate_size, num_experts, top_k, dtype, seed=0, other_rank_fraction=0.15
):
    g = torch.Generator(device="cuda").manual_seed(seed)
    cuda = dict(device="cuda", generator=g)
    x = torch.randn(num_tokens, hidden_size, **cuda).to(TORCH[dtype])
    w_gate_up = (torch.randn(num_experts, 2 * intermediate_size, hidden_size, **cuda) / hidden_size**0.5).to(
        TORCH[dtype]
    )
    w_down = (torch.randn(num_experts, hidden_size, intermediate_size, **cuda) / intermediate_size**0.5).to(
        TORCH[dtype]
    )
    topk_ids = torch.rand(num_tokens, num_experts, **cuda).topk(top_k, dim=1).indices.int()
    topk_ids[torch.rand(num_tokens, top_k, **cuda) < other_rank_fraction] = -1
    topk_weights = torch.rand(num_tokens, top_k, **cuda) * 0.9 + 0.1
    return x, w_gate_up, w_down, topk_weights, topk_ids.contiguous()


def torch_reference(x, w_gate_up, w_down, topk_weights, topk_ids, activation="silu", apply_router_weight=True):
    """sum_k w[t,k] * down_e(act(gate_e x) * up_e x) in float64, slots with ids outside [0, E) skipped."""
    I = w_gate_up.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in range(w_gate_up.shape[0]):
        t, k = torch.nonzero(topk_ids == e, as_tuple=True)
        if t.numel() == 0:
            continue
        h = x[t].double() @ w_gate_up[e].double().T
        y = (activation_reference(h[:, :I], activation) * h[:, I:]) @ w_down[e].double().T
        if apply_router_weight:
            y = y * topk_weights[t, k].double()[:, None]
        out.index_add_(0, t, y)
    return out


def relative_error(out, expected):
    return ((out.double() - expected).norm() / expected.norm()).item()


def run_path(
    x, w_gate_up, w_down, topk_weights, topk_ids, *, path, block_size=None, activation="silu", apply_router_weight=True
):
    """run_fused_experts with a forced kernel path, on torch's current stream."""
    import cupy

    problem = check_fused_experts_args(
        x,
        w_gate_up,
        w_down,
        topk_weights,
        topk_ids,
        activation=activation,
        apply_router_weight=apply_router_weight,
        block_size=block_size,
    )
    out = torch.empty_like(x)

    def allocate(shape, dtype):
        return _torch_as_cupy(torch.empty(shape, dtype=TORCH[dtype], device=x.device))

    with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
        run_fused_experts(
            CupyBackend(allocate),
            problem,
            *[_torch_as_cupy(v) for v in (x, w_gate_up, w_down, topk_weights, topk_ids)],
            _torch_as_cupy(out),
            activation=activation,
            apply_router_weight=apply_router_weight,
            block_size=block_size,
            path=path,
        )
    return out


@pytest.mark.parametrize("path, dtype, block_size", PATH_CASES)
def test_every_path_matches_torch(path, dtype, block_size):
    inputs = make_inputs(**SHAPE, dtype=dtype, seed=block_size)
    out = run_path(*inputs, path=path, block_size=block_size)
    assert torch.isfinite(out).all()
    assert relative_error(out, torch_reference(*inputs)) < RELATIVE_ERROR[dtype]


@pytest.mark.parametrize("path, dtype", [("simt", "float32"), ("mma", "bfloat16")])
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("apply_router_weight", [True, False])
def test_activations_and_router_weight(path, dtype, activation, apply_router_weight):
    inputs = make_inputs(**SHAPE, dtype=dtype, seed=3)
    out = run_path(*inputs, path=path, block_size=32, activation=activation, apply_router_weight=apply_router_weight)
    expected = torch_reference(*inputs, activation=activation, apply_router_weight=apply_router_weight)
    assert relative_error(out, expected) < RELATIVE_ERROR[dtype]


def test_mma_matches_simt():
    inputs = make_inputs(**SHAPE, dtype="bfloat16", seed=5)
    mma = run_path(*inputs, path="mma", block_size=64)
    simt = run_path(*inputs, path="simt", block_size=64)
    assert relative_error(mma, simt.double()) < 5e-3


@pytest.mark.parametrize(
    "name, hidden_size, intermediate_size, num_tokens, num_experts, top_k",
    [
        ("DeepSeek-V3 decode", 7168, 2048, 64, 8, 8),
        ("Qwen3-30B-A3B prefill", 2048, 768, 2048, 16, 8),
    ],
)
def test_model_shapes_on_a_side_stream(name, hidden_size, intermediate_size, num_tokens, num_experts, top_k):
    inputs = make_inputs(num_tokens, hidden_size, intermediate_size, num_experts, top_k, "bfloat16", seed=1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = fused_experts(*inputs)
        expected = torch_reference(*inputs)
    side.synchronize()
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.device == inputs[0].device
    assert relative_error(out, expected) < RELATIVE_ERROR["bfloat16"], name


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_cupy_inputs_give_cupy_output(dtype):
    import cupy

    inputs = make_inputs(**SHAPE, dtype=dtype, seed=2)
    out = fused_experts(*[cupy.from_dlpack(v) for v in inputs])
    assert isinstance(out, cupy.ndarray) and out.dtype == np.dtype(dtype) and out.shape == inputs[0].shape
    assert relative_error(torch.from_dlpack(out), torch_reference(*inputs)) < RELATIVE_ERROR[dtype]


@pytest.mark.parametrize("dtype", L.DTYPES)
def test_torch_inputs_are_not_copied(dtype):
    x = torch.randn(8, 16, device="cuda").to(TORCH[dtype])
    assert _torch_as_cupy(x).data.ptr == x.data_ptr()


def test_zero_tokens():
    x, w_gate_up, w_down, topk_weights, topk_ids = make_inputs(0, 64, 32, 4, 2, "bfloat16")
    out = fused_experts(x, w_gate_up, w_down, topk_weights, topk_ids)
    assert out.shape == (0, 64) and out.dtype == torch.bfloat16 and out.is_cuda


def test_tokens_with_no_local_slot_are_zero():
    inputs = make_inputs(**SHAPE, dtype="bfloat16", seed=4)
    inputs[4][:10] = -1
    out = fused_experts(*inputs)
    assert (out[:10] == 0).all()


def test_deterministic():
    inputs = make_inputs(**SHAPE, dtype="bfloat16", seed=6)
    assert torch.equal(fused_experts(*inputs), fused_experts(*inputs))


def test_align_fallback_on_device():
    import cupy

    ids = np.random.default_rng(0).integers(-1, 40, size=(300, 8)).astype(np.int32)
    sorted_ids, expert_ids, total = align_block_size_array_api(cupy.asarray(ids), 37, 64, xp=cupy)
    want = reference.align_block_size(ids, 37, 64)
    np.testing.assert_array_equal(cupy.asnumpy(sorted_ids), want[0])
    np.testing.assert_array_equal(cupy.asnumpy(expert_ids), want[1])
    assert int(total) == want[2]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpt_oss_experts_with_biases_match_torch(dtype):
    # fused_experts with swigluoai and both biases against a float64 torch definition.
    x, w_gate_up, w_down, topk_weights, topk_ids = make_inputs(**SHAPE, dtype=dtype, seed=9)
    w_gate_up = (w_gate_up.float() * 8.0).to(w_gate_up.dtype)  # reach the clamps at +-7
    E, two_I = w_gate_up.shape[:2]
    I = two_I // 2
    g = torch.Generator(device=x.device).manual_seed(10)
    b_gate_up = (torch.randn(E, two_I, device=x.device, generator=g) * 2.0).to(x.dtype)
    b_down = torch.randn(E, x.shape[1], device=x.device, generator=g).to(x.dtype)
    out = fused_experts(
        x, w_gate_up, w_down, topk_weights, topk_ids, activation="swigluoai", gate_up_bias=b_gate_up, down_bias=b_down
    )
    expected = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in range(E):
        t, k = torch.nonzero(topk_ids == e, as_tuple=True)
        if t.numel() == 0:
            continue
        h = x[t].double() @ w_gate_up[e].double().T + b_gate_up[e].double()
        gate, up = h[:, :I].clamp(max=7.0), h[:, I:].clamp(-7.0, 7.0)
        y = ((up + 1) * gate * torch.sigmoid(1.702 * gate)) @ w_down[e].double().T + b_down[e].double()
        expected.index_add_(0, t, y * topk_weights[t, k].double()[:, None])
    assert relative_error(out, expected) < RELATIVE_ERROR[dtype]
