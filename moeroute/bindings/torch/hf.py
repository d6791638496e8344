"""transformers interop: build a moeroute MoE from a transformers MoE block, swap them in a model.

Each supported block is read from its own modules (the router's fields are what its
forward uses), in the transformers 5 layout where the experts are stacked parameters
``experts.gate_up_proj`` [N, 2I, H] (gate rows first) and ``experts.down_proj`` [N, H, I].

Routing of each family, and how it maps onto `moeroute.config.RouterConfig`:

=========================  ==================================================================
DeepseekV3MoE, Glm4MoeMoE  sigmoid scores of float32 logits, ``e_score_correction_bias`` for
(Kimi-K2: DeepseekV3MoE    selection, groups scored by their top-2 sum (n_group, topk_group),
with n_group = 1)          optional renormalization (+1e-20), times rsf. Shared MLP of size
                           n_shared * I, ungated: S = n_shared slots. Exact.
Qwen2Moe, Qwen3Next        softmax (float32) of logits computed in the weights' dtype, top-k,
                           optional renormalization (``norm_topk_prob``; Qwen3.5 always),
Qwen3_5Moe                 sigmoid-gated shared MLP: S = shared size / I slots (Qwen1.5-MoE:
                           5632 / 1408 = 4), unfusable when it does not divide. Exact in
                           float32 (the renormalization's 1e-20 is below float32 resolution
                           of any sum of top-k probabilities).
Qwen3Moe, Mixtral          softmax top-k, optional (Qwen3) or always (Mixtral) renormalized;
                           no shared expert. Exact.
GptOssMLP                  router linear with a bias, top-k of the logits then softmax over
(Mxfp4GptOssMLP: the       the K picked (= softmax + renormalize); experts with biases,
MXFP4 experts kept packed) gate/up columns interleaved in ``gate_up_proj`` [N, H, 2I]
                           (transposed: gate = columns 0, 2, 4, ..., up = 1, 3, 5, ...),
                           ``down_proj`` [N, I, H]; activation "swigluoai". Exact in float32.
=========================  ==================================================================

Not bit-identical in bfloat16, by design: Qwen blocks round the routing weights to bfloat16
before weighting and every block accumulates the expert outputs in bfloat16 (index_add_);
moeroute keeps the weights in float32 and accumulates in float32. Selection is identical
(the router logits are computed in the same dtype as the block's). Mixtral's training-time
jitter noise is not reproduced (inference only).
"""

from __future__ import annotations

import dataclasses

import warnings
import weakref
from collections.abc import Callable

import torch
from torch import nn

from moeroute.experts.modules import LocalExperts
from moeroute.experts.formats.fp8 import check_quantized_weights, gate_up_scale_from_stacked
from moeroute.bindings.torch.hf_keys import (
    TransformersCheckpoint,
    from_gpt_oss_layout,
)
from moeroute.bindings.torch.int4_keys import int4_checkpoint_for
from moeroute.bindings.torch.moe import MoE
from moeroute.experts.formats.mxfp4 import GPT_OSS_MXFP4_KEYS as MXFP4_CHECKPOINT_KEYS
from moeroute.experts.formats.mxfp4 import check_mxfp4_weights, gate_rows_first
from moeroute.config import RouterConfig
from moeroute.quant import FP8_DTYPE, QuantConfig, quantize_experts, quantize_int4

__all__ = [
    "from_hf",
    "replace_moe_blocks",
    "SUPPORTED_BLOCKS",
    "SUPPORTED_MODEL_TYPES",
    "EXPERTS_IMPLEMENTATION",
    "experts_forward",
    "register_experts_implementation",
    "TupleOutputMoE",
    "TransformersCheckpoint",
]

#: The name under which moeroute registers in transformers' experts interface.
EXPERTS_IMPLEMENTATION = "moeroute"

#: transformers hidden_act name -> moeroute activation (one of moeroute.config.EXPERT_ACTIVATIONS):
#: transformers has its own spellings, and its gpt-oss blocks hard-code "swigluoai" unnamed.
_HF_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
}


def _activation(block: nn.Module) -> str:
    config = getattr(block.experts, "config", None) or getattr(block, "config", None)
    name = getattr(config, "hidden_act", "silu")
    if name not in _HF_ACTIVATIONS:
        raise ValueError(
            f"{type(block).__name__} uses hidden_act={name!r}; moeroute supports {sorted(_HF_ACTIVATIONS)}"
        )
    return _HF_ACTIVATIONS[name]


