"""INT4 (w4a16) expert compute: group-quantized 4-bit weights, decoded inside the expert loop.

For the rows one rank received (``[Tr, H]`` with local expert ids and weights), computes
``sum_k w_k * expert_k(x)`` for gated-MLP experts whose weights are INT4
(`moeroute.quant.int4`: packed uint8 [L, N, K/2], scales [L, N, K/g], zero points uint8
[L, N, K/g] when asymmetric; ``w = (q - z) * s``). The activations stay in their dtype
(bfloat16, float16 or float32); sums are float32; the intermediate ``act(gate) * up`` is
rounded to the activations' dtype before the down projection, as the float layer keeps it.

Two CPU strategies, both on the MXFP4 machinery (INT4's packed bytes are MXFP4's blocks,
`moeroute.experts.cpu.int4`):

* "rows" ("auto" on the CPU; for bfloat16 activations where the CPU has bfloat16 dot
  instructions only up to `choose.int4_rows_bound` mean rows per hit expert): each packed
  weight row is read once, half a byte per weight. With bfloat16 activations and H and I
  multiples of 128, the whole forward is one Numba call on the tiles of
  `moeroute.experts.cpu.int4_dot` (symmetric or asymmetric weights;
  `moeroute.experts.cpu.quant_rows.rows_experts_int4_quad`): the bfloat16 dot instruction with
  AVX512-BF16 at every row count, float32 FMAs on the other vector paths below
  `int4_dot.FMA_MAX_MEAN_ROWS` mean rows per hit expert. Otherwise, with AVX512-BF16, bfloat16
  activations and symmetric weights, the tiles of `moeroute.experts.cpu.mxfp4_dot` with
  INT4's table and scales, in one call too (`rows_experts_int4`). Elsewhere few rows per
  expert decode each row in registers per tile of four rows (`moeroute.experts.cpu.int4`'s
  row kernels, MXFP4's in-register block dot with INT4's rule); from `DECODED_MIN_ROWS` mean
  rows on, each weight row is decoded once into cache and dotted with all of its expert's
  rows by the float32 row kernels (`moeroute.experts.cpu.mxfp4_rows`), which beat float32
  "blocks" at prefill sizes too (the decoded row stays in cache for all the rows; "blocks"
  writes and reads back every decoded chunk and pays torch's per-expert GEMM calls).
* "blocks": per hit expert, `CHUNK_BYTES` of weight rows at a time are decoded into one
  float32 buffer and multiplied with torch (a float32 GEMM: bfloat16 activations are exact
  in it). bfloat16 activations on a CPU with bfloat16 dot instructions (`bf16_blocks`) take
  `BF16_CHUNK_BYTES` of rows decoded to bfloat16 (`moeroute.experts.cpu.decode_bf16`) and
  oneDNN's bfloat16 GEMM instead, which "auto" picks past `choose.int4_rows_bound` mean rows
  per hit expert. On another device than the CPU the decode is torch's (`decode_int4`).

GPTQ act order on gate/up (``gate_up_perm``, one hidden-column order per expert): the
gate_up GEMM reads each routed row's activations gathered in its expert's order, built once
per call in expert-sorted order (`act_order_rows`) and handed to the same kernels with
identity token indices; the CPU's one-call forward and the CUDA kernels are not used then.
Without it nothing changes.

The kernels take the scales (and zero points) as one array per weight (`params`). Scales
without zero points are viewed as they are held, no copy: float32, and where the vector
kernels run (`moeroute.experts.cpu.mxfp4.SIMD`) bfloat16 (its bits) and float16 too, which
they widen to float32 as they read them. Otherwise (zero points, or 16-bit scales on the
generic path) the hit experts' entries are converted to float32 each call (1/g of their
weights).
"""

from __future__ import annotations

import numpy as np
import torch

from moeroute._validate import weights_then_ids
from moeroute import routing
from moeroute.experts.activations import gated_activation
from moeroute.experts.choose import STRATEGIES, check_strategy, choose, cupy_installed
from moeroute import cpu_features
from moeroute.experts.cpu import decode_bf16
from moeroute.experts.cpu import act_order as cpu_act_order
from moeroute.experts.cpu import int4 as cpu_int4
from moeroute.experts.cpu import mxfp4 as cpu_mxfp4
from moeroute.experts.cpu import mxfp4_dot, mxfp4_rows, quant_rows
from moeroute.experts.cpu import rows as cpu_rows
from moeroute.experts.formats.unquantized import bias_view, check_same_device, numba_threads
from moeroute.experts.formats.mxfp4 import DECODED_MIN_ROWS, split_rows
from moeroute.quant import QuantConfig, check_int4
from moeroute.quant.int4 import decode_int4
from moeroute.routing.threads import cpu_threads

