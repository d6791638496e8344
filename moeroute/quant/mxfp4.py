"""MXFP4 weights (gpt-oss): quantize, dequantize, check (torch, CPU or CUDA).

The format, defined once here and in docs/quant.md. A weight W [rows, cols] (cols a
multiple of 32) is stored as

* ``blocks`` uint8 [rows, cols/32, 16]: 32 e2m1 codes per block, two to a byte; byte j of
  a block holds element 2j in its low nibble and element 2j+1 in its high nibble. A code
  indexes `E2M1_VALUES` = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0, -0.5, -1, -1.5, -2, -3, -4, -6].
* ``scales`` uint8 [rows, cols/32]: a biased power-of-two exponent per block (e8m0);
  ``W[i, 32b + k] = E2M1_VALUES[code] * 2 ** (scales[i, b] - 127)``. The byte 255 is NaN
  in e8m0 and is refused.

Quantizing a block of 32 values: ``e = ceil(log2(amax / 6))`` (computed exactly from amax's
float exponent and mantissa; clamped to [-127, 127]; an all-zero block gets the byte 0),
then each ``value / 2**e`` rounds to the nearest e2m1 value, ties to the even code.
Values already on such a grid come back exactly.

Leading dimensions (experts) pass through: ``[..., rows, cols]`` <-> ``[..., rows, cols/32,
16]`` and ``[..., rows, cols/32]``.
"""

from __future__ import annotations

import itertools
import math

import torch

__all__ = [
    "E2M1_VALUES",
    "MXFP4_BLOCK",
    "SCALE_BIAS",
    "dequantize_mxfp4",
    "decode_mxfp4",
    "quantize_mxfp4",
    "check_mxfp4",
    "lead_index",
    "row_steps",
]

#: The 16 e2m1 values, indexed by a 4-bit code (bit 3 the sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: Values per scale byte (along the input columns).
MXFP4_BLOCK = 32
#: The e8m0 exponent bias: a scale byte s means 2 ** (s - 127).
SCALE_BIAS = 127
#: e8m0's NaN encoding; refused.
_SCALE_NAN = 255
#: Largest e2m1 magnitude: a block's amax maps at most onto it.
_E2M1_MAX = 6.0
#: Midpoints between consecutive e2m1 magnitudes (codes 0..7): the rounding boundaries.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
#: Elements quantized per step of `quantize_mxfp4`: its float64 and int32 temporaries (about
#: 35 bytes an element) stay under 5 MB whatever the size of the stack being converted.
_STEP_ELEMENTS = 1 << 17


def check_mxfp4(blocks, scales, name: str = "weight", check_values: bool = True) -> None:
    """Check an MXFP4 pair at the boundary.

    Parameters
    ----------
    blocks : Tensor [..., rows, cols/32, 16] uint8
    scales : Tensor [..., rows, cols/32] uint8, on blocks' device
    name : str
        Named in the messages (``{name} blocks``, ``{name} scales``).
    check_values : bool
        Also refuse a scale byte 255 (e8m0 NaN); this reads the scales (a CUDA sync).

    Raises
    ------
    TypeError
        Not tensors.
    ValueError
        A dtype other than uint8, blocks whose last dim is not 16, scales whose shape is not
        blocks' without the last dim, different devices, a scale byte 255.
    """
    for part, tensor in (("blocks", blocks), ("scales", scales)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} {part} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype != torch.uint8:
            raise ValueError(
                f"{name} {part} has dtype {tensor.dtype}; MXFP4 {part} are uint8 (a float weight "
                "must be quantized first: moeroute.quant.quantize_mxfp4)"
            )
    if blocks.dim() < 3 or blocks.shape[-1] != MXFP4_BLOCK // 2:
        raise ValueError(
            f"{name} blocks has shape {tuple(blocks.shape)}; MXFP4 blocks are "
            f"[..., rows, cols/32, 16] (16 bytes hold 32 values)"
        )
    if tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(
            f"{name} scales has shape {tuple(scales.shape)} but its blocks "
            f"{tuple(blocks.shape)} need scales of shape {list(blocks.shape[:-1])}"
        )
    if scales.device != blocks.device:
        raise ValueError(f"{name} scales is on {scales.device} but its blocks are on {blocks.device}")
    if not (check_values and scales.numel()):
        return
    # One matrix at a time: the mask of a whole stacked layer's scales grows with the layer.
    for lead in itertools.product(*map(range, scales.shape[:-2])):
        bad = scales[lead] == _SCALE_NAN
        if bool(bad.any()):
            index = lead + tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"{name} scales{list(index)} is 255, the e8m0 NaN encoding; an MXFP4 scale byte "
                "must be 0..254 (2 ** (s - 127))"
            )


