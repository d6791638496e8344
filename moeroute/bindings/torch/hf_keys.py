"""The transformers key mapping: a checkpoint's state-dict names and layouts <-> moeroute's.

One room for every translation between the names a transformers MoE block saves and the
names of `moeroute.bindings.torch.moe.MoE` (``router_weight``, ``experts.w_gate_up``, ...):

* `map_transformers_keys`: load time, the stacked names (``gate.weight``,
  ``experts.gate_up_proj`` [N, 2I, H], ``experts.down_proj`` [N, H, I], the shared MLP)
  -> this rank's tensors, fused shared slots assembled; `map_quantized_expert_keys` for FP8
  (DeepSeek-V3's per-expert keys or transformers 5's stacked FP8Experts keys) and gpt-oss's
  MXFP4 names. ``MoE._load_from_state_dict`` calls it for a module without a
  ``checkpoint_format``.
* `TransformersCheckpoint`: the ``checkpoint_format`` of a module `from_hf` built, which
  loads and saves the block's own names and layouts (stacked, or gpt-oss's interleaved
  gate/up columns); `save_in_checkpoint_format` is its state-dict post-hook.

`moeroute.bindings.torch.hf` re-exports `TransformersCheckpoint`. This module imports
neither ``moe.py`` nor ``hf.py`` (both import it): it reads the module it is given.
"""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from moeroute.experts.formats.fp8 import (
    PROJECTIONS,
    STACKED_SCALE_KEYS,
    check_quantized_weights,
    gate_up_scale_from_stacked,
)
from moeroute.experts.formats.mxfp4 import map_gpt_oss_mxfp4_keys
from moeroute.bindings.torch.int4_keys import map_int4_expert_keys
from moeroute.quant import dequantize_fp8_block, dequantize_fp8_tensor, quantize_experts, quantize_int4
from moeroute.quant.fp8 import check_fp8_weight, check_scale

__all__ = [
    "TRANSFORMERS_RENAMES",
    "TRANSFORMERS_SHARED",
    "TransformersCheckpoint",
    "from_gpt_oss_layout",
    "fused_slots",
    "map_quantized_expert_keys",
    "map_transformers_keys",
    "save_in_checkpoint_format",
    "split_slots",
    "stacked_fp8_scale",
    "to_gpt_oss_layout",
]

#: FP8 scale dtypes a checkpoint may hold (`moeroute.quant.check_scale`).
_SCALE_DTYPES = tuple(d for d in (torch.float32, getattr(torch, "float8_e8m0fnu", None)) if d is not None)
#: transformers parameter names (relative to the block) -> `MoE`'s.
TRANSFORMERS_RENAMES = {"gate.weight": "router_weight", "gate.e_score_correction_bias": "correction_bias"}
#: Where transformers blocks keep their shared MLP (DeepSeek/GLM, Qwen).
TRANSFORMERS_SHARED = ("shared_experts.", "shared_expert.")
#: One expert's per-tensor FP8 scales as saved: transformers' FP8Experts keeps [2, 1] (gate,
#: up) and [1, 1]; moeroute [2] and a scalar. All load, as moeroute's [2] and scalar.
FP8_TENSOR_SCALE_SHAPES = {"gate_up_scale": ((2,), (2, 1)), "down_scale": ((), (1,), (1, 1))}


def stacked_fp8_scale(name: str):
    """(shapes one expert's row may have, row -> moeroute's shape) of a stacked per-tensor
    FP8 scale; ``name`` is "gate_up_scale" or "down_scale"."""
    shape = (2,) if name == "gate_up_scale" else ()
    return FP8_TENSOR_SCALE_SHAPES[name], lambda row: row.reshape(shape)


def _check_shape(key: str, tensor: torch.Tensor, shapes, expert=None) -> None:
    """ValueError naming the key (and expert) unless ``tensor`` has one of ``shapes``."""
    if tuple(tensor.shape) not in shapes:
        where = "" if expert is None else f" (expert {expert})"
        raise ValueError(
            f"{key}{where} has shape {list(tensor.shape)}, expected {' or '.join(str(list(shape)) for shape in shapes)}"
        )


