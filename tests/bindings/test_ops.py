"""torch.ops.moeroute.*: values against the NumPy/torch references, torch.library.opcheck on
every op, fake kernels, the key registries and the errors."""

from __future__ import annotations

import copy
import gc

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from helpers.reference import dense_experts
from helpers.reference import generator as _generator
from moeroute.bindings.torch import ops
from moeroute.bindings.torch.moe import MoE
from moeroute.config import RouterConfig
from moeroute.layout import ExpertLayout
from moeroute.routing import reference

H, I, N = 24, 16, 8
FP32_ATOL = 1e-5  # float32 outputs of magnitude ~1: a few ulps of accumulation-order difference

SOFTMAX = RouterConfig(N, 3, "softmax", renormalize=True, routed_scaling_factor=1.5)
GROUPED = RouterConfig(16, 4, "sigmoid", num_expert_group=4, topk_group=2, renormalize=True, routed_scaling_factor=2.5)


def _opcheck(op, args, kwargs=None):
    """opcheck's schema, fake-tensor and AOT-dispatch (dynamic shapes) checks all pass."""
    results = torch.library.opcheck(op, args, kwargs)
    assert set(results.values()) == {"SUCCESS"}, results


def test_ops_are_registered_in_the_moeroute_namespace():
    for name in ("select_experts", "append_shared_slots", "experts", "fused_experts", "moe_forward"):
        packet = getattr(torch.ops.moeroute, name)
        assert packet.default._schema.name == f"moeroute::{name}"
        assert ops.OPS[name]._qualname == f"moeroute::{name}"


# ------------------------------------------------------------------ select_experts


@pytest.mark.parametrize("router, with_bias", [(SOFTMAX, False), (GROUPED, True)])
def test_select_experts_op_matches_reference(router, with_bias):
    logits = torch.randn(11, router.num_experts, generator=_generator(1))
    bias = torch.randn(router.num_experts, generator=_generator(2)) * 0.1 if with_bias else None
    weights, ids = ops.select_experts(logits, router, bias)
    expected_weights, expected_ids = reference.select_experts(
        logits.numpy(), router, None if bias is None else bias.numpy()
    )
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    np.testing.assert_array_equal(ids.numpy(), expected_ids)
    np.testing.assert_allclose(weights.numpy(), expected_weights, rtol=1e-6, atol=1e-7)
    args = (
        logits,
        router.top_k,
        router.scoring,
        router.num_expert_group,
        router.topk_group,
        router.renormalize,
        float(router.routed_scaling_factor),
        bias,
    )
    _opcheck(ops.OPS["select_experts"], args)


def test_select_experts_op_zero_tokens():
    weights, ids = ops.select_experts(torch.empty(0, N), SOFTMAX)
    assert tuple(ids.shape) == (0, SOFTMAX.top_k) and tuple(weights.shape) == (0, SOFTMAX.top_k)


def test_select_experts_op_errors():
    with pytest.raises(ValueError, match="logits must be 2-D"):
        torch.ops.moeroute.select_experts(torch.zeros(N), 2)
    with pytest.raises(ValueError, match="top_k=9"):
        torch.ops.moeroute.select_experts(torch.zeros(3, N), 9)
    with pytest.raises(ValueError, match=r"logits must be \[T, N=8\]"):
        ops.select_experts(torch.zeros(3, 6), SOFTMAX)
    with pytest.raises(TypeError, match="RouterConfig"):
        ops.select_experts(torch.zeros(3, N), {"top_k": 2})
    # The fake kernel refuses the same arguments at trace time.
    with FakeTensorMode() as mode, pytest.raises(ValueError, match="top_k=9"):
        torch.ops.moeroute.select_experts(mode.from_tensor(torch.zeros(3, N)), 9)


# ------------------------------------------------------------------ append_shared_slots


