"""The pipeline as torch custom ops: ``torch.ops.moeroute.*``, each with a fake (meta) kernel.

torch.compile and torch.export see each op as one opaque call whose output
shapes come from its fake kernel; nothing inside (NumPy views of tensors, Numba and CuPy
launches, oneDNN linears) is traced.

===============================================  =============================================
``select_experts(logits, top_k, scoring,         Top-k routing (docs/semantics.md section 1). logits [T, N]
num_expert_group, topk_group, renormalize,       float32; correction_bias [N] float32 or None.
routed_scaling_factor, correction_bias)``        -> (topk_weights [T, K] float32,
                                                 topk_ids [T, K] int32).
``append_shared_slots(topk_weights, topk_ids,    Fused shared slots appended (docs/semantics.md section 4);
layout_key, home_rank, shared_weights,           the layout is found by `layout_key`.
shared_weight)``                                 -> (weights [T, K+S'] float32, ids int32).
``experts(hidden_states, w_gate_up, w_down,      The local experts' weighted sum (CPU: sort,
topk_weights, topk_ids, activation, gemm,        BLAS/oneDNN GEMMs, combine; CUDA: as
b_gate_up, b_down, gate_up_scale, down_scale,    ``fused_experts``); biases optional. With
input_scale, quant_format, block_size,           ``quant_format`` ("fp8_block"/"fp8_tensor")
quant_activation, scale_fmt, expert_map,         the weights are float8_e4m3fn with their
gate_up_zero, down_zero, group_size,             scales; with "mxfp4" the weights are the
symmetric)``                                     packed uint8 blocks and the scales their
                                                 uint8 exponents; with "int4" the packed
                                                 uint8 nibbles, their group scales and
                                                 (asymmetric) zero points (docs/quant.md). With
                                                 ``expert_map`` (int [N_physical], -1 = not
                                                 held) the ids are physical and mapped to
                                                 local ids first. -> [T, H].
``fused_experts(hidden_states, w_gate_up,        The CuPy grouped-GEMM path (CUDA tensors
w_down, topk_weights, topk_ids, activation,      only; the fake kernel serves any device).
apply_router_weight, block_size, gate_up_bias,   -> [T, H].
down_bias)``
``moe_forward(hidden_states, router_logits,      One whole `moeroute.bindings.torch.MoE` layer,
layer_key)``                                     found by `register_layer`'s key. -> shape and
                                                 dtype of hidden_states.
===============================================  =============================================

Objects that are not tensors or scalars (an `ExpertLayout`, an `MoE` module) reach the ops
through a string key: `layout_key` and `register_layer` keep weak references, so a key
lives as long as its object and a compiled graph holds only the string. The plain Python
wrappers `select_experts` and `append_shared_slots` below take the config objects and
call the ops.

Every op that takes a routing pair takes it weights first, then ids (as ``select_experts``
returns it and as vLLM passes it), and refuses the pair in the other order by dtype with a
TypeError naming the argument.

None of the ops has an autograd formula: the pipeline is inference-only.
"""

import inspect
import itertools
import types
import weakref
from typing import Optional

import torch

from moeroute._validate import weights_then_ids
from moeroute.bindings.torch import arrays
from moeroute.experts.activations import check_activation
from moeroute.experts.choose import check_strategy
from moeroute.experts.formats.unquantized import (
    SUPPORTED_DTYPES,
    check_same_device,
    cpu_experts,
)
from moeroute.experts.formats.fp8 import check_quantized_weights, fp8_experts_forward
from moeroute.experts.formats.int4 import int4_experts_forward
from moeroute.experts.formats.mxfp4 import check_mxfp4_weights, mxfp4_experts_forward
from moeroute.config import RouterConfig
from moeroute.layout import ExpertLayout
from moeroute.quant import QuantConfig, check_int4

__all__ = [
    "NAMESPACE",
    "OPS",
    "layout_key",
    "register_layer",
    "registered_layer",
    "select_experts",
    "append_shared_slots",
]

#: The torch.library namespace: the ops are ``torch.ops.moeroute.<name>``.
NAMESPACE = "moeroute"

# ------------------------------------------------------------------ registries

_LAYOUTS: "weakref.WeakValueDictionary[str, ExpertLayout]" = weakref.WeakValueDictionary()
_LAYOUT_COUNTER = itertools.count()
#: Attribute of a registered ExpertLayout that holds its key: compiled code reads it (and
#: Dynamo guards on it) instead of looking the layout up in a weak dictionary.
_LAYOUT_KEY_ATTRIBUTE = "_torch_op_key"
_LAYERS: "weakref.WeakValueDictionary[str, torch.nn.Module]" = weakref.WeakValueDictionary()
_LAYER_COUNTER = itertools.count()


