"""The vLLM plugin's switch, decline rules and layer plans, without vLLM.

The plugin serving real vLLM layers is tested end to end in tests_vllm/ (``make test-vllm``).
Here vLLM's layer objects are stood in by namespaces carrying the attributes the plugin
reads, so that each rule is checked on its own.
"""

import dataclasses
import logging
import sys
from enum import Enum
from types import SimpleNamespace

import pytest
import torch

from helpers.reference import dense_experts, generator
from moeroute.compat import vllm_plugin
from moeroute.config import RouterConfig


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({}, False),
        ({"VLLM_PLUGINS": "moeroute"}, True),
        ({"VLLM_PLUGINS": "lora_filesystem_resolver,moeroute"}, True),
        ({"VLLM_PLUGINS": "moeroute_extra"}, False),
        ({"VLLM_PLUGINS": ""}, False),
        ({"MOEROUTE_VLLM": "1"}, True),
        ({"MOEROUTE_VLLM": "0", "VLLM_PLUGINS": "moeroute"}, False),
        ({"MOEROUTE_VLLM": "1", "VLLM_PLUGINS": "other"}, True),
        ({"MOEROUTE_VLLM": ""}, False),
    ],
)
def test_requested(environ, expected):
    assert vllm_plugin.requested(environ) is expected


@pytest.mark.parametrize("value", ["yes", "true", "2", " 1"])
def test_bad_switch_value_names_the_switch(value):
    with pytest.raises(ValueError, match="MOEROUTE_VLLM") as error:
        vllm_plugin.requested({"MOEROUTE_VLLM": value})
    assert repr(value) in str(error.value)


def test_register_does_nothing_unless_asked(monkeypatch):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.delenv("MOEROUTE_VLLM", raising=False)
    # Asking nothing, it must not even import vLLM: a None module makes any import fail.
    monkeypatch.setitem(sys.modules, "vllm", None)
    assert vllm_plugin.register() is None


class Activation(Enum):
    SILU = "silu"
    GELU = "gelu"
    RELU2 = "relu2_no_mul"
    SWIGLUOAI = "swigluoai"


class CPURouter:
    eplb_state = None


class ZeroExpertRouter:
    eplb_state = None


def _parallel(**sizes):
    values = dict(tp_size=1, dp_size=1, ep_size=1, pcp_size=1, use_ep=False, enable_eplb=False)
    values.update(sizes)
    return SimpleNamespace(**values)


def _layer(**fields):
    """A stand-in vLLM RoutedExperts of a DeepSeek-V3-like layer (16 experts)."""
    import torch

    moe_config = SimpleNamespace(
        moe_parallel_config=_parallel(),
        is_lora_enabled=False,
        activation=Activation.SILU,
        has_bias=False,
        has_hash_routing=False,
    )
    values = dict(
        moe_config=moe_config,
        layer_name="model.layers.1.mlp.experts",
        global_num_experts=16,
        local_num_experts=16,
        expert_map=None,
        top_k=4,
        use_grouped_topk=True,
        num_expert_group=4,
        topk_group=2,
        scoring_func="sigmoid",
        renormalize=True,
        routed_scaling_factor=2.5,
        custom_routing_function=None,
        apply_router_weight_on_input=False,
        w13_weight=torch.empty(16, 128, 64, dtype=torch.bfloat16),
        w2_weight=torch.empty(16, 64, 64, dtype=torch.bfloat16),
    )
    values.update(fields)
    return SimpleNamespace(**values)


