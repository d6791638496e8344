"""FP8 (w8a8, or w8a16) expert compute on the CPU: the numerics of `moeroute.quant`, streamed.

For the rows one rank received (``[Tr, H]`` with local expert ids and weights), computes
``sum_k w_k * expert_k(x)`` where each expert is the w8a8 MLP of docs/quant.md: its input
quantized per token group (or per token, or with a static scale), the gate_up GEMM over the
FP8 weight with its block scales, the activation, the intermediate rounded to the
activation dtype and quantized again, the down GEMM, and the weighted sum in float32.
With ``activation="none"`` (w8a16) neither GEMM input is quantized: the same steps on the
rows and the intermediate as they are (the GEMMs' operands then have unit group scales).

The FP8 weights are never dequantized whole. Two strategies, picked by rows per expert:

* "rows" (few rows per expert, decode): the Numba kernels of `moeroute.experts.cpu.fp8` decode
  each weight row in registers as they read it and dot it with every row of the expert, so
  memory reads one byte per weight. Both GEMMs of every hit expert run in two calls
  (parallel, or serial when torch has one thread); the second adds into the float32 sums
  directly. The bookkeeping is `moeroute.experts.cpu.rows.plan_rows` (one Numba pass).
* "blocks" (many rows per expert, prefill): per expert, `CHUNK_BYTES` of weight rows at a
  time are decoded into one reusable float32 buffer, and multiplied by the expert's
  quantized rows (float32, whatever the activation dtype: the row kernels' numerics) with
  torch (oneDNN/MKL): the GEMM's compute is then the cost, as in the float layer.

`moeroute.experts.choose` picks between them (bench/quant.py finds the crossover). On a CPU
with AVX512-BF16 and shapes whose rows and column blocks are whole 64-weight steps
(`moeroute.experts.cpu.fp8.bf16_dot_serves`), the row kernels decode e4m3 to bfloat16 and use
the bfloat16 dot instruction, four activation rows per weight row: "rows" at every size there,
as the weights are then read once for four rows and the blocks' decode buffer is never written.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from moeroute._validate import weights_then_ids
from moeroute.experts.cpu import quant_rows
from moeroute.experts.cpu import rows as cpu_rows
from moeroute.experts.activations import gated_activation
from moeroute.experts.formats.unquantized import numba_threads, check_same_device
from moeroute.experts.choose import STRATEGIES, check_strategy, choose, cupy_installed, fp8_bf16_dot
from moeroute.quant import FP8_DTYPE, QuantConfig, check_scale, quantize_fp8_activations, quantize_fp8_static
from moeroute.quant.fp8 import MIN_AMAX, check_fp8_weight
from moeroute.experts.cpu import fp8 as cpu_fp8
from moeroute import routing
from moeroute.routing.threads import cpu_threads

__all__ = [
    "fp8_experts_forward",
    "FP8_STRATEGIES",
    "fake_quantize",
    "check_quantized_weights",
    "PROJECTIONS",
    "STACKED_SCALE_KEYS",
    "per_expert_key",
    "gate_up_scale_from_stacked",
    "FP8Activations",
    "quantize_for_dispatch",
    "check_dispatch_quant",
]

#: The three projections of a per-expert checkpoint, in moeroute's row order (gate, up, down).
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
#: transformers 5 FP8Experts scale names (relative to the block) -> QuantizedExperts parameter.
STACKED_SCALE_KEYS = {"experts.gate_up_proj_scale_inv": "gate_up_scale", "experts.down_proj_scale_inv": "down_scale"}


def per_expert_key(expert: int, projection: str, scale: bool = False) -> str:
    """``experts.{e}.{projection}.weight`` (or ``.weight_scale_inv``), relative to the block."""
    return f"experts.{expert}.{projection}.{'weight_scale_inv' if scale else 'weight'}"


def gate_up_scale_from_stacked(scale: torch.Tensor, quant: QuantConfig, intermediate_size: int) -> torch.Tensor:
    """transformers' fused gate_up scales [.., ceil(2I/bn), G] as moeroute's [.., 2*ceil(I/bn), G].

    The two are the same rows when bn divides I. Otherwise a block of the fused tensor spans
    gate and up rows, which have their own block rows here: ValueError.
    """
    if quant.format != "fp8_block":
        return scale
    bn = quant.block_size[0]
    if intermediate_size % bn:
        raise ValueError(
            f"gate_up_proj_scale_inv blocks span the gate and up rows (intermediate size "
            f"{intermediate_size} is not a multiple of the block rows {bn}); moeroute keeps "
            "gate and up in their own block rows: load the per-expert gate_proj/up_proj weights"
        )
    return scale


#: Strategies of the FP8 experts; "auto" picks per call (`moeroute.experts.choose`).
FP8_STRATEGIES = STRATEGIES["fp8"]
#: Bytes of decoded weights per chunk of the "blocks" strategy: one reusable buffer, large
#: enough that the chunked GEMMs keep the speed of whole ones (bench/quant.py).
CHUNK_BYTES = 16 << 20


def fake_quantize(x: torch.Tensor, config: QuantConfig, static_scale=None) -> torch.Tensor:
    """``q_a * s_a`` float32 of activations ``x [M, K]``: the values the FP8 GEMM multiplies.

    Dynamic: per row and group of ``config.activation_group_size`` columns (fp8_block) or
    per row (fp8_tensor). ``static_scale``: a float32 tensor [M] or a float (static scheme).
    """
    if static_scale is not None:
        scale = static_scale[:, None] if isinstance(static_scale, torch.Tensor) else static_scale
        return quantize_fp8_static(x, scale).float() * scale
    group = config.activation_group_size
    q, scales = quantize_fp8_activations(x, group, config.scale_fmt)
    return _dequantize_rows(q, scales, group)


@dataclasses.dataclass(frozen=True)
class FP8Activations:
    """Token rows quantized once for FP8 dispatch: what travels instead of a float tensor.

    Attributes
    ----------
    q : Tensor [T, H] float8_e4m3fn
    scales : Tensor [T, G] float32
        Per row and group of ``group_size`` columns (G = ceil(H / group_size)), or one per
        row (G = 1) when ``group_size`` is None: ``x ~= q * scales[t, j // group_size]``.
    group_size : int or None
        The QuantConfig's activation group (fp8_block: bk; fp8_tensor: None, the whole row).
    dtype : torch.dtype
        The activation dtype the layer computes in (the experts' output dtype).

    ``shape``, ``device`` and ``dtype`` answer as the float rows would, so a dispatcher's
    combine checks its partial outputs against them unchanged.
    """

    q: torch.Tensor
    scales: torch.Tensor
    group_size: int | None
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    def dequantize(self) -> torch.Tensor:
        """float32 [T, H]: ``q * scales`` per group, the values the first FP8 GEMM multiplies."""
        return _dequantize_rows(self.q, self.scales, self.group_size)

    def check(self, name: str = "hidden_states") -> None:
        """ValueError naming ``name`` unless q is 2-D e4m3 and scales float32 [T, G] beside it."""
        q, scales = self.q, self.scales
        if not isinstance(q, torch.Tensor) or q.dtype != FP8_DTYPE or q.dim() != 2:
            raise ValueError(
                f"{name}.q must be a 2-D float8_e4m3fn tensor [T, H], got "
                f"{getattr(q, 'dtype', type(q).__name__)} {tuple(getattr(q, 'shape', ()))}"
            )
        groups = 1 if self.group_size is None else -(-q.shape[1] // self.group_size)
        if (
            not isinstance(scales, torch.Tensor)
            or scales.dtype != torch.float32
            or tuple(scales.shape) != (q.shape[0], groups)
            or scales.device != q.device
        ):
            raise ValueError(
                f"{name}.scales must be float32 [{q.shape[0]}, {groups}] on {q.device}, got "
                f"{getattr(scales, 'dtype', type(scales).__name__)} "
                f"{tuple(getattr(scales, 'shape', ()))}"
            )
        if self.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"{name}.dtype={self.dtype} must be the activation dtype (float32, bfloat16, float16)")


def _dequantize_rows(q: torch.Tensor, scales: torch.Tensor, group: int | None) -> torch.Tensor:
    if group is None:
        return q.float() * scales
    return q.float().mul_(scales.repeat_interleave(group, dim=-1)[..., : q.shape[-1]])


def check_dispatch_quant(dispatch_dtype, quant: QuantConfig | None) -> str | None:
    """``dispatch_dtype`` checked against the layer's format: "fp8" or None (the activation dtype).

    Raises
    ------
    ValueError
        Naming ``dispatch_dtype``: a value other than None, "auto" or "fp8"; "fp8" on a float
        layer (its experts would compute on rounded inputs the single-rank layer never sees)
        or with static activation scales (the first GEMM quantizes each (row, expert) with the
        expert's own scale, which a per-token quantization on the sender cannot reproduce).
    """
    if dispatch_dtype is None or dispatch_dtype == "auto":
        return None
    if dispatch_dtype != "fp8":
        raise ValueError(
            f"dispatch_dtype={dispatch_dtype!r} is unknown; use None/'auto' (the activation dtype) or 'fp8'"
        )
    if quant is None:
        raise ValueError(
            "dispatch_dtype='fp8' needs FP8 experts (quant=QuantConfig(...)): a float layer's "
            "experts would compute on e4m3-rounded inputs and differ from the single-rank layer"
        )
    if not quant.format.startswith("fp8"):
        raise ValueError(
            f"dispatch_dtype='fp8' needs FP8 experts; {quant.format} experts compute on the "
            "activations as they are (w4a16), which e4m3 rows would round"
        )
    if not quant.quantizes_activations:
        raise ValueError(
            "dispatch_dtype='fp8' needs w8a8 experts; with quant activation='none' (w8a16) the "
            "experts compute on the activations as they are, which e4m3 rows would round: "
            "leave dispatch_dtype None"
        )
    if quant.activation != "dynamic":
        raise ValueError(
            "dispatch_dtype='fp8' needs dynamic activation scales; with quant "
            "activation='static' each expert quantizes its input with its own scale, which "
            "the sending rank cannot apply once per token"
        )
    return "fp8"


def quantize_for_dispatch(x: torch.Tensor, config: QuantConfig) -> FP8Activations:
    """Quantize the routed input rows ``x [T, H]`` once, as the FP8 experts' first GEMM would.

    Per row and group of ``config.activation_group_size`` columns (fp8_block: bk; fp8_tensor:
    the whole row), with ``config.scale_fmt`` (`moeroute.quant.quantize_fp8_activations`).
    """
    q, scales = quantize_fp8_activations(x, config.activation_group_size, config.scale_fmt)
    return FP8Activations(q, scales, config.activation_group_size, x.dtype)


def _kernel_scales(config: QuantConfig, gate_up_scale, down_scale, hidden, inter):
    """Scales as the kernels index them, ``scale[e, row // bn, col // bk]``, and (bn, bk) of
    each GEMM: per-tensor FP8 is one block per matrix (per gate and per up)."""
    if config.format == "fp8_block":
        bn, bk = config.block_size
        return gate_up_scale, down_scale, (bn, bk), (bn, bk)
    return (
        gate_up_scale.reshape(-1, 2, 1).contiguous(),
        down_scale.reshape(-1, 1, 1).contiguous(),
        (inter, hidden),
        (hidden, inter),
    )


def fp8_experts_forward(
    hidden_states: torch.Tensor,
    weights: torch.Tensor,
    local_ids: torch.Tensor,
    q_gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    q_down: torch.Tensor,
    down_scale: torch.Tensor,
    config: QuantConfig,
    activation: str = "silu",
    input_scale: torch.Tensor | None = None,
    strategy: str = "auto",
) -> torch.Tensor:
    """Weighted sum of each row's local w8a8 experts (CPU), or w8a16 ones where
    ``config.activation == "none"``.

    Parameters
    ----------
    hidden_states : Tensor [Tr, H] float32/bfloat16/float16, or FP8Activations
        FP8Activations (FP8 dispatch): rows quantized once on the sending rank with this
        config's groups; the first GEMM uses their q and scales as they are (dynamic scheme
        only), so the result is that of the float rows they were quantized from.
    weights : Tensor [Tr, K'] float32
    local_ids : Tensor [Tr, K'] int32; ids outside [0, L) are not computed here
    q_gate_up : Tensor [L, 2I, H] float8_e4m3fn (gate rows first)
    gate_up_scale : Tensor float32, [L, 2*ceil(I/bn), ceil(H/bk)] (fp8_block) or [L, 2]
    q_down : Tensor [L, H, I] float8_e4m3fn
    down_scale : Tensor float32, [L, ceil(H/bn), ceil(I/bk)] (fp8_block) or [L]
    config : QuantConfig
    activation : str
    input_scale : Tensor [L, 2] float32 (gate_up input, down input), static scheme only
    strategy : {"auto", "rows", "blocks"}

    Returns
    -------
    Tensor [Tr, H], dtype of ``hidden_states``, accumulated in float32.
    """
    weights_then_ids(weights, local_ids, "weights", "local_ids")
    check_strategy("strategy", strategy, "fp8")
    rows = hidden_states.q if isinstance(hidden_states, FP8Activations) else hidden_states
    check_same_device(
        "hidden_states",
        rows,
        weights=weights,
        local_ids=local_ids,
        q_gate_up=q_gate_up,
        gate_up_scale=gate_up_scale,
        q_down=q_down,
        down_scale=down_scale,
        input_scale=input_scale,
    )
    received = None
    if isinstance(hidden_states, FP8Activations):
        received = hidden_states
        received.check()
        if config.activation != "dynamic" or received.group_size != config.activation_group_size:
            raise ValueError(
                f"hidden_states are FP8 rows in groups of {received.group_size} columns, but "
                f"the experts quantize their input with activation={config.activation!r}, "
                f"groups of {config.activation_group_size}"
            )
        hidden_states = received.q
    act_dtype = hidden_states.dtype if received is None else received.dtype
    num_tokens, hidden = hidden_states.shape
    num_experts, two_inter, _ = q_gate_up.shape
    inter = two_inter // 2
    device = hidden_states.device
    gu_scale, d_scale, gu_block, d_block = _kernel_scales(config, gate_up_scale, down_scale, hidden, inter)
    if device.type != "cpu":
        # The CUDA kernels (w8a8, and w8a16 with activation="none") take the float rows (not
        # rows quantized by the sender) on a CUDA device where CuPy is installed; else the
        # torch "blocks".
        cuda_kernels = device.type == "cuda" and received is None and cupy_installed()
        strategy = choose("fp8", "cuda", strategy=strategy, cuda_kernels=cuda_kernels)
        if strategy == "cuda":
            from moeroute.gpu import fused_experts

            return fused_experts(
                hidden_states.contiguous(),
                q_gate_up.contiguous(),
                q_down.contiguous(),
                weights.to(torch.float32).contiguous(),
                local_ids.to(torch.int32).contiguous(),
                activation=activation,
                quant=config,
                gate_up_scale=gate_up_scale.contiguous(),
                down_scale=down_scale.contiguous(),
                input_scale=None if input_scale is None else input_scale.contiguous(),
            )
    if strategy != "blocks":
        # The row kernels' bookkeeping in one Numba pass; it also gives "auto" its counts.
        plan = cpu_rows.plan_rows(
            local_ids.detach().contiguous().numpy(),
            weights.detach().to(torch.float32).contiguous().numpy(),
            num_experts,
            -(-two_inter // cpu_fp8.ROW_BLOCK),
        )
        if strategy == "auto":
            strategy = choose(
                "fp8",
                "cpu",
                np.diff(plan[2]).tolist(),
                bf16_dot=_bf16_dot(config, act_dtype, hidden, inter, gu_block, d_block),
            )
        if strategy == "rows":
            return _rows_forward(
                hidden_states,
                received,
                plan,
                q_gate_up,
                gu_scale,
                gu_block,
                q_down,
                d_scale,
                d_block,
                config,
                activation,
                input_scale,
                act_dtype,
            )
    top_k = local_ids.shape[1]
    sorted_slots, expert_offsets, _ = routing.sort_by_expert(local_ids.detach().contiguous(), num_experts)
    offsets = expert_offsets.to(torch.int64)
    counts = (offsets[1:] - offsets[:-1]).tolist()
    slots = sorted_slots.to(torch.int64)
    tokens = slots // top_k
    slot_weights = weights.reshape(-1).to(torch.float32)[slots].contiguous()
    sums = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=device)
    if slots.numel() == 0:
        return sums.to(act_dtype)
    static = config.activation == "static"
    row_expert = torch.repeat_interleave(torch.arange(num_experts, device=device), torch.tensor(counts, device=device))

    # First GEMM's input: quantized once per token (dynamic; on the sending rank with FP8
    # dispatch), or per (row, expert) with the expert's static scale, or not at all (w8a16).
    if not config.quantizes_activations:
        xs = hidden_states[tokens].float()
    elif received is not None:
        xs = received.dequantize()[tokens]
    elif static:
        xs = fake_quantize(hidden_states[tokens], config, input_scale[row_expert, 0].float())
    else:
        xs = fake_quantize(hidden_states, config)[tokens]
    hit = [e for e, c in enumerate(counts) if c]
    gate_up = _blocks_gemm(
        xs, offsets, hit, q_gate_up, gu_scale, gu_block, act_dtype, halves=(inter, gu_scale.shape[1] // 2)
    )
    act = gated_activation(gate_up[:, :inter], gate_up[:, inter:], activation)
    if act_dtype != torch.float32:  # the intermediate in the activation dtype, as GPUs keep it
        act = act.to(act_dtype)
    act_scale = input_scale[row_expert, 1].float() if static else None
    if config.quantizes_activations:
        acts = fake_quantize(act, config, act_scale).contiguous()
    else:
        acts = act.float().contiguous()
    y = _blocks_gemm(acts, offsets, hit, q_down, d_scale, d_block, act_dtype)
    sums.index_add_(0, tokens, y.mul_(slot_weights[:, None]))
    return sums if act_dtype == torch.float32 else sums.to(act_dtype)


def _rows_forward(
    hidden_states,
    received,
    plan,
    q_gate_up,
    gu_scale,
    gu_block,
    q_down,
    d_scale,
    d_block,
    config,
    activation,
    input_scale,
    act_dtype,
):
    """The "rows" strategy: both GEMMs in the row kernels of `moeroute.experts.cpu.fp8`, the
    second adding into the float32 sums; serial kernels when torch has one thread. With
    dynamic float scales (or w8a16), the whole forward is one Numba call
    (`moeroute.experts.cpu.quant_rows`, around the bfloat16-dot tiles or the widened ones)."""
    tokens, slot_weights, offsets, hit, work = plan
    num_tokens, hidden = hidden_states.shape
    inter = q_gate_up.shape[1] // 2
    if hit.shape[0] == 0:
        return torch.zeros(num_tokens, hidden, dtype=act_dtype)
    static = config.activation == "static"
    gu_groups, d_groups = gu_scale.shape[2], d_scale.shape[2]
    threads = cpu_threads()
    quantize = config.quantizes_activations
    bf16_dot = fp8_bf16_dot(
        _bf16_dot(config, act_dtype, hidden, inter, gu_block, d_block), tokens.shape[0], hit.shape[0]
    )
    groups = _fused_groups(config, hidden, inter, gu_groups, d_groups)
    fused = (
        groups is not None
        and received is None
        and not static
        and (config.scale_fmt == "float" or not quantize)
        and act_dtype in (torch.float32, torch.bfloat16)
        and activation in cpu_rows.ACTIVATION_CODES
    )
    if fused:
        # One Numba call from the rows to the output (`moeroute.experts.cpu.quant_rows`): the
        # same steps as below, without the torch calls between them, which cost a decode step
        # as much as a third of its time.
        bits = act_dtype == torch.bfloat16
        x = hidden_states.detach().contiguous()
        out = torch.empty(num_tokens, hidden, dtype=act_dtype)
        args = (
            (x.view(torch.uint16) if bits else x).numpy(),
            tokens,
            slot_weights,
            offsets,
            hit,
            work,
            q_gate_up.view(torch.uint8).numpy(),
            gu_scale.numpy(),
            q_down.view(torch.uint8).numpy(),
            d_scale.numpy(),
            gu_block,
            d_block,
            groups,
            bits,
            _MIN_AMAX,
            cpu_rows.ACTIVATION_CODES[activation],
            quantize,
        )
        result = (out.view(torch.uint16) if bits else out).numpy()
        # One contiguous range of output columns per thread (one thread: all of them), whole
        # packs of weight rows.
        columns = quant_rows.thread_columns(hidden, threads, cpu_fp8.ROW_BLOCK)
        if bf16_dot:
            kernel = quant_rows.rows_experts_fp8_dot_serial if threads == 1 else quant_rows.rows_experts_fp8_dot
        else:
            kernel = quant_rows.rows_experts_fp8_widened_serial if threads == 1 else quant_rows.rows_experts_fp8_widened
        with numba_threads(threads):
            kernel(*args, columns, result)
        return out
    sums = torch.zeros(num_tokens, hidden, dtype=torch.float32)
    if static:  # per (row, expert): the expert's own input scale
        row_expert = torch.from_numpy(np.repeat(np.arange(offsets.shape[0] - 1), np.diff(offsets)))
        q_x, s_x = _quantized_rows(
            hidden_states[torch.from_numpy(tokens)], config, gu_groups, input_scale[row_expert, 0].float()
        )
        x_rows = np.arange(tokens.shape[0])
    elif not quantize:  # w8a16: the rows as they are, unit group scales
        q_x, s_x = hidden_states.float(), torch.ones(num_tokens, gu_groups)
        x_rows = tokens
    elif received is not None:  # quantized once per token on the sending rank (FP8 dispatch)
        q_x, s_x = received.q.float(), received.scales.expand(-1, gu_groups).contiguous()
        x_rows = tokens
    else:  # quantized once per token
        q_x, s_x = _quantized_rows(hidden_states, config, gu_groups)
        x_rows = tokens
    gate_up = torch.empty(tokens.shape[0], 2 * inter, dtype=torch.float32)
    # The bfloat16 dot instructions where the CPU has them and the shapes fit their vectors;
    # else the float32 kernels. One thread: the serial kernels, with no parallel region to start.
    if bf16_dot:
        gate_up_rows, down_rows = (
            (cpu_fp8.gate_up_rows_bf16_serial, cpu_fp8.down_rows_bf16_serial)
            if threads == 1
            else (cpu_fp8.gate_up_rows_bf16, cpu_fp8.down_rows_bf16)
        )
    else:
        gate_up_rows, down_rows = (
            (cpu_fp8.gate_up_rows_serial, cpu_fp8.down_rows_serial)
            if threads == 1
            else (cpu_fp8.gate_up_rows, cpu_fp8.down_rows)
        )
    with numba_threads(threads):
        gate_up_rows(
            (_e4m3_operand(q_x, bf16_dot), s_x.numpy()),
            x_rows,
            offsets,
            work,
            q_gate_up.view(torch.uint8).numpy(),
            (gu_scale.numpy(), inter, gu_block[0], gu_block[1]),
            _NO_BIAS,
            gate_up.numpy(),
        )
        act = gated_activation(gate_up[:, :inter], gate_up[:, inter:], activation)
        # The intermediate rounded to the activation dtype (as GPUs keep it), then quantized (w8a8).
        if quantize:
            q_act, s_act = _quantized_rows(
                act, config, d_groups, input_scale[row_expert, 1].float() if static else None, round_to=act_dtype
            )
        else:
            q_act, s_act = act.to(act_dtype).float(), torch.ones(act.shape[0], d_groups)
        down_rows(
            (_e4m3_operand(q_act, bf16_dot), s_act.numpy()),
            tokens,
            slot_weights,
            offsets,
            hit,
            q_down.view(torch.uint8).numpy(),
            (d_scale.numpy(), hidden, d_block[0], d_block[1]),
            _NO_BIAS,
            sums.numpy(),
        )
    return sums if act_dtype == torch.float32 else sums.to(act_dtype)


def _bf16_dot(config: QuantConfig, act_dtype: torch.dtype, hidden: int, inter: int, gu_block, d_block) -> bool:
    """Whether the row kernels take the bfloat16 dot (`moeroute.experts.cpu.fp8.bf16_dot_serves`).
    w8a16 takes it for bfloat16 activations only: float32 and float16 ones would be rounded to
    bfloat16 on the way in, so they take the exact float32 kernels."""
    served = cpu_fp8.bf16_dot_serves(hidden, inter, gu_block, d_block)
    return served and (config.quantizes_activations or act_dtype == torch.bfloat16)


def _fused_groups(config: QuantConfig, hidden: int, inter: int, gu_groups: int, d_groups: int):
    """The activation group sizes of the two GEMMs' inputs for `moeroute.experts.cpu.quant_rows`, or None where a
    group's scales do not map onto the weight column blocks (one per block, or one per row)."""
    groups = []
    for cols, blocks in ((hidden, gu_groups), (inter, d_groups)):
        group = config.activation_group_size or cols
        if -(-cols // group) not in (1, blocks):
            return None
        groups.append(group)
    return tuple(groups)


def _e4m3_operand(q: torch.Tensor, bf16_dot: bool) -> np.ndarray:
    """Quantized activations (e4m3 values, float32) as the row kernels take them: as they
    are, or for the bfloat16-dot kernels as bfloat16 bits (exact: e4m3 fits bfloat16). w8a16
    operands are the activations themselves (bfloat16 ones only on the bfloat16-dot kernels,
    so exact)."""
    if bf16_dot:
        return q.contiguous().to(torch.bfloat16).view(torch.uint16).numpy()
    return q.contiguous().numpy()


def _quantized_rows(x: torch.Tensor, config: QuantConfig, groups: int, static_scale=None, round_to=None):
    """``(q_a, s_a)`` of activations ``x [M, K]``, the two factors of `fake_quantize`: the e4m3
    values as float32 [M, K] and their scales float32 [M, groups], one per row and weight
    column block (a per-row scale repeated over the blocks). ``round_to``: the dtype ``x`` is
    first rounded to (the activation dtype of the intermediate).

    Dynamic float scales of float32 or bfloat16 values run in one serial Numba pass
    (`moeroute.experts.cpu.fp8.quantize_rows`, bit for bit `quantize_fp8_activations`): at decode
    sizes torch's dozen elementwise ops each start a parallel region, which cost more than
    the arithmetic, the more so when the cores are shared.
    """
    round_to = x.dtype if round_to is None else round_to
    if (
        static_scale is None
        and config.scale_fmt == "float"
        and x.device.type == "cpu"
        and round_to in (torch.float32, torch.bfloat16)
        and x.dtype in (torch.float32, torch.bfloat16)
    ):
        values = x.detach().float().contiguous()  # bfloat16 widened exactly
        group = config.activation_group_size or max(1, x.shape[1])
        q = torch.empty(x.shape, dtype=torch.float32)
        scales = torch.empty(x.shape[0], -(-x.shape[1] // group), dtype=torch.float32)
        cpu_fp8.quantize_rows(
            values.numpy(),
            group,
            round_to == torch.bfloat16 and x.dtype == torch.float32,
            _MIN_AMAX,
            q.numpy(),
            scales.numpy(),
        )
        return q, scales.expand(-1, groups).contiguous()
    if x.dtype != round_to:
        x = x.to(round_to)
    if static_scale is not None:
        q = quantize_fp8_static(x, static_scale[:, None]).float()
        scales = static_scale[:, None]
    else:
        q, scales = quantize_fp8_activations(x, config.activation_group_size, config.scale_fmt)
        q = q.float()
    return q, scales.expand(-1, groups).contiguous()


#: The row kernels' bias argument: none (`moeroute.experts.cpu.tiles`).
_NO_BIAS = np.empty((0, 0), np.float32)
#: `moeroute.quant`'s amax floor as float32 (the dynamic scale's ``max(amax, 1e-10)``).
_MIN_AMAX = np.float32(MIN_AMAX)


def _blocks_gemm(xs, offsets, hit, q, scale, block, dtype, halves=None, decoder=None):
    """[M, R] float32: each expert's rows of ``xs`` times its weight decoded in chunks.

    ``halves`` (I, nb): the weight is gate_up, whose up rows count block rows from row I.
    ``decoder``: "numba" (`moeroute.experts.cpu.fp8.dequantize_rows`, CPU) or "torch" (torch's
    e4m3 conversion, fast on devices); default by the weight's device.
    """
    if decoder is None:
        decoder = "numba" if q.device.type == "cpu" else "torch"
    rows_out = q.shape[1]
    cols = q.shape[2]
    bn, bk = block
    out = torch.empty(xs.shape[0], rows_out, dtype=torch.float32, device=xs.device)
    # The CPU decodes to float32 and multiplies in float32 whatever the activation dtype: a
    # bfloat16 GEMM is much slower than float32 on CPUs without bfloat16
    # instructions. The quantized activations (q_a * s_a, float32) are taken as they are:
    # rounding them to bfloat16 would leave the definition (up to 1.4e-2 of the output's
    # largest value), while the row kernels, which every row count takes on AVX512-BF16,
    # compute it exactly; so every CPU path has one numerics.
    chunk_rows = min(rows_out, max(1, CHUNK_BYTES // (4 * cols)))  # rows need not align to blocks
    buffer = torch.empty(chunk_rows, cols, dtype=torch.float32, device=xs.device)
    x_cast = xs.float() if decoder == "numba" else xs.to(dtype)
    q_bytes = q.view(torch.uint8)
    # Chunks never straddle gate and up (their block rows are numbered apart).
    spans = [(0, rows_out, 0)] if halves is None else [(0, halves[0], 0), (halves[0], rows_out, halves[0])]
    for e in hit:
        start, stop = int(offsets[e]), int(offsets[e + 1])
        x_e = x_cast[start:stop]
        for first, last, origin in spans:
            scale_e = scale[e] if origin == 0 else scale[e, halves[1] :]
            for r0 in range(first, last, chunk_rows):
                r1 = min(last, r0 + chunk_rows)
                w = buffer[: r1 - r0]
                if decoder == "numba":
                    cpu_fp8.dequantize_rows(q_bytes[e].numpy(), scale_e.numpy(), r0, r1, origin, bn, bk, w.numpy())
                else:  # torch's own e4m3 conversion is fast on devices
                    rows = torch.arange(r0, r1, device=q.device) - origin
                    block_scales = scale_e[rows // bn].repeat_interleave(bk, dim=1)[:, :cols]
                    torch.mul(q[e, r0:r1].float(), block_scales, out=w)
                out[start:stop, r0:r1] = torch.mm(x_e, w.t() if decoder == "numba" else w.to(dtype).t())
    return out


def check_quantized_weights(
    quant: QuantConfig,
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    w_gate_up,
    w_down,
    gate_up_scale,
    down_scale,
    input_scale,
    check_values: bool = True,
) -> dict:
    """The full stacked FP8 tensors checked at the boundary; name -> tensor (scales float32).

    ``check_values=False`` checks shapes and dtypes only (no read of the weights' bytes or
    the scales' values).

    Raises
    ------
    TypeError, ValueError
        Naming the argument: a float weight (quantize it first), an FP8 weight without its
        scales, shapes other than `QuantConfig.scale_shapes`, a weight byte that is NaN in
        float8_e4m3fn (0x7F, 0xFF; named with its expert: `moeroute.quant.fp8.check_fp8_weight`),
        scales that are not float32, not finite or not positive, a static scheme without
        ``input_scale`` (or one given to a dynamic layer).
    """
    expected = {
        "w_gate_up": (num_experts, 2 * intermediate_size, hidden_size),
        "w_down": (num_experts, hidden_size, intermediate_size),
    }
    for name, weight in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(weight).__name__}")
        if weight.dtype != FP8_DTYPE:
            raise ValueError(
                f"{name} has dtype {weight.dtype} but the layer has quant={quant.format!r}, "
                "which stores float8_e4m3fn weights with their scales; quantize float weights "
                "with moeroute.quant.quantize_experts"
            )
        if tuple(weight.shape) != expected[name]:
            raise ValueError(f"{name} has shape {tuple(weight.shape)}, expected {list(expected[name])}")
        if check_values:
            check_fp8_weight(name, weight)
    gate_up_shape, down_shape = quant.scale_shapes(num_experts, hidden_size, intermediate_size)
    for name, scale in (("gate_up_scale", gate_up_scale), ("down_scale", down_scale)):
        if scale is None:
            raise ValueError(f"{name} is missing: FP8 weights (quant={quant.format!r}) need their scales")
    tensors = {
        "w_gate_up": w_gate_up,
        "w_down": w_down,
        "gate_up_scale": check_scale("gate_up_scale", gate_up_scale, gate_up_shape, check_values),
        "down_scale": check_scale("down_scale", down_scale, down_shape, check_values),
    }
    if quant.activation == "static":
        if input_scale is None:
            raise ValueError(
                "input_scale is missing: quant activation='static' needs the [N, 2] activation "
                "scales (gate_up input, down input)"
            )
        tensors["input_scale"] = check_scale("input_scale", input_scale, (num_experts, 2), check_values)
    elif input_scale is not None:
        raise ValueError(
            f"input_scale was given but the layer has no static activation scales (QuantConfig "
            f"activation={quant.activation!r})"
        )
    return tensors
