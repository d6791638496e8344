"""Every public routing op on every framework: NumPy arrays, CPU torch tensors, and (under the
CUDA simulator, or on a GPU) numba device arrays, CuPy arrays and torch CUDA tensors.

Each op's answer is checked against ``moeroute.routing.reference`` (ids exactly, weights
with a stated tolerance) and must come back in the input's framework, dtype and device.
bfloat16 and float16 logits must route exactly as their float32 upcast.
"""

from __future__ import annotations

import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import moeroute
from moeroute.config import RouterConfig
from moeroute.layout import ExpertLayout
from moeroute.routing import _arrays, reference
from _simulator import run_simulator_suite  # noqa: E402

WEIGHT_RTOL = 1e-6  # float32 routing weights: a few ulps between kernel and reference
TOKENS = 37

ROUTERS = {
    "softmax": RouterConfig(32, 4, "softmax", renormalize=True),
    "softmax-raw": RouterConfig(32, 4, "softmax", renormalize=False, routed_scaling_factor=1.5),
    "sigmoid-groups": RouterConfig(32, 3, "sigmoid", num_expert_group=4, topk_group=2, routed_scaling_factor=2.5),
}
#: Logit dtypes of CPU torch tensors; every one routes as its float32 upcast.
TORCH_LOGIT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]

