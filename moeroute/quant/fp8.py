"""FP8 (float8_e4m3fn) weights and activations: quantize, dequantize, check (torch, CPU or CUDA).

The numerics, defined once here and in docs/quant.md:

* fp8_block weight W [rows, cols]: ``q`` float8_e4m3fn [rows, cols] and ``scale_inv`` float32
  [ceil(rows/bn), ceil(cols/bk)], ``W = q * scale_inv[i // bn, j // bk]`` (the last block
  row/column may be partial). Quantizing: per block ``s = max(amax(|W_block|), 1e-10) / 448``
  (``2 ** ceil(log2(...))`` with ue8m0), ``q = clamp(W / s, -448, 448)`` rounded to e4m3.
* fp8_tensor weight: one float32 scale per matrix, the same rule over the whole matrix.
* Activations x [..., H]: per row and group of ``group_size`` columns (the whole row when
  None), ``s = max(amax(|x_group|), 1e-10) / 448`` (ue8m0: a power of two), ``q = clamp(x / s,
  -448, 448)`` -> e4m3.

Gate and up keep their own block rows: an expert's gate_up weight [2I, H] is quantized as its
gate [I, H] and up [I, H] separately (`quantize_experts`), so the scales of the two never
share a block even when I is not a multiple of bn.
"""

from __future__ import annotations

import itertools

import torch

from moeroute._validate import integer
from moeroute.quant.config import QuantConfig, _block_size
from moeroute.quant.mxfp4 import MXFP4_BLOCK, _quantize_mxfp4_into, dequantize_mxfp4

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "MIN_AMAX",
    "quantize_fp8_block",
    "dequantize_fp8_block",
    "quantize_fp8_tensor",
    "dequantize_fp8_tensor",
    "quantize_fp8_activations",
    "quantize_fp8_static",
    "quantize_experts",
    "dequantize_experts",
    "check_scale",
    "check_fp8_weight",
]

#: The storage dtype of FP8 weights and activations.
FP8_DTYPE = torch.float8_e4m3fn
#: Largest finite e4m3 magnitude: an amax maps onto it.
FP8_MAX = 448.0
#: Floor of amax before dividing, so that an all-zero block gets a finite, positive scale.
MIN_AMAX = 1e-10


def _scale_from_amax(amax: torch.Tensor, ue8m0: bool) -> torch.Tensor:
    scale = amax.float().clamp(min=MIN_AMAX) / FP8_MAX
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return scale


