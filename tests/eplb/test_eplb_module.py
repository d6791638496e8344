"""record_load windows, gather_load and apply on one rank (the gloo runs: test_eplb_live.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeroute.bindings.torch.moe import MoE
from moeroute.config import RouterConfig
from moeroute.eplb import apply, gather_load, rebalance
from moeroute.layout import REPLICA_HASH_MULTIPLIER
from moeroute.quant import QuantConfig, quantize_experts

N, K, HIDDEN, INTER = 8, 2, 16, 8
#: float32 outputs computed from the same weights in another slot order.
TOLERANCE = 1e-6


def _topk_ids(logits):
    """Softmax + top-k (renormalised weights do not change the ids): the logical picks."""
    return torch.topk(torch.softmax(logits.float(), dim=-1), K, dim=-1).indices


def _physical(logical_ids, table):
    """The replica rule: row t of logical l -> replicas[((t * M) mod 2**32) % count]."""
    out = torch.empty_like(logical_ids)
    for t in range(logical_ids.shape[0]):
        for k in range(logical_ids.shape[1]):
            replicas = [p for p, x in enumerate(table) if x == int(logical_ids[t, k])]
            out[t, k] = replicas[((t * REPLICA_HASH_MULTIPLIER) % 2**32) % len(replicas)]
    return out


def _module(**kwargs):
    torch.manual_seed(3)
    return MoE(RouterConfig(N, K), HIDDEN, INTER, **kwargs)


def test_window_counts_the_last_forwards_per_physical_expert():
    module = _module(num_redundant_experts=4, record_load=True, load_window=3)
    table = module.layout.physical_to_logical.tolist()
    counts = []
    for step in range(5):
        torch.manual_seed(100 + step)
        x, logits = torch.randn(7 + step, HIDDEN), torch.randn(7 + step, N)
        logits[:, 2] += 3.0  # a hot expert with replicas
        with torch.no_grad():
            module(x, logits)
        counts.append(torch.bincount(_physical(_topk_ids(logits), table).reshape(-1), minlength=12))
    recorder = module.load_recorder
    assert recorder.forwards == 5 and recorder.counts.shape == (3, 12)
    expected = sum(counts[2:])
    assert recorder.physical_load(module.layout).tolist() == expected.tolist()
    logical = np.zeros(N, np.int64)
    np.add.at(logical, table, expected.numpy())
    assert gather_load([module]).tolist() == [logical.tolist()]
    recorder.reset()
    assert gather_load(module).tolist() == [[0] * N]


def test_window_leaves_fused_shared_slots_out():
    from moeroute.bindings.torch.mlp import GatedMLP

    torch.manual_seed(4)
    module = MoE(RouterConfig(N, K), HIDDEN, INTER, GatedMLP(HIDDEN, INTER), shared="fused", record_load=True)
    x, logits = torch.randn(9, HIDDEN), torch.randn(9, N)
    with torch.no_grad():
        module(x, logits)
    assert module.load_recorder.counts.shape == (128, N + 1)  # the shared slot is counted ...
    assert int(module.load_recorder.counts[0, N]) == 9
    expected = torch.bincount(_topk_ids(logits).reshape(-1), minlength=N)
    assert gather_load(module)[0].tolist() == expected.tolist()  # ... but never reported


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(record_load="yes"), ValueError, ["record_load", "bool"]),
        (dict(record_load=True, load_window=0), ValueError, ["load_window=0", ">= 1"]),
    ],
)
def test_bad_recorder_arguments(kwargs, error, words):
    with pytest.raises(error) as info:
        _module(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_gather_load_needs_record_load():
    with pytest.raises(ValueError, match="layer 0 records no load"):
        gather_load(_module())
    with pytest.raises(TypeError, match="MoE"):
        gather_load([torch.nn.Linear(2, 2)])


@pytest.mark.parametrize("bias", [False, True])
def test_apply_on_one_rank_keeps_outputs_and_moves_the_right_weights(bias):
    torch.manual_seed(5)
    full = (torch.randn(N, 2 * INTER, HIDDEN), torch.randn(N, HIDDEN, INTER) * 0.3)
    biases = (torch.randn(N, 2 * INTER), torch.randn(N, HIDDEN)) if bias else ()
    layers = []
    for seed in range(2):
        module = _module(
            num_redundant_experts=4, expert_bias=bias, record_load=True, activation="swigluoai" if bias else "silu"
        )
        module.load_routed_weights(*full, *biases)
        layers.append(module)
    x, logits = torch.randn(33, HIDDEN), torch.randn(33, N)
    logits[:, 5] += 4.0
    with torch.no_grad():
        before = [layer(x, logits) for layer in layers]
    load = gather_load(layers)
    placement = rebalance(load, 12, 1)
    old = [layer.layout.physical_to_logical.copy() for layer in layers]
    handle = apply(layers, placement)
    assert handle.done and handle.bytes_sent == handle.bytes_received == 0
    assert handle.experts_moved == int(placement.moved(np.stack(old)).sum()) > 0
    assert handle.experts_copied == handle.experts_moved  # one rank: every expert is local
    for index, layer in enumerate(layers):
        assert layer.layout.physical_to_logical.tolist() == placement.layer(index).tolist()
        for slot, logical in enumerate(placement.layer(index).tolist()):
            assert torch.equal(layer.experts.w_gate_up[slot], full[0][logical])
            assert torch.equal(layer.experts.w_down[slot], full[1][logical])
            if bias:
                assert torch.equal(layer.experts.b_gate_up[slot], biases[0][logical])
        assert layer.load_recorder.forwards == 0  # the window refers to the old placement
    with torch.no_grad():
        after = [layer(x, logits) for layer in layers]
    for a, b in zip(before, after):
        assert torch.allclose(a, b, rtol=0, atol=TOLERANCE * float(b.abs().max()))


def test_apply_refuses_a_placement_that_does_not_fit():
    layers = [_module(num_redundant_experts=4)]
    with pytest.raises(ValueError, match=r"\(N, P, E\) = \(8, 16, 1\) does not fit layer 0"):
        apply(layers, rebalance(np.ones(N), 16, 1))
    with pytest.raises(ValueError, match="2 layer"):
        apply(layers, rebalance(np.ones((2, N)), 12, 1))
    with pytest.raises(TypeError, match="Placement"):
        apply(layers, np.zeros((1, 12), int))
    table = layers[0].layout.physical_to_logical.copy()
    assert layers[0].layout.physical_to_logical.tolist() == table.tolist()


def test_async_apply_swaps_at_the_next_forward():
    layers = [_module(num_redundant_experts=4) for _ in range(2)]
    full = (torch.randn(N, 2 * INTER, HIDDEN), torch.randn(N, HIDDEN, INTER))
    for layer in layers:  # replicas hold their logical expert's weights
        layer.load_routed_weights(*full)
    x, logits = torch.randn(10, HIDDEN), torch.randn(10, N)
    with torch.no_grad():
        before = [layer(x, logits) for layer in layers]
    placement = rebalance(np.arange(1, 2 * N + 1).reshape(2, N), 12, 1)
    handle = apply(layers, placement, async_op=True)
    assert not handle.done and layers[1].pending_placement is not None
    assert layers[0].layout.physical_to_logical.tolist() != placement.layer(0).tolist()
    with torch.no_grad():
        after = [layer(x, logits) for layer in layers]
    assert handle.done and all(layer.pending_placement is None for layer in layers)
    assert [layer.layout.physical_to_logical.tolist() for layer in layers] == placement.physical_to_logical.tolist()
    for a, b in zip(before, after):
        assert torch.allclose(a, b, rtol=0, atol=TOLERANCE * float(b.abs().max()))


def test_apply_with_fused_global_shared_slots_on_one_rank():
    from moeroute.bindings.torch.mlp import GatedMLP

    torch.manual_seed(6)
    full = (torch.randn(N, 2 * INTER, HIDDEN), torch.randn(N, HIDDEN, INTER) * 0.3)
    module = MoE(
        RouterConfig(N, K),
        HIDDEN,
        INTER,
        GatedMLP(HIDDEN, 2 * INTER),
        torch.nn.Linear(HIDDEN, 1, bias=False),
        shared="fused",
        num_redundant_experts=4,
        record_load=True,
    )
    module.load_routed_weights(*full)
    assert module.layout.shared_slots == "global"
    shared_rows = module.experts.w_gate_up[12:].clone()  # the 2 fused slots after the 12 routed
    x, logits = torch.randn(21, HIDDEN), torch.randn(21, N)
    logits[:, 1] += 3.0
    with torch.no_grad():
        before = module(x, logits)
    placement = rebalance(gather_load(module), 12, 1)
    apply(module, placement)
    assert torch.equal(module.experts.w_gate_up[12:], shared_rows)  # shared slots never move
    assert module.layout.shared == "fused" and module.layout.shared_slots == "global"
    with torch.no_grad():
        after = module(x, logits)
    assert torch.allclose(before, after, rtol=0, atol=TOLERANCE * float(after.abs().max()))


def test_apply_repacks_onednn_copies():
    from moeroute.experts.formats.unquantized import onednn_linear_serves

    if not onednn_linear_serves(torch.float32):
        pytest.skip("this torch build's oneDNN does not serve float32")
    torch.manual_seed(7)
    module = _module(num_redundant_experts=4)
    module.load_routed_weights(torch.randn(N, 2 * INTER, HIDDEN), torch.randn(N, HIDDEN, INTER))
    module.pack_cpu_weights()
    x, logits = torch.randn(15, HIDDEN), torch.randn(15, N)
    with torch.no_grad():
        before = module(x, logits)
    apply(module, rebalance(np.arange(N, 0, -1) ** 2, 12, 1))
    with torch.no_grad():
        after = module(x, logits)  # stale copies would raise
    assert torch.allclose(before, after, rtol=0, atol=TOLERANCE * float(after.abs().max()))


@pytest.mark.parametrize(
    "quant",
    [QuantConfig("fp8_block", block_size=(16, 32)), QuantConfig("fp8_tensor"), QuantConfig("mxfp4")],
    ids=lambda q: q.format,
)
def test_apply_moves_quantized_experts_with_their_scales(quant):
    """Quantized layers move their packed weights and scales slot by slot, never dequantized."""
    hidden, inter = 32, 32
    torch.manual_seed(7)
    full = quantize_experts(torch.randn(N, 2 * inter, hidden), torch.randn(N, hidden, inter) * 0.3, quant)
    torch.manual_seed(3)
    layer = MoE(RouterConfig(N, K), hidden, inter, quant=quant, num_redundant_experts=4, record_load=True)
    if quant.format == "mxfp4":
        layer.load_routed_weights((full[0], full[1]), (full[2], full[3]))
    else:
        layer.load_routed_weights(full[0], full[2], gate_up_scale=full[1], down_scale=full[3])
    x, logits = torch.randn(33, hidden), torch.randn(33, N)
    logits[:, 5] += 4.0
    with torch.no_grad():
        before = layer(x, logits)
    placement = rebalance(gather_load([layer]), 12, 1)
    old = layer.layout.physical_to_logical.copy()
    handle = apply([layer], placement)
    assert handle.experts_moved == int(placement.moved(old[None]).sum()) > 0
    experts = layer.experts
    for slot, logical in enumerate(placement.layer(0).tolist()):
        for name, source in (
            ("w_gate_up", full[0]),
            ("gate_up_scale", full[1]),
            ("w_down", full[2]),
            ("down_scale", full[3]),
        ):
            moved = getattr(experts, name)[slot]
            assert moved.dtype == source.dtype
            assert torch.equal(moved.reshape(-1).view(torch.uint8), source[logical].reshape(-1).view(torch.uint8)), (
                name,
                slot,
            )
    with torch.no_grad():
        after = layer(x, logits)
    assert torch.allclose(before, after, rtol=0, atol=TOLERANCE * float(after.abs().max()))