SIM_MODULE = Path(__file__).with_name("_sim_frameworks.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
SIM_TIMEOUT_S = 600  # the suite takes well under a minute; this only guards against a hang


def _rng(*key):
    return np.random.default_rng([zlib.crc32(str(k).encode()) for k in key])


def _logits(tokens, experts, seed=0):
    return _rng("logits", tokens, experts, seed).standard_normal((tokens, experts)).astype(np.float32)


def _torch_ids(rows, cols, high, seed=0, dtype=torch.int32):
    ids = _rng("ids", rows, cols, high, seed).integers(-1, high + 1, size=(rows, cols))
    return torch.from_numpy(ids).to(dtype)


# ------------------------------------------------------------------ select_experts


@pytest.mark.parametrize("name", list(ROUTERS))
@pytest.mark.parametrize("dtype", TORCH_LOGIT_DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [0, 1, TOKENS])
def test_select_experts_cpu_torch_routes_as_float32_upcast(name, dtype, tokens):
    config = ROUTERS[name]
    logits = torch.from_numpy(_logits(tokens, config.num_experts)).to(dtype)
    bias = torch.from_numpy(_logits(1, config.num_experts, 1)[0]) * 0.1 if config.scoring == "sigmoid" else None
    weights, ids = moeroute.select_experts(logits, config, bias)
    upcast = logits.float().numpy()  # exact for float16 and bfloat16
    ref_w, ref_ids = reference.select_experts(upcast, config, None if bias is None else bias.numpy())
    assert isinstance(weights, torch.Tensor) and isinstance(ids, torch.Tensor)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.device.type == ids.device.type == "cpu"
    assert np.array_equal(ids.numpy(), ref_ids)
    np.testing.assert_allclose(weights.numpy(), ref_w, rtol=WEIGHT_RTOL, atol=0)


@pytest.mark.parametrize("name", list(ROUTERS))
def test_select_experts_bf16_bits_equal_float32_upcast_bit_for_bit(name):
    # The same kernel on float32 input and on bfloat16 input (upcast by a table of bit
    # patterns) must give identical ids and weights, bit for bit.
    config = ROUTERS[name]
    logits = torch.from_numpy(_logits(TOKENS, config.num_experts, 2)).to(torch.bfloat16)
    w16, ids16 = moeroute.select_experts(logits, config)
    w32, ids32 = moeroute.select_experts(logits.float().numpy(), config)
    assert np.array_equal(ids16.numpy(), ids32)
    assert np.array_equal(w16.numpy().view(np.uint32), w32.view(np.uint32))


def test_select_experts_numpy_in_numpy_out_and_noncontiguous_torch():
    config = ROUTERS["softmax"]
    logits = _logits(TOKENS, config.num_experts)
    weights, ids = moeroute.select_experts(logits, config)
    assert isinstance(weights, np.ndarray) and isinstance(ids, np.ndarray)
    # A transposed (non-contiguous) CPU tensor routes as its contiguous copy.
    strided = torch.from_numpy(np.ascontiguousarray(logits.T)).T
    assert not strided.is_contiguous()
    t_weights, t_ids = moeroute.select_experts(strided, config)
    assert np.array_equal(t_ids.numpy(), ids)
    np.testing.assert_array_equal(t_weights.numpy(), weights)


def test_select_experts_accepts_tensors_that_require_grad():
    config = ROUTERS["softmax"]
    logits = torch.from_numpy(_logits(5, config.num_experts)).requires_grad_(True)
    _, ids = moeroute.select_experts(logits, config)
    _, ref_ids = reference.select_experts(logits.detach().numpy(), config)
    assert np.array_equal(ids.numpy(), ref_ids)


def test_select_experts_rejects_unsupported_inputs():
    config = ROUTERS["softmax"]
    with pytest.raises(TypeError, match="logits must be a NumPy array, a torch tensor"):
        moeroute.select_experts([[0.0] * 32], config)
    with pytest.raises(ValueError, match="logits dtype float64 is not supported"):
        moeroute.select_experts(torch.zeros(2, 32, dtype=torch.float64), config)
    with pytest.raises(ValueError, match="CPU tensor"):
        moeroute.select_experts(torch.zeros(2, 32, device="meta"), config)
    with pytest.raises(ValueError, match="correction_bias dtype bfloat16 must be float32"):
        moeroute.select_experts(torch.zeros(2, 32), config, torch.zeros(32, dtype=torch.bfloat16))


# ------------------------------------------------------------------ out= buffers


@pytest.mark.parametrize("framework", ["numpy", "torch", "torch-bfloat16"])
def test_select_experts_writes_into_out_buffers(framework):
    config = ROUTERS["sigmoid-groups"]
    logits = _logits(TOKENS, config.num_experts, 3)
    bias = 0.1 * _logits(1, config.num_experts, 4)[0]
    if framework == "torch-bfloat16":
        logits = torch.from_numpy(logits).to(torch.bfloat16).float().numpy()  # exact upcast
    ref_w, ref_ids = reference.select_experts(logits, config, bias)
    if framework.startswith("torch"):
        logits, bias = torch.from_numpy(logits), torch.from_numpy(bias)
        if framework == "torch-bfloat16":
            logits = logits.to(torch.bfloat16)
        out = (torch.full((TOKENS, 3), -7.0), torch.full((TOKENS, 3), -7, dtype=torch.int32))
    else:
        out = (np.full((TOKENS, 3), -7.0, np.float32), np.full((TOKENS, 3), -7, np.int32))
    result = moeroute.select_experts(logits, config, bias, out=out)
    assert result[0] is out[0] and result[1] is out[1]
    assert np.array_equal(np.asarray(out[1]), ref_ids)
    np.testing.assert_allclose(np.asarray(out[0]), ref_w, rtol=WEIGHT_RTOL, atol=0)


def test_select_experts_out_buffers_are_validated():
    config = ROUTERS["softmax"]
    logits = torch.from_numpy(_logits(4, config.num_experts))
    good_w, good_ids = torch.empty(4, 4), torch.empty(4, 4, dtype=torch.int32)
    cases = [
        ((good_w,), TypeError, r"out must be a \(topk_weights, topk_ids\) pair"),
        ((torch.empty(4, 5), good_ids), ValueError, r"out\[0\] \(topk_weights\) has shape \(4, 5\)"),
        (
            (good_w, torch.empty(4, 4, dtype=torch.int64)),
            ValueError,
            r"out\[1\] \(topk_ids\) has dtype int64, expected int32",
        ),
        ((torch.empty(4, 4, dtype=torch.float64), good_ids), ValueError, "dtype float64"),
        ((torch.empty(4, 4).T, good_ids), ValueError, "C-contiguous"),
        ((np.empty((4, 4), np.float32), good_ids), TypeError, "must be a torch tensor like logits"),
        (
            (good_w, torch.empty(4, 4, dtype=torch.int32, device="meta")),
            ValueError,
            r"out\[1\] \(topk_ids\) is on meta but logits is on cpu",
        ),
    ]
    for out, error, match in cases:
        with pytest.raises(error, match=match):
            moeroute.select_experts(logits, config, out=out)
    with pytest.raises(TypeError, match="must be a NumPy array like logits"):
        moeroute.select_experts(logits.numpy(), config, out=(good_w, good_ids))
    with pytest.raises(ValueError, match="read-only"):
        frozen = np.empty((4, 4), np.float32)
        frozen.flags.writeable = False
        moeroute.select_experts(logits.numpy(), config, out=(frozen, good_ids.numpy()))


# An out= buffer that shares memory with another output or an input is refused: the
# kernels would read what they already overwrote (ids like 1053609165 came back before).


def _overlap_cases(framework, tokens, experts, top_k):
    """(logits, bias, out, message) per way of aliasing, all views of one float32 buffer."""
    size = tokens * experts
    if framework == "numpy":
        buffer = _rng(5).standard_normal(size + tokens * top_k + 2 * experts).astype(np.float32)
        as_int32 = lambda a: a.view(np.int32)  # noqa: E731
        flat = buffer
    else:
        flat = torch.from_numpy(_rng(5).standard_normal(size + tokens * top_k + 2 * experts).astype(np.float32))
        as_int32 = lambda a: a.view(torch.int32)  # noqa: E731
    logits = flat[:size].reshape(tokens, experts)
    bias = flat[size : size + experts]
    spare = flat[size + experts : size + experts + tokens * top_k].reshape(tokens, top_k)
    other = (
        np.empty((tokens, top_k), np.int32) if framework == "numpy" else torch.empty(tokens, top_k, dtype=torch.int32)
    )
    last_row = flat[size - experts : size - experts + tokens * top_k].reshape(tokens, top_k)
    two_rows = flat[size - 2 * experts : size - 2 * experts + tokens * top_k].reshape(tokens, top_k)
    into_bias = flat[size + experts - 1 : size + experts - 1 + tokens * top_k].reshape(tokens, top_k)
    return (
        logits,
        bias,
        spare,
        other,
        [
            ((spare, as_int32(spare)), r"out\[0\] \(topk_weights\) overlaps out\[1\] \(topk_ids\)"),
            ((last_row, other), r"out\[0\] \(topk_weights\) overlaps logits"),
            ((two_rows, other), r"out\[0\] \(topk_weights\) overlaps logits"),
            ((spare, as_int32(last_row)), r"out\[1\] \(topk_ids\) overlaps logits"),
            ((into_bias, other), r"out\[0\] \(topk_weights\) overlaps correction_bias"),
        ],
    )


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_select_experts_refuses_out_buffers_sharing_memory(framework):
    config = RouterConfig(16, 4, "sigmoid", num_expert_group=4, topk_group=2)
    logits, bias, spare, other, cases = _overlap_cases(framework, 6, 16, 4)
    for out, match in cases:
        before = np.asarray(logits).copy()
        with pytest.raises(ValueError, match=match):
            moeroute.select_experts(logits, config, bias, out=out)
        np.testing.assert_array_equal(np.asarray(logits), before)  # nothing was written
    # Adjacent, not overlapping: accepted, and the answer is the reference's.
    ref_w, ref_ids = reference.select_experts(np.asarray(logits), config, np.asarray(bias))
    weights, ids = moeroute.select_experts(logits, config, bias, out=(spare, other))
    assert weights is spare and ids is other
    np.testing.assert_array_equal(np.asarray(ids), ref_ids)
    np.testing.assert_allclose(np.asarray(weights), ref_w, rtol=WEIGHT_RTOL, atol=0)


def test_select_experts_names_a_meta_tensor():
    config = ROUTERS["softmax"]
    with pytest.raises(ValueError, match=r"logits is on meta; select_experts takes a CPU tensor, a CUDA tensor"):
        moeroute.select_experts(torch.empty(4, config.num_experts, device="meta"), config)
    with pytest.raises(ValueError, match=r"correction_bias is on meta"):
        moeroute.select_experts(
            torch.zeros(4, config.num_experts), config, torch.empty(config.num_experts, device="meta")
        )


def test_expert_load_and_accumulate_rows_refuse_out_over_their_inputs():
    from moeroute.routing.combine import accumulate_rows

    ids = np.array([[0, 1, 3, 3], [2, 3, 0, 1]], np.int64)
    with pytest.raises(ValueError, match=r"out overlaps ids"):
        moeroute.expert_load(ids, 4, out=ids[0])  # the counts would change the ids they count
    np.testing.assert_array_equal(ids, [[0, 1, 3, 3], [2, 3, 0, 1]])
    tensor_ids = torch.from_numpy(ids)
    with pytest.raises(ValueError, match=r"out overlaps ids"):
        moeroute.expert_load(tensor_ids, 4, out=tensor_ids[1])
    counter = np.zeros(4, np.int64)
    np.testing.assert_array_equal(moeroute.expert_load(ids, 4, out=counter), reference.expert_load(ids, 4))

    buffer = np.arange(18, dtype=np.float32).reshape(6, 3)
    tokens, weights = np.array([0, 2]), np.ones(2, np.float32)
    with pytest.raises(ValueError, match=r"out overlaps rows"):
        accumulate_rows(buffer[:4], buffer[3:5], tokens, weights)
    flat = np.zeros(14, np.float32)
    with pytest.raises(ValueError, match=r"out overlaps weights"):
        accumulate_rows(flat[:12].reshape(4, 3), np.ones((2, 3), np.float32), tokens, flat[11:13])
    out = np.zeros((4, 3), np.float32)
    accumulate_rows(out, buffer[3:5], tokens, weights)  # disjoint: out[0] = row 3, out[2] = row 4
    np.testing.assert_array_equal(out[[0, 2]], buffer[3:5])


class _CudaArrayLike:
    """A device array as the CUDA array interface describes it (no memory behind it)."""

    def __init__(self, pointer, shape, typestr="<f4", strides=None):
        self.__cuda_array_interface__ = {
            "data": (pointer, False),
            "shape": shape,
            "typestr": typestr,
            "strides": strides,
            "version": 3,
        }


def test_device_arrays_overlap_by_their_byte_spans():
    a = _CudaArrayLike(4096, (4, 8))  # 128 bytes: [4096, 4224)
    assert _arrays.memory_span(a) == ("device", 4096, 4224)
    assert _arrays.memory_span(_CudaArrayLike(4096, (4, 2), strides=(32, 4))) == ("device", 4096, 4200)
    assert _arrays.memory_span(_CudaArrayLike(4096, (0, 8))) is None
    assert _arrays.overlaps(a, _CudaArrayLike(4224 - 4, (1,), "<i4"))  # the last element
    assert not _arrays.overlaps(a, _CudaArrayLike(4224, (4, 8)))  # adjacent
    assert not _arrays.overlaps(a, _CudaArrayLike(4096, (0, 8)))  # empty
    assert not _arrays.overlaps(a, np.zeros(4))  # host and device never overlap
    with pytest.raises(ValueError, match=r"out\[1\] \(topk_ids\) overlaps logits"):
        _arrays.check_no_overlap(
            {
                "out[0] (topk_weights)": _CudaArrayLike(8192, (4, 2)),
                "out[1] (topk_ids)": _CudaArrayLike(4200, (4, 2), "<i4"),
            },
            {"logits": a, "correction_bias": None},
        )
    # torch tensors are measured by their own data_ptr and strides, NumPy arrays by theirs;
    # host spans that meet are then compared exactly.
    t = torch.zeros(6, 8)
    start = t.data_ptr()
    assert _arrays.memory_span(t[1:3]) == ("host", start + 32, start + 96)
    assert _arrays.memory_span(t[:, 2]) == ("host", start + 8, start + 5 * 32 + 12)
    assert _arrays.memory_span(t.numpy()[:, 2]) == ("host", start + 8, start + 5 * 32 + 12)
    assert not _arrays.overlaps(t[:, 2], t[:, 3])  # interleaved, no shared element
    assert _arrays.overlaps(t[:, 2], t[4:5].numpy())
    assert not _arrays.overlaps(t[:, 2], _CudaArrayLike(start, (6, 8)))  # host vs device


# ------------------------------------------------------------------ dispatch primitives


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64], ids=str)
def test_logical_to_physical_and_remap_on_torch(id_dtype):
    layout = ExpertLayout(16, num_shared_experts=1, ep_size=4, dispatch="all2all", num_redundant_experts=4)
    ids = _torch_ids(TOKENS, 4, 16, 5, id_dtype)
    physical = moeroute.logical_to_physical(ids, layout)
    assert isinstance(physical, torch.Tensor) and physical.dtype == torch.int32
    assert np.array_equal(physical.numpy(), reference.logical_to_physical(ids.numpy(), layout))
    expert_map = layout.expert_map(2)
    for table in (expert_map, torch.from_numpy(expert_map)):
        local = moeroute.remap_to_local(physical, table)
        assert isinstance(local, torch.Tensor) and local.dtype == torch.int32
        assert np.array_equal(local.numpy(), reference.remap_to_local(physical.numpy(), expert_map))


