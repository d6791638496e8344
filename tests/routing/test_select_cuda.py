"""select_experts' CUDA kernel: simulator runs, device compile checks, GPU runs.

* ``test_sim_*`` run only under NUMBA_ENABLE_CUDASIM=1 (the simulator must be chosen
  before numba is imported): ``test_cuda_simulator_suite`` runs them in a subprocess and
  asserts they all passed. They compare the CUDA kernel with the CPU path on small shapes
  (the simulator runs every CUDA thread as a Python thread): ids exactly, weights with
  rtol 1e-6. They also exercise the simulator versions of the routing._warp helpers.
* Every kernel specialisation compiles to PTX for sm_80 and sm_90 (NVVM, no GPU needed)
  with warp shuffles, a ballot per pick round and without local-memory traffic; the
  per-lane sorting network sorts (0-1 principle).
* ``gpu`` tests run the kernel at full size on a real device against the CPU path.
"""

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

from moeroute.config import PRESETS, RouterConfig
from moeroute.routing._arrays import simulator_enabled

SIMULATED = simulator_enabled()
cuda = pytest.importorskip("numba.cuda")

from moeroute.routing import _warp  # noqa: E402
from moeroute.routing import select as select_module  # noqa: E402
from moeroute.routing.select import select_experts  # noqa: E402
from _simulator import run_simulator_suite  # noqa: E402

WEIGHT_RTOL = 1e-6

sim_only = pytest.mark.skipif(not SIMULATED, reason="runs inside the CUDA simulator subprocess")
no_sim = pytest.mark.skipif(SIMULATED, reason="needs the real numba.cuda, not the simulator")


def rng_for(*key):
    import zlib

    return np.random.default_rng(zlib.crc32(repr(key).encode()))


@no_sim
def test_cuda_simulator_suite():
    # The device's launch configuration: four warps per block (exact warp intrinsics).
    run_simulator_suite(Path(__file__), warps=select_module.DEVICE_WARPS_PER_BLOCK, select="test_sim_")


# ------------------------------------------------------------------ simulator


def device_select(logits, config, bias=None, **kwargs):
    d_bias = None if bias is None else cuda.to_device(bias)
    weights, ids = select_experts(cuda.to_device(logits), config, d_bias, **kwargs)
    return weights.copy_to_host(), ids.copy_to_host()


def assert_device_matches_host(logits, config, bias=None, **kwargs):
    host_logits = logits.astype(np.float32) if logits.dtype == np.int16 else logits
    host_w, host_ids = select_experts(host_logits, config, bias)
    dev_w, dev_ids = device_select(logits, config, bias, **kwargs)
    np.testing.assert_array_equal(dev_ids, host_ids)
    np.testing.assert_allclose(dev_w, host_w, rtol=WEIGHT_RTOL, atol=0)
    return dev_w, dev_ids


SIM_PRESET_CASES = [
    ("deepseek-v3", 0),
    ("deepseek-v3", 1),
    ("kimi-k2", 1),
    ("glm-4.5", 3),
    ("qwen3-30b-a3b", 1),
    ("qwen3.5-moe", 3),
    ("qwen1.5-moe-a2.7b", 3),
    ("mixtral-8x7b", 3),
]


@sim_only
@pytest.mark.parametrize("preset_name,num_tokens", SIM_PRESET_CASES)
def test_sim_presets_match_cpu(preset_name, num_tokens):
    preset = PRESETS[preset_name]
    config = preset.router
    rng = rng_for(preset_name, num_tokens)
    logits = rng.standard_normal((num_tokens, config.num_experts)).astype(np.float32)
    bias = None
    if preset.has_correction_bias:
        bias = (0.1 * rng.standard_normal(config.num_experts)).astype(np.float32)
    assert_device_matches_host(logits, config, bias, stream=cuda.default_stream())


@sim_only
@pytest.mark.parametrize("preset_name", ["qwen3-30b-a3b", "glm-4.5"])
def test_sim_float16_matches_cpu(preset_name):
    preset = PRESETS[preset_name]
    rng = rng_for("half", preset_name)
    logits = rng.standard_normal((1, preset.router.num_experts)).astype(np.float16)
    bias = (
        (0.1 * rng.standard_normal(preset.router.num_experts)).astype(np.float32)
        if preset.has_correction_bias
        else None
    )
    assert_device_matches_host(logits, preset.router, bias)


