"""Checkpoint names of routed experts, and reading them from safetensors one tensor at a time.

Two layouts of a block's routed experts are read (relative to the block's prefix):

=====================================================  ==========================================
per expert (DeepSeek-V3's published checkpoints)       ``experts.{e}.gate_proj.weight`` [I, H],
                                                       ``experts.{e}.up_proj.weight`` [I, H],
                                                       ``experts.{e}.down_proj.weight`` [H, I];
                                                       FP8: float8_e4m3fn, each with
                                                       ``.weight_scale_inv`` [ceil(rows/bn),
                                                       ceil(cols/bk)] float32
stacked (transformers 5)                               ``experts.gate_up_proj`` [N, 2I, H],
                                                       ``experts.down_proj`` [N, H, I]; FP8 adds
                                                       ``experts.gate_up_proj_scale_inv``,
                                                       ``experts.down_proj_scale_inv`` and
                                                       (static) ``*_activation_scale`` [N]
MXFP4 (gpt-oss)                                        ``experts.gate_up_proj_blocks`` [N, 2I,
                                                       H/32, 16] and ``_scales`` [N, 2I, H/32]
                                                       uint8 (rows gate, up, gate, ...),
                                                       ``experts.down_proj_blocks``/``_scales``,
                                                       ``experts.*_proj_bias``
=====================================================  ==========================================

`load_experts` fills a patched model's `MoE` layers straight from the files: every tensor is
read alone (``safe_open`` of its file, then closed), copied into this rank's slot and
released, so resident memory grows by the module's own weights plus one tensor.
"""

from __future__ import annotations

import json
import os

import torch

from moeroute.bindings.torch.fp8_experts import (
    PROJECTIONS,
    STACKED_SCALE_KEYS,
    gate_up_scale_from_stacked,
    per_expert_key,
)
from moeroute.bindings.torch.moe import MoE
from moeroute.bindings.torch.mxfp4_experts import GPT_OSS_MXFP4_KEYS, gate_rows_first
from moeroute.quant import FP8_DTYPE, check_scale

__all__ = ["load_experts"]


class _Reader:
    """Where each tensor of a safetensors checkpoint lives; reads one tensor per call."""

    def __init__(self, path) -> None:
        path = os.fspath(path)
        if os.path.isfile(path):
            files = [path]
            directory = os.path.dirname(path)
        elif os.path.isdir(path):
            directory = path
            files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
        else:
            raise ValueError(f"path={path!r} is neither a safetensors file nor a directory")
        index = os.path.join(directory, "model.safetensors.index.json")
        self.location = {}
        if os.path.isdir(path) and os.path.isfile(index):
            with open(index, encoding="utf-8") as handle:
                weight_map = json.load(handle).get("weight_map", {})
            self.location = {key: os.path.join(directory, name) for key, name in weight_map.items()}
        else:
            from safetensors import safe_open

            for file in files:
                with safe_open(file, framework="pt") as handle:
                    for key in handle.keys():
                        self.location[key] = file
        if not self.location:
            raise ValueError(f"no safetensors tensors found under {path!r}")
        self.bytes_read = 0
        self.tensors_read = 0

    def __contains__(self, key: str) -> bool:
        return key in self.location

    def keys_with_prefix(self, prefix: str):
        return [key for key in self.location if key.startswith(prefix)]

    def get(self, key: str, index=None) -> torch.Tensor:
        """The tensor (or its row ``index`` of the first dim), read from its file alone."""
        from safetensors import safe_open

        with safe_open(self.location[key], framework="pt") as handle:
            tensor = handle.get_tensor(key) if index is None else handle.get_slice(key)[index]
        self.tensors_read += 1
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


def _copy(target: torch.Tensor, source: torch.Tensor, name: str) -> None:
    if tuple(target.shape) != tuple(source.shape):
        raise ValueError(f"{name} has shape {tuple(source.shape)}, expected {list(target.shape)}")
    target.copy_(source)


def _fp8(name: str, tensor: torch.Tensor, quant) -> torch.Tensor:
    if quant is not None and tensor.dtype != FP8_DTYPE:
        raise ValueError(f"{name} has dtype {tensor.dtype} but the layer has quant={quant.format!r} "
                         "(float8_e4m3fn weights with scales)")
    if quant is None and tensor.dtype == FP8_DTYPE:
        raise ValueError(f"{name} is float8_e4m3fn but the layer holds float experts; build it with "
                         "quant=QuantConfig.from_hf(config)")
    return tensor


@torch.no_grad()
def _load_mxfp4(module, reader: _Reader, prefix: str) -> None:
    """gpt-oss's MXFP4 experts (``experts.{gate_up,down}_proj_{blocks,scales,bias}``), one
    expert row of one tensor at a time, gate_up rows de-interleaved (`gate_rows_first`)."""
    experts = module.experts
    for key in GPT_OSS_MXFP4_KEYS:
        if prefix + key not in reader:
            raise ValueError(f"{prefix + key} is missing: the layer has quant='mxfp4' and reads gpt-oss's "
                             f"{', '.join(GPT_OSS_MXFP4_KEYS)}")
    order = gate_rows_first(2 * module.intermediate_size)
    pairs = (("experts.gate_up_proj_blocks", experts.w_gate_up, order),
             ("experts.gate_up_proj_scales", experts.gate_up_scale, order),
             ("experts.down_proj_blocks", experts.w_down, None), ("experts.down_proj_scales", experts.down_scale, None),
             ("experts.gate_up_proj_bias", experts.b_gate_up, order), ("experts.down_proj_bias", experts.b_down, None))
    for local, e in enumerate(module.routed_expert_ids()):
        for name, target, rows in pairs:
            if target is None or prefix + name not in reader:
                continue
            tensor = reader.get(prefix + name, e)
            if name.endswith("_scales") and bool((tensor == 255).any()):
                raise ValueError(f"{prefix + name}[{e}] holds the scale byte 255 (e8m0 NaN); MXFP4 scale bytes "
                                 "are 0..254")
            if not name.endswith("_bias") and tensor.dtype != torch.uint8:
                raise ValueError(f"{prefix + name} has dtype {tensor.dtype}; MXFP4 blocks and scales are uint8")
            _copy(target[local], tensor if rows is None else tensor[rows], prefix + name)