def _to_fp8(values: torch.Tensor) -> torch.Tensor:
    return values.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _check_float(name: str, tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point() or tensor.dtype == FP8_DTYPE:
        raise ValueError(f"{name} must be a float32/bfloat16/float16 tensor, got {tensor.dtype}")


def _check_block(block_size) -> tuple[int, int]:
    return _block_size(block_size)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pad_to_blocks(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    rows, cols = w.shape[-2:]
    pad_rows, pad_cols = _cdiv(rows, bn) * bn - rows, _cdiv(cols, bk) * bk - cols
    if pad_rows or pad_cols:
        w = torch.nn.functional.pad(w, (0, pad_cols, 0, pad_rows))
    return w


#: Elements of `quantize_fp8_block`'s step (whole block rows): its float32 temporaries stay a
#: few MB whatever the size of the stack being converted.
_STEP_ELEMENTS = 1 << 18


def quantize_fp8_block(w: torch.Tensor, block_size=(128, 128), scale_fmt: str = "float"):
    """Quantize ``w`` [..., rows, cols] to e4m3 with one float32 scale per (bn, bk) block.

    Parameters
    ----------
    w : Tensor [..., rows, cols], float32/bfloat16/float16, CPU or CUDA
    block_size : (bn, bk)
    scale_fmt : {"float", "ue8m0"}

    Returns
    -------
    q : Tensor [..., rows, cols] float8_e4m3fn
    scale_inv : Tensor [..., ceil(rows/bn), ceil(cols/bk)] float32
        ``w ~= q * scale_inv[i // bn, j // bk]``; zero padding fills partial blocks.

    Memory: each matrix is quantized a few block rows at a time (about ``_STEP_ELEMENTS``,
    2**18, elements; one block row when that is more), never copying ``w``; beyond ``w`` and
    the outputs the peak extra memory is one step's float32 temporaries, about 12 bytes an
    element of a step: 3 MB, or ``12 * bn * cols`` bytes when one block row is larger (11 MB for
    bn = 128 and 7168 columns), far less than one expert's float32 weights, whatever the
    number of experts.

    Raises
    ------
    TypeError, ValueError
        ``w`` not a float tensor of at least 2 dims; a bad block_size or scale_fmt.
    """
    _check_float("w", w)
    if w.dim() < 2:
        raise ValueError(f"w must have at least 2 dims [..., rows, cols], got shape {tuple(w.shape)}")
    bn, bk = _check_block(block_size)
    ue8m0 = _scale_fmt(scale_fmt)
    rows, cols = w.shape[-2:]
    lead = tuple(w.shape[:-2])
    q = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
    scale = torch.empty(*lead, _cdiv(rows, bn), _cdiv(cols, bk), dtype=torch.float32, device=w.device)
    _quantize_fp8_block_into(w, q, scale, bn, bk, ue8m0)
    return q, scale


def _quantize_fp8_block_into(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bn: int, bk: int, ue8m0: bool):
    """`quantize_fp8_block` of ``w`` [..., rows, cols] written into ``q`` and ``scale`` (views
    of a larger output allowed), a few block rows at a time."""
    if not w.numel():
        return  # no block has an element: scale is empty too
    rows, cols = w.shape[-2:]
    step_rows = bn * max(1, _STEP_ELEMENTS // (bn * cols))
    for index in itertools.product(*map(range, w.shape[:-2])):
        matrix, q_matrix, scale_matrix = w[index], q[index], scale[index]
        for first in range(0, rows, step_rows):
            q_step, scale_step = _quantize_block_rows(matrix[first : first + step_rows], bn, bk, ue8m0)
            q_matrix[first : first + step_rows] = q_step
            scale_matrix[first // bn : first // bn + scale_step.shape[0]] = scale_step


def _quantize_block_rows(w: torch.Tensor, bn: int, bk: int, ue8m0: bool):
    """q [n, cols] float8_e4m3fn and scales [ceil(n/bn), ceil(cols/bk)] of ``w`` [n, cols]."""
    rows, cols = w.shape
    padded = _pad_to_blocks(w.float(), bn, bk)
    nbr, nbc = padded.shape[-2] // bn, padded.shape[-1] // bk
    blocks = padded.reshape(nbr, bn, nbc, bk)
    scale = _scale_from_amax(blocks.abs().amax(dim=(-3, -1)), ue8m0)
    return _to_fp8(blocks / scale[:, None, :, None]).reshape(padded.shape)[:rows, :cols], scale


def _expand_blocks(scale_inv: torch.Tensor, bn: int, bk: int, rows: int, cols: int) -> torch.Tensor:
    return scale_inv.repeat_interleave(bn, dim=-2)[..., :rows, :].repeat_interleave(bk, dim=-1)[..., :cols]


def dequantize_fp8_block(q: torch.Tensor, scale_inv: torch.Tensor, block_size=(128, 128)) -> torch.Tensor:
    """``q * scale_inv[i // bn, j // bk]`` in float32, over the last two dims.

    Parameters
    ----------
    q : Tensor [..., rows, cols] float8_e4m3fn
    scale_inv : Tensor [..., ceil(rows/bn), ceil(cols/bk)] float32 (float8_e8m0fnu accepted)
    block_size : (bn, bk)

    Returns
    -------
    Tensor [..., rows, cols] float32

    Raises
    ------
    TypeError, ValueError
        ``q`` not float8_e4m3fn; ``scale_inv`` of another shape or dtype (named in the message).
    """
    bn, bk = _check_block(block_size)
    _check_fp8("q", q)
    rows, cols = q.shape[-2:]
    scale_inv = check_scale(
        "scale_inv", scale_inv, (*q.shape[:-2], _cdiv(rows, bn), _cdiv(cols, bk)), check_values=False
    )
    return q.float() * _expand_blocks(scale_inv, bn, bk, rows, cols)


def quantize_fp8_tensor(w: torch.Tensor, scale_fmt: str = "float"):
    """Quantize ``w`` [..., rows, cols] with one float32 scale per matrix.

    Returns
    -------
    q : Tensor [..., rows, cols] float8_e4m3fn
    scale : Tensor [...] float32, ``w ~= q * scale``

    Memory: each matrix is read twice a step of about ``_STEP_ELEMENTS`` (2**18) elements at
    a time (whole rows; one row when a row is longer), first for its amax, then for the
    quotients, never copying ``w``: beyond ``w`` and the outputs, one step's float32
    temporaries (about 12 bytes an element of a step, 3 MB), whatever the number of experts.
    """
    _check_float("w", w)
    if w.dim() < 2:
        raise ValueError(f"w must have at least 2 dims [..., rows, cols], got shape {tuple(w.shape)}")
    ue8m0 = _scale_fmt(scale_fmt)
    q = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
    scale = torch.empty(w.shape[:-2], dtype=torch.float32, device=w.device)
    _quantize_fp8_tensor_into(w, q, scale, ue8m0)
    return q, scale


def _quantize_fp8_tensor_into(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, ue8m0: bool):
    """`quantize_fp8_tensor` of ``w`` [..., rows, cols] written into ``q`` and ``scale``, a
    matrix at a time and a step of rows at a time within it: the amax over the steps (a max
    of maxes: the same value), then the quotient of each step."""
    rows, cols = w.shape[-2:]
    step_rows = max(1, _STEP_ELEMENTS // max(cols, 1))
    for index in itertools.product(*map(range, w.shape[:-2])):
        matrix, q_matrix = w[index], q[index]
        amax = torch.zeros((), dtype=torch.float32, device=w.device)
        for first in range(0, rows, step_rows):
            step = matrix[first : first + step_rows]
            if step.numel():
                amax = torch.maximum(amax, step.float().abs().amax())
        matrix_scale = _scale_from_amax(amax, ue8m0)
        scale[index] = matrix_scale
        for first in range(0, rows, step_rows):
            q_matrix[first : first + step_rows] = _to_fp8(matrix[first : first + step_rows].float() / matrix_scale)


def dequantize_fp8_tensor(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q * scale`` in float32; ``scale`` [...] matches ``q``'s leading dims."""
    _check_fp8("q", q)
    scale = check_scale("scale", scale, tuple(q.shape[:-2]), check_values=False)
    return q.float() * scale[..., None, None]


def quantize_fp8_activations(x: torch.Tensor, group_size: int | None = 128, scale_fmt: str = "float"):
    """Quantize activations per row and group of ``group_size`` columns (dynamic).

    Parameters
    ----------
    x : Tensor [..., H], float32/bfloat16/float16, CPU or CUDA
    group_size : int or None
        Columns per scale (the weight's bk); None: one scale per row (fp8_tensor).
    scale_fmt : {"float", "ue8m0"}

    Returns
    -------
    q : Tensor [..., H] float8_e4m3fn
    scales : Tensor [..., ceil(H/group_size)] float32 ([..., 1] when group_size is None)
        ``s = max(amax(|x_group|), 1e-10) / 448``; ``q = clamp(x / s, -448, 448)``.
    """
    _check_float("x", x)
    if x.dim() < 1:
        raise ValueError("x must have at least 1 dim [..., H]")
    ue8m0 = _scale_fmt(scale_fmt)
    hidden = x.shape[-1]
    if group_size is None:
        group_size = max(hidden, 1)
    group_size = integer("group_size", group_size, 1, why="or None: one group per row")
    groups = _cdiv(hidden, group_size)
    padded = x.float()
    if groups * group_size != hidden:
        padded = torch.nn.functional.pad(padded, (0, groups * group_size - hidden))
    grouped = padded.reshape(*x.shape[:-1], groups, group_size)
    scales = _scale_from_amax(grouped.abs().amax(dim=-1), ue8m0)
    q = _to_fp8(grouped / scales[..., None]).reshape(padded.shape)[..., :hidden]
    return q.contiguous(), scales


def quantize_fp8_static(x: torch.Tensor, scale) -> torch.Tensor:
    """``clamp(x / scale, -448, 448)`` -> e4m3 with a given (static) activation scale."""
    _check_float("x", x)
    return _to_fp8(x.float() / scale)


def _scale_fmt(scale_fmt: str) -> bool:
    if scale_fmt not in ("float", "ue8m0"):
        raise ValueError(f"scale_fmt={scale_fmt!r} is unknown; use 'float' or 'ue8m0'")
    return scale_fmt == "ue8m0"


def _check_fp8(name: str, q) -> None:
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(q).__name__}")
    if q.dtype != FP8_DTYPE:
        raise ValueError(f"{name} must be float8_e4m3fn, got {q.dtype}")
    if q.dim() < 2:
        raise ValueError(f"{name} must have at least 2 dims [..., rows, cols], got shape {tuple(q.shape)}")


#: The magnitude bits of float8_e4m3fn's NaN (bytes 0x7F and 0xFF): e4m3fn has no infinities.
_E4M3_NAN_BITS = 0x7F


def check_fp8_weight(name: str, q: torch.Tensor, expert: int | None = None) -> None:
    """ValueError naming ``name`` and the expert where float8_e4m3fn weights ``q`` hold a NaN.

    The bytes 0x7F and 0xFF are NaN in float8_e4m3fn; the CPU decoders would read them as
    +-480 (the exponent and mantissa formula), so every token routed to that expert would get
    a finite, wrong output. They are refused where weights enter a module, as MXFP4's scale
    byte 255 is. ``q``: stacked [N, rows, cols] (the first index is the expert), or one
    expert's matrix with ``expert`` its id. Reads the bytes (a CUDA sync): load time only.
    """
    if not q.numel():
        return
    # One matrix at a time: the byte masks of a whole stacked layer would be as large as the
    # layer's weights.
    data = q.view(torch.uint8)
    for lead in itertools.product(*map(range, q.shape[:-2])):
        bad = (data[lead] & _E4M3_NAN_BITS) == _E4M3_NAN_BITS
        if bool(bad.any()):
            index = lead + tuple(int(i) for i in bad.nonzero()[0])
            break
    else:
        return
    if expert is None:
        expert = index[0] if q.dim() >= 3 else None
    which = "" if expert is None else f" (expert {expert})"
    raise ValueError(
        f"{name}{list(index)}{which} is the byte 0x{int(q.view(torch.uint8)[index]):02X}, NaN in "
        "float8_e4m3fn; FP8 weights must be finite (bytes other than 0x7F and 0xFF)"
    )


#: Scale dtypes accepted at the boundary; converted (exactly) to float32.
_SCALE_DTYPES = tuple(d for d in (torch.float32, getattr(torch, "float8_e8m0fnu", None)) if d is not None)


def check_scale(name: str, scale, shape: tuple, check_values: bool = True) -> torch.Tensor:
    """``scale`` as float32 of ``shape``; TypeError/ValueError naming ``name`` otherwise.

    float8_e8m0fnu scales (powers of two) are converted to float32 exactly. With
    ``check_values``, every scale must be finite and > 0 (this synchronizes a CUDA tensor:
    a load-time check, never run per forward).
    """
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(scale).__name__}")
    if scale.dtype not in _SCALE_DTYPES:
        raise ValueError(f"{name} has dtype {scale.dtype}; FP8 scales are float32 (or float8_e8m0fnu)")
    if tuple(scale.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(scale.shape)}, expected {list(shape)}")
    scale = scale.float()
    if check_values and scale.numel():
        bad = ~(torch.isfinite(scale) & (scale > 0))
        if bool(bad.any()):
            index = tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(f"{name} must be finite and > 0 everywhere; {name}[{index}] = {float(scale[index])}")
    return scale


def quantize_experts(w_gate_up: torch.Tensor, w_down: torch.Tensor, config: QuantConfig, *, out=None):
    """Quantize stacked expert weights in moeroute's layout.

    Parameters
    ----------
    w_gate_up : Tensor [N, 2I, H] float (gate rows first)
    w_down : Tensor [N, H, I] float
    config : QuantConfig
    out : tuple of 4 tensors, optional
        Where to write the result (e.g. rows of a layer's own parameters): tensors of the
        returned shapes, dtypes and device; MXFP4 ones contiguous. Returned as given.

    Returns
    -------
    (q_gate_up [N, 2I, H], gate_up_scale, q_down [N, H, I], down_scale): float8_e4m3fn
    weights and float32 scales of `QuantConfig.scale_shapes` (fp8_block: the gate's block
    rows, then the up's; fp8_tensor: [N, 2] gate, up and [N]); mxfp4: uint8 blocks and
    scale bytes (`moeroute.quant.mxfp4.quantize_mxfp4` of each stacked weight).

    Memory: the outputs are allocated once (or are ``out``) and every projection of every
    expert is quantized into them in steps (`quantize_fp8_block`, `quantize_fp8_tensor`,
    `quantize_mxfp4`): beyond the inputs and the outputs, the peak is one step's
    temporaries, a few MB, whatever N.

    Raises
    ------
    TypeError, ValueError
        Not a QuantConfig; weights that are not float, of other shapes (named); ``out`` not
        four tensors of the result's shapes, dtypes and device.
    """
    if not isinstance(config, QuantConfig):
        raise TypeError(f"config must be a QuantConfig, got {type(config).__name__}")
    if config.format == "int4":
        raise ValueError("config format 'int4' is not stacked here; use moeroute.quant.quantize_int4 on each weight")
    _check_float("w_gate_up", w_gate_up)
    _check_float("w_down", w_down)
    if w_gate_up.dim() != 3 or w_gate_up.shape[1] % 2:
        raise ValueError(f"w_gate_up must be [N, 2I, H], got shape {tuple(w_gate_up.shape)}")
    num, two_inter, hidden = w_gate_up.shape
    inter = two_inter // 2
    if w_down.dim() != 3 or tuple(w_down.shape) != (num, hidden, inter):
        raise ValueError(f"w_down has shape {tuple(w_down.shape)}, expected [N, H, I] = {[num, hidden, inter]}")
    if config.format == "mxfp4":
        for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
            if w.shape[-1] % MXFP4_BLOCK:
                raise ValueError(
                    f"{name} has {w.shape[-1]} columns; MXFP4 needs a multiple of {MXFP4_BLOCK} "
                    f"(one scale per {MXFP4_BLOCK} input columns)"
                )
        gate_up_scale_shape, down_scale_shape = config.scale_shapes(num, hidden, inter)
        specs = (
            ((*gate_up_scale_shape, MXFP4_BLOCK // 2), torch.uint8),
            (gate_up_scale_shape, torch.uint8),
            ((*down_scale_shape, MXFP4_BLOCK // 2), torch.uint8),
            (down_scale_shape, torch.uint8),
        )
    else:
        gate_up_scale_shape, down_scale_shape = config.scale_shapes(num, hidden, inter)
        specs = (
            (tuple(w_gate_up.shape), FP8_DTYPE),
            (gate_up_scale_shape, torch.float32),
            (tuple(w_down.shape), FP8_DTYPE),
            (down_scale_shape, torch.float32),
        )
    out = _experts_out(out, specs, w_gate_up.device, config.format == "mxfp4")
    q_gate_up, gate_up_scale, q_down, down_scale = out
    if config.format == "mxfp4":
        _quantize_mxfp4_into(w_gate_up, q_gate_up, gate_up_scale)
        _quantize_mxfp4_into(w_down, q_down, down_scale)
        return out
    ue8m0 = _scale_fmt(config.scale_fmt)
    gate, up = w_gate_up[:, :inter], w_gate_up[:, inter:]
    if config.format == "fp8_block":
        bn, bk = config.block_size
        nbr = gate_up_scale.shape[1] // 2
        _quantize_fp8_block_into(gate, q_gate_up[:, :inter], gate_up_scale[:, :nbr], bn, bk, ue8m0)
        _quantize_fp8_block_into(up, q_gate_up[:, inter:], gate_up_scale[:, nbr:], bn, bk, ue8m0)
        _quantize_fp8_block_into(w_down, q_down, down_scale, bn, bk, ue8m0)
        return out
    _quantize_fp8_tensor_into(gate, q_gate_up[:, :inter], gate_up_scale[:, 0], ue8m0)
    _quantize_fp8_tensor_into(up, q_gate_up[:, inter:], gate_up_scale[:, 1], ue8m0)
    _quantize_fp8_tensor_into(w_down, q_down, down_scale, ue8m0)
    return out


def _experts_out(out, specs, device, contiguous: bool) -> tuple:
    """`quantize_experts`' four outputs: ``out`` checked against ``specs`` ((shape, dtype)
    each), or new tensors."""
    if out is None:
        return tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs)
    names = ("q_gate_up", "gate_up_scale", "q_down", "down_scale")
    if not isinstance(out, (tuple, list)) or len(out) != 4:
        raise TypeError(f"out must be a tuple of 4 tensors ({', '.join(names)}), got {type(out).__name__}")
    for name, tensor, (shape, dtype) in zip(names, out, specs):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"out {name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype or tensor.device != torch.device(device):
            raise ValueError(
                f"out {name} is {tensor.dtype} {tuple(tensor.shape)} on {tensor.device}, expected "
                f"{dtype} {list(shape)} on {device}"
            )
        if contiguous and not tensor.is_contiguous():
            raise ValueError(f"out {name} must be contiguous for MXFP4")
    return tuple(out)


def dequantize_experts(q_gate_up, gate_up_scale, q_down, down_scale, config: QuantConfig):
    """float32 (w_gate_up [N, 2I, H], w_down [N, H, I]) of `quantize_experts`' outputs."""
    if not isinstance(config, QuantConfig):
        raise TypeError(f"config must be a QuantConfig, got {type(config).__name__}")
    if config.format == "int4":
        raise ValueError("config format 'int4' is not stacked here; use moeroute.quant.dequantize_int4 on each weight")
    if config.format == "mxfp4":
        return dequantize_mxfp4(q_gate_up, gate_up_scale), dequantize_mxfp4(q_down, down_scale)
    _check_fp8("q_gate_up", q_gate_up)
    inter = q_gate_up.shape[-2] // 2
    if config.format == "fp8_block":
        nbr = gate_up_scale.shape[-2] // 2
        gate = dequantize_fp8_block(q_gate_up[..., :inter, :], gate_up_scale[..., :nbr, :], config.block_size)
        up = dequantize_fp8_block(q_gate_up[..., inter:, :], gate_up_scale[..., nbr:, :], config.block_size)
        return torch.cat([gate, up], -2), dequantize_fp8_block(q_down, down_scale, config.block_size)
    gate = dequantize_fp8_tensor(q_gate_up[..., :inter, :], gate_up_scale[..., 0])
    up = dequantize_fp8_tensor(q_gate_up[..., inter:, :], gate_up_scale[..., 1])
    return torch.cat([gate, up], -2), dequantize_fp8_tensor(q_down, down_scale)
