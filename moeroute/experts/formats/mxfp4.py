"""MXFP4 (w4a16) expert compute: the packed gpt-oss weights, decoded inside the expert loop.

For the rows one rank received (``[Tr, H]`` with local expert ids and weights), computes
``sum_k w_k * expert_k(x)`` where each expert is the gated MLP (with the gpt-oss biases when
present) over weights stored as MXFP4 blocks and scale bytes (`moeroute.quant.mxfp4`). The
activations stay in their dtype (bfloat16, float16 or float32); sums are float32.

The packed bytes are never dequantized whole. Two strategies:

* "rows" (every CPU call under "auto"): each packed weight row is read once. With few rows
  per expert, the Numba kernels of `moeroute.experts.cpu.mxfp4` decode its nibbles in
  registers (AVX2 where the CPU has it) and dot them with up to four of the expert's rows
  per pass (on a CPU with AVX512-BF16 and bfloat16 activations, `moeroute.experts.cpu.mxfp4_dot`
  at every row count: the e2m1 values and the activations as bfloat16, multiplied with the
  bfloat16 dot instruction); elsewhere, from `DECODED_MIN_ROWS` rows per hit expert on,
  `moeroute.experts.cpu.mxfp4_rows`
  decodes each weight row once into cache and the float32 row kernels dot it with all of
  them. Memory reads half a byte per weight. The biases and the combine happen inside the
  kernels, and the bookkeeping is one Numba pass (`moeroute.experts.cpu.rows.plan_rows`),
  as for the float row kernels.
* "blocks" (on request, and on a device without CuPy): per expert, `CHUNK_BYTES` of weight
  rows at a time are decoded into one reusable float32 buffer and multiplied with torch (a
  float32 GEMM on the CPU: the bfloat16 activations are exact in it). On a device the decode
  is torch's (`decode_mxfp4`).

CUDA (and ROCm) tensors under "auto" run the w4a16 grouped GEMMs of `moeroute.gpu`
(kernels/moe_gemm_mxfp4.cu: the nibbles decoded in registers, never a dequantized weight),
on torch's current stream. Only when CuPy is not installed do they fall back to "blocks".
"""

from __future__ import annotations

import numpy as np
import torch

from moeroute._validate import weights_then_ids
from moeroute.experts.cpu import mxfp4_rows
from moeroute.experts.cpu import quant_rows
from moeroute.experts.cpu import rows as cpu_rows
from moeroute.experts.activations import gated_activation
from moeroute.experts.formats.unquantized import bias_view, numba_threads, check_same_device
from moeroute.experts.choose import STRATEGIES, check_strategy, choose, cupy_installed
from moeroute.quant import QuantConfig, check_mxfp4
from moeroute.experts.cpu import mxfp4_dot
from moeroute.experts.cpu import mxfp4 as cpu_mxfp4
from moeroute.quant.mxfp4 import decode_mxfp4
from moeroute import routing
from moeroute.routing.threads import cpu_threads

__all__ = [
    "mxfp4_experts_forward",
    "check_mxfp4_weights",
    "MXFP4_STRATEGIES",
    "CHUNK_BYTES",
    "map_gpt_oss_mxfp4_keys",
    "gate_rows_first",
    "split_rows",
    "GPT_OSS_MXFP4_KEYS",
]

#: CPU strategies; "auto" picks per call as the FP8 experts do.
MXFP4_STRATEGIES = STRATEGIES["mxfp4"]
#: Bytes of decoded weights per chunk of the "blocks" strategy (one reusable buffer).
CHUNK_BYTES = 16 << 20
#: Mean rows per hit expert from which the row strategy decodes each weight row once into
#: cache (`moeroute.experts.cpu.mxfp4_rows`) instead of once per tile of four rows.
DECODED_MIN_ROWS = 12


