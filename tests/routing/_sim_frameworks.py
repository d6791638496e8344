"""Every public routing op on numba device arrays under the CUDA simulator, against the reference.

Run by tests/routing/test_frameworks.py in a subprocess with NUMBA_ENABLE_CUDASIM=1. Device
arrays in must give device arrays out (of the same framework), and ``select_experts(...,
out=...)`` must write into device buffers. Shapes are small: the simulator runs every CUDA
thread as a Python thread.
"""

import numpy as np
import pytest
import torch

from moeroute.routing._arrays import is_device_array, simulator_enabled

if not simulator_enabled():
    pytest.skip("needs NUMBA_ENABLE_CUDASIM=1 before numba is imported", allow_module_level=True)

from numba import cuda  # noqa: E402

import moeroute  # noqa: E402
from moeroute.config import RouterConfig  # noqa: E402
from moeroute.layout import ExpertLayout  # noqa: E402
from moeroute.routing import reference  # noqa: E402

TOKENS = 6
WEIGHT_RTOL = 1e-5  # device exp vs NumPy exp: an ulp or two


def dev(array):
    return cuda.to_device(np.ascontiguousarray(array))


def _rng(seed):
    return np.random.default_rng(seed)


def _assert_device(*arrays):
    for array in arrays:
        assert is_device_array(array) and isinstance(array, type(dev(np.zeros(1)))), type(array)


# numba device arrays carry no bfloat16; torch CUDA bfloat16 is covered by the gpu tests.
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_select_experts_device_in_device_out(dtype):
    config = RouterConfig(16, 3, "sigmoid", num_expert_group=4, topk_group=2, routed_scaling_factor=2.5)
    logits = _rng(1).standard_normal((TOKENS, 16)).astype(dtype)
    bias = (0.1 * _rng(2).standard_normal(16)).astype(np.float32)
    device_logits = dev(logits)
    logits32 = logits.astype(np.float32)
    weights, ids = moeroute.select_experts(device_logits, config, dev(bias))
    _assert_device(weights, ids)
    ref_w, ref_ids = reference.select_experts(logits32, config, bias)
    assert np.array_equal(ids.copy_to_host(), ref_ids)
    np.testing.assert_allclose(weights.copy_to_host(), ref_w, rtol=WEIGHT_RTOL, atol=0)


def test_select_experts_device_out_buffers():
    config = RouterConfig(16, 4, "softmax")
    logits = _rng(3).standard_normal((TOKENS, 16)).astype(np.float32)
    out = (cuda.device_array((TOKENS, 4), np.float32), cuda.device_array((TOKENS, 4), np.int32))
    result = moeroute.select_experts(dev(logits), config, out=out)
    assert result[0] is out[0] and result[1] is out[1]
    ref_w, ref_ids = reference.select_experts(logits, config)
    assert np.array_equal(out[1].copy_to_host(), ref_ids)
    np.testing.assert_allclose(out[0].copy_to_host(), ref_w, rtol=WEIGHT_RTOL, atol=0)
    with pytest.raises(ValueError, match=r"out\[1\] \(topk_ids\) has dtype int64"):
        moeroute.select_experts(dev(logits), config, out=(out[0], cuda.device_array((TOKENS, 4), np.int64)))
    with pytest.raises(TypeError, match=r"out\[0\] \(topk_weights\) must be a device array"):
        moeroute.select_experts(dev(logits), config, out=(np.empty((TOKENS, 4), np.float32), out[1]))
    with pytest.raises(ValueError, match=r"has shape \(5, 4\)"):
        moeroute.select_experts(dev(logits), config, out=(cuda.device_array((5, 4), np.float32), out[1]))


