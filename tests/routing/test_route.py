"""route: select_experts + append_shared_slots + remap_to_local in one op.

* CPU: route equals the composition of the three ops for several layouts (EP 1/2/4,
  shared none / fused global / fused per_rank, redundant experts, round-robin placement),
  every rank and home rank; torch tensors in give torch tensors out; bad arguments raise
  errors that name them.
* ``test_sim_*`` run only under NUMBA_ENABLE_CUDASIM=1: ``test_route_under_the_simulator``
  runs them in a subprocess (four warps per block) and compares the fused kernel on numba
  device arrays with the CPU path.
* The fused kernel compiles to PTX for sm_90 without local-memory traffic.
"""

import re
from pathlib import Path

import numpy as np
import pytest

from moeroute import ExpertLayout, RouterConfig, append_shared_slots, remap_to_local, route
from moeroute import select_experts
from moeroute.routing._arrays import simulator_enabled
from _simulator import run_simulator_suite  # noqa: E402

SIMULATED = simulator_enabled()
WEIGHT_RTOL = 1e-6

sim_only = pytest.mark.skipif(not SIMULATED, reason="runs inside the CUDA simulator subprocess")
no_sim = pytest.mark.skipif(SIMULATED, reason="needs the real numba.cuda, not the simulator")

# (name, ExpertLayout kwargs over N routed experts)
LAYOUTS = [
    ("ep1, no shared", dict(ep_size=1)),
    ("ep1, fused global", dict(num_shared_experts=1, ep_size=1, dispatch="none")),
    (
        "ep1, per_rank S=2, redundant",
        dict(num_shared_experts=2, ep_size=1, dispatch="none", shared_slots="per_rank", num_redundant_experts=3),
    ),
    ("ep2, all2all per_rank", dict(num_shared_experts=1, ep_size=2, dispatch="all2all")),
    ("ep4, allgather global S=2", dict(num_shared_experts=2, ep_size=4, dispatch="allgather", shared_slots="global")),
    ("ep4, per_rank, redundant", dict(num_shared_experts=1, ep_size=4, dispatch="all2all", num_redundant_experts=4)),
    (
        "ep2, round_robin, redundant",
        dict(num_shared_experts=1, ep_size=2, dispatch="all2all", placement="round_robin", num_redundant_experts=2),
    ),
    ("ep2, overlap (not fused)", dict(num_shared_experts=1, ep_size=2, dispatch="all2all", shared="overlap")),
]
CONFIGS = [
    (
        "sigmoid, bias, groups",
        RouterConfig(32, 4, "sigmoid", num_expert_group=4, topk_group=2, routed_scaling_factor=2.5),
        True,
    ),
    ("softmax", RouterConfig(32, 3, "softmax", renormalize=True), False),
]


def composed(logits, config, layout, rank, bias, shared_weights, home_rank):
    topk_weights, topk_ids = select_experts(logits, config, bias)
    weights, ids = append_shared_slots(topk_weights, topk_ids, layout, home_rank, shared_weights)
    return weights, remap_to_local(ids, layout.expert_map(rank))


def rng_for(*key):
    import zlib

    return np.random.default_rng(zlib.crc32(repr(key).encode()))


@pytest.mark.parametrize("config_name,config,with_bias", CONFIGS, ids=[c[0] for c in CONFIGS])
@pytest.mark.parametrize("label,kwargs", LAYOUTS, ids=[label for label, _ in LAYOUTS])
def test_cpu_route_equals_the_composition(label, kwargs, config_name, config, with_bias):
    layout = ExpertLayout(config.num_experts, **kwargs)
    rng = rng_for(label, config_name)
    tokens = 9
    logits = rng.standard_normal((tokens, config.num_experts)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(config.num_experts)).astype(np.float32) if with_bias else None
    slots = layout.num_shared_experts if layout.shared == "fused" else 0
    gate = rng.random(tokens).astype(np.float32)
    for shared_weights in (None, 0.5, gate):
        for rank in range(layout.ep_size):
            for home_rank in range(layout.ep_size):
                weights, local_ids = route(logits, config, layout, rank, bias, shared_weights, home_rank)
                want_w, want_ids = composed(logits, config, layout, rank, bias, shared_weights, home_rank)
                assert local_ids.dtype == np.int32 and weights.dtype == np.float32
                assert local_ids.shape == weights.shape == (tokens, config.top_k + slots)
                np.testing.assert_array_equal(local_ids, want_ids)
                np.testing.assert_array_equal(weights, want_w)
    # Every routed pick is local on exactly one rank.
    held = sum(
        (route(logits, config, layout, r, bias)[1][:, : config.top_k] >= 0).astype(int) for r in range(layout.ep_size)
    )
    assert (held == 1).all()


