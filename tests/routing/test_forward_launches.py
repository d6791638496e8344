"""One MoE forward, counted: which routing ops it calls and how many kernels a device runs.

* CPU: a one-rank `MoE` forward calls the fused ``route`` once and none of the three ops it
  fuses (select_experts, append_shared_slots, remap_to_local), and its output matches a
  dense torch definition of the layer.
* Device (``test_sim_*``, under NUMBA_ENABLE_CUDASIM=1 in the subprocess that
  test_route.py's ``test_route_under_the_simulator`` starts for both files): the forward's device
  pipeline - ``route`` on device logits, then the expert pipeline the module runs on CUDA
  tensors (`moeroute.gpu.gemm.run_fused_experts`: align, two GEMMs, the top-k sum) - counted
  at the two launch points, `moeroute.routing._launcher.launch` (every Numba kernel) and the
  GEMM backend's ``launch`` (every CuPy kernel). docs/guide.md quotes the count: route 1,
  align 2, GEMMs 2, combine 1. The simulator runs the Numba kernels, so their results are
  checked against the CPU ops; the GEMM plans are recorded, not run (the host emulation
  tests run them).
"""

import numpy as np
import pytest

from moeroute import ExpertLayout, RouterConfig, route
from moeroute.routing._arrays import simulator_enabled
from helpers.reference import dense_experts  # noqa: E402

SIMULATED = simulator_enabled()
sim_only = pytest.mark.skipif(not SIMULATED, reason="runs inside the CUDA simulator subprocess")
no_sim = pytest.mark.skipif(SIMULATED, reason="needs the real numba.cuda, not the simulator")

N, K, H, I, T = 16, 2, 32, 24, 5
CONFIG = RouterConfig(N, K, "sigmoid", num_expert_group=4, topk_group=2, routed_scaling_factor=1.0)


# ------------------------------------------------------------------ CPU


def _count_calls(monkeypatch):
    from moeroute.bindings.torch import arrays

    calls = {}
    for name in ("route", "select_experts", "append_shared_slots", "remap_to_local"):
        original = getattr(arrays.ROUTING_KERNELS, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(arrays.ROUTING_KERNELS, name, counted)
    return calls


@no_sim
@pytest.mark.parametrize("shared", ["fused", "overlap"])
def test_one_rank_forward_routes_once(monkeypatch, shared):
    import torch

    from moeroute.bindings.torch import MoE

    class GatedMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = torch.nn.Linear(H, I, bias=False)
            self.up_proj = torch.nn.Linear(H, I, bias=False)
            self.down_proj = torch.nn.Linear(I, H, bias=False)

        def forward(self, x):
            return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    generator = torch.Generator().manual_seed(5)
    shared_mlp = GatedMLP()
    with torch.no_grad():  # the shared MLP is complete before the layer takes it
        for linear in (shared_mlp.gate_proj, shared_mlp.up_proj, shared_mlp.down_proj):
            linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator) * 0.3)
    module = MoE(
        RouterConfig(N, K, "softmax", renormalize=True),
        H,
        I,
        shared_experts=shared_mlp,
        shared=shared,
        dtype=torch.float32,
    )
    with torch.no_grad():
        module.router_weight.copy_(torch.randn(N, H, generator=generator))
        w_gate_up = torch.randn(N, 2 * I, H, generator=generator) * 0.3
        w_down = torch.randn(N, H, I, generator=generator) * 0.3
        module.load_routed_weights(w_gate_up, w_down)
    x = torch.randn(T, H, generator=generator)
    calls = _count_calls(monkeypatch)
    out = module(x)
    assert calls == {"route": 1}

    # Dense definition: softmax top-k, renormalized, SiLU-gated experts, plus the shared MLP.
    x64 = x.double()
    probs = torch.softmax(x64 @ module.router_weight.double().T, dim=-1)
    top_w, top_ids = probs.topk(K, dim=-1)
    top_w = top_w / top_w.sum(-1, keepdim=True)
    s = shared_mlp
    want = (
        torch.nn.functional.silu(x64 @ s.gate_proj.weight.double().T) * (x64 @ s.up_proj.weight.double().T)
    ) @ s.down_proj.weight.double().T
    want += dense_experts(x, top_w, top_ids, w_gate_up, w_down)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ device, counted


