"""The plugin's classes inside vLLM, without serving a model: registration (gpt-oss's
RoutedExperts subclass included), the quantized fallback line, the shared-expert answer read
from the plan and the MXFP4 decline rules.

(Registering changes vLLM's class registry of this process only; the serving tests run
their engines in fresh processes.)
"""

import logging

import pytest
import torch

from moeroute.compat import vllm_plugin
from moeroute.config import RouterConfig
from moeroute.layout import ExpertLayout


@pytest.fixture(scope="module")
def classes():
    from vllm.model_executor.custom_op import op_registry_oot

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MOEROUTE_VLLM", "1")
        vllm_plugin.register()
        vllm_plugin.register()  # vLLM may load plugins more than once: idempotent
    method_cls, experts_cls = vllm_plugin._plugin_classes()
    assert op_registry_oot["UnquantizedFusedMoEMethod"] is method_cls
    assert op_registry_oot["RoutedExperts"] is experts_cls
    return method_cls, experts_cls


@pytest.fixture
def plugin_log():
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("vllm.moeroute")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def test_quantized_layer_keeps_vllm_method_with_one_line(classes, monkeypatch, plugin_log):
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    _, experts_cls = classes

    class Fp8MoEMethod:  # stands in for any of vLLM's quantized MoE methods
        pass

    monkeypatch.setattr(vllm_plugin, "_declined_reasons", {})
    monkeypatch.setattr(RoutedExperts, "_get_quant_method", lambda self, prefix, quant_config, moe: Fp8MoEMethod())
    experts = object.__new__(experts_cls)
    methods = [
        experts_cls._get_quant_method(experts, f"model.layers.{i}.mlp.experts", object(), None) for i in range(3)
    ]
    assert all(isinstance(m, Fp8MoEMethod) for m in methods)  # vLLM's method is kept
    lines = [r.getMessage() for r in plugin_log]
    assert len(lines) == 1, lines
    assert "model.layers.0.mlp.experts" in lines[0] and "quantized (Fp8MoEMethod)" in lines[0]


def _method(method_cls, shared):
    method = object.__new__(method_cls)
    torch.nn.Module.__init__(method)
    method.moe_kernel = None
    method.plan = vllm_plugin.LayerPlan(RouterConfig(16, 4), ExpertLayout(16, 1, shared=shared), "silu")
    return method


def test_runner_is_told_from_the_plan_who_computes_the_shared_expert(classes):
    method_cls, _ = classes
    served = _method(method_cls, "runner")
    assert served.is_monolithic
    assert served.mk_can_overlap_shared_experts is False
    # The answer is the plan's: a plan giving the shared expert to the kernel says so.
    assert _method(method_cls, "fused").mk_can_overlap_shared_experts is True


@pytest.mark.parametrize("mode", [0, 3])
def test_mxfp4_layers_are_served_eager_and_compiled(mode):
    """The MXFP4 experts are torch.ops.moeroute.experts (an opaque custom op with a fake
    kernel), so a compiling vLLM (mode 3) is served as an eager one."""
    import types

    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig(compilation_config=CompilationConfig(mode=mode))):
        assert vllm_plugin.mxfp4_decline_reason(types.SimpleNamespace()) is None


def test_mxfp4_layers_with_other_swiglu_constants_are_declined():
    import types

    assert "swiglu_limit is 10.0" in vllm_plugin.mxfp4_decline_reason(types.SimpleNamespace(swiglu_limit=10.0))
    assert "swiglu_alpha is 1.5" in vllm_plugin.mxfp4_decline_reason(types.SimpleNamespace(swiglu_alpha=1.5))
    assert vllm_plugin.mxfp4_decline_reason(types.SimpleNamespace(swiglu_alpha=1.702, swiglu_limit=7.0)) is None


def test_gpt_oss_routed_experts_are_replaced(classes):
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.models.gpt_oss import GptOssRoutedExperts

    replacement = op_registry_oot["GptOssRoutedExperts"]
    assert issubclass(replacement, GptOssRoutedExperts) and replacement is vllm_plugin._gpt_oss_routed_experts_class()