def test_spec_worked_example_in_local_ids():
    # N=8, S=1, E=2: a token from rank 1 routed to logical 4 and 7 gets physical 5 and 8 and
    # shared 9, i.e. local 0, 3 and 4 on rank 1, and nothing on rank 0.
    config = RouterConfig(8, 2, "softmax", renormalize=False)
    layout = ExpertLayout(8, 1, ep_size=2, dispatch="all2all")
    logits = np.full((1, 8), -5.0, np.float32)
    logits[0, 4], logits[0, 7] = 3.0, 2.0
    _, on_rank_1 = route(logits, config, layout, rank=1, home_rank=1)
    _, on_rank_0 = route(logits, config, layout, rank=0, home_rank=1)
    assert on_rank_1.tolist() == [[0, 3, 4]]
    assert on_rank_0.tolist() == [[-1, -1, -1]]


def test_zero_tokens():
    config = RouterConfig(16, 2, "sigmoid")
    layout = ExpertLayout(16, 1, ep_size=2, dispatch="all2all")
    weights, local_ids = route(np.empty((0, 16), np.float32), config, layout, 1)
    assert weights.shape == local_ids.shape == (0, 3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_in_torch_out(dtype):
    torch = pytest.importorskip("torch")
    config = RouterConfig(32, 4, "sigmoid", num_expert_group=4, topk_group=2)
    layout = ExpertLayout(32, 1, ep_size=2, dispatch="all2all", num_redundant_experts=2)
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 32, generator=generator).to(getattr(torch, dtype))
    bias = 0.1 * torch.randn(32, generator=generator)
    gate = torch.rand(6, 1, generator=generator)
    weights, local_ids = route(logits, config, layout, 1, bias, gate, home_rank=1)
    assert isinstance(weights, torch.Tensor) and isinstance(local_ids, torch.Tensor)
    assert weights.dtype == torch.float32 and local_ids.dtype == torch.int32
    want_w, want_ids = composed(logits.float().numpy(), config, layout, 1, bias.numpy(), gate.numpy(), 1)
    np.testing.assert_array_equal(local_ids.numpy(), want_ids)
    np.testing.assert_allclose(weights.numpy(), want_w, rtol=WEIGHT_RTOL, atol=0)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(rank=2), ValueError, r"rank=2 is outside \[0, 2\)"),
        (dict(rank=True), TypeError, r"rank=True must be an integer"),
        (dict(home_rank=-1), ValueError, r"home_rank=-1 is outside \[0, 2\)"),
        (dict(layout="ep2"), TypeError, r"layout must be a moeroute ExpertLayout"),
        (
            dict(layout=ExpertLayout(24, 1, ep_size=2, dispatch="all2all")),
            ValueError,
            r"config.num_experts=16 does not match layout.num_routed_experts=24",
        ),
        (dict(config="deepseek"), TypeError, r"config must be a moeroute RouterConfig"),
        (dict(shared_weights=np.ones(5, np.float32)), ValueError, r"shared_weights has shape \(5,\)"),
        (dict(correction_bias=np.ones(15, np.float32)), ValueError, r"correction_bias shape"),
    ],
    ids=[
        "rank-range",
        "rank-type",
        "home-rank",
        "layout-type",
        "layout-mismatch",
        "config",
        "shared-shape",
        "bias-shape",
    ],
)
def test_invalid_arguments_name_themselves(kwargs, error, match):
    arguments = dict(
        logits=np.zeros((3, 16), np.float32),
        config=RouterConfig(16, 2),
        layout=ExpertLayout(16, 1, ep_size=2, dispatch="all2all"),
    )
    arguments.update(kwargs)
    with pytest.raises(error, match=match):
        route(**arguments)


