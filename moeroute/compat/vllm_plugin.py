"""moeroute as vLLM's MoE backend: the ``vllm.general_plugins`` entry point ``moeroute``.

Installing moeroute changes nothing in vLLM. The plugin acts only when ``VLLM_PLUGINS`` names
``moeroute`` or ``MOEROUTE_VLLM=1``; ``MOEROUTE_VLLM=0`` keeps it off even when
``VLLM_PLUGINS`` names it, and any other value raises ValueError when vLLM loads its plugins.

Asked, it registers through vLLM's out-of-tree seam (``register_oot``) `MoerouteMoEMethod` for
``UnquantizedFusedMoEMethod``, and replacements of ``RoutedExperts`` and
``GptOssRoutedExperts`` whose quant-method choice swaps vLLM's ``Fp8MoEMethod`` for
`MoerouteFp8MoEMethod` and, for ``GptOssMxfp4Config``, picks `MoerouteMxfp4MoEMethod`, and for
compressed-tensors W4A16 experts (``pack-quantized`` INT4) `MoerouteInt4MoEMethod` (vLLM's
quantized methods are no CustomOp, so the layer that picks them is the seam). Each keeps
vLLM's weights and loaders. After a layer's weights are loaded it decides once whether it
serves the layer: served, the layer becomes "monolithic" (vLLM's runner hands it the router
logits), routes them with `moeroute.select_experts` and runs ``torch.ops.moeroute.experts`` on
the layer's own weights; declined, vLLM's own method runs it unchanged and one log line says
why. The shared expert stays vLLM's runner's (each served layer's `moeroute.ExpertLayout`
resolves ``shared`` to ``"runner"``, and the method tells the runner so). `STATS` counts what
the plugin did in this process.

What is served and declined, the weight layouts, expert parallelism and the limits:
docs/vllm.md.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os

from moeroute.config import EXPERT_ACTIVATIONS

__all__ = [
    "PLUGIN_NAME",
    "FP8_WEIGHT_DTYPES",
    "SWITCH",
    "STATS",
    "LayerPlan",
    "register",
    "requested",
    "decline_reason",
    "build_plan",
]

#: The entry point's name, as ``VLLM_PLUGINS`` names it.
PLUGIN_NAME = "moeroute"
#: moeroute's own switch: "1" on, "0" off, unset: on when ``VLLM_PLUGINS`` names moeroute.
SWITCH = "MOEROUTE_VLLM"
_SWITCH_VALUES = ("", "0", "1")
#: vLLM activation name -> moeroute activation (the same gated definitions).
ACTIVATIONS = {name: name for name in EXPERT_ACTIVATIONS if name != "swigluoai"}
#: vLLM ``scoring_func`` values the plugin routes (moeroute's names are vLLM's).
SCORING_FUNCS = ("softmax", "sigmoid")
#: vLLM routers whose decision moeroute reproduces from the layer's routing arguments;
#: other routers (zero experts, routing simulation, custom functions) keep vLLM's method.
ROUTERS = ("CPURouter", "FusedTopKRouter", "GroupedTopKRouter", "FusedTopKBiasRouter")
#: Expert weight dtypes moeroute's expert GEMMs serve.
WEIGHT_DTYPES = ("torch.float32", "torch.float16", "torch.bfloat16")
#: Expert weight dtypes of FP8 layers the plugin serves.
FP8_WEIGHT_DTYPES = ("torch.float8_e4m3fn",)
#: MXFP4 (gpt-oss) layers: packed uint8 weights, gpt-oss's activation (moeroute's
#: "swigluoai": alpha 1.702, limit 7, the rows gate-first after the plugin reorders them).
MXFP4_WEIGHT_DTYPES = ("torch.uint8",)
MXFP4_ACTIVATIONS = {"swigluoai": "swigluoai"}
#: compressed-tensors W4A16 layers (``pack-quantized``, 4 bits, group scales): vLLM loads
#: the experts' ``weight_packed`` as int32 words, eight 4-bit values each.
INT4_WEIGHT_DTYPES = ("torch.int32",)

#: What the plugin did in this process: "layers" served, "declined" layers, "calls" of the
#: served layers' forward and "tokens" routed by moeroute (eager calls; not counted inside
#: a torch.compile graph), "huge_page_bytes" of served expert weights Linux moved onto 2 MB
#: pages (`moeroute.bindings.torch.memory`).
STATS: collections.Counter = collections.Counter()

# A child of vLLM's logger: the lines appear in vLLM's log, formatted as its own.
logger = logging.getLogger("vllm.moeroute")

_declined_reasons: dict[str, str] = {}


def _give_llvmlite_lib_a_namespace() -> None:
    """Let vLLM's CPU worker scan the modules numba loaded.

    vLLM 0.32's CPU worker, at start-up, reads ``vars(value)`` of every object held by every
    loaded module (to rebind Triton kernels). llvmlite's ``ffi.lib`` answers any attribute
    name with a wrapped C function, ``__dict__`` included, so that scan raises
    AttributeError once numba is imported - and importing this entry point imports moeroute,
    hence numba, into every vLLM process. Giving ``lib`` an empty ``__dict__`` entry in its
    function table makes ``vars(lib)`` an empty dict; no llvmlite function is named so.
    """
    try:
        from llvmlite.binding import ffi
    except ImportError:
        return
    table = getattr(ffi.lib, "_fntab", None)
    if isinstance(table, dict):
        table.setdefault("__dict__", {})


_give_llvmlite_lib_a_namespace()


def requested(environ=None) -> bool:
    """Whether the plugin should act: ``MOEROUTE_VLLM`` when set, else whether
    ``VLLM_PLUGINS`` (comma-separated, as vLLM parses it) names ``moeroute``.

    Raises
    ------
    ValueError
        ``MOEROUTE_VLLM`` set to anything but "0" or "1".
    """
    environ = os.environ if environ is None else environ
    switch = environ.get(SWITCH, "")
    if switch not in _SWITCH_VALUES:
        raise ValueError(
            f"{SWITCH}={switch!r} is not a switch value; use '1' (moeroute serves vLLM's MoE "
            f"layers), '0' (it does not) or leave it unset (it does when VLLM_PLUGINS names "
            f"{PLUGIN_NAME!r})"
        )
    if switch:
        return switch == "1"
    plugins = environ.get("VLLM_PLUGINS")
    return plugins is not None and PLUGIN_NAME in plugins.split(",")


def register() -> None:
    """The ``vllm.general_plugins`` entry point; vLLM calls it in each of its processes.

    Does nothing unless `requested`; then registers moeroute's MoE method with vLLM
    (idempotent). Raises ValueError for a bad ``MOEROUTE_VLLM``.
    """
    if not requested():
        return
    from vllm.model_executor.custom_op import op_registry_oot

    method_cls, routed_experts_cls = _plugin_classes()
    present = op_registry_oot.get("UnquantizedFusedMoEMethod")
    if present is method_cls:
        return
    if present is not None:
        logger.warning(
            "moeroute: not registered: another plugin already replaced vLLM's "
            "UnquantizedFusedMoEMethod with %s; vLLM keeps that one",
            present.__name__,
        )
        return
    # vLLM's documented seam: an out-of-tree subclass replaces the in-tree class by name.
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    UnquantizedFusedMoEMethod.register_oot(method_cls)
    if "RoutedExperts" not in op_registry_oot:
        routed_experts_cls.__bases__[-1].register_oot(routed_experts_cls)
    gpt_oss_cls = _gpt_oss_routed_experts_class()
    if gpt_oss_cls is not None and "GptOssRoutedExperts" not in op_registry_oot:
        gpt_oss_cls.__bases__[-1].register_oot(gpt_oss_cls)
    logger.info(
        "moeroute: registered as vLLM's unquantized MoE method (%s)",
        f"{SWITCH}=1" if os.environ.get(SWITCH) == "1" else f"VLLM_PLUGINS names {PLUGIN_NAME}",
    )


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """How moeroute serves one vLLM MoE layer.

    Attributes
    ----------
    router : moeroute.RouterConfig
        The layer's routing (vLLM's top_k, renormalize, grouped top-k, scoring_func,
        routed_scaling_factor).
    layout : moeroute.ExpertLayout
        One rank, the layer's routed experts and its shared MLP (0 or 1 slot):
        ``layout.shared`` says who computes the shared expert ("runner": vLLM's MoE
        runner, once per token; "none": there is none).
    activation : str
        moeroute's name of the experts' gated activation.
    quant : moeroute.quant.QuantConfig or None
        The experts' quantization (fp8_block, mxfp4, int4), None for float experts.
    num_local_experts : int or None
        Expert parallelism: the experts this rank holds (the layer's ``expert_map`` maps
        the routed ids to them at every call, and the other ranks' slots add nothing);
        None: the layer holds every expert.
    """

    router: object
    layout: object
    activation: str
    quant: object = None
    num_local_experts: int | None = None

    def describe(self) -> str:
        r = self.router
        routing = (
            f"{r.scoring} top-{r.top_k} of {r.num_experts}"
            + (f", {r.topk_group} of {r.num_expert_group} groups" if r.num_expert_group > 1 else "")
            + (", renormalized" if r.renormalize else "")
            + (f", scaled by {r.routed_scaling_factor:g}" if r.routed_scaling_factor != 1.0 else "")
        )
        experts = f"{self.activation} experts"
        if self.quant is not None and self.quant.format == "fp8_block":
            experts = f"{self.quant.format} {self.quant.block_size[0]}x{self.quant.block_size[1]} {experts}"
        elif self.quant is not None and self.quant.format == "int4":
            kind = "symmetric" if self.quant.symmetric else "asymmetric"
            experts = f"int4 (groups of {self.quant.group_size}, {kind}) {experts}"
        elif self.quant is not None:
            experts = f"{self.quant.format} {experts}"
        held = (
            ""
            if self.num_local_experts is None
            else f"; expert parallelism: {self.num_local_experts} of {r.num_experts} experts held here"
        )
        return f"{routing}; {experts}; shared expert: {self.layout.shared}{held}"


def decline_reason(
    moe_config, layer, runner, weight_dtypes=WEIGHT_DTYPES, activations=ACTIVATIONS, biases=False
) -> str | None:
    """Why moeroute does not serve this layer, in words, or None when it does.

    Parameters
    ----------
    moe_config : vLLM FusedMoEConfig of the layer
    layer : vLLM RoutedExperts (the expert weights and routing arguments)
    runner : the layer's vLLM MoERunner, or None when it cannot be found
    weight_dtypes : the expert weight dtypes served (`WEIGHT_DTYPES`, `FP8_WEIGHT_DTYPES`, ...)
    activations : vLLM activation name -> moeroute's, of the activations served
    biases : whether expert biases are served (MXFP4 gpt-oss experts)
    """
    if runner is None:
        return "its MoE runner is not registered in vLLM's forward context"
    parallel = moe_config.moe_parallel_config
    sizes = {name: getattr(parallel, f"{name}_size", 1) for name in ("tp", "dp", "ep", "pcp")}
    # Expert parallelism alone (vLLM's TP + EP: tp folded into ep, no all2all): every rank
    # sees all tokens, computes its held experts' partial sums, and vLLM's runner all-reduces.
    expert_parallel_only = (
        parallel.use_ep
        and getattr(parallel, "sp_size", 1) == 1
        and all(sizes[name] == 1 for name in ("tp", "dp", "pcp"))
    )
    if not expert_parallel_only and (any(size > 1 for size in sizes.values()) or parallel.use_ep):
        settings = ", ".join(f"{name}={size}" for name, size in sizes.items())
        if parallel.use_ep:
            settings += f", sp={getattr(parallel, 'sp_size', 1)}"
        return (
            f"it is split over several ranks ({settings}); the plugin serves single-rank layers and "
            "expert parallelism without tensor, data, context or sequence parallelism"
        )
    if parallel.use_ep and sizes["ep"] > 1 and layer.expert_map is None:
        return f"it is split over ep={sizes['ep']} ranks without an expert_map"
    if parallel.enable_eplb:
        return "expert load balancing (EPLB) is on"
    if moe_config.is_lora_enabled:
        return "LoRA is enabled"
    activation = moe_config.activation.value
    if activation not in activations:
        return f"activation {activation!r} is not one the plugin serves here ({', '.join(activations)})"
    if moe_config.has_bias and not biases:
        return "its experts have biases"
    if layer.apply_router_weight_on_input:
        return "it applies the router weight on the input"
    if layer.custom_routing_function is not None:
        return f"it routes with a custom function ({getattr(layer.custom_routing_function, '__name__', '?')})"
    if layer.scoring_func not in SCORING_FUNCS:
        return f"scoring_func {layer.scoring_func!r} is not one the plugin routes ({', '.join(SCORING_FUNCS)})"
    if getattr(moe_config, "has_hash_routing", False):
        return "it routes by token hash"
    router_name = type(runner.router).__name__
    if router_name not in ROUTERS:
        return f"its router {router_name} is not one the plugin reproduces ({', '.join(ROUTERS)})"
    if getattr(runner.router, "eplb_state", None) is not None:
        return "its router records expert load (EPLB)"
    reason = _expert_map_reason(layer)
    if reason is not None:
        return reason
    for name in ("w13_weight", "w2_weight"):
        dtype = str(getattr(getattr(layer, name, None), "dtype", None))
        if dtype not in weight_dtypes:
            return f"its {name} has dtype {dtype}; the plugin serves {', '.join(weight_dtypes)} here"
    return None


def _expert_map_reason(layer) -> str | None:
    """Why the layer's experts cannot be served as held (expert parallelism), or None: without
    an ``expert_map`` it must hold every expert; with one, the map must cover the global
    experts and name exactly the ``local_num_experts`` its weights hold."""
    expert_map, local, total = layer.expert_map, int(layer.local_num_experts), int(layer.global_num_experts)
    if expert_map is None:
        if local != total:
            return f"it holds {local} of {total} experts without an expert_map"
        return None
    if tuple(expert_map.shape) != (total,):
        return f"its expert_map has shape {tuple(expert_map.shape)}, not [global_num_experts={total}]"
    weights = getattr(layer, "w13_weight", None)
    if weights is not None and int(weights.shape[0]) != local:
        return f"its w13_weight holds {int(weights.shape[0])} experts, local_num_experts is {local}"
    held = sorted(int(e) for e in expert_map.tolist() if int(e) != -1)
    if held != list(range(local)):
        return (
            f"its expert_map does not name each of its {local} local experts once (-1 for the others); "
            f"held ids {held[:8]}{'...' if len(held) > 8 else ''}"
        )
    return None


def build_plan(layer, runner, quant=None, activations=ACTIVATIONS) -> LayerPlan:
    """The `LayerPlan` of a layer that `decline_reason` accepts.

    Raises
    ------
    ValueError
        The routing arguments are not a valid `moeroute.RouterConfig` (e.g. top_k
        exceeding what the kept groups hold), with moeroute's message.
    """
    from moeroute.config import RouterConfig
    from moeroute.layout import ExpertLayout

    groups, kept = 1, 1
    if layer.use_grouped_topk and layer.num_expert_group:
        groups = int(layer.num_expert_group)
        kept = int(layer.topk_group) if layer.topk_group else groups
    router = RouterConfig(
        int(layer.global_num_experts),
        int(layer.top_k),
        layer.scoring_func,
        num_expert_group=groups,
        topk_group=kept,
        renormalize=bool(layer.renormalize),
        routed_scaling_factor=float(layer.routed_scaling_factor),
    )
    # vLLM's runner owns the shared MLP (one module, whatever n_shared_experts it fuses):
    # the plan says so, and both sides read it.
    num_shared = 0 if runner.shared_experts is None else 1
    layout = ExpertLayout(router.num_experts, num_shared, shared="runner")
    held = None if layer.expert_map is None else int(layer.local_num_experts)
    return LayerPlan(router, layout, activations[layer.moe_config.activation.value], quant, held)


def _decline(layer_name: str, reason: str) -> None:
    STATS["declined"] += 1
    if reason in _declined_reasons:
        return
    _declined_reasons[reason] = layer_name
    logger.warning(
        "moeroute: vLLM's own MoE method serves layer %s (and any other layer for the same reason): %s",
        layer_name,
        reason,
    )


def _find_runner(layer):
    """The vLLM MoERunner that owns ``layer`` (registered under the same name), or None."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is None:
        return None
    runner = config.compilation_config.static_forward_context.get(layer.layer_name)
    return runner if getattr(runner, "routed_experts", None) is layer else None


def _routed_experts_capture_on() -> bool:
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    aux = getattr(config, "aux_output_config", None)
    return bool(getattr(aux, "enable_return_routed_experts", False))


def fp8_decline_reason(method, layer) -> str | None:
    """Why moeroute does not serve this FP8 layer (beyond `decline_reason`), or None.

    Parameters
    ----------
    method : vLLM Fp8MoEMethod of the layer (its quant config and block shape)
    layer : vLLM RoutedExperts holding the loaded FP8 weights and scales
    """
    config = method.quant_config
    if not method.block_quant:
        return "its FP8 experts have per-tensor scales; the plugin serves block-scaled FP8 (weight_block_size)"
    if config.activation_scheme != "dynamic":
        return f"its FP8 activation scheme is {config.activation_scheme!r}; the plugin serves 'dynamic'"
    if method.weight_scale_refine is not None or list(method.moe_block_shape) != list(method.weight_block_size):
        return (
            f"vLLM refines its scale blocks {list(method.weight_block_size)} to {list(method.moe_block_shape)} "
            "(tensor parallelism)"
        )
    for name in ("w13_weight_scale_inv", "w2_weight_scale_inv"):
        dtype = str(getattr(getattr(layer, name, None), "dtype", None))
        if dtype != "torch.float32":
            return f"its {name} has dtype {dtype}; the plugin serves float32 block scales"
    return None


def _fp8_quant_config(method, layer):
    """moeroute's `QuantConfig` of a served FP8 layer, its loaded weights and scales checked
    (shapes, dtypes and scale values, once); ValueError/TypeError with moeroute's message."""
    from moeroute.experts.formats.fp8 import check_quantized_weights
    from moeroute.quant import QuantConfig

    quant = QuantConfig("fp8_block", block_size=tuple(int(b) for b in method.weight_block_size))
    w13, w2 = layer.w13_weight, layer.w2_weight
    check_quantized_weights(
        quant,
        int(w13.shape[0]),
        int(w13.shape[2]),
        int(w13.shape[1]) // 2,
        w13,
        w2,
        layer.w13_weight_scale_inv,
        layer.w2_weight_scale_inv,
        None,
    )
    return quant


class _ServedMethod:
    """What moeroute's vLLM MoE methods share: the decision after loading, the plan, and
    routing plus experts when served. Mixed in before a vLLM method class, whose code runs
    for a declined layer."""

    #: The layer's `LayerPlan` once moeroute serves it; None: vLLM's method runs.
    plan = None
    #: Expert weight dtypes, activations and biases this method serves.
    weight_dtypes = WEIGHT_DTYPES
    activations = ACTIVATIONS
    biases = False

    def _quant_reason(self, layer) -> str | None:
        """A reason to decline that is the quantization's, or None."""
        return None

    def _quant_config(self, layer):
        """moeroute's QuantConfig of a served layer (None: float experts)."""
        return None

    def _adopt_weights(self, layer) -> None:
        """Put a served layer's loaded weights in moeroute's layout (in place), if needed."""

    def _vllm_setup(self, layer, reason: str) -> None:
        """vLLM's own set-up of a declined layer."""
        super().process_weights_after_loading(layer)

    def process_weights_after_loading(self, layer) -> None:
        runner = _find_runner(layer)
        reason = decline_reason(self.moe, layer, runner, self.weight_dtypes, self.activations, self.biases)
        if reason is None and _routed_experts_capture_on():
            reason = "vLLM captures the routed experts (enable_return_routed_experts)"
        if reason is None:
            reason = self._quant_reason(layer)
        plan = None
        if reason is None:
            try:
                plan = build_plan(layer, runner, self._quant_config(layer), self.activations)
            except (TypeError, ValueError) as error:
                reason = f"moeroute refuses its routing or weights ({error})"
        if plan is None:
            _decline(layer.layer_name, reason)
            self._vllm_setup(layer, reason)
            return
        self._adopt_weights(layer)
        # Decode streams the hit experts' weights from memory: 2 MB pages under them (advice
        # to Linux; the tensors and their values stay as they are).
        from moeroute.bindings.torch.memory import back_with_huge_pages

        STATS["huge_page_bytes"] += back_with_huge_pages(
            *(
                weight
                for weight in (getattr(layer, "w13_weight", None), getattr(layer, "w2_weight", None))
                if weight is not None
            )
        )
        # The loaded w13_weight [E, 2I, H] (gate rows first) and w2_weight [E, H, I] (and FP8
        # block scales) are moeroute's layout already: used as they are, never repacked or copied.
        self.plan = plan
        STATS["layers"] += 1
        if plan.quant is not None:
            STATS["quantized_layers"] += 1
        if STATS["layers"] == 1 or (plan.quant is not None and STATS["quantized_layers"] == 1):
            logger.info("moeroute: serving MoE layer %s: %s", layer.layer_name, plan.describe())

    @property
    def is_monolithic(self) -> bool:
        # Served: the runner hands over the router logits and moeroute routes.
        return True if self.plan is not None else super().is_monolithic

    @property
    def mk_can_overlap_shared_experts(self) -> bool:
        # The runner asks whether the kernel computes the shared experts: only when
        # moeroute's plan gives them to it, never for a layer the plan gives the runner.
        if self.plan is not None:
            return self.plan.layout.shared not in ("runner", "none")
        return super().mk_can_overlap_shared_experts

    def apply_monolithic(self, layer, x, router_logits, input_ids=None):
        if self.plan is None:
            return super().apply_monolithic(layer, x, router_logits, input_ids)
        import torch

        from moeroute.bindings.torch import ops

        bias = layer.e_score_correction_bias
        if bias is not None and bias.dtype != torch.float32:
            bias = bias.float()
        if ops.runs_eagerly(router_logits, bias):  # as vLLM calls it: no op dispatch
            from moeroute.bindings.torch import arrays

            topk_weights, topk_ids = arrays.select_experts(router_logits, self.plan.router, bias)
        else:
            topk_weights, topk_ids = ops.select_experts(router_logits, self.plan.router, bias)
        return self._experts(layer, x, topk_weights, topk_ids)

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        if self.plan is None:
            return super().apply(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)
        import torch

        # Reached only if a caller routes first: the experts are still moeroute's, and the
        # shared experts stay with the runner, as the plan says.
        return self._experts(layer, x, topk_weights.to(torch.float32), topk_ids.to(torch.int32))

    def _experts(self, layer, x, topk_weights, topk_ids):
        import torch

        if not torch.compiler.is_compiling():  # a traced graph would count once, at tracing
            STATS["calls"] += 1
            STATS["tokens"] += int(x.shape[0])
        quant = self.plan.quant
        # Expert parallelism: the routed ids are global; the layer's map (read at every call:
        # vLLM may replace it) turns them into its local experts, -1 for other ranks' experts.
        expert_map = layer.expert_map
        if quant is not None and quant.format == "mxfp4":
            return _mxfp4_experts(layer, x, topk_weights, topk_ids, expert_map)
        if quant is not None and quant.format == "int4":
            return _int4_experts(layer, x, topk_weights, topk_ids, expert_map, quant, self.plan.activation)
        from moeroute.bindings.torch import ops

        # Called eagerly (as vLLM runs a layer's method, inside its own op), the op's body
        # runs directly; a tracer sees the op.
        eager = ops.runs_eagerly(x, topk_weights, topk_ids, expert_map)
        experts = ops.experts if eager else torch.ops.moeroute.experts
        if quant is None:
            return experts(
                x,
                layer.w13_weight,
                layer.w2_weight,
                topk_weights,
                topk_ids,
                self.plan.activation,
                "auto",
                expert_map=expert_map,
            )
        return experts(
            x,
            layer.w13_weight,
            layer.w2_weight,
            topk_weights,
            topk_ids,
            self.plan.activation,
            "auto",
            gate_up_scale=layer.w13_weight_scale_inv,
            down_scale=layer.w2_weight_scale_inv,
            quant_format=quant.format,
            block_size=list(quant.block_size),
            quant_activation=quant.activation,
            scale_fmt=quant.scale_fmt,
            expert_map=expert_map,
        )


@functools.cache
def _plugin_classes():
    """(method class, RoutedExperts class), defined on first use: vLLM is imported only
    when the plugin acts."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    from moeroute.bindings.torch import ops  # noqa: F401  (registers torch.ops.moeroute.*)

    class MoerouteMoEMethod(_ServedMethod, UnquantizedFusedMoEMethod):
        """vLLM's unquantized MoE method, with moeroute's routing and experts where the
        layer allows (see the module docstring); vLLM's own code elsewhere."""

    class MoerouteRoutedExperts(_ChoosesQuantMethod, RoutedExperts):
        """vLLM's RoutedExperts whose FP8 block-scaled experts get `MoerouteFp8MoEMethod`;
        says in one log line when another quantized layer keeps vLLM's method."""

    return MoerouteMoEMethod, MoerouteRoutedExperts


class _ChoosesQuantMethod:
    """The quant-method choice of moeroute's RoutedExperts classes (mixed in before vLLM's)."""

    def _get_quant_method(self, prefix, quant_config, moe_config):
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
            UnquantizedFusedMoEMethod,
        )

        if _is_gpt_oss_mxfp4(quant_config):
            # Chosen before vLLM's method is built: on a CPU without AMX building it raises.
            return _mxfp4_method_class()(moe_config)
        int4_scheme = _compressed_tensors_int4_scheme(quant_config, self, prefix)
        if int4_scheme is not None:
            # The same: vLLM's CPU W4A16 experts need AMX, and building its method raises.
            return _int4_method_class()(*int4_scheme, moe_config, prefix)
        method = super()._get_quant_method(prefix, quant_config, moe_config)
        replacement = _quant_replacement(method)
        if replacement is not None:
            return replacement(quant_config, self)
        if not isinstance(method, UnquantizedFusedMoEMethod):
            _decline(
                prefix,
                f"its experts are quantized ({type(method).__name__}); the plugin serves unquantized, "
                "FP8 (Fp8MoEMethod), gpt-oss MXFP4 and compressed-tensors W4A16 (pack-quantized INT4) experts",
            )
        return method