@torch.compiler.assume_constant_result
def _register_layout(layout: ExpertLayout) -> str:
    # Runs once per layout, eagerly even while Dynamo traces (the key becomes a constant).
    key = getattr(layout, _LAYOUT_KEY_ATTRIBUTE, None)
    if key is None or _LAYOUTS.get(key) is not layout:  # new, or a copy carrying its original's key
        key = f"layout.{next(_LAYOUT_COUNTER)}"
        _LAYOUTS[key] = layout
        object.__setattr__(layout, _LAYOUT_KEY_ATTRIBUTE, key)  # ExpertLayout is otherwise frozen
    return key


def layout_key(layout: ExpertLayout) -> str:
    """The string that names ``layout`` in ``torch.ops.moeroute.append_shared_slots``.

    One key per layout object, the same on every call. The registry holds the layout
    weakly: the key is valid while the layout is alive. Traceable by torch.compile.

    Raises
    ------
    TypeError
        ``layout`` is not an ExpertLayout.
    """
    if not isinstance(layout, ExpertLayout):
        raise TypeError(f"layout must be a moeroute ExpertLayout, got {type(layout).__name__}")
    key = getattr(layout, _LAYOUT_KEY_ATTRIBUTE, None)
    if key is None or (not torch.compiler.is_compiling() and _LAYOUTS.get(key) is not layout):
        return _register_layout(layout)
    return key


def _registered_layout(key: str) -> ExpertLayout:
    layout = _LAYOUTS.get(key)
    if layout is None:
        raise ValueError(
            f"layout_key={key!r} names no live ExpertLayout; get keys from "
            "moeroute.bindings.torch.ops.layout_key(layout) in this process"
        )
    return layout


def register_layer(module: torch.nn.Module) -> str:
    """Register ``module`` for ``torch.ops.moeroute.moe_forward``; returns its new key.

    The op calls ``module.forward_impl(hidden_states, router_logits)``. Keys are
    ``"moe.<n>"`` in construction order; the registry holds the module weakly.
    """
    key = f"moe.{next(_LAYER_COUNTER)}"
    _LAYERS[key] = module
    return key


def registered_layer(key: str) -> torch.nn.Module:
    """The live module registered under ``key``.

    Raises
    ------
    ValueError
        No live module has that key (it was garbage-collected, or the key comes from
        another process: an exported program runs only where its layers exist).
    """
    module = _LAYERS.get(key)
    if module is None:
        raise ValueError(
            f"layer_key={key!r} names no live moeroute layer; the MoE module was deleted "
            "or built in another process (moe_forward runs only where its layer exists)"
        )
    return module


def runs_eagerly(*tensors) -> bool:
    """True when no tracer can be watching a call on ``tensors`` (None entries skipped):
    plain tensors (not fake, functional or proxy subclasses) outside torch.compile,
    torch.export and torch.jit.trace. Callers then run an op's body directly, without the
    custom op's dispatch, whose Python overhead rivals a small layer's work; a tracer must see the op."""
    for tensor in tensors:
        if tensor is not None and type(tensor) is not torch.Tensor:
            return False
    return not (torch.compiler.is_compiling() or torch.compiler.is_exporting() or torch.jit.is_tracing())


def _static_int(value) -> bool:
    # Fake kernels validate what is known at trace time; symbolic sizes are checked when run.
    return isinstance(value, int)


# ------------------------------------------------------------------ select_experts


def _check_logits(logits: torch.Tensor, correction_bias: Optional[torch.Tensor] = None) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [T, N], got shape {tuple(logits.shape)}")
    # A bias on another device (the meta device included) would be read as whatever is there.
    check_same_device("logits", logits, correction_bias=correction_bias)


def _router(
    num_experts, top_k, scoring, num_expert_group, topk_group, renormalize, routed_scaling_factor
) -> RouterConfig:
    return RouterConfig(num_experts, top_k, scoring, num_expert_group, topk_group, renormalize, routed_scaling_factor)


@torch.library.custom_op(f"{NAMESPACE}::select_experts", mutates_args=())
def _select_experts_op(
    logits: torch.Tensor,
    top_k: int,
    scoring: str = "softmax",
    num_expert_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    correction_bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_logits(logits, correction_bias)
    router = _router(logits.shape[1], top_k, scoring, num_expert_group, topk_group, renormalize, routed_scaling_factor)
    return arrays.select_experts(logits, router, correction_bias)


@_select_experts_op.register_fake
def _(
    logits,
    top_k,
    scoring="softmax",
    num_expert_group=1,
    topk_group=1,
    renormalize=True,
    routed_scaling_factor=1.0,
    correction_bias=None,
):
    _check_logits(logits, correction_bias)
    if _static_int(logits.shape[1]):
        _router(logits.shape[1], top_k, scoring, num_expert_group, topk_group, renormalize, routed_scaling_factor)
    shape = (logits.shape[0], top_k)
    return (logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int32))