def mxfp4_experts_forward(
    hidden_states: torch.Tensor,
    weights: torch.Tensor,
    local_ids: torch.Tensor,
    gate_up_blocks: torch.Tensor,
    gate_up_scales: torch.Tensor,
    down_blocks: torch.Tensor,
    down_scales: torch.Tensor,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    activation: str = "silu",
    strategy: str = "auto",
) -> torch.Tensor:
    """Weighted sum of each row's local MXFP4 experts.

    Parameters
    ----------
    hidden_states : Tensor [Tr, H] float32/bfloat16/float16
    weights : Tensor [Tr, K'] float32
    local_ids : Tensor [Tr, K'] int32; ids outside [0, L) are not computed here
    gate_up_blocks : Tensor [L, 2I, H/32, 16] uint8 (gate rows first)
    gate_up_scales : Tensor [L, 2I, H/32] uint8
    down_blocks : Tensor [L, H, I/32, 16] uint8
    down_scales : Tensor [L, H, I/32] uint8
    gate_up_bias : Tensor [L, 2I] float32, optional
    down_bias : Tensor [L, H] float32, optional
    activation : str
    strategy : {"auto", "rows", "blocks"}
        On CUDA tensors "auto" runs `moeroute.gpu.fused_experts` (the MXFP4 kernels) when CuPy
        is installed, else "blocks".

    Returns
    -------
    Tensor [Tr, H], dtype of ``hidden_states``, accumulated in float32.

    Raises
    ------
    ValueError
        An unknown ``strategy``; a tensor on another device than ``hidden_states``.
    """
    weights_then_ids(weights, local_ids, "weights", "local_ids")
    check_strategy("strategy", strategy, "mxfp4")
    check_same_device(
        "hidden_states",
        hidden_states,
        weights=weights,
        local_ids=local_ids,
        gate_up_blocks=gate_up_blocks,
        gate_up_scales=gate_up_scales,
        down_blocks=down_blocks,
        down_scales=down_scales,
        gate_up_bias=gate_up_bias,
        down_bias=down_bias,
    )
    num_tokens, hidden = hidden_states.shape
    num_experts, two_inter = gate_up_blocks.shape[:2]
    inter = two_inter // 2
    top_k = local_ids.shape[1]
    dtype, device = hidden_states.dtype, hidden_states.device
    # Another device than the CPU takes the CUDA kernels where it is a CUDA device and CuPy is
    # installed, else the torch "blocks".
    backend, cuda_kernels = (
        ("cpu", False) if device.type == "cpu" else ("cuda", device.type == "cuda" and cupy_installed())
    )
    strategy = choose("mxfp4", backend, strategy=strategy, cuda_kernels=cuda_kernels)
    if strategy == "cuda":
        from moeroute.gpu import fused_experts

        return fused_experts(
            hidden_states.contiguous(),
            (gate_up_blocks.contiguous(), gate_up_scales.contiguous()),
            (down_blocks.contiguous(), down_scales.contiguous()),
            weights.to(torch.float32).contiguous(),
            local_ids.to(torch.int32).contiguous(),
            activation=activation,
            gate_up_bias=gate_up_bias,
            down_bias=down_bias,
            quant=QuantConfig(format="mxfp4"),
        )
    if strategy == "rows":
        blocks_per_expert = -(-two_inter // cpu_mxfp4.ROW_BLOCK)
        plan = cpu_rows.plan_rows(
            local_ids.detach().contiguous().numpy(),
            weights.detach().to(torch.float32).contiguous().numpy(),
            num_experts,
            blocks_per_expert,
        )
        return _rows_forward(
            hidden_states,
            plan,
            gate_up_blocks,
            gate_up_scales,
            down_blocks,
            down_scales,
            gate_up_bias,
            down_bias,
            activation,
        )
    sorted_slots, expert_offsets, _ = routing.sort_by_expert(local_ids.detach().contiguous(), num_experts)
    offsets = expert_offsets.to(torch.int64)
    counts = (offsets[1:] - offsets[:-1]).tolist()
    slots = sorted_slots.to(torch.int64)
    tokens = slots // top_k
    slot_weights = weights.reshape(-1).to(torch.float32)[slots].contiguous()
    sums = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=device)
    if slots.numel() == 0:
        return sums.to(dtype)
    hit = [e for e, c in enumerate(counts) if c]
    row_expert = torch.repeat_interleave(torch.arange(num_experts, device=device), torch.tensor(counts, device=device))
    gate_up = _blocks_gemm(hidden_states[tokens], offsets, hit, gate_up_blocks, gate_up_scales, dtype)
    if gate_up_bias is not None:
        gate_up += gate_up_bias[row_expert].float()
    act = gated_activation(gate_up[:, :inter], gate_up[:, inter:], activation)
    if dtype != torch.float32:  # the intermediate in the activation dtype, as the float layer keeps it
        act = act.to(dtype)
    y = _blocks_gemm(act, offsets, hit, down_blocks, down_scales, dtype)
    if down_bias is not None:
        y += down_bias[row_expert].float()
    sums.index_add_(0, tokens, y.mul_(slot_weights[:, None]))
    return sums if dtype == torch.float32 else sums.to(dtype)