# ------------------------------------------------------------------ simulator


@no_sim
def test_route_under_the_simulator():
    from moeroute.routing.select._cuda import DEVICE_WARPS_PER_BLOCK

    # test_forward_launches' device counts share this simulator process (one start-up).
    run_simulator_suite(
        [Path(__file__), Path(__file__).with_name("test_forward_launches.py")],
        warps=DEVICE_WARPS_PER_BLOCK,
        select="test_sim_",
    )


# (name, config, bias, layout, rank, home_rank, shared weights kind, rows, input dtype)
SIM_CASES = [
    (
        "deepseek-like, per_rank, [T] gate",
        RouterConfig(64, 4, "sigmoid", num_expert_group=4, topk_group=2, routed_scaling_factor=2.5),
        True,
        dict(num_shared_experts=1, ep_size=2, dispatch="all2all"),
        1,
        1,
        "[T]",
        5,
        "float32",
    ),
    (
        "softmax, allgather global S=2, [T,S] weights",
        RouterConfig(40, 3, "softmax"),
        False,
        dict(num_shared_experts=2, ep_size=4, dispatch="allgather", shared_slots="global"),
        2,
        3,
        "[T,S]",
        6,
        "float32",
    ),
    (
        "sqrtsoftplus, round_robin, redundant, scalar, float16",
        RouterConfig(48, 5, "sqrtsoftplus", routed_scaling_factor=1.5),
        True,
        dict(num_shared_experts=1, ep_size=4, dispatch="all2all", placement="round_robin", num_redundant_experts=4),
        3,
        0,
        "scalar",
        8,
        "float16",
    ),
    (
        "softmax K=6, no shared, bfloat16 bits, NaN row",
        RouterConfig(96, 6, "softmax", renormalize=False),
        False,
        dict(ep_size=2, dispatch="allgather", shared="runner"),
        0,
        0,
        "none",
        3,
        "bfloat16",
    ),
]


@sim_only
@pytest.mark.parametrize("case", SIM_CASES, ids=[c[0] for c in SIM_CASES])
def test_sim_route_matches_cpu(case):
    from numba import cuda

    name, config, with_bias, layout_kwargs, rank, home_rank, gate, rows, dtype = case
    layout = ExpertLayout(config.num_experts, **layout_kwargs)
    rng = rng_for("sim", name)
    values = (2.0 * rng.standard_normal((rows, config.num_experts))).astype(np.float32)
    if dtype == "bfloat16":
        values[-1, ::3] = np.nan
        bits = (values.view(np.uint32) >> 16).astype(np.uint16).view(np.int16)
        host_logits = (bits.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        device_logits = bits
    else:
        device_logits = values.astype(dtype)
        host_logits = device_logits
    bias = (0.2 * rng.standard_normal(config.num_experts)).astype(np.float32) if with_bias else None
    shared = {
        "none": None,
        "scalar": 0.75,
        "[T]": rng.random(rows).astype(np.float32),
        "[T,S]": rng.random((rows, layout.num_shared_experts)).astype(np.float32),
    }[gate]
    want_w, want_ids = composed(host_logits, config, layout, rank, bias, shared, home_rank)
    if dtype == "bfloat16":
        # The public op takes bfloat16 tensors; the kernel reads their int16 bits.
        from moeroute.routing.select import _cuda as _select_device
        from moeroute.routing.remap import expert_map_device_table, layout_device_tables
        from moeroute.routing.route import _route_kernel

        kernel = _route_kernel(config.num_experts, 1, config.scoring, False, config.renormalize, "bfloat16")
        out_w = cuda.device_array(want_w.shape, np.float32)
        out_ids = cuda.device_array(want_ids.shape, np.int32)
        warps = _select_device.warps_per_block()
        kernel[-(-rows // warps), warps * 32](
            cuda.to_device(bits),
            out_w.reshape(-1),
            rows,
            config.top_k,
            1,
            np.float32(config.routed_scaling_factor),
            layout.num_routed_experts,
            *layout_device_tables(layout),
            0,
            0,
            out_w,
            0,
            0,
            np.float32(0.0),
            False,
            expert_map_device_table(layout.expert_map(rank)),
            out_w,
            out_ids,
        )
    else:
        d_shared = cuda.to_device(shared) if isinstance(shared, np.ndarray) else shared
        out_w, out_ids = route(
            cuda.to_device(device_logits),
            config,
            layout,
            rank,
            None if bias is None else cuda.to_device(bias),
            d_shared,
            home_rank,
        )
    got_w, got_ids = out_w.copy_to_host(), out_ids.copy_to_host()
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_allclose(got_w, want_w, rtol=WEIGHT_RTOL, atol=0)


@sim_only
def test_sim_device_argument_errors():
    from numba import cuda

    config = RouterConfig(16, 2)
    layout = ExpertLayout(16, 1, ep_size=2, dispatch="all2all")
    logits = cuda.to_device(np.zeros((2, 16), np.float32))
    with pytest.raises(TypeError, match=r"shared_weights is a host array"):
        route(logits, config, layout, 0, None, np.ones(2, np.float32))
    with pytest.raises(TypeError, match=r"correction_bias must live where logits live"):
        route(logits, config, layout, 0, np.zeros(16, np.float32))
    weights, local_ids = route(cuda.to_device(np.zeros((0, 16), np.float32)), config, layout)
    assert weights.shape == local_ids.shape == (0, 3)


# ------------------------------------------------------------------ device compile checks

LOCAL_MEMORY = re.compile(r"\b(ld|st)\.local\b")


@no_sim
@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        (256, 8, "sigmoid", True, True, "bfloat16"),
        (128, 1, "softmax", False, True, "float16"),
    ],
    ids=["deepseek-v3", "qwen3-30b"],
)
def test_route_kernel_compiles_to_ptx_without_local_memory(case):
    cuda = pytest.importorskip("numba.cuda")
    from moeroute.routing.select import _cuda as _select_device

    function = _select_device.route_kernel_function(*case)
    ptx, _ = cuda.compile_ptx(function, _select_device.route_signature(case[-1], "C", "A"), cc=(9, 0))
    assert ".target sm_90" in ptx
    assert "shfl.sync.bfly" in ptx and "vote.sync.ballot" in ptx
    assert not LOCAL_MEMORY.search(ptx), LOCAL_MEMORY.findall(ptx)[:5]