def _is_gpt_oss_mxfp4(quant_config) -> bool:
    try:
        from vllm.model_executor.layers.quantization.mxfp4 import GptOssMxfp4Config
    except ImportError:
        return False
    return type(quant_config) is GptOssMxfp4Config


@functools.cache
def _gpt_oss_routed_experts_class():
    """moeroute's replacement of vLLM's GptOssRoutedExperts (gpt-oss builds its MoE layers
    with that subclass, which vLLM's registry keys by its own name), or None."""
    try:
        from vllm.model_executor.models.gpt_oss import GptOssRoutedExperts
    except ImportError:
        return None

    class MoerouteGptOssRoutedExperts(_ChoosesQuantMethod, GptOssRoutedExperts):
        """vLLM's GptOssRoutedExperts (its loaders) whose MXFP4 experts get
        `MoerouteMxfp4MoEMethod`."""

    return MoerouteGptOssRoutedExperts


def _quant_replacement(method):
    """moeroute's class for vLLM's quantized MoE method ``method`` (exactly vLLM's class,
    not a subclass someone else made), or None."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod

    if type(method) is Fp8MoEMethod:
        return _fp8_method_class()
    return None


@functools.cache
def _fp8_method_class():
    from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod

    class MoerouteFp8MoEMethod(_ServedMethod, Fp8MoEMethod):
        """vLLM's FP8 MoE method: its weights, scales and loaders; served, moeroute's routing
        and fp8_block experts run on them (see the module docstring)."""

        weight_dtypes = FP8_WEIGHT_DTYPES

        def _quant_reason(self, layer):
            return fp8_decline_reason(self, layer)

        def _quant_config(self, layer):
            return _fp8_quant_config(self, layer)

    return MoerouteFp8MoEMethod


def mxfp4_decline_reason(layer) -> str | None:
    """Why moeroute does not serve this gpt-oss MXFP4 layer (beyond `decline_reason`), or None."""
    from moeroute.experts.activations import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT

    for name, value in (("swiglu_alpha", SWIGLUOAI_ALPHA), ("swiglu_limit", SWIGLUOAI_LIMIT)):
        given = getattr(layer, name, None)
        if given is not None and float(given) != value:
            return f"its {name} is {given}; moeroute's swigluoai has {value}"
    return None


def _mxfp4_quant_config(layer):
    """moeroute's QuantConfig("mxfp4") of a served layer, its loaded bytes checked."""
    from moeroute.experts.formats.mxfp4 import check_mxfp4_weights
    from moeroute.quant import QuantConfig

    quant = QuantConfig("mxfp4")
    num_experts, two_inter = layer.w13_weight.shape[:2]
    hidden = layer.w2_weight.shape[1]
    w13, w2 = _mxfp4_blocks(layer)
    check_mxfp4_weights(
        quant,
        int(num_experts),
        int(hidden),
        int(two_inter) // 2,
        (w13, layer.w13_weight_scale),
        (w2, layer.w2_weight_scale),
    )
    return quant