def test_append_shared_slots_op_worked_example():
    # docs/semantics.md section 2: N=8, S=1, E=2, all2all; a token from rank 1 routed to logical 4 and 7
    # gets physical ids 5 and 8 and shared id 9.
    layout = ExpertLayout(8, 1, ep_size=2, dispatch="all2all")
    ids = torch.tensor([[4, 7]], dtype=torch.int32)
    weights = torch.tensor([[0.6, 0.4]])
    out_weights, out_ids = ops.append_shared_slots(weights, ids, layout, home_rank=1, shared_weights=0.5)
    assert out_ids.tolist() == [[5, 8, 9]]
    np.testing.assert_allclose(out_weights.numpy(), [[0.6, 0.4, 0.5]])


@pytest.mark.parametrize("weight_form", ["none", "scalar", "tensor"])
@pytest.mark.parametrize(
    "layout_args",
    [dict(num_shared_experts=2), dict(num_shared_experts=0), dict(num_shared_experts=1, num_redundant_experts=3)],
)
def test_append_shared_slots_op_matches_reference(layout_args, weight_form):
    layout = ExpertLayout(N, **layout_args)
    topk_weights, topk_ids = reference.select_experts(torch.randn(9, N, generator=_generator(3)).numpy(), SOFTMAX)
    gate = torch.rand(9, generator=_generator(4))
    shared_weights = {"none": None, "scalar": 0.25, "tensor": gate}[weight_form]
    weights, ids = ops.append_shared_slots(
        torch.from_numpy(topk_weights), torch.from_numpy(topk_ids), layout, 0, shared_weights
    )
    expected_weights, expected_ids = reference.append_shared_slots(
        topk_weights, topk_ids, layout, 0, gate.numpy() if weight_form == "tensor" else shared_weights
    )
    np.testing.assert_array_equal(ids.numpy(), expected_ids)
    np.testing.assert_array_equal(weights.numpy(), expected_weights)
    op_args = (
        torch.from_numpy(topk_weights),
        torch.from_numpy(topk_ids),
        ops.layout_key(layout),
        0,
        gate if weight_form == "tensor" else None,
        0.25 if weight_form == "scalar" else None,
    )
    _opcheck(ops.OPS["append_shared_slots"], op_args)


def test_layout_keys_are_stable_per_layout_and_weak():
    first = ExpertLayout(N, 1)
    key = ops.layout_key(first)
    assert ops.layout_key(first) == key
    assert ops.layout_key(ExpertLayout(N, 1)) != key
    copied = copy.deepcopy(first)  # carries the original's key attribute: gets its own
    assert ops.layout_key(copied) not in (key, None)
    del first
    gc.collect()
    with pytest.raises(ValueError, match="names no live ExpertLayout"):
        torch.ops.moeroute.append_shared_slots(
            torch.zeros(1, 2), torch.zeros(1, 2, dtype=torch.int32), key, 0, None, None
        )
    with pytest.raises(TypeError, match="ExpertLayout"):
        ops.layout_key("layout.0")


def test_append_shared_slots_op_rejects_both_weight_forms():
    key = ops.layout_key(layout := ExpertLayout(N, 1))
    with pytest.raises(ValueError, match="not both"):
        torch.ops.moeroute.append_shared_slots(
            torch.zeros(1, 2), torch.zeros(1, 2, dtype=torch.int32), key, 0, torch.ones(1), 1.0
        )
    assert layout.shared == "fused"


# ------------------------------------------------------------------ experts (CPU)


def _expert_problem(seed, tokens=10, slots=3, experts=5, dtype=torch.float32):
    generator = _generator(seed)
    hidden = torch.randn(tokens, H, generator=generator).to(dtype)
    w_gate_up = (torch.randn(experts, 2 * I, H, generator=generator) * 0.3).to(dtype)
    w_down = (torch.randn(experts, H, I, generator=generator) * 0.3).to(dtype)
    # Ids outside [0, experts) (another rank's) must be skipped.
    ids = torch.randint(-1, experts + 1, (tokens, slots), generator=generator, dtype=torch.int32)
    weights = torch.rand(tokens, slots, generator=generator)
    return hidden, w_gate_up, w_down, weights, ids


def _experts_reference(hidden, w_gate_up, w_down, weights, ids, activation="silu"):
    """sum over the slots with a local id of w * down(act(gate x) * up x), float64."""
    return dense_experts(hidden, weights, ids, w_gate_up, w_down, activation)