# ------------------------------------------------------------------ GPU


def _torch_cuda():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


@pytest.mark.gpu
@pytest.mark.skipif(
    SIMULATED or _torch_cuda() is None, reason="needs torch with a CUDA device (bench/gpu_check.py runs it)"
)
@pytest.mark.parametrize("launcher", ["numba", "cached"])
@pytest.mark.parametrize("num_tokens", [1, 64, 4099])
@pytest.mark.parametrize("label,kwargs", LAYOUTS[2:5], ids=[label for label, _ in LAYOUTS[2:5]])
def test_gpu_route_equals_the_cpu_composition(label, kwargs, num_tokens, launcher, monkeypatch):
    """Torch CUDA tensors in, torch CUDA tensors out, on both launchers: ids exactly and
    weights within WEIGHT_RTOL of the CPU composition, for a strided gate too."""
    torch = _torch_cuda()
    monkeypatch.setenv("MOEROUTE_CUDA_LAUNCHER", launcher)
    config = CONFIGS[0][1]
    layout = ExpertLayout(config.num_experts, **kwargs)
    rng = rng_for(label, num_tokens)
    logits = rng.standard_normal((num_tokens, config.num_experts)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(config.num_experts)).astype(np.float32)
    gate = rng.random((num_tokens, 2)).astype(np.float32)
    device_gate = torch.from_numpy(gate).cuda()[:, 1]  # strided: "A" layout
    rank = home_rank = layout.ep_size - 1
    weights, local_ids = route(
        torch.from_numpy(logits).cuda(), config, layout, rank, torch.from_numpy(bias).cuda(), device_gate, home_rank
    )
    assert weights.is_cuda and local_ids.is_cuda
    want_w, want_ids = composed(logits, config, layout, rank, bias, np.ascontiguousarray(gate[:, 1]), home_rank)
    np.testing.assert_array_equal(local_ids.cpu().numpy(), want_ids)
    np.testing.assert_allclose(weights.cpu().numpy(), want_w, rtol=WEIGHT_RTOL, atol=0)