def _mxfp4_blocks(layer):
    """vLLM's packed w13/w2 [E, rows, cols/2] uint8 viewed as moeroute's [E, rows, cols/32, 16]."""
    w13, w2 = layer.w13_weight, layer.w2_weight
    return (w13.view(w13.shape[0], w13.shape[1], -1, 16), w2.view(w2.shape[0], w2.shape[1], -1, 16))


def _mxfp4_experts(layer, x, topk_weights, topk_ids, expert_map=None):
    """The layer's MXFP4 experts through ``torch.ops.moeroute.experts`` (its body when eager)."""
    import torch

    from moeroute.bindings.torch import ops

    w13, w2 = _mxfp4_blocks(layer)
    experts = ops.experts if ops.runs_eagerly(x, topk_weights, topk_ids, expert_map) else torch.ops.moeroute.experts
    return experts(
        x,
        w13,
        w2,
        topk_weights,
        topk_ids,
        "swigluoai",
        "auto",
        getattr(layer, "w13_bias", None),
        getattr(layer, "w2_bias", None),
        gate_up_scale=layer.w13_weight_scale,
        down_scale=layer.w2_weight_scale,
        quant_format="mxfp4",
        expert_map=expert_map,
    )


@functools.cache
def _mxfp4_method_class():
    import torch
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend
    from vllm.model_executor.layers.quantization.mxfp4 import GptOssMxfp4MoEMethod

    class MoerouteMxfp4MoEMethod(_ServedMethod, GptOssMxfp4MoEMethod):
        """vLLM's gpt-oss MXFP4 MoE method: its weights, scales, biases and loaders; served,
        moeroute's routing and MXFP4 experts run on them.

        vLLM keeps gpt-oss's interleaved gate_up rows (gate, up, gate, ...); a served layer's
        packed rows, scale rows and bias entries are put gate rows first once after loading
        (a row permutation of the bytes; nothing is dequantized)."""

        weight_dtypes = MXFP4_WEIGHT_DTYPES
        activations = MXFP4_ACTIVATIONS
        biases = True

        def __init__(self, moe):
            try:
                super().__init__(moe)
                #: vLLM's reason it has no MXFP4 backend here, or None when it has one.
                self.vllm_unavailable = None
            except NotImplementedError as error:
                # vLLM's __init__ up to its backend choice, without a backend.
                FusedMoEMethodBase.__init__(self, moe)
                self.weight_dtype = "gpt_oss_mxfp4"
                self.mxfp4_backend, self.experts_cls = Mxfp4MoeBackend.NONE, None
                self.max_capture_size = moe.max_capture_size
                self._cache_permute_indices = {}
                self.moe_kernel = None
                self.w13_precision_config = self.w2_precision_config = None
                self.vllm_unavailable = str(error)

        @property
        def is_monolithic(self) -> bool:
            # Served answers without super(): torch.compile traces this property inside
            # vLLM's graph, and dynamo cannot read a property through super().
            if self.plan is not None:
                return True
            if self.experts_cls is None:
                return False
            return super().is_monolithic

        def _quant_reason(self, layer):
            return mxfp4_decline_reason(layer)

        def _quant_config(self, layer):
            return _mxfp4_quant_config(layer)

        def _vllm_setup(self, layer, reason):
            if self.vllm_unavailable is not None:
                raise NotImplementedError(
                    f"{self.vllm_unavailable} (moeroute declined layer {layer.layer_name}: {reason})"
                )
            super()._vllm_setup(layer, reason)

        def _adopt_weights(self, layer):
            rows = layer.w13_weight.shape[1]
            order = torch.cat([torch.arange(0, rows, 2), torch.arange(1, rows, 2)]).to(layer.w13_weight.device)
            for name in ("w13_weight", "w13_weight_scale", "w13_bias"):
                param = getattr(layer, name, None)
                if param is not None:
                    param.data = param.data.index_select(1, order)

        def get_fused_moe_quant_config(self, layer):
            if self.plan is not None and self.mxfp4_backend == Mxfp4MoeBackend.NONE:
                return None  # no vLLM kernel runs this layer
            return super().get_fused_moe_quant_config(layer)

    return MoerouteMxfp4MoEMethod