def _local_rows(source: torch.Tensor, ids: list, num_experts: int, extra: torch.Tensor | None = None):
    """This rank's rows ``ids`` of a stacked ``source`` [N, ...], then the rows of ``extra``
    (fused slots), in one new tensor filled a row at a time: no temporary beyond the result.
    ``source`` itself (no copy) when it is exactly those rows, or when its first dim is not
    the layer's N experts (the shape check before the copy then names it)."""
    if extra is None and ids == list(range(num_experts)) or source.dim() == 0 or source.shape[0] != num_experts:
        return source
    rows = len(ids) + (0 if extra is None else extra.shape[0])
    out = torch.empty((rows, *source.shape[1:]), dtype=source.dtype, device=source.device)
    for local, e in enumerate(ids):
        out[local] = source[e]
    if extra is not None:
        out[len(ids) :] = extra
    return out


def split_slots(gate, up, down, inter: int, num_slots: int):
    """A shared MLP's gate/up [S*I, H] and down [H, S*I] as S expert slots [S, 2I, H], [S, H, I]."""
    gate_up = torch.stack(
        [torch.cat([gate[j * inter : (j + 1) * inter], up[j * inter : (j + 1) * inter]]) for j in range(num_slots)]
    )
    down = torch.stack([down[:, j * inter : (j + 1) * inter] for j in range(num_slots)])
    return gate_up, down


@torch.no_grad()
def _check_rest_before_write(module, state_dict: dict, prefix: str, shared: dict) -> None:
    """The layer's tensors besides its routed experts (router, correction bias, a separate
    shared MLP) checked before the experts are written into the layer's own tensors: the
    usual check runs after the mapping, and a refused load must leave the layer as it was."""
    rest = dict(state_dict)
    if module.layout.shared != "fused":
        rest.update({prefix + "shared_experts." + name: value for name, value in shared.items()})
    module._check_state_before_copy(rest, prefix)


def map_transformers_keys(module, state_dict: dict, prefix: str) -> None:
    """Rename (and for a rank's slice or fused slots, assemble) transformers keys in place.

    ``module`` is the `MoE` loading ``state_dict``: its layout, rank and ``quant`` decide
    which experts it keeps and how its fused slots are filled.

    ``experts.gate_up_proj`` [N, 2I, H] and ``experts.down_proj`` [N, H, I] become this
    rank's ``experts.w_gate_up`` / ``experts.w_down`` (its routed experts, then the fused
    shared slots cut from the shared MLP's ``gate_proj``/``up_proj``/``down_proj``);
    ``gate.weight`` -> ``router_weight``; ``gate.e_score_correction_bias`` ->
    ``correction_bias``; ``shared_expert.*`` -> ``shared_experts.*``.

    The stacked tensors are handed on as they are when they hold exactly this rank's
    experts; otherwise this rank's rows (and the fused slots) are written one expert at a
    time into one new tensor per name.
    """
    for source, target in TRANSFORMERS_RENAMES.items():
        if prefix + source in state_dict:
            state_dict[prefix + target] = state_dict.pop(prefix + source)
    shared = {}
    for shared_prefix in TRANSFORMERS_SHARED:
        for key in [k for k in state_dict if k.startswith(prefix + shared_prefix)]:
            shared[key[len(prefix + shared_prefix) :]] = state_dict.pop(key)
    gate_up_key, down_key = prefix + "experts.gate_up_proj", prefix + "experts.down_proj"
    if module.quant is not None:
        map_quantized_expert_keys(module, state_dict, prefix, shared)
    elif gate_up_key in state_dict or down_key in state_dict:
        missing = [key for key in (gate_up_key, down_key) if key not in state_dict]
        if missing:
            raise KeyError(
                f"{missing[0]} is missing from the state dict: the routed experts need {gate_up_key} and {down_key}"
            )
        gate_up, down = state_dict.pop(gate_up_key), state_dict.pop(down_key)
        ids = module.routed_expert_ids()
        slots = fused_slots(module, shared, gate_up) if module.layout.shared == "fused" else (None, None)
        n = module.router.num_experts
        state_dict[prefix + "experts.w_gate_up"] = _local_rows(gate_up, ids, n, slots[0])
        state_dict[prefix + "experts.w_down"] = _local_rows(down, ids, n, slots[1])
    if module.layout.shared != "fused":
        for name, value in shared.items():
            state_dict[prefix + "shared_experts." + name] = value


