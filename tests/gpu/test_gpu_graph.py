"""CUDA graph capture of the device pipeline: the MoE forward and the dispatch ops, captured
once with torch.cuda.CUDAGraph and replayed on new inputs, against eager calls and the CPU.

A capture fails outright on any synchronization or host copy, and an allocation outside
torch's caching allocator would not be replay-safe; the simulator suite
(tests/routing/_sim_dispatch_cuda.py, the graph-safety tests) checks the same properties
without a GPU. Skipped without a CUDA device (bench/gpu_check.py runs these on a GPU machine).
"""

import numpy as np
import pytest
import torch

from gpu_reference import cuda_device_available
from moeroute.config import RouterConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_device_available(), reason="no CUDA device (run bench/gpu_check.py on a GPU machine)"),
]

H, I, N, K, T = 64, 32, 16, 4, 48
ROUTER = RouterConfig(N, K, "softmax", renormalize=True, routed_scaling_factor=1.5)
#: Replays with fresh inputs after the capture.
REPLAYS = 3
#: bfloat16 layer against its float32 CPU twin: normwise, a few bf16 ulps of the largest entry.
BF16_RTOL = 3e-2


def capture(function, *static_inputs):
    """Warm up on a side stream (compiles, caches tables), capture once; the static output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            function(*static_inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_output = function(*static_inputs)
    return graph, static_output


def make_moe(dtype):
    from moeroute.bindings.torch import MoE

    generator = torch.Generator().manual_seed(0)
    module = MoE(ROUTER, H, I, dtype=dtype)
    with torch.no_grad():
        module.router_weight.copy_(torch.randn(N, H, generator=generator))
        module.load_routed_weights(
            (torch.randn(N, 2 * I, H, generator=generator) * 0.3).to(dtype),
            (torch.randn(N, H, I, generator=generator) * 0.3).to(dtype),
        )
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_forward_replays_in_a_cuda_graph(dtype):
    module_cpu = make_moe(dtype)
    module = make_moe(dtype).to("cuda")
    static_x = torch.randn(T, H, device="cuda").to(dtype)
    graph, static_out = capture(module, static_x)
    generator = torch.Generator().manual_seed(1)
    for _ in range(REPLAYS):
        x = torch.randn(T, H, generator=generator).to(dtype)
        static_x.copy_(x.cuda())
        graph.replay()
        replayed = static_out.clone()
        eager = module(x.cuda())
        # The same kernels on the same inputs: the same bits (no atomics decide a sum).
        assert torch.equal(replayed, eager)
        expected = module_cpu(x).double()
        error = float((replayed.cpu().double() - expected).abs().max() / expected.abs().max())
        assert error < (1e-5 if dtype == torch.float32 else BF16_RTOL)


def test_dispatch_ops_replay_in_a_cuda_graph():
    from moeroute.routing.align import align_block_size
    from moeroute.routing.combine import combine
    from moeroute.routing.permute import permute

    rng = np.random.default_rng(2)

    def new_inputs():
        ids = rng.integers(-1, N, (T, K)).astype(np.int32)  # -1: slots of another rank
        hidden = rng.standard_normal((T, H)).astype(np.float32)
        weights = rng.random((T, K)).astype(np.float32)
        return ids, hidden, weights

    def pipeline(ids, hidden, weights):
        sorted_ids, expert_ids, total = align_block_size(ids, N, 8)
        permuted, offsets, inverse = permute(hidden, ids, N)
        return sorted_ids, expert_ids, total, offsets, combine(permuted, inverse, weights)

    ids, hidden, weights = new_inputs()
    static = [torch.from_numpy(a).cuda() for a in (ids, hidden, weights)]
    graph, outputs = capture(pipeline, *static)
    for _ in range(REPLAYS):
        ids, hidden, weights = new_inputs()
        for target, value in zip(static, (ids, hidden, weights)):
            target.copy_(torch.from_numpy(value))
        graph.replay()
        torch.cuda.synchronize()
        sorted_ids, expert_ids, total = align_block_size(ids, N, 8)
        permuted, offsets, inverse = permute(hidden, ids, N)
        np.testing.assert_array_equal(outputs[0].cpu().numpy(), sorted_ids)
        np.testing.assert_array_equal(outputs[1].cpu().numpy(), expert_ids)
        assert int(outputs[2].cpu()[0]) == total
        np.testing.assert_array_equal(outputs[3].cpu().numpy(), offsets)
        want = combine(permuted, inverse, weights)
        np.testing.assert_allclose(outputs[4].cpu().numpy(), want, rtol=1e-5, atol=1e-6)


def test_outputs_on_an_explicit_stream_are_recorded_on_it():
    """An explicit stream other than torch's current one: the outputs are recorded on it,
    so the caching allocator keeps them until that stream's work is done."""
    from moeroute.routing.combine import combine

    rng = np.random.default_rng(3)
    expert_out = torch.from_numpy(rng.standard_normal((8, H)).astype(np.float32)).cuda()
    inverse = torch.from_numpy(rng.integers(-1, 8, (4, 2)).astype(np.int32)).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    recorded = []
    original = torch.Tensor.record_stream

    def spy(tensor, stream):
        recorded.append(stream.cuda_stream)
        return original(tensor, stream)

    torch.Tensor.record_stream = spy
    try:
        out = combine(expert_out, inverse, stream=side.cuda_stream)
    finally:
        torch.Tensor.record_stream = original
    side.synchronize()
    assert recorded and set(recorded) == {side.cuda_stream}
    want = combine(expert_out.cpu().numpy(), inverse.cpu().numpy())
    np.testing.assert_allclose(out.cpu().numpy(), want, rtol=1e-6, atol=1e-6)