@pytest.mark.parametrize("gemm", ["auto", "loop", "padded", "rows"])
@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_experts_op_matches_reference(gemm, activation):
    args = _expert_problem(5)
    out = torch.ops.moeroute.experts(*args, activation, gemm)
    assert out.dtype == torch.float32 and tuple(out.shape) == (10, H)
    torch.testing.assert_close(out.double(), _experts_reference(*args, activation), rtol=1e-5, atol=FP32_ATOL)
    _opcheck(ops.OPS["experts"], (*args, activation, gemm))


@pytest.mark.parametrize("gemm", ["loop", "padded", "rows"])
def test_experts_op_with_biases_matches_reference(gemm):
    hidden, w_gate_up, w_down, weights, ids = _expert_problem(12)
    generator = _generator(13)
    b_gate_up = torch.randn(5, 2 * I, generator=generator) * 0.5
    b_down = torch.randn(5, H, generator=generator) * 0.5
    out = torch.ops.moeroute.experts(hidden, w_gate_up, w_down, weights, ids, "silu", gemm, b_gate_up, b_down)
    expected = dense_experts(hidden, weights, ids, w_gate_up, w_down, "silu", b_gate_up, b_down)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=FP32_ATOL)
    _opcheck(ops.OPS["experts"], (hidden, w_gate_up, w_down, weights, ids, "silu", gemm, b_gate_up, b_down))
    with pytest.raises(ValueError, match=r"b_down must be torch.float32 \[5, 24\]"):
        torch.ops.moeroute.experts(hidden, w_gate_up, w_down, weights, ids, "silu", gemm, b_gate_up, b_down[:, 1:])


def test_experts_op_bfloat16():
    args = _expert_problem(6, dtype=torch.bfloat16)
    out = torch.ops.moeroute.experts(*args)
    assert out.dtype == torch.bfloat16
    expected = _experts_reference(*args)
    # bfloat16 rounds the input, the intermediate and the output (8 significant bits).
    assert ((out.double() - expected).norm() / expected.norm()).item() < 3e-2
    _opcheck(ops.OPS["experts"], args)


def test_experts_op_zero_tokens():
    hidden, w_gate_up, w_down, weights, ids = _expert_problem(7)
    out = torch.ops.moeroute.experts(hidden[:0], w_gate_up, w_down, weights[:0], ids[:0])
    assert tuple(out.shape) == (0, H)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(hidden=torch.zeros(10, H + 1)), r"w_gate_up must be \[L, 2I, H=25\]"),
        (dict(w_down=torch.zeros(5, H, I + 1)), r"w_down must be \[L, H, I\]"),
        (dict(ids=torch.zeros(10, 3, dtype=torch.int64)), "topk_ids must be int32"),
        (dict(weights=torch.zeros(10, 2)), "topk_weights must be float32 of the shape"),
        (dict(w_gate_up=torch.zeros(5, 2 * I, H, dtype=torch.float64)), "dtype"),
        (dict(activation="relu"), "activation='relu'"),
        (dict(gemm="grouped"), "gemm='grouped'"),
    ],
)
def test_experts_op_errors(change, message):
    hidden, w_gate_up, w_down, weights, ids = _expert_problem(8)
    args = dict(
        hidden=hidden, w_gate_up=w_gate_up, w_down=w_down, weights=weights, ids=ids, activation="silu", gemm="auto"
    )
    args.update(change)
    with pytest.raises(ValueError, match=message):
        torch.ops.moeroute.experts(*args.values())
    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(ValueError, match=message):
        torch.ops.moeroute.experts(*args.values())


# ------------------------------------------------------------------ experts on physical ids (expert_map)

NUM_PHYSICAL = 12
#: Five local experts held among twelve physical ones; -1: held by another rank.
EXPERT_MAP = torch.tensor([-1, 3, -1, 0, -1, -1, 4, 1, -1, 2, -1, -1], dtype=torch.int32)


