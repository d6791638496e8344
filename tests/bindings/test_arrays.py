"""Torch <-> kernel arrays: zero-copy both ways, bfloat16 as raw bits, routing ops on tensors
checked against moeroute.routing.reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.reference import generator as _generator
from moeroute.bindings.torch import arrays
from moeroute.config import RouterConfig
from moeroute.layout import ExpertLayout
from moeroute.routing import reference

WEIGHT_RTOL = 1e-6  # float32 routing weights: a few ulps between kernel and reference


# ------------------------------------------------------------------ zero copy


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32])
def test_host_array_shares_memory(dtype):
    tensor = torch.arange(24).reshape(4, 6).to(dtype)
    view = arrays.host_array(tensor)
    assert view.ctypes.data == tensor.data_ptr()
    assert view.shape == (4, 6)
    tensor[1, 2] = 99  # a write through torch is visible through NumPy
    assert view[1, 2] == 99


def test_host_array_bf16_is_raw_bits_not_floats():
    tensor = torch.tensor([1.0, -2.5, 3.140625, 0.0], dtype=torch.bfloat16)
    view = arrays.host_array(tensor)
    assert view.dtype == np.uint16
    assert view.ctypes.data == tensor.data_ptr()
    # bfloat16 is the top half of the float32 pattern
    expected = (tensor.float().numpy().view(np.uint32) >> 16).astype(np.uint16)
    assert np.array_equal(view, expected)


def test_as_tensor_shares_memory_with_numpy():
    array = np.arange(10, dtype=np.int32)
    tensor = arrays.as_tensor(array)
    assert tensor.data_ptr() == array.ctypes.data
    assert tensor.dtype == torch.int32


def test_kernel_array_of_contiguous_cpu_tensor_is_a_view():
    tensor = torch.randn(5, 3)
    assert arrays.kernel_array(tensor).ctypes.data == tensor.data_ptr()


def test_host_array_rejects_bad_input():
    with pytest.raises(TypeError, match="torch.Tensor"):
        arrays.host_array(np.zeros(3))
    with pytest.raises(ValueError, match="CPU tensor"):
        arrays.host_array(torch.zeros(3, device="meta"))


# ------------------------------------------------------------------ routing ops

ROUTERS = [
    RouterConfig(16, 4, "softmax", renormalize=True),
    RouterConfig(16, 3, "sigmoid", num_expert_group=4, topk_group=2, routed_scaling_factor=2.5),
]


@pytest.mark.parametrize("router", ROUTERS)
@pytest.mark.parametrize("tokens", [0, 1, 37])
def test_select_experts_matches_reference(router, tokens):
    logits = torch.randn(tokens, router.num_experts, generator=_generator(tokens))
    bias = torch.randn(router.num_experts, generator=_generator(99)) * 0.1 if router.scoring == "sigmoid" else None
    weights, ids = arrays.select_experts(logits, router, bias)
    ref_weights, ref_ids = reference.select_experts(logits.numpy(), router, None if bias is None else bias.numpy())
    assert isinstance(ids, torch.Tensor) and ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert np.array_equal(ids.numpy(), ref_ids)
    np.testing.assert_allclose(weights.numpy(), ref_weights, rtol=WEIGHT_RTOL, atol=0)


@pytest.mark.parametrize("gate", [None, 0.75, "tensor"])
def test_append_shared_slots_matches_reference(gate):
    layout = ExpertLayout(8, 2, num_redundant_experts=2)
    ids = torch.randint(0, 8, (9, 3), generator=_generator(1), dtype=torch.int32)
    weights = torch.rand(9, 3, generator=_generator(2))
    shared = torch.rand(9, generator=_generator(3)) if gate == "tensor" else gate
    out_weights, out_ids = arrays.append_shared_slots(weights, ids, layout, 0, shared)
    ref_weights, ref_ids = reference.append_shared_slots(
        weights.numpy(), ids.numpy(), layout, 0, shared.numpy() if isinstance(shared, torch.Tensor) else shared
    )
    assert np.array_equal(out_ids.numpy(), ref_ids)
    np.testing.assert_allclose(out_weights.numpy(), ref_weights, rtol=0, atol=0)


def test_append_shared_slots_zero_tokens_with_gate_tensor():
    layout = ExpertLayout(8, 1)
    out_weights, out_ids = arrays.append_shared_slots(
        torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.int32), layout, 0, torch.zeros(0)
    )
    assert out_ids.shape == (0, 3) and out_weights.shape == (0, 3)


def test_remap_to_local_matches_reference():
    layout = ExpertLayout(8, 1, ep_size=2, dispatch="all2all")
    ids = torch.randint(-1, layout.num_physical_experts, (11, 4), generator=_generator(4), dtype=torch.int32)
    for rank in range(2):
        expert_map = arrays.expert_map_for_device(layout.expert_map(rank), torch.device("cpu"))
        local = arrays.remap_to_local(ids, expert_map)
        assert np.array_equal(local.numpy(), reference.remap_to_local(ids.numpy(), layout.expert_map(rank)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_permute_matches_reference_bit_for_bit(dtype):
    hidden = torch.randn(7, 5, generator=_generator(5)).to(dtype)
    ids = torch.randint(-1, 4, (7, 3), generator=_generator(6), dtype=torch.int32)
    permuted, offsets, inverse = arrays.permute(hidden, ids, 4)
    ref_sorted, ref_offsets, ref_inverse = reference.sort_by_expert(ids.numpy(), 4)
    assert permuted.dtype == dtype
    assert torch.equal(permuted, hidden[torch.from_numpy(ref_sorted // 3).long()])
    assert np.array_equal(offsets.numpy(), ref_offsets)
    assert np.array_equal(inverse.numpy(), ref_inverse)


def test_sort_by_expert_matches_reference():
    ids = torch.randint(-1, 6, (13, 2), generator=_generator(7), dtype=torch.int32)
    got = arrays.sort_by_expert(ids, 6)
    for actual, expected in zip(got, reference.sort_by_expert(ids.numpy(), 6)):
        assert np.array_equal(actual.numpy(), expected)


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-6), (torch.float16, 1e-3), (torch.bfloat16, 8e-3)])
def test_combine_matches_float64_definition(dtype, rtol):
    """out[t] = sum_k w[t, k] * y[inverse[t, k]] over entries >= 0; rtol: one rounding to dtype."""
    tokens, slots, rows, hidden = 6, 3, 12, 8
    expert_out = torch.randn(rows, hidden, generator=_generator(8)).to(dtype)
    inverse = torch.randint(-1, rows, (tokens, slots), generator=_generator(9), dtype=torch.int32)
    weights = torch.rand(tokens, slots, generator=_generator(10))
    out = arrays.combine(expert_out, inverse, weights)
    expected = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for k in range(slots):
            if inverse[t, k] >= 0:
                expected[t] += float(weights[t, k]) * expert_out[inverse[t, k]].double()
    assert out.dtype == dtype and out.shape == (tokens, hidden)
    torch.testing.assert_close(out.double(), expected, rtol=rtol, atol=rtol * float(expected.abs().max()))


def test_combine_zero_tokens():
    out = arrays.combine(torch.zeros(0, 4), torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, 2))
    assert out.shape == (0, 4)
