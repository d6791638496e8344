"""INT4 weights (w4a16): moeroute's layout, quantize, dequantize, check (torch, CPU or CUDA).

The format, defined once here and in docs/quant.md. A weight W [N, K] (N output rows, K
input columns, K a multiple of the group size g, one of 32, 64, 128) is stored as

* ``packed`` uint8 [N, K/2]: the 4-bit integers q (0..15), two to a byte; byte j of a row
  holds element 2j in its low nibble and element 2j+1 in its high nibble;
* ``scales`` [N, K/g] float32, bfloat16 or float16 (kept in the dtype they come in: every
  checkpoint's scales stay exact);
* ``zeros`` uint8 [N, K/g], one zero point 0..15 a byte, only when asymmetric; symmetric
  weights have none and z = 8.

``W[n, k] = (q[n, k] - z[n, k // g]) * s[n, k // g]``, computed in float32 (exact for
bfloat16 and float16 scales, whose product with an integer of at most 5 bits fits float32's
mantissa; one float32 rounding for float32 scales). Activations are not
quantized: ``y = x @ W^T``, summed in float32.

Leading dimensions (experts) pass through: ``[..., N, K]`` <-> ``[..., N, K/2]``,
``[..., N, K/g]``. ``quantize_int4`` returns ``(packed, scales)`` (symmetric) or
``(packed, scales, zeros)``, the tuple a layer's INT4 weight is given as, and
``dequantize_int4(*that, group_size=g)`` inverts it.

Quantizing (round to nearest, per row and group of g columns): symmetric ``s = amax / 7``,
``q = clamp(round(w / s), -8, 7) + 8``; asymmetric with ``lo = min(min w, 0)`` and
``hi = max(max w, 0)`` (the range holds zero, so z fits 0..15), ``s = (hi - lo) / 15``,
``z = clamp(round(-lo / s), 0, 15)``, ``q = clamp(round(w / s) + z, 0, 15)``. ``s`` is
rounded to ``scale_dtype`` first and q computed with the rounded scale; ``round`` is half
to even; an all-zero group gets s = 0 and q = z. Checkpoint layouts (compressed-tensors,
GPTQ, AWQ) are unpacked into this one by `moeroute.quant.int4_checkpoint`.
"""

from __future__ import annotations

import weakref

import torch

from moeroute.quant.config import INT4_GROUP_SIZES
from moeroute.quant.mxfp4 import lead_index, row_steps

__all__ = [
    "INT4_GROUP_SIZES",
    "INT4_SCALE_DTYPES",
    "SYMMETRIC_ZERO",
    "check_int4",
    "decode_int4",
    "dequantize_int4",
    "pack_int4",
    "quantize_int4",
    "unpack_int4",
]

#: Scale dtypes kept as they come (a checkpoint's bfloat16 or float16, quantize_int4's choice).
INT4_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: The zero point of symmetric weights: q - 8 spans -8..7.
SYMMETRIC_ZERO = 8

# Elements handled per step: whole rows, about this many at a time (bounds the temporaries
# of quantize/dequantize to a few MB whatever the number of experts).
_STEP_ELEMENTS = 1 << 18


