"""The MoE layer as a torch module: routing, shared-expert ownership, dispatch, experts, combine.

One forward, one direction (docs/semantics.md sections 3, 5 and 8)::

    router logits (float32) -> select_experts -> shared gate g -> append_shared_slots
    (fused: slot weight = layout.shared_slot_weight(g, rsf)) -> dispatcher.dispatch
    (async when overlap) -> [overlap: shared MLP while the transfer is in flight]
    -> local experts -> dispatcher.combine -> ("output" regime: * rsf)
    -> routed_output_transform -> + shared (runner / overlap)

Who computes the shared expert is decided once, by `moeroute.layout.ExpertLayout`
(``self.layout.shared``); every branch below reads that one field, so each token's shared
contribution is computed exactly once in every mode.

Parameters and buffers (``requires_grad=False``; N experts, L held here, H' the routed input
size, H unless a routed_input_transform maps to a smaller one):

* ``router_weight`` [N, H]; ``router_bias`` [N] (gpt-oss), its dtype; ``correction_bias``
  [N] float32 (DeepSeek-V3 ``e_score_correction_bias``, selection only), float32 under every
  dtype change.
* ``experts.w_gate_up`` [L, 2I, H'] (gate rows first) and ``experts.w_down`` [L, H', I], the
  Hugging Face stacked layout; with a fused shared expert the last S of the L are its slots.
  ``experts.b_gate_up`` [L, 2I] and ``experts.b_down`` [L, H'] with ``expert_bias``.
* ``shared_experts`` / ``shared_expert_gate``: the given modules (fused keeps only the gate).

The router's dtypes, the forward's dtypes, loading and saving under transformers names,
inference only, and the custom op a tracer sees: docs/guide.md, "The torch module" and
"torch.compile / torch.export / custom ops". ``MoE.from_hf`` is attached by
`moeroute.bindings.torch.hf`, which imports this module (never the other way round).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import nn

from moeroute._validate import integer
from moeroute.bindings.torch import arrays, ops
from moeroute.bindings.torch.dispatch import Dispatcher, LocalDispatcher, ep_dispatcher_factory
from moeroute.experts.formats.fp8 import (
    check_dispatch_quant,
    check_quantized_weights,
    quantize_for_dispatch,
)
from moeroute.experts.activations import apply_activation, check_activation
from moeroute.experts.choose import check_strategy, format_of
from moeroute.experts.formats.unquantized import (
    SUPPORTED_DTYPES,
    check_dtype,
)
from moeroute.bindings.torch.group import check_ranks_agree, ep_group_size_and_rank, layout_fingerprint
from moeroute.bindings.torch.hf_keys import map_transformers_keys, save_in_checkpoint_format
from moeroute.bindings.torch.hf_keys import split_slots as _split_slots
from moeroute.bindings.torch.load_window import DEFAULT_LOAD_WINDOW, LoadRecorder, check_window
from moeroute.experts.formats.mxfp4 import check_mxfp4_weights
from moeroute.experts.formats.int4 import check_int4_weights
from moeroute.experts.modules import LocalExperts, QuantizedExperts
from moeroute.bindings.torch.placement_guard import PlacementGuard
from moeroute.config import RouterConfig
from moeroute.layout import EP_DISPATCH_MODES, SCALING_REGIMES, SHARED_MODES, ExpertLayout
from moeroute.quant import QuantConfig, dequantize_fp8_block, dequantize_fp8_tensor, quantize_experts, quantize_int4

__all__ = ["MoE", "shared_mlp_slots", "SUPPORTED_DEVICES"]

#: Device types the forward serves: NumPy/Numba on the CPU, Numba CUDA + CuPy on CUDA.
SUPPORTED_DEVICES = ("cpu", "cuda")
#: Probe points for checking that a shared MLP's activation is the experts' activation.
_ACTIVATION_PROBE = torch.linspace(-6.0, 6.0, steps=25)
#: Float32 slack when comparing the probe (the two functions should agree bit for bit).
_ACTIVATION_PROBE_ATOL = 1e-6


def _linear_weight(module: nn.Module, name: str, out_features: int | None, in_features: int):
    """``module.<name>.weight`` when it is a bias-free nn.Linear of the expected shape."""
    layer = getattr(module, name, None)
    if not isinstance(layer, nn.Linear):
        return None, f"shared_experts.{name} is not an nn.Linear"
    if layer.bias is not None:
        return None, f"shared_experts.{name} has a bias, which expert slots do not carry"
    if layer.in_features != in_features or (out_features is not None and layer.out_features != out_features):
        return None, (
            f"shared_experts.{name} maps {layer.in_features} -> {layer.out_features}, "
            f"expected {in_features} -> {out_features if out_features is not None else '?'}"
        )
    return layer.weight, None


def shared_mlp_slots(shared_experts: nn.Module, hidden_size: int, intermediate_size: int, activation: str):
    """How a shared MLP splits into expert slots of the routed intermediate size.

    A gated MLP ``down(act(gate(x)) * up(x))`` of intermediate size S*I is exactly the sum of
    S MLPs of size I (the product is elementwise over the intermediate dimension).

    Parameters
    ----------
    shared_experts : nn.Module
        Expected: bias-free nn.Linear layers ``gate_proj`` [S*I, H], ``up_proj`` [S*I, H],
        ``down_proj`` [H, S*I] and an ``act_fn`` equal to ``activation`` (when present).
    hidden_size, intermediate_size : int
        H and the routed I.
    activation : str

    Returns
    -------
    num_slots : int
        S (1 when the MLP does not split).
    reason : str or None
        Why the MLP cannot become expert slots; None when it can.
    """
    gate, reason = _linear_weight(shared_experts, "gate_proj", None, hidden_size)
    if reason is None:
        total = gate.shape[0]
        _, reason = _linear_weight(shared_experts, "up_proj", total, hidden_size)
    if reason is None:
        _, reason = _linear_weight(shared_experts, "down_proj", hidden_size, total)
    if reason is None and total % intermediate_size:
        reason = (
            f"the shared MLP's intermediate size {total} is not a multiple of the routed "
            f"intermediate_size={intermediate_size}, so it does not split into slots"
        )
    if reason is None and activation == "swigluoai":
        # swigluoai has no gate-only form to probe: the MLP must say it uses it.
        if getattr(shared_experts, "activation", None) != "swigluoai":
            reason = (
                "the shared MLP does not declare activation='swigluoai' (the experts' "
                "activation), so it cannot be checked to split into slots"
            )
    elif reason is None:
        act_fn = getattr(shared_experts, "act_fn", None)
        if act_fn is not None:
            probe = _ACTIVATION_PROBE.to(gate.device)
            try:
                same = torch.allclose(
                    act_fn(probe), apply_activation(probe, activation), atol=_ACTIVATION_PROBE_ATOL, rtol=0
                )
            except Exception:  # an act_fn that cannot take a float32 vector is not ours to fuse
                same = False
            if not same:
                reason = (
                    f"the shared MLP's act_fn ({type(act_fn).__name__}) is not the experts' activation {activation!r}"
                )
    if reason is not None:
        return 1, reason + (
            "" if reason.startswith("the shared") else " (fusing needs a gated MLP with gate_proj/up_proj/down_proj)"
        )
    return total // intermediate_size, None


def linear_float_weight(linear: nn.Module) -> torch.Tensor:
    """A linear layer's weight in float32, dequantized when it is an FP8 linear (float8_e4m3fn
    ``weight`` with ``weight_scale_inv`` per ``block_size`` block, or one scale)."""
    weight = linear.weight
    if weight.dtype != torch.float8_e4m3fn:
        return weight.float()
    scale = getattr(linear, "weight_scale_inv", None)
    if scale is None:
        raise ValueError(f"{type(linear).__name__} holds a float8_e4m3fn weight without weight_scale_inv")
    block = getattr(linear, "block_size", None)
    if block is None or scale.numel() == 1:
        return dequantize_fp8_tensor(weight, scale.reshape(()))
    return dequantize_fp8_block(weight, scale, tuple(block))


def _runs_as_inference(forward):
    """Run ``forward`` under ``torch.no_grad()`` after `MoE._check_inference`: the layer is
    inference-only whatever its parameters' ``requires_grad``."""

    @functools.wraps(forward)
    def run(self, hidden_states, router_logits=None):
        self._check_inference(hidden_states, router_logits)
        with torch.no_grad():
            return forward(self, hidden_states, router_logits)

    return run