def _physical_problem(seed, tokens=10, slots=3, dtype=torch.float32):
    """Experts 0..4 held as physical ids 3, 7, 9, 1, 6; rows 0 and 1 route only to unheld
    experts; one slot carries an id past the map (treated as not held)."""
    hidden, w_gate_up, w_down, weights, _ = _expert_problem(seed, tokens, slots, 5, dtype)
    ids = torch.randint(0, NUM_PHYSICAL, (tokens, slots), generator=_generator(seed + 100), dtype=torch.int32)
    ids[0] = torch.tensor([0, 2, 4][:slots], dtype=torch.int32)
    ids[1] = torch.tensor([11, 8, 5][:slots], dtype=torch.int32)
    ids[2, 0] = NUM_PHYSICAL + 3
    return hidden, w_gate_up, w_down, weights, ids


def _held_ids(ids, expert_map):
    """The reference's local ids, written slot by slot: expert_map[p], -1 for p outside the map."""
    table = expert_map.tolist()
    return torch.tensor(
        [[table[p] if 0 <= p < len(table) else -1 for p in row] for row in ids.tolist()], dtype=torch.int64
    )


@pytest.mark.parametrize("gemm", ["auto", "loop", "padded", "rows"])
def test_experts_op_with_expert_map_matches_reference_over_held_experts(gemm):
    hidden, w_gate_up, w_down, weights, ids = _physical_problem(31)
    out = torch.ops.moeroute.experts(hidden, w_gate_up, w_down, weights, ids, "silu", gemm, expert_map=EXPERT_MAP)
    expected = dense_experts(hidden, weights, _held_ids(ids, EXPERT_MAP), w_gate_up, w_down)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=FP32_ATOL)
    assert torch.count_nonzero(out[:2]) == 0  # rows whose slots are all held elsewhere
    held_rows = (_held_ids(ids, EXPERT_MAP) >= 0).any(1)
    assert torch.equal(out.abs().sum(1) > 0, held_rows) and int(held_rows.sum()) >= 6
    # The eager body, an int64 map, and the op agree; opcheck runs schema, fake and AOT with the map.
    eager = ops.experts(hidden, w_gate_up, w_down, weights, ids, "silu", gemm, expert_map=EXPERT_MAP.long())
    torch.testing.assert_close(eager, out, rtol=0, atol=0)
    _opcheck(ops.OPS["experts"], (hidden, w_gate_up, w_down, weights, ids, "silu", gemm), dict(expert_map=EXPERT_MAP))


def test_experts_op_with_expert_map_and_biases():
    hidden, w_gate_up, w_down, weights, ids = _physical_problem(32)
    generator = _generator(33)
    b_gate_up = torch.randn(5, 2 * I, generator=generator) * 0.5
    b_down = torch.randn(5, H, generator=generator) * 0.5
    out = torch.ops.moeroute.experts(
        hidden, w_gate_up, w_down, weights, ids, "silu", "loop", b_gate_up, b_down, expert_map=EXPERT_MAP
    )
    expected = dense_experts(hidden, weights, _held_ids(ids, EXPERT_MAP), w_gate_up, w_down, "silu", b_gate_up, b_down)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=FP32_ATOL)
    assert torch.count_nonzero(out[:2]) == 0  # no bias leaks into rows with no held expert


def test_experts_op_with_expert_map_bfloat16():
    args = _physical_problem(34, dtype=torch.bfloat16)
    hidden, w_gate_up, w_down, weights, ids = args
    out = torch.ops.moeroute.experts(*args, expert_map=EXPERT_MAP)
    expected = dense_experts(hidden, weights, _held_ids(ids, EXPERT_MAP), w_gate_up, w_down)
    assert out.dtype == torch.bfloat16
    assert ((out.double() - expected).norm() / expected.norm()).item() < 3e-2
    assert torch.count_nonzero(out[:2]) == 0


