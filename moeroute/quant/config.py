"""`QuantConfig`: which quantized format the expert weights are stored in, and how the
activations are quantized around them.

A format is data plus a decode rule (docs/quant.md); it never decides who computes the
shared experts (that is `moeroute.layout.ExpertLayout`'s answer). Each format names the
fields it uses in `FORMAT_FIELDS`: "mxfp4" (gpt-oss: 4-bit e2m1 values in blocks of 32 along
the input dimension with a power-of-two scale byte each, activations left in bfloat16 or
float32) is one entry with its own defaults.

This module imports neither torch nor transformers: a transformers configuration is read
through ``to_dict()`` (`moeroute.config`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from moeroute._validate import integer
from moeroute.config import _as_dict

__all__ = ["QuantConfig", "FORMATS", "ACTIVATION_SCHEMES", "SCALE_FORMATS", "DEFAULT_BLOCK_SIZE"]

#: Weight formats of the routed experts.
FORMATS = ("fp8_block", "fp8_tensor", "mxfp4")
#: "dynamic": activation scales computed from each call's values (per token group for
#: fp8_block, per token for fp8_tensor); "static": one given scale per expert and projection;
#: "none": activations are not quantized (mxfp4's w4a16).
ACTIVATION_SCHEMES = ("dynamic", "static", "none")
#: "float": any positive float32 scale; "ue8m0": scales are powers of two (DeepSeek-V3.1).
SCALE_FORMATS = ("float", "ue8m0")
#: DeepSeek-V3's weight_block_size: [output rows, input columns] per scale.
DEFAULT_BLOCK_SIZE = (128, 128)

#: MXFP4's block: one scale byte per weight row and 32 input columns (fixed by the format).
MXFP4_BLOCK_SIZE = (1, 32)

#: Per format: (block_size default, allowed activation schemes, the first being the
#: default). block_size None means the format has no blocks (one scale per expert and
#: projection).
FORMAT_FIELDS = {
    "fp8_block": (DEFAULT_BLOCK_SIZE, ("dynamic",)),
    "fp8_tensor": (None, ("dynamic", "static")),
    "mxfp4": (MXFP4_BLOCK_SIZE, ("none",)),
}

#: Hugging Face ``quant_method`` values read by `QuantConfig.from_hf`.
_HF_FP8_METHODS = ("fp8",)
_HF_MXFP4_METHODS = ("mxfp4",)


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """How the routed experts' weights are quantized.

    Parameters
    ----------
    format : {"fp8_block", "fp8_tensor", "mxfp4"}
        "fp8_block": float8_e4m3fn weights with one float32 scale per block of
        ``block_size`` (rows, columns), activations quantized per token and group of
        ``block_size[1]`` columns. "fp8_tensor": one float32 scale per expert and projection,
        activations per token (dynamic) or with a given scale (static). "mxfp4": e2m1
        nibbles packed two to a byte with one power-of-two scale byte per row and 32
        columns (`moeroute.quant.mxfp4`), activations unquantized (w4a16).
    block_size : (int, int), optional
        (bn, bk) of fp8_block; default (128, 128). Not accepted for fp8_tensor; always
        (1, 32) for mxfp4.
    activation : {"dynamic", "static", "none"}, optional
        Activation scales computed per call, or given (`load_routed_weights`'s
        ``input_scale``; fp8_tensor only), or no activation quantization (mxfp4 only).
        Default: "dynamic" for the FP8 formats, "none" for mxfp4.
    scale_fmt : {"float", "ue8m0"}
        "ue8m0": the activation scales are rounded up to powers of two
        (``2 ** ceil(log2(amax / 448))``), as the weight scales of such checkpoints are.
    modules_to_not_convert : tuple of str
        Module names a checkpoint keeps unquantized (informational; from ``from_hf``). Not
        part of equality or the hash: two configs of the same format are equal whatever
        their lists (a config read from ``config.json`` agrees with the format read from
        the weights, e.g. by ``MoE.from_hf(block, quant=...)``).

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

    def __post_init__(self) -> None:
        if not isinstance(self.format, str) or self.format not in FORMAT_FIELDS:
            raise ValueError(f"format={self.format!r} is not a quantized format; use one of {FORMATS}")
        default_block, activations = FORMAT_FIELDS[self.format]
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
        if self.activation is None:
            object.__setattr__(self, "activation", activations[0])
        if not isinstance(self.activation, str) or self.activation not in activations:
            raise ValueError(
                f"activation={self.activation!r} is not served by format={self.format!r}; use one of {activations}"
            )
        if not isinstance(self.scale_fmt, str) or self.scale_fmt not in SCALE_FORMATS:
            raise ValueError(f"scale_fmt={self.scale_fmt!r} is unknown; use one of {SCALE_FORMATS}")
        modules = self.modules_to_not_convert
        if modules is None:
            modules = ()
        if isinstance(modules, str) or not all(isinstance(m, str) for m in modules):
            raise ValueError(f"modules_to_not_convert={modules!r} must be a sequence of module names")
        object.__setattr__(self, "modules_to_not_convert", tuple(modules))

    @property
    def activation_group_size(self) -> int | None:
        """Columns per activation scale: bk for fp8_block, None (the whole row) for fp8_tensor."""
        return None if self.block_size is None else self.block_size[1]

    @property
    def ue8m0(self) -> bool:
        return self.scale_fmt == "ue8m0"

    def scale_shapes(self, num_experts: int, hidden_size: int, intermediate_size: int):
        """Shapes of (gate_up_scale, down_scale) for N experts of sizes H and I.

        fp8_block: [N, 2*ceil(I/bn), ceil(H/bk)] (the gate's block rows, then the up's) and
        [N, ceil(H/bn), ceil(I/bk)]; fp8_tensor: [N, 2] (gate, up) and [N]; mxfp4: uint8
        [N, 2I, H/32] and [N, H, I/32] (H and I multiples of 32).
        """
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
        scales (FP8), or 3*H*I half-byte weights plus a scale byte per 32 (mxfp4)."""
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
            ``{"quant_method": "mxfp4", "modules_to_not_convert": [...]}``: mxfp4.

        Returns
        -------
        QuantConfig, or None when the model declares no quantization.

        Raises
        ------
        ValueError
            An unreadable file; a ``quant_method`` or ``fmt`` moeroute does not serve (the
            message names it); field values `QuantConfig` rejects.
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
        if method not in _HF_FP8_METHODS:
            raise ValueError(
                f"quantization_config quant_method={method!r} is not served; moeroute reads "
                f"{_HF_FP8_METHODS + _HF_MXFP4_METHODS} (float8_e4m3fn or MXFP4 weights)"
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