def _rows_forward(
    hidden_states, plan, gate_up_blocks, gate_up_scales, down_blocks, down_scales, gate_up_bias, down_bias, activation
):
    """The "rows" strategy: `moeroute.experts.cpu.mxfp4`'s kernels over a `plan_rows` plan."""
    tokens, slot_weights, offsets, hit, work = plan
    num_tokens, hidden = hidden_states.shape
    inter = gate_up_blocks.shape[1] // 2
    dtype = hidden_states.dtype
    if hit.shape[0] == 0:
        return torch.zeros(num_tokens, hidden, dtype=dtype)
    threads = cpu_threads()
    # The bfloat16 dot instructions where `mxfp4_dot.serves`, at every row count (they
    # multiply the e2m1 values without widening them), the whole forward in
    # one Numba call (`moeroute.experts.cpu.quant_rows`). Elsewhere few rows per expert decode in registers per
    # tile of rows; more decode each weight row once into cache for all of them. One thread:
    # the serial kernels (no parallel region).
    bf16_dot = mxfp4_dot.serves(dtype == torch.bfloat16, hidden, inter)
    if bf16_dot and activation in cpu_rows.ACTIVATION_CODES:
        out = torch.empty(num_tokens, hidden, dtype=dtype)
        args = (
            hidden_states.detach().contiguous().view(torch.uint16).numpy(),
            tokens,
            slot_weights,
            offsets,
            hit,
            work,
            _packed(gate_up_blocks),
            _packed(gate_up_scales),
            _packed(down_blocks),
            _packed(down_scales),
            bias_view(gate_up_bias),
            bias_view(down_bias),
            cpu_rows.ACTIVATION_CODES[activation],
        )
        columns = quant_rows.thread_columns(hidden, threads, mxfp4_dot.ROW_TILE)
        kernel = quant_rows.rows_experts_mxfp4_serial if threads == 1 else quant_rows.rows_experts_mxfp4
        with numba_threads(threads):
            kernel(*args, columns, out.view(torch.uint16).numpy())
        return out
    sums = torch.zeros(num_tokens, hidden, dtype=torch.float32)
    gate_up = torch.empty(tokens.shape[0], 2 * inter, dtype=torch.float32)
    many_rows = tokens.shape[0] >= DECODED_MIN_ROWS * hit.shape[0]
    kernels = mxfp4_dot if bf16_dot else mxfp4_rows if many_rows else cpu_mxfp4
    split = _split_pairs if bf16_dot else split_rows
    gate_up_rows, down_rows = (
        (kernels.gate_up_rows_serial, kernels.down_rows_serial)
        if threads == 1
        else (kernels.gate_up_rows, kernels.down_rows)
    )
    with numba_threads(threads):
        gate_up_rows(
            split(hidden_states),
            tokens,
            offsets,
            work,
            _packed(gate_up_blocks),
            _packed(gate_up_scales),
            bias_view(gate_up_bias),
            gate_up.numpy(),
        )
        act = gated_activation(gate_up[:, :inter], gate_up[:, inter:], activation)
        if dtype != torch.float32:  # the intermediate in the activation dtype, as the float layer keeps it
            act = act.to(dtype)
        down_rows(
            split(act),
            tokens,
            slot_weights,
            offsets,
            hit,
            _packed(down_blocks),
            _packed(down_scales),
            bias_view(down_bias),
            sums.numpy(),
        )
    return sums if dtype == torch.float32 else sums.to(dtype)


def split_rows(rows: torch.Tensor) -> np.ndarray:
    """Rows as float32 in the kernels' order (`cpu_mxfp4.split_blocks`)."""
    values = rows.detach().to(torch.float32).contiguous().numpy()
    out = np.empty_like(values)
    cpu_mxfp4.split_blocks(values, out)
    return out


