"""``torch.ops.moeroute.experts``' boundary checks, the same for every weight format.

Each case would otherwise reach a kernel: ids for fewer tokens than ``hidden_states`` left
rows unwritten (zeros), ids for more read and wrote past both (SIGSEGV), and a weight on
the meta device with CPU hidden states gave back uninitialised memory. Every check runs
before any kernel, so these tests compile none.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from helpers.reference import generator as _generator
from moeroute.bindings.torch import ops
from moeroute.bindings.torch.moe import MoE
from moeroute.config import RouterConfig
from moeroute.quant import QuantConfig, quantize_experts, quantize_mxfp4

HIDDEN, INTER, EXPERTS, TOKENS, TOP_K = 64, 64, 4, 6, 2
FORMATS = ["float", "fp8_block", "fp8_tensor", "mxfp4"]


def _weights(fmt):
    """(w_gate_up, w_down, op keyword arguments) of ``fmt``."""
    generator = _generator(3)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=generator) * 0.1
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=generator) * 0.1
    if fmt == "float":
        return gate_up, down, {}
    if fmt == "mxfp4":
        (gu_blocks, gu_scales), (d_blocks, d_scales) = quantize_mxfp4(gate_up), quantize_mxfp4(down)
        return gu_blocks, d_blocks, dict(gate_up_scale=gu_scales, down_scale=d_scales, quant_format="mxfp4")
    quant = QuantConfig(fmt, block_size=(32, 32)) if fmt == "fp8_block" else QuantConfig(fmt)
    q_gu, s_gu, q_d, s_d = quantize_experts(gate_up, down, quant)
    kwargs = dict(gate_up_scale=s_gu, down_scale=s_d, quant_format=fmt)
    if quant.block_size is not None:
        kwargs["block_size"] = list(quant.block_size)
    return q_gu, q_d, kwargs


def _routing(tokens=TOKENS):
    generator = _generator(4)
    ids = torch.randint(0, EXPERTS, (tokens, TOP_K), generator=generator, dtype=torch.int32)
    return torch.rand(tokens, TOP_K, generator=generator), ids


def _raises_everywhere(args, kwargs, message):
    """The op, its eager body and its fake kernel (torch.compile's view) all refuse."""
    with pytest.raises(ValueError, match=message):
        torch.ops.moeroute.experts(*args, **kwargs)
    with pytest.raises(ValueError, match=message):
        ops.experts(*args, **kwargs)
    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(ValueError, match=message):
        torch.ops.moeroute.experts(*args, **kwargs)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("id_rows", [TOKENS - 2, TOKENS + 3, 0])
def test_topk_ids_for_another_token_count_are_refused_in_every_format(fmt, id_rows):
    # TOKENS + 3: the case that crashed the interpreter; it must raise here, in-process.
    w_gate_up, w_down, kwargs = _weights(fmt)
    x = torch.randn(TOKENS, HIDDEN, generator=_generator(5))
    weights, ids = _routing(id_rows)
    message = (
        rf"topk_ids has shape \({id_rows}, {TOP_K}\) and hidden_states \({TOKENS}, {HIDDEN}\); "
        rf"topk_ids must be \[T, K\] with T = hidden_states.shape\[0\] = {TOKENS}"
    )
    _raises_everywhere((x, w_gate_up, w_down, weights, ids), kwargs, message)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "change, message",
    [
        (dict(weights=torch.rand(TOKENS, TOP_K + 1)), r"topk_weights must be float32 of the shape of topk_ids"),
        (dict(weights=torch.rand(TOKENS, TOP_K, dtype=torch.float64)), r"topk_weights must be float32.*float64"),
        (dict(ids=torch.zeros(TOKENS, TOP_K, dtype=torch.int64)), r"topk_ids must be int32 \[T, K\], got torch.int64"),
        (dict(ids=torch.zeros(TOKENS * TOP_K, dtype=torch.int32)), r"topk_ids must be int32 \[T, K\], got .* \(12,\)"),
    ],
)
def test_topk_weights_and_ids_dtype_and_shape_in_every_format(fmt, change, message):
    w_gate_up, w_down, kwargs = _weights(fmt)
    weights, ids = _routing()
    args = dict(x=torch.randn(TOKENS, HIDDEN), w_gate_up=w_gate_up, w_down=w_down, weights=weights, ids=ids)
    args.update(change)
    _raises_everywhere(tuple(args.values()), kwargs, message)


def _meta_cases(fmt):
    names = ["w_gate_up", "w_down", "topk_ids", "topk_weights"]
    return [(fmt, name) for name in names + ([] if fmt == "float" else ["gate_up_scale", "down_scale"])]


@pytest.mark.parametrize("fmt, name", [case for fmt in FORMATS for case in _meta_cases(fmt)])
def test_a_tensor_on_the_meta_device_is_refused_naming_both_devices(fmt, name):
    w_gate_up, w_down, kwargs = _weights(fmt)
    weights, ids = _routing()
    args = dict(x=torch.randn(TOKENS, HIDDEN), w_gate_up=w_gate_up, w_down=w_down, topk_weights=weights, topk_ids=ids)
    if name in args:
        args[name] = args[name].to("meta")
    else:
        kwargs = {**kwargs, name: kwargs[name].to("meta")}
    _raises_everywhere(tuple(args.values()), kwargs, rf"{name} is on meta, hidden_states on cpu")