def test_fp8_experts_op_with_expert_map_matches_reference_over_held_experts():
    from moeroute.quant import QuantConfig, quantize_experts
    from moeroute.quant.reference import moe_experts_reference

    hidden_size, inter = 128, 80
    quant = QuantConfig("fp8_block", block_size=(32, 64))
    generator = _generator(35)
    q_gu, s_gu, q_d, s_d = quantize_experts(
        torch.randn(5, 2 * inter, hidden_size, generator=generator) * 0.1,
        torch.randn(5, hidden_size, inter, generator=generator) * 0.1,
        quant,
    )
    _, _, _, weights, ids = _physical_problem(36)
    x = torch.randn(ids.shape[0], hidden_size, generator=generator)
    kwargs = dict(
        gate_up_scale=s_gu,
        down_scale=s_d,
        quant_format=quant.format,
        block_size=list(quant.block_size),
        expert_map=EXPERT_MAP,
    )
    out = torch.ops.moeroute.experts(x, q_gu, q_d, weights, ids, **kwargs)
    expected = moe_experts_reference(x, weights, _held_ids(ids, EXPERT_MAP), q_gu, s_gu, q_d, s_d, quant.block_size)
    assert float((out - expected).abs().max() / expected.abs().max()) < 1e-4
    assert torch.count_nonzero(out[:2]) == 0
    # Same as the local ids given directly: the map is the only difference.
    local = torch.ops.moeroute.experts(
        x, q_gu, q_d, weights, _held_ids(ids, EXPERT_MAP).int(), **{**kwargs, "expert_map": None}
    )
    torch.testing.assert_close(out, local, rtol=0, atol=0)


def test_experts_op_with_expert_map_compiles():
    hidden, w_gate_up, w_down, weights, ids = _physical_problem(37)

    def layer(x, topk_weights, topk_ids, expert_map):
        return torch.ops.moeroute.experts(x, w_gate_up, w_down, topk_weights, topk_ids, expert_map=expert_map) + x

    compiled = torch.compile(layer, fullgraph=True)
    with torch.inference_mode():
        actual = compiled(hidden, weights, ids, EXPERT_MAP)
    expected = dense_experts(hidden, weights, _held_ids(ids, EXPERT_MAP), w_gate_up, w_down) + hidden.double()
    torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=FP32_ATOL)


@pytest.mark.parametrize(
    "expert_map, error, message",
    [
        (EXPERT_MAP.float(), TypeError, "expert_map must hold integers"),
        (EXPERT_MAP.bool(), TypeError, "expert_map must hold integers"),
        (EXPERT_MAP.reshape(3, 4), ValueError, r"expert_map must be 1-D"),
        (torch.where(EXPERT_MAP == 4, 5, EXPERT_MAP), ValueError, r"expert_map values must be .* \[0, 5\).*\[-1, 5\]"),
        (torch.where(EXPERT_MAP == -1, -2, EXPERT_MAP), ValueError, r"expert_map values .*\[-2, 4\]"),
    ],
)
def test_experts_op_expert_map_errors(expert_map, error, message):
    hidden, w_gate_up, w_down, weights, ids = _physical_problem(38)
    with pytest.raises(error, match=message):
        torch.ops.moeroute.experts(hidden, w_gate_up, w_down, weights, ids, expert_map=expert_map)
    with pytest.raises(error, match=message):
        ops.experts(hidden, w_gate_up, w_down, weights, ids, expert_map=expert_map)
    if "values" not in message:  # the fake kernel sees shapes and dtypes, not values
        with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(error, match=message):
            torch.ops.moeroute.experts(hidden, w_gate_up, w_down, weights, ids, expert_map=expert_map)


@pytest.mark.gpu
def test_experts_op_with_expert_map_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    args = _physical_problem(40)
    hidden, w_gate_up, w_down, weights, ids = args
    out = torch.ops.moeroute.experts(*(t.cuda() for t in args), expert_map=EXPERT_MAP.cuda())
    expected = dense_experts(hidden, weights, _held_ids(ids, EXPERT_MAP), w_gate_up, w_down)
    torch.testing.assert_close(out.double().cpu(), expected, rtol=1e-4, atol=1e-4)
    assert torch.count_nonzero(out[:2]) == 0
    with pytest.raises(ValueError, match="expert_map is on cpu"):
        torch.ops.moeroute.experts(*(t.cuda() for t in args), expert_map=EXPERT_MAP)


def test_experts_eager_body_rejects_a_non_tensor_expert_map():
    hidden, w_gate_up, w_down, weights, ids = _physical_problem(39)
    with pytest.raises(TypeError, match="expert_map must be an integer torch.Tensor"):
        ops.experts(hidden, w_gate_up, w_down, weights, ids, expert_map=EXPERT_MAP.tolist())


