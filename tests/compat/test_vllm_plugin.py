"""The vLLM plugin's switch, decline rules and layer plans, without vLLM.

The plugin serving real vLLM layers is tested end to end in tests_vllm/ (``make test-vllm``).
Here vLLM's layer objects are stood in by namespaces carrying the attributes the plugin
reads, so that each rule is checked on its own.
"""

import logging
import sys
from enum import Enum
from types import SimpleNamespace

import pytest

from moeroute.compat import vllm_plugin
from moeroute.config import RouterConfig


@pytest.mark.parametrize("environ, expected", [
    ({}, False),
    ({"VLLM_PLUGINS": "moeroute"}, True),
    ({"VLLM_PLUGINS": "lora_filesystem_resolver,moeroute"}, True),
    ({"VLLM_PLUGINS": "moeroute_extra"}, False),
    ({"VLLM_PLUGINS": ""}, False),
    ({"MOEROUTE_VLLM": "1"}, True),
    ({"MOEROUTE_VLLM": "0", "VLLM_PLUGINS": "moeroute"}, False),
    ({"MOEROUTE_VLLM": "1", "VLLM_PLUGINS": "other"}, True),
    ({"MOEROUTE_VLLM": ""}, False),
])
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

    moe_config = SimpleNamespace(moe_parallel_config=_parallel(), is_lora_enabled=False,
                                 activation=Activation.SILU, has_bias=False, has_hash_routing=False)
    values = dict(moe_config=moe_config, layer_name="model.layers.1.mlp.experts", global_num_experts=16,
                  local_num_experts=16, expert_map=None, top_k=4, use_grouped_topk=True,
                  num_expert_group=4, topk_group=2, scoring_func="sigmoid", renormalize=True,
                  routed_scaling_factor=2.5, custom_routing_function=None,
                  apply_router_weight_on_input=False,
                  w13_weight=torch.empty(16, 128, 64, dtype=torch.bfloat16),
                  w2_weight=torch.empty(16, 64, 64, dtype=torch.bfloat16))
    values.update(fields)
    return SimpleNamespace(**values)


def _runner(router=None, shared=None):
    return SimpleNamespace(router=router or CPURouter(), shared_experts=shared)


def test_plan_routes_as_the_layer_says():
    layer = _layer()
    plan = vllm_plugin.build_plan(layer, _runner(shared=object()))
    assert plan.router == RouterConfig(16, 4, "sigmoid", num_expert_group=4, topk_group=2,
                                       renormalize=True, routed_scaling_factor=2.5)
    assert plan.activation == "silu"
    # vLLM's runner computes the shared expert; the plan says so.
    assert plan.layout.num_shared_experts == 1
    assert plan.layout.shared == "runner"
    assert "shared expert: runner" in plan.describe()


def test_plan_without_shared_expert_and_without_groups():
    layer = _layer(use_grouped_topk=False, num_expert_group=None, topk_group=None, scoring_func="softmax",
                   routed_scaling_factor=1.0, renormalize=False)
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


@pytest.mark.parametrize("moe, layer, runner, words", [
    (_moe(), _layer(), None, "runner is not registered"),
    (_moe(moe_parallel_config=_parallel(tp_size=2)), _layer(), _runner(), "tp=2"),
    (_moe(moe_parallel_config=_parallel(ep_size=2, use_ep=True)), _layer(), _runner(), "ep=2"),
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
    (_moe(), _layer(local_num_experts=8), _runner(), "subset of the experts"),
    (_moe(), _layer(w13_weight=SimpleNamespace(dtype="torch.float8_e4m3fn")), _runner(), "float8_e4m3fn"),
])
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
