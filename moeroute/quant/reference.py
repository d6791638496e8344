"""Plain-torch definitions of the w8a8 expert numerics, written from the formulas (docs/quant.md).

Slow on purpose (one k-group at a time, float64 where the formula has no rounding): the tests
compare every backend against these. Nothing here is shared with the fast paths, so a
mistake in one does not hide in the other.

fp8_block GEMM of activations x [M, K] with a weight (q_w [N, K] e4m3, s_w [ceil(N/bn),
ceil(K/bk)])::

    s_a[m, g] = max(amax(|x[m, group g]|), 1e-10) / 448        (ue8m0: 2 ** ceil(log2(.)))
    q_a[m, k] = e4m3(clamp(x[m, k] / s_a[m, k // bk], -448, 448))
    y[m, n]   = sum_g s_a[m, g] * s_w[n // bn, g] * dot(q_a[m, group g], q_w[n, group g])

fp8_tensor: one group spanning the row (s_a[m] per token, or a given static scale) and one
weight scale. The expert MLP quantizes both GEMM inputs: the hidden rows, and the
intermediate ``act(gate) * up`` (rounded to the activation dtype first, as GPU kernels do).

w8a16 (fp8_block with activation="none", ``quantize_activations=False`` here): the same
weights, the activations as they are::

    y[m, n]   = sum_k x[m, k] * q_w[n, k] * s_w[n // bn, k // bk]

and the intermediate rounded to the activation dtype, not quantized.

int4 (w4a16) of activations x [M, K] with a weight stored as ``packed`` uint8 [N, K/2]
(element k in the low nibble of byte k // 2 when k is even, the high nibble when odd),
``scales`` [N, K/g] and ``zeros`` uint8 [N, K/g] (None: z = 8)::

    q[n, k] = (packed[n, k // 2] >> (4 * (k % 2))) & 15
    w[n, k] = (q[n, k] - z[n, k // g]) * s[n, k // g]
    y[m, n] = sum_k x[m, k] * w[n, k]                          (activations not quantized)
"""

from __future__ import annotations

import math

import torch

from moeroute._validate import weights_then_ids

__all__ = [
    "fp8_linear_reference",
    "expert_mlp_reference",
    "moe_experts_reference",
    "int4_dequantize_reference",
    "int4_linear_reference",
    "int4_expert_mlp_reference",
    "int4_moe_experts_reference",
]

_E4M3_MAX = 448.0
_AMAX_FLOOR = 1e-10


def _activation_scale(amax: torch.Tensor, ue8m0: bool) -> torch.Tensor:
    scale = torch.maximum(amax, torch.tensor(_AMAX_FLOOR, dtype=amax.dtype)).float() / _E4M3_MAX
    if ue8m0:
        scale = torch.tensor(
            [2.0 ** math.ceil(math.log2(v)) for v in scale.reshape(-1).tolist()], dtype=torch.float32
        ).reshape(scale.shape)
    return scale


def _e4m3(values: torch.Tensor) -> torch.Tensor:
    """Round float values to e4m3 (saturating at 448) and back to float64."""
    return values.clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn).double()


