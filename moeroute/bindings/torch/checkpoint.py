"""Checkpoint names of routed experts, and reading them from safetensors one tensor at a time.

Two layouts of a block's routed experts are read (relative to the block's prefix):

=====================================================  ==========================================
per expert (DeepSeek-V3's published checkpoints)       ``experts.{e}.gate_proj.weight`` [I, H],
                                                       ``experts.{e}.up_proj.weight`` [I, H],
                                                       ``experts.{e}.down_proj.weight`` [H, I];
                                                       FP8: float8_e4m3fn, each with
                                                       ``.weight_scale_inv`` [ceil(rows/bn),
                                                       ceil(cols/bk)] float32 (one value per
                                                       tensor for fp8_tensor)
stacked (transformers 5)                               ``experts.gate_up_proj`` [N, 2I, H],
                                                       ``experts.down_proj`` [N, H, I]; FP8 adds
                                                       ``experts.gate_up_proj_scale_inv``,
                                                       ``experts.down_proj_scale_inv`` (per
                                                       tensor: [N, 2, 1] and [N, 1, 1], or
                                                       [N, 2] and [N]) and (static)
                                                       ``*_activation_scale`` [N]; expert
                                                       biases ``experts.*_proj_bias``
gpt-oss float (a module `from_hf` built from gpt-oss)  ``experts.gate_up_proj`` [N, H, 2I]
                                                       (gate/up columns interleaved),
                                                       ``experts.down_proj`` [N, I, H],
                                                       ``experts.*_proj_bias``
INT4 (compressed-tensors, GPTQ, AWQ; per expert)       ``experts.{e}.{gate,up,down}_proj.`` and
                                                       the layout's keys (``weight_packed``,
                                                       ``weight_scale``, ``weight_shape``,
                                                       ``weight_zero_point``; ``qweight``,
                                                       ``qzeros``, ``scales``, ``g_idx``),
                                                       `moeroute.bindings.torch.int4_keys`
MXFP4 (gpt-oss)                                        ``experts.gate_up_proj_blocks`` [N, 2I,
                                                       H/32, 16] and ``_scales`` [N, 2I, H/32]
                                                       uint8 (rows gate, up, gate, ...),
                                                       ``experts.down_proj_blocks``/``_scales``,
                                                       ``experts.*_proj_bias``
=====================================================  ==========================================

`load_experts` fills a patched model's `MoE` layers straight from the files in two passes.
The first checks everything before anything is written: every tensor a layer needs is
present, with the dtype and shape the layer expects (read from the files' headers), and the
tensors whose values have rules (scales, FP8 weight bytes) are read, checked and released. Only then does the
second pass copy: every tensor is read alone (``safe_open`` of its file, then closed),
copied into this rank's slot and released, so resident memory grows by the module's own
weights plus one tensor, and a refused checkpoint leaves every layer as it was.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable

import torch

from moeroute.experts.formats.fp8 import PROJECTIONS, STACKED_SCALE_KEYS, per_expert_key
from moeroute.bindings.torch.int4_keys import read_int4_plan, write_int4_plan
from moeroute.bindings.torch.hf_keys import TRANSFORMERS_RENAMES, TRANSFORMERS_SHARED, stacked_fp8_scale
from moeroute.bindings.torch.moe import MoE
from moeroute.experts.formats.mxfp4 import gate_rows_first
from moeroute.quant import FP8_DTYPE, check_scale
from moeroute.quant.fp8 import check_fp8_weight

__all__ = ["load_experts"]

#: safetensors header dtype names -> torch dtypes (the ones a layer can take).
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
}
if hasattr(torch, "float8_e8m0fnu"):
    _SAFETENSORS_DTYPES["F8_E8M0"] = torch.float8_e8m0fnu
#: Float weights a float layer copies (converted to its dtype).
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: FP8 scale dtypes (`moeroute.quant.check_scale`).
_SCALE_DTYPES = tuple(d for d in (torch.float32, getattr(torch, "float8_e8m0fnu", None)) if d is not None)
#: Names (relative to the block) of the router's tensors -> the module's.
_RENAMES = {**TRANSFORMERS_RENAMES, "router.weight": "router_weight", "router.bias": "router_bias"}


def _read_header(file: str) -> dict:
    """A safetensors file's header: key -> {"dtype", "shape", "data_offsets"}."""
    size = os.path.getsize(file)
    with open(file, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        if length <= 0 or length > size - 8:
            raise ValueError(f"{file!r} is not a safetensors file (header length {length}, file size {size})")
        try:
            header = json.loads(handle.read(length))
        except ValueError as error:
            raise ValueError(f"{file!r} is not a safetensors file (its header is not JSON: {error})") from None
    header.pop("__metadata__", None)
    return header


class _Reader:
    """Where each tensor of a safetensors checkpoint lives, with its header's dtype and
    shape; reads one tensor per call."""

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
        self._headers = {}
        if os.path.isdir(path) and os.path.isfile(index):
            with open(index, encoding="utf-8") as handle:
                weight_map = json.load(handle).get("weight_map", {})
            self.location = {key: os.path.join(directory, name) for key, name in weight_map.items()}
        else:
            for file in files:
                for key in self._header(file):
                    self.location[key] = file
        if not self.location:
            raise ValueError(f"no safetensors tensors found under {path!r}")
        self.bytes_read = 0
        self.tensors_read = 0

    def _header(self, file: str) -> dict:
        if file not in self._headers:
            self._headers[file] = _read_header(file)
        return self._headers[file]

    def __contains__(self, key: str) -> bool:
        return key in self.location

    def keys_with_prefix(self, prefix: str):
        return [key for key in self.location if key.startswith(prefix)]

    def meta(self, key: str):
        """(shape, dtype) of ``key`` from its file's header, nothing read; the dtype is the
        header's name when torch has no such dtype."""
        entry = self._header(self.location[key]).get(key)
        if entry is None:
            raise ValueError(
                f"{key} is listed in model.safetensors.index.json but its file {self.location[key]!r} does not hold it"
            )
        return tuple(entry["shape"]), _SAFETENSORS_DTYPES.get(entry["dtype"], entry["dtype"])

    def get(self, key: str, index=None) -> torch.Tensor:
        """The tensor (or its row ``index`` of the first dim), read from its file alone."""
        from safetensors import safe_open

        with safe_open(self.location[key], framework="pt") as handle:
            tensor = handle.get_tensor(key) if index is None else handle.get_slice(key)[index]
        self.tensors_read += 1
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


@dataclasses.dataclass
class _Copy:
    """One checkpoint tensor (or one expert's row of a stacked one) and the slot it fills."""

    key: str
    expert: int | None  # the logical expert it belongs to (None: not an expert's)
    index: int | None  # its row of a stacked tensor's first dim (None: the whole tensor)
    target: torch.Tensor  # the module's slot
    dtypes: tuple  # the checkpoint dtypes the slot takes
    shapes: tuple  # the shapes (of the row, for stacked tensors) the slot takes
    convert: Callable | None = None  # checkpoint layout -> the slot's (row order, transpose, ...)
    check: Callable | None = None  # check(name, tensor) of the values, in the first pass

    @property
    def name(self) -> str:
        return self.key if self.index is None else f"{self.key}[{self.index}]"

    def what(self) -> str:
        return self.name if self.expert is None else f"{self.name} (expert {self.expert})"


def _shape_text(shapes) -> str:
    return " or ".join(str(list(shape)) for shape in shapes)


def _dtype_text(dtypes) -> str:
    return " or ".join(str(dtype).replace("torch.", "") for dtype in dtypes)


def _check_meta(reader: _Reader, copy: _Copy, num_experts: int | None) -> None:
    """The copy's tensor is present with a dtype and shape its slot takes (its header only)."""
    if copy.key not in reader:
        where = "" if copy.expert is None else f" (this rank holds expert {copy.expert})"
        raise ValueError(f"{copy.key} is missing from the checkpoint{where}")
    shape, dtype = reader.meta(copy.key)
    if dtype not in copy.dtypes:
        dtype_name = str(dtype).replace("torch.", "")
        if FP8_DTYPE in copy.dtypes and dtype in _FLOAT_DTYPES:
            raise ValueError(
                f"{copy.key} has dtype {dtype_name} but the layer holds FP8 experts (float8_e4m3fn weights with scales)"
            )
        if dtype == FP8_DTYPE and FP8_DTYPE not in copy.dtypes and torch.float32 in copy.dtypes:
            raise ValueError(
                f"{copy.key} is float8_e4m3fn but the layer holds float experts; build it with "
                "quant=QuantConfig.from_hf(config)"
            )
        raise ValueError(f"{copy.key} has dtype {dtype_name}, expected {_dtype_text(copy.dtypes)}")
    if copy.index is not None:
        if len(shape) == 0 or shape[0] != num_experts:
            raise ValueError(
                f"{copy.key} has shape {list(shape)}: its first dimension must be the "
                f"{num_experts} experts of the layer"
            )
        shape = shape[1:]
    if shape not in copy.shapes:
        raise ValueError(f"{copy.what()} has shape {list(shape)}, expected {_shape_text(copy.shapes)}")


def _no_scale_byte_255(name: str, scales: torch.Tensor) -> None:
    if bool((scales == 255).any()):
        raise ValueError(f"{name} holds the scale byte 255 (e8m0 NaN); MXFP4 scale bytes are 0..254")


def _positive_scale(name: str, scale: torch.Tensor) -> None:
    check_scale(name, scale, tuple(scale.shape))


def _rows(order: torch.Tensor) -> Callable:
    return lambda tensor: tensor[order]


def _as_shape(shape) -> Callable:
    return lambda tensor: tensor.reshape(shape)


def _expert_copies(module, reader: _Reader, prefix: str) -> list[_Copy]:
    """Every tensor the module's routed experts take from the checkpoint (nothing read)."""
    experts, quant = module.experts, module.quant
    inter = module.intermediate_size
    ids = module.routed_expert_ids()
    copies = []
    if quant is not None and quant.format == "mxfp4":
        order = gate_rows_first(2 * inter)
        uint8 = (torch.uint8,)
        for local, e in enumerate(ids):
            for name, target, rows in (
                ("experts.gate_up_proj_blocks", experts.w_gate_up, order),
                ("experts.gate_up_proj_scales", experts.gate_up_scale, order),
                ("experts.down_proj_blocks", experts.w_down, None),
                ("experts.down_proj_scales", experts.down_scale, None),
            ):
                copies.append(
                    _Copy(
                        prefix + name,
                        e,
                        e,
                        target[local],
                        uint8,
                        (tuple(target.shape[1:]),),
                        None if rows is None else _rows(rows),
                        _no_scale_byte_255 if name.endswith("_scales") else None,
                    )
                )
        copies += _bias_copies(module, reader, prefix, ids, order)
        return copies
    float_weights = (FP8_DTYPE,) if quant is not None else _FLOAT_DTYPES
    per_expert = [prefix + per_expert_key(e, p) for e in ids for p in PROJECTIONS]
    if any(key in reader for key in per_expert):
        return _per_expert_copies(module, prefix, ids, float_weights)
    if getattr(module.checkpoint_format, "family", None) == "gpt_oss" and quant is None:
        return _gpt_oss_float_copies(module, reader, prefix, ids)
    if prefix + "experts.gate_up_proj" in reader or prefix + "experts.down_proj" in reader:
        for local, e in enumerate(ids):
            for name, target in (("experts.gate_up_proj", experts.w_gate_up), ("experts.down_proj", experts.w_down)):
                copies.append(
                    _Copy(
                        prefix + name,
                        e,
                        e,
                        target[local],
                        float_weights,
                        (tuple(target.shape[1:]),),
                        check=None if quant is None else check_fp8_weight,
                    )
                )
            if quant is None:
                continue
            for name, attribute in STACKED_SCALE_KEYS.items():
                target = getattr(experts, attribute)[local]
                shapes = (tuple(target.shape),)
                convert = None
                if quant.format == "fp8_tensor":
                    shapes, convert = stacked_fp8_scale(attribute)
                elif attribute == "gate_up_scale" and inter % quant.block_size[0]:
                    raise ValueError(
                        f"{prefix + name} blocks span the gate and up rows (intermediate size {inter} "
                        f"is not a multiple of the block rows {quant.block_size[0]}); moeroute keeps "
                        "gate and up in their own block rows: save the per-expert gate_proj/up_proj "
                        "weights"
                    )
                copies.append(_Copy(prefix + name, e, e, target, _SCALE_DTYPES, shapes, convert, _positive_scale))
            if quant.activation == "static":
                for column, name in enumerate(
                    ("experts.gate_up_proj_activation_scale", "experts.down_proj_activation_scale")
                ):
                    copies.append(
                        _Copy(
                            prefix + name,
                            e,
                            e,
                            experts.input_scale[local, column],
                            _SCALE_DTYPES,
                            ((),),
                            None,
                            _positive_scale,
                        )
                    )
        if experts.b_gate_up is not None:
            copies += _bias_copies(module, reader, prefix, ids, None)
        return copies
    raise ValueError(
        f"the checkpoint has no routed experts under {prefix!r} (looked for "
        f"{prefix + per_expert_key(ids[0], 'gate_proj')} and {prefix}experts.gate_up_proj)"
    )


def _per_expert_copies(module, prefix: str, ids, float_weights) -> list[_Copy]:
    """DeepSeek-V3's ``experts.{e}.{gate,up,down}_proj.weight`` (and ``.weight_scale_inv``)."""
    experts, quant, inter = module.experts, module.quant, module.intermediate_size
    copies = []
    nb = None if quant is None or quant.format != "fp8_block" else -(-inter // quant.block_size[0])
    for local, e in enumerate(ids):
        for projection in PROJECTIONS:
            if projection == "down_proj":
                weight, scale = experts.w_down[local], None if quant is None else experts.down_scale[local]
            else:
                gate = projection == "gate_proj"
                weight = experts.w_gate_up[local, :inter] if gate else experts.w_gate_up[local, inter:]
                if quant is None:
                    scale = None
                elif quant.format == "fp8_tensor":
                    scale = experts.gate_up_scale[local, 0 if gate else 1]
                else:
                    scale = experts.gate_up_scale[local, :nb] if gate else experts.gate_up_scale[local, nb:]
            copies.append(
                _Copy(
                    prefix + per_expert_key(e, projection),
                    e,
                    None,
                    weight,
                    float_weights,
                    (tuple(weight.shape),),
                    check=None if quant is None else check_fp8_weight,
                )
            )
            if scale is None:
                continue
            shapes, convert = (tuple(scale.shape),), None
            if quant.format == "fp8_tensor":  # one value, saved as a scalar, [1] or [1, 1]
                shapes, convert = ((), (1,), (1, 1)), _as_shape(())
            copies.append(
                _Copy(
                    prefix + per_expert_key(e, projection, scale=True),
                    e,
                    None,
                    scale,
                    _SCALE_DTYPES,
                    shapes,
                    convert,
                    _positive_scale,
                )
            )
    if experts.b_gate_up is not None:
        raise ValueError(
            f"the layer under {prefix!r} has expert biases, which per-expert checkpoint keys "
            f"({prefix}experts.{{e}}.gate_proj.weight, ...) do not carry"
        )
    return copies


def _gpt_oss_float_copies(module, reader: _Reader, prefix: str, ids) -> list[_Copy]:
    """gpt-oss's float experts: ``gate_up_proj`` [N, H, 2I] (gate/up columns interleaved),
    ``down_proj`` [N, I, H] and the biases; `from_hf`'s gpt-oss modules load these."""
    experts, inter, hid = module.experts, module.intermediate_size, module.routed_hidden_size
    order = gate_rows_first(2 * inter)
    copies = []
    for local, e in enumerate(ids):
        copies.append(
            _Copy(
                prefix + "experts.gate_up_proj",
                e,
                e,
                experts.w_gate_up[local],
                _FLOAT_DTYPES,
                ((hid, 2 * inter),),
                lambda t: t.t()[order],
            )
        )
        copies.append(
            _Copy(
                prefix + "experts.down_proj",
                e,
                e,
                experts.w_down[local],
                _FLOAT_DTYPES,
                ((inter, hid),),
                lambda t: t.t(),
            )
        )
    return copies + _bias_copies(module, reader, prefix, ids, order)


def _bias_copies(module, reader: _Reader, prefix: str, ids, order) -> list[_Copy]:
    """``experts.gate_up_proj_bias`` [N, 2I] (rows ``order`` of the checkpoint's; None: as
    saved) and ``experts.down_proj_bias`` [N, H]: required when the layer has expert biases,
    refused when it has none (they would be dropped)."""
    experts = module.experts
    keys = (prefix + "experts.gate_up_proj_bias", prefix + "experts.down_proj_bias")
    if experts.b_gate_up is None:
        present = [key for key in keys if key in reader]
        if present:
            raise ValueError(
                f"the checkpoint holds {present[0]} but the layer under {prefix!r} has no expert "
                "biases, so they would be dropped; build it with expert_bias=True"
            )
        return []
    copies = []
    for local, e in enumerate(ids):
        for key, target, rows in ((keys[0], experts.b_gate_up, order), (keys[1], experts.b_down, None)):
            copies.append(
                _Copy(
                    key,
                    e,
                    e,
                    target[local],
                    _FLOAT_DTYPES,
                    (tuple(target.shape[1:]),),
                    None if rows is None else _rows(rows),
                )
            )
    return copies


def _rest_keys(module, reader: _Reader, prefix: str) -> list[str]:
    """The block's router, correction bias and shared MLP keys (not ``experts.*``), checked
    against the module's tensors from the headers: each is one the module has, with its
    shape; a fused shared MLP has its three weights (and an FP8 one its scales)."""
    keys = [key for key in reader.keys_with_prefix(prefix) if not key[len(prefix) :].startswith("experts.")]
    own = dict(module.named_parameters())
    own.update(module.named_buffers())
    fused = module.layout.shared == "fused"
    slots = module.num_shared_experts * module.intermediate_size
    fused_shapes = {
        "gate_proj": (slots, module.hidden_size),
        "up_proj": (slots, module.hidden_size),
        "down_proj": (module.hidden_size, slots),
    }
    fused_found = {}
    unexpected = []
    for key in keys:
        name = key[len(prefix) :]
        name = _RENAMES.get(name, name)
        for shared_prefix in TRANSFORMERS_SHARED:
            if name.startswith(shared_prefix):
                name = "shared_experts." + name[len(shared_prefix) :]
        shape, dtype = reader.meta(key)
        projection, _, kind = name[len("shared_experts.") :].partition(".")
        if fused and name.startswith("shared_experts.") and projection in fused_shapes:
            fused_found[projection, kind] = (key, dtype)
            if kind == "weight" and shape != fused_shapes[projection]:
                raise ValueError(
                    f"{key} has shape {list(shape)}, expected {list(fused_shapes[projection])} (the "
                    f"shared MLP fused into {module.num_shared_experts} expert slots)"
                )
        elif name in own:
            if shape != tuple(own[name].shape):
                raise ValueError(f"{key} has shape {list(shape)}, expected {list(own[name].shape)}")
        else:
            unexpected.append(key)
    if unexpected:
        raise ValueError(f"the checkpoint holds tensors under {prefix!r} the layer does not have: {unexpected}")
    if fused_found:
        for projection in fused_shapes:
            weight = fused_found.get((projection, "weight"))
            if weight is None:
                raise ValueError(
                    f"{prefix}shared_experts.{projection}.weight is missing: the layer fuses the shared "
                    "MLP into expert slots and needs gate_proj, up_proj and down_proj"
                )
            if weight[1] == FP8_DTYPE and (projection, "weight_scale_inv") not in fused_found:
                raise ValueError(f"{weight[0]} is float8_e4m3fn without its weight_scale_inv")
    return keys


@torch.no_grad()
def _check_layer(module, reader: _Reader, prefix: str):
    """The first pass for one layer: (expert copies, rest keys), every check passed."""
    if module.quant is not None and module.quant.format == "int4":
        plan = read_int4_plan(module, reader.location, prefix, reader.meta, reader.get)
        if not plan[0]:
            raise ValueError(
                f"the checkpoint has no INT4 routed experts under {prefix!r} (looked for "
                f"{prefix}experts.{{e}}.gate_proj.* of the layer's {module.quant.checkpoint!r} layout)"
            )
        return plan, _rest_keys(module, reader, prefix)
    copies = _expert_copies(module, reader, prefix)
    num_experts = module.router.num_experts
    for copy in copies:
        _check_meta(reader, copy, num_experts)
    # Values next, still before anything is written: one tensor read at a time, then released.
    for copy in copies:
        if copy.check is not None:
            copy.check(copy.name, reader.get(copy.key, copy.index))
    return copies, _rest_keys(module, reader, prefix)


@torch.no_grad()
def _write_layer(module, reader: _Reader, copies, rest_keys, prefix: str) -> None:
    """The second pass for one layer: each checked tensor read alone and copied into its slot."""
    if isinstance(copies, tuple):  # INT4: one expert's tensors at a time, unpacked into its rows
        write_int4_plan(module, copies[0], prefix, reader.get, copies[1])
        copies = []
    for copy in copies:
        tensor = reader.get(copy.key, copy.index)
        if copy.convert is not None:
            tensor = copy.convert(tensor)
        copy.target.copy_(tensor)
    if rest_keys:
        # Through the module's own state-dict mapping (renames, fused shared slots).
        module.load_state_dict({key[len(prefix) :]: reader.get(key) for key in rest_keys}, strict=False)


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
        ``{"layers": number of MoE layers loaded, "tensors": tensors read, "bytes": bytes read,
        "checked_bytes": bytes the first pass read to check values}``; the second pass reads
        each tensor a layer takes once, so ``bytes - checked_bytes`` is the layers' share of
        the checkpoint.

    Notes
    -----
    Each layer takes only its rank's experts (expert parallelism: the others are never
    read); FP8 weights stay FP8 and MXFP4 and INT4 integers stay packed (never dequantized;
    INT4 checkpoints' words are unpacked one expert at a time straight into the layer's
    rows, `moeroute.bindings.torch.int4_keys`). Two passes:
    the first checks every layer (each tensor present, with its dtype and shape from the
    files' headers; the values with rules, scales and FP8 weight bytes, read one at a time
    and checked) and writes nothing; the second reads each tensor from its file alone and
    releases it after its copy, so resident memory grows by the layers' weights plus one
    tensor, and a refused checkpoint changes no layer. The
    router, correction bias and shared MLP under the layer's prefix are loaded too (through
    ``load_state_dict``, which fills fused shared slots).

    Raises
    ------
    ValueError
        Naming the checkpoint key (and expert): no safetensors under ``path``; a layer whose
        experts are missing; any tensor the layer takes missing (an expert's weight, an FP8
        weight's scale, an expert bias of a layer built with ``expert_bias=True``); expert
        biases in the checkpoint for a layer without them; a tensor of the wrong dtype or
        shape for the layer; FP8 scales that are not finite and positive; a NaN FP8 weight
        byte (0x7F or 0xFF); an MXFP4 scale byte 255; a tensor under a layer's prefix the
        layer does not have. Nothing is written when one is raised.
    """
    reader = _Reader(path)
    layers = [(module, f"{name}." if name else "") for name, module in model.named_modules() if isinstance(module, MoE)]
    checked = [(module, prefix, *_check_layer(module, reader, prefix)) for module, prefix in layers]
    checked_bytes = reader.bytes_read
    for module, prefix, copies, rest_keys in checked:
        _write_layer(module, reader, copies, rest_keys, prefix)
    return {
        "layers": len(layers),
        "tensors": reader.tensors_read,
        "bytes": reader.bytes_read,
        "checked_bytes": checked_bytes,
    }