def test_select_experts_device_out_buffers_sharing_memory_are_refused():
    config = RouterConfig(16, 4, "softmax")
    buffer = cuda.to_device(_rng(6).standard_normal(TOKENS * 16 + TOKENS * 4).astype(np.float32))
    logits = buffer[: TOKENS * 16].reshape(TOKENS, 16)
    spare = buffer[TOKENS * 16 :].reshape(TOKENS, 4)
    ids = cuda.device_array((TOKENS, 4), np.int32)
    last_row = buffer[TOKENS * 16 - 16 : TOKENS * 16 - 16 + TOKENS * 4].reshape(TOKENS, 4)
    with pytest.raises(ValueError, match=r"out\[0\] \(topk_weights\) overlaps logits"):
        moeroute.select_experts(logits, config, out=(last_row, ids))
    with pytest.raises(ValueError, match=r"out\[0\] \(topk_weights\) overlaps out\[1\]"):
        moeroute.select_experts(logits, config, out=(spare, spare.view(np.int32)))
    weights, picked = moeroute.select_experts(logits, config, out=(spare, ids))
    ref_w, ref_ids = reference.select_experts(logits.copy_to_host(), config)
    assert np.array_equal(picked.copy_to_host(), ref_ids)
    np.testing.assert_allclose(weights.copy_to_host(), ref_w, rtol=WEIGHT_RTOL, atol=0)


def test_dispatch_primitives_device_in_device_out():
    layout = ExpertLayout(8, num_shared_experts=1, ep_size=2, dispatch="all2all", num_redundant_experts=2)
    ids = _rng(4).integers(-1, 9, size=(TOKENS, 2)).astype(np.int32)
    weights = _rng(5).random((TOKENS, 2)).astype(np.float32)

    physical = moeroute.logical_to_physical(dev(ids), layout)
    _assert_device(physical)
    assert np.array_equal(physical.copy_to_host(), reference.logical_to_physical(ids, layout))

    out_w, out_ids = moeroute.append_shared_slots(dev(weights), dev(ids), layout, 1, 0.5)
    _assert_device(out_ids, out_w)
    ref_w, ref_ids = reference.append_shared_slots(weights, ids, layout, 1, 0.5)
    assert np.array_equal(out_ids.copy_to_host(), ref_ids)
    np.testing.assert_array_equal(out_w.copy_to_host(), ref_w)

    local = moeroute.remap_to_local(out_ids, dev(layout.expert_map(1)))
    _assert_device(local)
    ref_local = reference.remap_to_local(ref_ids, layout.expert_map(1))
    assert np.array_equal(local.copy_to_host(), ref_local)

    num_local = layout.num_local_experts(1)
    sorted_ids, expert_ids, total = moeroute.align_block_size(local, num_local, 2)
    _assert_device(sorted_ids, expert_ids, total)
    ref_sorted, ref_experts, ref_total = reference.align_block_size(ref_local, num_local, 2)
    assert np.array_equal(sorted_ids.copy_to_host(), ref_sorted)
    assert np.array_equal(expert_ids.copy_to_host(), ref_experts)
    assert int(total.copy_to_host()[0]) == ref_total

    # On the device the sorted slots are sized by their upper bound T*K (no read-back of
    # the kept count): the first expert_offsets[-1] entries are the sort, the rest T*K.
    got_sorted, got_offsets, got_inverse = moeroute.sort_by_expert(local, num_local)
    _assert_device(got_sorted, got_offsets, got_inverse)
    ref_sorted_slots, ref_offsets, ref_inverse = reference.sort_by_expert(ref_local, num_local)
    kept, numel = len(ref_sorted_slots), ref_local.size
    assert np.array_equal(got_sorted.copy_to_host(), np.concatenate([ref_sorted_slots, np.full(numel - kept, numel)]))
    assert np.array_equal(got_offsets.copy_to_host(), ref_offsets)
    assert np.array_equal(got_inverse.copy_to_host(), ref_inverse)

    hidden = _rng(6).standard_normal((TOKENS, 5)).astype(np.float32)
    permuted, offsets, inverse = moeroute.permute(dev(hidden), local, num_local)
    _assert_device(permuted, offsets, inverse)
    ref_perm, ref_offsets, ref_inverse = reference.permute(hidden, ref_local, num_local)
    assert permuted.shape == (numel, hidden.shape[1])
    np.testing.assert_array_equal(permuted.copy_to_host()[:kept], ref_perm)
    assert np.array_equal(offsets.copy_to_host(), ref_offsets)
    assert np.array_equal(inverse.copy_to_host(), ref_inverse)

    combined = moeroute.combine(permuted, inverse, out_w)
    _assert_device(combined)
    np.testing.assert_allclose(
        combined.copy_to_host(), reference.combine(ref_perm, ref_inverse, ref_w), rtol=1e-6, atol=1e-7
    )