@torch.no_grad()
def map_quantized_expert_keys(module, state_dict: dict, prefix: str, shared: dict) -> None:
    """FP8 experts of a checkpoint -> this rank's ``experts.*`` tensors, still FP8.

    Reads DeepSeek-V3's per-expert keys (``experts.{e}.{gate,up,down}_proj.weight`` with
    ``.weight_scale_inv``) or transformers 5's stacked FP8Experts keys; the other ranks'
    experts are dropped. INT4 layers read their checkpoint's per-expert keys
    (`moeroute.bindings.torch.int4_keys.map_int4_expert_keys`) or moeroute's names. Fused shared slots are the shared MLP (float, or FP8 with
    ``weight_scale_inv``) quantized with the layer's config. Per-tensor scales load as
    transformers' FP8Experts saves them ([N, 2, 1] and [N, 1, 1]) or as moeroute does.

    Memory: every tensor is checked before any is copied; then per-expert keys are written
    one expert at a time into the layer's own tensors (handed to torch, which copies each
    onto itself), or, with fused slots to quantize, static scales, meta tensors or the
    layer's own tensors as the input, into one new tensor per name that torch copies in;
    stacked tensors are handed on as they are when they are exactly this rank's experts.
    Beyond the state dict (and that new state), the peak is one expert's tensors (and the S
    fused slots' float weights).

    Raises
    ------
    KeyError
        A tensor the layer takes is missing (named): an expert's weight or scale, a stacked
        tensor, an MXFP4 expert bias of a layer with ``expert_bias=True``.
    ValueError
        Naming the key (and expert): a float weight, a tensor whose shape is not the layer's
        (checked before anything is stacked), MXFP4 biases for a layer without them.
    """
    if module.quant.format == "mxfp4":  # gpt-oss's MXFP4 names (mxfp4_experts)
        _check_expert_biases(module, state_dict, prefix, prefix + "experts.gate_up_proj_blocks")
        map_gpt_oss_mxfp4_keys(module, state_dict, prefix)
        return
    if module.quant.format == "int4":  # per-expert checkpoint keys or moeroute's names; a float shared MLP
        map_int4_expert_keys(module, state_dict, prefix)
        _int4_shared_slots(module, state_dict, prefix, shared)
        return
    quant, inter, hid = module.quant, module.intermediate_size, module.routed_hidden_size
    ids = module.routed_expert_ids()
    pattern = re.compile(
        re.escape(prefix) + r"experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$"
    )
    found = {}
    for key in [k for k in state_dict if k.startswith(prefix + "experts.")]:
        match = pattern.match(key)
        if match:
            found[int(match.group(1)), match.group(2), match.group(3)] = state_dict.pop(key)
    targets = module.experts.quantized_tensors()
    names = ("w_gate_up", "gate_up_scale", "w_down", "down_scale")
    num_local = len(ids)
    routed = None  # name -> this rank's routed rows [L, ...], checked
    found_in_place = False
    if found:
        gate_up_scale_shape, down_scale_shape = (shape[1:] for shape in quant.scale_shapes(1, hid, inter))
        if quant.format == "fp8_block":
            scale_shapes = {
                "gate_proj": (gate_up_scale_shape[0] // 2, gate_up_scale_shape[1]),
                "up_proj": (gate_up_scale_shape[0] // 2, gate_up_scale_shape[1]),
                "down_proj": down_scale_shape,
            }
            scale_shapes = {projection: (shape,) for projection, shape in scale_shapes.items()}
        else:  # one value per projection, saved as a scalar, [1] or [1, 1]
            scale_shapes = dict.fromkeys(PROJECTIONS, ((), (1,), (1, 1)))
        weight_shapes = {"gate_proj": ((inter, hid),), "up_proj": ((inter, hid),), "down_proj": ((hid, inter),)}

        def take(e, projection, kind):
            # Each tensor checked before any is copied: torch's copy errors name no key.
            key = f"{prefix}experts.{e}.{projection}.{kind}"
            if (e, projection, kind) not in found:
                raise KeyError(f"{key} is missing from the state dict (this rank holds expert {e})")
            tensor = found[e, projection, kind]
            if kind == "weight" and tensor.dtype != torch.float8_e4m3fn:
                raise ValueError(
                    f"{key} has dtype {tensor.dtype} but the layer has quant={quant.format!r} "
                    "(float8_e4m3fn weights with their weight_scale_inv)"
                )
            if kind != "weight" and tensor.dtype not in _SCALE_DTYPES:
                raise ValueError(f"{key} has dtype {tensor.dtype}; FP8 scales are float32 (or float8_e8m0fnu)")
            _check_shape(key, tensor, (weight_shapes if kind == "weight" else scale_shapes)[projection], e)
            return tensor

        for kind in ("weight", "weight_scale_inv"):
            for projection in PROJECTIONS:
                for e in ids:
                    take(e, projection, kind)
        # Written into the layer's own tensors when nothing can be refused after the first
        # write (every value checked here; no fused shared slots to quantize, no static
        # scales) and they hold memory (not meta): the load then holds no copy of the layer.
        # Otherwise one expert's tensors at a time into new rows that torch copies in.
        own = {targets[name].untyped_storage().data_ptr() for name in names if not targets[name].is_meta}
        in_place = (
            quant.activation != "static"
            and not (module.layout.shared == "fused" and "gate_proj.weight" in shared)
            and not any(targets[name].is_meta for name in names)
            # the layer's own state (a round trip) is read before anything is written
            and not any(tensor.untyped_storage().data_ptr() in own for tensor in found.values())
        )
        if in_place:
            for e in ids:
                for projection in PROJECTIONS:
                    key = f"{prefix}experts.{e}.{projection}.weight"
                    check_fp8_weight(key, found[e, projection, "weight"], e)
                    scale = found[e, projection, "weight_scale_inv"]
                    found[e, projection, "weight_scale_inv"] = check_scale(
                        key + "_scale_inv", scale, tuple(scale.shape)
                    )
            _check_rest_before_write(module, state_dict, prefix, shared)
            routed = {name: targets[name][:num_local] for name in names}
            found_in_place = True
        else:
            routed = {name: torch.empty_like(targets[name][:num_local]) for name in names}
        nb = gate_up_scale_shape[0] // 2 if quant.format == "fp8_block" else None
        with torch.no_grad():  # the layer's own tensors when in place
            for local, e in enumerate(ids):
                routed["w_gate_up"][local, :inter] = found[e, "gate_proj", "weight"]
                routed["w_gate_up"][local, inter:] = found[e, "up_proj", "weight"]
                routed["w_down"][local] = found[e, "down_proj", "weight"]
                gate_s, up_s, down_s = (found[e, p, "weight_scale_inv"] for p in PROJECTIONS)
                if quant.format == "fp8_block":  # gate block rows, then up block rows
                    routed["gate_up_scale"][local, :nb] = gate_s
                    routed["gate_up_scale"][local, nb:] = up_s
                    routed["down_scale"][local] = down_s
                else:  # one scale per projection: [L, 2] (gate, up) and [L]
                    routed["gate_up_scale"][local, 0] = gate_s.reshape(())
                    routed["gate_up_scale"][local, 1] = up_s.reshape(())
                    routed["down_scale"][local] = down_s.reshape(())
        found.clear()
    elif prefix + "experts.gate_up_proj" in state_dict:
        stacked_names = ["experts.gate_up_proj", "experts.down_proj", *STACKED_SCALE_KEYS]
        if quant.activation == "static":
            stacked_names += ["experts.gate_up_proj_activation_scale", "experts.down_proj_activation_scale"]
        missing = [prefix + name for name in stacked_names if prefix + name not in state_dict]
        if missing:
            raise KeyError(f"{missing[0]} is missing from the state dict (FP8 experts need it)")
        gate_up_scale_shape, down_scale_shape = (shape[1:] for shape in quant.scale_shapes(1, hid, inter))
        row_shapes = [((2 * inter, hid),), ((hid, inter),), (gate_up_scale_shape,), (down_scale_shape,), ((),), ((),)]
        if quant.format == "fp8_tensor":  # transformers' FP8Experts: [N, 2, 1] and [N, 1, 1]
            row_shapes[2:4] = [stacked_fp8_scale("gate_up_scale")[0], stacked_fp8_scale("down_scale")[0]]
        n = module.router.num_experts
        stacked = []
        for name, shapes in zip(stacked_names, row_shapes):
            key = prefix + name
            tensor = state_dict.pop(key)
            if tensor.dim() == 0 or tensor.shape[0] != n or tuple(tensor.shape[1:]) not in shapes:
                raise ValueError(
                    f"{key} has shape {list(tensor.shape)}, expected "
                    f"{' or '.join(str([n, *shape]) for shape in shapes)} (the {n} experts)"
                )
            stacked.append(tensor)
        if quant.format == "fp8_tensor":
            stacked[2], stacked[3] = stacked[2].reshape(n, 2), stacked[3].reshape(n)
        gate_up_scale_from_stacked(stacked[2], quant, inter)
        own = {targets[name].untyped_storage().data_ptr() for name in names if not targets[name].is_meta}
        if (
            ids != list(range(n))
            and quant.activation != "static"
            and not (module.layout.shared == "fused" and "gate_proj.weight" in shared)
            and not any(targets[name].is_meta for name in names)
            and not any(tensor.untyped_storage().data_ptr() in own for tensor in stacked)
        ):
            # Another subset or order of the experts (expert parallelism, replicas): the rows
            # this rank takes are checked, then written one expert at a time into the layer's
            # own tensors, as the per-expert keys are.
            scales = [
                check_scale(prefix + key, stacked[i], tuple(stacked[i].shape))
                for i, key in ((2, stacked_names[2]), (3, stacked_names[3]))
            ]
            for e in dict.fromkeys(ids):
                check_fp8_weight(prefix + stacked_names[0], stacked[0][e], e)
                check_fp8_weight(prefix + stacked_names[1], stacked[1][e], e)
            _check_rest_before_write(module, state_dict, prefix, shared)
            with torch.no_grad():
                for name, source in zip(("w_gate_up", "w_down", "gate_up_scale", "down_scale"), stacked[:2] + scales):
                    for local, e in enumerate(ids):
                        targets[name][local] = source[e]
            routed = {name: targets[name][:num_local] for name in names}
            found_in_place = True
        else:
            # This rank's rows: the checkpoint's tensors themselves when they are exactly those.
            routed = dict(
                zip(("w_gate_up", "w_down", "gate_up_scale", "down_scale"), (_local_rows(t, ids, n) for t in stacked))
            )
        if quant.activation == "static" and not found_in_place:
            index = torch.tensor(ids, device=stacked[4].device)
            routed["input_scale"] = torch.stack([stacked[4][index], stacked[5][index]], dim=1)
    if routed is not None and found_in_place:
        # The rows are the layer's own tensors, checked above: torch copies each onto itself.
        for name in names:
            state_dict[prefix + "experts." + name] = targets[name]
        return
    if routed is not None:
        checked = check_quantized_weights(
            quant,
            num_local,
            hid,
            inter,
            routed["w_gate_up"],
            routed["w_down"],
            routed["gate_up_scale"],
            routed["down_scale"],
            routed.get("input_scale"),
        )
        routed = {name: checked[name] for name in routed}
    slots = None
    if module.layout.shared == "fused" and "gate_proj.weight" in shared:
        weights = []
        for name in ("gate_proj", "up_proj", "down_proj"):
            weight, scale = shared.pop(f"{name}.weight"), shared.pop(f"{name}.weight_scale_inv", None)
            if weight.dtype == torch.float8_e4m3fn:
                if scale is None:
                    raise KeyError(f"{prefix}shared_experts.{name}.weight_scale_inv is missing for the FP8 shared MLP")
                weight = (
                    dequantize_fp8_block(weight, scale, quant.block_size)
                    if scale.numel() > 1
                    else dequantize_fp8_tensor(weight, scale.reshape(()))
                )
            weights.append(weight.float())
        slots = split_slots(*weights, inter, module.num_shared_experts)
    if routed is None and slots is None:
        return
    for name in {*(routed or ()), *(names if slots is not None else ())}:
        full = targets[name]
        if slots is None and routed[name].shape[0] == full.shape[0]:
            state_dict[prefix + "experts." + name] = routed[name]  # the checked rows as they are
            continue
        out = torch.empty_like(full)
        out[:num_local] = full[:num_local] if routed is None else routed[name]
        if slots is None or name not in names:
            out[num_local:] = full[num_local:]  # the fused slots (or their input scales) kept
        state_dict[prefix + "experts." + name] = out
    if slots is not None:  # the shared MLP quantized with the layer's config, into its slots
        out = tuple(state_dict[prefix + "experts." + name][num_local:] for name in names)
        quantize_experts(*(w.to(out[0].device) for w in slots), quant, out=out)


def _int4_shared_slots(module, state_dict: dict, prefix: str, shared: dict) -> None:
    """A float shared MLP of ``state_dict`` quantized with the layer's INT4 config into its
    fused slots; the routed rows are the state dict's (or the layer's own when absent)."""
    if module.layout.shared != "fused" or "gate_proj.weight" not in shared:
        return
    quant, inter, num_local = module.quant, module.intermediate_size, len(module.routed_expert_ids())
    weights = [shared.pop(f"{name}.weight").float() for name in ("gate_proj", "up_proj", "down_proj")]
    slots = split_slots(*weights, inter, module.num_shared_experts)
    targets = module.experts.quantized_tensors()
    for kind, weight in zip(("gate_up", "down"), slots):
        parts = quantize_int4(weight, group_size=quant.group_size, symmetric=quant.symmetric)
        for name, tensor in zip(("w_" + kind, kind + "_scale", kind + "_zero"), parts):
            full, given = targets[name], state_dict.get(prefix + "experts." + name)
            out = torch.empty_like(full)
            out[:num_local] = full[:num_local] if given is None else given[:num_local]
            out[num_local:] = tensor
            state_dict[prefix + "experts." + name] = out


def _check_expert_biases(module, state_dict: dict, prefix: str, experts_key: str) -> None:
    """A state dict carrying the routed experts (``experts_key``) carries their biases
    exactly when the layer has them: a missing one would leave zeros, an extra one would be
    dropped, both silently."""
    if experts_key not in state_dict:
        return
    keys = (prefix + "experts.gate_up_proj_bias", prefix + "experts.down_proj_bias")
    if module.experts.b_gate_up is not None:
        missing = [key for key in keys if key not in state_dict]
        if missing:
            raise KeyError(
                f"{missing[0]} is missing from the state dict: the layer has expert biases "
                f"(expert_bias=True) and {experts_key} comes without them"
            )
    else:
        present = [key for key in keys if key in state_dict]
        if present:
            raise ValueError(
                f"the state dict holds {present[0]} but the layer has no expert biases, so they "
                "would be dropped; build it with expert_bias=True"
            )


def fused_slots(module, shared: dict, like: torch.Tensor):
    """The S fused slots [S, 2I, H], [S, H, I] cut from a shared MLP's state dict."""
    inter, s = module.intermediate_size, module.num_shared_experts
    try:
        gate, up, down = (shared[f"{name}.weight"] for name in ("gate_proj", "up_proj", "down_proj"))
    except KeyError as missing:
        raise KeyError(
            f"the state dict has experts.gate_up_proj but no shared MLP {missing.args[0]} "
            "(under shared_experts. or shared_expert.) to fill the fused slots"
        ) from None
    gate_up, down = split_slots(gate, up, down, inter, s)
    return gate_up.to(like.device), down.to(like.device)


def from_gpt_oss_layout(gate_up, down, gate_up_bias, down_bias):
    # [N, H, 2I] with gate/up interleaved along the last axis -> [N, 2I, H], gate block first.
    w_gate_up = torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], dim=-1).transpose(1, 2)
    b_gate_up = torch.cat([gate_up_bias[..., 0::2], gate_up_bias[..., 1::2]], dim=-1)
    return w_gate_up, down.transpose(1, 2), b_gate_up, down_bias