class _RecordingBackend:
    """The GEMM backend of `run_fused_experts` with the CuPy launches recorded, not run;
    align is the Numba CUDA op the CuPy backend calls (here on simulator arrays)."""

    compute_capability = (9, 0)
    is_hip = False

    def __init__(self):
        self.plans = []

    def empty(self, shape, dtype):
        from numba import cuda

        return cuda.device_array(shape, np.float32 if dtype == "float32" else np.uint16)

    def pointer(self, array) -> int:
        return 0

    def align_block_size(self, topk_ids, num_experts, block_size):
        from moeroute.routing.align import align_block_size

        sorted_token_ids, expert_ids, _ = align_block_size(topk_ids, num_experts, block_size)
        return sorted_token_ids, expert_ids

    def launch(self, plan) -> None:
        self.plans.append(plan.name)


@sim_only
def test_sim_one_forward_launches(monkeypatch):
    from numba import cuda

    from moeroute.gpu import launch as L
    from moeroute.gpu.gemm import check_fused_experts_args, run_fused_experts
    from moeroute.routing import _launcher
    from moeroute.routing.align import align_block_size

    numba_launches = []
    original = _launcher.launch

    def counted(dispatcher, *args, **kwargs):
        numba_launches.append(getattr(dispatcher, "__name__", repr(dispatcher)))
        return original(dispatcher, *args, **kwargs)

    monkeypatch.setattr(_launcher, "launch", counted)

    layout = ExpertLayout(N, num_shared_experts=1, ep_size=1, dispatch="none")
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((T, N)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(N)).astype(np.float32)
    gate = rng.random(T).astype(np.float32)
    hidden = rng.standard_normal((T, H)).astype(np.float32)
    num_local = layout.num_local_experts(0)
    w_gate_up = rng.standard_normal((num_local, 2 * I, H)).astype(np.float32)
    w_down = rng.standard_normal((num_local, H, I)).astype(np.float32)

    # route: one launch, the CPU composition's ids and weights.
    weights, local_ids = route(cuda.to_device(logits), CONFIG, layout, 0, cuda.to_device(bias), cuda.to_device(gate))
    assert len(numba_launches) == 1
    want_w, want_ids = route(logits, CONFIG, layout, 0, bias, gate)
    np.testing.assert_array_equal(local_ids.copy_to_host(), want_ids)
    np.testing.assert_allclose(weights.copy_to_host(), want_w, rtol=1e-6, atol=0)

    # The experts: align (two Numba launches), two GEMMs and the top-k sum (three CuPy ones).
    backend = _RecordingBackend()
    problem = check_fused_experts_args(hidden, w_gate_up, w_down, weights, local_ids)
    block_size = L.choose_block_size(T * (K + 1), num_local)
    run_fused_experts(
        backend,
        problem,
        cuda.to_device(hidden),
        cuda.to_device(w_gate_up),
        cuda.to_device(w_down),
        weights,
        local_ids,
        cuda.device_array((T, H), np.float32),
        block_size=block_size,
    )
    assert len(numba_launches) == 1 + 2, numba_launches
    assert len(backend.plans) == 3, backend.plans
    assert [name.startswith("moe_gemm_") for name in backend.plans] == [True, True, False]
    assert backend.plans[2] == L.sum_name("float32")

    # The align the pipeline ran gives the CPU align's blocks.
    sorted_ids, expert_ids, _ = align_block_size(local_ids, num_local, block_size)
    want_sorted, want_experts, _ = align_block_size(want_ids, num_local, block_size)
    got_experts = expert_ids.copy_to_host()[: len(want_experts)]
    np.testing.assert_array_equal(got_experts, want_experts)
    np.testing.assert_array_equal(sorted_ids.copy_to_host()[: len(want_sorted)], want_sorted)
