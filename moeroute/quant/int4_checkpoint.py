"""Unpack one INT4 linear weight of a checkpoint into moeroute's INT4 layout (`moeroute.quant.int4`).

Each function takes the tensors a checkpoint stores for one linear weight W [N, K] (N
output rows, K input columns) and returns an `Int4Weight`: ``packed`` uint8 [N, K/2] (low
nibble the even column), ``scales`` [N, K/g] in the checkpoint's own dtype, ``zeros`` uint8
[N, K/g] (None when symmetric: z = 8) and ``perm`` (None, or GPTQ's act-order column order).
The layouts read, as their writers publish them:

* **compressed-tensors pack-quantized** (`unpack_compressed_tensors`): ``weight_packed``
  int32 [N, K/8], element k in bits 4*(k % 8) of word k // 8, each stored as the signed
  integer plus 8 (so the stored nibble is moeroute's q); ``weight_scale`` [N, K/g];
  ``weight_shape`` [2] = (N, K); when asymmetric ``weight_zero_point``, int32 [ceil(N/8),
  K/g] packed the same way along the rows (row r in bits 4*(r % 8) of word r // 8), each the
  signed zero point plus 8 (older writers stored it unpacked, int8 [N, K/g], signed: read
  as well). ``W = (q - z) * s``.
* **GPTQ** (`unpack_gptq`): ``qweight`` int32 [K/8, N], element (n, k) in bits 4*(k % 8) of
  ``qweight[k // 8, n]``; ``qzeros`` int32 [K/g, N/8], the zero point of (n, group) in bits
  4*(n % 8) of ``qzeros[group, n // 8]``; ``scales`` [K/g, N]; ``g_idx`` [K], the group of
  each input column. The "gptq" checkpoint format (AutoGPTQ, and GPTQModel's default
  on disk) stores each zero point minus one, so z = (stored + 1) mod 16; "gptq_v2" stores
  it as it is. Symmetric GPTQ stores z = 8 everywhere (7 in "gptq"), checked and dropped.
* **AWQ GEMM** (`unpack_awq`): ``qweight`` int32 [K, N/8], the eight columns 8c .. 8c+7 of
  word ``qweight[k, c]`` in the nibble order 0, 2, 4, 6, 1, 3, 5, 7 (nibble i, bits 4i,
  holds column 8c + ORDER[i]); ``qzeros`` int32 [K/g, N/8] in the same order, stored as
  they are; ``scales`` [K/g, N]. Always asymmetric.

**GPTQ act order.** With ``desc_act`` GPTQ quantizes the columns in a permuted order and
``g_idx[k]`` names the group of input column k, so a group's columns are scattered. They
are made contiguous once, here: ``perm = argsort(g_idx)`` (stable), and the returned
``packed`` holds the checkpoint's columns in that order (canonical column j is checkpoint
column ``perm[j]``), with the checkpoint's scales and zero points unchanged (canonical group
j is g_idx's group j). The weight is then ``W[:, perm]``, and ``x @ W^T = x[:, perm] @
W[:, perm]^T``: a layer applies the same permutation to the activations it multiplies.
For a down projection that permutation can be folded into the rows of gate and up (its
input columns are their output rows), at no cost per token; a gate_up projection's input
is the hidden state, whose permutation (one per expert, shared by gate and up, which GPTQ
quantizes from the same inputs) the INT4 experts gather per routed row
(`moeroute.experts.formats.int4`; `fold_act_order` does the first and checks the second).
Each group must hold exactly g columns (what GPTQ writes); ``g_idx == k // g`` (no act
order) gives ``perm`` None.

The ``pack_*`` functions write moeroute's layout back into these (`pack_int4_checkpoint` by
``QuantConfig.checkpoint``): unpacking what they write gives back the same bytes, scales and
zero points, and packing what the unpackers read gives back the checkpoint's tensors byte for
byte (GPTQ act order included: `pack_gptq` writes an `Int4Weight`'s columns back in the
order of its ``perm`` and ``g_idx`` from it).

Memory: a step of output rows (about 2**20 elements) at a time; beyond the inputs and the
outputs, the temporaries are those of one step. On little-endian hosts compressed-tensors'
and GPTQ's words are read as bytes (a view and a byte transpose, no nibble arithmetic), and
``out=`` writes straight into a layer's rows.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import NamedTuple

import torch

from moeroute.quant.config import QuantConfig
from moeroute.quant.int4 import INT4_SCALE_DTYPES, SYMMETRIC_ZERO, _group_size, check_int4, pack_int4, unpack_int4

__all__ = [
    "AWQ_ORDER",
    "Int4Weight",
    "fold_act_order",
    "pack_awq",
    "pack_compressed_tensors",
    "pack_gptq",
    "pack_int4_checkpoint",
    "unpack_awq",
    "unpack_compressed_tensors",
    "unpack_gptq",
    "unpack_int4_checkpoint",
    "INT4_CHECKPOINT_KEYS",
]

#: AWQ GEMM's packing: nibble i of a word holds column ORDER[i] of its eight.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
#: The nibble holding column m of a word: the inverse of AWQ_ORDER.
_AWQ_NIBBLE_OF_COLUMN = tuple(AWQ_ORDER.index(m) for m in range(8))

#: Per checkpoint layout: (required keys, optional keys) of one linear weight.
INT4_CHECKPOINT_KEYS = {
    "compressed-tensors": (("weight_packed", "weight_scale"), ("weight_shape", "weight_zero_point")),
    "gptq": (("qweight", "qzeros", "scales"), ("g_idx",)),
    "gptq_v2": (("qweight", "qzeros", "scales"), ("g_idx",)),
    "awq": (("qweight", "qzeros", "scales"), ()),
}

_STEP_ELEMENTS = 1 << 20
_SHIFTS = tuple(4 * i for i in range(8))
#: The layouts' words read as bytes (a view, no nibble arithmetic) on little-endian hosts.
_LITTLE_ENDIAN = sys.byteorder == "little"


class Int4Weight(NamedTuple):
    """One weight in moeroute's INT4 layout (`moeroute.quant.int4`)."""

    #: uint8 [N, K/2]: element 2j in byte j's low nibble, 2j+1 in its high nibble.
    packed: torch.Tensor
    #: [N, K/g] float32, bfloat16 or float16 (the checkpoint's dtype).
    scales: torch.Tensor
    #: uint8 [N, K/g] zero points 0..15, or None (symmetric: z = 8).
    zeros: torch.Tensor | None
    #: int64 [K]: canonical column j is the checkpoint's input column perm[j] (GPTQ act
    #: order), or None (the checkpoint's order).
    perm: torch.Tensor | None = None

    def tensors(self) -> tuple:
        """(packed, scales) or (packed, scales, zeros): what `dequantize_int4` takes."""
        return (self.packed, self.scales) if self.zeros is None else (self.packed, self.scales, self.zeros)