def to_gpt_oss_layout(w_gate_up, w_down, b_gate_up, b_down):
    """The inverse of `from_gpt_oss_layout`: gpt-oss's (gate_up_proj [N, H, 2I] interleaved,
    down_proj [N, I, H], gate_up_proj_bias [N, 2I] interleaved, down_proj_bias [N, H])."""
    inter = w_down.shape[2]

    def interleave(gate_first):  # [..., 2I] gate block then up block -> g0, u0, g1, u1, ...
        return torch.stack([gate_first[..., :inter], gate_first[..., inter:]], dim=-1).flatten(-2)

    return (interleave(w_gate_up.transpose(1, 2)), w_down.transpose(1, 2).contiguous(), interleave(b_gate_up), b_down)


@dataclasses.dataclass(frozen=True)
class TransformersCheckpoint:
    """How the transformers block a module replaced names and lays out its state.

    A module built by `from_hf` carries one as ``checkpoint_format``: its ``state_dict()``
    then holds the block's own names and layouts (what the unpatched model saves), and it
    loads them (moeroute's own names load too). ``module.checkpoint_format = None`` gives
    moeroute's names (``router_weight``, ``experts.w_gate_up``, ...), e.g. for a rank's
    own experts under expert parallelism.

    Attributes
    ----------
    family : {"stacked", "gpt_oss"}
        "stacked": ``gate.weight``, ``experts.gate_up_proj`` [N, 2I, H] (gate rows first),
        ``experts.down_proj`` [N, H, I] (DeepSeek-V3, GLM-4-MoE, Qwen, Mixtral).
        "gpt_oss": ``router.weight``/``router.bias``, ``experts.gate_up_proj`` [N, H, 2I]
        (gate/up columns interleaved), ``experts.down_proj`` [N, I, H] and their biases.
    shared_prefix : str
        Where the block keeps its shared MLP: "shared_experts." (DeepSeek, GLM) or
        "shared_expert." (Qwen).
    """

    family: str = "stacked"
    shared_prefix: str = "shared_experts."

    def load(self, module: nn.Module, state_dict: dict, prefix: str) -> None:
        """Map the block's keys under ``prefix`` to the module's, in place."""
        if self.family == "stacked":
            map_transformers_keys(module, state_dict, prefix)
            return
        names = {"router.weight": "router_weight", "router.bias": "router_bias"}
        for source, target in names.items():
            if prefix + source in state_dict:
                state_dict[prefix + target] = state_dict.pop(prefix + source)
        sources = [
            prefix + "experts." + name for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
        ]
        present = [key for key in sources if key in state_dict]
        if present and len(present) != len(sources):
            missing = [key for key in sources if key not in state_dict]
            raise KeyError(f"{missing[0]} is missing from the state dict: gpt-oss experts need {', '.join(sources)}")
        if present:
            gate_up, down, gate_up_bias, down_bias = (state_dict.pop(key) for key in sources)
            ids, n = module.routed_expert_ids(), module.router.num_experts
            if ids == list(range(n)) or gate_up.dim() != 3 or gate_up.shape[0] != n:
                converted = from_gpt_oss_layout(gate_up, down, gate_up_bias, down_bias)
            else:  # this rank's experts (and replicas), converted one expert at a time
                w_gate_up = torch.empty(
                    (len(ids), gate_up.shape[2], gate_up.shape[1]), dtype=gate_up.dtype, device=gate_up.device
                )
                for local, e in enumerate(ids):
                    w_gate_up[local] = from_gpt_oss_layout(gate_up[e : e + 1], down[:1, :0], gate_up_bias[:1], None)[0][
                        0
                    ]
                _, w_down, b_gate_up, b_down = from_gpt_oss_layout(gate_up[:, :0], down, gate_up_bias, down_bias)
                converted = (w_gate_up, *(_local_rows(t, ids, n) for t in (w_down, b_gate_up, b_down)))
            for name, tensor in zip(("w_gate_up", "w_down", "b_gate_up", "b_down"), converted):
                state_dict[prefix + "experts." + name] = tensor

    def save(self, module: nn.Module, state_dict: dict, prefix: str) -> None:
        """Replace the module's keys under ``prefix`` by the block's, in place.

        Raises
        ------
        RuntimeError
            The module holds only its rank's experts (expert parallelism): the block's
            checkpoint needs all N.
        """
        layout = module.layout
        if layout.ep_size > 1:
            raise RuntimeError(
                f"the MoE at {prefix or 'the root'!r} holds rank {module.rank}'s experts of an expert-parallel "
                f"layer ({layout.ep_size} ranks), so it cannot save the transformers checkpoint of the whole "
                "block; save from a model patched without ep_group, or set module.checkpoint_format = None "
                "to save this rank's state under moeroute's names"
            )

        def pop(name):
            return state_dict.pop(prefix + name)

        inter, num_experts = module.intermediate_size, module.router.num_experts
        gate_up, down = pop("experts.w_gate_up"), pop("experts.w_down")
        # One local row per logical expert (the first replica); fused slots after them.
        ids = module.routed_expert_ids()
        rows = [ids.index(e) for e in range(num_experts)]
        routed = [_select_rows(gate_up, rows), _select_rows(down, rows)]
        out = {}
        if self.family == "gpt_oss":
            converted = to_gpt_oss_layout(
                *routed, *(_select_rows(pop(name), rows) for name in ("experts.b_gate_up", "experts.b_down"))
            )
            for name, tensor in zip(("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"), converted):
                out["experts." + name] = tensor
            out["router.weight"], out["router.bias"] = pop("router_weight"), pop("router_bias")
        else:
            out["gate.weight"] = pop("router_weight")
            if module.correction_bias is not None:
                out["gate.e_score_correction_bias"] = pop("correction_bias")
            out["experts.gate_up_proj"], out["experts.down_proj"] = routed
            if layout.shared == "fused":  # the shared MLP is the S slots after the routed experts
                slots = range(len(ids), len(ids) + module.num_shared_experts)
                out[self.shared_prefix + "gate_proj.weight"] = torch.cat([gate_up[j, :inter] for j in slots])
                out[self.shared_prefix + "up_proj.weight"] = torch.cat([gate_up[j, inter:] for j in slots])
                out[self.shared_prefix + "down_proj.weight"] = torch.cat([down[j] for j in slots], dim=1)
            for key in [k for k in state_dict if k.startswith(prefix + "shared_experts.")]:
                out[self.shared_prefix + key[len(prefix + "shared_experts.") :]] = state_dict.pop(key)
        state_dict.update((prefix + name, tensor) for name, tensor in out.items())


def _select_rows(tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``tensor[rows]``; the tensor itself (or a leading slice of it) when rows are 0, 1, ..."""
    if rows == list(range(len(rows))):
        return tensor if tensor.shape[0] == len(rows) else tensor[: len(rows)]
    return tensor.index_select(0, torch.tensor(rows, device=tensor.device))


def save_in_checkpoint_format(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """State-dict post-hook of the modules `from_hf` builds: the block's names and layouts."""
    if module.checkpoint_format is not None:
        module.checkpoint_format.save(module, state_dict, prefix)