def _check_module(name: str, value) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"{name} must be an nn.Module (or callable) or None, got {type(value).__name__}")


class MoE(nn.Module):
    """A Mixture-of-Experts layer: routing, shared experts, dispatch, expert GEMMs, combine.

    Parameters
    ----------
    router : moeroute.config.RouterConfig
        N, K, scoring, grouping, renormalization and rsf.
    hidden_size : int
        H.
    intermediate_size : int
        I, one routed expert's intermediate size.
    shared_experts : nn.Module, optional
        The shared MLP, ``[T, H] -> [T, H]``. It can be fused into S expert slots when it is a
        gated MLP (``gate_proj``/``up_proj``/``down_proj``) of intermediate size S*I.
    shared_expert_gate : nn.Module, optional
        ``[T, H] -> [T, 1]``; the shared output is multiplied by ``sigmoid(gate(x))``.
    shared : {"auto", "runner", "overlap", "fused"}
        Who computes the shared expert (docs/semantics.md section 3); resolved once into ``self.layout``.
    ep_group : torch.distributed.ProcessGroup, optional
        Expert-parallel group: the module holds only its rank's experts and dispatches through
        ``dispatcher_factory``; construction is a collective (`ep_fingerprint`). None: one rank.
    dispatch : {"all2all", "allgather"}
        Dispatch mode with ``ep_group``; without one nothing is dispatched (layout
        dispatch "none").
    activation : {"silu", "gelu", "gelu_tanh", "swigluoai"}
        "swigluoai" is gpt-oss's clamped SwiGLU (`moeroute.experts.activations.gated_activation`).
    routed_input_transform, routed_output_transform : nn.Module, optional
        Latent MoE: map the hidden states to the routed experts' input size H' and the
        routed sum back to H. The router and shared experts see the original hidden states.
        Either one makes "fused" impossible.
    scaling_regime : {"router", "output"}
        "router": rsf is folded into the routed weights; "output": routing uses rsf = 1 and
        the combined routed sum is multiplied by rsf.
    num_redundant_experts : int
        R replica experts (EPLB), placed as in docs/semantics.md section 2.
    routed_hidden_size : int, optional
        H'; default H, or ``routed_input_transform.out_features`` when it has one.
    correction_bias : bool
        Register a ``correction_bias`` [N] float32 buffer (zeros) used for selection.
    router_dtype : torch.dtype
        Dtype of ``router_weight`` (float32 by default).
    gemm : {"auto", "loop", "padded", "rows"}
        CPU expert-GEMM strategy (see `moeroute.experts.formats.unquantized`).
    expert_bias : bool
        Experts carry a gate_up bias [2I] and a down bias [H] each (gpt-oss); load them with
        `load_routed_weights` (``gate_up_bias``, ``down_bias``).
    router_bias : bool
        The router linear has a bias [N] (gpt-oss): ``logits = x @ router_weight^T + router_bias``.
    apply_router_weight_on_input : bool
        Multiply each token's routed input row by its router weight before the experts and
        combine with weight 1 (vLLM's Llama 4 path). Needs ``router.top_k == 1``; the shared
        expert still sees the unscaled input, so it is never fused.
    placement : {"linear", "round_robin"}
    physical_to_logical : array_like of int [P], optional
        Expert placement over the EP ranks (`moeroute.layout.ExpertLayout`); a table sets
        the redundant experts itself (leave ``num_redundant_experts`` 0).
    record_load : bool
        Count tokens per physical expert over the last ``load_window`` forwards
        (`moeroute.bindings.torch.load_window.LoadRecorder`, docs/eplb.md).
    load_window : int
        Forwards per load window (default 128).
    dispatcher_factory : callable, optional
        ``factory(layout, ep_group, dispatch) -> Dispatcher`` building the dispatcher with
        ``ep_group``; default `moeroute.bindings.ep.make_dispatcher` (all2all, allgather).
    dtype, device
        Of the expert weights; the activations must match.
    quant : moeroute.quant.QuantConfig, optional
        Keep the routed experts quantized (docs/quant.md): FP8 (float8_e4m3fn weights,
        float32 scales), ``QuantConfig("mxfp4")`` (gpt-oss's uint8 blocks and scale bytes) or
        ``QuantConfig("int4", group_size=, symmetric=)`` (w4a16 with group scales);
        ``gemm`` then names the quantized CPU strategy ("auto", "rows", "blocks"). The shared
        experts stay as given; fused shared slots take the same config.
    dispatch_dtype : {None, "auto", "fp8"}
        How the routed input rows travel with ``ep_group``: None/"auto" in the activation
        dtype; "fp8" (FP8 experts with dynamic activation scales) as e4m3 values and float32
        scales, quantized once as the first GEMM would (docs/quant.md, FP8 dispatch).
    expert_weights : (Tensor [N, 2I, H'], Tensor [N, H', I]), optional
        The full stacked routed weights (the transformers layout) to take this rank's experts
        from: shared, not copied, when the module holds exactly these N experts in ``dtype``
        on ``device`` (one rank, no replicas, no fused shared slots).

    Raises
    ------
    TypeError
        ``router`` not a RouterConfig; a module argument that is not callable; ``ep_group``
        not a torch.distributed ProcessGroup.
    moeroute.bindings.torch.group.RankMismatchError
        With ``ep_group``: the ranks disagree on a field of `ep_fingerprint`; raised on
        every rank with the same message naming each field and each rank's value.
    ValueError
        Sizes below 1; an unknown shared, dispatch, activation or scaling_regime; a shared
        gate without shared experts; an unsupported dtype or device;
        ``apply_router_weight_on_input`` with top_k != 1; a non-bool flag; a
        ``dispatch_dtype`` other than None/"auto"/"fp8", or "fp8" on a float layer, with static
        activation scales, or with a dispatcher that does not carry FP8 rows.
    moeroute.layout.LayoutError
        A layout that cannot work, e.g. an explicit ``shared="fused"`` with a
        routed_input_transform or with a shared MLP that does not split into slots.
    """

    def __init__(
        self,
        router: RouterConfig,
        hidden_size: int,
        intermediate_size: int,
        shared_experts: nn.Module | None = None,
        shared_expert_gate: nn.Module | None = None,
        shared: str = "auto",
        ep_group=None,
        dispatch: str = "all2all",
        activation: str = "silu",
        routed_input_transform: nn.Module | None = None,
        routed_output_transform: nn.Module | None = None,
        *,
        scaling_regime: str = "router",
        num_redundant_experts: int = 0,
        routed_hidden_size: int | None = None,
        correction_bias: bool = False,
        router_dtype: torch.dtype = torch.float32,
        gemm: str = "auto",
        dtype: torch.dtype | None = None,
        device=None,
        expert_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
        expert_bias: bool = False,
        router_bias: bool = False,
        apply_router_weight_on_input: bool = False,
        placement: str = "linear",
        physical_to_logical=None,
        record_load: bool = False,
        load_window: int = DEFAULT_LOAD_WINDOW,
        dispatcher_factory=None,
        quant: QuantConfig | None = None,
        dispatch_dtype: str | None = None,
    ) -> None:
        super().__init__()
        # The key by which torch.ops.moeroute.moe_forward finds this layer (see forward).
        self.layer_key = ops.register_layer(self)
        if not isinstance(router, RouterConfig):
            raise TypeError(f"router must be a moeroute RouterConfig, got {type(router).__name__}")
        hidden_size = integer("hidden_size", hidden_size, 1)
        intermediate_size = integer("intermediate_size", intermediate_size, 1)
        for name, value in (
            ("shared_experts", shared_experts),
            ("shared_expert_gate", shared_expert_gate),
            ("routed_input_transform", routed_input_transform),
            ("routed_output_transform", routed_output_transform),
        ):
            _check_module(name, value)
        if shared_expert_gate is not None and shared_experts is None:
            raise ValueError("shared_expert_gate was given without shared_experts; pass both or neither")
        if not isinstance(shared, str) or shared not in SHARED_MODES:
            raise ValueError(f"shared={shared!r} is not a shared mode; use one of {SHARED_MODES}")
        if not isinstance(scaling_regime, str) or scaling_regime not in SCALING_REGIMES:
            raise ValueError(f"scaling_regime={scaling_regime!r} is unknown; use one of {SCALING_REGIMES}")
        if not isinstance(dispatch, str) or dispatch not in EP_DISPATCH_MODES:
            raise ValueError(
                f"dispatch={dispatch!r} is not an expert-parallel dispatch mode; use one of "
                f"{EP_DISPATCH_MODES} (it only matters with an ep_group)"
            )
        activation = check_activation(activation)
        for name, value in (
            ("expert_bias", expert_bias),
            ("router_bias", router_bias),
            ("apply_router_weight_on_input", apply_router_weight_on_input),
        ):
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} must be a bool")
        if quant is not None and not isinstance(quant, QuantConfig):
            raise TypeError(f"quant must be a moeroute.quant.QuantConfig or None, got {type(quant).__name__}")
        if quant is not None and expert_bias and quant.format != "mxfp4":
            raise ValueError(
                f"expert_bias=True is not served with quant={quant.format!r} (FP8 experts carry no biases)"
            )
        if quant is not None and expert_weights is not None:
            raise ValueError(
                "expert_weights takes float weights; with quant, load the FP8 experts and their "
                "scales with load_routed_weights(w_gate_up, w_down, gate_up_scale=..., "
                "down_scale=...)"
            )
        self.dispatch_dtype = check_dispatch_quant(dispatch_dtype, quant)
        check_strategy("gemm", gemm, format_of(quant))
        if apply_router_weight_on_input and router.top_k != 1:
            raise ValueError(
                f"apply_router_weight_on_input=True needs top_k=1 (one weight per input row), got top_k={router.top_k}"
            )
        dtype = torch.get_default_dtype() if dtype is None else dtype
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype={dtype} is not supported; use one of {SUPPORTED_DTYPES}")
        if router_dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"router_dtype={router_dtype} is not supported; use one of {SUPPORTED_DTYPES}")
        if device is not None and torch.device(device).type not in SUPPORTED_DEVICES + ("meta",):
            raise ValueError(f"device={device} is not supported; use one of {SUPPORTED_DEVICES}")
        if routed_hidden_size is None:
            routed_hidden_size = getattr(routed_input_transform, "out_features", hidden_size)
        routed_hidden_size = integer("routed_hidden_size", routed_hidden_size, 1)
        if routed_input_transform is None and routed_output_transform is None and routed_hidden_size != hidden_size:
            raise ValueError(
                f"routed_hidden_size={routed_hidden_size} differs from hidden_size={hidden_size} "
                "but no routed_input_transform/routed_output_transform maps between them"
            )

        # The shared expert's slot count and whether it can be fused: the layout decides.
        num_shared, unfusable = 0, None
        if shared_experts is not None:
            num_shared, unfusable = shared_mlp_slots(shared_experts, hidden_size, intermediate_size, activation)
            if routed_input_transform is not None or routed_output_transform is not None:
                unfusable = (
                    "a routed_input_transform/routed_output_transform is set, and the shared "
                    "expert needs the untransformed hidden states"
                )
            elif apply_router_weight_on_input:
                unfusable = (
                    "apply_router_weight_on_input scales the routed input rows, and the shared "
                    "expert needs the unscaled hidden states"
                )
            elif quant is not None and quant.activation == "static":
                unfusable = (
                    "quant activation='static' needs given activation scales for every expert "
                    "slot, and the shared MLP has none"
                )

        if ep_group is None:
            ep_size, rank, layout_dispatch = 1, 0, "none"
        else:
            (ep_size, rank), layout_dispatch = ep_group_size_and_rank(ep_group), dispatch
        self.layout = ExpertLayout(
            router.num_experts,
            num_shared,
            ep_size=ep_size,
            dispatch=layout_dispatch,
            shared=shared,
            num_redundant_experts=num_redundant_experts,
            scaling_regime=scaling_regime,
            unfusable_reason=unfusable,
            placement=placement,
            physical_to_logical=physical_to_logical,
        )
        self.apply_router_weight_on_input = apply_router_weight_on_input
        self.rank = rank
        self.router = router
        # "output" regime: route with rsf = 1, scale the combined routed sum afterwards.
        self._selection_router = (
            router if scaling_regime == "router" else dataclasses.replace(router, routed_scaling_factor=1.0)
        )
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.routed_hidden_size = routed_hidden_size
        self.num_shared_experts = num_shared
        self.activation = activation

        self.router_weight = nn.Parameter(
            torch.empty(router.num_experts, hidden_size, dtype=router_dtype, device=device),
            requires_grad=False,
        )
        nn.init.normal_(self.router_weight, std=0.02)
        #: The dtype the router logits are computed in; None: router_weight's own dtype (it
        #: follows the module's dtype changes). ``from_hf`` sets float32 for the blocks whose
        #: router upcasts its bfloat16 weight (DeepSeek-V3, GLM-4-MoE).
        self.router_compute_dtype = None
        self.register_buffer(
            "correction_bias",
            torch.zeros(router.num_experts, dtype=torch.float32, device=device) if correction_bias else None,
        )
        self.router_bias = None
        if router_bias:
            self.router_bias = nn.Parameter(
                torch.zeros(router.num_experts, dtype=router_dtype, device=device), requires_grad=False
            )
        local_experts = self.layout.num_local_experts(rank)
        self.quant = quant
        if quant is not None:
            # FP8 experts: the format is data; the layout above already decided the plan.
            self.experts = QuantizedExperts(
                local_experts,
                routed_hidden_size,
                intermediate_size,
                activation,
                quant=quant,
                device=device,
                strategy=gemm,
                bias=expert_bias,
            )
        elif expert_weights is not None and self._can_alias(expert_weights, dtype, device):
            # This rank holds exactly the given experts: share their memory, copy nothing.
            self.experts = LocalExperts(
                local_experts,
                routed_hidden_size,
                intermediate_size,
                activation,
                gemm=gemm,
                bias=expert_bias,
                weights=tuple(expert_weights),
            )
        else:
            self.experts = LocalExperts(
                local_experts,
                routed_hidden_size,
                intermediate_size,
                activation,
                gemm=gemm,
                bias=expert_bias,
                dtype=dtype,
                device=device,
            )
            if expert_weights is not None:
                self.load_routed_weights(*expert_weights)
        self.shared_expert_gate = shared_expert_gate
        self.routed_input_transform = routed_input_transform
        self.routed_output_transform = routed_output_transform
        if self.layout.shared == "fused":
            # The shared MLP lives on as S expert slots; the module itself is never called.
            self.shared_experts = None
            self.load_shared_weights(shared_experts)
        else:
            self.shared_experts = shared_experts

        if ep_group is None:
            self.dispatcher: Dispatcher = LocalDispatcher(self.layout)
        else:
            # Once, here rather than on the first forward: a disagreement surfaces where the
            # layers are built, and the forward stays free of extra collectives.
            check_ranks_agree(self.ep_fingerprint(), ep_group, "the MoE layer")
            factory = dispatcher_factory or ep_dispatcher_factory()
            self.dispatcher = factory(self.layout, ep_group, dispatch)
            if self.dispatch_dtype == "fp8" and not getattr(self.dispatcher, "carries_fp8", False):
                raise ValueError(
                    f"dispatch_dtype='fp8' needs a dispatcher that carries FP8 rows "
                    f"(carries_fp8 = True); {type(self.dispatcher).__name__} does not"
                )
        # EPLB (moeroute.eplb): the load window, and a placement swap waiting for its forward.
        if not isinstance(record_load, bool):
            raise ValueError(f"record_load={record_load!r} must be a bool")
        self.load_recorder = LoadRecorder(check_window(load_window)) if record_load else None
        self.pending_placement = None
        # Forwards share the placement; an EPLB swap waits for those in flight (eplb.live).
        self.placement_guard = PlacementGuard()
        # state_dict() saves under checkpoint_format's names when one is set (from_hf sets it).
        self.register_state_dict_post_hook(save_in_checkpoint_format)

    def ep_fingerprint(self) -> dict:
        """The fields every rank of an expert-parallel group must agree on (plain values):
        the layout, every router field, the sizes, dtypes, activation and the optional
        parts. Exchanged once at construction with ``ep_group``."""
        fields = layout_fingerprint(self.layout)
        fields.update({f"router.{name}": value for name, value in dataclasses.asdict(self.router).items()})
        fields.update(
            {
                "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size,
                "routed_hidden_size": self.routed_hidden_size,
                "dtype": str(self.experts.w_gate_up.dtype),
                "router_dtype": str(self.router_weight.dtype),
                "activation": self.activation,
                "correction_bias": self.correction_bias is not None,
                "shared_expert_gate": self.shared_expert_gate is not None,
                "routed_input_transform": self.routed_input_transform is not None,
                "routed_output_transform": self.routed_output_transform is not None,
                "expert_bias": self.experts.b_gate_up is not None,
                "router_bias": self.router_bias is not None,
                "apply_router_weight_on_input": self.apply_router_weight_on_input,
                "quant": repr(self.quant),
                "dispatch_dtype": self.dispatch_dtype,
            }
        )
        return fields

    # ----------------------------------------------------------------- weights

    def _can_alias(self, expert_weights, dtype, device) -> bool:
        """True when the local experts are exactly the rows of ``expert_weights``, in
        order, in the requested dtype and device: no fused shared slots, no replicas, and
        one rank holding all N (a rank's slice would keep the whole tensor alive)."""
        gate_up, down = expert_weights
        n = self.router.num_experts
        return (
            self.layout.num_local_experts(self.rank) == n
            and self.layout.shared != "fused"
            and self.routed_expert_ids() == list(range(n))
            and isinstance(gate_up, torch.Tensor)
            and isinstance(down, torch.Tensor)
            and gate_up.dtype == down.dtype == dtype
            and gate_up.device == down.device
            and (device is None or gate_up.device == torch.device(device))
            and tuple(gate_up.shape) == (n, 2 * self.intermediate_size, self.routed_hidden_size)
            and tuple(down.shape) == (n, self.routed_hidden_size, self.intermediate_size)
        )

    def shares_weights_with(self, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> bool:
        """True when the expert parameters alias (share the memory of) these tensors."""
        return (
            self.experts.w_gate_up.data_ptr() == w_gate_up.data_ptr()
            and self.experts.w_down.data_ptr() == w_down.data_ptr()
        )

    def routed_expert_ids(self) -> list[int]:
        """Logical expert id of each routed local expert of this rank (replicas included)."""
        start, count = self.layout.routed_range(self.rank)
        logical = self.layout.physical_to_logical
        return [int(logical[p]) for p in range(start, start + count)]

    def pack_cpu_weights(self, enable: bool = True) -> "MoE":
        """Pack the expert weights now into oneDNN copies for CPU forwards (opt-in: a
        second copy of the expert weights in memory). Explicit: the copies are a snapshot;
        re-pack after changing the weights (a change torch can see makes the next CPU
        forward raise; a write through ``.data`` is not seen). See
        `moeroute.bindings.torch.LocalExperts.pack_cpu_weights`. Returns ``self``."""
        self.experts.pack_cpu_weights(enable)
        return self

    @torch.no_grad()
    def load_routed_weights(
        self,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
        *,
        gate_up_scale: torch.Tensor | None = None,
        down_scale: torch.Tensor | None = None,
        input_scale: torch.Tensor | None = None,
    ) -> None:
        """Copy this rank's routed experts out of the full stacked weights.

        With ``quant``, the weights are float8_e4m3fn and stay so (this rank's experts are
        copied, never dequantized), and the scales are required.

        Parameters
        ----------
        w_gate_up : Tensor [N, 2I, H'] (gate rows first), any float dtype/device
            (float8_e4m3fn with ``quant``)
        w_down : Tensor [N, H', I]
        gate_up_scale : Tensor float32, with ``quant`` only
            fp8_block: [N, 2*ceil(I/bn), ceil(H'/bk)] (the gate's block rows, then the up's);
            fp8_tensor: [N, 2] (gate, up).
        down_scale : Tensor float32, with ``quant`` only
            fp8_block: [N, ceil(H'/bn), ceil(I/bk)]; fp8_tensor: [N].
        input_scale : Tensor [N, 2] float32, with ``activation="static"`` only
            The static activation scales of the gate_up and down inputs.
        gate_up_bias : Tensor [N, 2I] (gate entries first), optional
            Only with ``expert_bias=True``; None leaves the current biases.
        With ``quant=QuantConfig("mxfp4")``, ``w_gate_up`` = (blocks uint8 [N, 2I, H'/32, 16],
        scales uint8 [N, 2I, H'/32]) (gate rows first) and ``w_down`` = (blocks [N, H', I/32,
        16], scales [N, H', I/32]) (`moeroute.quant.mxfp4`), copied packed; no ``*_scale``.
        With ``quant=QuantConfig("int4", group_size=g, symmetric=...)``, each weight is what
        `moeroute.quant.quantize_int4` returns: (packed uint8 [N, 2I, H'/2], scales [N, 2I,
        H'/g][, zeros uint8 [N, 2I, H'/g]]) and (packed [N, H', I/2], scales [N, H', I/g][,
        zeros]), zeros exactly when not symmetric; no ``*_scale``, no biases.
        down_bias : Tensor [N, H'], optional
            Only with ``expert_bias=True``; None leaves the current biases.

        Raises
        ------
        ValueError
            Shapes other than the above; a bias given to a module built without
            ``expert_bias=True``.
        """
        n, inter, hid = self.router.num_experts, self.intermediate_size, self.routed_hidden_size
        if self.quant is not None and self.quant.format == "int4":
            for name, value in (
                ("gate_up_scale", gate_up_scale),
                ("down_scale", down_scale),
                ("input_scale", input_scale),
                ("gate_up_bias", gate_up_bias),
                ("down_bias", down_bias),
            ):
                if value is not None:
                    raise ValueError(
                        f"{name} was given but quant='int4' takes each weight as quantize_int4 returns it: "
                        "w_gate_up=(packed, scales[, zeros]), w_down=(packed, scales[, zeros]), no biases"
                    )
            tensors = check_int4_weights(self.quant, n, hid, inter, w_gate_up, w_down)
            for name in ("gate_up_scale", "down_scale"):
                self.experts.hold_int4_scales(name, tensors[name].dtype)
            targets = self.experts.quantized_tensors()
            self._copy_expert_rows([(targets[name], tensor) for name, tensor in tensors.items()])
            self.experts.gate_up_perm = None  # the given weights are in the hidden columns' order
            return
        if self.quant is not None and self.quant.format == "mxfp4":
            for name, scale in (
                ("gate_up_scale", gate_up_scale),
                ("down_scale", down_scale),
                ("input_scale", input_scale),
            ):
                if scale is not None:
                    raise ValueError(
                        f"{name} was given but quant='mxfp4' takes each weight as a (blocks, "
                        "scales) pair: w_gate_up=(blocks, scales), w_down=(blocks, scales)"
                    )
            tensors = check_mxfp4_weights(self.quant, n, hid, inter, w_gate_up, w_down)
            targets = self.experts.quantized_tensors()
            pairs = [(targets[name], tensor) for name, tensor in tensors.items()]
            self._copy_expert_rows(pairs + self._bias_pairs(gate_up_bias, down_bias))
            return
        if self.quant is not None:
            if gate_up_bias is not None or down_bias is not None:
                raise ValueError("gate_up_bias/down_bias were given but FP8 experts carry no biases")
            tensors = check_quantized_weights(
                self.quant, n, hid, inter, w_gate_up, w_down, gate_up_scale, down_scale, input_scale
            )
            targets = self.experts.quantized_tensors()
            self._copy_expert_rows([(targets[name], tensor) for name, tensor in tensors.items()])
            return
        for name, scale in (("gate_up_scale", gate_up_scale), ("down_scale", down_scale), ("input_scale", input_scale)):
            if scale is not None:
                raise ValueError(
                    f"{name} was given but this layer holds float experts; build it with "
                    "quant=QuantConfig(...) to keep FP8 weights"
                )
        if tuple(w_gate_up.shape) != (n, 2 * inter, hid):
            raise ValueError(
                f"w_gate_up has shape {tuple(w_gate_up.shape)}, expected [N, 2I, H'] = {[n, 2 * inter, hid]}"
            )
        if tuple(w_down.shape) != (n, hid, inter):
            raise ValueError(f"w_down has shape {tuple(w_down.shape)}, expected [N, H', I] = {[n, hid, inter]}")
        pairs = [(self.experts.w_gate_up, w_gate_up), (self.experts.w_down, w_down)]
        self._copy_expert_rows(pairs + self._bias_pairs(gate_up_bias, down_bias))

    @torch.no_grad()
    def load_expert_biases(
        self, gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None
    ) -> None:
        """Copy this rank's routed expert biases out of the full stacked biases.

        Parameters
        ----------
        gate_up_bias : Tensor [N, 2I] (gate entries first), optional
        down_bias : Tensor [N, H'], optional

        Raises
        ------
        ValueError
            Shapes other than the above; a module built without ``expert_bias=True``.
        """
        self._copy_expert_rows(self._bias_pairs(gate_up_bias, down_bias))

    def _bias_pairs(self, gate_up_bias, down_bias) -> list:
        """(target parameter, source) of the given biases, shapes checked."""
        n, inter, hid = self.router.num_experts, self.intermediate_size, self.routed_hidden_size
        pairs = []
        for name, bias, shape, target in (
            ("gate_up_bias", gate_up_bias, (n, 2 * inter), self.experts.b_gate_up),
            ("down_bias", down_bias, (n, hid), self.experts.b_down),
        ):
            if bias is None:
                continue
            if target is None:
                raise ValueError(
                    f"{name} was given but the module has no expert biases; build it with expert_bias=True"
                )
            if tuple(bias.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(bias.shape)}, expected {list(shape)}")
            pairs.append((target, bias))
        return pairs

    def _copy_expert_rows(self, pairs) -> None:
        """Copy this rank's routed rows of each (target, full source) pair."""
        ids = self.routed_expert_ids()
        if ids == list(range(ids[0], ids[0] + len(ids))):  # no replicas: one block copy
            rows = slice(ids[0], ids[0] + len(ids))
            for target, source in pairs:
                target[: len(ids)].copy_(source[rows])
            return
        for local, logical in enumerate(ids):
            for target, source in pairs:
                target[local].copy_(source[logical])

    @torch.no_grad()
    def load_shared_weights(self, shared_experts: nn.Module) -> None:
        """Copy a gated shared MLP into this rank's S fused expert slots.

        Slot j gets intermediate rows/columns ``[j*I, (j+1)*I)`` of gate_proj, up_proj and
        down_proj. Only meaningful when ``self.layout.shared == "fused"``.

        Raises
        ------
        ValueError
            The layout does not fuse the shared expert.
        """
        if self.layout.shared != "fused":
            raise ValueError(f"load_shared_weights needs a fused layout; this one is shared={self.layout.shared!r}")
        inter, s = self.intermediate_size, self.num_shared_experts
        _, first = self.layout.routed_range(self.rank)
        if self.quant is not None:
            self._load_quantized_slots(
                first,
                *(linear_float_weight(getattr(shared_experts, name)) for name in ("gate_proj", "up_proj", "down_proj")),
            )
            return
        gate = shared_experts.gate_proj.weight
        up = shared_experts.up_proj.weight
        down = shared_experts.down_proj.weight
        for j in range(s):
            rows = slice(j * inter, (j + 1) * inter)
            self.experts.w_gate_up[first + j, :inter].copy_(gate[rows])
            self.experts.w_gate_up[first + j, inter:].copy_(up[rows])
            self.experts.w_down[first + j].copy_(down[:, rows])

    def _load_quantized_slots(self, first: int, gate, up, down) -> None:
        """Quantize a float shared MLP (gate/up [S*I, H], down [H, S*I]) into the S fused
        slots from local expert ``first`` on, with the layer's QuantConfig."""
        inter, s = self.intermediate_size, self.num_shared_experts
        w_gate_up, w_down = _split_slots(gate, up, down, inter, s)
        targets = self.experts.quantized_tensors()
        if self.quant.format == "int4":
            for prefix, weight in (("gate_up", w_gate_up), ("down", w_down)):
                parts = quantize_int4(weight, group_size=self.quant.group_size, symmetric=self.quant.symmetric)
                self.experts.hold_int4_scales(prefix + "_scale", parts[1].dtype)
                targets = self.experts.quantized_tensors()
                for name, tensor in zip(("w_" + prefix, prefix + "_scale", prefix + "_zero"), parts):
                    targets[name][first : first + s].copy_(tensor)
            perm = self.experts.gate_up_perm
            if perm is not None:  # the shared MLP's slots multiply the hidden columns in order
                perm[first : first + s] = torch.arange(perm.shape[1], dtype=perm.dtype, device=perm.device)
            return
        quantized = quantize_experts(w_gate_up, w_down, self.quant)
        for name, tensor in zip(("w_gate_up", "gate_up_scale", "w_down", "down_scale"), quantized):
            targets[name][first : first + s].copy_(tensor)

    # ------------------------------------------------------------ state dict

    #: How checkpoints name this module's state: None, moeroute's names (loading also maps
    #: the transformers stacked names and INT4 checkpoints' per-expert keys); `from_hf` sets
    #: the block's format, which the module then saves and loads
    #: (`moeroute.bindings.torch.hf_keys.TransformersCheckpoint`, or for INT4 layers
    #: `moeroute.bindings.torch.int4_keys.Int4Checkpoint`, which can also be set by hand).
    checkpoint_format = None

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        # A transformers checkpoint of the block this module replaced loads as it is: its
        # names are mapped to this module's before the usual loading (which copies into the
        # existing parameters, so aliased weights stay aliased).
        # A checkpoint format without a mapping of its own (INT4's per-expert keys) is read by
        # the transformers one.
        load = getattr(self.checkpoint_format, "load", None)
        if load is not None:
            load(self, state_dict, prefix)
        else:
            map_transformers_keys(self, state_dict, prefix)
        self._check_state_before_copy(state_dict, prefix)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def _check_state_before_copy(self, state_dict, prefix) -> None:
        """Every tensor of this layer (its submodules' included) in ``state_dict`` checked
        before torch copies any: torch reports a wrong shape only after copying the others,
        and would cast a float tensor into FP8 or MXFP4 weights (or e4m3 bytes into float
        ones) without their scales; and the experts' own checks of the values (FP8 NaN bytes, an
        INT4 act-order permutation), so that a refused load leaves the router as it was.
        ValueError naming the key."""
        check_state = getattr(self.experts, "check_state", None)
        if check_state is not None:
            check_state(state_dict, prefix + "experts.")
        own = {prefix + name: tensor for name, tensor in [*self.named_parameters(), *self.named_buffers()]}
        for key, target in own.items():
            tensor = state_dict.get(key)
            if not isinstance(tensor, torch.Tensor):
                continue
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(f"{key} has shape {list(tensor.shape)}, expected {list(target.shape)}")
            quantized = (torch.float8_e4m3fn, torch.uint8)
            if tensor.dtype != target.dtype and (tensor.dtype in quantized or target.dtype in quantized):
                raise ValueError(
                    f"{key} has dtype {tensor.dtype} but the layer holds {target.dtype} there: "
                    "quantized weights load as they are, never cast (quantize float weights with "
                    "moeroute.quant; build a layer for FP8 or MXFP4 weights with quant=...)"
                )

    # ----------------------------------------------------------------- forward

    def extra_repr(self) -> str:
        r = self.router
        return (
            f"num_experts={r.num_experts}, top_k={r.top_k}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, shared={self.layout.shared!r}, "
            f"num_shared_experts={self.num_shared_experts}, ep_size={self.layout.ep_size}, "
            f"rank={self.rank}, scaling_regime={self.layout.scaling_regime!r}"
        )

    def _check_forward_inputs(self, hidden_states, router_logits):
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}")
        if hidden_states.dim() not in (2, 3) or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden_states must be [T, H] or [B, S, H] with H={self.hidden_size}, "
                f"got shape {tuple(hidden_states.shape)}"
            )
        expected = self.experts.w_gate_up.dtype
        # A module moved to another dtype (module.double()) is refused here, never misread:
        # the expert weights first, then the router's.
        if self.quant is None:
            check_dtype("the module's expert weights", expected)
        check_dtype("the module's router_weight", self.router_weight.dtype)
        if self.quant is not None:  # quantized experts serve every activation dtype
            if hidden_states.dtype not in SUPPORTED_DTYPES:
                raise ValueError(
                    f"hidden_states dtype {hidden_states.dtype} is not served; use one of {SUPPORTED_DTYPES}"
                )
        else:
            if hidden_states.dtype != expected:
                raise ValueError(
                    f"hidden_states dtype {hidden_states.dtype} does not match the expert weights' "
                    f"dtype {expected}; convert one of them (supported: {SUPPORTED_DTYPES})"
                )
        device = hidden_states.device
        if device.type not in SUPPORTED_DEVICES:
            raise ValueError(f"hidden_states on device {device} is not supported; use one of {SUPPORTED_DEVICES}")
        if device != self.experts.w_gate_up.device:
            raise ValueError(
                f"hidden_states is on {device} but the expert weights are on "
                f"{self.experts.w_gate_up.device}; move the module or the input"
            )
        # The routing tensors this forward reads (a meta one holds no data to read).
        used = (
            ("correction_bias",) if router_logits is not None else ("router_weight", "router_bias", "correction_bias")
        )
        for name in used:
            tensor = getattr(self, name)
            if tensor is not None and tensor.device != device:
                raise ValueError(
                    f"hidden_states is on {device} but the module's {name} is on {tensor.device}; "
                    "move the module or the input"
                )
        if router_logits is not None:
            if not isinstance(router_logits, torch.Tensor):
                raise TypeError(f"router_logits must be a torch.Tensor or None, got {type(router_logits).__name__}")
            tokens = hidden_states.numel() // self.hidden_size
            if tuple(router_logits.shape) != (tokens, self.router.num_experts):
                raise ValueError(
                    f"router_logits must be [T={tokens}, N={self.router.num_experts}], got "
                    f"shape {tuple(router_logits.shape)}"
                )
            if not router_logits.is_floating_point() or router_logits.device != device:
                raise ValueError(
                    f"router_logits must be a float tensor on {device}, got "
                    f"{router_logits.dtype} on {router_logits.device}"
                )

    def _check_inference(self, hidden_states, router_logits) -> None:
        # Only the caller's inputs can ask for gradients: parameters that require grad (as
        # transformers leaves a shared MLP's) do not, so every shared mode behaves alike.
        if not torch.is_grad_enabled():
            return
        culprit = next(
            (
                name
                for name, value in (("hidden_states", hidden_states), ("router_logits", router_logits))
                if getattr(value, "requires_grad", False)
            ),
            None,
        )
        if culprit is not None:
            raise RuntimeError(
                f"moeroute MoE is inference-only, but gradients are requested ({culprit} requires grad); "
                "run it under torch.no_grad() or torch.inference_mode(), or pass a detached tensor"
            )

    def compute_router_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Router logits [T, N] float32 of hidden states [T, H], computed in
        ``router_compute_dtype`` (default: the dtype of ``router_weight``)."""
        weight, bias = self.router_weight, self.router_bias
        dtype = self.router_compute_dtype or weight.dtype
        return F.linear(hidden_states.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)).float()

    def _shared_gate(self, hidden_states):
        if self.shared_expert_gate is None:
            return None
        return torch.sigmoid(self.shared_expert_gate(hidden_states))

    def _shared_output(self, hidden_states, gate):
        out = self.shared_experts(hidden_states)
        return out if gate is None else gate * out

    def _apply(self, fn, *args, **kwargs):
        # correction_bias is float32 state (added to float32 scores): .half(), .bfloat16(),
        # .double() and .to(dtype) move it with the module but keep its dtype and values.
        bias = self.correction_bias
        result = super()._apply(fn, *args, **kwargs)
        moved = self.correction_bias
        if bias is not None and moved is not None and moved.dtype != torch.float32:
            self.correction_bias = bias.to(device=moved.device, dtype=torch.float32)
        return result

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        # A copy (copy.deepcopy, pickle) is a layer of its own: moe_forward must find it,
        # not the module it was copied from.
        self.layer_key = ops.register_layer(self)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor | None = None) -> torch.Tensor:
        """Run the layer: `forward_impl`, as one opaque op ``torch.ops.moeroute.moe_forward``
        whenever a tracer is watching.

        torch.compile, torch.export and torch.jit.trace see the op and its fake (an empty
        tensor of the input's shape and dtype), never the kernels behind it; the op calls
        `forward_impl`. Called eagerly on plain tensors, the layer runs `forward_impl`
        directly: the same computation without the op's dispatch cost. Parameters, result
        and errors are those of `forward_impl`; the inputs are checked once, before anything
        runs.
        """
        if ops.runs_eagerly(hidden_states, router_logits) and isinstance(hidden_states, torch.Tensor):
            return self.forward_impl(hidden_states, router_logits)
        self._check_forward_inputs(hidden_states, router_logits)
        self._check_inference(hidden_states, router_logits)
        return torch.ops.moeroute.moe_forward(hidden_states, router_logits, self.layer_key)

    @_runs_as_inference
    def forward_impl(self, hidden_states: torch.Tensor, router_logits: torch.Tensor | None = None) -> torch.Tensor:
        """Run the layer eagerly, the body of ``torch.ops.moeroute.moe_forward`` (always without
        autograd: see the module docstring).

        Parameters
        ----------
        hidden_states : Tensor [T, H] or [B, S, H], dtype of the expert weights, CPU or CUDA
        router_logits : Tensor [T, N] float, optional
            Precomputed logits (T = B*S); default ``compute_router_logits(hidden_states)``.

        Returns
        -------
        Tensor, shape and dtype of ``hidden_states``:
        ``sum_k w_k * expert_k(x) + g * shared(x)`` (docs/semantics.md section 3).

        Raises
        ------
        TypeError, ValueError
            Bad shapes, dtypes or devices (the message names the argument).
        RuntimeError
            ``hidden_states`` or ``router_logits`` requires grad while grad mode is on
            (inference only).
        """
        self._check_forward_inputs(hidden_states, router_logits)
        if self.pending_placement is not None:  # EPLB: an async apply swaps in here when done
            self.pending_placement.at_forward(self)
        # From routing to the output one placement: a swap waits until this forward is done.
        with self.placement_guard.forward():
            return self._forward_on_placement(hidden_states, router_logits)

    def _forward_on_placement(self, hidden_states, router_logits):
        """`forward_impl` after its checks, under the placement guard (shared)."""
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, self.hidden_size)
        layout, rsf = self.layout, self.router.routed_scaling_factor
        mode = layout.shared

        logits = self.compute_router_logits(x) if router_logits is None else router_logits.float()
        gate = self._shared_gate(x) if mode != "none" else None
        slot_weights = None
        if mode == "fused":
            gate_values = None if gate is None else gate.reshape(-1).float()
            slot_weights = layout.shared_slot_weight(gate_values, rsf)
        local = isinstance(self.dispatcher, LocalDispatcher)
        if local:
            # One rank: route picks, appends the shared slots and gives local ids in one op
            # (one launch on a device); those ids are the physical ones, and nothing travels.
            weights, ids = arrays.route(logits, self._selection_router, layout, 0, self.correction_bias, slot_weights)
            topk_weights = weights[:, : self.router.top_k]
        else:
            topk_weights, topk_ids = arrays.select_experts(logits, self._selection_router, self.correction_bias)
            weights, ids = arrays.append_shared_slots(topk_weights, topk_ids, layout, self.rank, slot_weights)
        if self.load_recorder is not None:  # EPLB load window: this rank's tokens, at home
            self.load_recorder.record(ids, layout.num_physical_experts)

        routed_input = x if self.routed_input_transform is None else self.routed_input_transform(x)
        if self.apply_router_weight_on_input:
            # K = 1: scale the input row by its weight, then every routed slot counts once.
            routed_input = routed_input * topk_weights.to(routed_input.dtype)
            weights = torch.ones_like(weights)
        if local:
            routed = self.experts(routed_input, weights, ids)
            shared_out = self._shared_output(x, gate) if mode == "overlap" else None
        else:
            if self.dispatch_dtype == "fp8":
                # FP8 dispatch: quantized once, here on the sending rank; the experts use it as is.
                routed_input = quantize_for_dispatch(routed_input, self.quant)
            handle = self.dispatcher.dispatch(routed_input, weights, ids, async_op=mode == "overlap")
            shared_out = self._shared_output(x, gate) if mode == "overlap" else None
            recv_hidden, recv_weights, recv_local_ids = handle.wait()
            partial = self.experts(recv_hidden, recv_weights, recv_local_ids)
            routed = self.dispatcher.combine(partial, handle)

        if layout.scaling_regime == "output" and rsf != 1.0:
            routed = routed * rsf
        if self.routed_output_transform is not None:
            routed = self.routed_output_transform(routed)
        if mode == "runner":
            shared_out = self._shared_output(x, gate)
        out = routed if shared_out is None else routed + shared_out
        return out.reshape(shape)