def _split_pairs(rows: torch.Tensor) -> np.ndarray:
    """bfloat16 rows as their bits in the dot kernels' order (`mxfp4_dot.split_pairs`)."""
    bits = rows.detach().contiguous().view(torch.uint16).numpy()
    out = np.empty_like(bits)
    mxfp4_dot.split_pairs(bits, out)
    return out


def _packed(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().contiguous().numpy()


def _blocks_gemm(xs, offsets, hit, blocks, scales, dtype):
    """[M, R] float32: each expert's rows of ``xs`` times its weight decoded in chunks.

    On the CPU the chunks are float32 and so is the GEMM: a bfloat16 GEMM there is much
    slower than float32 where the CPU has no bfloat16 instructions, and the bfloat16
    activations are exact in float32. Both operands are in `cpu_mxfp4.split_blocks` order
    (the vector decode writes each block's even values, then its odd ones).
    """
    rows_out, cols = blocks.shape[1], blocks.shape[2] * 32
    out = torch.empty(xs.shape[0], rows_out, dtype=torch.float32, device=xs.device)
    on_cpu = blocks.device.type == "cpu"
    chunk_rows = min(rows_out, max(1, CHUNK_BYTES // (4 * cols)))
    buffer = torch.empty(chunk_rows, cols, dtype=torch.float32, device=xs.device)
    x_cast = xs.to(dtype)
    if on_cpu:  # float32, each block's even then odd values: the order the decode writes
        x_cast = torch.from_numpy(split_rows(x_cast))
    for e in hit:
        start, stop = int(offsets[e]), int(offsets[e + 1])
        x_e = x_cast[start:stop]
        blocks_e, scales_e = blocks[e], scales[e]
        for r0 in range(0, rows_out, chunk_rows):
            r1 = min(rows_out, r0 + chunk_rows)
            w = buffer[: r1 - r0]
            if on_cpu:
                cpu_mxfp4.dequantize_rows_split(blocks_e.numpy(), scales_e.numpy(), r0, r1, w.numpy())
                out[start:stop, r0:r1] = torch.mm(x_e, w.t())
            else:
                w.copy_(decode_mxfp4(blocks_e[r0:r1], scales_e[r0:r1]))
                out[start:stop, r0:r1] = torch.mm(x_e, w.to(dtype).t())
    return out


def check_mxfp4_weights(
    quant: QuantConfig,
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    w_gate_up,
    w_down,
    check_values: bool = True,
) -> dict:
    """The full stacked MXFP4 pairs checked at the boundary; name -> tensor of the layer.

    ``w_gate_up`` and ``w_down`` are ``(blocks, scales)`` pairs of `QuantConfig.scale_shapes`
    (gate rows first). ``check_values=False`` checks shapes and dtypes only.

    Raises
    ------
    TypeError, ValueError
        Naming the argument: a float weight (quantize it first: `quantize_mxfp4`), a pair
        that is not two tensors, shapes other than the layer's, a scale byte 255.
    """
    gate_up_shape, down_shape = quant.scale_shapes(num_experts, hidden_size, intermediate_size)
    tensors = {}
    for name, pair, scale_shape in (("w_gate_up", w_gate_up, gate_up_shape), ("w_down", w_down, down_shape)):
        if isinstance(pair, torch.Tensor):
            raise ValueError(
                f"{name} is a {pair.dtype} tensor but the layer has quant='mxfp4', which stores "
                f"(blocks, scales) pairs; quantize float weights with moeroute.quant.quantize_mxfp4 "
                "(or pass the checkpoint's _blocks and _scales tensors)"
            )
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(
                f"{name} must be a (blocks, scales) pair of uint8 tensors with quant='mxfp4', got {type(pair).__name__}"
            )
        blocks, scales = pair
        check_mxfp4(blocks, scales, name, check_values)
        if tuple(scales.shape) != scale_shape:
            raise ValueError(
                f"{name} scales has shape {tuple(scales.shape)}, expected {list(scale_shape)} "
                f"(blocks {[*scale_shape, 16]})"
            )
        prefix = "gate_up" if name == "w_gate_up" else "down"
        tensors[name] = blocks
        tensors[f"{prefix}_scale"] = scales
    return tensors


#: gpt-oss checkpoint names of MXFP4 experts, relative to the block.
GPT_OSS_MXFP4_KEYS = (
    "experts.gate_up_proj_blocks",
    "experts.gate_up_proj_scales",
    "experts.down_proj_blocks",
    "experts.down_proj_scales",
)


def gate_rows_first(rows: int, device=None) -> torch.Tensor:
    """The row order taking gpt-oss's interleaved gate_up rows (gate, up, gate, ...) to
    moeroute's (every gate row, then every up row): even rows, then odd rows."""
    return torch.cat([torch.arange(0, rows, 2), torch.arange(1, rows, 2)]).to(device)


@torch.no_grad()
def map_gpt_oss_mxfp4_keys(module, state_dict: dict, prefix: str) -> None:
    """A gpt-oss MXFP4 checkpoint's names under ``prefix`` -> the module's, in place.

    ``router.weight``/``router.bias`` -> ``router_weight``/``router_bias``;
    ``experts.{gate_up,down}_proj_{blocks,scales}`` and ``experts.{gate_up,down}_proj_bias``
    -> this rank's ``experts.w_gate_up``, ``experts.gate_up_scale``, ``experts.w_down``,
    ``experts.down_scale``, ``experts.b_gate_up``, ``experts.b_down``, gate rows first (a
    row permutation of blocks, scales and bias entries), still packed. Other ranks' experts
    are dropped.

    Raises
    ------
    KeyError
        Some but not all of the four MXFP4 tensors.
    ValueError
        As `check_mxfp4` (a scale byte 255 included), naming the key.
    """
    for source, target in (("router.weight", "router_weight"), ("router.bias", "router_bias")):
        if prefix + source in state_dict:
            state_dict[prefix + target] = state_dict.pop(prefix + source)
    keys = [prefix + name for name in GPT_OSS_MXFP4_KEYS]
    present = [key for key in keys if key in state_dict]
    if not present:
        return
    if len(present) != len(keys):
        missing = sorted(set(keys) - set(present))
        raise KeyError(f"{missing} missing from the state dict: MXFP4 experts need their blocks and scales")
    gate_up_blocks, gate_up_scales, down_blocks, down_scales = (state_dict.pop(key) for key in keys)
    check_mxfp4(gate_up_blocks, gate_up_scales, keys[0][: -len("_blocks")])
    check_mxfp4(down_blocks, down_scales, keys[2][: -len("_blocks")])
    ids = module.routed_expert_ids()
    order = gate_rows_first(gate_up_blocks.shape[1])
    gate_up_bias, down_bias = prefix + "experts.gate_up_proj_bias", prefix + "experts.down_proj_bias"
    # name -> (the checkpoint's stacked tensor, the row order within an expert or None)
    sources = {
        "w_gate_up": (gate_up_blocks, order),
        "gate_up_scale": (gate_up_scales, order),
        "w_down": (down_blocks, None),
        "down_scale": (down_scales, None),
    }
    if gate_up_bias in state_dict:
        sources["b_gate_up"] = (state_dict.pop(gate_up_bias), order)
    if down_bias in state_dict:
        sources["b_down"] = (state_dict.pop(down_bias), None)
    experts = module.experts
    targets = {name: getattr(experts, name, None) for name in sources}
    own = {t.untyped_storage().data_ptr() for t in targets.values() if t is not None and not t.is_meta}
    if any(source.untyped_storage().data_ptr() in own for source, _ in sources.values()):
        targets = dict.fromkeys(sources)  # the layer's own state (a round trip): read before any write
    # Every value is checked above: this rank's experts are written one at a time into the
    # layer's own tensors (torch then copies each onto itself), or into new ones of their
    # shape where the layer's differ (fused slots, another dtype) or hold no memory (meta).
    with torch.no_grad():
        for name, (source, rows) in sources.items():
            target = targets[name]
            shape = (len(ids), *source.shape[1:])
            if target is None or target.is_meta or tuple(target.shape) != shape or target.dtype != source.dtype:
                target = torch.empty(shape, dtype=source.dtype, device=source.device)
            for local, e in enumerate(ids):
                target[local] = source[e] if rows is None else source[e][rows]
            state_dict[prefix + "experts." + name] = target