def _scale_values(scales: torch.Tensor) -> torch.Tensor:
    """2 ** (s - 127) float32, exactly: the byte as a float32's exponent field (s >= 1), or the
    subnormal 2**-127 (s = 0)."""
    exponent = scales.to(torch.int32)
    bits = torch.where(exponent > 0, exponent << 23, torch.full_like(exponent, 1 << 22))
    return bits.view(torch.float32)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``e2m1[code] * 2 ** (scale - 127)`` in float32.

    Parameters
    ----------
    blocks : Tensor [..., rows, cols/32, 16] uint8, CPU or CUDA
    scales : Tensor [..., rows, cols/32] uint8, same device

    Returns
    -------
    Tensor [..., rows, cols] float32 (exact: every value is an e2m1 value times a power of
    two; blocks whose ``6 * 2 ** (s - 127)`` passes float32's range give inf).

    Raises
    ------
    TypeError, ValueError
        As `check_mxfp4` (a scale byte 255 included).
    """
    check_mxfp4(blocks, scales)
    return decode_mxfp4(blocks, scales)


def decode_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`dequantize_mxfp4` without the checks (the caller has made them): float32 [..., rows, cols]."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    low = table[(blocks & 0x0F).long()]
    high = table[(blocks >> 4).long()]
    values = torch.stack((low, high), dim=-1).reshape(*blocks.shape[:-1], MXFP4_BLOCK)
    values.mul_(_scale_values(scales)[..., None])
    return values.reshape(*blocks.shape[:-2], blocks.shape[-2] * MXFP4_BLOCK)


def _block_exponent(amax: torch.Tensor) -> torch.Tensor:
    """ceil(log2(amax / 6)) int32 computed exactly: with amax = m * 2**p (m in [0.5, 1)),
    amax <= 6 * 2**e first holds at e = p - 3 when m <= 0.75, else at e = p - 2."""
    mantissa, exponent = torch.frexp(amax)
    e = torch.where(mantissa <= 0.75, exponent - 3, exponent - 2)
    e = torch.where(amax > 0, e, torch.full_like(e, -SCALE_BIAS))
    return e.clamp(-SCALE_BIAS, SCALE_BIAS)


def quantize_mxfp4(w: torch.Tensor):
    """Quantize ``w`` [..., rows, cols] to MXFP4 (one scale byte per row and 32 columns).

    Parameters
    ----------
    w : Tensor [..., rows, cols] float32/bfloat16/float16/float64, CPU or CUDA; cols a multiple of 32;
        finite values

    Returns
    -------
    blocks : Tensor [..., rows, cols/32, 16] uint8
    scales : Tensor [..., rows, cols/32] uint8
        Per block ``e = ceil(log2(amax / 6))`` (byte ``127 + e``), codes rounded to the
        nearest e2m1 value of ``w / 2**e`` (ties to the even code); ``dequantize_mxfp4``
        returns ``w`` within half an e2m1 step of each element, exactly on grid values.

    Memory: whole rows are quantized a step of about ``_STEP_ELEMENTS`` (2**17) elements at a
    time (one row when a row is longer), never copying ``w``; beyond ``w`` and the outputs
    (17/32 byte an element) the peak extra memory is one step's temporaries, about 35 bytes an
    element of a step (under 5 MB): less than one float32 expert of 2**20 elements or more
    (gpt-oss-20b's have 16.6M), whatever the number of experts.

    Raises
    ------
    TypeError, ValueError
        ``w`` not a float tensor of at least 2 dims, cols not a multiple of 32, a value
        that is not finite (naming the leading index, e.g. the expert, that holds it).
    """
    _check_input(w)
    rows, cols = w.shape[-2:]
    lead = tuple(w.shape[:-2])
    blocks = torch.empty(*lead, rows, cols // MXFP4_BLOCK, MXFP4_BLOCK // 2, dtype=torch.uint8, device=w.device)
    scales = torch.empty(*lead, rows, cols // MXFP4_BLOCK, dtype=torch.uint8, device=w.device)
    _quantize_mxfp4_into(w, blocks, scales)
    return blocks, scales


def _check_input(w) -> None:
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"w must be a torch.Tensor, got {type(w).__name__}")
    if not w.is_floating_point() or w.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise ValueError(f"w must be a float32/bfloat16/float16/float64 tensor, got {w.dtype}")
    if w.dim() < 2:
        raise ValueError(f"w must have at least 2 dims [..., rows, cols], got shape {tuple(w.shape)}")
    if w.shape[-1] % MXFP4_BLOCK:
        raise ValueError(
            f"w has {w.shape[-1]} columns; MXFP4 needs a multiple of {MXFP4_BLOCK} (one scale per "
            f"{MXFP4_BLOCK} input columns)"
        )


def _quantize_mxfp4_into(w: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """`quantize_mxfp4` of ``w`` written into contiguous ``blocks`` and ``scales`` of its
    result's shapes (e.g. rows of a layer's parameters), a step of rows at a time."""
    _check_input(w)
    if not w.numel():
        return
    rows, cols = w.shape[-2:]
    lead = tuple(w.shape[:-2])
    midpoints = torch.tensor(_MIDPOINTS, dtype=torch.float64, device=w.device)
    step_rows = max(1, _STEP_ELEMENTS // cols)
    flat_blocks, flat_scales = blocks.view(-1, *blocks.shape[-2:]), scales.view(-1, scales.shape[-1])
    for first, chunk in row_steps(w, step_rows):
        finite = torch.isfinite(chunk)
        if not bool(finite.all()):
            bad_row = first + int((~finite).any(dim=-1).nonzero()[0, 0])
            where = f"w{list(lead_index(lead, bad_row // rows))}" if lead else "w"
            raise ValueError(f"{where} holds inf or NaN values, which MXFP4 cannot represent")
        chunk_blocks, chunk_scales = _quantize_rows(chunk, midpoints)
        flat_blocks[first : first + chunk.shape[0]] = chunk_blocks
        flat_scales[first : first + chunk.shape[0]] = chunk_scales


def row_steps(w: torch.Tensor, step_rows: int):
    """(first flat row, view [n, cols]) pieces of ``w`` [..., rows, cols], ``step_rows`` rows
    at most, in order; views, never copies (a contiguous ``w`` is stepped across its
    matrices, another one matrix by matrix)."""
    rows, cols = w.shape[-2:]
    if w.is_contiguous():
        flat = w.view(-1, cols)
        for first in range(0, flat.shape[0], step_rows):
            yield first, flat[first : first + step_rows]
        return
    for index in range(math.prod(w.shape[:-2])):
        matrix = w[lead_index(tuple(w.shape[:-2]), index)]
        for first in range(0, rows, step_rows):
            yield index * rows + first, matrix[first : first + step_rows]


def lead_index(lead: tuple, flat: int) -> tuple:
    """The index into the leading dims ``lead`` of matrix number ``flat`` (row-major)."""
    index = []
    for size in reversed(lead):
        flat, rest = divmod(flat, size)
        index.append(rest)
    return tuple(reversed(index))


def _quantize_rows(rows: torch.Tensor, midpoints: torch.Tensor):
    """blocks [n, cols/32, 16] and scales [n, cols/32] uint8 of finite ``rows`` [n, cols]
    (one float64 copy of ``rows``, worked on in place, and int32 codes)."""
    scaled = rows.to(torch.float64, memory_format=torch.contiguous_format, copy=True)
    scaled = scaled.view(rows.shape[0], rows.shape[1] // MXFP4_BLOCK, MXFP4_BLOCK)
    # amax(|x|) as max(max x, -min x): the same value without an |x| copy.
    exponent = _block_exponent(torch.maximum(scaled.amax(dim=-1), scaled.amin(dim=-1).neg_()))
    # Dividing by a power of two is exact in float64 for every float32 input.
    scaled.mul_(torch.pow(2.0, -exponent.double())[..., None])
    negative = torch.signbit(scaled)
    magnitude = scaled.abs_().clamp_(max=_E2M1_MAX)
    code = torch.bucketize(magnitude, midpoints, out_int32=True)  # a tie to midpoint k lands on code k
    tie = torch.bucketize(magnitude, midpoints, out_int32=True, right=True) != code  # ... and k + 1 here
    code += tie & (code % 2 == 1)  # ties go to the even code
    code |= negative.int() << 3
    pairs = code.to(torch.uint8).reshape(*code.shape[:-1], MXFP4_BLOCK // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4), (exponent + SCALE_BIAS).to(torch.uint8)