def test_meta_hidden_states_with_cpu_weights_are_refused():
    w_gate_up, w_down, kwargs = _weights("fp8_block")
    weights, ids = _routing()
    with pytest.raises(ValueError, match=r"w_gate_up is on cpu, hidden_states on meta"):
        ops.experts(torch.randn(TOKENS, HIDDEN, device="meta"), w_gate_up, w_down, weights, ids, **kwargs)


@pytest.mark.parametrize(
    "fmt, tensor",
    [
        ("float", "w_down"),
        ("fp8_block", "w_down"),
        ("fp8_block", "down_scale"),
        ("mxfp4", "w_down"),
        ("mxfp4", "gate_up_scale"),
    ],
)
def test_moe_forward_refuses_an_expert_tensor_left_on_the_meta_device(fmt, tensor):
    quant = (
        None if fmt == "float" else QuantConfig(fmt, block_size=(32, 32)) if fmt == "fp8_block" else QuantConfig(fmt)
    )
    module = MoE(RouterConfig(EXPERTS, TOP_K), HIDDEN, INTER, quant=quant)
    old = getattr(module.experts, tensor)
    if isinstance(old, torch.nn.Parameter):
        setattr(module.experts, tensor, torch.nn.Parameter(old.to("meta"), requires_grad=False))
    else:
        setattr(module.experts, tensor, old.to("meta"))
    with pytest.raises(ValueError, match=r"is on meta, hidden_states on cpu"):
        module(torch.randn(3, HIDDEN))


@pytest.mark.parametrize(
    "fmt, gemm, allowed",
    [
        ("fp8_block", "loop", "'auto', 'rows', 'blocks'"),
        ("fp8_tensor", "padded", "'auto', 'rows', 'blocks'"),
        ("mxfp4", "loop", "'auto', 'rows', 'blocks'"),
        ("float", "blocks", "'auto', 'loop', 'padded'"),
    ],
)
def test_an_unknown_strategy_names_the_ops_gemm_argument(fmt, gemm, allowed):
    w_gate_up, w_down, kwargs = _weights(fmt)
    weights, ids = _routing()
    args = (torch.randn(TOKENS, HIDDEN), w_gate_up, w_down, weights, ids, "silu", gemm)
    _raises_everywhere(args, kwargs, rf"^gemm='{gemm}' is not an? .*{allowed}")


# ------------------------------------------------------------------ the routing ops and fused_experts


def test_routing_ops_refuse_a_tensor_on_another_device():
    from moeroute.layout import ExpertLayout

    logits = torch.randn(4, EXPERTS)
    with pytest.raises(ValueError, match="correction_bias is on meta, logits on cpu"):
        ops.select_experts(logits, RouterConfig(EXPERTS, TOP_K), torch.zeros(EXPERTS, device="meta"))
    weights, ids = _routing()
    layout = ExpertLayout(EXPERTS, 1, shared="fused")
    for kwargs, name in (
        (dict(topk_weights=weights.to("meta")), "topk_weights"),
        (dict(shared_weights=torch.ones(TOKENS, device="meta")), "shared_weights"),
    ):
        args = dict(topk_weights=weights, topk_ids=ids, shared_weights=1.0)
        args.update(kwargs)
        with pytest.raises(ValueError, match=rf"{name} is on meta, topk_ids on cpu"):
            ops.append_shared_slots(args["topk_weights"], args["topk_ids"], layout, 0, args["shared_weights"])
        with (
            FakeTensorMode(allow_non_fake_inputs=True),
            pytest.raises(ValueError, match=rf"{name} is on meta, topk_ids on cpu"),
        ):
            ops.append_shared_slots(args["topk_weights"], args["topk_ids"], layout, 0, args["shared_weights"])


@pytest.mark.parametrize("id_rows", [TOKENS - 1, TOKENS + 1])
def test_fused_experts_fake_refuses_ids_for_another_token_count(id_rows):
    w_gate_up, w_down, _ = _weights("float")
    weights, ids = _routing(id_rows)
    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(ValueError, match="topk_ids has shape"):
        torch.ops.moeroute.fused_experts(torch.randn(TOKENS, HIDDEN), w_gate_up, w_down, weights, ids)


@pytest.mark.parametrize("tensor", ["router_weight", "correction_bias"])
def test_moe_forward_refuses_a_routing_tensor_left_on_the_meta_device(tensor):
    module = MoE(RouterConfig(EXPERTS, TOP_K), HIDDEN, INTER, correction_bias=True)
    old = getattr(module, tensor)
    if isinstance(old, torch.nn.Parameter):
        setattr(module, tensor, torch.nn.Parameter(old.to("meta"), requires_grad=False))
    else:
        setattr(module, tensor, old.to("meta"))
    with pytest.raises(ValueError, match=rf"hidden_states is on cpu but the module's {tensor} is on meta"):
        module(torch.randn(3, HIDDEN))
