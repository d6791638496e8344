"""CUDA kernels of the dispatch primitives: simulator runs, device compile checks, GPU runs.

* The simulator suite (_sim_dispatch_cuda.py) runs in a subprocess with
  NUMBA_ENABLE_CUDASIM=1: every kernel on small shapes against the CPU path.
* Every kernel is compiled to PTX for sm_80 and sm_90 with NVRTC/NVVM (no GPU needed).
* `gpu` tests run the kernels at full size on a real device, against the CPU path.
"""

import contextlib
import importlib
import re
import types
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

cuda = pytest.importorskip("numba.cuda")
from numba import types as nt  # noqa: E402

from moeroute.layout import ExpertLayout  # noqa: E402
from moeroute.routing import _sort  # noqa: E402

# Each op's CUDA kernels live in its package's _cuda module.
combine_module = importlib.import_module("moeroute.routing.combine._cuda")
permute_module = importlib.import_module("moeroute.routing.permute._cuda")
remap_module = importlib.import_module("moeroute.routing.remap._cuda")
shared_slots_module = importlib.import_module("moeroute.routing.shared_slots._cuda")
from moeroute.routing.align import align_block_size  # noqa: E402
from moeroute.routing.combine import combine  # noqa: E402
from moeroute.routing.permute import permute, sort_by_expert  # noqa: E402
from moeroute.routing.remap import logical_to_physical, remap_to_local  # noqa: E402
from moeroute.routing.select import DEVICE_WARPS_PER_BLOCK  # noqa: E402
from moeroute.routing.shared_slots import append_shared_slots  # noqa: E402
from _simulator import run_simulator_suite  # noqa: E402

SIM_MODULE = Path(__file__).with_name("_sim_dispatch_cuda.py")


def test_cuda_kernels_under_the_simulator():
    # The device's launch configuration: four warps per block (exact warp intrinsics).
    run_simulator_suite(SIM_MODULE, warps=DEVICE_WARPS_PER_BLOCK)


def test_device_views_never_synchronize(monkeypatch):
    """numba-cuda syncs on the producer's stream unless told not to: a host wait per call."""
    from moeroute.routing import _arrays

    calls = []
    monkeypatch.setattr(cuda, "as_cuda_array", lambda obj, sync=True: calls.append(sync) or obj)

    class Producer:
        __cuda_array_interface__ = {"shape": (2,), "typestr": "<i4", "data": (0, False), "version": 3, "stream": 7}

    _arrays.as_device_array(Producer())
    assert calls == [False]


# ------------------------------------------------------------------ compile checks


def _array(dtype, ndim):
    return nt.Array(dtype, ndim, "A")


I32, I64, F32, F16, U16, BOOL = nt.int32, nt.int64, nt.float32, nt.float16, nt.uint16, nt.boolean


def _kernel_signatures():
    ids2 = {name: _array(t, 2) for name, t in (("int32", I32), ("int64", I64))}
    table = _array(I32, 1)
    cases = []
    for name, ids in ids2.items():
        cases += [
            (f"count[{name}]", _sort._count_kernel, (ids, table, BOOL, I64, I64, _array(I32, 2))),
            (
                f"place[{name}]",
                _sort._place_kernel,
                (
                    ids,
                    table,
                    BOOL,
                    I64,
                    I64,
                    I64,
                    I64,
                    _array(I32, 2),
                    _array(I32, 2),
                    _array(I32, 2),
                    _array(I32, 2),
                    table,
                    table,
                    _array(I32, 2),
                    BOOL,
                    table,
                ),
            ),
            (
                f"logical_to_physical[{name}]",
                remap_module.logical_to_physical_kernel,
                (ids, I64, table, table, table, _array(I32, 2)),
            ),
            (f"remap[{name}]", remap_module._remap_kernel, (_array(ids.dtype, 1), table, table)),
            (
                f"append[{name}]",
                shared_slots_module._append_kernel,
                (
                    ids,
                    _array(F32, 2),
                    I64,
                    table,
                    table,
                    table,
                    I64,
                    _array(F32, 2),
                    I64,
                    I64,
                    F32,
                    BOOL,
                    _array(I32, 2),
                    _array(F32, 2),
                ),
            ),
        ]
    cases += [
        ("gather[uint16]", permute_module._gather_rows_kernel, (_array(U16, 2), table, table, I64, _array(U16, 2))),
        ("gather[float32]", permute_module._gather_rows_kernel, (_array(F32, 2), table, table, I64, _array(F32, 2))),
        (
            "combine[float32]",
            combine_module._combine_kernel,
            (_array(F32, 2), _array(I32, 2), _array(F32, 2), BOOL, _array(F32, 2)),
        ),
        (
            "combine[float16]",
            combine_module._combine_kernel,
            (_array(F16, 2), _array(I64, 2), _array(F32, 2), BOOL, _array(F16, 2)),
        ),
        (
            "combine[bf16-bits]",
            combine_module._combine_bf16_kernel,
            (_array(U16, 2), _array(I32, 2), _array(F32, 2), BOOL, _array(U16, 2)),
        ),
    ]
    return cases