# ------------------------------------------------------------------ fused_experts (CUDA)


def _meta(*tensors):
    return tuple(t.to("meta") for t in tensors)


def test_fused_experts_op_schema_and_fake_on_meta_tensors():
    hidden, w_gate_up, w_down, weights, ids = _expert_problem(9)
    # Its real kernel needs CUDA; on the CPU its schema and fake kernel run on meta tensors.
    args = (*_meta(hidden, w_gate_up, w_down, weights, ids), "silu", True, None)
    _opcheck(ops.OPS["fused_experts"], args)
    out = torch.ops.moeroute.fused_experts(*args)
    assert out.device.type == "meta" and tuple(out.shape) == (10, H) and out.dtype == torch.float32
    int64_ids = ids.long()
    with FakeTensorMode() as mode, pytest.raises(ValueError, match="topk_ids must be int32"):
        torch.ops.moeroute.fused_experts(
            *(mode.from_tensor(t) for t in (hidden, w_gate_up, w_down, weights)), mode.from_tensor(int64_ids)
        )


def test_fused_experts_op_refuses_cpu_tensors():
    hidden, w_gate_up, w_down, weights, ids = _expert_problem(10)
    pytest.importorskip("cupy")
    with pytest.raises(TypeError, match="needs CUDA"):
        torch.ops.moeroute.fused_experts(hidden, w_gate_up, w_down, weights, ids)


@pytest.mark.gpu
def test_fused_experts_op_matches_reference_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    args = _expert_problem(11)
    hidden, w_gate_up, w_down, weights, ids = (t.cuda() for t in args)
    out = torch.ops.moeroute.fused_experts(hidden, w_gate_up, w_down, weights, ids)
    torch.testing.assert_close(out.double().cpu(), _experts_reference(*args), rtol=1e-4, atol=1e-4)
    via_experts = torch.ops.moeroute.experts(hidden, w_gate_up, w_down, weights, ids)
    torch.testing.assert_close(via_experts, out, rtol=0, atol=0)
    _opcheck(ops.OPS["fused_experts"], (hidden, w_gate_up, w_down, weights, ids, "silu", True, None))


# ------------------------------------------------------------------ moe_forward


def _moe(seed=0, **kwargs):
    module = MoE(SOFTMAX, H, I, **kwargs)
    generator = _generator(seed)
    with torch.no_grad():
        module.router_weight.copy_(torch.randn(N, H, generator=generator))
        module.load_routed_weights(
            torch.randn(N, 2 * I, H, generator=generator) * 0.3, torch.randn(N, H, I, generator=generator) * 0.3
        )
    return module


def _moe_reference(module, x):
    """The layer without a shared expert, in float64 from the reference routing."""
    logits = F.linear(x, module.router_weight).float()
    weights, ids = reference.select_experts(logits.numpy(), module.router)
    return _experts_reference(
        x, module.experts.w_gate_up, module.experts.w_down, torch.from_numpy(weights), torch.from_numpy(ids)
    )


def test_moe_forward_is_the_op_and_matches_reference():
    module = _moe()
    x = torch.randn(2, 5, H, generator=_generator(12))
    with torch.inference_mode():
        out = module(x)
        direct = torch.ops.moeroute.moe_forward(x, None, module.layer_key)
        eager = module.forward_impl(x)
    torch.testing.assert_close(
        out.double(), _moe_reference(module, x.reshape(-1, H)).reshape(x.shape), rtol=1e-5, atol=FP32_ATOL
    )
    assert torch.equal(out, direct) and torch.equal(out, eager)
    with torch.no_grad():
        _opcheck(ops.OPS["moe_forward"], (x, None, module.layer_key))
        logits = torch.randn(10, N, generator=_generator(13))
        _opcheck(ops.OPS["moe_forward"], (x, logits, module.layer_key))


def test_moe_forward_traced_graph_holds_only_the_op():
    module = _moe(shared_experts=torch.nn.Linear(H, H, bias=False))
    x = torch.randn(6, H, generator=_generator(14))
    with torch.no_grad():
        exported = torch.export.export(module, (x,))
        targets = [node.target for node in exported.graph.nodes if node.op == "call_function"]
        assert targets == [torch.ops.moeroute.moe_forward.default]
        torch.testing.assert_close(exported.module()(x), module.forward_impl(x), rtol=0, atol=0)