def _compressed_tensors_int4_scheme(quant_config, layer, prefix):
    """(weight_quant, input_quant) of a compressed-tensors MoE layer whose experts are 4-bit
    ``pack-quantized`` weights with 16-bit activations (W4A16), as vLLM's own choice of
    ``CompressedTensorsWNA16MoEMethod`` reads them; None for any other layer."""
    try:
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
            CompressedTensorsConfig,
        )
    except ImportError:
        return None
    if type(quant_config) is not CompressedTensorsConfig:
        return None
    quant_config._add_fused_moe_to_target_scheme_map()
    names = (layer.ckpt_gate_proj_name, layer.ckpt_up_proj_name, layer.ckpt_down_proj_name)
    schemes = [quant_config.get_scheme_dict(layer, f"{prefix}.0.{name}") for name in names]
    if schemes[0] is None or any(scheme != schemes[0] for scheme in schemes):
        return None  # an ignored layer, or one vLLM refuses itself
    weight_quant, input_quant = schemes[0].get("weights"), schemes[0].get("input_activations")
    if weight_quant is None or not quant_config._is_wNa16_group_channel(weight_quant, input_quant):
        return None
    if weight_quant.num_bits != 4 or schemes[0].get("format") != "pack-quantized":
        return None
    return weight_quant, input_quant