__all__ = ["int4_experts_forward", "act_order_rows", "check_int4_weights", "INT4_STRATEGIES", "CHUNK_BYTES"]

#: CPU strategies ("auto" first).
INT4_STRATEGIES = STRATEGIES["int4"]
#: Bytes of decoded weights per chunk of the "blocks" strategy (one reusable buffer).
CHUNK_BYTES = 16 << 20
#: Bytes of decoded bfloat16 weights per chunk where "blocks" runs oneDNN's bfloat16 GEMMs
#: (`bf16_blocks`): within the last-level cache, and few chunks per expert, since each one
#: hands the cores from Numba's threads (the decode) to torch's (the GEMM) and back.
BF16_CHUNK_BYTES = 16 << 20


def int4_experts_forward(
    hidden_states: torch.Tensor,
    weights: torch.Tensor,
    local_ids: torch.Tensor,
    gate_up: tuple,
    down: tuple,
    group_size: int,
    activation: str = "silu",
    strategy: str = "auto",
    *,
    gate_up_perm: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weighted sum of each row's local INT4 experts.

    Parameters
    ----------
    hidden_states : Tensor [Tr, H] float32/bfloat16/float16
    weights : Tensor [Tr, K'] float32
    local_ids : Tensor [Tr, K'] integer; ids outside [0, L) are not computed here
    gate_up : (packed uint8 [L, 2I, H/2], scales [L, 2I, H/g][, zeros uint8 [L, 2I, H/g]])
        gate rows first; zeros absent or None: symmetric (z = 8)
    down : (packed [L, H, I/2], scales [L, H, I/g][, zeros])
    group_size : {32, 64, 128}
    activation : str
    strategy : {"auto", "rows", "blocks"}
        On a CUDA device every strategy but "blocks" runs `moeroute.gpu.fused_experts` (the
        INT4 kernels) where CuPy is installed; otherwise, and on other devices, "blocks".
    gate_up_perm : Tensor int32/int64 [L, H], optional
        GPTQ act order on gate/up: expert l's gate_up columns are the hidden columns
        ``gate_up_perm[l]``, so its rows multiply ``x[gate_up_perm[l]]`` (`act_order_rows`;
        the CUDA kernels and the CPU's one-call forward are then not used).

    Returns
    -------
    Tensor [Tr, H], dtype of ``hidden_states``, accumulated in float32.

    Raises
    ------
    ValueError
        An unknown ``strategy``; tensors that are not an INT4 weight (`check_int4`, shapes
        that do not fit ``hidden_states``); a tensor on another device.
    """
    weights_then_ids(weights, local_ids, "weights", "local_ids")
    check_strategy("strategy", strategy, "int4")
    gate_up, down = _parts("gate_up", gate_up), _parts("down", down)
    check_int4(*gate_up, group_size=group_size, name="gate_up")
    check_int4(*down, group_size=group_size, name="down")
    num_tokens, hidden = hidden_states.shape
    num_experts, two_inter = gate_up[0].shape[:2]
    inter = two_inter // 2
    if gate_up[0].dim() != 3 or tuple(gate_up[0].shape) != (num_experts, two_inter, hidden // 2):
        raise ValueError(
            f"gate_up packed has shape {tuple(gate_up[0].shape)}; hidden_states [{num_tokens}, {hidden}] "
            f"need [L, 2I, {hidden // 2}]"
        )
    if tuple(down[0].shape) != (num_experts, hidden, inter // 2):
        raise ValueError(f"down packed has shape {tuple(down[0].shape)}, expected {[num_experts, hidden, inter // 2]}")
    check_same_device(
        "hidden_states",
        hidden_states,
        weights=weights,
        local_ids=local_ids,
        **{f"gate_up[{i}]": t for i, t in enumerate(gate_up) if t is not None},
        **{f"down[{i}]": t for i, t in enumerate(down) if t is not None},
    )
    dtype, device = hidden_states.dtype, hidden_states.device
    if gate_up_perm is not None and tuple(gate_up_perm.shape) != (num_experts, hidden):
        raise ValueError(
            f"gate_up_perm has shape {tuple(gate_up_perm.shape)}, expected {[num_experts, hidden]} (one hidden-column "
            "order per expert)"
        )
    if device.type != "cpu" and gate_up_perm is None:
        # A CUDA device where CuPy is installed takes the INT4 CUDA kernels; else the torch "blocks".
        cuda_kernels = device.type == "cuda" and cupy_installed()
        if choose("int4", "cuda", strategy=strategy, cuda_kernels=cuda_kernels) == "cuda":
            from moeroute.gpu import fused_experts

            return fused_experts(
                hidden_states.contiguous(),
                tuple(t.contiguous() for t in gate_up if t is not None),
                tuple(t.contiguous() for t in down if t is not None),
                weights.to(torch.float32).contiguous(),
                local_ids.to(torch.int32).contiguous(),
                activation=activation,
                quant=QuantConfig("int4", group_size=group_size, symmetric=gate_up[2] is None),
            )
    top_k = local_ids.shape[1]
    backend = "cpu" if device.type == "cpu" else "cuda"
    if backend == "cpu":
        plan = cpu_rows.plan_rows(
            local_ids.detach().contiguous().numpy(),
            weights.detach().to(torch.float32).contiguous().numpy(),
            num_experts,
            -(-two_inter // cpu_mxfp4.ROW_BLOCK),
        )
        tokens, slot_weights, offsets = (torch.from_numpy(a) for a in plan[:3])
        counts, hit = np.diff(plan[2]).tolist(), plan[3].tolist()  # NumPy: a decode step's overhead
    else:
        sorted_slots, expert_offsets, _ = routing.sort_by_expert(local_ids.detach().contiguous(), num_experts)
        offsets = expert_offsets.to(torch.int64).cpu()
        slots = sorted_slots.to(torch.int64)
        tokens = slots // top_k
        slot_weights = weights.reshape(-1).to(torch.float32)[slots].contiguous()
        counts = (offsets[1:] - offsets[:-1]).tolist()
        hit = [e for e, c in enumerate(counts) if c]
    strategy = choose("int4", backend, counts, strategy=strategy, dtype=dtype)
    if not hit:
        return torch.zeros(num_tokens, hidden, dtype=dtype, device=device)
    if strategy == "rows":
        return _rows_forward(hidden_states, plan, gate_up, down, activation, gate_up_perm)
    sums = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=device)
    x_rows, x_tokens = act_order_rows(hidden_states, tokens, offsets, hit, gate_up_perm)
    h = _blocks_gemm(x_rows, offsets, hit, gate_up, group_size, dtype, rows=x_tokens)
    act = gated_activation(h[:, :inter], h[:, inter:], activation)
    if dtype != torch.float32:  # the intermediate in the activation dtype, as the float layer keeps it
        act = act.to(dtype)
    y = _blocks_gemm(act, offsets, hit, down, group_size, dtype)
    sums.index_add_(0, tokens, y.mul_(slot_weights[:, None]))
    return sums if dtype == torch.float32 else sums.to(dtype)


def _parts(name: str, weight) -> tuple:
    """(packed, scales, zeros or None) of a (packed, scales[, zeros]) tuple."""
    if isinstance(weight, torch.Tensor) or not isinstance(weight, (tuple, list)) or len(weight) not in (2, 3):
        raise TypeError(
            f"{name} must be a (packed, scales) or (packed, scales, zeros) tuple of tensors for INT4 weights, "
            f"got {type(weight).__name__}"
        )
    packed, scales, *rest = weight
    return packed, scales, (rest[0] if rest else None)


def kernel_params(scales: torch.Tensor, zeros, experts) -> np.ndarray:
    """[L, N, P, K/g] of the kernels (`moeroute.experts.cpu.int4`): the scales and, with zero
    points (P = 2), the zero points as floats. Scales without zero points are viewed (no copy):
    float32, and where `cpu_mxfp4.SIMD` bfloat16 (its bits as uint16) and float16 (its bits as
    int16, `cpu_int4.SCALE_TYPES`); otherwise a
    float32 array of which only ``experts``' entries are written."""
    if zeros is None and (scales.dtype == torch.float32 or (cpu_mxfp4.SIMD and scales.dtype in _WIDENED)):
        view = scales.detach().contiguous().unsqueeze(2)
        if view.dtype == torch.bfloat16:
            return view.view(torch.int16).numpy().view(np.uint16)
        return view.view(torch.int16).numpy() if view.dtype == torch.float16 else view.numpy()
    parts = 1 if zeros is None else 2
    params = torch.empty(*scales.shape[:2], parts, scales.shape[2], dtype=torch.float32)
    index = torch.as_tensor(experts, dtype=torch.int64)
    params[index, :, 0] = scales.detach()[index].float()
    if zeros is not None:
        params[index, :, 1] = zeros.detach()[index].float()
    return params.numpy()


#: 16-bit scale dtypes the vector kernels read as they are held (`cpu_int4.SCALE_TYPES`).
_WIDENED = (torch.bfloat16, torch.float16)


def _blocks_view(packed: torch.Tensor) -> np.ndarray:
    """packed [L, N, K/2] as the MXFP4 blocks [L, N, K/32, 16] (the same bytes)."""
    packed = packed.detach().contiguous()
    return packed.view(*packed.shape[:2], packed.shape[2] // 16, 16).numpy()


def act_order_rows(hidden_states, tokens, offsets, hit, perm):
    """(rows, row tokens) the gate_up GEMM reads: row m of the expert-sorted slots is
    ``rows[row_tokens[m]]``. Without ``perm`` the hidden states and ``tokens`` as they are;
    with GPTQ act order (``perm`` [L, H], `int4_experts_forward`) each slot's token row
    gathered in its expert's column order, ``x[tokens[m]][perm[e]]``, once per call (an [M, H]
    copy; `moeroute.experts.cpu.act_order` on the CPU), with identity tokens. ``hit``: the
    experts with rows (the others' offsets are empty)."""
    if perm is None:
        return hidden_states, tokens
    device = hidden_states.device
    tokens = torch.as_tensor(tokens).to(device=device, dtype=torch.int64)
    offsets = torch.as_tensor(offsets).to(device=device, dtype=torch.int64)
    row_expert = torch.repeat_interleave(torch.arange(offsets.shape[0] - 1, device=device), offsets.diff())
    rows = torch.empty(tokens.shape[0], hidden_states.shape[1], dtype=hidden_states.dtype, device=device)
    if device.type == "cpu":
        bits = {2: torch.int16, 4: torch.int32}[hidden_states.element_size()]
        arrays = (
            hidden_states.detach().contiguous().view(bits).numpy(),
            tokens.numpy(),
            row_expert.numpy(),
            perm.detach().to(torch.int32).contiguous().numpy(),
            rows.view(bits).numpy(),
        )
        if rows.numel() < cpu_act_order.SERIAL_ELEMENTS:
            cpu_act_order.gather_columns_serial(*arrays)
        else:
            with numba_threads(cpu_threads()):
                cpu_act_order.gather_columns(*arrays)
    else:
        index = perm.to(device).index_select(0, row_expert).to(torch.int64)
        torch.gather(hidden_states.index_select(0, tokens), 1, index, out=rows)
    return rows, torch.arange(tokens.shape[0], dtype=torch.int64, device=device)


def _rows_forward(hidden_states, plan, gate_up, down, activation, gate_up_perm=None):
    """The "rows" strategy: MXFP4's row kernels with INT4's decode and block dots."""
    tokens, slot_weights, offsets, hit, work = plan
    num_tokens, hidden = hidden_states.shape
    inter = gate_up[0].shape[1] // 2
    dtype = hidden_states.dtype
    threads = cpu_threads()
    experts = hit.tolist()
    no_bias = bias_view(None)
    gate_up_params = kernel_params(gate_up[1], gate_up[2], experts)
    down_params = kernel_params(down[1], down[2], experts)
    mean_rows = tokens.shape[0] / max(1, hit.shape[0])
    tile = gate_up_perm is None and _tile_serves(dtype, hidden, inter, gate_up, down, mean_rows)
    if tile and activation in cpu_rows.ACTIVATION_CODES:
        # the whole forward in one call on the tiles (bfloat16 dot, or FMAs at few rows per expert)
        out = torch.empty(num_tokens, hidden, dtype=dtype)
        if cpu_int4.quad_tile_serves(True, hidden, inter, mean_rows):
            kernel = quant_rows.rows_experts_int4_quad_serial if threads == 1 else quant_rows.rows_experts_int4_quad
        else:
            kernel = quant_rows.rows_experts_int4_serial if threads == 1 else quant_rows.rows_experts_int4
        with numba_threads(threads):
            kernel(
                hidden_states.detach().contiguous().view(torch.uint16).numpy(),
                tokens,
                slot_weights,
                offsets,
                hit,
                work,
                _blocks_view(gate_up[0]),
                gate_up_params,
                _blocks_view(down[0]),
                down_params,
                no_bias,
                no_bias,
                cpu_rows.ACTIVATION_CODES[activation],
                quant_rows.thread_columns(hidden, threads, mxfp4_dot.ROW_TILE),
                out.view(torch.uint16).numpy(),
            )
        return out
    # Few rows per expert: each packed row decoded in registers per tile of rows
    # (`cpu_int4.gate_up_rows`); more: each decoded once into cache for all of them.
    kernels = mxfp4_rows if tokens.shape[0] >= DECODED_MIN_ROWS * hit.shape[0] else cpu_int4
    gate_up_rows, down_rows = (
        (kernels.gate_up_rows_serial, kernels.down_rows_serial)
        if threads == 1
        else (kernels.gate_up_rows, kernels.down_rows)
    )
    sums = torch.zeros(num_tokens, hidden, dtype=torch.float32)
    h = torch.empty(tokens.shape[0], 2 * inter, dtype=torch.float32)
    x_rows, x_tokens = act_order_rows(hidden_states, torch.from_numpy(tokens), offsets, hit, gate_up_perm)
    with numba_threads(threads):
        gate_up_rows(
            split_rows(x_rows),
            x_tokens.numpy(),
            offsets,
            work,
            _blocks_view(gate_up[0]),
            gate_up_params,
            no_bias,
            h.numpy(),
        )
        act = gated_activation(h[:, :inter], h[:, inter:], activation)
        if dtype != torch.float32:  # the intermediate in the activation dtype, as the float layer keeps it
            act = act.to(dtype)
        down_rows(
            split_rows(act),
            tokens,
            slot_weights,
            offsets,
            hit,
            _blocks_view(down[0]),
            down_params,
            no_bias,
            sums.numpy(),
        )
    return sums if dtype == torch.float32 else sums.to(dtype)


def _tile_serves(dtype, hidden, inter, gate_up, down, mean_rows) -> bool:
    """Whether the tiles of the one-call forward compute this call, at ``mean_rows`` rows per
    hit expert (`cpu_int4.tile_serves`)."""
    symmetric = gate_up[2] is None and down[2] is None
    return cpu_int4.tile_serves(dtype == torch.bfloat16, hidden, inter, symmetric, mean_rows)


def bf16_blocks(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether "blocks" decodes to bfloat16 for oneDNN's bfloat16 GEMMs: bfloat16 activations
    on a CPU (on the path in use) with bfloat16 dot instructions; else it decodes to float32."""
    return dtype == torch.bfloat16 and device.type == "cpu" and cpu_features.BFLOAT16_INSTRUCTIONS


def _split_bf16(xs: torch.Tensor) -> torch.Tensor:
    """bfloat16 rows [M, K] in `split_blocks` order (per block of 32 columns its 16 even then
    its 16 odd ones), the order `decode_bf16` writes the weights in."""
    rows, cols = xs.shape
    return xs.reshape(rows, cols // 32, 16, 2).transpose(2, 3).reshape(rows, cols).contiguous()


def _blocks_gemm_bf16(x, offsets, hit, weight):
    """`_blocks_gemm` on oneDNN's bfloat16 GEMMs, ``x`` the bfloat16 rows in `_split_bf16`
    order: each chunk of `BF16_CHUNK_BYTES` of weight rows decoded to bfloat16 in parallel
    (`decode_bf16`), then multiplied with the expert's rows (bfloat16 results, float32 sums
    inside the GEMM), written straight into one bfloat16 result and widened to float32 once at
    the end (exactly: they are bfloat16 values)."""
    packed, scales, zeros = weight
    rows_out, cols = packed.shape[1], 2 * packed.shape[2]
    out = torch.empty(x.shape[0], rows_out, dtype=torch.bfloat16)
    chunk_rows = min(rows_out, max(1, BF16_CHUNK_BYTES // (2 * cols)))
    buffer = torch.empty(chunk_rows, cols, dtype=torch.bfloat16)
    bits = buffer.view(torch.uint16).numpy()
    blocks, params = _blocks_view(packed), kernel_params(scales, zeros, hit)
    with numba_threads(cpu_threads()):
        for e in hit:
            start, stop = int(offsets[e]), int(offsets[e + 1])
            x_e = x[start:stop]
            for r0 in range(0, rows_out, chunk_rows):
                r1 = min(rows_out, r0 + chunk_rows)
                decode_bf16.dequantize_rows_bf16(blocks[e], params[e], r0, r1, bits)
                torch.mm(x_e, buffer[: r1 - r0].t(), out=out[start:stop, r0:r1])
    return out.float()


def _blocks_gemm(xs, offsets, hit, weight, group_size, dtype, rows=None):
    """[M, R] float32: each hit expert's rows of ``xs`` (of ``xs[rows]`` where ``rows`` is
    given) times its weight decoded in chunks. On the CPU both operands are in `split_blocks`
    order, the order the decode writes: the columns of ``xs`` are put in it before ``rows``
    gathers them (a prefill's top-k rows are K times as many to reorder)."""
    if bf16_blocks(dtype, xs.device):
        x = _split_bf16(xs.to(torch.bfloat16))
        return _blocks_gemm_bf16(x if rows is None else x[rows], offsets, hit, weight)
    packed, scales, zeros = weight
    rows_out, cols = packed.shape[1], 2 * packed.shape[2]
    on_cpu = packed.device.type == "cpu"
    chunk_rows = min(rows_out, max(1, CHUNK_BYTES // (4 * cols)))
    buffer = torch.empty(chunk_rows, cols, dtype=torch.float32, device=xs.device)
    x_cast = xs.to(dtype)
    if on_cpu:
        x_cast = torch.from_numpy(split_rows(x_cast))
        blocks, params = _blocks_view(packed), kernel_params(scales, zeros, hit)
    if rows is not None:
        x_cast = x_cast[rows]
    out = torch.empty(x_cast.shape[0], rows_out, dtype=torch.float32, device=xs.device)
    for e in hit:
        start, stop = int(offsets[e]), int(offsets[e + 1])
        x_e = x_cast[start:stop]
        for r0 in range(0, rows_out, chunk_rows):
            r1 = min(rows_out, r0 + chunk_rows)
            w = buffer[: r1 - r0]
            if on_cpu:
                cpu_int4.dequantize_rows_split(blocks[e], params[e], r0, r1, w.numpy())
                out[start:stop, r0:r1] = torch.mm(x_e, w.t())
            else:
                z = None if zeros is None else zeros[e, r0:r1]
                w.copy_(decode_int4(packed[e, r0:r1], scales[e, r0:r1], z, group_size))
                out[start:stop, r0:r1] = torch.mm(x_e, w.to(dtype).t())
    return out


def check_int4_weights(
    quant: QuantConfig, num_experts: int, hidden_size: int, intermediate_size: int, w_gate_up, w_down
) -> dict:
    """The full stacked INT4 weights checked at the boundary; name -> tensor of the layer.

    ``w_gate_up`` and ``w_down`` are what `moeroute.quant.quantize_int4` returns:
    ``(packed, scales)`` when ``quant.symmetric``, ``(packed, scales, zeros)`` otherwise
    (gate rows first), with ``quant.group_size``.

    Raises
    ------
    TypeError, ValueError
        Naming the argument: a float weight (quantize it first: `quantize_int4`), a tuple of
        the wrong length for ``quant.symmetric``, shapes other than the layer's.
    """
    gate_up_shape, down_shape = quant.scale_shapes(num_experts, hidden_size, intermediate_size)
    want = 2 if quant.symmetric else 3
    what = "(packed, scales)" if quant.symmetric else "(packed, scales, zeros)"
    tensors = {}
    for name, weight, scale_shape in (("w_gate_up", w_gate_up, gate_up_shape), ("w_down", w_down, down_shape)):
        if isinstance(weight, torch.Tensor):
            raise ValueError(
                f"{name} is a {weight.dtype} tensor but the layer has quant='int4', which stores {what} tuples; "
                "quantize float weights with moeroute.quant.quantize_int4"
            )
        if not isinstance(weight, (tuple, list)) or len(weight) != want:
            got = f"a tuple of {len(weight)}" if isinstance(weight, (tuple, list)) else type(weight).__name__
            raise ValueError(
                f"{name} must be a {what} tuple with quant=QuantConfig('int4', symmetric={quant.symmetric}), got {got}"
            )
        packed, scales, zeros = _parts(name, weight)
        check_int4(packed, scales, zeros, group_size=quant.group_size, name=name)
        expected = (*scale_shape[:2], scale_shape[2] * quant.group_size // 2)
        if tuple(packed.shape) != expected:
            raise ValueError(f"{name} packed has shape {tuple(packed.shape)}, expected {list(expected)}")
        prefix = "gate_up" if name == "w_gate_up" else "down"
        tensors[name] = packed
        tensors[f"{prefix}_scale"] = scales
        if zeros is not None:
            tensors[f"{prefix}_zero"] = zeros
    return tensors