KERNELS = _kernel_signatures()


@contextlib.contextmanager
def _compiling_for(cc):
    """numba-cuda compiles called device functions for the current device's compute
    capability; with no GPU present, name the target instead."""
    import numba.cuda.dispatcher as dispatcher

    device = types.SimpleNamespace(compute_capability=cc)
    with mock.patch.object(dispatcher, "get_current_device", return_value=device):
        yield


@pytest.mark.parametrize("cc", [(8, 0), (9, 0)], ids=["sm_80", "sm_90"])
@pytest.mark.parametrize("name,function,signature", KERNELS, ids=[k[0] for k in KERNELS])
def test_kernel_compiles_to_ptx(name, function, signature, cc):
    with _compiling_for(cc):
        ptx, return_type = cuda.compile_ptx(function, signature, cc=cc)
    assert return_type == nt.void
    assert f".target sm_{cc[0]}{cc[1]}" in ptx
    assert ".entry" in ptx


ELEMENTWISE = [k for k in KERNELS if k[0].startswith(("gather", "combine"))]


def test_row_launch_config_covers_every_column_once():
    for rows, width in [(3, 300), (1, 1), (5, 32), (2, 257), (7, 7168)]:
        (grid_rows, tiles), threads = _sort.row_launch_config(rows, width)
        assert grid_rows == rows and threads % 32 == 0 and threads <= _sort.THREADS_PER_BLOCK
        columns = np.arange(tiles)[:, None] * threads + np.arange(threads)[None, :]
        assert set(columns[columns < width].tolist()) == set(range(width))
        assert tiles == 1 or (tiles - 1) * threads < width  # no block of only idle threads
    with pytest.raises(ValueError, match=r"width=16777216 needs 65536 column tiles"):
        _sort.row_launch_config(1, 65536 * 256)


@pytest.mark.parametrize("name,function,signature", ELEMENTWISE, ids=[k[0] for k in ELEMENTWISE])
def test_elementwise_kernels_do_no_64_bit_division(name, function, signature):
    """Row and column come from the block index: no 64-bit divide or remainder per element
    (each is a ~70-instruction software routine on the GPU)."""
    with _compiling_for((9, 0)):
        ptx, _ = cuda.compile_ptx(function, signature, cc=(9, 0))
    assert not re.search(r"\b(div|rem)\.[su]64\b", ptx)


# ------------------------------------------------------------------ GPU

needs_device = pytest.mark.skipif(not cuda.is_available(), reason="no CUDA device")


def _ids(rng, tokens, top_k, num_experts, invalid_fraction=0.0):
    values = np.arange(num_experts)
    p = 1.0 / (values + 1.0) ** 1.2
    ids = rng.choice(values, size=(tokens, top_k), p=p / p.sum()).astype(np.int32)
    ids[rng.random(ids.shape) < invalid_fraction] = -1
    return ids


@pytest.mark.gpu
@needs_device
@pytest.mark.parametrize(
    "tokens,top_k,num_experts,block_size",
    [
        (65536, 8, 256, 64),
        (65536, 9, 520, 128),
        (4097, 10, 1024, 16),
        (0, 8, 256, 64),
        (1, 2, 8, 1),
    ],
)
def test_gpu_align_and_sort_match_cpu(tokens, top_k, num_experts, block_size):
    rng = np.random.default_rng(tokens + num_experts)
    ids = _ids(rng, tokens, top_k, num_experts, invalid_fraction=0.01)
    device_ids = cuda.to_device(ids)
    got = align_block_size(device_ids, num_experts, block_size)
    want = align_block_size(ids, num_experts, block_size)
    np.testing.assert_array_equal(got[0].copy_to_host(), want[0])
    np.testing.assert_array_equal(got[1].copy_to_host(), want[1])
    assert int(got[2].copy_to_host()[0]) == want[2]
    slots, offsets, inverse = sort_by_expert(device_ids, num_experts)
    want_slots, want_offsets, want_inverse = sort_by_expert(ids, num_experts)
    np.testing.assert_array_equal(offsets.copy_to_host(), want_offsets)
    np.testing.assert_array_equal(inverse.copy_to_host(), want_inverse)
    kept = int(want_offsets[-1])  # sized by the upper bound T*K, padded with T*K
    np.testing.assert_array_equal(slots.copy_to_host(), np.r_[want_slots, np.full(ids.size - kept, ids.size)])