def select_experts(logits: torch.Tensor, router: RouterConfig, correction_bias: Optional[torch.Tensor] = None):
    """``torch.ops.moeroute.select_experts`` with a `RouterConfig`.

    Parameters
    ----------
    logits : Tensor [T, N] float32, CPU or CUDA
    router : RouterConfig (N = router.num_experts)
    correction_bias : Tensor [N] float32, optional

    Returns
    -------
    topk_weights : Tensor [T, K] float32
    topk_ids : Tensor [T, K] int32

    Raises
    ------
    TypeError
        ``router`` is not a RouterConfig.
    ValueError
        ``logits`` is not [T, router.num_experts], or as `moeroute.select_experts`.
    """
    if not isinstance(router, RouterConfig):
        raise TypeError(f"router must be a moeroute RouterConfig, got {type(router).__name__}")
    if logits.dim() != 2 or logits.shape[1] != router.num_experts:
        raise ValueError(f"logits must be [T, N={router.num_experts}], got shape {tuple(logits.shape)}")
    return torch.ops.moeroute.select_experts(
        logits,
        router.top_k,
        router.scoring,
        router.num_expert_group,
        router.topk_group,
        router.renormalize,
        float(router.routed_scaling_factor),
        correction_bias,
    )


# ------------------------------------------------------------------ append_shared_slots


def _appended_slots(layout: ExpertLayout) -> int:
    return layout.num_shared_experts if layout.shared == "fused" else 0


@torch.library.custom_op(f"{NAMESPACE}::append_shared_slots", mutates_args=())
def _append_shared_slots_op(
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    layout_key: str,
    home_rank: int = 0,
    shared_weights: Optional[torch.Tensor] = None,
    shared_weight: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if shared_weights is not None and shared_weight is not None:
        raise ValueError(
            "pass the shared slot weight as shared_weights (a tensor) or shared_weight (a float), not both"
        )
    weights_then_ids(topk_weights, topk_ids)
    check_same_device("topk_ids", topk_ids, topk_weights=topk_weights, shared_weights=shared_weights)
    layout = _registered_layout(layout_key)
    shared = shared_weights if shared_weights is not None else shared_weight
    return arrays.append_shared_slots(topk_weights, topk_ids, layout, home_rank, shared)


@_append_shared_slots_op.register_fake
def _(topk_weights, topk_ids, layout_key, home_rank=0, shared_weights=None, shared_weight=None):
    weights_then_ids(topk_weights, topk_ids)
    check_same_device("topk_ids", topk_ids, topk_weights=topk_weights, shared_weights=shared_weights)
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be 2-D [T, K], got shape {tuple(topk_ids.shape)}")
    slots = _appended_slots(_registered_layout(layout_key))
    shape = (topk_ids.shape[0], topk_ids.shape[1] + slots)
    return (topk_ids.new_empty(shape, dtype=torch.float32), topk_ids.new_empty(shape, dtype=torch.int32))


def append_shared_slots(
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, layout: ExpertLayout, home_rank: int = 0, shared_weights=None
):
    """``torch.ops.moeroute.append_shared_slots`` with an `ExpertLayout`.

    Parameters
    ----------
    topk_weights : Tensor [T, K] float32
    topk_ids : Tensor [T, K] int32, logical routed ids
    layout : ExpertLayout
    home_rank : int
    shared_weights : None, float, or Tensor [T] / [T, 1] / [T, S] float32
        ``layout.shared_slot_weight(gate, rsf)``.

    Returns
    -------
    weights : Tensor [T, K + S'] float32, ids : Tensor [T, K + S'] int32
        S' = S when the layout fuses the shared expert, else 0.

    Raises
    ------
    TypeError, ValueError
        As `moeroute.append_shared_slots` (TypeError for ids passed first, the order before 0.2).
    """
    key = layout_key(layout)
    if isinstance(shared_weights, torch.Tensor):
        return torch.ops.moeroute.append_shared_slots(
            topk_weights, topk_ids, key, home_rank, shared_weights.to(torch.float32), None
        )
    scalar = None if shared_weights is None else float(shared_weights)
    return torch.ops.moeroute.append_shared_slots(topk_weights, topk_ids, key, home_rank, None, scalar)


# ------------------------------------------------------------------ experts


def _check_experts_args(
    hidden_states, w_gate_up, w_down, topk_weights, topk_ids, activation, gemm, b_gate_up=None, b_down=None
):
    check_activation(activation)
    check_strategy("gemm", gemm, "float")
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be 2-D [T, H], got shape {tuple(hidden_states.shape)}")
    if hidden_states.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"hidden_states has dtype {hidden_states.dtype}; use one of {SUPPORTED_DTYPES}")
    hidden = hidden_states.shape[1]
    if w_gate_up.dim() != 3 or w_gate_up.shape[2] != hidden or w_gate_up.shape[1] % 2:
        raise ValueError(f"w_gate_up must be [L, 2I, H={hidden}], got shape {tuple(w_gate_up.shape)}")
    num_experts, inter = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    if tuple(w_down.shape) != (num_experts, hidden, inter):
        raise ValueError(f"w_down must be [L, H, I] = {[num_experts, hidden, inter]}, got shape {tuple(w_down.shape)}")
    for name, weight in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if weight.dtype != hidden_states.dtype:
            raise ValueError(f"{name} has dtype {weight.dtype}, hidden_states {hidden_states.dtype}; they must match")
    _check_routing_args(hidden_states, topk_weights, topk_ids)
    for name, bias, shape in (
        ("b_gate_up", b_gate_up, (num_experts, 2 * inter)),
        ("b_down", b_down, (num_experts, hidden)),
    ):
        if bias is not None and (tuple(bias.shape) != tuple(shape) or bias.dtype != hidden_states.dtype):
            raise ValueError(
                f"{name} must be {hidden_states.dtype} {list(shape)}, got {bias.dtype} of shape {tuple(bias.shape)}"
            )