@sim_only
def test_sim_bfloat16_bits_match_cpu():
    # bfloat16 reaches the kernel as int16 bits: x = float32 with the low 16 bits cleared.
    config = PRESETS["qwen3.5-moe"].router
    values = rng_for("bf16").standard_normal((2, config.num_experts)).astype(np.float32)
    bits = (values.view(np.uint32) >> 16).astype(np.uint16).view(np.int16)
    as_float = (bits.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    kernel = select_module._device_kernel(config.num_experts, 1, "softmax", False, True, "bfloat16")
    out_w = cuda.device_array((2, config.top_k), np.float32)
    out_ids = cuda.device_array((2, config.top_k), np.int32)
    warps = select_module._device_warps_per_block()
    kernel[-(-2 // warps), warps * 32](
        cuda.to_device(bits), out_w.reshape(-1), 2, config.top_k, 1, np.float32(1.0), out_w, out_ids
    )
    host_w, host_ids = select_experts(as_float, config)
    np.testing.assert_array_equal(out_ids.copy_to_host(), host_ids)
    np.testing.assert_allclose(out_w.copy_to_host(), host_w, rtol=WEIGHT_RTOL)


SIM_CONFIGS = {
    # Exact softmax path (bias) with grouped routing by top-2 sums.
    "softmax, bias, groups": (
        RouterConfig(64, 4, "softmax", num_expert_group=4, topk_group=2, routed_scaling_factor=2.0),
        True,
    ),
    "sigmoid, no bias, groups": (
        RouterConfig(48, 5, "sigmoid", num_expert_group=3, topk_group=2, renormalize=False),
        False,
    ),
    "K = 32": (RouterConfig(33, 32, "softmax"), False),
    # Groups of whole slots (64 experts = 2 slots): membership fixed at compile time.
    "sigmoid, bias, groups of 64": (
        RouterConfig(128, 6, "sigmoid", num_expert_group=2, topk_group=1, routed_scaling_factor=2.5),
        True,
    ),
    "N = 33": (RouterConfig(33, 3, "softmax", renormalize=False, routed_scaling_factor=0.5), False),
    "sqrtsoftplus, bias, groups": (
        RouterConfig(64, 4, "sqrtsoftplus", num_expert_group=4, topk_group=2, routed_scaling_factor=2.5),
        True,
    ),
    "sqrtsoftplus, no renormalize": (RouterConfig(40, 3, "sqrtsoftplus", renormalize=False), False),
    "none": (RouterConfig(40, 3, "none", renormalize=False, routed_scaling_factor=1.5), False),
    "none, renormalize, bias": (RouterConfig(48, 4, "none", renormalize=True), True),
}


@sim_only
@pytest.mark.parametrize("name", list(SIM_CONFIGS))
def test_sim_configurations_match_cpu(name):
    config, with_bias = SIM_CONFIGS[name]
    rng = rng_for(name)
    logits = (2.0 * rng.standard_normal((1, config.num_experts))).astype(np.float32)
    bias = (0.3 * rng.standard_normal(config.num_experts)).astype(np.float32) if with_bias else None
    assert_device_matches_host(logits, config, bias)


def special_rows(num_experts, rng):
    nan, inf = np.nan, np.inf
    one_inf = rng.standard_normal(num_experts)
    one_inf[num_experts // 3] = inf
    mixed = rng.standard_normal(num_experts)
    mixed[::2] = nan
    mixed[1::4] = -inf
    rows = [np.full(num_experts, nan), np.full(num_experts, inf), one_inf, mixed]
    return np.array(rows, np.float32)


@sim_only
@pytest.mark.parametrize(
    "config,with_bias",
    [
        (RouterConfig(64, 4, "sigmoid", num_expert_group=4, topk_group=2, routed_scaling_factor=2.5), True),
        (RouterConfig(40, 3, "softmax", renormalize=False), False),
        (RouterConfig(40, 3, "sqrtsoftplus", num_expert_group=4, topk_group=2), True),
        (RouterConfig(40, 3, "none", renormalize=True, routed_scaling_factor=2.0), False),
    ],
    ids=["sigmoid-bias-groups", "softmax-no-renormalize", "sqrtsoftplus-bias-groups", "none-renormalize"],
)
def test_sim_nan_and_inf_rows_match_cpu(config, with_bias):
    rng = rng_for("special", config)
    logits = special_rows(config.num_experts, rng)
    bias = (0.1 * rng.standard_normal(config.num_experts)).astype(np.float32) if with_bias else None
    if with_bias:
        bias[5] = np.nan
    with np.errstate(invalid="ignore", over="ignore"):
        dev_w, dev_ids = assert_device_matches_host(logits, config, bias)
    assert np.isfinite(dev_w).all()
    assert all(len(set(row)) == config.top_k for row in dev_ids.tolist())


@sim_only
def test_sim_raw_logit_renormalize_rule_matches_cpu():
    # Positive, zero, negative and overflowing sums of the picked logits (scoring "none").
    config = RouterConfig(4, 2, "none", renormalize=True)
    logits = np.array(
        [[3.0, 1.0, -5.0, 0.5], [1.0, -1.0, -5.0, -6.0], [-1.0, -2.0, -5.0, -6.0], [3e38, 3e38, 0.0, 0.0]], np.float32
    )
    with np.errstate(over="ignore"):
        dev_w, dev_ids = assert_device_matches_host(logits, config)
    np.testing.assert_allclose(dev_w, [[0.75, 0.25], [1e20, -1e20], [-1.0, -2.0], [3e38, 3e38]], rtol=WEIGHT_RTOL)


@sim_only
def test_sim_zero_tokens_returns_empty_device_arrays():
    config = PRESETS["deepseek-v3"].router
    weights, ids = select_experts(
        cuda.to_device(np.empty((0, 256), np.float32)), config, cuda.to_device(np.zeros(256, np.float32))
    )
    assert _arrays_is_device(weights) and _arrays_is_device(ids)
    assert weights.shape == ids.shape == (0, 8)
    assert weights.dtype == np.float32 and ids.dtype == np.int32


def _arrays_is_device(array):
    from moeroute.routing._arrays import is_device_array

    return is_device_array(array)


@sim_only
@pytest.mark.parametrize(
    "config,error,match",
    [
        (RouterConfig(1056, 4, "softmax"), ValueError, r"num_experts=1056 exceeds the device kernel limit 1024"),
        (RouterConfig(64, 33, "softmax"), ValueError, r"top_k=33 exceeds the device kernel limit 32"),
        (
            RouterConfig(128, 4, "softmax", num_expert_group=64, topk_group=8),
            ValueError,
            r"num_expert_group=64 exceeds the device kernel limit 32",
        ),
    ],
    ids=["experts", "top_k", "groups"],
)
def test_sim_device_limits(config, error, match):
    logits = cuda.to_device(np.zeros((1, config.num_experts), np.float32))
    with pytest.raises(error, match=match):
        select_experts(logits, config)


@sim_only
def test_sim_invalid_device_arguments():
    config = PRESETS["glm-4.5"].router
    logits = cuda.to_device(np.zeros((1, 160), np.float32))
    with pytest.raises(TypeError, match=r"correction_bias must live where logits live.*ndarray"):
        select_experts(logits, config, np.zeros(160, np.float32))
    with pytest.raises(ValueError, match=r"logits dtype float64 is not supported on the device"):
        select_experts(cuda.to_device(np.zeros((1, 160))), config)
    strided = cuda.to_device(np.zeros((2, 320), np.float32))[:, ::2]
    with pytest.raises(ValueError, match=r"device logits must be C-contiguous, got strides \(1280, 8\)"):
        select_experts(strided, config)
    with pytest.raises(ValueError, match=r"logits.shape\[1\]=161 does not match"):
        select_experts(cuda.to_device(np.zeros((1, 161), np.float32)), config)


@sim_only
def test_sim_warp_helpers_fallback():
    assert _warp.SIMULATED and _warp.warps_per_block(4) == min(4, _warp.SIM_WARPS)

    @cuda.jit
    def helpers(keys, values, out_max, out_sum, out_idx, out_xor, out_bits, out_float):
        lane = cuda.threadIdx.x
        out_max[lane] = _warp.allreduce_max(keys[lane])
        out_sum[lane] = _warp.allreduce_sum(values[lane])
        out_idx[lane] = _warp.shfl_idx(values[lane], 7)
        out_xor[lane] = _warp.shfl_xor(keys[lane], 5)
        out_bits[lane] = _warp.float_as_int(values[lane])
        out_float[lane] = _warp.int_as_float(out_bits[lane])

    rng = rng_for("warp")
    keys = rng.integers(-(2**62), 2**62, 32).astype(np.int64)
    values = rng.standard_normal(32).astype(np.float32)
    outs = [
        np.zeros(32, np.int64),
        np.zeros(32, np.float32),
        np.zeros(32, np.float32),
        np.zeros(32, np.int64),
        np.zeros(32, np.int32),
        np.zeros(32, np.float32),
    ]
    helpers[1, 32](keys, values, *outs)
    out_max, out_sum, out_idx, out_xor, out_bits, out_float = outs
    np.testing.assert_array_equal(out_max, np.full(32, keys.max()))
    # The butterfly sum has the host's lane order, bit for bit.
    lane_sums = np.zeros(32, np.float32)
    expected = select_module._lane_order_sum(values, lane_sums)
    np.testing.assert_array_equal(out_sum, np.full(32, expected, np.float32))
    np.testing.assert_array_equal(out_idx, np.full(32, values[7]))
    np.testing.assert_array_equal(out_xor, keys[np.arange(32) ^ 5])
    np.testing.assert_array_equal(out_bits, values.view(np.int32))
    np.testing.assert_array_equal(out_float, values)


# ------------------------------------------------------------------ device compile checks

# (name, N, G, scoring, bias, renormalize, input kind): every code shape the kernel takes.
PTX_CASES = [
    ("deepseek-v3", 256, 8, "sigmoid", True, True, "float32"),
    ("kimi-k2", 384, 1, "sigmoid", True, True, "bfloat16"),
    ("glm-4.5", 160, 1, "sigmoid", True, True, "float16"),
    ("qwen3-30b-a3b", 128, 1, "softmax", False, True, "float16"),
    ("qwen3.5-moe", 512, 1, "softmax", False, True, "bfloat16"),
    ("qwen1.5-moe-a2.7b", 60, 1, "softmax", False, False, "float32"),
    ("mixtral-8x7b", 8, 1, "softmax", False, True, "float32"),
    ("softmax-bias-groups", 64, 4, "softmax", True, True, "float32"),
    ("softmax-groups", 128, 8, "softmax", False, True, "bfloat16"),
    ("sigmoid-no-bias-groups", 48, 3, "sigmoid", False, False, "float32"),
    ("sqrtsoftplus-bias-groups", 256, 8, "sqrtsoftplus", True, True, "bfloat16"),
    ("none-renormalize", 128, 1, "none", False, True, "float32"),
    ("none-bias-groups", 64, 4, "none", True, False, "float16"),
]
LOCAL_MEMORY = re.compile(r"\b(ld|st)\.local\b")
# sm_90 takes every code shape; sm_80 the shapes that stress registers most (the largest N,
# grouped sigmoid with a bias, each input kind): the kernel has no per-architecture code.
SM80_CASES = ("deepseek-v3", "kimi-k2", "qwen3.5-moe", "none-bias-groups")
PTX_TARGETS = [
    pytest.param(
        case,
        ((9, 0), (8, 0)) if case[0] in SM80_CASES else ((9, 0),),
        id=f"{case[0]}-sm90" + ("-sm80" if case[0] in SM80_CASES else ""),
    )
    for case in PTX_CASES
]


def _ptx_per_architecture(function, signature, ccs):
    """``{cc: PTX}``, as ``cuda.compile_ptx(function, signature, cc=cc)`` makes it for each,
    with the kernel typed and lowered to LLVM IR once (most of a compile) and only NVVM run per
    architecture: numba-cuda's lowering compares the compute capability with sm_75 and older
    ones only, so sm_80 and sm_90 get the same IR (the PTX equals compile_ptx's up to the
    names' unique suffixes)."""
    from numba.core.compiler_lock import global_compiler_lock
    from numba.cuda.compiler import _compile_pyfunc_with_fixup

    with global_compiler_lock:
        library, _ = _compile_pyfunc_with_fixup(function, signature, device=False, cc=max(ccs), abi="numba")
        return {cc: library.get_asm_str(cc=cc) for cc in ccs}


@no_sim
@pytest.mark.slow
@pytest.mark.parametrize("case, ccs", PTX_TARGETS)
def test_kernel_compiles_to_ptx_without_local_memory(case, ccs):
    name, num_experts, groups, scoring, has_bias, renormalize, kind = case
    function = select_module._device_kernel_function(num_experts, groups, scoring, has_bias, renormalize, kind)
    ptxes = _ptx_per_architecture(function, select_module._device_signature(kind), ccs)
    for cc, ptx in ptxes.items():
        assert f".target sm_{cc[0]}{cc[1]}" in ptx, cc
        assert "shfl.sync.bfly" in ptx, cc
        # The pick rounds: the winner's lane by ballot, its id by an indexed shuffle, its next
        # candidate from the lane's sorted column in shared memory.
        assert "vote.sync.ballot" in ptx and "shfl.sync.idx" in ptx, cc
        assert re.search(r"\bld\.shared\.u64\b", ptx), cc
        # N <= 512 keeps every per-lane array in registers (K is a run-time value).
        assert not LOCAL_MEMORY.search(ptx), (cc, LOCAL_MEMORY.findall(ptx)[:5])


@pytest.mark.parametrize("size", list(range(1, 33)))
def test_sorting_network_sorts(size):
    # 0-1 principle: a comparator network sorts every input iff it sorts every 0/1 input;
    # exhaustive up to 16 elements, sampled above; the generated function on random keys.
    from moeroute.routing.select._cuda import _sort_descending_function, sorting_network

    pairs = sorting_network(size)
    assert all(0 <= i < j < size for i, j in pairs)
    if size <= 16:
        rows = ((np.arange(1 << size)[:, None] >> np.arange(size)) & 1).astype(np.int8)
    else:
        rows = (rng_for("network", size).random((1 << 14, size)) < 0.5).astype(np.int8)
    for i, j in pairs:
        high = np.maximum(rows[:, i], rows[:, j])
        rows[:, j] = np.minimum(rows[:, i], rows[:, j])
        rows[:, i] = high
    assert (np.diff(rows.astype(int), axis=1) <= 0).all()
    keys = rng_for("keys", size).integers(-(2**62), 2**62, size)
    keys[: size // 2] = keys[0]  # repeated values
    values = keys.copy()
    _sort_descending_function(size)(values)
    np.testing.assert_array_equal(values, np.sort(keys)[::-1])


@no_sim
def test_warp_helpers_compile_to_shuffles():
    def kernel(keys, values, out_i, out_f):
        lane = cuda.threadIdx.x
        out_i[lane] = _warp.allreduce_max(keys[lane])
        out_f[lane] = (
            _warp.allreduce_sum(values[lane])
            + _warp.shfl_idx(values[lane], 3)
            + _warp.int_as_float(_warp.float_as_int(values[lane]))
        )

    from numba import types

    signature = (types.int64[::1], types.float32[::1], types.int64[::1], types.float32[::1])
    ptx, _ = cuda.compile_ptx(kernel, signature, cc=(9, 0))
    assert ptx.count("shfl.sync.bfly") >= 15  # 5 steps x (2 for int64 + 1 for float32)
    assert "shfl.sync.idx" in ptx
    assert "bar.sync" not in ptx  # the shuffle path, not the simulator fallback


# ------------------------------------------------------------------ GPU

requires_gpu = pytest.mark.skipif(
    SIMULATED or not cuda.is_available(), reason="needs a CUDA GPU (numba.cuda.is_available() is False)"
)


def _near_tie_rows():
    spec = importlib.util.spec_from_file_location("_select_tests", Path(__file__).with_name("test_select.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.near_tie_rows


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("preset_name", list(PRESETS))
@pytest.mark.parametrize("num_tokens", [1, 64, 4096, 65536])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_gpu_matches_cpu(preset_name, num_tokens, dtype):
    preset = PRESETS[preset_name]
    config = preset.router
    rng = rng_for("gpu", preset_name, num_tokens, dtype)
    logits = rng.standard_normal((num_tokens, config.num_experts)).astype(dtype)
    bias = (0.1 * rng.standard_normal(config.num_experts)).astype(np.float32) if preset.has_correction_bias else None
    host_w, host_ids = select_experts(logits, config, bias)
    dev_w, dev_ids = device_select(logits, config, bias)
    same = (dev_ids == host_ids).all(axis=1)
    if not same.all():
        # libdevice's expf and the host's exp may round 2 ulp apart: only near ties may move.
        near = _near_tie_rows()(logits[~same], config, bias)
        assert near.all() and (~same).sum() <= 1e-3 * num_tokens
    np.testing.assert_allclose(dev_w[same], host_w[same], rtol=WEIGHT_RTOL)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_gpu_torch_tensors_stay_on_device(dtype):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA build here")
    preset = PRESETS["deepseek-v3"]
    config = preset.router
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(1000, 256, generator=generator).to(getattr(torch, dtype))
    bias = 0.1 * torch.randn(256, generator=generator)
    weights, ids = select_experts(logits.cuda(), config, bias.cuda())
    assert isinstance(weights, torch.Tensor) and weights.is_cuda and ids.dtype == torch.int32
    host_w, host_ids = select_experts(logits.float().numpy(), config, bias.numpy())
    np.testing.assert_array_equal(ids.cpu().numpy(), host_ids)
    np.testing.assert_allclose(weights.cpu().numpy(), host_w, rtol=WEIGHT_RTOL)
    empty_w, empty_ids = select_experts(logits[:0].cuda(), config, bias.cuda())
    assert tuple(empty_w.shape) == tuple(empty_ids.shape) == (0, 8)