def _key(name: str, key: str) -> str:
    return f"{name}.{key}" if name else key


def _tensor(name: str, key: str, value, dtypes, dims: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{_key(name, key)} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in dtypes:
        allowed = "/".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{_key(name, key)} must be {allowed}, got {value.dtype}")
    if value.dim() != dims:
        raise ValueError(f"{_key(name, key)} must have {dims} dims, got shape {tuple(value.shape)}")
    return value


def _shape(name: str, key: str, value: torch.Tensor, expected: tuple, why: str) -> None:
    if tuple(value.shape) != tuple(expected):
        raise ValueError(f"{_key(name, key)} has shape {tuple(value.shape)}; {why} needs {list(expected)}")


def _scales(name: str, key: str, value) -> torch.Tensor:
    scales = _tensor(name, key, value, INT4_SCALE_DTYPES, 2)
    finite = torch.isfinite(scales)
    if scales.numel() and not bool(finite.all()):
        index = [int(i) for i in (~finite).nonzero()[0]]
        raise ValueError(f"{_key(name, key)}{index} is {float(scales[tuple(index)])}; INT4 scales must be finite")
    return scales


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """uint8 [..., W, 8]: nibble i (bits 4i) of each int32 word (any sign)."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=words.device)
    return ((words[..., None] >> shifts) & 0x0F).to(torch.uint8)


def _out(out, rows: int, cols: int, device) -> torch.Tensor:
    """``out`` checked to be uint8 [rows, cols/2] on ``device``, or a new one."""
    if out is None:
        return torch.empty(rows, cols // 2, dtype=torch.uint8, device=device)
    if not isinstance(out, torch.Tensor) or out.dtype != torch.uint8 or tuple(out.shape) != (rows, cols // 2):
        got = f"{out.dtype} {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"out must be uint8 [{rows}, {cols // 2}] for a [{rows}, {cols}] weight, got {got}")
    if out.device != device:
        raise ValueError(f"out is on {out.device} but the checkpoint tensors are on {device}")
    return out


def _steps(total: int, per_item: int):
    step = max(1, _STEP_ELEMENTS // max(1, per_item))
    for first in range(0, total, step):
        yield slice(first, min(first + step, total))


def _check_symmetric_zeros(name: str, key: str, zeros: torch.Tensor) -> None:
    bad = zeros != SYMMETRIC_ZERO
    if zeros.numel() and bool(bad.any()):
        index = [int(i) for i in bad.nonzero()[0]]
        raise ValueError(
            f"{_key(name, key)} gives the zero point {int(zeros[tuple(index)])} at [row, group] {index}, but the "
            f"weight is symmetric (z = {SYMMETRIC_ZERO}); read it with symmetric=False"
        )


def unpack_compressed_tensors(
    weight_packed,
    weight_scale,
    weight_shape=None,
    weight_zero_point=None,
    *,
    group_size: int,
    symmetric: bool,
    name: str = "",
    out: torch.Tensor | None = None,
) -> Int4Weight:
    """moeroute's INT4 layout of one compressed-tensors pack-quantized weight (module docstring).

    Parameters
    ----------
    weight_packed : Tensor int32 [N, K/8]
    weight_scale : Tensor [N, K/g] float32/bfloat16/float16
    weight_shape : Tensor [2] integer (N, K), optional (K = 8 * weight_packed.shape[1] without it)
    weight_zero_point : Tensor int32 [ceil(N/8), K/g] (packed) or int8 [N, K/g] (signed), asymmetric
        only (a symmetric weight's, if stored, must be all zero points 8, i.e. signed 0)
    group_size : {32, 64, 128}
    symmetric : bool
    name : str
        The module's key prefix, named in the messages (e.g. "model.layers.3.mlp.experts.7.up_proj").
    out : Tensor uint8 [N, K/2], optional
        Where to write the packed integers (e.g. a layer's own rows); a new tensor when None.

    Raises
    ------
    TypeError, ValueError
        A tensor of another dtype or shape, K not a multiple of ``group_size``, a missing zero
        point of an asymmetric weight, a non-finite scale; the message names the key.
    """
    packed, scales, zeros = _ct_side(
        name, weight_packed, weight_scale, weight_shape, weight_zero_point, group_size, symmetric
    )
    return Int4Weight(_ct_weight(packed, scales.shape[1] * group_size, out), scales, zeros)


def _ct_side(name, weight_packed, weight_scale, weight_shape, weight_zero_point, group_size, symmetric):
    """(weight_packed checked, scales, zeros) of a compressed-tensors weight: every check, the
    weight's integers not read (it may be a meta tensor)."""
    group = _group_size(group_size)
    packed = _tensor(name, "weight_packed", weight_packed, (torch.int32,), 2)
    rows, words = packed.shape
    cols = 8 * words
    if weight_shape is not None:
        shape = _tensor(name, "weight_shape", weight_shape, (torch.int64, torch.int32), 1)
        _shape(name, "weight_shape", shape, (2,), "(N, K)")
        rows_, cols = (int(v) for v in shape.tolist())
        if rows_ != rows or -(-cols // 8) != words:
            raise ValueError(
                f"{_key(name, 'weight_shape')} is {[rows_, cols]} but {_key(name, 'weight_packed')} has shape "
                f"{tuple(packed.shape)}: {rows} rows of {8 * words - 7}..{8 * words} columns, eight a word"
            )
    if cols % group:
        raise ValueError(f"{_key(name, 'weight_shape')}: K = {cols} is not a multiple of group_size={group}")
    scales = _scales(name, "weight_scale", weight_scale)
    _shape(name, "weight_scale", scales, (rows, cols // group), f"[N, K/g] with group_size={group}")
    zeros = None
    if weight_zero_point is not None:
        point = _tensor(name, "weight_zero_point", weight_zero_point, (torch.int32, torch.int8), 2)
        if point.dtype == torch.int32:
            _shape(name, "weight_zero_point", point, (-(-rows // 8), cols // group), "packed int32 [ceil(N/8), K/g]")
            zeros = _nibbles(point).permute(0, 2, 1).reshape(-1, cols // group)[:rows].contiguous()
        else:
            _shape(name, "weight_zero_point", point, (rows, cols // group), "int8 [N, K/g]")
            if point.numel() and bool(((point < -8) | (point > 7)).any()):
                raise ValueError(f"{_key(name, 'weight_zero_point')} holds values outside -8..7")
            zeros = (point.to(torch.int16) + SYMMETRIC_ZERO).to(torch.uint8)
        if symmetric:
            _check_symmetric_zeros(name, "weight_zero_point", zeros)
            zeros = None
    elif not symmetric:
        raise ValueError(f"{_key(name, 'weight_zero_point')} is missing; an asymmetric weight needs its zero points")
    return packed, scales.contiguous(), zeros


def _ct_weight(packed: torch.Tensor, cols: int, out) -> torch.Tensor:
    # Element k in bits 4 * (k % 8) of word k // 8: the little-endian bytes of the words are
    # moeroute's bytes (element 2j low, 2j + 1 high nibble of byte j), stored q = signed + 8.
    rows = packed.shape[0]
    out = _out(out, rows, cols, packed.device)
    if _LITTLE_ENDIAN:
        out.copy_(packed.contiguous().view(torch.uint8)[:, : cols // 2])
        return out
    words = packed.shape[1]
    for step in _steps(rows, cols):
        out[step] = pack_int4(_nibbles(packed[step]).reshape(-1, 8 * words)[:, :cols])
    return out


def unpack_gptq(
    qweight,
    qzeros,
    scales,
    g_idx=None,
    *,
    group_size: int,
    symmetric: bool,
    checkpoint: str = "gptq",
    name: str = "",
    out: torch.Tensor | None = None,
) -> Int4Weight:
    """moeroute's INT4 layout of one GPTQ weight (module docstring), act order applied.

    Parameters
    ----------
    qweight : Tensor int32 [K/8, N]
    qzeros : Tensor int32 [K/g, N/8]
    scales : Tensor [K/g, N] float16/bfloat16/float32
    g_idx : Tensor int32/int64 [K], optional (None: group k // g)
    group_size : {32, 64, 128}
    symmetric : bool
        True: every zero point must be 8 (checked); none is returned.
    checkpoint : {"gptq", "gptq_v2"}
        "gptq" stores zero points minus one, "gptq_v2" as they are.
    name : str
        The module's key prefix, named in the messages.
    out : Tensor uint8 [N, K/2], optional
        Where to write the packed integers; a new tensor when None.

    Returns
    -------
    Int4Weight, with ``perm`` set when ``g_idx`` is not k // g.

    Raises
    ------
    TypeError, ValueError
        A tensor of another dtype or shape (N or K not a multiple of 8 and g), a ``g_idx``
        value outside [0, K/g) or a group without exactly g columns, a symmetric weight with
        another zero point, a non-finite scale; the message names the key.
    """
    words, scale, zeros, perm = _gptq_side(name, qweight, qzeros, scales, g_idx, group_size, symmetric, checkpoint)
    return Int4Weight(_gptq_weight(words, perm, out), scale, zeros, perm)


def _gptq_side(name, qweight, qzeros, scales, g_idx, group_size, symmetric, checkpoint):
    """(qweight checked, scales [N, K/g], zeros, perm) of a GPTQ weight: every check, the
    weight's integers not read (it may be a meta tensor)."""
    group = _group_size(group_size)
    if checkpoint not in ("gptq", "gptq_v2"):
        raise ValueError(f"checkpoint={checkpoint!r} is not a GPTQ layout; use 'gptq' or 'gptq_v2'")
    words = _tensor(name, "qweight", qweight, (torch.int32,), 2)
    cols, rows = 8 * words.shape[0], words.shape[1]
    if cols % group:
        raise ValueError(
            f"{_key(name, 'qweight')} has shape {tuple(words.shape)}: K = {cols} is not a multiple of "
            f"group_size={group}"
        )
    if rows % 8:
        raise ValueError(f"{_key(name, 'qweight')} has N = {rows} output columns; GPTQ's qzeros needs a multiple of 8")
    zero_words = _tensor(name, "qzeros", qzeros, (torch.int32,), 2)
    _shape(name, "qzeros", zero_words, (cols // group, rows // 8), f"[K/g, N/8] with group_size={group}")
    scale = _scales(name, "scales", scales)
    _shape(name, "scales", scale, (cols // group, rows), f"[K/g, N] with group_size={group}")
    zeros = _nibbles(zero_words).reshape(cols // group, rows)
    if checkpoint == "gptq":
        zeros = (zeros + 1) & 0x0F
    zeros = zeros.t().contiguous()
    if symmetric:
        _check_symmetric_zeros(name, "qzeros", zeros)
        zeros = None
    perm = None
    if g_idx is not None:
        index = _tensor(name, "g_idx", g_idx, (torch.int32, torch.int64), 1)
        _shape(name, "g_idx", index, (cols,), "one group per input column, [K]")
        perm = _act_order(name, index.to(torch.int64), group)
    return words, scale.t().contiguous(), zeros, perm


def _gptq_weight(words: torch.Tensor, perm, out) -> torch.Tensor:
    # Element (n, k) in bits 4 * (k % 8) of word [k // 8, n]: byte b of that word holds k =
    # 8 (k // 8) + 2b (low nibble) and + 1 (high), so moeroute's row n is a byte transpose.
    cols, rows = 8 * words.shape[0], words.shape[1]
    out = _out(out, rows, cols, words.device)
    if _LITTLE_ENDIAN and perm is None and words.is_contiguous() and out.is_contiguous():
        # One strided copy of the bytes, no temporaries.
        out.view(rows, cols // 8, 4).copy_(words.view(torch.uint8).view(cols // 8, rows, 4).permute(1, 0, 2))
        return out
    for step in _steps(rows, cols):
        if _LITTLE_ENDIAN:
            block = words[:, step].contiguous().view(torch.uint8).view(cols // 8, -1, 4).permute(1, 0, 2)
            if perm is None:
                out[step].view(-1, cols // 8, 4).copy_(block)
                continue
            q = unpack_int4(block.reshape(-1, cols // 2))
        else:
            q = _nibbles(words[:, step]).permute(1, 0, 2).reshape(-1, cols)
        out[step] = pack_int4(q if perm is None else q[:, perm])
    return out


def _act_order(name: str, g_idx: torch.Tensor, group: int) -> torch.Tensor | None:
    """None when ``g_idx`` is k // g; else the stable argsort making each group contiguous."""
    cols = g_idx.shape[0]
    groups = cols // group
    if g_idx.numel() and bool(((g_idx < 0) | (g_idx >= groups)).any()):
        bad = int(((g_idx < 0) | (g_idx >= groups)).nonzero()[0, 0])
        raise ValueError(
            f"{_key(name, 'g_idx')}[{bad}] is {int(g_idx[bad])}, outside the {groups} groups [0, {groups})"
        )
    trivial = torch.arange(cols, device=g_idx.device) // group
    if bool((g_idx == trivial).all()):
        return None
    counts = torch.bincount(g_idx, minlength=groups)
    if bool((counts != group).any()):
        bad = int((counts != group).nonzero()[0, 0])
        raise ValueError(
            f"{_key(name, 'g_idx')} gives group {bad} {int(counts[bad])} columns; contiguous groups need "
            f"group_size={group} columns in each"
        )
    return torch.argsort(g_idx, stable=True)


def unpack_awq(qweight, qzeros, scales, *, group_size: int, name: str = "", out=None) -> Int4Weight:
    """moeroute's INT4 layout of one AWQ GEMM weight (module docstring); always asymmetric.

    Parameters
    ----------
    qweight : Tensor int32 [K, N/8]
    qzeros : Tensor int32 [K/g, N/8]
    scales : Tensor [K/g, N] float16/bfloat16/float32
    group_size : {32, 64, 128}
    name : str
        The module's key prefix, named in the messages.
    out : Tensor uint8 [N, K/2], optional
        Where to write the packed integers; a new tensor when None.

    Raises
    ------
    TypeError, ValueError
        A tensor of another dtype or shape, K not a multiple of ``group_size``, a non-finite
        scale; the message names the key.
    """
    words, scale, zeros = _awq_side(name, qweight, qzeros, scales, group_size)
    return Int4Weight(_awq_weight(words, out), scale, zeros)


def _awq_side(name, qweight, qzeros, scales, group_size):
    """(qweight checked, scales [N, K/g], zeros) of an AWQ weight: every check, the weight's
    integers not read (it may be a meta tensor)."""
    group = _group_size(group_size)
    words = _tensor(name, "qweight", qweight, (torch.int32,), 2)
    cols, rows = words.shape[0], 8 * words.shape[1]
    if cols % group:
        raise ValueError(
            f"{_key(name, 'qweight')} has shape {tuple(words.shape)}: K = {cols} is not a multiple of "
            f"group_size={group}"
        )
    zero_words = _tensor(name, "qzeros", qzeros, (torch.int32,), 2)
    _shape(name, "qzeros", zero_words, (cols // group, rows // 8), f"[K/g, N/8] with group_size={group}")
    scale = _scales(name, "scales", scales)
    _shape(name, "scales", scale, (cols // group, rows), f"[K/g, N] with group_size={group}")
    order = torch.tensor(_AWQ_NIBBLE_OF_COLUMN, dtype=torch.int64, device=words.device)
    zeros = _nibbles(zero_words)[..., order].reshape(cols // group, rows).t().contiguous()
    return words, scale.t().contiguous(), zeros


def _awq_weight(words: torch.Tensor, out) -> torch.Tensor:
    cols, rows = words.shape[0], 8 * words.shape[1]
    out = _out(out, rows, cols, words.device)
    order = torch.tensor(_AWQ_NIBBLE_OF_COLUMN, dtype=torch.int64, device=words.device)
    for step in _steps(rows // 8, 8 * cols):
        if _LITTLE_ENDIAN:  # nibble 2b is byte b's low nibble, 2b + 1 its high one
            q = unpack_int4(words[:, step].contiguous().view(torch.uint8))
            q = q.view(cols, -1, 8)[..., order].reshape(cols, -1)
        else:
            q = _nibbles(words[:, step])[..., order].reshape(cols, -1)
        out[8 * step.start : 8 * step.stop] = pack_int4(q.t())
    return out


def unpack_int4_checkpoint(
    tensors: Mapping, quant, name: str = "", *, out: torch.Tensor | None = None, check_only: bool = False
) -> Int4Weight:
    """Unpack one weight from its checkpoint tensors, keyed by their names under the module.

    Parameters
    ----------
    tensors : mapping of str to Tensor
        The module's tensors under their checkpoint names, e.g. ``{"weight_packed": ...,
        "weight_scale": ..., "weight_shape": ...}`` (compressed-tensors), ``{"qweight": ...,
        "qzeros": ..., "scales": ..., "g_idx": ...}`` (GPTQ) or without g_idx (AWQ).
    quant : QuantConfig
        format "int4" with ``checkpoint`` set (`QuantConfig.from_hf` sets it).
    name : str
        The module's key prefix, named in the messages.
    out : Tensor uint8 [N, K/2], optional
        Where to write the packed integers (e.g. a layer's own rows); a new tensor when None.
    check_only : bool
        Every check, without reading the weight's integers (``weight_packed`` / ``qweight``
        may then be a meta tensor of the file's shape and dtype): ``packed`` is None.

    Raises
    ------
    KeyError
        A required tensor missing (named).
    ValueError
        A tensor the layout does not have (named), or as the unpack function of the layout.
    """
    if not isinstance(quant, QuantConfig) or quant.format != "int4":
        raise ValueError(f"quant must be a QuantConfig of format 'int4', got {quant!r}")
    if quant.checkpoint not in INT4_CHECKPOINT_KEYS:
        raise ValueError(
            f"quant.checkpoint={quant.checkpoint!r} names no checkpoint layout; use one of "
            f"{tuple(INT4_CHECKPOINT_KEYS)} (QuantConfig.from_hf sets it)"
        )
    required, optional = INT4_CHECKPOINT_KEYS[quant.checkpoint]
    for key in required:
        if key not in tensors:
            raise KeyError(f"{_key(name, key)} is missing from the {quant.checkpoint} checkpoint")
    extra = sorted(set(tensors) - set(required) - set(optional))
    if extra:
        raise ValueError(
            f"{_key(name, extra[0])} is not a tensor of a {quant.checkpoint} INT4 weight (which has "
            f"{required + optional})"
        )
    group = quant.group_size
    if quant.checkpoint == "compressed-tensors":
        words, scales, zeros = _ct_side(
            name,
            tensors["weight_packed"],
            tensors["weight_scale"],
            tensors.get("weight_shape"),
            tensors.get("weight_zero_point"),
            group,
            quant.symmetric,
        )
        packed = None if check_only else _ct_weight(words, scales.shape[1] * group, out)
        return Int4Weight(packed, scales, zeros)
    if quant.checkpoint == "awq":
        words, scales, zeros = _awq_side(name, tensors["qweight"], tensors["qzeros"], tensors["scales"], group)
        return Int4Weight(None if check_only else _awq_weight(words, out), scales, zeros)
    words, scales, zeros, perm = _gptq_side(
        name,
        tensors["qweight"],
        tensors["qzeros"],
        tensors["scales"],
        tensors.get("g_idx"),
        group,
        quant.symmetric,
        quant.checkpoint,
    )
    return Int4Weight(None if check_only else _gptq_weight(words, perm, out), scales, zeros, perm)


# -- packers: moeroute's layout back into a checkpoint's -------------------------------------------


def _pairs(values: torch.Tensor) -> torch.Tensor:
    """uint8 [..., M/2] of values 0..15 [..., M]: element 2j low nibble, 2j + 1 high."""
    return pack_int4(values)


def _as_words(data: torch.Tensor) -> torch.Tensor:
    """int32 [..., M/4] of uint8 bytes [..., M] (little-endian words)."""
    if _LITTLE_ENDIAN:
        return data.contiguous().view(torch.int32)
    b = data.to(torch.int64).view(*data.shape[:-1], -1, 4)
    value = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    return torch.where(value >= 1 << 31, value - (1 << 32), value).to(torch.int32)


def _check_weight(weight, group: int, symmetric: bool, act_order: bool = False) -> tuple:
    if isinstance(weight, Int4Weight):
        packed, scales, zeros = weight[:3]
    elif isinstance(weight, (tuple, list)) and len(weight) in (2, 3):
        packed, scales, *rest = weight
        zeros = rest[0] if rest else None
    else:
        raise TypeError("weight must be an Int4Weight or a (packed, scales[, zeros]) tuple")
    if getattr(weight, "perm", None) is not None and not act_order:
        raise ValueError(
            "weight has an act-order perm, which only GPTQ's g_idx stores; pack the weight in its canonical "
            "column order (perm None)"
        )
    check_int4(packed, scales, zeros, group_size=group, name="weight")
    if packed.dim() != 2:
        raise ValueError(f"weight packed must be one [N, K/2] weight, got shape {tuple(packed.shape)}")
    if symmetric and zeros is not None and bool((zeros != SYMMETRIC_ZERO).any()):
        raise ValueError(f"weight has zero points other than {SYMMETRIC_ZERO} but symmetric=True")
    rows, groups = scales.shape
    if zeros is None:
        zeros = torch.full((rows, groups), SYMMETRIC_ZERO, dtype=torch.uint8, device=packed.device)
    return packed, scales, zeros


def pack_compressed_tensors(
    weight, *, group_size: int, symmetric: bool, scale_dtype=None, zero_point_dtype=torch.int32
) -> dict:
    """The compressed-tensors pack-quantized tensors of one weight in moeroute's layout (the
    inverse of `unpack_compressed_tensors`): ``weight_packed`` int32 [N, K/8],
    ``weight_scale`` [N, K/g] (``scale_dtype``, default the weight's), ``weight_shape`` int64
    [2] and, when not ``symmetric``, ``weight_zero_point`` (int32 [ceil(N/8), K/g] packed along
    the rows, the rows past N zero; or int8 [N, K/g] signed with ``zero_point_dtype=torch.int8``).
    ``weight`` is an `Int4Weight` without act order or a (packed, scales[, zeros]) tuple."""
    group = _group_size(group_size)
    packed, scales, zeros = _check_weight(weight, group, symmetric)
    rows, cols = packed.shape[0], 2 * packed.shape[1]
    out = {
        "weight_packed": _as_words(packed),
        "weight_scale": scales.to(scale_dtype or scales.dtype).contiguous(),
        "weight_shape": torch.tensor([rows, cols], dtype=torch.int64),
    }
    if not symmetric:
        if zero_point_dtype == torch.int8:
            out["weight_zero_point"] = (zeros.to(torch.int16) - SYMMETRIC_ZERO).to(torch.int8)
        elif zero_point_dtype == torch.int32:
            padded = torch.zeros(-(-rows // 8) * 8, zeros.shape[1], dtype=torch.uint8, device=zeros.device)
            padded[:rows] = zeros
            out["weight_zero_point"] = _as_words(_pairs(padded.t())).t().contiguous()
        else:
            raise ValueError(f"zero_point_dtype={zero_point_dtype!r} is not a layout; use torch.int32 or torch.int8")
    return out


def pack_gptq(weight, *, group_size: int, symmetric: bool, checkpoint: str = "gptq", scale_dtype=None, g_idx=True):
    """The GPTQ tensors of one weight in moeroute's layout (the inverse of `unpack_gptq`):
    ``qweight`` int32 [K/8, N], ``qzeros`` int32 [K/g, N/8] (zero points minus one in
    "gptq", as they are in "gptq_v2"; 8 when symmetric), ``scales`` [K/g, N] (``scale_dtype``,
    default the weight's) and, with ``g_idx``, ``g_idx`` int32 [K] = k // g. An `Int4Weight`
    with act order (``perm``) is written back in the checkpoint's column order: canonical
    column j goes to column ``perm[j]``, and ``g_idx[perm[j]] = j // g``.
    A zero point 0 is stored as 15 in "gptq" (what its minus-one wraps to)."""
    group = _group_size(group_size)
    if checkpoint not in ("gptq", "gptq_v2"):
        raise ValueError(f"checkpoint={checkpoint!r} is not a GPTQ layout; use 'gptq' or 'gptq_v2'")
    packed, scales, zeros = _check_weight(weight, group, symmetric, act_order=True)
    rows, cols = packed.shape[0], 2 * packed.shape[1]
    if rows % 8:
        raise ValueError(f"weight has N = {rows} rows; GPTQ's qzeros needs a multiple of 8")
    perm = getattr(weight, "perm", None)
    groups = torch.arange(cols, device=packed.device) // group
    if perm is not None:
        perm = _check_perm(perm, cols, packed.device)
        if not g_idx:
            raise ValueError("weight has an act-order perm, which GPTQ stores as g_idx; pack it with g_idx=True")
        # Canonical column j is the checkpoint's column perm[j], of group j // g.
        original = torch.empty_like(groups)
        original[perm] = groups
        groups = original
        q = torch.empty(rows, cols, dtype=torch.uint8, device=packed.device)
        q[:, perm] = unpack_int4(packed)
        packed = pack_int4(q)
    stored = (zeros.to(torch.int16) - 1).remainder(16).to(torch.uint8) if checkpoint == "gptq" else zeros
    out = {
        "qweight": _as_words(packed.view(rows, cols // 8, 4).permute(1, 0, 2).reshape(cols // 8, rows * 4)),
        "qzeros": _as_words(_pairs(stored.t())),
        "scales": scales.t().to(scale_dtype or scales.dtype).contiguous(),
    }
    if g_idx:
        out["g_idx"] = groups.to(torch.int32)
    return out


def _check_perm(perm, cols: int, device) -> torch.Tensor:
    """``perm`` as int64 on ``device``: ValueError unless a permutation of [0, cols)."""
    if not isinstance(perm, torch.Tensor) or perm.dtype not in (torch.int16, torch.int32, torch.int64):
        raise TypeError(f"weight perm must be an integer tensor, got {getattr(perm, 'dtype', type(perm).__name__)}")
    perm = perm.to(device=device, dtype=torch.int64)
    if perm.shape != (cols,) or not torch.equal(torch.sort(perm).values, torch.arange(cols, device=device)):
        raise ValueError(f"weight perm must be a permutation of the {cols} input columns, got shape {list(perm.shape)}")
    return perm


def pack_awq(weight, *, group_size: int, scale_dtype=None) -> dict:
    """The AWQ GEMM tensors of one weight in moeroute's layout (the inverse of `unpack_awq`):
    ``qweight`` int32 [K, N/8] and ``qzeros`` int32 [K/g, N/8] in the nibble order AWQ_ORDER,
    ``scales`` [K/g, N] (``scale_dtype``, default the weight's). Symmetric weights get zero
    points 8."""
    group = _group_size(group_size)
    packed, scales, zeros = _check_weight(weight, group, False)
    rows, cols = packed.shape[0], 2 * packed.shape[1]
    if rows % 8:
        raise ValueError(f"weight has N = {rows} rows; AWQ packs eight output columns a word")
    order = torch.tensor(AWQ_ORDER, dtype=torch.int64, device=packed.device)

    def columns(values):  # [M, N] values 0..15 -> int32 [M, N/8], nibble i holding column 8c + ORDER[i]
        return _as_words(_pairs(values.reshape(values.shape[0], -1, 8)[..., order].reshape(values.shape[0], -1)))

    qweight = torch.empty(cols, rows // 8, dtype=torch.int32, device=packed.device)
    step = max(2, _STEP_ELEMENTS // rows // 2 * 2)  # an even number of input columns at a time
    for first in range(0, cols, step):
        q = unpack_int4(packed[:, first // 2 : (first + step) // 2])
        qweight[first : first + q.shape[1]] = columns(q.t().contiguous())
    return {
        "qweight": qweight,
        "qzeros": columns(zeros.t()),
        "scales": scales.t().to(scale_dtype or scales.dtype).contiguous(),
    }


def pack_int4_checkpoint(weight, quant, *, scale_dtype=None, g_idx=True, zero_point_dtype=torch.int32) -> dict:
    """The checkpoint tensors of one weight for ``quant.checkpoint``'s layout: the inverse of
    `unpack_int4_checkpoint` (act order: GPTQ only, `pack_gptq`), keyed by their names under the module."""
    if not isinstance(quant, QuantConfig) or quant.format != "int4" or quant.checkpoint not in INT4_CHECKPOINT_KEYS:
        raise ValueError(f"quant must be a QuantConfig of format 'int4' with a checkpoint layout, got {quant!r}")
    group = quant.group_size
    if quant.checkpoint == "compressed-tensors":
        return pack_compressed_tensors(
            weight,
            group_size=group,
            symmetric=quant.symmetric,
            scale_dtype=scale_dtype,
            zero_point_dtype=zero_point_dtype,
        )
    if quant.checkpoint == "awq":
        return pack_awq(weight, group_size=group, scale_dtype=scale_dtype)
    return pack_gptq(
        weight,
        group_size=group,
        symmetric=quant.symmetric,
        checkpoint=quant.checkpoint,
        scale_dtype=scale_dtype,
        g_idx=g_idx,
    )


def fold_act_order(gate: Int4Weight, up: Int4Weight, down: Int4Weight, name: str = "") -> tuple:
    """One expert's (gate, up, down) with the down projection's act order folded into gate and up.

    ``down.perm`` (its input columns, the intermediate units) permutes the rows of ``gate``
    and ``up`` instead: ``down(act(gate x) * up x) = down[:, p] (act(gate[p] x) * up[p] x)``,
    exact, with no permutation left per token; the returned down has ``perm`` None, and gate
    and up keep their shared ``perm`` (of the hidden columns, which a kernel gathers).

    Raises
    ------
    ValueError
        ``gate`` and ``up`` with different permutations (GPTQ derives both from the same
        inputs; two different ones cannot share one gather), or shapes that do not chain.
    """
    if (gate.perm is None) != (up.perm is None) or (gate.perm is not None and not torch.equal(gate.perm, up.perm)):
        raise ValueError(
            f"{_key(name, 'gate_proj')} and {_key(name, 'up_proj')} have different act orders (g_idx); "
            "gate and up multiply the same hidden columns and must share one permutation"
        )
    inter = gate.packed.shape[0]
    if up.packed.shape[0] != inter or 2 * down.packed.shape[1] != inter:
        raise ValueError(
            f"{_key(name, 'down_proj')} has {2 * down.packed.shape[1]} input columns but gate and up have "
            f"{gate.packed.shape[0]} and {up.packed.shape[0]} rows"
        )
    if down.perm is None:
        return gate, up, down
    rows = down.perm.to(gate.packed.device)

    def permuted(weight: Int4Weight) -> Int4Weight:
        zeros = None if weight.zeros is None else weight.zeros[rows]
        return Int4Weight(weight.packed[rows], weight.scales[rows], zeros, weight.perm)

    return permuted(gate), permuted(up), down._replace(perm=None)
