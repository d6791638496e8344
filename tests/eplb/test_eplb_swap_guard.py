"""An EPLB swap never lands inside a forward: two threads share one MoE layer.

Thread A's forward is paused by a hook on the experts (after routing, before the expert
GEMMs); thread B swaps to a new placement (``handle.wait()``, or its own forward that
finishes the async apply). B must wait for A (polled, no sleeps): A finishes on the old
placement, and the next forward runs on the new one. Without the guard B wrote the new rows
under A, whose old physical ids then picked the wrong experts (relative error ~1).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from helpers.reference import dense_experts
from moeroute.bindings.torch.moe import MoE
from moeroute.bindings.torch.placement_guard import PlacementGuard
from moeroute.config import RouterConfig
from moeroute.eplb import apply, rebalance
from moeroute.quant import QuantConfig, quantize_experts

N, K, HIDDEN, INTER, REDUNDANT = 8, 2, 32, 32, 4
#: float32 outputs of the same logical experts computed in another slot order.
TOLERANCE = 1e-6
#: Upper bound on a join or an event wait: reached only by a hang (then the test fails).
HANG_S = 300


def _layer(quant):
    torch.manual_seed(11)
    gate_up, down = torch.randn(N, 2 * INTER, HIDDEN) * 0.2, torch.randn(N, HIDDEN, INTER) * 0.2
    layer = MoE(RouterConfig(N, K), HIDDEN, INTER, quant=quant, num_redundant_experts=REDUNDANT)
    if quant is None:
        layer.load_routed_weights(gate_up, down)
    elif quant.format == "mxfp4":
        q = quantize_experts(gate_up, down, quant)
        layer.load_routed_weights((q[0], q[1]), (q[2], q[3]))
    else:
        q = quantize_experts(gate_up, down, quant)
        layer.load_routed_weights(q[0], q[2], gate_up_scale=q[1], down_scale=q[3])
    return layer, (gate_up, down)


def _expert_tensors(layer):
    return {
        name: t.detach().clone()
        for name, t in list(layer.experts.named_parameters()) + list(layer.experts.named_buffers())
        if t is not None
    }


def _placement(layer):
    """A placement that moves most slots (old physical ids would name other experts)."""
    load = np.arange(N, 0, -1, dtype=np.float64) ** 3
    placement = rebalance(load[None], N + REDUNDANT, 1)
    old = layer.layout.physical_to_logical
    assert int((placement.layer(0) != old).sum()) >= N // 2
    return placement


def _wait_until(condition, event):
    """Poll ``condition`` until it holds or ``event`` is set; fail on a hang."""
    for _ in range(HANG_S * 1000):
        if condition() or event.is_set():
            return
        event.wait(0.001)
    pytest.fail("neither happened")


@pytest.mark.parametrize("trigger", ["wait", "forward"])
@pytest.mark.parametrize(
    "quant",
    [None, QuantConfig("fp8_block", block_size=(16, 32)), QuantConfig("mxfp4")],
    ids=lambda q: "float" if q is None else q.format,
)
def test_a_swap_waits_for_the_forward_in_flight(quant, trigger):
    layer, (gate_up, down) = _layer(quant)
    generator = torch.Generator().manual_seed(12)
    x, logits = torch.randn(19, HIDDEN, generator=generator), torch.randn(19, N, generator=generator)
    logits[:, 0] += 2.0
    with torch.no_grad():
        old_output = layer(x, logits)
    if quant is None:  # the old placement's output is the layer's definition
        probs = torch.softmax(logits, dim=-1)
        weights, ids = torch.topk(probs, K, dim=-1)
        expected = dense_experts(x, weights / weights.sum(-1, keepdim=True), ids, gate_up, down, "silu")
        torch.testing.assert_close(old_output.double(), expected.double(), rtol=0, atol=1e-5)
    placement = _placement(layer)
    old_table = layer.layout.physical_to_logical.tolist()

    entered, release, swapped = threading.Event(), threading.Event(), threading.Event()
    paused = []
    outputs = {}

    def pause(module, args):
        if not paused:  # the first forward only: thread A's
            paused.append(True)
            entered.set()
            assert release.wait(HANG_S)

    def forward_a():
        with torch.no_grad():
            outputs["a"] = layer(x, logits)

    def swap_b():
        handle = apply(layer, placement, async_op=True)
        if trigger == "wait":
            handle.wait()
        else:
            with torch.no_grad():
                outputs["b"] = layer(x, logits)  # finishes the async apply at its start
        outputs["handle"] = handle
        swapped.set()

    hook = layer.experts.register_forward_pre_hook(pause)
    a = threading.Thread(target=forward_a)
    b = threading.Thread(target=swap_b)
    try:
        a.start()
        assert entered.wait(HANG_S)  # A routed on the old placement and is paused
        before = _expert_tensors(layer)
        b.start()
        guard = getattr(layer, "placement_guard", None)
        _wait_until(lambda: guard is not None and guard.swap_waiting, swapped)
        assert not swapped.is_set(), "the swap ran under a forward in flight"
        assert layer.layout.physical_to_logical.tolist() == old_table
        for name, tensor in _expert_tensors(layer).items():
            assert torch.equal(
                tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor,
                before[name].view(torch.uint8) if tensor.element_size() == 1 else before[name],
            ), name
    finally:
        release.set()
        a.join(HANG_S)
        b.join(HANG_S)
        hook.remove()
    assert not a.is_alive() and not b.is_alive()
    assert outputs["handle"].done
    assert layer.layout.physical_to_logical.tolist() == placement.layer(0).tolist()
    scale = float(old_output.abs().max())
    # A computed on the old placement from start to end.
    torch.testing.assert_close(outputs["a"], old_output, rtol=0, atol=TOLERANCE * scale)
    with torch.no_grad():
        new_output = layer(x, logits)
    # The new placement holds the same logical experts in other slots: the same output.
    torch.testing.assert_close(new_output, old_output, rtol=0, atol=TOLERANCE * scale)
    if trigger == "forward":
        torch.testing.assert_close(outputs["b"], old_output, rtol=0, atol=TOLERANCE * scale)


def test_guard_lets_forwards_share_and_a_waiting_swap_go_first():
    guard = PlacementGuard()
    events = []
    with guard.forward(), guard.forward():  # forwards share
        assert guard.forwards_in_flight == 2
        done = threading.Event()

        def swap():
            with guard.swap():
                events.append("swap")
            done.set()

        thread = threading.Thread(target=swap)
        thread.start()
        _wait_until(lambda: guard.swap_waiting, done)
        assert not done.is_set()

        late_started = threading.Event()

        def late_forward():
            late_started.set()
            with guard.forward():
                events.append("late forward")

        late = threading.Thread(target=late_forward)
        late.start()
        assert late_started.wait(HANG_S)
        events.append("forwards end")
    thread.join(HANG_S)
    late.join(HANG_S)
    # The late forward queued behind the waiting swap.
    assert events == ["forwards end", "swap", "late forward"]


def test_a_copied_or_pickled_layer_has_its_own_guard():
    import copy
    import pickle

    layer, _ = _layer(None)
    for twin in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert isinstance(twin.placement_guard, PlacementGuard)
        assert twin.placement_guard is not layer.placement_guard
        with twin.placement_guard.swap():
            assert layer.placement_guard.forwards_in_flight == 0
