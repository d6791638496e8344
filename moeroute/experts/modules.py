"""The experts one rank holds, as torch modules: `LocalExperts` (float32, float16, bfloat16
weights) and `QuantizedExperts` (FP8 or MXFP4). Each owns its stacked weights in the Hugging
Face layout (gate_up [L, 2I, H] with the gate rows first, down [L, H, I]) and hands them to
its format's compute (`moeroute.experts.formats`): for each received row,
``sum over its local slots of w * expert(x)``.
"""

from __future__ import annotations

import torch
from torch import nn

from moeroute._validate import integer, weights_then_ids
from moeroute.experts.activations import check_activation
from moeroute.experts.choose import check_strategy, format_of
from moeroute.experts.formats.fp8 import fp8_experts_forward
from moeroute.experts.formats.mxfp4 import mxfp4_experts_forward
from moeroute.experts.formats.int4 import int4_experts_forward
from moeroute.experts.formats.unquantized import (
    INIT_STD,
    SUPPORTED_DTYPES,
    check_dtype,
    cpu_experts,
    onednn_linear_serves,
)
from moeroute.quant import FP8_DTYPE, QuantConfig
from moeroute.quant.fp8 import check_fp8_weight

__all__ = ["LocalExperts", "QuantizedExperts"]


def _check_adopted_weights(weights, num_local_experts, hidden_size, intermediate_size):
    """``weights`` as a (gate_up, down) pair of tensors of the expected shapes and one
    supported dtype and device; ValueError/TypeError naming the mismatch otherwise."""
    if (
        not isinstance(weights, (tuple, list))
        or len(weights) != 2
        or not all(isinstance(w, torch.Tensor) for w in weights)
    ):
        raise TypeError("weights must be a (w_gate_up, w_down) pair of tensors")
    gate_up, down = weights
    expected = (
        (num_local_experts, 2 * intermediate_size, hidden_size),
        (num_local_experts, hidden_size, intermediate_size),
    )
    for name, tensor, shape in (("w_gate_up", gate_up, expected[0]), ("w_down", down, expected[1])):
        if tuple(tensor.shape) != shape:
            raise ValueError(f"weights {name} has shape {tuple(tensor.shape)}, expected {list(shape)}")
    if gate_up.dtype != down.dtype or gate_up.device != down.device:
        raise ValueError(
            f"weights must share one dtype and device, got {gate_up.dtype} on {gate_up.device} "
            f"and {down.dtype} on {down.device}"
        )
    if gate_up.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"weights dtype {gate_up.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    return gate_up, down