def _experts(block: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    experts = block.experts
    gate_up = getattr(experts, "gate_up_proj", None)
    down = getattr(experts, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) or gate_up.dim() != 3:
        raise ValueError(
            f"{type(block).__name__}.experts has no stacked gate_up_proj [N, 2I, H] / down_proj [N, H, I]; "
            "moeroute reads the transformers >= 5 expert layout"
        )
    if (
        getattr(experts, "is_transposed", False)
        or not getattr(experts, "is_concatenated", True)
        or getattr(experts, "has_bias", False)
    ):
        raise ValueError(
            f"{type(block).__name__}.experts stores transposed, interleaved or biased "
            "weights; moeroute reads [N, 2I, H] gate-then-up without bias"
        )
    return gate_up, down


def _fp8_experts(experts: nn.Module, quant: QuantConfig | None):
    """(QuantConfig, load_routed_weights kwargs) of a transformers FP8Experts module, or None
    when its weights are not float8_e4m3fn."""
    gate_up = getattr(experts, "gate_up_proj", None)
    if not isinstance(gate_up, torch.Tensor) or gate_up.dtype != FP8_DTYPE:
        return None
    gate_up_scale, down_scale = experts.gate_up_proj_scale_inv, experts.down_proj_scale_inv
    block = getattr(experts, "block_size", None)
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    found = QuantConfig(
        "fp8_block" if block is not None else "fp8_tensor",
        block_size=None if block is None else tuple(block),
        activation=getattr(experts, "activation_scheme", "dynamic"),
        scale_fmt="ue8m0" if gate_up_scale.dtype == e8m0 else "float",
    )
    # modules_to_not_convert (informational) is not compared; w8a16 (activation="none") is a
    # choice of compute over the same dynamic-scheme weights, so it may replace "dynamic".
    w8a16 = quant is not None and quant.activation == "none" and found.activation == "dynamic"
    if quant is not None and quant != found and not (w8a16 and dataclasses.replace(found, activation="none") == quant):
        raise ValueError(
            f"quant={quant!r} differs from the block's FP8 experts ({found!r}); leave quant None "
            "to keep the checkpoint's format"
        )
    found = quant or found  # the caller's, with its modules_to_not_convert
    num_experts, two_inter, _ = gate_up.shape
    if found.format == "fp8_tensor":
        gate_up_scale, down_scale = gate_up_scale.reshape(num_experts, -1), down_scale.reshape(num_experts)
        if gate_up_scale.shape[1] == 1:
            gate_up_scale = gate_up_scale.expand(num_experts, 2)
    else:
        gate_up_scale = gate_up_scale_from_stacked(gate_up_scale, found, two_inter // 2)
    kwargs = dict(gate_up_scale=gate_up_scale, down_scale=down_scale)
    if found.activation == "static":
        kwargs["input_scale"] = torch.stack(
            [experts.gate_up_proj_activation_scale, experts.down_proj_activation_scale], dim=1
        )
    return found, kwargs


def _quantize_into(module: MoE, expert: Callable, quant: QuantConfig) -> None:
    """Quantize a float block's experts with ``quant`` straight into ``module``'s routed
    rows, one expert at a time: ``expert(e)`` is logical expert e's (gate_up [1, 2I, H],
    down [1, H, I]) (views of the block's tensors, or one expert's converted copy). Beyond
    the block's weights and the module's, the peak is one expert's converted copy (gpt-oss
    only) plus `quantize_experts`' step temporaries. The written rows are checked as
    `MoE.load_routed_weights` checks them (scales finite and positive, no NaN byte)."""
    targets = module.experts.quantized_tensors()
    if "input_scale" in targets:
        raise ValueError(
            "input_scale is missing: quant activation='static' needs the [N, 2] activation "
            "scales (gate_up input, down input), which a float block does not have"
        )
    ids = module.routed_expert_ids()
    if quant.format == "int4":  # each expert's two weights with quantize_int4, into its rows
        for local, e in enumerate(ids):
            for kind, weight in zip(("gate_up", "down"), expert(e)):
                parts = quantize_int4(weight[0], group_size=quant.group_size, symmetric=quant.symmetric)
                module.experts.hold_int4_scales(kind + "_scale", parts[1].dtype)
                targets = module.experts.quantized_tensors()
                for name, tensor in zip(("w_" + kind, kind + "_scale", kind + "_zero"), parts):
                    targets[name][local].copy_(tensor)
        return
    names = ("w_gate_up", "gate_up_scale", "w_down", "down_scale")
    for local, e in enumerate(ids):
        quantize_experts(*expert(e), quant, out=tuple(targets[name][local : local + 1] for name in names))
    if quant.format != "mxfp4":
        rows = {name: targets[name][: len(ids)] for name in names}
        check_quantized_weights(
            quant,
            len(ids),
            module.routed_hidden_size,
            module.intermediate_size,
            rows["w_gate_up"],
            rows["w_down"],
            rows["gate_up_scale"],
            rows["down_scale"],
            None,
        )


def _read_deepseek(block: nn.Module) -> dict:
    gate = block.gate
    router = RouterConfig(
        num_experts=gate.num_experts,
        top_k=gate.top_k,
        scoring="sigmoid",
        num_expert_group=gate.num_group,
        topk_group=gate.topk_group,
        renormalize=bool(gate.norm_topk_prob),
        routed_scaling_factor=float(gate.routed_scaling_factor),
    )
    # The block always computes its logits in float32 (whatever its weight's dtype, which
    # the module keeps: a bfloat16 model saves a bfloat16 gate) and always applies the bias.
    return dict(
        router=router,
        router_weight=gate.weight,
        router_dtype=gate.weight.dtype,
        router_compute_dtype=torch.float32,
        correction_bias=gate.e_score_correction_bias,
        shared_experts=block.shared_experts,
        shared_expert_gate=None,
        checkpoint=TransformersCheckpoint("stacked", "shared_experts."),
    )


def _gpt_oss_experts(experts: nn.Module) -> tuple[torch.Tensor, ...]:
    """gpt-oss expert weights in their own layout (gate_up_proj [N, H, 2I] interleaved,
    down_proj [N, I, H], the biases), converted by `from_gpt_oss_layout` when used: as a
    whole for a float layer (which then holds that copy), one expert at a time to quantize."""
    return (experts.gate_up_proj, experts.down_proj, experts.gate_up_proj_bias, experts.down_proj_bias)


#: gpt-oss checkpoint names of MXFP4 experts (relative to the experts module).
GPT_OSS_MXFP4_KEYS = tuple(key[len("experts.") :] for key in MXFP4_CHECKPOINT_KEYS)


def _unswizzled(tensor) -> torch.Tensor:
    """The plain torch tensor behind a triton_kernels tensor (``storage.data`` in
    ``storage.layout``), transposed back to the checkpoint's [N, rows, ...] order: the inverse
    of what transformers' MXFP4 loader does (swizzle_mxfp4 of the transposed checkpoint tensor)."""
    storage = tensor.storage
    return storage.layout.unswizzle_data(storage.data).transpose(-1, -2)


def _mxfp4_tensors(experts: nn.Module):
    """(gate_up blocks, gate_up scales, down blocks, down scales) of an experts module holding
    MXFP4 weights, in the checkpoint's shapes ([N, rows, cols / 32, 16] and [N, rows, cols / 32]),
    or None when it holds float weights.

    Two forms: the checkpoint's names as tensors (``gate_up_proj_blocks`` ...), and
    transformers' ``Mxfp4GptOssExperts`` after loading, whose ``gate_up_proj`` / ``down_proj``
    are triton_kernels tensors (packed bytes in a hardware layout) with the scale bytes in
    ``<proj>_precision_config.weight_scale``."""
    tensors = [getattr(experts, name, None) for name in GPT_OSS_MXFP4_KEYS]
    if all(isinstance(t, torch.Tensor) for t in tensors):
        return tensors
    found = []
    for proj in ("gate_up_proj", "down_proj"):
        weight = getattr(experts, proj, None)
        if isinstance(weight, torch.Tensor) and weight.dtype != torch.uint8:
            return None  # float (or FP8) experts
        config = getattr(experts, f"{proj}_precision_config", None)
        if not hasattr(weight, "storage") or not hasattr(getattr(config, "weight_scale", None), "storage"):
            raise ValueError(
                f"{type(experts).__name__}.{proj} holds packed MXFP4 bytes without their scales "
                f"({proj}_precision_config.weight_scale); moeroute reads the checkpoint's "
                f"{proj}_blocks / {proj}_scales or transformers' loaded MXFP4 experts"
            )
        scales = _unswizzled(config.weight_scale)
        found += [_unswizzled(weight).reshape(*scales.shape, -1), scales]
    return found


def _gpt_oss_mxfp4_experts(experts: nn.Module):
    """MXFP4 gpt-oss experts in the checkpoint's row order, or None when ``experts`` holds no
    MXFP4 tensors: ((gate_up blocks, scales), (down blocks, scales), gate_up_bias,
    down_bias). gate_up's rows alternate gate, up; MXFP4 rows are independent, so putting
    the gate rows first (`_build_mxfp4`, one expert at a time) is a row permutation of
    blocks, scales and bias entries."""
    tensors = _mxfp4_tensors(experts)
    if tensors is None:
        return None
    gate_up_blocks, gate_up_scales, down_blocks, down_scales = tensors
    return (
        (gate_up_blocks, gate_up_scales),
        (down_blocks, down_scales),
        experts.gate_up_proj_bias,
        experts.down_proj_bias,
    )


def _read_gpt_oss(block: nn.Module) -> dict:
    from moeroute.experts.activations import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT

    router, experts = block.router, block.experts
    alpha, limit = float(experts.alpha), float(experts.limit)
    if (alpha, limit) != (SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT):
        raise ValueError(
            f"{type(block).__name__} uses swiglu_alpha={alpha}, swiglu_limit={limit}; moeroute's "
            f"swigluoai has alpha={SWIGLUOAI_ALPHA}, limit={SWIGLUOAI_LIMIT}"
        )
    mxfp4 = _gpt_oss_mxfp4_experts(experts)
    # top-k of the logits, then softmax over the K picked: softmax + renormalize (docs/semantics.md section 9).
    config = RouterConfig(num_experts=router.num_experts, top_k=router.top_k, scoring="softmax", renormalize=True)
    return dict(
        router=config,
        router_weight=router.weight,
        router_dtype=router.weight.dtype,
        router_bias=router.bias,
        correction_bias=None,
        shared_experts=None,
        shared_expert_gate=None,
        experts=mxfp4,
        gpt_oss_float=_gpt_oss_experts(experts) if mxfp4 is None else None,
        activation="swigluoai",
        checkpoint=TransformersCheckpoint("gpt_oss"),
    )


def _read_qwen(block: nn.Module) -> dict:
    gate = block.gate
    router = RouterConfig(
        num_experts=gate.num_experts,
        top_k=gate.top_k,
        scoring="softmax",
        # Qwen3.5-MoE and Mixtral routers have no norm_topk_prob: they always renormalize.
        renormalize=bool(getattr(gate, "norm_topk_prob", True)),
    )
    return dict(
        router=router,
        router_weight=gate.weight,
        router_dtype=gate.weight.dtype,
        correction_bias=None,
        shared_experts=getattr(block, "shared_expert", None),
        shared_expert_gate=getattr(block, "shared_expert_gate", None),
        checkpoint=TransformersCheckpoint("stacked", "shared_expert."),
    )


#: Block class name -> reader of its routing, router weights and shared expert.
SUPPORTED_BLOCKS: dict[str, Callable[[nn.Module], dict]] = {
    "DeepseekV3MoE": _read_deepseek,
    "Glm4MoeMoE": _read_deepseek,
    "Qwen3_5MoeSparseMoeBlock": _read_qwen,
    "Qwen3NextSparseMoeBlock": _read_qwen,
    "Qwen2MoeSparseMoeBlock": _read_qwen,
    "Qwen3MoeSparseMoeBlock": _read_qwen,
    "MixtralSparseMoeBlock": _read_qwen,
    "GptOssMLP": _read_gpt_oss,
    # transformers >= 5 swaps GptOssMLP for this class when it keeps an MXFP4 checkpoint's
    # experts packed (transformers 4.x patched GptOssMLP's forward in place instead).
    "Mxfp4GptOssMLP": _read_gpt_oss,
}

#: transformers ``config.model_type`` of the families whose blocks `SUPPORTED_BLOCKS` reads:
#: in such a model, an MoE block `replace_moe_blocks` cannot read is reported, not skipped silently.
SUPPORTED_MODEL_TYPES = frozenset(
    {
        "deepseek_v3",
        "kimi_k2",
        "glm4_moe",
        "qwen2_moe",
        "qwen3_moe",
        "qwen3_next",
        "qwen3_5_moe",
        "qwen3_5_moe_text",
        "mixtral",
        "gpt_oss",
    }
)


def _reader_for(block: nn.Module):
    for cls in type(block).__mro__:
        reader = SUPPORTED_BLOCKS.get(cls.__name__)
        if reader is not None:
            return reader
    return None


def from_hf(block: nn.Module, ep_group=None, shared: str = "auto", dispatch: str = "all2all", **kwargs) -> MoE:
    """A moeroute `MoE` computing what a transformers MoE block computes.

    Parameters
    ----------
    block : nn.Module
        One of `SUPPORTED_BLOCKS` (subclasses included).
    ep_group : torch.distributed.ProcessGroup, optional
        With a group, the new module holds only this rank's experts.
    shared : {"auto", "runner", "overlap", "fused"}
    dispatch : {"all2all", "allgather"}
    **kwargs
        Passed to `MoE` (e.g. ``scaling_regime``, ``num_redundant_experts``). ``quant``: a
        `moeroute.quant.QuantConfig` to quantize a float block's experts with, each straight
        into the new layer: beyond the block's weights and the layer's, the peak is one
        quantization step's temporaries (gpt-oss: plus one expert's converted copy). A block
        whose experts are transformers' ``FP8Experts`` (fine-grained FP8)
        keeps its float8_e4m3fn weights and scales as they are, and its format is read from
        the block (``quant``, when given, must agree). An INT4 ``quant`` read from a
        checkpoint (``QuantConfig.from_hf``, which sets ``quant.checkpoint``) is for loading
        that checkpoint: the block's float experts are not quantized, and the layer holds
        zero weights until ``load_state_dict`` or ``load_experts`` fills them.

    Returns
    -------
    MoE
        On the block's device, in the dtype of its expert weights. The routed expert
        weights share the block's ``gate_up_proj`` / ``down_proj`` memory when the module
        holds exactly those experts (one rank, no replicas, no fused shared slots); they
        are copies otherwise (this rank's experts, then the fused shared slots). The
        shared MLP, its gate, the bias and the router weight share the block's tensors.
        The module saves and loads the block's transformers state dict: its
        ``checkpoint_format`` (`TransformersCheckpoint`) maps the names and layouts.

    Raises
    ------
    TypeError
        ``block`` is not a supported transformers MoE block.
    ValueError, moeroute.layout.LayoutError
        As `MoE` (e.g. ``shared="fused"`` for a shared MLP that does not split into slots).
    """
    return _build(MoE, block, ep_group=ep_group, shared=shared, dispatch=dispatch, **kwargs)


@torch.no_grad()
def _build(
    cls: type[MoE], block: nn.Module, ep_group=None, shared: str = "auto", dispatch: str = "all2all", **kwargs
) -> MoE:
    """``MoE.from_hf(block, ep_group=None, shared="auto", dispatch="all2all", **kwargs)``:
    `from_hf`, building an instance of the class it is called on (a subclass of `MoE`)."""
    reader = _reader_for(block) if isinstance(block, nn.Module) else None
    if reader is None:
        raise TypeError(
            f"block of type {type(block).__name__} is not a supported transformers MoE block; "
            f"supported: {', '.join(SUPPORTED_BLOCKS)}"
        )
    fields = reader(block)
    expert_biases = None
    quant = kwargs.pop("quant", None)
    if fields.get("experts") is not None:
        return _build_mxfp4(cls, fields, quant, ep_group=ep_group, shared=shared, dispatch=dispatch, **kwargs)
    fp8 = _fp8_experts(block.experts, quant) if reader is not _read_gpt_oss else None
    gpt_oss = fields.get("gpt_oss_float")
    if fp8 is not None:  # transformers FP8Experts: kept as they are
        quant, fp8_scales = fp8
        gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
    elif gpt_oss is not None and quant is None:  # the float layer holds the converted weights
        gate_up, down, *expert_biases = from_gpt_oss_layout(*gpt_oss)
    elif gpt_oss is not None:  # converted one expert at a time (`_quantize_into`)
        gate_up, down = gpt_oss[0].transpose(1, 2), gpt_oss[1].transpose(1, 2)  # shapes only
        expert_biases = list(from_gpt_oss_layout(*(t[:, :0] for t in gpt_oss[:2]), *gpt_oss[2:])[2:])
    else:
        gate_up, down = _experts(block)
    num_experts, two_inter, hidden = gate_up.shape
    if num_experts != fields["router"].num_experts:
        raise ValueError(
            f"{type(block).__name__} routes over {fields['router'].num_experts} experts but "
            f"holds {num_experts}; an expert-parallel transformers block cannot be read"
        )
    bias = fields["correction_bias"]
    module = cls(
        fields["router"],
        hidden,
        two_inter // 2,
        shared_experts=fields["shared_experts"],
        shared_expert_gate=fields["shared_expert_gate"],
        shared=shared,
        ep_group=ep_group,
        dispatch=dispatch,
        activation=fields.get("activation") or _activation(block),
        correction_bias=bias is not None,
        router_dtype=fields["router_dtype"],
        dtype=None if quant is not None else gate_up.dtype,
        device=gate_up.device,
        expert_weights=None if quant is not None else (gate_up, down),
        quant=quant,
        expert_bias=expert_biases is not None,
        router_bias=fields.get("router_bias") is not None,
        **kwargs,
    )
    if fp8 is not None:
        module.load_routed_weights(gate_up, down, **fp8_scales)
    elif quant is not None and quant.format == "int4" and quant.checkpoint is not None:
        # The routed experts come from the INT4 checkpoint that ``quant.checkpoint`` names: the
        # block's float weights (random in a model built from its config) are not quantized,
        # the layer holds its zero weights until the load.
        pass
    elif gpt_oss is not None and quant is not None:
        _quantize_into(module, lambda e: from_gpt_oss_layout(*(t[e : e + 1] for t in gpt_oss))[:2], quant)
    elif quant is not None:
        _quantize_into(module, lambda e: (gate_up[e : e + 1], down[e : e + 1]), quant)
    module.router_weight = nn.Parameter(fields["router_weight"].detach(), requires_grad=False)
    module.router_compute_dtype = fields.get("router_compute_dtype")
    if fields.get("router_bias") is not None:
        module.router_bias = nn.Parameter(fields["router_bias"].detach(), requires_grad=False)
    if bias is not None:
        module.correction_bias = bias.detach().float()
    if expert_biases is not None:
        module.load_expert_biases(*expert_biases)
    # Saved and loaded under the block's names and layouts (see TransformersCheckpoint). FP8
    # layers save under moeroute's names (weights and scales together); they still load the
    # transformers and DeepSeek-V3 FP8 names (hf_keys.map_quantized_expert_keys).
    # INT4 layers whose quant names a checkpoint layout save and load its per-expert keys
    # (`moeroute.bindings.torch.int4_keys.Int4Checkpoint`).
    checkpoint = (
        fields["checkpoint"] if quant is None else int4_checkpoint_for(quant, fields["checkpoint"].shared_prefix)
    )
    if checkpoint is not None:
        module.checkpoint_format = checkpoint  # saved by MoE's state-dict post-hook
    return module


def _build_mxfp4(cls, fields, quant, **kwargs) -> MoE:
    """`_build` for experts stored as MXFP4 blocks and scale bytes (gpt-oss): the packed
    bytes are copied as they are (this rank's experts), never dequantized, one expert at a
    time with its gate rows put first: beyond the block's tensors and the module's, the
    peak is one expert's permuted gate_up blocks."""
    (gate_up, down, gate_up_bias, down_bias) = fields["experts"]
    if quant is not None and quant.format != "mxfp4":
        raise ValueError(
            f"quant={quant!r} differs from the block's MXFP4 experts; leave quant None or pass QuantConfig('mxfp4')"
        )
    quant = quant or QuantConfig("mxfp4")
    blocks = gate_up[0]
    num_experts, two_inter = blocks.shape[:2]
    if num_experts != fields["router"].num_experts:
        raise ValueError(
            f"the block routes over {fields['router'].num_experts} experts but holds {num_experts}; "
            "an expert-parallel transformers block cannot be read"
        )
    module = cls(
        fields["router"],
        blocks.shape[2] * 32,
        two_inter // 2,
        activation=fields["activation"],
        router_dtype=fields["router_dtype"],
        device=blocks.device,
        quant=quant,
        expert_bias=True,
        router_bias=fields.get("router_bias") is not None,
        **kwargs,
    )
    hidden, inter = module.routed_hidden_size, module.intermediate_size
    check_mxfp4_weights(quant, num_experts, hidden, inter, gate_up, down)
    order = gate_rows_first(two_inter, blocks.device)
    targets = module.experts.quantized_tensors()
    for local, e in enumerate(module.routed_expert_ids()):
        targets["w_gate_up"][local].copy_(gate_up[0][e].index_select(0, order))
        targets["gate_up_scale"][local].copy_(gate_up[1][e].index_select(0, order))
        targets["w_down"][local].copy_(down[0][e])
        targets["down_scale"][local].copy_(down[1][e])
    module.load_expert_biases(gate_up_bias.index_select(-1, order.to(gate_up_bias.device)), down_bias)
    module.router_weight = nn.Parameter(fields["router_weight"].detach(), requires_grad=False)
    if fields.get("router_bias") is not None:
        module.router_bias = nn.Parameter(fields["router_bias"].detach(), requires_grad=False)
    return module


# MoE.from_hf is attached here, beside the readers, so that moe.py never imports this module
# (the data flows one way, hf -> moe); importing the torch adapter imports this module.
MoE.from_hf = classmethod(_build)


class TupleOutputMoE(nn.Module):
    """A moeroute `MoE` standing in for a block whose forward returns ``(hidden_states,
    router_scores)`` (gpt-oss): returns ``(moe(hidden_states), None)``."""

    def __init__(self, moe: MoE) -> None:
        super().__init__()
        self.moe = moe
        # The block's checkpoint has no "moe." level: saved without it, loaded into it.
        self.register_state_dict_post_hook(_drop_moe_level)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        inner = prefix + "moe."
        for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
            state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        return self.moe(hidden_states, *args, **kwargs), None


def _drop_moe_level(module: TupleOutputMoE, state_dict: dict, prefix: str, local_metadata) -> None:
    inner = prefix + "moe."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)


def _model_types(model: nn.Module) -> set[str]:
    """``model_type`` of the model's config and of its text config (a multimodal model's)."""
    config = getattr(model, "config", None)
    types = {getattr(config, "model_type", None)}
    get_text_config = getattr(config, "get_text_config", None)
    if callable(get_text_config):
        types.add(getattr(get_text_config(), "model_type", None))
    return types - {None}


def _looks_like_moe_block(module: nn.Module) -> bool:
    """A module with an ``experts`` child beside a ``gate`` or ``router`` child: the shape of
    every transformers MoE block (and of a renamed one moeroute does not know yet)."""
    children = dict(module.named_children())
    return "experts" in children and ("gate" in children or "router" in children)


def _unsupported_blocks(model: nn.Module, targets: list[str]) -> list[tuple[str, str]]:
    """(name, class name) of the MoE-looking modules of ``model`` that are neither supported
    blocks nor inside one (nor moeroute's own modules)."""
    skipped = tuple(name + "." for name in targets)
    found = []
    for name, module in model.named_modules():
        if isinstance(module, (MoE, TupleOutputMoE)):
            skipped += (name + ".",)
        elif name and not name.startswith(skipped) and name not in targets and _looks_like_moe_block(module):
            found.append((name, type(module).__name__))
    return found


def replace_moe_blocks(model: nn.Module, strict: bool = False, **kwargs) -> int:
    """Swap every supported transformers MoE block inside ``model`` for a moeroute `MoE`.

    Parameters
    ----------
    model : nn.Module
        E.g. a ``*ForCausalLM``; modified in place.
    strict : bool
        What to do when a model of a supported family (its ``config.model_type`` is in
        `SUPPORTED_MODEL_TYPES`, or it holds a supported block) also holds MoE-looking
        modules (an ``experts`` child beside a ``gate`` or ``router``) that are not supported
        blocks, e.g. a block class transformers renamed: False warns (`UserWarning` naming
        the classes and modules) and replaces the supported blocks; True raises before
        anything is replaced.
    **kwargs
        Passed to `from_hf` (``ep_group``, ``shared``, ``dispatch``, ``scaling_regime``, ...).

    Returns
    -------
    int
        The number of blocks replaced.

    Notes
    -----
    One block at a time, each released before the next is read: at most one block's copied
    experts of extra memory. The patched model loads and saves transformers state dicts;
    it no longer records router logits. Details: docs/guide.md, "The torch module".

    Raises
    ------
    TypeError
        ``model`` is not an nn.Module; with ``strict=True``, unsupported MoE-looking blocks
        in a model of a supported family (the model is left unchanged).
    ValueError
        ``model`` is itself a supported MoE block: a swap in place cannot replace the
        caller's reference to it; use ``MoE.from_hf(block)`` (and assign the result).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool, got {type(strict).__name__}")
    if _reader_for(model) is not None:
        raise ValueError(
            f"model is itself a {type(model).__name__}, a supported MoE block: "
            "replace_moe_blocks swaps the blocks inside a model and cannot replace your "
            "reference to the block; build the layer with MoE.from_hf(block) instead"
        )
    # Names only: holding the blocks themselves would keep every original alive to the end.
    targets = [name for name, module in model.named_modules() if name and _reader_for(module) is not None]
    unsupported = _unsupported_blocks(model, targets)
    if unsupported and (targets or _model_types(model) & SUPPORTED_MODEL_TYPES):
        classes = sorted({cls for _, cls in unsupported})
        message = (
            f"replace_moe_blocks: {len(unsupported)} MoE block(s) of this model are not supported by moeroute "
            f"and keep transformers' forward: class {', '.join(classes)} at "
            f"{', '.join(name for name, _ in unsupported[:4])}{', ...' if len(unsupported) > 4 else ''} "
            f"({len(targets)} of {len(targets) + len(unsupported)} blocks are supported; "
            f"supported classes: {', '.join(SUPPORTED_BLOCKS)})"
        )
        if strict:
            raise TypeError(message + "; nothing was replaced")
        warnings.warn(message + "; pass strict=True to raise instead", UserWarning, stacklevel=2)
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        block = getattr(parent, child)
        tuple_output = _reader_for(block) is _read_gpt_oss
        replacement = from_hf(block, **kwargs)
        if tuple_output:  # gpt-oss blocks return (hidden_states, router_scores)
            replacement = TupleOutputMoE(replacement)
        del block
        setattr(parent, child, replacement)  # the last reference to the block goes here
        del replacement
    return len(targets)


# ------------------------------------------------------------------ experts interface

#: transformers experts module -> (key of the weights it was built from, LocalExperts
#: sharing those weights). Weak keys: the cache goes with the module.
_LOCAL_EXPERTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _local_experts(experts: nn.Module) -> LocalExperts:
    """A `LocalExperts` over ``experts``' own gate_up_proj / down_proj (no copy), rebuilt
    when the parameters are replaced (``model.to(...)``, a new Parameter)."""
    gate_up, down = experts.gate_up_proj, experts.down_proj
    key = tuple((w.data_ptr(), w.dtype, w.device, tuple(w.shape)) for w in (gate_up, down))
    cached = _LOCAL_EXPERTS.get(experts)
    if cached is not None and cached[0] == key:
        return cached[1]
    if (
        gate_up.dim() != 3
        or getattr(experts, "is_transposed", False)
        or not getattr(experts, "is_concatenated", True)
        or getattr(experts, "has_bias", False)
        or not getattr(experts, "has_gate", True)
    ):
        raise ValueError(
            f"{type(experts).__name__} stores transposed, interleaved, biased or ungated "
            "weights; the moeroute experts implementation reads gate_up_proj [N, 2I, H] "
            "(gate rows first) and down_proj [N, H, I] without bias"
        )
    name = getattr(getattr(experts, "config", None), "hidden_act", "silu")
    if name not in _HF_ACTIVATIONS:
        raise ValueError(
            f"{type(experts).__name__} uses hidden_act={name!r}; moeroute supports {sorted(_HF_ACTIVATIONS)}"
        )
    num_experts, two_inter, hidden = gate_up.shape
    local = LocalExperts(num_experts, hidden, two_inter // 2, _HF_ACTIVATIONS[name], weights=(gate_up, down))
    _LOCAL_EXPERTS[experts] = (key, local)
    return local


def experts_forward(
    experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts-implementation signature, computed by moeroute's expert kernels.

    Parameters
    ----------
    experts : nn.Module
        A transformers ``@use_experts_implementation`` experts module with stacked
        ``gate_up_proj`` [N, 2I, H] (gate rows first) and ``down_proj`` [N, H, I].
    hidden_states : Tensor [T, H], dtype of the expert weights
    top_k_index : Tensor [T, K], integer
        Expert of each slot; ids outside [0, N) (expert-parallel sentinels) are skipped.
    top_k_weights : Tensor [T, K], float
        Routing weight of each slot.

    Returns
    -------
    Tensor [T, H], dtype of ``hidden_states``: ``sum_k w_k * expert_k(x)``, accumulated
    in float32.

    Raises
    ------
    ValueError
        Transposed, interleaved, biased or ungated expert weights; an activation moeroute
        does not have.
    """
    local = _local_experts(experts)
    ids = top_k_index.to(torch.int32).contiguous()
    weights = top_k_weights.to(torch.float32).contiguous()
    with torch.no_grad():  # moeroute's experts are inference-only
        out = local(hidden_states.contiguous(), weights, ids)
    return out.to(hidden_states.dtype)


def register_experts_implementation(name: str = EXPERTS_IMPLEMENTATION) -> str:
    """Register moeroute in transformers' experts interface (``ALL_EXPERTS_FUNCTIONS``).

    Afterwards a model selects it like any other implementation, without its modules
    being replaced: ``AutoModelForCausalLM.from_pretrained(..., experts_implementation=
    "moeroute")``, ``model.set_experts_implementation("moeroute")``, or
    ``config._experts_implementation = "moeroute"``. Only the expert computation changes;
    the model's own router, shared experts and weights stay. Idempotent.

    Returns
    -------
    str
        ``name``.

    Raises
    ------
    ImportError
        transformers (>= 5, with ``transformers.integrations.moe``) is not installed.
    """
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(name, experts_forward)
    return name