@pytest.mark.gpu
@needs_device
def test_gpu_permute_and_combine_match_cpu():
    rng = np.random.default_rng(1)
    tokens, top_k, num_experts, hidden = 65536, 8, 256, 64
    ids = _ids(rng, tokens, top_k, num_experts, invalid_fraction=0.01)
    values = rng.standard_normal((tokens, hidden)).astype(np.float32)
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)  # truncated bf16 patterns
    permuted = {}
    for name, hidden_states in (("float32", values), ("bf16", bits)):
        got = permute(cuda.to_device(hidden_states), cuda.to_device(ids), num_experts)
        want = permute(hidden_states, ids, num_experts)
        assert got[0].shape == (ids.size, hidden)  # the upper bound; rows past M unwritten
        assert got[0].copy_to_host()[: want[0].shape[0]].tobytes() == want[0].tobytes()
        np.testing.assert_array_equal(got[1].copy_to_host(), want[1])
        np.testing.assert_array_equal(got[2].copy_to_host(), want[2])
        permuted[name], inverse = want[0], want[2]
    weights = rng.random((tokens, top_k)).astype(np.float32)
    for expert_out, raw in (
        (permuted["float32"], False),
        (permuted["float32"].astype(np.float16), False),
        (permuted["bf16"], True),
    ):
        got = combine(
            cuda.to_device(expert_out), cuda.to_device(inverse), cuda.to_device(weights), raw_bf16=raw
        ).copy_to_host()
        cpu = combine(expert_out, inverse, weights, raw_bf16=raw)
        assert got.dtype == cpu.dtype
        if raw:
            # The GPU may fuse multiply-adds: at most one bf16 ulp apart.
            assert np.abs(got.astype(np.int32) - cpu.astype(np.int32)).max() <= 1
            continue
        # Fused multiply-adds change float32 sums by a few ulps of sum |w y|.
        decoded = expert_out.astype(np.float32)
        magnitude = np.zeros((tokens, hidden), np.float32)
        for k in range(top_k):
            kept = inverse[:, k] >= 0
            magnitude[kept] += np.abs(weights[kept, k, None] * decoded[inverse[kept, k]])
        ulp = 2.0**-11 if expert_out.dtype == np.float16 else 0.0
        bound = 1e-6 * magnitude + ulp * np.abs(cpu.astype(np.float32))
        assert np.all(np.abs(got.astype(np.float32) - cpu.astype(np.float32)) <= bound)


@pytest.mark.gpu
@needs_device
def test_gpu_ids_match_cpu():
    rng = np.random.default_rng(2)
    layout = ExpertLayout(512, 1, ep_size=8, dispatch="all2all", num_redundant_experts=8)
    ids = _ids(rng, 65536, 10, 512)
    weights = rng.random(ids.shape).astype(np.float32)
    gate = rng.random(65536).astype(np.float32)
    np.testing.assert_array_equal(
        logical_to_physical(cuda.to_device(ids), layout).copy_to_host(), logical_to_physical(ids, layout)
    )
    got = append_shared_slots(cuda.to_device(weights), cuda.to_device(ids), layout, 3, cuda.to_device(gate))
    want = append_shared_slots(weights, ids, layout, 3, gate)
    np.testing.assert_array_equal(got[0].copy_to_host(), want[0])
    np.testing.assert_array_equal(got[1].copy_to_host(), want[1])
    expert_map = layout.expert_map(3)
    np.testing.assert_array_equal(
        remap_to_local(got[1], cuda.to_device(expert_map)).copy_to_host(), remap_to_local(want[1], expert_map)
    )


@pytest.mark.gpu
@needs_device
def test_gpu_framework_arrays_stay_in_their_framework():
    rng = np.random.default_rng(3)
    ids = _ids(rng, 1000, 8, 64)
    cupy = pytest.importorskip("cupy")
    got = align_block_size(cupy.asarray(ids), 64, 16)
    assert all(isinstance(a, cupy.ndarray) for a in got)
    np.testing.assert_array_equal(cupy.asnumpy(got[0]), align_block_size(ids, 64, 16)[0])
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA build here")
    tensor_ids = torch.from_numpy(ids).cuda()
    sorted_slots, offsets, inverse = sort_by_expert(tensor_ids, 64)
    assert isinstance(sorted_slots, torch.Tensor) and sorted_slots.device == tensor_ids.device
    want_slots = sort_by_expert(ids, 64)[0]
    np.testing.assert_array_equal(sorted_slots[: want_slots.shape[0]].cpu().numpy(), want_slots)
    hidden = torch.randn(1000, 32, device="cuda").to(torch.bfloat16)
    permuted, _, inverse = permute(hidden.view(torch.int16), tensor_ids, 64)
    out = combine(permuted, inverse, None, raw_bf16=True).view(torch.bfloat16)
    # Eight equal bf16 terms sum exactly in float32.
    assert torch.equal(out, (hidden.float() * 8).to(torch.bfloat16))