def _check_routing_args(hidden_states, topk_weights, topk_ids) -> None:
    """The routing arguments of every weight format, checked at the op's boundary before any
    kernel: a kernel indexes ``hidden_states`` and the output by the rows of ``topk_ids``,
    so ids for fewer rows would leave output rows unwritten and ids for more would read and
    write past both. TypeError first when the pair comes ids first (the order before 0.2)."""
    weights_then_ids(topk_weights, topk_ids)
    num_tokens = hidden_states.shape[0]
    if topk_ids.dtype != torch.int32 or topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be int32 [T, K], got {topk_ids.dtype} of shape {tuple(topk_ids.shape)}")
    if topk_ids.shape[0] != num_tokens:
        raise ValueError(
            f"topk_ids has shape {tuple(topk_ids.shape)} and hidden_states {tuple(hidden_states.shape)}; "
            f"topk_ids must be [T, K] with T = hidden_states.shape[0] = {num_tokens} (one row of "
            "ids per token)"
        )
    if tuple(topk_weights.shape) != tuple(topk_ids.shape) or topk_weights.dtype != torch.float32:
        raise ValueError(
            f"topk_weights must be float32 of the shape of topk_ids {tuple(topk_ids.shape)}, "
            f"got {topk_weights.dtype} of shape {tuple(topk_weights.shape)}"
        )


def _check_experts_devices(call) -> None:
    """Every tensor argument of ``experts`` (``call``: its arguments by name) on the device of
    ``hidden_states`` (the kernels read them there; a meta-device weight holds no data).
    ``expert_map`` is held to the device of ``topk_ids`` by `_check_expert_map`."""
    names = ("w_gate_up", "w_down", "topk_weights", "topk_ids", "b_gate_up", "b_down", "gate_up_scale")
    names += ("down_scale", "input_scale", "gate_up_zero", "down_zero")
    check_same_device("hidden_states", call.hidden_states, **{name: getattr(call, name) for name in names})


def _quant_config(
    quant_format, block_size, quant_activation, scale_fmt, group_size=None, symmetric=None, zeros=(None, None)
) -> QuantConfig:
    """The op's quantization arguments as a `QuantConfig`; ``quant_activation=""`` is the
    format's default ("dynamic" for FP8, "none" for MXFP4 and INT4). ``group_size`` and
    ``symmetric`` are INT4's (None: 128, and symmetric unless zero points are passed); zero
    points with another format are refused here, naming the argument."""
    if quant_format != "int4":
        for name, zero in zip(("gate_up_zero", "down_zero"), zeros):
            if zero is not None:
                raise ValueError(
                    f"{name} is given but quant_format={quant_format!r}; zero points belong to "
                    "quant_format='int4' with symmetric=False"
                )
    elif symmetric is None:
        symmetric = zeros[0] is None and zeros[1] is None
    return QuantConfig(
        quant_format,
        block_size=None if block_size is None else tuple(block_size),
        activation=quant_activation or None,
        scale_fmt=scale_fmt,
        group_size=group_size,
        symmetric=symmetric,
    )