def test_layer_keys_are_unique_and_follow_copies():
    module = _moe(1)
    copied = copy.deepcopy(module)
    assert copied.layer_key != module.layer_key
    assert ops.registered_layer(copied.layer_key) is copied
    with torch.no_grad():
        copied.experts.w_down.mul_(2.0)
        x = torch.randn(4, H, generator=_generator(15))
        # The copy's op runs the copy: its outputs double, the original's do not.
        torch.testing.assert_close(copied(x), 2.0 * module(x), rtol=1e-6, atol=1e-6)


def test_moe_forward_unknown_layer_key():
    module = _moe(2)
    key = module.layer_key
    del module
    gc.collect()
    with pytest.raises(ValueError, match=f"layer_key='{key}' names no live moeroute layer"):
        torch.ops.moeroute.moe_forward(torch.zeros(2, H), None, key)


def test_moe_forward_checks_inputs_before_the_op():
    module = _moe(3)
    with pytest.raises(TypeError, match="hidden_states must be a torch.Tensor"):
        module([[0.0] * H])
    with pytest.raises(ValueError, match="router_logits must be"):
        module(torch.zeros(3, H), torch.zeros(3, N + 1))
    with pytest.raises(RuntimeError, match="inference-only"):
        module(torch.zeros(3, H, requires_grad=True))


# ------------------------------------------------------------------ the routing pair's order


ORDER_MESSAGE = r"topk_weights must be a floating array, got dtype int32 \(weights come before ids since 0.2"


def test_append_shared_slots_takes_weights_then_ids_and_refuses_the_old_order():
    layout = ExpertLayout(8, 1, ep_size=2, dispatch="all2all")
    weights = torch.tensor([[0.6, 0.4], [0.3, 0.7]])
    ids = torch.tensor([[4, 7], [0, 3]], dtype=torch.int32)
    out_weights, out_ids = ops.append_shared_slots(weights, ids, layout, 1, 0.5)
    expected_weights, expected_ids = reference.append_shared_slots(weights.numpy(), ids.numpy(), layout, 1, 0.5)
    assert out_ids.dtype == torch.int32 and out_weights.dtype == torch.float32
    np.testing.assert_array_equal(out_ids.numpy(), expected_ids)
    np.testing.assert_array_equal(out_weights.numpy(), expected_weights)
    with pytest.raises(TypeError, match=ORDER_MESSAGE):
        ops.append_shared_slots(ids, weights, layout, 1, 0.5)
    with pytest.raises(TypeError, match=ORDER_MESSAGE):
        torch.ops.moeroute.append_shared_slots(ids, weights, ops.layout_key(layout), 1, None, 0.5)
    with FakeTensorMode() as mode, pytest.raises(TypeError, match=ORDER_MESSAGE):
        torch.ops.moeroute.append_shared_slots(
            mode.from_tensor(ids), mode.from_tensor(weights), ops.layout_key(layout), 1, None, 0.5
        )


def test_experts_op_refuses_ids_before_weights():
    hidden, w_gate_up, w_down, weights, ids = _expert_problem(41)
    old_order = (hidden, w_gate_up, w_down, ids, weights)
    with pytest.raises(TypeError, match=ORDER_MESSAGE):
        torch.ops.moeroute.experts(*old_order)
    with pytest.raises(TypeError, match=ORDER_MESSAGE):
        ops.experts(*old_order)
    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(TypeError, match=ORDER_MESSAGE):
        torch.ops.moeroute.experts(*old_order)
    with pytest.raises(TypeError, match=ORDER_MESSAGE):
        torch.ops.moeroute.fused_experts(*_meta(*old_order))
    # Float ids with integer-looking weights: the ids' own check names them.
    with pytest.raises(TypeError, match=r"topk_ids must be an integer array, got dtype float32 \(weights come before"):
        torch.ops.moeroute.experts(hidden, w_gate_up, w_down, weights, weights)