def int4_decline_reason(method) -> str | None:
    """Why moeroute does not serve this compressed-tensors W4A16 layer (beyond
    `decline_reason`), or None: symmetric or asymmetric INT4 in groups of 32, 64 or 128 input
    columns, without activation ordering."""
    from moeroute.quant.config import INT4_GROUP_SIZES

    quant = method.weight_quant
    strategy = getattr(quant.strategy, "value", quant.strategy)
    if strategy != "group":
        return f"its INT4 experts have {strategy} scales; the plugin serves group scales"
    if quant.group_size not in INT4_GROUP_SIZES:
        return f"its INT4 group size is {quant.group_size}; the plugin serves {', '.join(map(str, INT4_GROUP_SIZES))}"
    actorder = getattr(quant.actorder, "value", quant.actorder)
    if actorder not in (None, "static", "weight"):
        return f"its INT4 experts have activation ordering {actorder!r} (g_idx); the plugin serves none"
    return None


def int4_from_compressed_tensors(weight_packed, weight_scale, weight_zero_point, *, group_size, symmetric, name):
    """moeroute's INT4 experts tensors (packed uint8 [E, N, K/2], scales [E, N, K/g], zeros
    uint8 [E, N, K/g] or None) of vLLM's stacked compressed-tensors buffers: ``weight_packed``
    int32 [E, N, K/8] and ``weight_scale`` [E, N, K/g] as each expert's checkpoint stores them
    (`moeroute.quant.int4_checkpoint.unpack_compressed_tensors`), ``weight_zero_point`` int32
    [E, N/8, K/g] packed along the rows (asymmetric only).

    The experts' rows are independent, so the stack is read as one weight of E*N rows (the
    zero points' words too: N is a multiple of 8). ValueError/TypeError naming ``name``.
    """
    from moeroute.quant.int4_checkpoint import unpack_compressed_tensors

    if weight_packed.dim() != 3 or weight_scale.dim() != 3:
        raise ValueError(
            f"{name}: weight_packed and weight_scale must be [E, N, K/8] and [E, N, K/g], got shapes "
            f"{tuple(weight_packed.shape)} and {tuple(weight_scale.shape)}"
        )
    experts, rows = weight_packed.shape[:2]
    zeros = None
    if weight_zero_point is not None:
        if rows % 8 or weight_zero_point.dim() != 3 or tuple(weight_zero_point.shape[:2]) != (experts, rows // 8):
            raise ValueError(
                f"{name}.weight_zero_point has shape {tuple(weight_zero_point.shape)}; packed along "
                f"{rows} rows it needs [{experts}, {rows // 8}, K/g] (N a multiple of 8)"
            )
        zeros = weight_zero_point.reshape(experts * (rows // 8), -1)
    unpacked = unpack_compressed_tensors(
        weight_packed.reshape(experts * rows, -1),
        weight_scale.reshape(experts * rows, -1),
        None,
        zeros,
        group_size=group_size,
        symmetric=symmetric,
        name=name,
    )
    return tuple(None if t is None else t.reshape(experts, rows, -1) for t in unpacked[:3])


def _int4_experts(layer, x, topk_weights, topk_ids, expert_map, quant, activation):
    """The layer's INT4 experts: ``torch.ops.moeroute.experts`` with ``quant_format="int4"``
    on the tensors `_adopt_weights` installed (its body directly when called eagerly)."""
    import torch

    from moeroute.bindings.torch import ops

    eager = ops.runs_eagerly(x, topk_weights, topk_ids, expert_map)
    experts = ops.experts if eager else torch.ops.moeroute.experts
    return experts(
        x,
        layer.w13_weight_packed,
        layer.w2_weight_packed,
        topk_weights,
        topk_ids,
        activation,
        "auto",
        gate_up_scale=layer.w13_weight_scale,
        down_scale=layer.w2_weight_scale,
        quant_format="int4",
        expert_map=expert_map,
        gate_up_zero=getattr(layer, "w13_weight_zero_point", None),
        down_zero=getattr(layer, "w2_weight_zero_point", None),
        group_size=quant.group_size,
        symmetric=quant.symmetric,
    )


@functools.cache
def _int4_method_class():
    import torch
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_wna16 import (  # noqa: E501
        CompressedTensorsWNA16MoEMethod,
    )

    class MoerouteInt4MoEMethod(_ServedMethod, CompressedTensorsWNA16MoEMethod):
        """vLLM's compressed-tensors W4A16 MoE method: its buffers and loaders (each expert's
        ``weight_packed``, ``weight_scale``, ``weight_zero_point`` stacked into w13/w2);
        served, moeroute's routing and INT4 experts run on them.

        After loading, a served layer's int32 words become moeroute's INT4 bytes (the same
        4-bit values, two to a byte: half the memory of vLLM's words, a copy made once) and
        its packed zero points one byte each; the scales stay as loaded."""

        weight_dtypes = INT4_WEIGHT_DTYPES

        def __init__(self, weight_quant, input_quant, moe, layer_name=None):
            try:
                super().__init__(weight_quant, input_quant, moe, layer_name)
                #: vLLM's reason it has no W4A16 MoE backend here, or None when it has one.
                self.vllm_unavailable = None
            except NotImplementedError as error:
                # vLLM's __init__ set the format's fields before its backend choice raised.
                self.wna16_backend, self.experts_cls = None, None
                self.is_marlin, self.is_transposed = False, False
                self.input_dtype = torch.bfloat16
                self.moe_kernel = None
                self.vllm_unavailable = str(error)
            self._int4_tensors = None

        @property
        def is_monolithic(self) -> bool:
            if self.plan is not None:
                return True
            if self.experts_cls is None:
                return False
            return super().is_monolithic

        def process_weights_after_loading(self, layer) -> None:
            # vLLM's names for the loaded words, which the shared checks read (vLLM's own
            # set-up aliases them so too).
            layer.w13_weight = layer.w13_weight_packed
            layer.w2_weight = layer.w2_weight_packed
            super().process_weights_after_loading(layer)

        def _quant_reason(self, layer):
            return int4_decline_reason(self)

        def _quant_config(self, layer):
            from moeroute.quant import QuantConfig

            quant = QuantConfig("int4", group_size=int(self.group_size), symmetric=bool(self.symmetric))
            name = getattr(layer, "layer_name", "experts")
            self._int4_tensors = {
                prefix: int4_from_compressed_tensors(
                    getattr(layer, f"{prefix}_weight_packed"),
                    getattr(layer, f"{prefix}_weight_scale"),
                    getattr(layer, f"{prefix}_weight_zero_point", None),
                    group_size=quant.group_size,
                    symmetric=quant.symmetric,
                    name=f"{name}.{prefix}",
                )
                for prefix in ("w13", "w2")
            }
            return quant

        def _adopt_weights(self, layer):
            for prefix, (packed, scales, zeros) in self._int4_tensors.items():
                for suffix, tensor in (("weight_packed", packed), ("weight_scale", scales)):
                    getattr(layer, f"{prefix}_{suffix}").data = tensor
                if zeros is not None:
                    getattr(layer, f"{prefix}_weight_zero_point").data = zeros
                elif hasattr(layer, f"{prefix}_weight_zero_point"):
                    delattr(layer, f"{prefix}_weight_zero_point")
            self._int4_tensors = None

        def _vllm_setup(self, layer, reason):
            if self.vllm_unavailable is not None:
                raise NotImplementedError(
                    f"{self.vllm_unavailable} (moeroute declined layer {layer.layer_name}: {reason})"
                )
            super()._vllm_setup(layer, reason)

        def get_fused_moe_quant_config(self, layer):
            if self.plan is not None and self.experts_cls is None:
                return None  # no vLLM kernel runs this layer
            return super().get_fused_moe_quant_config(layer)

    return MoerouteInt4MoEMethod