def _check_int4_experts_args(call, quant):
    """The INT4 form of `_check_experts_args`: packed uint8 [L, 2I, H/2] and [L, H, I/2],
    scales [L, 2I, H/g] and [L, H, I/g] (float32/bfloat16/float16), zero points uint8 of
    the scales' shape exactly when ``quant.symmetric`` is False; no biases, no input scale."""
    hidden_states, w_gate_up, w_down = call.hidden_states, call.w_gate_up, call.w_down
    if call.b_gate_up is not None or call.b_down is not None:
        raise ValueError("INT4 experts carry no biases; pass b_gate_up=b_down=None")
    if call.input_scale is not None:
        raise ValueError("INT4 experts keep their activations in float (w4a16); pass input_scale=None")
    for name, zero in (("gate_up_zero", call.gate_up_zero), ("down_zero", call.down_zero)):
        if quant.symmetric and zero is not None:
            raise ValueError(f"{name} is given with symmetric=True; symmetric INT4 has no zero points (z = 8)")
        if not quant.symmetric and zero is None:
            raise ValueError(f"{name} is missing; symmetric=False needs the zero points (uint8, the scales' shape)")
    if w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(
            f"with quant_format='int4' w_gate_up and w_down are packed uint8 [L, rows, cols/2], got shapes "
            f"{tuple(w_gate_up.shape)} and {tuple(w_down.shape)}"
        )
    num_experts, two_inter = w_gate_up.shape[:2]
    hidden = hidden_states.shape[1]
    if _static_int(num_experts) and _static_int(two_inter) and _static_int(hidden):
        if two_inter % 2:
            raise ValueError(f"w_gate_up has {two_inter} rows; gate_up rows are 2I (gate rows, then up rows)")
        inter = two_inter // 2
        for name, packed, scale, zero, shape in (
            ("w_gate_up", w_gate_up, call.gate_up_scale, call.gate_up_zero, (num_experts, two_inter, hidden // 2)),
            ("w_down", w_down, call.down_scale, call.down_zero, (num_experts, hidden, inter // 2)),
        ):
            if scale is None:
                raise ValueError(
                    f"{name}'s scales are missing; pass gate_up_scale and down_scale with quant_format='int4'"
                )
            # Shapes and dtypes only: zero point values are checked by the forward (here a read
            # would synchronize a device, and a fake tensor has none).
            check_int4(packed, scale, None, group_size=quant.group_size, name=name)
            if zero is not None and (zero.dtype != torch.uint8 or tuple(zero.shape) != tuple(scale.shape)):
                raise ValueError(
                    f"{name} zeros must be uint8 of the scales' shape {tuple(scale.shape)}, got {zero.dtype} of "
                    f"shape {tuple(zero.shape)}"
                )
            if tuple(packed.shape) != shape:
                raise ValueError(
                    f"{name} packed has shape {tuple(packed.shape)}; hidden_states [T, {hidden}] and "
                    f"{two_inter} gate_up rows need {list(shape)}"
                )


def _check_mxfp4_experts_args(call, quant):
    """The MXFP4 form of `_check_experts_args`: blocks uint8 [L, 2I, H/32, 16] and
    [L, H, I/32, 16] with their uint8 scales; biases optional (added in float32)."""
    hidden_states, w_gate_up, w_down = call.hidden_states, call.w_gate_up, call.w_down
    if call.input_scale is not None:
        raise ValueError("MXFP4 experts keep their activations in float (w4a16); pass input_scale=None")
    if w_gate_up.dim() != 4 or w_down.dim() != 4:
        raise ValueError(
            f"with quant_format='mxfp4' w_gate_up and w_down are blocks [L, rows, cols/32, 16], got "
            f"shapes {tuple(w_gate_up.shape)} and {tuple(w_down.shape)}"
        )
    num_experts, two_inter = w_gate_up.shape[:2]
    hidden = hidden_states.shape[1]
    if _static_int(num_experts) and _static_int(two_inter) and _static_int(hidden):
        if two_inter % 2:
            raise ValueError(f"w_gate_up has {two_inter} rows; gate_up rows are 2I (gate rows, then up rows)")
        # Shapes and dtypes only (reading the scale bytes would synchronize a device).
        check_mxfp4_weights(
            quant,
            num_experts,
            hidden,
            two_inter // 2,
            (w_gate_up, call.gate_up_scale),
            (w_down, call.down_scale),
            check_values=False,
        )
    for name, bias, shape in (
        ("b_gate_up", call.b_gate_up, (num_experts, two_inter)),
        ("b_down", call.b_down, (num_experts, hidden)),
    ):
        if bias is not None and (tuple(bias.shape) != tuple(shape) or bias.dtype not in SUPPORTED_DTYPES):
            raise ValueError(
                f"{name} must be {list(shape)} of {SUPPORTED_DTYPES} (added in float32), got "
                f"{bias.dtype} of shape {tuple(bias.shape)}"
            )


def _check_fp8_experts_args(call, quant):
    """The FP8 form of `_check_experts_args` (weights float8_e4m3fn, scales per `QuantConfig`)."""
    hidden_states, w_gate_up, w_down = call.hidden_states, call.w_gate_up, call.w_down
    if call.b_gate_up is not None or call.b_down is not None:
        raise ValueError("FP8 experts carry no biases; pass b_gate_up=b_down=None")
    if w_gate_up.dim() != 3 or w_gate_up.shape[1] % 2 or w_gate_up.shape[2] != hidden_states.shape[1]:
        raise ValueError(
            f"w_gate_up must be [L, 2I, H={hidden_states.shape[1]}] (H of hidden_states), got shape "
            f"{tuple(w_gate_up.shape)}"
        )
    num_experts, two_inter, hidden = w_gate_up.shape
    if _static_int(num_experts) and _static_int(hidden) and _static_int(two_inter):
        # Shapes and dtypes only: scale values are checked where weights are loaded, and
        # reading them here would synchronize a device (and cannot run on fake tensors).
        check_quantized_weights(
            quant,
            num_experts,
            hidden,
            two_inter // 2,
            w_gate_up,
            w_down,
            call.gate_up_scale,
            call.down_scale,
            call.input_scale,
            check_values=False,
        )


#: quant.format -> (the gemm strategies' format name, the check of its arguments)
_QUANT_CHECKS = {
    "int4": ("int4", _check_int4_experts_args),
    "mxfp4": ("mxfp4", _check_mxfp4_experts_args),
    "fp8_block": ("fp8", _check_fp8_experts_args),
    "fp8_tensor": ("fp8", _check_fp8_experts_args),
}


def _check_experts_call(call: dict) -> Optional[QuantConfig]:
    """The checks of ``experts`` and of its fake, on its arguments by name, before any kernel:
    devices, then the arguments of the float, INT4, MXFP4 or FP8 form, then the routing pair.
    Returns the `QuantConfig` of ``quant_format`` (None for float experts)."""
    call = types.SimpleNamespace(**call)
    weights_then_ids(call.topk_weights, call.topk_ids)
    _check_experts_devices(call)
    if not call.quant_format:
        _check_experts_args(
            *(call.hidden_states, call.w_gate_up, call.w_down, call.topk_weights, call.topk_ids, call.activation),
            *(call.gemm, call.b_gate_up, call.b_down),
        )
        return None
    zeros = (call.gate_up_zero, call.down_zero)
    quant = _quant_config(
        call.quant_format,
        call.block_size,
        call.quant_activation,
        call.scale_fmt,
        call.group_size,
        call.symmetric,
        zeros,
    )
    strategies, check_format_args = _QUANT_CHECKS[quant.format]
    check_activation(call.activation)
    check_strategy("gemm", call.gemm, strategies)
    hidden_states = call.hidden_states
    if hidden_states.dim() != 2 or hidden_states.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"hidden_states must be 2-D [T, H] of {SUPPORTED_DTYPES}, got {hidden_states.dtype} of "
            f"shape {tuple(hidden_states.shape)}"
        )
    check_format_args(call, quant)
    _check_routing_args(hidden_states, call.topk_weights, call.topk_ids)
    return quant


def _check_expert_map(expert_map, topk_ids, num_local_experts) -> None:
    """TypeError/ValueError naming ``expert_map`` unless it is an integer tensor [N_physical] on
    the device of ``topk_ids`` whose values (on the CPU, or wherever they can be read without a
    device sync) are -1 or local ids in [0, num_local_experts)."""
    if not isinstance(expert_map, torch.Tensor):
        raise TypeError(
            f"expert_map must be an integer torch.Tensor [num_physical_experts] or None, got "
            f"{type(expert_map).__name__}"
        )
    if expert_map.dtype.is_floating_point or expert_map.dtype.is_complex or expert_map.dtype == torch.bool:
        raise TypeError(f"expert_map must hold integers (int32: layout.expert_map(rank)), got dtype {expert_map.dtype}")
    if expert_map.dim() != 1:
        raise ValueError(f"expert_map must be 1-D [num_physical_experts], got shape {tuple(expert_map.shape)}")
    if expert_map.device != topk_ids.device:
        raise ValueError(
            f"expert_map is on {expert_map.device}, topk_ids on {topk_ids.device}; pass both on one device"
        )
    # Values: read on the CPU only (a device read would synchronize the stream). On a device a
    # value outside [-1, L) is not an error but names no local expert: its slots are skipped.
    if (
        expert_map.device.type == "cpu"
        and type(expert_map) is torch.Tensor
        and expert_map.numel()
        and _static_int(num_local_experts)
    ):
        low, high = int(expert_map.min()), int(expert_map.max())
        if low < -1 or high >= num_local_experts:
            raise ValueError(
                f"expert_map values must be -1 (not held here) or local ids in "
                f"[0, {num_local_experts}) (num_local_experts = w_gate_up.shape[0]), got values "
                f"in [{low}, {high}]"
            )


def local_expert_ids(
    topk_ids: torch.Tensor, expert_map: Optional[torch.Tensor], num_local_experts: int
) -> torch.Tensor:
    """``topk_ids`` as the experts body takes them: unchanged without ``expert_map``; with
    one, the physical ids mapped to local ids (``expert_map[id]``, -1 where this rank does
    not hold the expert or the id is outside [0, len(expert_map))) by the routing library's
    `remap_to_local` (one Numba pass on the CPU, one kernel launch on a device).

    Parameters
    ----------
    topk_ids : Tensor [T, K] int32, physical ids when ``expert_map`` is given
    expert_map : Tensor [N_physical] integer or None, on the device of ``topk_ids``
    num_local_experts : int, L (the experts' leading dimension)

    Raises
    ------
    TypeError, ValueError
        As `_check_expert_map`: ``expert_map`` not an integer 1-D tensor on the device of
        ``topk_ids``, or (CPU) holding values outside [-1, L).
    """
    if expert_map is None:
        return topk_ids
    _check_expert_map(expert_map, topk_ids, num_local_experts)
    if expert_map.dtype != torch.int32:
        expert_map = expert_map.to(torch.int32)
    return arrays.remap_to_local(topk_ids, expert_map)


def experts(
    hidden_states: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    gemm: str = "auto",
    b_gate_up: Optional[torch.Tensor] = None,
    b_down: Optional[torch.Tensor] = None,
    gate_up_scale: Optional[torch.Tensor] = None,
    down_scale: Optional[torch.Tensor] = None,
    input_scale: Optional[torch.Tensor] = None,
    quant_format: str = "",
    block_size: Optional[list[int]] = None,
    quant_activation: str = "",
    scale_fmt: str = "float",
    expert_map: Optional[torch.Tensor] = None,
    gate_up_zero: Optional[torch.Tensor] = None,
    down_zero: Optional[torch.Tensor] = None,
    group_size: Optional[int] = None,
    symmetric: Optional[bool] = None,
) -> torch.Tensor:
    """``sum_k w[t, k] * expert_{ids[t, k]}(x_t)`` over the ids in [0, L); the others are
    computed elsewhere and skipped. Optional biases b_gate_up [L, 2I] and b_down [L, H].
    The computation of `LocalExperts` with plain (not oneDNN-packed) weights. With
    ``quant_format``: FP8 weights and their scales, the computation of `QuantizedExperts`
    (``gemm`` then names the FP8 strategy: "auto", "rows" or "blocks"). With ``expert_map``
    (integer [N_physical], -1 = not held here) the ids are physical: id p is local expert
    ``expert_map[p]``, and slots whose expert is not held contribute nothing (expert
    parallelism: this rank's partial sum). With ``quant_format="mxfp4"``: ``w_gate_up`` /
    ``w_down`` are MXFP4 blocks, ``gate_up_scale`` / ``down_scale`` their scale bytes, the
    computation of an MXFP4 layer (biases added in float32). With ``quant_format="int4"``:
    ``w_gate_up`` / ``w_down`` are packed uint8 [L, 2I, H/2] / [L, H, I/2] (two 4-bit
    integers a byte, low nibble first), ``gate_up_scale`` / ``down_scale`` their group scales
    [L, rows, cols/group_size], and with ``symmetric=False`` ``gate_up_zero`` / ``down_zero``
    their uint8 zero points of the scales' shape (``w = (q - z) * s``, z = 8 when
    symmetric); ``group_size`` 32, 64 or 128 (None: 128), ``symmetric`` None: symmetric
    unless zero points are passed; ``gemm`` names the INT4 strategy ("auto", "rows", "blocks").

    The routing pair comes weights first (as vLLM passes it); before 0.2 this op took
    ``topk_ids, topk_weights``, and ids passed first are refused with a TypeError (non-float
    ``topk_weights``). Every format checks the same way, before any kernel: ValueError naming the argument when
    ``topk_ids`` is not int32 [T, K] with T = ``hidden_states.shape[0]``, ``topk_weights``
    is not float32 of its shape, a tensor is on another device than ``hidden_states`` (the
    meta device included), or ``gemm`` is not a strategy of the format.

    The body of ``torch.ops.moeroute.experts``, called directly where `runs_eagerly` allows.
    """
    quant = _check_experts_call(locals())
    topk_ids = local_expert_ids(topk_ids, expert_map, w_gate_up.shape[0])
    if quant is not None:
        if quant.format == "int4":
            return int4_experts_forward(
                hidden_states.contiguous(),
                topk_weights.contiguous(),
                topk_ids.contiguous(),
                (w_gate_up, gate_up_scale, gate_up_zero),
                (w_down, down_scale, down_zero),
                quant.group_size,
                activation,
                gemm,
            )
        if quant.format == "mxfp4":
            return mxfp4_experts_forward(
                hidden_states.contiguous(),
                topk_weights.contiguous(),
                topk_ids.contiguous(),
                w_gate_up,
                gate_up_scale,
                w_down,
                down_scale,
                b_gate_up,
                b_down,
                activation,
                gemm,
            )
        return fp8_experts_forward(
            hidden_states.contiguous(),
            topk_weights.contiguous(),
            topk_ids.contiguous(),
            w_gate_up,
            gate_up_scale.float(),
            w_down,
            down_scale.float(),
            quant,
            activation,
            None if input_scale is None else input_scale.float(),
            gemm,
        )
    if hidden_states.device.type == "cuda":
        contiguous = [None if t is None else t.contiguous() for t in (b_gate_up, b_down)]
        return torch.ops.moeroute.fused_experts(
            hidden_states.contiguous(),
            w_gate_up.contiguous(),
            w_down.contiguous(),
            topk_weights.contiguous(),
            topk_ids.contiguous(),
            activation,
            True,
            None,
            *contiguous,
        )
    return cpu_experts(hidden_states, topk_weights, topk_ids, w_gate_up, w_down, activation, gemm, b_gate_up, b_down)


_experts_op = torch.library.custom_op(f"{NAMESPACE}::experts", mutates_args=())(experts)
_EXPERTS_SIGNATURE = inspect.signature(experts)


def _bound_call(signature: inspect.Signature, args, kwargs) -> dict:
    """A fake's arguments by name, defaults filled in, as the op's ``signature`` binds them."""
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


@_experts_op.register_fake
def _(*args, **kwargs):
    call = _bound_call(_EXPERTS_SIGNATURE, args, kwargs)
    _check_experts_call(call)
    if call["expert_map"] is not None:
        _check_expert_map(call["expert_map"], call["topk_ids"], call["w_gate_up"].shape[0])
    return call["hidden_states"].new_empty(call["hidden_states"].shape)


# ------------------------------------------------------------------ fused_experts (CUDA)


def _fused_experts(
    hidden_states: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    apply_router_weight: bool = True,
    block_size: Optional[int] = None,
    gate_up_bias: Optional[torch.Tensor] = None,
    down_bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """`moeroute.gpu.fused_experts` on torch CUDA tensors (it raises TypeError for others)."""
    weights_then_ids(topk_weights, topk_ids)
    try:
        from moeroute.gpu import fused_experts
    except ImportError as error:  # CuPy missing: say what the CUDA path needs
        raise RuntimeError(
            f"moeroute's CUDA expert GEMMs could not be imported ({error}); install the 'cuda' extra (CuPy, numba-cuda)"
        ) from error
    return fused_experts(
        hidden_states,
        w_gate_up,
        w_down,
        topk_weights,
        topk_ids,
        activation=activation,
        apply_router_weight=apply_router_weight,
        block_size=block_size,
        gate_up_bias=gate_up_bias,
        down_bias=down_bias,
    )


_fused_experts_op = torch.library.custom_op(f"{NAMESPACE}::fused_experts", mutates_args=())(_fused_experts)
_FUSED_EXPERTS_SIGNATURE = inspect.signature(_fused_experts)


@_fused_experts_op.register_fake
def _(*args, **kwargs):
    call = _bound_call(_FUSED_EXPERTS_SIGNATURE, args, kwargs)
    _check_experts_args(
        *(call["hidden_states"], call["w_gate_up"], call["w_down"], call["topk_weights"], call["topk_ids"]),
        *(call["activation"], "auto", call["gate_up_bias"], call["down_bias"]),
    )
    return call["hidden_states"].new_empty(call["hidden_states"].shape)


# ------------------------------------------------------------------ the whole layer


@torch.library.custom_op(f"{NAMESPACE}::moe_forward", mutates_args=())
def _moe_forward_op(hidden_states: torch.Tensor, router_logits: Optional[torch.Tensor], layer_key: str) -> torch.Tensor:
    """One MoE layer, run eagerly by the registered module's ``forward_impl``."""
    out = registered_layer(layer_key).forward_impl(hidden_states, router_logits)
    # A custom op's output must be a fresh, contiguous tensor (the fake promises one).
    if not out.is_contiguous() or out.untyped_storage().data_ptr() == hidden_states.untyped_storage().data_ptr():
        out = out.clone(memory_format=torch.contiguous_format)
    return out


@_moe_forward_op.register_fake
def _(hidden_states, router_logits, layer_key):
    registered_layer(layer_key)
    return hidden_states.new_empty(hidden_states.shape)


#: The registered ops by name (``OPS["select_experts"] is torch.ops.moeroute.select_experts``'s
#: Python handle, for torch.library.opcheck and introspection).
OPS = {
    "select_experts": _select_experts_op,
    "append_shared_slots": _append_shared_slots_op,
    "experts": _experts_op,
    "fused_experts": _fused_experts_op,
    "moe_forward": _moe_forward_op,
}