def _group_size(group_size) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"group_size={group_size!r} is not an INT4 group size; use one of {INT4_GROUP_SIZES}")
    return group_size


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] of integers ``q`` [..., K] in 0..15 (K even): element 2j in byte j's low
    nibble, 2j+1 in its high nibble. No range check (the caller's values are 0..15)."""
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The integers 0..15, uint8 [..., 2 * packed.shape[-1]], of ``packed`` uint8 [..., K/2]."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def check_int4(packed, scales, zeros=None, *, group_size, name: str = "weight") -> None:
    """Check an INT4 weight's tensors (types, shapes, devices, zero points 0..15).

    Parameters
    ----------
    packed : Tensor [..., N, K/2] uint8
    scales : Tensor [..., N, K/g] float32, bfloat16 or float16
    zeros : Tensor [..., N, K/g] uint8 with values 0..15, or None (symmetric, z = 8)
    group_size : {32, 64, 128}
    name : str
        Named in the messages.

    Raises
    ------
    TypeError
        A tensor that is not a torch.Tensor.
    ValueError
        A dtype, shape or device other than above, ``group_size`` not one of 32/64/128, a
        zero point above 15 (with its index).

    The zero points' values are read once per version of the tensor: checking the same,
    unchanged ``zeros`` again (a layer's forward) costs no pass over them.
    """
    group = _group_size(group_size)
    for label, tensor in (("packed", packed), ("scales", scales), ("zeros", zeros)):
        if tensor is None and label == "zeros":
            continue
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} {label} must be a torch.Tensor, got {type(tensor).__name__}")
    if packed.dtype != torch.uint8:
        raise ValueError(f"{name} packed must be uint8 (two 4-bit integers a byte), got {packed.dtype}")
    if packed.dim() < 2:
        raise ValueError(f"{name} packed must be [..., N, K/2], got shape {tuple(packed.shape)}")
    cols = 2 * packed.shape[-1]
    if cols % group:
        raise ValueError(
            f"{name} packed has {cols} columns (shape {tuple(packed.shape)}, two a byte), not a multiple of "
            f"group_size={group}"
        )
    expected = (*packed.shape[:-1], cols // group)
    if scales.dtype not in INT4_SCALE_DTYPES:
        raise ValueError(f"{name} scales must be float32, bfloat16 or float16, got {scales.dtype}")
    if tuple(scales.shape) != expected:
        raise ValueError(
            f"{name} scales has shape {tuple(scales.shape)} but packed {tuple(packed.shape)} with "
            f"group_size={group} needs {list(expected)}"
        )
    if scales.device != packed.device:
        raise ValueError(f"{name} scales is on {scales.device} but packed is on {packed.device}")
    if zeros is None:
        return
    if zeros.dtype != torch.uint8:
        raise ValueError(f"{name} zeros must be uint8 (one zero point 0..15 a byte), got {zeros.dtype}")
    if tuple(zeros.shape) != expected:
        raise ValueError(
            f"{name} zeros has shape {tuple(zeros.shape)} but packed {tuple(packed.shape)} with "
            f"group_size={group} needs {list(expected)}"
        )
    if zeros.device != packed.device:
        raise ValueError(f"{name} zeros is on {zeros.device} but packed is on {packed.device}")
    key = _zeros_key(zeros)
    entry = _CHECKED_ZEROS.get(id(zeros))
    if key is not None and entry is not None and entry[0]() is zeros and entry[1] == key:
        return
    _scan_zeros(zeros, name)
    if key is not None:
        ident = id(zeros)
        _CHECKED_ZEROS[ident] = (weakref.ref(zeros, lambda ref: _forget_zeros(ident, ref)), key)


# Zero point tensors whose values passed `_scan_zeros`, by id: (weak reference, `_zeros_key`).
# A layer hands its forward the same zero points every call; they are scanned again only when
# torch sees them change (an in-place write bumps the version, new data moves the pointer).
_CHECKED_ZEROS: dict = {}


def _zeros_key(zeros: torch.Tensor):
    """What torch can tell about the values' identity, or None where it tracks no version
    (inference tensors: scanned every time)."""
    if torch.is_inference(zeros) or zeros.is_meta:
        return None
    return (zeros._version, zeros.data_ptr(), tuple(zeros.shape), tuple(zeros.stride()), zeros.device)


def _forget_zeros(ident: int, ref) -> None:
    entry = _CHECKED_ZEROS.get(ident)
    if entry is not None and entry[0] is ref:
        del _CHECKED_ZEROS[ident]


def _scan_zeros(zeros: torch.Tensor, name: str) -> None:
    """ValueError naming the first zero point above 15 (a read of every value)."""
    bad = zeros > 15
    if zeros.numel() and bool(bad.any()):
        index = [int(i) for i in bad.nonzero()[0]]
        raise ValueError(f"{name} zeros{index} is {int(zeros[tuple(index)])}; an INT4 zero point is 0..15")


def dequantize_int4(packed, scales, zeros=None, *, group_size) -> torch.Tensor:
    """``(q - z) * s`` per group, float32 [..., N, K] (exact with 16-bit scales; float32
    scales: the product rounded once to float32).

    Parameters
    ----------
    packed, scales, zeros
        As `quantize_int4` returns them (zeros None or absent: symmetric, z = 8).
    group_size : {32, 64, 128}

    Raises
    ------
    TypeError, ValueError
        As `check_int4`.
    """
    check_int4(packed, scales, zeros, group_size=group_size)
    return decode_int4(packed, scales, zeros, group_size)


def decode_int4(packed, scales, zeros, group_size: int) -> torch.Tensor:
    """`dequantize_int4` without the checks: float32 [..., N, K], a step of rows at a time."""
    rows, half = packed.shape[-2:]
    cols = 2 * half
    lead = tuple(packed.shape[:-2])
    out = torch.empty(*lead, rows, cols, dtype=torch.float32, device=packed.device)
    if not out.numel():
        return out
    flat_out = out.view(-1, cols)
    flat_packed = packed.reshape(-1, half)
    flat_scales = scales.reshape(-1, cols // group_size)
    flat_zeros = None if zeros is None else zeros.reshape(-1, cols // group_size)
    step = max(1, _STEP_ELEMENTS // cols)
    for first in range(0, flat_out.shape[0], step):
        rows_ = slice(first, first + step)
        q = unpack_int4(flat_packed[rows_]).view(-1, cols // group_size, group_size).to(torch.float32)
        z = SYMMETRIC_ZERO if flat_zeros is None else flat_zeros[rows_].to(torch.float32)[..., None]
        q.sub_(z).mul_(flat_scales[rows_].to(torch.float32)[..., None])
        flat_out[rows_] = q.view(-1, cols)
    return out


def quantize_int4(w: torch.Tensor, *, group_size: int = 128, symmetric: bool = True, scale_dtype=torch.bfloat16):
    """Quantize ``w`` [..., N, K] to INT4, round to nearest (the module docstring's rule).

    Parameters
    ----------
    w : Tensor [..., N, K] float32/bfloat16/float16/float64, CPU or CUDA; K a multiple of
        ``group_size``; finite values
    group_size : {32, 64, 128}
    symmetric : bool
        True: ``s = amax / 7``, no zero points (z = 8); False: ``s = (hi - lo) / 15`` over
        the group's range widened to hold 0, ``z = round(-lo / s)``.
    scale_dtype : torch.dtype
        float32, bfloat16 (the default: what checkpoints carry) or float16; the scale is
        rounded to it before q is computed, so q is the nearest value for the stored scale.

    Returns
    -------
    (packed, scales) when symmetric, (packed, scales, zeros) when not: uint8 [..., N, K/2],
    ``scale_dtype`` [..., N, K/g], uint8 [..., N, K/g]; `dequantize_int4` of it is within
    half a step (s / 2) of ``w`` in each element (a scale rounded to 16 bits can move an
    asymmetric group's extreme value up to one step), exact for symmetric groups of values
    ``(q - 8) * s`` whose largest magnitude is ``7 * s``, s representable in ``scale_dtype``.

    Memory: whole rows, about 2**18 elements at a time (one row when a row is longer), never
    copying ``w``: beyond ``w`` and the outputs the temporaries are those of one step (a few
    MB), whatever the number of experts.

    Raises
    ------
    TypeError, ValueError
        ``w`` not a float tensor of at least 2 dims, K not a multiple of ``group_size``, a
        bad ``group_size``/``symmetric``/``scale_dtype``, a value that is not finite (naming
        the leading index, e.g. the expert, that holds it).
    """
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"w must be a torch.Tensor, got {type(w).__name__}")
    if w.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise ValueError(f"w must be a float32/bfloat16/float16/float64 tensor, got {w.dtype}")
    if w.dim() < 2:
        raise ValueError(f"w must have at least 2 dims [..., N, K], got shape {tuple(w.shape)}")
    group = _group_size(group_size)
    if not isinstance(symmetric, bool):
        raise ValueError(f"symmetric={symmetric!r} must be True or False")
    if scale_dtype not in INT4_SCALE_DTYPES:
        raise ValueError(f"scale_dtype={scale_dtype!r} is not an INT4 scale dtype; use one of {INT4_SCALE_DTYPES}")
    rows, cols = w.shape[-2:]
    if cols % group:
        raise ValueError(f"w has {cols} columns; INT4 with group_size={group} needs a multiple of {group}")
    lead = tuple(w.shape[:-2])
    packed = torch.empty(*lead, rows, cols // 2, dtype=torch.uint8, device=w.device)
    scales = torch.empty(*lead, rows, cols // group, dtype=scale_dtype, device=w.device)
    zeros = None if symmetric else torch.empty(*lead, rows, cols // group, dtype=torch.uint8, device=w.device)
    outputs = (packed, scales) if symmetric else (packed, scales, zeros)
    if not w.numel():
        return outputs
    flat = [t.view(-1, t.shape[-1]) for t in outputs]
    step = max(1, _STEP_ELEMENTS // cols)
    for first, chunk in row_steps(w, step):
        finite = torch.isfinite(chunk)
        if not bool(finite.all()):
            bad_row = first + int((~finite).any(dim=-1).nonzero()[0, 0])
            where = f"w{list(lead_index(lead, bad_row // rows))}" if lead else "w"
            raise ValueError(f"{where} holds inf or NaN values, which INT4 cannot represent")
        pieces = _quantize_rows(chunk, group, symmetric, scale_dtype)
        for target, piece in zip(flat, pieces):
            target[first : first + chunk.shape[0]] = piece
    return outputs


def _quantize_rows(rows: torch.Tensor, group: int, symmetric: bool, scale_dtype):
    """(packed, scales[, zeros]) of finite ``rows`` [n, K], computed in float64 with the
    stored scale's value."""
    values = rows.to(torch.float64, memory_format=torch.contiguous_format, copy=True)
    values = values.view(rows.shape[0], rows.shape[1] // group, group)
    if symmetric:
        amax = torch.maximum(values.amax(dim=-1), values.amin(dim=-1).neg())
        scale = (amax / 7).to(scale_dtype)
    else:
        low = values.amin(dim=-1).clamp(max=0)
        scale = ((values.amax(dim=-1).clamp(min=0) - low) / 15).to(scale_dtype)
    if not bool(torch.isfinite(scale).all()):
        raise ValueError(
            f"w holds values whose INT4 scale (amax / 7 or range / 15) overflows scale_dtype={scale_dtype}"
        )
    divisor = scale.double()
    positive = divisor > 0
    divisor = torch.where(positive, divisor, 1.0)
    if symmetric:
        zero = torch.full_like(divisor, SYMMETRIC_ZERO)
        q = torch.round(values.div_(divisor[..., None])).clamp_(-8, 7).add_(SYMMETRIC_ZERO)
    else:
        zero = torch.where(positive, torch.round(-low / divisor), 0.0).clamp_(0, 15)
        q = torch.round(values.div_(divisor[..., None])).add_(zero[..., None]).clamp_(0, 15)
    # An all-zero group (s = 0): every q is its zero point.
    q = torch.where(positive[..., None], q, zero[..., None])
    packed = pack_int4(q.view(rows.shape[0], rows.shape[1]).to(torch.uint8))
    if symmetric:
        return packed, scale
    return packed, scale, zero.to(torch.uint8)
