"""`QuantConfig`: which quantized format the expert weights are stored in, and how the
activations are quantized around them.

A format is data plus a decode rule (docs/quant.md); it never decides who computes the
shared experts (that is `moeroute.layout.ExpertLayout`'s answer). Each format names the
fields it uses in `FORMAT_FIELDS`: "mxfp4" (gpt-oss: 4-bit e2m1 values in blocks of 32 along
the input dimension with a power-of-two scale byte each, activations left in bfloat16 or
float32) is one entry with its own defaults; "int4" (group-quantized 4-bit integers with a
scale, and a zero point when asymmetric, per group of 32, 64 or 128 input columns, w4a16:
compressed-tensors pack-quantized, GPTQ and AWQ checkpoints) another.

This module imports neither torch nor transformers: a transformers configuration is read
through ``to_dict()`` (`moeroute.config`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from moeroute._validate import integer
from moeroute.config import _as_dict

__all__ = [
    "QuantConfig",
    "FORMATS",
    "ACTIVATION_SCHEMES",
    "SCALE_FORMATS",
    "DEFAULT_BLOCK_SIZE",
    "INT4_GROUP_SIZES",
    "INT4_CHECKPOINTS",
]

#: Weight formats of the routed experts.
FORMATS = ("fp8_block", "fp8_tensor", "mxfp4", "int4")
#: "dynamic": activation scales computed from each call's values (per token group for
#: fp8_block, per token for fp8_tensor); "static": one given scale per expert and projection;
#: "none": activations are not quantized (mxfp4's and int4's w4a16; fp8_block's w8a16).
ACTIVATION_SCHEMES = ("dynamic", "static", "none")
#: "float": any positive float32 scale; "ue8m0": scales are powers of two (DeepSeek-V3.1).
SCALE_FORMATS = ("float", "ue8m0")
#: DeepSeek-V3's weight_block_size: [output rows, input columns] per scale.
DEFAULT_BLOCK_SIZE = (128, 128)

#: MXFP4's block: one scale byte per weight row and 32 input columns (fixed by the format).
MXFP4_BLOCK_SIZE = (1, 32)

#: INT4's input columns per (scale, zero point) group.
INT4_GROUP_SIZES = (32, 64, 128)
#: INT4's default group (GPTQ's and AWQ's usual one).
INT4_DEFAULT_GROUP_SIZE = 128
#: The on-disk INT4 layouts `moeroute.quant.int4` unpacks, as `QuantConfig.checkpoint` names
#: them: compressed-tensors pack-quantized, GPTQ (v1: zero points stored minus one; v2: as
#: they are) and AWQ's GEMM packing.
INT4_CHECKPOINTS = ("compressed-tensors", "gptq", "gptq_v2", "awq")

#: Per format: (block_size default, allowed activation schemes, the first being the
#: default). block_size None means the format has no blocks (one scale per expert and
#: projection). int4's block is (1, group_size), set from ``group_size``.
FORMAT_FIELDS = {
    "fp8_block": (DEFAULT_BLOCK_SIZE, ("dynamic", "none")),
    "fp8_tensor": (None, ("dynamic", "static")),
    "mxfp4": (MXFP4_BLOCK_SIZE, ("none",)),
    "int4": ((1, INT4_DEFAULT_GROUP_SIZE), ("none",)),
}

#: Hugging Face ``quant_method`` values read by `QuantConfig.from_hf`.
_HF_FP8_METHODS = ("fp8",)
_HF_MXFP4_METHODS = ("mxfp4",)
_HF_INT4_METHODS = ("compressed-tensors", "gptq", "awq")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """How the routed experts' weights are quantized.

    Parameters
    ----------
    format : {"fp8_block", "fp8_tensor", "mxfp4", "int4"}
        "fp8_block": float8_e4m3fn weights with one float32 scale per block of
        ``block_size`` (rows, columns), activations quantized per token and group of
        ``block_size[1]`` columns (w8a8), or not at all with ``activation="none"`` (w8a16).
        "fp8_tensor": one float32 scale per expert and projection,
        activations per token (dynamic) or with a given scale (static). "mxfp4": e2m1
        nibbles packed two to a byte with one power-of-two scale byte per row and 32
        columns (`moeroute.quant.mxfp4`), activations unquantized (w4a16). "int4": 4-bit
        integers q with a scale s (and a zero point z, 8 when symmetric) per row and group
        of ``group_size`` input columns, ``w = (q - z) * s`` (`moeroute.quant.int4`),
        activations unquantized (w4a16).
    block_size : (int, int), optional
        (bn, bk) of fp8_block; default (128, 128). Not accepted for fp8_tensor; always
        (1, 32) for mxfp4 and (1, group_size) for int4.
    activation : {"dynamic", "static", "none"}, optional
        Activation scales computed per call, or given (`load_routed_weights`'s
        ``input_scale``; fp8_tensor only), or no activation quantization (mxfp4, int4, and
        fp8_block's w8a16: ``y = x @ dequant(W)^T`` in float32 on the activations as they are,
        docs/quant.md). Default: "dynamic" for the FP8 formats (w8a8, the checkpoints' own
        inference definition), "none" for mxfp4 and int4.
    scale_fmt : {"float", "ue8m0"}
        "ue8m0": the activation scales are rounded up to powers of two
        (``2 ** ceil(log2(amax / 448))``), as the weight scales of such checkpoints are. No
        effect with ``activation="none"`` (there are no activation scales).
    modules_to_not_convert : tuple of str
        Module names a checkpoint keeps unquantized (informational; from ``from_hf``). Not
        part of equality or the hash: two configs of the same format are equal whatever
        their lists (a config read from ``config.json`` agrees with the format read from
        the weights, e.g. by ``MoE.from_hf(block, quant=...)``).
    group_size : {32, 64, 128}, int4 only
        Input columns per scale (and zero point); default 128. None for the other formats.
    symmetric : bool, int4 only
        True (the default): no stored zero points, z = 8; False: one zero point 0..15 per
        group. None for the other formats.
    checkpoint : {"compressed-tensors", "gptq", "gptq_v2", "awq"} or None, int4 only
        The on-disk layout the weights come in (set by ``from_hf``; `moeroute.quant.int4`
        unpacks each into moeroute's one layout). Informational like
        ``modules_to_not_convert``: not part of equality or the hash.

    Raises
    ------
    ValueError
        A field outside its allowed values; the message names the field.
    """

    format: str
    block_size: tuple[int, int] | None = None
    activation: str | None = None
    scale_fmt: str = "float"
    modules_to_not_convert: tuple[str, ...] = dataclasses.field(default=(), compare=False)
    group_size: int | None = dataclasses.field(default=None, kw_only=True)
    symmetric: bool | None = dataclasses.field(default=None, kw_only=True)
    checkpoint: str | None = dataclasses.field(default=None, kw_only=True, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.format, str) or self.format not in FORMAT_FIELDS:
            raise ValueError(f"format={self.format!r} is not a quantized format; use one of {FORMATS}")
        self._int4_fields()
        default_block, activations = FORMAT_FIELDS[self.format]
        if self.format == "int4":
            default_block = (1, self.group_size)
        if self.block_size is None:
            object.__setattr__(self, "block_size", default_block)
        elif default_block is None:
            raise ValueError(
                f"block_size={self.block_size!r} does not apply to format={self.format!r} "
                "(one scale per expert and projection); leave it None"
            )
        else:
            object.__setattr__(self, "block_size", _block_size(self.block_size))
            if self.format == "mxfp4" and self.block_size != MXFP4_BLOCK_SIZE:
                raise ValueError(
                    f"block_size={self.block_size!r} does not apply to format='mxfp4', whose "
                    f"blocks are {MXFP4_BLOCK_SIZE} (one scale per row and 32 columns)"
                )
            if self.format == "int4" and self.block_size != default_block:
                raise ValueError(
                    f"block_size={self.block_size!r} does not apply to format='int4' with "
                    f"group_size={self.group_size}, whose blocks are {default_block}; set group_size"
                )
        if self.activation is None:
            object.__setattr__(self, "activation", activations[0])
        if not isinstance(self.activation, str) or self.activation not in activations:
            raise ValueError(
                f"activation={self.activation!r} is not served by format={self.format!r}; use one of {activations}"
            )
        if not isinstance(self.scale_fmt, str) or self.scale_fmt not in SCALE_FORMATS:
            raise ValueError(f"scale_fmt={self.scale_fmt!r} is unknown; use one of {SCALE_FORMATS}")
        if self.format == "int4" and self.scale_fmt != "float":
            raise ValueError(
                f"scale_fmt={self.scale_fmt!r} does not apply to format='int4', whose scales are stored "
                "floats and whose activations are not quantized; leave it 'float'"
            )
        modules = self.modules_to_not_convert
        if modules is None:
            modules = ()
        if isinstance(modules, str) or not all(isinstance(m, str) for m in modules):
            raise ValueError(f"modules_to_not_convert={modules!r} must be a sequence of module names")
        object.__setattr__(self, "modules_to_not_convert", tuple(modules))

    def _int4_fields(self) -> None:
        """Check and default group_size, symmetric and checkpoint (int4's, None elsewhere)."""
        if self.format != "int4":
            for name in ("group_size", "symmetric", "checkpoint"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"{name}={getattr(self, name)!r} applies to format='int4' only, not "
                        f"format={self.format!r}; leave it None"
                    )
            return
        group = INT4_DEFAULT_GROUP_SIZE if self.group_size is None else self.group_size
        if isinstance(group, bool) or not isinstance(group, int) or group not in INT4_GROUP_SIZES:
            raise ValueError(f"group_size={self.group_size!r} is not an INT4 group size; use one of {INT4_GROUP_SIZES}")
        object.__setattr__(self, "group_size", int(group))
        symmetric = True if self.symmetric is None else self.symmetric
        if not isinstance(symmetric, bool):
            raise ValueError(f"symmetric={self.symmetric!r} must be True or False")
        object.__setattr__(self, "symmetric", symmetric)
        if self.checkpoint is not None and self.checkpoint not in INT4_CHECKPOINTS:
            raise ValueError(
                f"checkpoint={self.checkpoint!r} is not an INT4 layout; use None or one of {INT4_CHECKPOINTS}"
            )

    @property
    def activation_group_size(self) -> int | None:
        """Columns per activation scale: bk for fp8_block, None (the whole row) for fp8_tensor."""
        return None if self.block_size is None else self.block_size[1]

    @property
    def quantizes_activations(self) -> bool:
        """Whether the GEMMs quantize their inputs (w8a8: "dynamic" or "static"); False for
        activation="none" (w8a16 FP8, w4a16 mxfp4 and int4)."""
        return self.activation != "none"

    @property
    def ue8m0(self) -> bool:
        return self.scale_fmt == "ue8m0"

    def scale_shapes(self, num_experts: int, hidden_size: int, intermediate_size: int):
        """Shapes of (gate_up_scale, down_scale) for N experts of sizes H and I.

        fp8_block: [N, 2*ceil(I/bn), ceil(H/bk)] (the gate's block rows, then the up's) and
        [N, ceil(H/bn), ceil(I/bk)]; fp8_tensor: [N, 2] (gate, up) and [N]; mxfp4: uint8
        [N, 2I, H/32] and [N, H, I/32] (H and I multiples of 32); int4: [N, 2I, H/g] and
        [N, H, I/g], g = group_size (H and I multiples of g), the shape of the scales and,
        when asymmetric, of the zero points.
        """
        if self.format == "int4":
            group = self.group_size
            for name, size in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
                if size % group:
                    raise ValueError(
                        f"{name}={size} is not a multiple of group_size={group}, which format='int4' needs "
                        f"(one scale per {group} input columns)"
                    )
            return (
                (num_experts, 2 * intermediate_size, hidden_size // group),
                (num_experts, hidden_size, intermediate_size // group),
            )
        if self.format == "mxfp4":
            for name, size in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
                if size % 32:
                    raise ValueError(
                        f"{name}={size} is not a multiple of 32, which format='mxfp4' needs "
                        "(one scale per 32 input columns)"
                    )
            return (
                (num_experts, 2 * intermediate_size, hidden_size // 32),
                (num_experts, hidden_size, intermediate_size // 32),
            )
        if self.block_size is None:
            return (num_experts, 2), (num_experts,)
        bn, bk = self.block_size
        return (
            (num_experts, 2 * _cdiv(intermediate_size, bn), _cdiv(hidden_size, bk)),
            (num_experts, _cdiv(hidden_size, bn), _cdiv(intermediate_size, bk)),
        )

    def expert_bytes(self, hidden_size: int, intermediate_size: int) -> int:
        """Bytes one expert takes in this format: 3*H*I one-byte weights plus their float32
        scales (FP8), or 3*H*I half-byte weights plus a scale byte per 32 (mxfp4), or 3*H*I
        half-byte weights plus a 16-bit scale (and, asymmetric, a zero-point byte) per group
        (int4, with the bfloat16/float16 scales checkpoints carry)."""
        if self.format == "int4":
            self.scale_shapes(1, hidden_size, intermediate_size)
            groups = 3 * hidden_size * intermediate_size // self.group_size
            return 3 * hidden_size * intermediate_size // 2 + groups * (2 if self.symmetric else 3)
        if self.format == "mxfp4":
            return 3 * hidden_size * intermediate_size // 2 + 3 * hidden_size * intermediate_size // 32
        gate_up, down = self.scale_shapes(1, hidden_size, intermediate_size)
        scales = gate_up[1] * (gate_up[2] if len(gate_up) > 2 else 1) + (down[1] * down[2] if len(down) > 1 else 1)
        return 3 * hidden_size * intermediate_size + 4 * scales

    @classmethod
    def from_hf(cls, config: Any) -> QuantConfig | None:
        """Read a Hugging Face ``quantization_config``.

        Parameters
        ----------
        config : dict, str, os.PathLike or transformers.PretrainedConfig
            A whole ``config.json`` (parsed, a path to it or to its directory, or a
            transformers configuration object) holding ``quantization_config``, or the
            ``quantization_config`` mapping itself. DeepSeek-V3's reads as
            ``{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128]}`` (+ ``"scale_fmt": "ue8m0"`` for V3.1):
            fp8_block; without ``weight_block_size``, fp8_tensor. gpt-oss's
            ``{"quant_method": "mxfp4", "modules_to_not_convert": [...]}``: mxfp4. INT4
            (int4, with ``checkpoint`` naming the layout): compressed-tensors
            (``"quant_method": "compressed-tensors", "format": "pack-quantized"`` whose
            ``config_groups`` quantize weights to ``num_bits: 4``, ``type: "int"``,
            ``strategy: "group"`` with ``group_size`` 32/64/128, ``symmetric`` either way,
            no activation quantization; Kimi-K2-Thinking's), GPTQ (``"quant_method": "gptq",
            "bits": 4, "group_size": g, "sym": ..., "desc_act": ...``, checkpoint format
            "gptq" or "gptq_v2") and AWQ (``"quant_method": "awq", "bits": 4, "group_size": g,
            "zero_point": true, "version": "gemm"``).

        Returns
        -------
        QuantConfig, or None when the model declares no quantization.

        Raises
        ------
        ValueError
            An unreadable file; a ``quant_method``, ``fmt`` or INT4 field moeroute does not
            serve (the message names it and its value); field values `QuantConfig` rejects.
        """
        fields = _as_dict(config)
        if "quant_method" not in fields:
            fields = fields.get("quantization_config")
            if fields is None:
                text = _as_dict(config).get("text_config")
                fields = text.get("quantization_config") if isinstance(text, Mapping) else None
            if fields is None:
                return None
            if not isinstance(fields, Mapping):
                to_dict = getattr(fields, "to_dict", None)
                fields = to_dict() if callable(to_dict) else None
                if not isinstance(fields, Mapping):
                    raise ValueError("quantization_config must be a mapping of its fields")
        method = fields.get("quant_method")
        if method in _HF_MXFP4_METHODS:
            return cls(format="mxfp4", modules_to_not_convert=tuple(fields.get("modules_to_not_convert") or ()))
        if method in _HF_INT4_METHODS:
            return cls(format="int4", **_int4_from_hf(method, fields))
        if method not in _HF_FP8_METHODS:
            raise ValueError(
                f"quantization_config quant_method={method!r} is not served; moeroute reads "
                f"{_HF_FP8_METHODS + _HF_MXFP4_METHODS + _HF_INT4_METHODS} (float8_e4m3fn, MXFP4 or INT4 weights)"
            )
        fmt = fields.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"quantization_config fmt={fmt!r} is not served; moeroute's FP8 is 'e4m3'")
        block = fields.get("weight_block_size")
        scale_fmt = fields.get("scale_fmt") or "float"
        return cls(
            format="fp8_block" if block is not None else "fp8_tensor",
            block_size=None if block is None else tuple(block),
            activation=fields.get("activation_scheme", "dynamic"),
            scale_fmt=scale_fmt,
            modules_to_not_convert=tuple(fields.get("modules_to_not_convert") or ()),
        )


def _int4_from_hf(method: str, fields: Mapping) -> dict:
    """QuantConfig's int4 fields of a compressed-tensors, GPTQ or AWQ ``quantization_config``."""
    if method == "compressed-tensors":
        return _int4_from_compressed_tensors(fields)
    where = f"quantization_config (quant_method={method!r})"
    bits = fields.get("bits", fields.get("w_bit"))
    if isinstance(bits, bool) or bits != 4:
        raise ValueError(f"{where} bits={bits!r} is not served; moeroute reads 4-bit {method.upper()} only")
    group = _int4_group(where, fields.get("group_size", fields.get("q_group_size")))
    ignored = tuple(fields.get("modules_to_not_convert") or ())
    if method == "gptq":
        layout = fields.get("checkpoint_format", fields.get("format")) or "gptq"
        if layout not in ("gptq", "gptq_v2"):
            raise ValueError(
                f"{where} checkpoint_format={layout!r} is not served; moeroute reads 'gptq' (zero points "
                "stored minus one) and 'gptq_v2' (stored as they are)"
            )
        sym = fields.get("sym", True)
        if not isinstance(sym, bool):
            raise ValueError(f"{where} sym={sym!r} must be true or false")
        desc_act = fields.get("desc_act", False)
        if not isinstance(desc_act, bool):
            raise ValueError(f"{where} desc_act={desc_act!r} must be true or false")
        return dict(group_size=group, symmetric=sym, checkpoint=layout, modules_to_not_convert=ignored)
    version = fields.get("version", "gemm")
    if not isinstance(version, str) or version.lower() != "gemm":
        raise ValueError(
            f"{where} version={version!r} is not served; moeroute reads AWQ's 'gemm' packing "
            "(qweight [K, N/8] in the order 0, 2, 4, 6, 1, 3, 5, 7)"
        )
    zero_point = fields.get("zero_point", True)
    if zero_point is not True:
        raise ValueError(
            f"{where} zero_point={zero_point!r} is not served; AWQ's GEMM layout stores zero points (qzeros), "
            "so moeroute reads zero_point=true only"
        )
    return dict(group_size=group, symmetric=False, checkpoint="awq", modules_to_not_convert=ignored)


def _int4_from_compressed_tensors(fields: Mapping) -> dict:
    where = "quantization_config (quant_method='compressed-tensors')"
    groups = fields.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise ValueError(f"{where} config_groups={groups!r} must be a non-empty mapping of quantization schemes")
    found = set()
    for name, scheme in groups.items():
        at = f"{where} config_groups[{name!r}]"
        if not isinstance(scheme, Mapping):
            raise ValueError(f"{at} must be a mapping, got {type(scheme).__name__}")
        layout = scheme.get("format") or fields.get("format")
        if layout != "pack-quantized":
            raise ValueError(
                f"{at} format={layout!r} is not served; moeroute reads compressed-tensors 'pack-quantized' "
                "(INT4 weights packed eight to an int32)"
            )
        for key in ("input_activations", "output_activations"):
            if scheme.get(key) is not None:
                raise ValueError(
                    f"{at} {key} is set; moeroute's INT4 leaves activations unquantized (w4a16), so it must be null"
                )
        weights = scheme.get("weights")
        if not isinstance(weights, Mapping):
            raise ValueError(f"{at} weights={weights!r} must be a mapping of the weight scheme")
        for key, wanted in (("num_bits", 4), ("type", "int"), ("strategy", "group")):
            value = weights.get(key)
            if isinstance(value, bool) or value != wanted:
                raise ValueError(f"{at} weights.{key}={value!r} is not served; moeroute's INT4 needs {wanted!r}")
        if weights.get("dynamic", False) is not False:
            raise ValueError(f"{at} weights.dynamic={weights.get('dynamic')!r} is not served; weights are static")
        order = weights.get("actorder")
        if order not in (None, False, "weight", "static"):
            raise ValueError(
                f"{at} weights.actorder={order!r} is not served; moeroute reads contiguous groups (actorder "
                "null or 'weight'), not a per-column group index (weight_g_idx)"
            )
        symmetric = weights.get("symmetric", True)
        if not isinstance(symmetric, bool):
            raise ValueError(f"{at} weights.symmetric={symmetric!r} must be true or false")
        found.add((_int4_group(f"{at} weights", weights.get("group_size")), symmetric))
    if len(found) > 1:
        raise ValueError(
            f"{where} config_groups quantize weights differently ({sorted(found)} as (group_size, symmetric)); "
            "moeroute reads one INT4 scheme per model"
        )
    ((group, symmetric),) = found
    return dict(
        group_size=group,
        symmetric=symmetric,
        checkpoint="compressed-tensors",
        modules_to_not_convert=tuple(fields.get("ignore") or ()),
    )


def _int4_group(where: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value not in INT4_GROUP_SIZES:
        raise ValueError(
            f"{where} group_size={value!r} is not served; moeroute's INT4 groups are {INT4_GROUP_SIZES} input columns"
        )
    return value


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _block_size(value) -> tuple[int, int]:
    try:
        rows, cols = value
    except (TypeError, ValueError):
        raise ValueError(f"block_size={value!r} must be a pair (rows, columns) of integers >= 1") from None
    try:
        return integer("rows", rows, 1), integer("columns", cols, 1)
    except ValueError:  # IntegerTypeError included: name the pair as the caller wrote it
        raise ValueError(f"block_size={value!r} must be a pair (rows, columns) of integers >= 1") from None