@pytest.mark.parametrize("shared_weights", [None, "tensor", 0.5])
def test_append_shared_slots_on_torch(shared_weights):
    layout = ExpertLayout(16, num_shared_experts=2, ep_size=2, dispatch="all2all")
    ids = _torch_ids(TOKENS, 4, 16, 6)
    weights = torch.from_numpy(_rng("w").random((TOKENS, 4)).astype(np.float32))
    if shared_weights == "tensor":
        shared_weights = torch.from_numpy(_rng("g").random(TOKENS).astype(np.float32))
    out_w, out_ids = moeroute.append_shared_slots(weights, ids, layout, 1, shared_weights)
    ref_shared = shared_weights.numpy() if isinstance(shared_weights, torch.Tensor) else shared_weights
    ref_w, ref_ids = reference.append_shared_slots(weights.numpy(), ids.numpy(), layout, 1, ref_shared)
    assert isinstance(out_ids, torch.Tensor) and isinstance(out_w, torch.Tensor)
    assert out_ids.dtype == torch.int32 and out_w.dtype == torch.float32
    assert np.array_equal(out_ids.numpy(), ref_ids)
    np.testing.assert_allclose(out_w.numpy(), ref_w, rtol=0, atol=0)


def test_append_shared_slots_bf16_weights_are_converted_by_torch():
    layout = ExpertLayout(8, num_shared_experts=1)
    ids = _torch_ids(6, 2, 8, 7)
    weights = torch.tensor(_rng("w16").random((6, 2)), dtype=torch.bfloat16)
    out_w, _ = moeroute.append_shared_slots(weights, ids, layout)
    np.testing.assert_array_equal(out_w[:, :2].numpy(), weights.float().numpy())


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("tokens", [0, TOKENS])
def test_align_and_sort_on_torch(id_dtype, tokens):
    ids = _torch_ids(tokens, 4, 12, 8, id_dtype)
    sorted_ids, expert_ids, total = moeroute.align_block_size(ids, 12, 4)
    ref_sorted, ref_experts, ref_total = reference.align_block_size(ids.numpy(), 12, 4)
    assert isinstance(sorted_ids, torch.Tensor) and isinstance(expert_ids, torch.Tensor)
    assert np.array_equal(sorted_ids.numpy(), ref_sorted)
    assert np.array_equal(expert_ids.numpy(), ref_experts)
    assert total == ref_total and isinstance(total, int)
    got = moeroute.sort_by_expert(ids, 12)
    for value, expected in zip(got, reference.sort_by_expert(ids.numpy(), 12)):
        assert isinstance(value, torch.Tensor) and value.dtype == torch.int32
        assert np.array_equal(value.numpy(), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_permute_and_combine_on_torch(dtype):
    ids = _torch_ids(TOKENS, 3, 10, 9)
    hidden = torch.from_numpy(_logits(TOKENS, 24, 10)).to(dtype)
    permuted, offsets, inverse = moeroute.permute(hidden, ids, 10)
    assert isinstance(permuted, torch.Tensor) and permuted.dtype == dtype
    # The reference gathers float32 rows; the gather moves bits, so the upcast must agree.
    ref_perm, ref_offsets, ref_inverse = reference.permute(hidden.float().numpy(), ids.numpy(), 10)
    np.testing.assert_array_equal(permuted.float().numpy(), ref_perm)
    assert np.array_equal(offsets.numpy(), ref_offsets)
    assert np.array_equal(inverse.numpy(), ref_inverse)

    weights = torch.from_numpy(_rng("cw").random((TOKENS, 3)).astype(np.float32))
    out = moeroute.combine(permuted, inverse, weights)
    assert isinstance(out, torch.Tensor) and out.dtype == dtype
    expected = reference.combine(permuted.float().numpy(), inverse.numpy(), weights.numpy())
    # float32 sums rounded once to the output dtype: half an ulp of that dtype.
    rtol = {torch.float32: 1e-6, torch.float16: 2**-11, torch.bfloat16: 2**-8}[dtype]
    np.testing.assert_allclose(out.float().numpy(), expected, rtol=rtol, atol=1e-6)


def test_results_share_memory_with_numpy_outputs():
    # torch out of a CPU op is a view of the kernel's NumPy result: no copy on the way back.
    result = np.arange(6, dtype=np.int32)
    template = torch.zeros(1)
    tensor = _arrays.as_caller(result, template)
    assert tensor.data_ptr() == result.ctypes.data
    assert _arrays.as_caller(result, np.zeros(1)) is result
    bits = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    view = _arrays.host_array(bits)
    assert view.dtype == np.uint16 and view.ctypes.data == bits.data_ptr()
    back = _arrays.as_caller(view, bits, bfloat16=True)
    assert back.dtype == torch.bfloat16 and torch.equal(back, bits)


def test_framework_detection_never_imports_torch():
    # The routing layer finds torch only through sys.modules, and only for torch inputs.
    code = (
        "import sys, numpy as np, moeroute;"
        "w, i = moeroute.select_experts(np.zeros((2, 8), np.float32), moeroute.RouterConfig(8, 2));"
        "from moeroute.routing import _arrays;"
        "assert _arrays.torch_of(np.zeros(1)) is None;"
        "print('torch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=SIM_TIMEOUT_S
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False"


def test_device_detection_and_bits_of_torch_tensors():
    cpu = torch.zeros(2, 3, dtype=torch.bfloat16)
    assert not _arrays.is_device_array(cpu)
    assert _arrays.framework_of(cpu) == "torch"
    assert _arrays.is_bfloat16(cpu) and not _arrays.is_bfloat16(np.zeros(1, np.float16))
    bits = _arrays.device_bits16(cpu)
    assert bits.dtype == torch.int16 and bits.data_ptr() == cpu.data_ptr()
    assert _arrays.from_device_bits16(bits, cpu).dtype == torch.bfloat16


# ------------------------------------------------------------------ device frameworks


def test_device_frameworks_under_the_simulator():
    run_simulator_suite(SIM_MODULE, allow_skipped=True)


requires_torch_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
)


@pytest.mark.gpu
@requires_torch_cuda
@pytest.mark.parametrize("dtype", TORCH_LOGIT_DTYPES, ids=str)
def test_gpu_torch_cuda_tensors_in_and_out(dtype):
    config = ROUTERS["sigmoid-groups"]
    logits = torch.from_numpy(_logits(TOKENS, config.num_experts)).to(dtype)
    bias = torch.from_numpy(0.1 * _logits(1, config.num_experts, 1)[0])
    ref_w, ref_ids = reference.select_experts(logits.float().numpy(), config, bias.numpy())
    weights, ids = moeroute.select_experts(logits.cuda(), config, bias.cuda())
    assert weights.is_cuda and ids.is_cuda and ids.dtype == torch.int32
    assert np.array_equal(ids.cpu().numpy(), ref_ids)
    np.testing.assert_allclose(weights.cpu().numpy(), ref_w, rtol=1e-5, atol=0)
    out = (torch.empty_like(weights), torch.empty_like(ids))
    result = moeroute.select_experts(logits.cuda(), config, bias.cuda(), out=out)
    assert result[0] is out[0] and torch.equal(out[1], ids)
    layout = ExpertLayout(32, num_shared_experts=1)
    dev_w, dev_ids = moeroute.append_shared_slots(weights, ids, layout)
    ref_w2, ref_ids2 = reference.append_shared_slots(weights.cpu().numpy(), ids.cpu().numpy(), layout)
    assert dev_ids.is_cuda and np.array_equal(dev_ids.cpu().numpy(), ref_ids2)
    hidden = torch.randn(TOKENS, 16, dtype=torch.bfloat16, device="cuda")
    permuted, _, inverse = moeroute.permute(hidden, dev_ids, 33)
    assert permuted.is_cuda and permuted.dtype == torch.bfloat16
    combined = moeroute.combine(permuted, inverse, dev_w)
    assert combined.is_cuda and combined.dtype == torch.bfloat16
    expected = reference.combine(permuted.float().cpu().numpy(), inverse.cpu().numpy(), dev_w.cpu().numpy())
    np.testing.assert_allclose(combined.float().cpu().numpy(), expected, rtol=2**-8, atol=1e-6)


@pytest.mark.gpu
@requires_torch_cuda
def test_gpu_cupy_arrays_in_and_out():
    cupy = pytest.importorskip("cupy")
    config = ROUTERS["softmax"]
    logits = _logits(TOKENS, config.num_experts)
    weights, ids = moeroute.select_experts(cupy.asarray(logits), config)
    assert isinstance(ids, cupy.ndarray) and isinstance(weights, cupy.ndarray)
    ref_w, ref_ids = reference.select_experts(logits, config)
    assert np.array_equal(cupy.asnumpy(ids), ref_ids)
    sorted_ids, expert_ids, total = moeroute.align_block_size(ids, 32, 4)
    ref_sorted, ref_experts, ref_total = reference.align_block_size(ref_ids, 32, 4)
    assert isinstance(sorted_ids, cupy.ndarray)
    assert np.array_equal(cupy.asnumpy(sorted_ids), ref_sorted)
    assert int(cupy.asnumpy(total)[0]) == ref_total


def test_column_view_of_a_strided_numba_vector_needs_no_copy():
    """numba's reshape refuses a strided [T] vector (a strided gate); column_view gives the
    [T, 1] view (strides (s, s)) over the same memory. No device needed: the array is
    described over a stand-in pointer."""
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    class Pointer:
        device_ctypes_pointer = None

        def view(self, *args):
            return self

    pointer = Pointer()
    strided = DeviceNDArray(shape=(5,), strides=(8,), dtype=np.float32, gpu_data=pointer)
    with pytest.raises(NotImplementedError, match="requires copying"):
        strided.reshape(5, 1)
    column = _arrays.column_view(strided)
    assert (column.shape, column.strides, column.gpu_data) == ((5, 1), (8, 8), pointer)
    gate = torch.arange(10.0)[::2]
    assert _arrays.column_view(gate).tolist() == [[0.0], [2.0], [4.0], [6.0], [8.0]]
    assert _arrays.column_view(torch.tensor(3.0)).shape == (1, 1)