#: Rank 1 of two in vLLM's round-robin placement of 16 experts: odd ids held, as locals 0..7.
_EP_MAP = torch.tensor([-1 if e % 2 == 0 else e // 2 for e in range(16)], dtype=torch.int32)


def _ep_layer(**fields):
    """The stand-in layer on rank 1 of vLLM's TP + EP over two ranks (8 of 16 experts held)."""
    moe_config = SimpleNamespace(
        **{**vars(_layer().moe_config), "moe_parallel_config": _parallel(ep_size=2, use_ep=True)}
    )
    values = dict(
        moe_config=moe_config,
        local_num_experts=8,
        expert_map=_EP_MAP,
        w13_weight=torch.empty(8, 128, 64, dtype=torch.bfloat16),
        w2_weight=torch.empty(8, 64, 64, dtype=torch.bfloat16),
    )
    values.update(fields)
    return _layer(**values)


def _runner(router=None, shared=None):
    return SimpleNamespace(router=router or CPURouter(), shared_experts=shared)


def test_plan_routes_as_the_layer_says():
    layer = _layer()
    plan = vllm_plugin.build_plan(layer, _runner(shared=object()))
    assert plan.router == RouterConfig(
        16, 4, "sigmoid", num_expert_group=4, topk_group=2, renormalize=True, routed_scaling_factor=2.5
    )
    assert plan.activation == "silu"
    # vLLM's runner computes the shared expert; the plan says so.
    assert plan.layout.num_shared_experts == 1
    assert plan.layout.shared == "runner"
    assert "shared expert: runner" in plan.describe()


def test_plan_without_shared_expert_and_without_groups():
    layer = _layer(
        use_grouped_topk=False,
        num_expert_group=None,
        topk_group=None,
        scoring_func="softmax",
        routed_scaling_factor=1.0,
        renormalize=False,
    )
    plan = vllm_plugin.build_plan(layer, _runner())
    assert plan.router == RouterConfig(16, 4, "softmax", renormalize=False)
    assert plan.layout.shared == "none"


def test_plan_refuses_routing_moeroute_cannot_express():
    # top-4 from 1 kept group of 4 experts needs 4 <= 4: fine; top-5 is not.
    with pytest.raises(ValueError, match="top_k"):
        vllm_plugin.build_plan(_layer(top_k=5, topk_group=1), _runner())


def test_supported_layer_is_not_declined():
    assert vllm_plugin.decline_reason(_layer().moe_config, _layer(), _runner()) is None


def _moe(**fields):
    moe = _layer().moe_config
    return SimpleNamespace(**{**vars(moe), **fields})


@pytest.mark.parametrize(
    "moe, layer, runner, words",
    [
        (_moe(), _layer(), None, "runner is not registered"),
        (_moe(moe_parallel_config=_parallel(tp_size=2)), _layer(), _runner(), "tp=2"),
        (
            _moe(moe_parallel_config=_parallel(ep_size=2, use_ep=True)),
            _layer(),
            _runner(),
            "ep=2 ranks without an expert_map",
        ),
        (_moe(moe_parallel_config=_parallel(dp_size=2, ep_size=2, use_ep=True)), _layer(), _runner(), "dp=2"),
        (_moe(moe_parallel_config=_parallel(ep_size=2, use_ep=True, sp_size=2)), _layer(), _runner(), "sp=2"),
        (_moe(moe_parallel_config=_parallel(enable_eplb=True)), _layer(), _runner(), "EPLB"),
        (_moe(is_lora_enabled=True), _layer(), _runner(), "LoRA"),
        (_moe(activation=Activation.RELU2), _layer(), _runner(), "'relu2_no_mul'"),
        (_moe(activation=Activation.SWIGLUOAI), _layer(), _runner(), "'swigluoai'"),
        (_moe(has_bias=True), _layer(), _runner(), "biases"),
        (_moe(), _layer(apply_router_weight_on_input=True), _runner(), "router weight on the input"),
        (_moe(), _layer(custom_routing_function=vllm_plugin.requested), _runner(), "custom function (requested)"),
        (_moe(), _layer(scoring_func="sqrtsoftplus"), _runner(), "'sqrtsoftplus'"),
        (_moe(has_hash_routing=True), _layer(), _runner(), "hash"),
        (_moe(), _layer(), _runner(router=ZeroExpertRouter()), "ZeroExpertRouter"),
        (_moe(), _layer(local_num_experts=8), _runner(), "holds 8 of 16 experts without an expert_map"),
        (_moe(), _ep_layer(expert_map=_EP_MAP[:8]), _runner(), "expert_map has shape (8,)"),
        (_moe(), _ep_layer(expert_map=_EP_MAP.clamp(max=6)), _runner(), "name each of its 8 local experts once"),
        (_moe(), _ep_layer(w13_weight=_layer().w13_weight), _runner(), "w13_weight holds 16 experts"),
        (_moe(), _layer(w13_weight=SimpleNamespace(dtype="torch.float8_e4m3fn")), _runner(), "float8_e4m3fn"),
    ],
)
def test_unsupported_layers_are_declined_with_the_reason(moe, layer, runner, words):
    reason = vllm_plugin.decline_reason(moe, layer, runner)
    assert reason is not None and words in reason, reason


def test_one_log_line_per_reason(monkeypatch, caplog):
    monkeypatch.setattr(vllm_plugin, "_declined_reasons", {})
    monkeypatch.setattr(vllm_plugin, "STATS", vllm_plugin.collections.Counter())
    with caplog.at_level(logging.WARNING, logger="vllm.moeroute"):
        for index in range(3):
            vllm_plugin._decline(f"model.layers.{index}.mlp.experts", "its experts have biases")
        vllm_plugin._decline("model.layers.3.mlp.experts", "LoRA is enabled")
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.moeroute"]
    assert len(lines) == 2
    assert "model.layers.0.mlp.experts" in lines[0] and "its experts have biases" in lines[0]
    assert "model.layers.3.mlp.experts" in lines[1] and "LoRA is enabled" in lines[1]
    assert vllm_plugin.STATS["declined"] == 4


# ------------------------------------------------------------------ expert parallelism (expert_map)


def test_expert_parallel_layer_is_served_with_its_plan():
    layer = _ep_layer()
    assert vllm_plugin.decline_reason(layer.moe_config, layer, _runner()) is None
    plan = vllm_plugin.build_plan(layer, _runner())
    assert plan.router.num_experts == 16 and plan.num_local_experts == 8
    assert "expert parallelism: 8 of 16 experts held here" in plan.describe()
    assert vllm_plugin.build_plan(_layer(), _runner()).num_local_experts is None


def _served(plan):
    method = vllm_plugin._ServedMethod()
    method.plan = plan
    return method


def _held(ids, expert_map):
    """Local ids of the reference, slot by slot: expert_map[p] (-1: another rank's)."""
    table = expert_map.tolist()
    return torch.tensor([[table[p] for p in row] for row in ids.tolist()], dtype=torch.int64)


def _global_ids(tokens, top_k, seed):
    """Distinct global ids per token; token 0 routes only to experts rank 1 does not hold."""
    ids = torch.stack([torch.randperm(16, generator=generator(seed + t))[:top_k] for t in range(tokens)])
    ids[0] = torch.arange(0, 2 * top_k, 2)
    return ids.to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_parallel_layer_computes_its_partial_sum(dtype):
    hidden, inter, tokens, top_k = 64, 32, 9, 4
    g = generator(40)
    layer = _ep_layer(
        w13_weight=(torch.randn(8, 2 * inter, hidden, generator=g) * 0.2).to(dtype),
        w2_weight=(torch.randn(8, hidden, inter, generator=g) * 0.2).to(dtype),
    )
    plan = vllm_plugin.build_plan(layer, _runner())
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    ids, weights = _global_ids(tokens, top_k, 41), torch.rand(tokens, top_k, generator=g)
    out = _served(plan)._experts(layer, x, weights, ids)
    expected = dense_experts(x, weights, _held(ids, _EP_MAP), layer.w13_weight, layer.w2_weight)
    assert out.dtype == dtype and torch.count_nonzero(out[0]) == 0
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    assert float((out.double() - expected).norm() / expected.norm()) < tolerance
    # The two ranks' partial sums add up to the whole layer (what vLLM's all-reduce gives).
    other_map = torch.where(_EP_MAP == -1, torch.arange(16, dtype=torch.int32) // 2, -1)
    other = _ep_layer(
        expert_map=other_map,
        w13_weight=(torch.randn(8, 2 * inter, hidden, generator=g) * 0.2).to(dtype),
        w2_weight=(torch.randn(8, hidden, inter, generator=g) * 0.2).to(dtype),
    )
    total = out.double() + _served(plan)._experts(other, x, weights, ids).double()
    whole_up = torch.empty(16, 2 * inter, hidden, dtype=dtype)
    whole_down = torch.empty(16, hidden, inter, dtype=dtype)
    whole_up[1::2], whole_up[0::2] = layer.w13_weight, other.w13_weight
    whole_down[1::2], whole_down[0::2] = layer.w2_weight, other.w2_weight
    whole = dense_experts(x, weights, ids, whole_up, whole_down)
    assert float((total - whole).norm() / whole.norm()) < tolerance


def test_expert_parallel_mxfp4_layer_computes_its_partial_sum():
    from moeroute.quant import QuantConfig, quantize_mxfp4
    from moeroute.quant.mxfp4 import dequantize_mxfp4

    hidden, inter, tokens, top_k = 64, 32, 7, 4
    g = generator(42)
    (gu_blocks, gu_scales), (d_blocks, d_scales) = (
        quantize_mxfp4(torch.randn(8, 2 * inter, hidden, generator=g) * 0.2),
        quantize_mxfp4(torch.randn(8, hidden, inter, generator=g) * 0.2),
    )
    gu_bias, d_bias = torch.randn(8, 2 * inter, generator=g) * 0.3, torch.randn(8, hidden, generator=g) * 0.3
    # vLLM's packed bytes [E, rows, cols/2] and scale bytes [E, rows, cols/32].
    layer = _ep_layer(
        w13_weight=gu_blocks.reshape(8, 2 * inter, -1),
        w13_weight_scale=gu_scales,
        w2_weight=d_blocks.reshape(8, hidden, -1),
        w2_weight_scale=d_scales,
        w13_bias=gu_bias,
        w2_bias=d_bias,
    )
    plan = dataclasses.replace(
        vllm_plugin.build_plan(layer, _runner()), activation="swigluoai", quant=QuantConfig("mxfp4")
    )
    x = torch.randn(tokens, hidden, generator=g)
    ids, weights = _global_ids(tokens, top_k, 43), torch.rand(tokens, top_k, generator=g)
    out = _served(plan)._experts(layer, x, weights, ids)
    expected = dense_experts(
        x,
        weights,
        _held(ids, _EP_MAP),
        dequantize_mxfp4(gu_blocks, gu_scales),
        dequantize_mxfp4(d_blocks, d_scales),
        "swigluoai",
        gu_bias,
        d_bias,
    )
    assert torch.count_nonzero(out[0]) == 0  # no bias reaches a token none of whose experts are here
    assert float((out.double() - expected).abs().max() / expected.abs().max()) < 1e-4


def _words(nibbles):
    """int32 words of 4-bit values along the last dim: value j in bits 4 * (j % 8) of word j // 8."""
    shifted = nibbles.to(torch.int64).reshape(*nibbles.shape[:-1], -1, 8) << (4 * torch.arange(8))
    words = shifted.sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _compressed_tensors_stack(experts, rows, cols, group, symmetric, g):
    """vLLM's stacked compressed-tensors buffers of random INT4 experts (weight_packed int32
    [E, N, K/8], weight_scale bfloat16 [E, N, K/g], weight_zero_point int32 [E, N/8, K/g]
    packed along the rows, or None) and the weights they hold, float64 [E, N, K]."""
    q = torch.randint(0, 16, (experts, rows, cols), generator=g)
    scale = (torch.rand(experts, rows, cols // group, generator=g) * 0.05 + 0.01).to(torch.bfloat16)
    zeros = (
        torch.full_like(scale, 8, dtype=torch.int64) if symmetric else torch.randint(0, 16, scale.shape, generator=g)
    )
    zero_point = None if symmetric else _words(zeros.transpose(1, 2)).transpose(1, 2).contiguous()
    weight = (q - zeros.repeat_interleave(group, dim=2)).double() * scale.double().repeat_interleave(group, dim=2)
    return _words(q), scale, zero_point, weight


@pytest.mark.parametrize("symmetric", [True, False])
def test_expert_parallel_int4_layer_computes_its_partial_sum(symmetric):
    """vLLM's compressed-tensors W4A16 buffers, converted once into moeroute's INT4 tensors,
    give rank 1's partial sum of the dense float64 experts on the same 4-bit values."""
    from moeroute.quant import QuantConfig

    hidden, inter, tokens, top_k, group = 64, 32, 7, 4, 32
    g = generator(46)
    w13 = _compressed_tensors_stack(8, 2 * inter, hidden, group, symmetric, g)
    w2 = _compressed_tensors_stack(8, hidden, inter, group, symmetric, g)
    fields = {}
    for prefix, (packed, scale, zero_point, _) in (("w13", w13), ("w2", w2)):
        converted = vllm_plugin.int4_from_compressed_tensors(
            packed, scale, zero_point, group_size=group, symmetric=symmetric, name=f"layer.{prefix}"
        )
        assert converted[0].dtype == torch.uint8 and converted[0].shape == (8, packed.shape[1], 4 * packed.shape[2])
        assert torch.equal(converted[1], scale) and (converted[2] is None) == symmetric
        fields[f"{prefix}_weight_packed"], fields[f"{prefix}_weight_scale"] = converted[:2]
        if not symmetric:
            fields[f"{prefix}_weight_zero_point"] = converted[2]
    layer = _ep_layer(**fields)
    quant = QuantConfig("int4", group_size=group, symmetric=symmetric)
    plan = dataclasses.replace(vllm_plugin.build_plan(layer, _runner()), quant=quant)
    assert "int4 (groups of 32, " + ("symmetric" if symmetric else "asymmetric") + ") silu experts" in plan.describe()
    x = torch.randn(tokens, hidden, generator=g)
    ids, weights = _global_ids(tokens, top_k, 47), torch.rand(tokens, top_k, generator=g)
    out = _served(plan)._experts(layer, x, weights, ids)
    expected = dense_experts(x, weights, _held(ids, _EP_MAP), w13[3], w2[3])
    assert torch.count_nonzero(out[0]) == 0
    assert float((out.double() - expected).abs().max() / expected.abs().max()) < 1e-5


def test_int4_buffers_of_another_shape_are_refused_by_name():
    g = generator(48)
    packed, scale, zero_point, _ = _compressed_tensors_stack(2, 16, 64, 32, False, g)
    with pytest.raises(ValueError, match=r"layer.w13.weight_zero_point has shape \(2, 1, 2\)"):
        vllm_plugin.int4_from_compressed_tensors(
            packed, scale, zero_point[:, :1], group_size=32, symmetric=False, name="layer.w13"
        )
    with pytest.raises(ValueError, match="layer.w13.weight_scale has shape"):
        vllm_plugin.int4_from_compressed_tensors(
            packed, scale[:, :, :1], zero_point, group_size=32, symmetric=False, name="layer.w13"
        )
    with pytest.raises(ValueError, match="layer.w13.weight_zero_point is missing"):
        vllm_plugin.int4_from_compressed_tensors(packed, scale, None, group_size=32, symmetric=False, name="layer.w13")


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
def test_vllm_expert_maps_are_served(placement):
    """vLLM's own maps (its determine_expert_map, rank 1 of two) pass the plugin's checks and
    give each rank its share: the two partial sums add up to the whole layer."""
    expert_map_manager = pytest.importorskip("vllm.model_executor.layers.fused_moe.expert_map_manager")
    hidden, inter, tokens, top_k = 64, 32, 5, 4
    g = generator(44)
    w_up, w_down = (
        torch.randn(16, 2 * inter, hidden, generator=g) * 0.2,
        torch.randn(16, hidden, inter, generator=g) * 0.2,
    )
    x = torch.randn(tokens, hidden, generator=g)
    ids, weights = _global_ids(tokens, top_k, 45), torch.rand(tokens, top_k, generator=g)
    total = torch.zeros(tokens, hidden, dtype=torch.float64)
    for rank in range(2):
        local, expert_map, _ = expert_map_manager.determine_expert_map(2, rank, 16, placement)
        held = [int(e) for e in torch.argsort(expert_map)[-local:]]  # global ids in local order
        assert [int(expert_map[e]) for e in held] == list(range(local))
        layer = _ep_layer(local_num_experts=local, expert_map=expert_map, w13_weight=w_up[held], w2_weight=w_down[held])
        assert vllm_plugin.decline_reason(layer.moe_config, layer, _runner()) is None
        total += _served(vllm_plugin.build_plan(layer, _runner()))._experts(layer, x, weights, ids).double()
    expected = dense_experts(x, weights, ids, w_up, w_down)
    assert float((total - expected).norm() / expected.norm()) < 1e-5


@pytest.mark.parametrize(
    "fields, words",
    [
        ({}, None),
        ({"group_size": 128, "actorder": "weight"}, None),
        ({"strategy": "channel", "group_size": None}, "have channel scales; the plugin serves group scales"),
        ({"group_size": 16}, "its INT4 group size is 16; the plugin serves 32, 64, 128"),
        ({"actorder": "group"}, "activation ordering 'group' (g_idx)"),
    ],
)
def test_int4_decline_rules(fields, words):
    quant = SimpleNamespace(**{"strategy": "group", "group_size": 32, "actorder": None, **fields})
    reason = vllm_plugin.int4_decline_reason(SimpleNamespace(weight_quant=quant))
    assert reason is None if words is None else words in reason, reason