class LocalExperts(nn.Module):
    """Stacked weights of the experts one rank holds, and their compute.

    Parameters
    ----------
    num_local_experts : int
        L: routed experts held here, plus the fused shared slots when the layout fuses them.
    hidden_size : int
        H, the experts' input and output size.
    intermediate_size : int
        I, one expert's intermediate size.
    activation : str
        One of `ACTIVATIONS`.
    gemm : {"auto", "loop", "padded", "rows"}
        CPU expert-GEMM strategy (`GEMM_STRATEGIES`); "auto" decides per call (`moeroute.experts.choose`).
    bias : bool
        Give every expert a gate_up bias and a down bias (gpt-oss), initialised to zeros.
    dtype, device : torch dtype and device of the weights.
    weights : (Tensor [L, 2I, H], Tensor [L, H, I]), optional
        Existing stacked weights to adopt: the parameters share their memory (no copy),
        and dtype and device are theirs. E.g. a transformers experts module's
        ``gate_up_proj`` / ``down_proj``, or a contiguous slice of them.

    Attributes
    ----------
    w_gate_up : Parameter [L, 2I, H] (gate rows first), requires_grad False
    w_down : Parameter [L, H, I], requires_grad False
    b_gate_up : Parameter [L, 2I] (gate entries first) or None, requires_grad False
    b_down : Parameter [L, H] or None, requires_grad False

    Raises
    ------
    ValueError
        A count or size below 1, an unknown activation or gemm, a dtype outside
        `SUPPORTED_DTYPES`.
    """

    def __init__(
        self,
        num_local_experts: int,
        hidden_size: int,
        intermediate_size: int,
        activation: str = "silu",
        *,
        gemm: str = "auto",
        bias: bool = False,
        dtype=None,
        device=None,
        weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        num_local_experts = integer("num_local_experts", num_local_experts, 1)
        hidden_size = integer("hidden_size", hidden_size, 1)
        intermediate_size = integer("intermediate_size", intermediate_size, 1)
        if weights is not None:
            adopted = _check_adopted_weights(weights, num_local_experts, hidden_size, intermediate_size)
            dtype, device = adopted[0].dtype, adopted[0].device
        dtype = torch.get_default_dtype() if dtype is None else dtype
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype={dtype} is not supported; use one of {SUPPORTED_DTYPES}")
        self.activation = check_activation(activation)
        check_strategy("gemm", gemm, "float")
        self.gemm = gemm
        self.num_local_experts = num_local_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        #: Whether the CPU loop uses oneDNN-packed copies (`pack_cpu_weights`), and the
        #: copies: (key of the weights they were made from, gate_up list, down list).
        self.pack_cpu = False
        self._packed = None
        if not isinstance(bias, bool):
            raise ValueError(f"bias={bias!r} must be a bool")
        self.b_gate_up = self.b_down = None
        if bias:
            self.b_gate_up = nn.Parameter(
                torch.zeros(num_local_experts, 2 * intermediate_size, dtype=dtype, device=device), requires_grad=False
            )
            self.b_down = nn.Parameter(
                torch.zeros(num_local_experts, hidden_size, dtype=dtype, device=device), requires_grad=False
            )
        if weights is not None:
            # Parameters over the given tensors' memory: no copy, no initialisation.
            self.w_gate_up = nn.Parameter(adopted[0].detach(), requires_grad=False)
            self.w_down = nn.Parameter(adopted[1].detach(), requires_grad=False)
            return
        self.w_gate_up = nn.Parameter(
            torch.empty(num_local_experts, 2 * intermediate_size, hidden_size, dtype=dtype, device=device),
            requires_grad=False,
        )
        self.w_down = nn.Parameter(
            torch.empty(num_local_experts, hidden_size, intermediate_size, dtype=dtype, device=device),
            requires_grad=False,
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            nn.init.normal_(self.w_gate_up, std=INIT_STD)
            nn.init.normal_(self.w_down, std=INIT_STD)

    def pack_cpu_weights(self, enable: bool = True) -> "LocalExperts":
        """Pack the expert weights now into oneDNN copies for the CPU expert loop.

        oneDNN otherwise reorders each expert's weights into its blocked layout on every
        call; packed once, the loop skips that work (bench/layer.py measures the gain). The
        copies cost as much memory as the expert weights themselves, so this is opt-in.
        Results are the same bit for bit.

        Packing is explicit: the copies are a snapshot of the weights at this call, and
        after changing the weights in any way, call ``pack_cpu_weights()`` again.
        Changes torch can see (``copy_`` and other in-place ops, ``load_state_dict``,
        assigning ``.data``, ``module.to(...)`` to another dtype or device) make the next
        CPU forward raise a RuntimeError instead of computing with stale copies; writes
        through ``.data`` bypass torch's version counter and are NOT seen: re-pack after
        them. ``enable=False`` drops the copies (the plain weights serve). Copies of the
        module (``copy.deepcopy``, pickle, ``torch.save``) never carry the packed copies:
        they re-pack from their own weights, or run unpacked where they cannot pack.

        Returns ``self``. Raises ValueError when the weights are not on the CPU or this
        torch build's oneDNN cannot serve their dtype.
        """
        if enable and self.w_gate_up.device.type != "cpu":
            raise ValueError(f"pack_cpu_weights needs the weights on the CPU, they are on {self.w_gate_up.device}")
        if enable and not onednn_linear_serves(self.w_gate_up.dtype):
            raise ValueError(
                f"this torch build's oneDNN cannot serve {self.w_gate_up.dtype} "
                "weights; keep the plain weights (enable=False)"
            )
        self.pack_cpu = bool(enable)
        self._packed = None  # free old copies before building new ones
        if self.pack_cpu:
            reorder = torch.ops.mkldnn._reorder_linear_weight
            with torch.no_grad():
                self._packed = (
                    self._weights_key(),
                    [reorder(w) for w in self.w_gate_up],
                    [reorder(w) for w in self.w_down],
                )
        return self

    def _weights_key(self) -> tuple:
        """What torch can tell about the weights' identity: storage, version, dtype, device."""
        return tuple((w.data_ptr(), w._version, w.dtype, w.device) for w in (self.w_gate_up, self.w_down))

    def cpu_weights(self):
        """(w_gate_up, w_down) as the CPU expert loop uses them: the parameters, or lists of
        per-expert oneDNN-packed copies after `pack_cpu_weights`.

        Raises
        ------
        RuntimeError
            The weights changed in a way torch can see since `pack_cpu_weights`.
        """
        if not self.pack_cpu:
            return self.w_gate_up, self.w_down
        if self._packed is None or self._packed[0] != self._weights_key():
            raise RuntimeError(
                "the expert weights changed (written in place, loaded, replaced, moved or "
                "converted) after pack_cpu_weights(); the packed copies are a snapshot: call "
                "pack_cpu_weights() again to re-pack them, or pack_cpu_weights(False) to use "
                "the weights directly"
            )
        return self._packed[1], self._packed[2]

    def _apply(self, fn, *args, **kwargs):
        # module.to / .half() / .cuda(): copies of weights that moved or were converted are
        # dropped now (their memory goes with them); the next CPU forward then asks for a
        # re-pack. A .to() that changes nothing keeps them.
        result = super()._apply(fn, *args, **kwargs)
        if self._packed is not None and self._packed[0] != self._weights_key():
            self._packed = None
        return result

    def __getstate__(self):
        # oneDNN-packed copies are opaque tensors (no storage to copy or save) and derived
        # data: copies and pickles (copy.deepcopy, torch.save) carry the weights only.
        state = super().__getstate__()
        state["_packed"] = None
        return state

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        if self.pack_cpu:
            # Re-packed from the copy's own weights; where they cannot be packed (loaded onto
            # another device, a dtype oneDNN does not serve) the copy uses them unpacked.
            serves = self.w_gate_up.device.type == "cpu" and onednn_linear_serves(self.w_gate_up.dtype)
            self.pack_cpu_weights(serves)

    def extra_repr(self) -> str:
        return (
            f"num_local_experts={self.num_local_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, activation={self.activation!r}, "
            f"gemm={self.gemm!r}, bias={self.b_gate_up is not None}"
        )

    def forward(self, hidden_states: torch.Tensor, weights: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """Weighted sum of each row's local experts.

        Parameters
        ----------
        hidden_states : Tensor [Tr, H], dtype of the weights
        weights : Tensor [Tr, K'] float32
        local_ids : Tensor [Tr, K'] int32, local expert id per slot, -1 (or any id outside
            [0, L)) = not computed here

        Returns
        -------
        Tensor [Tr, H], dtype of ``hidden_states``: ``sum_k weights[t, k] * expert(x_t)``
        over the slots held here (rows with none are zero).

        Raises
        ------
        TypeError
            ``weights`` not floating or ``local_ids`` not integer (the pair passed ids first,
            the order before 0.2).
        ValueError
            The weights are not of a `SUPPORTED_DTYPES` dtype (``module.double()``), or
            ``hidden_states`` is not of theirs.
        """
        weights_then_ids(weights, local_ids, "weights", "local_ids")
        check_dtype("the expert weights", self.w_gate_up.dtype)
        if hidden_states.dtype != self.w_gate_up.dtype:
            raise ValueError(
                f"hidden_states dtype {hidden_states.dtype} does not match the expert "
                f"weights' dtype {self.w_gate_up.dtype}"
            )
        if hidden_states.device.type == "cuda":
            return self._forward_cuda(hidden_states, weights, local_ids)
        loop_weights = self.cpu_weights() if self.pack_cpu else None
        return cpu_experts(
            hidden_states,
            weights,
            local_ids,
            self.w_gate_up,
            self.w_down,
            self.activation,
            self.gemm,
            self.b_gate_up,
            self.b_down,
            loop_weights=loop_weights,
        )

    def _forward_cuda(self, hidden_states, weights, local_ids):
        try:
            from moeroute.gpu import fused_experts
        except ImportError as error:  # CuPy missing: say what the CUDA path needs
            raise RuntimeError(
                f"hidden_states on {hidden_states.device} need moeroute's CUDA expert GEMMs, which "
                f"could not be imported ({error}); install the 'cuda' extra (CuPy, numba-cuda)"
            ) from error
        return fused_experts(
            hidden_states.contiguous(),
            self.w_gate_up,
            self.w_down,
            weights.contiguous(),
            local_ids.contiguous(),
            activation=self.activation,
            gate_up_bias=self.b_gate_up,
            down_bias=self.b_down,
        )


#: Scale dtypes an INT4 layer holds (`QuantizedExperts.hold_int4_scales`).
_SCALE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class QuantizedExperts(nn.Module):
    """The quantized experts one rank holds (the counterpart of `LocalExperts`): FP8, MXFP4
    packed blocks and scale bytes (`moeroute.experts.formats.mxfp4`), or INT4 packed
    integers, scales and zero points (`moeroute.experts.formats.int4`).

    Parameters
    ----------
    num_local_experts, hidden_size, intermediate_size, activation
        As `LocalExperts`.
    quant : QuantConfig
    device : torch device of the weights.
    strategy : {"auto", "rows", "blocks"}
        CPU strategy (`fp8_experts_forward`, `mxfp4_experts_forward`, `int4_experts_forward`).
    bias : bool
        Experts carry a gate_up bias [2I] and a down bias [H] (gpt-oss; mxfp4 only).

    Attributes
    ----------
    w_gate_up : Parameter [L, 2I, H] float8_e4m3fn (gate rows first)
    w_down : Parameter [L, H, I] float8_e4m3fn
    gate_up_scale : Parameter float32, [L, 2*ceil(I/bn), ceil(H/bk)] (fp8_block: the gate's
        block rows, then the up's) or [L, 2] (fp8_tensor: gate, up)
    down_scale : Parameter float32, [L, ceil(H/bn), ceil(I/bk)] or [L]
    input_scale : Parameter [L, 2] float32 (gate_up input, down input) with
        ``activation="static"``, else None
    b_gate_up, b_down : None (FP8 experts carry no biases)

    With ``quant.format == "mxfp4"``: ``w_gate_up`` uint8 [L, 2I, H/32, 16] and
    ``gate_up_scale`` uint8 [L, 2I, H/32] (gate rows first), ``w_down`` uint8 [L, H, I/32, 16]
    and ``down_scale`` uint8 [L, H, I/32] (`moeroute.quant.mxfp4`), and with ``bias``
    ``b_gate_up`` [L, 2I] and ``b_down`` [L, H] float32.

    With ``quant.format == "int4"`` (g = ``quant.group_size``): ``w_gate_up`` uint8 [L, 2I,
    H/2] and ``w_down`` uint8 [L, H, I/2] (two 4-bit integers a byte), ``gate_up_scale``
    [L, 2I, H/g] and ``down_scale`` [L, H, I/g] in the dtype they are loaded in (bfloat16
    until then, `moeroute.quant.quantize_int4`'s; a checkpoint's float16 or float32 scales
    are held as float16 or float32, see `hold_int4_scales`), and when not ``quant.symmetric``
    ``gate_up_zero`` / ``down_zero`` uint8 of the scales' shapes (else None: z = 8)
    (`moeroute.quant.int4`), and ``gate_up_perm``: None, or int32 [L, H] where a GPTQ
    checkpoint has act order on gate_proj/up_proj: expert l's gate_up weights hold the hidden
    columns in the order ``gate_up_perm[l]`` (groups contiguous), and its rows multiply
    ``x[gate_up_perm[l]]`` (`moeroute.bindings.torch.int4_keys` sets it; a state dict carries
    it when set).

    The weights start at zero with unit scales (no float copy is ever made); load them with
    ``MoE.load_routed_weights``, ``load_state_dict`` or `moeroute.bindings.torch.load_experts`.
    ``module.to(dtype)`` leaves them as they are (it moves them to another device only):
    casting FP8 values without their scales would be silently wrong.
    """

    def __init__(
        self,
        num_local_experts: int,
        hidden_size: int,
        intermediate_size: int,
        activation: str = "silu",
        *,
        quant: QuantConfig,
        device=None,
        strategy: str = "auto",
        bias: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(quant, QuantConfig):
            raise TypeError(f"quant must be a moeroute.quant.QuantConfig, got {type(quant).__name__}")
        check_strategy("strategy", strategy, format_of(quant))
        self.activation = check_activation(activation)
        self.quant = quant
        self.strategy = strategy
        self.num_local_experts = num_local_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gemm = strategy
        self.b_gate_up = self.b_down = None
        self.gate_up_zero = self.down_zero = None
        self.pack_cpu = False
        gate_up_shape, down_shape = quant.scale_shapes(num_local_experts, hidden_size, intermediate_size)

        def parameter(tensor):
            return nn.Parameter(tensor, requires_grad=False)

        if bias and quant.format != "mxfp4":
            raise ValueError(f"bias=True is not served with quant={quant.format!r} (FP8 experts carry no biases)")
        if quant.format == "int4":
            # Codes 8 (zero weights, z = 8) and unit scales until loaded; no float copy is made.
            for prefix, (rows, groups) in (("gate_up", gate_up_shape[1:]), ("down", down_shape[1:])):
                cols = groups * quant.group_size
                packed = torch.full((num_local_experts, rows, cols // 2), 0x88, dtype=torch.uint8, device=device)
                setattr(self, "w_" + prefix, parameter(packed))
                shape = (num_local_experts, rows, groups)
                # 16-bit scales until loaded (`hold_int4_scales` takes a load's dtype)
                setattr(self, prefix + "_scale", parameter(torch.ones(shape, dtype=torch.bfloat16, device=device)))
                if not quant.symmetric:
                    zero = torch.full(shape, 8, dtype=torch.uint8, device=device)
                    setattr(self, prefix + "_zero", parameter(zero))
            self.input_scale = None
            self.register_buffer("gate_up_perm", None)
            return
        if quant.format == "mxfp4":
            # Packed bytes only (zero codes, unit scales) until loaded; no float copy is made.
            self.w_gate_up = parameter(torch.zeros(*gate_up_shape, 16, dtype=torch.uint8, device=device))
            self.w_down = parameter(torch.zeros(*down_shape, 16, dtype=torch.uint8, device=device))
            self.gate_up_scale = parameter(torch.full(gate_up_shape, 127, dtype=torch.uint8, device=device))
            self.down_scale = parameter(torch.full(down_shape, 127, dtype=torch.uint8, device=device))
            self.input_scale = None
            if bias:
                self.b_gate_up = parameter(
                    torch.zeros(num_local_experts, 2 * intermediate_size, dtype=torch.float32, device=device)
                )
                self.b_down = parameter(torch.zeros(num_local_experts, hidden_size, dtype=torch.float32, device=device))
            return

        self.w_gate_up = parameter(
            torch.zeros(num_local_experts, 2 * intermediate_size, hidden_size, dtype=FP8_DTYPE, device=device)
        )
        self.w_down = parameter(
            torch.zeros(num_local_experts, hidden_size, intermediate_size, dtype=FP8_DTYPE, device=device)
        )
        self.gate_up_scale = parameter(torch.ones(gate_up_shape, dtype=torch.float32, device=device))
        self.down_scale = parameter(torch.ones(down_shape, dtype=torch.float32, device=device))
        self.input_scale = None
        if quant.activation == "static":
            self.input_scale = parameter(torch.ones(num_local_experts, 2, dtype=torch.float32, device=device))

    def quantized_tensors(self) -> dict:
        """name -> parameter of every tensor a load must fill: weights, scales, input scales."""
        names = ("w_gate_up", "w_down", "gate_up_scale", "down_scale", "gate_up_zero", "down_zero", "input_scale")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    @torch.no_grad()
    def hold_int4_scales(self, name: str, dtype: torch.dtype) -> None:
        """Hold INT4 scales ``name`` ("gate_up_scale" or "down_scale") so that scales of
        ``dtype`` (bfloat16, float16 or float32) copy into them exactly, in as few bytes as
        that allows: the kernels read them as held, so a layer keeps its checkpoint's dtype.
        Unit scales (nothing loaded yet) are replaced by ``dtype``'s, the old tensor freed first
        (no second copy at any time); held values that ``dtype`` represents exactly are
        converted to it; otherwise the scales become float32, which holds both. Nothing
        happens when they already are ``dtype``, or for other formats or dtypes."""
        param = getattr(self, name, None)
        if self.quant.format != "int4" or param is None or param.dtype == dtype or dtype not in _SCALE_DTYPES:
            return
        held = param.data
        if held.is_meta or all(bool((row == 1).all()) for row in held):
            shape, device = held.shape, held.device
            param.data = torch.empty(0, dtype=dtype, device=device)
            param.data = torch.ones(shape, dtype=dtype, device=device)
            return
        exact = all(torch.equal(row.to(dtype).to(held.dtype), row) for row in held)
        param.data = held.to(dtype if exact else torch.float32)

    def pack_cpu_weights(self, enable: bool = True):
        if enable:
            raise ValueError(
                "pack_cpu_weights packs float weights for oneDNN; FP8 experts are decoded "
                "in the expert loop and have nothing to pack"
            )
        return self

    def _apply(self, fn, *args, **kwargs):
        # .to(dtype)/.half() would cast the e4m3 values (and the scales) without their scales:
        # keep every quantized tensor's dtype, follow only the device.
        kept = {name: p.data for name, p in self._parameters.items() if p is not None}
        result = super()._apply(fn, *args, **kwargs)
        for name, old in kept.items():
            param = self._parameters[name]
            if param.dtype != old.dtype:
                param.data = old.to(device=param.device)
        return result

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        # Every state-dict path into the module (moeroute's own names included) refuses NaN
        # e4m3 weight bytes and a malformed act-order permutation before anything is copied,
        # as the other loaders do (`MoE` runs the same checks before copying its router).
        self.check_state(state_dict, prefix)
        if self.quant.format == "int4":  # the scales take the dtype they come in
            for name in ("gate_up_scale", "down_scale"):
                tensor = state_dict.get(prefix + name)
                if isinstance(tensor, torch.Tensor):
                    self.hold_int4_scales(name, tensor.dtype)
            self._load_gate_up_perm(state_dict, prefix)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def check_state(self, state_dict, prefix) -> None:
        """The checks of ``state_dict``'s values for this module (keys under ``prefix``) that
        run before anything of the layer is copied: FP8 weight bytes without NaN codes, and an
        INT4 ``gate_up_perm`` that is an int32/int64 [L, H] permutation of the hidden columns
        per expert. TypeError/ValueError naming the key."""
        if self.quant.format.startswith("fp8"):
            for name in ("w_gate_up", "w_down"):
                tensor = state_dict.get(prefix + name)
                if isinstance(tensor, torch.Tensor) and tensor.dtype == FP8_DTYPE and not tensor.is_meta:
                    check_fp8_weight(prefix + name, tensor)
        key = prefix + "gate_up_perm"
        perm = state_dict.get(key)
        if self.quant.format != "int4" or perm is None:
            return
        shape = (self.num_local_experts, self.hidden_size)
        if not isinstance(perm, torch.Tensor) or perm.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{key} must be an int32 tensor [L, H], got {getattr(perm, 'dtype', type(perm).__name__)}")
        if tuple(perm.shape) != shape:
            raise ValueError(f"{key} has shape {list(perm.shape)}, expected {list(shape)}")
        if not perm.is_meta:
            arange = torch.arange(self.hidden_size, device=perm.device)
            bad = (torch.sort(perm.to(torch.int64), dim=1).values != arange).any(dim=1)
            if bool(bad.any()):
                raise ValueError(
                    f"{key}[{int(bad.nonzero()[0, 0])}] is not a permutation of the {self.hidden_size} hidden columns"
                )

    def _load_gate_up_perm(self, state_dict, prefix) -> None:
        """``gate_up_perm`` follows the state dict: taken (`check_state` checked it) when it
        has one, None when it holds the weights without one (a layer saved without act order)."""
        perm = state_dict.get(prefix + "gate_up_perm")
        if perm is None:
            if prefix + "w_gate_up" in state_dict:
                self.gate_up_perm = None
            return
        if self.gate_up_perm is None:
            shape = (self.num_local_experts, self.hidden_size)
            self.gate_up_perm = torch.empty(shape, dtype=torch.int32, device=self.w_gate_up.device)

    def __getstate__(self):
        # pickle cannot save float8 storages (torch.save can): the e4m3 weights travel as their
        # bytes (uint8 views, no copy) and are viewed back as float8_e4m3fn in __setstate__.
        state = super().__getstate__()
        parameters = state["_parameters"].copy()
        as_bytes = [name for name, p in parameters.items() if p is not None and p.dtype == FP8_DTYPE]
        for name in as_bytes:
            parameters[name] = parameters[name].detach().view(torch.uint8)
        state["_parameters"] = parameters
        state["_fp8_as_bytes"] = as_bytes
        return state

    def __setstate__(self, state) -> None:
        as_bytes = state.pop("_fp8_as_bytes", ())
        super().__setstate__(state)
        for name in as_bytes:
            self._parameters[name] = nn.Parameter(self._parameters[name].view(FP8_DTYPE), requires_grad=False)

    def extra_repr(self) -> str:
        return (
            f"num_local_experts={self.num_local_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, activation={self.activation!r}, "
            f"quant={self.quant!r}"
        )

    def forward(self, hidden_states: torch.Tensor, weights: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """Weighted sum of each row's local w8a8 experts: as `LocalExperts.forward`, with the
        numerics of docs/quant.md; any of float32/bfloat16/float16 activations."""
        weights_then_ids(weights, local_ids, "weights", "local_ids")
        if isinstance(hidden_states, torch.Tensor):
            hidden_states = hidden_states.contiguous()
        if self.quant.format == "int4":
            return int4_experts_forward(
                hidden_states,
                weights.contiguous(),
                local_ids.contiguous(),
                (self.w_gate_up, self.gate_up_scale, self.gate_up_zero),
                (self.w_down, self.down_scale, self.down_zero),
                self.quant.group_size,
                self.activation,
                self.strategy,
                gate_up_perm=self.gate_up_perm,
            )
        if self.quant.format == "mxfp4":
            return mxfp4_experts_forward(
                hidden_states,
                weights.contiguous(),
                local_ids.contiguous(),
                self.w_gate_up,
                self.gate_up_scale,
                self.w_down,
                self.down_scale,
                self.b_gate_up,
                self.b_down,
                self.activation,
                self.strategy,
            )
        return fp8_experts_forward(
            hidden_states,
            weights.contiguous(),
            local_ids.contiguous(),
            self.w_gate_up,
            self.gate_up_scale,
            self.w_down,
            self.down_scale,
            self.quant,
            self.activation,
            self.input_scale,
            self.strategy,
        )