@torch.no_grad()
def _load_module(module, reader: _Reader, prefix: str) -> None:
    experts, quant = module.experts, module.quant
    if quant is not None and quant.format == "mxfp4":
        _load_mxfp4(module, reader, prefix)
        _load_rest(module, reader, prefix)
        return
    inter = module.intermediate_size
    ids = module.routed_expert_ids()
    nb = None
    if quant is not None and quant.format == "fp8_block":
        nb = -(-inter // quant.block_size[0])
    if prefix + per_expert_key(ids[0], "gate_proj") in reader:
        for local, e in enumerate(ids):
            for projection in PROJECTIONS:
                key = prefix + per_expert_key(e, projection)
                weight = _fp8(key, reader.get(key), quant)
                if projection == "down_proj":
                    _copy(experts.w_down[local], weight, key)
                else:
                    rows = slice(0, inter) if projection == "gate_proj" else slice(inter, 2 * inter)
                    _copy(experts.w_gate_up[local, rows], weight, key)
                if quant is None:
                    continue
                scale_key = prefix + per_expert_key(e, projection, scale=True)
                if scale_key not in reader:
                    raise ValueError(f"{scale_key} is missing: FP8 weight {key} needs its scale")
                scale = reader.get(scale_key)
                if projection == "down_proj":
                    target = experts.down_scale[local]
                elif quant.format == "fp8_tensor":
                    target = experts.gate_up_scale[local, 0 if projection == "gate_proj" else 1]
                else:
                    target = experts.gate_up_scale[local, :nb] if projection == "gate_proj" \
                        else experts.gate_up_scale[local, nb:]
                target.copy_(check_scale(scale_key, scale.reshape(target.shape) if scale.numel() == 1
                                         and target.numel() == 1 else scale, tuple(target.shape)))
    elif prefix + "experts.gate_up_proj" in reader:
        for local, e in enumerate(ids):
            for key, target in ((prefix + "experts.gate_up_proj", experts.w_gate_up[local]),
                                (prefix + "experts.down_proj", experts.w_down[local])):
                _copy(target, _fp8(key, reader.get(key, e), quant), key)
            if quant is None:
                continue
            for key, name in STACKED_SCALE_KEYS.items():
                if prefix + key not in reader:
                    raise ValueError(f"{prefix + key} is missing: the FP8 experts need their scales")
                scale = reader.get(prefix + key, e)
                if name == "gate_up_scale":
                    scale = gate_up_scale_from_stacked(scale, quant, inter)
                target = getattr(experts, name)[local]
                target.copy_(check_scale(prefix + key, scale, tuple(target.shape)))
            if quant.activation == "static":
                for column, key in enumerate(("experts.gate_up_proj_activation_scale",
                                              "experts.down_proj_activation_scale")):
                    value = reader.get(prefix + key, e)
                    experts.input_scale[local, column] = check_scale(prefix + key, value.reshape(()), ())
    else:
        raise ValueError(f"the checkpoint has no routed experts under {prefix!r} (looked for "
                         f"{prefix + per_expert_key(ids[0], 'gate_proj')} and {prefix}experts.gate_up_proj)")
    _load_rest(module, reader, prefix)


def _load_rest(module, reader: _Reader, prefix: str) -> None:
    """The block's router, correction bias and shared MLP (small tensors), through the
    module's own state-dict mapping (fused shared slots included)."""
    rest = {}
    for key in reader.keys_with_prefix(prefix):
        name = key[len(prefix):]
        if name.startswith("experts."):
            continue
        rest[name] = reader.get(key)
    if not rest:
        return
    unexpected = module.load_state_dict(rest, strict=False).unexpected_keys
    if unexpected:
        raise ValueError(f"the checkpoint holds tensors under {prefix!r} the layer does not have: {unexpected}")


def load_experts(model: torch.nn.Module, path) -> dict:
    """Load every moeroute `MoE` layer of ``model`` from a safetensors checkpoint.

    Parameters
    ----------
    model : nn.Module
        A model patched by `replace_moe_blocks` (or any module holding `MoE` layers); each
        layer's checkpoint prefix is its module name (``model.layers.3.mlp.``).
    path : str or os.PathLike
        A safetensors file, or a directory of them (with ``model.safetensors.index.json``
        when present).

    Returns
    -------
    dict
        ``{"layers": number of MoE layers loaded, "tensors": tensors read, "bytes": bytes read}``.

    Notes
    -----
    Each layer takes only its rank's experts (expert parallelism: the others are never
    read); FP8 weights stay FP8 and MXFP4 bytes stay packed (never dequantized). Every tensor is read from its file
    alone and released after its copy, so resident memory grows by the layers' weights plus
    one tensor. The router, correction bias and shared MLP under the layer's prefix are
    loaded too (through ``load_state_dict``, which fills fused shared slots).

    Raises
    ------
    ValueError
        No safetensors under ``path``; a layer whose experts are missing; an FP8 weight
        without its scale, or of the wrong dtype or shape for the layer (named); scales that
        are not finite and positive.
    """
    reader = _Reader(path)
    layers = 0
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            _load_module(module, reader, f"{name}." if name else "")
            layers += 1
    return {"layers": layers, "tensors": reader.tensors_read, "bytes": reader.bytes_read}