def fp8_linear_reference(
    x: torch.Tensor,
    q_w: torch.Tensor,
    w_scale: torch.Tensor,
    block_size=None,
    scale_fmt: str = "float",
    input_scale=None,
    quantize_activations: bool = True,
) -> torch.Tensor:
    """``y [M, N]`` float32 of the FP8 GEMM of ``x [M, K]`` with ``q_w [N, K]``.

    ``block_size`` (bn, bk) with ``w_scale [ceil(N/bn), ceil(K/bk)]``: fp8_block; None with a
    0-dim ``w_scale``: fp8_tensor (dynamic per token, or ``input_scale`` when given).
    ``quantize_activations=False``: w8a16, ``x`` multiplied as it is (float64 sums).
    """
    x = x.float().cpu()
    q_w = q_w.cpu()
    w_scale = w_scale.float().cpu()
    rows, cols = x.shape
    out_features = q_w.shape[0]
    ue8m0 = scale_fmt == "ue8m0"
    bn, bk = block_size if block_size is not None else (out_features, cols)
    y = torch.zeros(rows, out_features, dtype=torch.float64)
    for g in range(-(-cols // bk)):
        columns = slice(g * bk, min((g + 1) * bk, cols))
        x_g = x[:, columns]
        if block_size is None:
            s_w = w_scale.reshape(()).double().expand(out_features)
        else:
            s_w = w_scale[torch.arange(out_features) // bn, g].double()
        if not quantize_activations:
            y += x_g.double() @ (q_w[:, columns].double() * s_w[:, None]).T
            continue
        if input_scale is not None:
            s_a = torch.full((rows,), float(input_scale), dtype=torch.float32)
        else:
            s_a = _activation_scale(x_g.abs().amax(dim=1), ue8m0)
        q_a = _e4m3(x_g / s_a[:, None])
        dots = q_a @ q_w[:, columns].double().T  # exact: products of e4m3 values, few terms
        y += s_a.double()[:, None] * s_w[None, :] * dots
    return y.float()


def _act(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return gate * torch.sigmoid(gate) * up
    if activation == "gelu":
        return 0.5 * gate * (1 + torch.erf(gate / math.sqrt(2))) * up
    if activation == "gelu_tanh":
        inner = math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)
        return 0.5 * gate * (1 + torch.tanh(inner)) * up
    if activation == "swigluoai":
        gate = gate.clamp(max=7.0)
        return (up.clamp(-7.0, 7.0) + 1) * gate * torch.sigmoid(1.702 * gate)
    raise ValueError(f"activation={activation!r} is unknown")


def expert_mlp_reference(
    x: torch.Tensor,
    q_gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    q_down: torch.Tensor,
    down_scale: torch.Tensor,
    block_size=None,
    scale_fmt: str = "float",
    activation: str = "silu",
    input_scale=None,
    intermediate_dtype: torch.dtype = torch.float32,
    quantize_activations: bool = True,
) -> torch.Tensor:
    """One expert's w8a8 MLP on rows ``x [M, H]``; float32 [M, H].

    ``q_gate_up [2I, H]`` (gate rows first) with ``gate_up_scale`` [2*ceil(I/bn), ceil(H/bk)]
    (fp8_block: the gate's block rows, then the up's) or [2] (fp8_tensor: gate, up);
    ``q_down [H, I]`` with ``down_scale``. ``input_scale``: (gate_up, down) static activation
    scales, or None (dynamic). The intermediate is rounded to ``intermediate_dtype`` before
    it is quantized. ``quantize_activations=False``: the w8a16 MLP (neither input quantized;
    the intermediate still rounded to ``intermediate_dtype``).
    """
    inter = q_gate_up.shape[0] // 2
    static = (None, None) if input_scale is None else input_scale
    halves = []
    for half in range(2):
        rows = slice(half * inter, (half + 1) * inter)
        if block_size is None:
            scale = gate_up_scale[half]
        else:
            nbr = gate_up_scale.shape[0] // 2
            scale = gate_up_scale[half * nbr : (half + 1) * nbr]
        halves.append(
            fp8_linear_reference(x, q_gate_up[rows], scale, block_size, scale_fmt, static[0], quantize_activations)
        )
    act = _act(halves[0], halves[1], activation).to(intermediate_dtype)
    return fp8_linear_reference(act, q_down, down_scale, block_size, scale_fmt, static[1], quantize_activations)


def moe_experts_reference(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    q_gate_up,
    gate_up_scale,
    q_down,
    down_scale,
    block_size=None,
    scale_fmt: str = "float",
    activation: str = "silu",
    input_scale=None,
    intermediate_dtype: torch.dtype = torch.float32,
    quantize_activations: bool = True,
) -> torch.Tensor:
    """``sum_k w[t, k] * expert_{ids[t, k]}(x_t)`` with w8a8 experts (w8a16 with
    ``quantize_activations=False``); float32 [T, H].

    Weights stacked over experts: ``q_gate_up [N, 2I, H]``, ``gate_up_scale [N, ...]``,
    ``q_down [N, H, I]``, ``down_scale [N, ...]``, ``input_scale`` [N, 2] or None. Ids outside
    [0, N) are skipped. The routing pair comes weights then ids, as the ops take it; ids
    first (the order before 0.2) is refused with a TypeError naming ``topk_weights``.
    """
    weights_then_ids(topk_weights, topk_ids)
    tokens = x.shape[0]
    out = torch.zeros(tokens, q_down.shape[1], dtype=torch.float64)
    for e in range(q_gate_up.shape[0]):
        hit = topk_ids == e
        rows = hit.any(dim=1).nonzero().reshape(-1)
        if rows.numel() == 0:
            continue
        static = None if input_scale is None else (float(input_scale[e, 0]), float(input_scale[e, 1]))
        y = expert_mlp_reference(
            x[rows],
            q_gate_up[e],
            gate_up_scale[e],
            q_down[e],
            down_scale[e],
            block_size,
            scale_fmt,
            activation,
            static,
            intermediate_dtype,
            quantize_activations,
        )
        weight = (topk_weights[rows].double() * hit[rows].double()).sum(dim=1)
        out[rows] += weight[:, None] * y.double()
    return out.float()


def int4_dequantize_reference(packed: torch.Tensor, scales: torch.Tensor, zeros, group_size: int) -> torch.Tensor:
    """``w [N, K]`` float64 of one INT4 weight, element by element from the formula above."""
    packed = packed.cpu().to(torch.int64)
    scales = scales.cpu().double()
    rows, cols = packed.shape[0], 2 * packed.shape[1]
    w = torch.empty(rows, cols, dtype=torch.float64)
    for k in range(cols):
        q = (packed[:, k // 2] >> (4 * (k % 2))) & 15
        z = (
            torch.full((rows,), 8, dtype=torch.int64)
            if zeros is None
            else zeros.cpu().to(torch.int64)[:, k // group_size]
        )
        w[:, k] = (q - z).double() * scales[:, k // group_size]
    return w


def int4_linear_reference(x: torch.Tensor, packed, scales, zeros=None, group_size: int = 128) -> torch.Tensor:
    """``y [M, N]`` float32 = ``x [M, K] @ w^T`` with the INT4 weight dequantized, summed in float64."""
    w = int4_dequantize_reference(packed, scales, zeros, group_size)
    return (x.cpu().double() @ w.T).float()


def _int4_parts(weight) -> tuple:
    """(packed, scales, zeros or None) of a (packed, scales[, zeros]) tuple."""
    packed, scales, *rest = weight
    return packed, scales, (rest[0] if rest else None)


def int4_expert_mlp_reference(
    x: torch.Tensor,
    gate_up,
    down,
    group_size: int,
    activation: str = "silu",
    intermediate_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """One expert's w4a16 MLP on rows ``x [M, H]``; float32 [M, H].

    ``gate_up`` = (packed [2I, H/2], scales [2I, H/g][, zeros]) with the gate rows first,
    ``down`` = (packed [H, I/2], scales [H, I/g][, zeros]). The intermediate ``act(gate) *
    up`` is rounded to ``intermediate_dtype`` before the down projection.
    """
    packed, scales, zeros = _int4_parts(gate_up)
    h = int4_linear_reference(x, packed, scales, zeros, group_size).double()
    inter = h.shape[1] // 2
    act = _act(h[:, :inter], h[:, inter:], activation).to(intermediate_dtype)
    packed, scales, zeros = _int4_parts(down)
    return int4_linear_reference(act, packed, scales, zeros, group_size)


def int4_moe_experts_reference(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up,
    down,
    group_size: int,
    activation: str = "silu",
    intermediate_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``sum_k w[t, k] * expert_{ids[t, k]}(x_t)`` with w4a16 experts; float32 [T, H].

    ``gate_up`` and ``down``: (packed, scales[, zeros]) stacked over experts ([N, 2I, H/2],
    [N, 2I, H/g], ... and [N, H, I/2], [N, H, I/g], ...). Ids outside [0, N) are skipped.
    The routing pair comes weights then ids; ids first is refused with a TypeError.
    """
    weights_then_ids(topk_weights, topk_ids)
    gate_up, down = _int4_parts(gate_up), _int4_parts(down)
    out = torch.zeros(x.shape[0], down[0].shape[1], dtype=torch.float64)
    for e in range(gate_up[0].shape[0]):
        hit = topk_ids == e
        rows = hit.any(dim=1).nonzero().reshape(-1)
        if rows.numel() == 0:
            continue
        expert = [tuple(t[e] for t in weight if t is not None) for weight in (gate_up, down)]
        y = int4_expert_mlp_reference(x[rows], expert[0], expert[1], group_size, activation, intermediate_dtype)
        weight = (topk_weights[rows].double() * hit[rows].double()).sum(dim=1)
        out[rows] += weight[:, None] * y.double()
    return out.float()
