"""INT4 checkpoints' per-expert keys <-> the tensors of an INT4 `MoE` layer.

Published INT4 MoE checkpoints keep one module per expert and projection, relative to the
block's prefix (``model.layers.{l}.mlp.``): ``experts.{e}.{gate_proj,up_proj,down_proj}.``
followed by the keys of their layout (DeepSeek-V3 / Kimi-K2 and Qwen3-MoE name them alike):

==================  ==========================================================================
compressed-tensors  ``weight_packed`` int32 [N, K/8], ``weight_scale`` [N, K/g],
(pack-quantized)    ``weight_shape`` [2], asymmetric: ``weight_zero_point``
GPTQ (v1, v2)       ``qweight`` int32 [K/8, N], ``qzeros`` int32 [K/g, N/8], ``scales`` [K/g, N],
                    ``g_idx`` [K]
AWQ (GEMM)          ``qweight`` int32 [K, N/8], ``qzeros`` int32 [K/g, N/8], ``scales`` [K/g, N]
==================  ==========================================================================

(N, K) is (I, H) for gate_proj and up_proj, (H, I) for down_proj; the layout is the layer's
``quant.checkpoint`` (`moeroute.quant.QuantConfig.from_hf` sets it; the words are decoded by
`moeroute.quant.int4_checkpoint`). Loading checks every expert this rank holds (keys present,
no key the layout does not have, dtypes and shapes, scales finite, zero points and ``g_idx``)
before it writes anything, then writes one expert at a time straight into the layer's own
tensors. GPTQ act order on down_proj (``g_idx`` of the intermediate columns) is folded into
the rows of gate_proj and up_proj once, here (`moeroute.quant.fold_act_order`); act order on
gate_proj/up_proj (the hidden columns, the same ``g_idx`` for both) makes their groups
contiguous here and leaves the layer one hidden-column permutation per expert
(``experts.gate_up_perm``), which the forward gathers the routed rows' activations with.

`Int4Checkpoint` is the ``checkpoint_format`` that saves such a layer back under these names
and packing (``state_dict`` / ``save_pretrained``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import torch
from torch import nn

from moeroute.quant import QuantConfig
from moeroute.quant.int4_checkpoint import (
    INT4_CHECKPOINT_KEYS,
    Int4Weight,
    pack_int4_checkpoint,
    unpack_int4_checkpoint,
)

__all__ = [
    "INT4_WEIGHT_KEY",
    "Int4Checkpoint",
    "check_int4_expert",
    "find_int4_expert_keys",
    "int4_layout",
    "int4_checkpoint_for",
    "map_int4_expert_keys",
    "note_int4_layout",
    "read_int4_plan",
    "set_gate_up_perms",
    "write_int4_expert",
    "write_int4_plan",
]

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
#: The tensor holding a layout's packed integers (checked from the file's header only).
INT4_WEIGHT_KEY = {"compressed-tensors": "weight_packed", "gptq": "qweight", "gptq_v2": "qweight", "awq": "qweight"}
#: Scale dtypes the layouts' writers use, when a layer saves scales it did not load.
_DEFAULT_SCALE_DTYPE = {
    "compressed-tensors": torch.bfloat16,
    "gptq": torch.float16,
    "gptq_v2": torch.float16,
    "awq": torch.float16,
}
_PATTERN = re.compile(r"experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.([A-Za-z0-9_]+)$")


def int4_layout(module, key: str) -> str:
    """The layer's INT4 checkpoint layout (``quant.checkpoint``); ValueError naming ``key``
    when the layer has none."""
    layout = module.quant.checkpoint
    if layout not in INT4_CHECKPOINT_KEYS:
        raise ValueError(
            f"{key} is an INT4 checkpoint tensor but the layer's quant has checkpoint={layout!r}; build it "
            f"with quant=QuantConfig.from_hf(config) (or checkpoint= one of {tuple(INT4_CHECKPOINT_KEYS)})"
        )
    return layout


def find_int4_expert_keys(keys, prefix: str) -> dict:
    """``{(e, projection): {name: key}}`` of every per-expert key under ``prefix``."""
    found = {}
    start = len(prefix)
    for key in keys:
        if not key.startswith(prefix + "experts."):
            continue
        match = _PATTERN.match(key, start)
        if match:
            found.setdefault((int(match.group(1)), match.group(2)), {})[match.group(3)] = key
    return found


def _expert_name(prefix: str, e: int, projection: str) -> str:
    return f"{prefix}experts.{e}.{projection}"


def _weight_shape(layout: str, rows: int, cols: int) -> tuple:
    if layout == "compressed-tensors":
        return (rows, cols // 8)
    if layout == "awq":
        return (cols, rows // 8)
    return (cols // 8, rows)


def expected_int4_keys(module, found: dict, prefix: str) -> tuple:
    """(layout, the unique expert ids this rank holds): every required key of theirs present,
    no expert id outside [0, N). KeyError/ValueError naming the key."""
    first = next(iter(next(iter(found.values())).values()))
    layout = int4_layout(module, first)
    num_experts = module.router.num_experts
    for (e, projection), names in found.items():
        if e >= num_experts:
            key = next(iter(names.values()))
            raise ValueError(f"{key} names expert {e}, but the layer has {num_experts} experts (0..{num_experts - 1})")
    required = INT4_CHECKPOINT_KEYS[layout][0]
    ids = list(dict.fromkeys(module.routed_expert_ids()))
    for e in ids:
        for projection in PROJECTIONS:
            names = found.get((e, projection), {})
            for name in required:
                if name not in names:
                    raise KeyError(
                        f"{_expert_name(prefix, e, projection)}.{name} is missing from the {layout} checkpoint "
                        f"(this rank holds expert {e})"
                    )
    return layout, ids


def check_int4_expert(module, e: int, tensors: dict, prefix: str) -> torch.Tensor | None:
    """Check one expert's checkpoint tensors ``{projection: {name: tensor}}`` against the
    layer (the packed weights may be meta tensors: only their dtype and shape are read).

    Returns (down_proj's act-order permutation, gate_proj's and up_proj's), each None
    without one.

    Raises
    ------
    KeyError, ValueError, TypeError
        Naming the key: a missing or extra tensor, a dtype or shape other than the layer's
        projection needs, a non-finite scale, a zero point or ``g_idx`` the layout refuses;
        gate_proj and up_proj with different ``g_idx`` (naming both).
    """
    quant, inter, hid = module.quant, module.intermediate_size, module.routed_hidden_size
    layout = quant.checkpoint
    weight_key = INT4_WEIGHT_KEY[layout]
    perms = {}
    for projection in PROJECTIONS:
        name = _expert_name(prefix, e, projection)
        rows, cols = (hid, inter) if projection == "down_proj" else (inter, hid)
        weight = tensors[projection].get(weight_key)
        expected = _weight_shape(layout, rows, cols)
        if isinstance(weight, torch.Tensor) and tuple(weight.shape) != expected:
            raise ValueError(
                f"{name}.{weight_key} has shape {list(weight.shape)}; the layer's {projection} is "
                f"[{rows}, {cols}], which {layout} stores as {list(expected)}"
            )
        unpacked = unpack_int4_checkpoint(tensors[projection], quant, name, check_only=True)
        perms[projection] = unpacked.perm
    gate, up = perms["gate_proj"], perms["up_proj"]
    if (gate is None) != (up is None) or (gate is not None and not torch.equal(gate, up)):
        raise ValueError(
            f"{_expert_name(prefix, e, 'gate_proj')}.g_idx and {_expert_name(prefix, e, 'up_proj')}.g_idx "
            "give different column orders (GPTQ act order); gate_proj and up_proj multiply the same hidden "
            "columns and must share one g_idx"
        )
    return perms["down_proj"], gate


def _slots(module, local: int, projection: str) -> tuple:
    """(packed, scales, zeros or None) views of one local expert's rows of ``projection``."""
    experts, inter = module.experts, module.intermediate_size
    if projection == "down_proj":
        names, rows = ("w_down", "down_scale", "down_zero"), slice(None)
    else:
        names = ("w_gate_up", "gate_up_scale", "gate_up_zero")
        rows = slice(0, inter) if projection == "gate_proj" else slice(inter, 2 * inter)
    return tuple(None if getattr(experts, n) is None else getattr(experts, n)[local, rows] for n in names)


@torch.no_grad()
def write_int4_expert(module, locals_: list, e: int, tensors: dict, prefix: str, perms) -> None:
    """Unpack one checked expert into its local rows ``locals_`` (its replicas after the
    first are copies of it); ``perms`` = `check_int4_expert`'s: down_proj's act order folded
    into the gate and up rows, gate_proj's and up_proj's into the layer's ``gate_up_perm``
    rows (`set_gate_up_perms` made it)."""
    down_perm, gate_up_perm = perms
    quant, inter = module.quant, module.intermediate_size
    targets = module.experts.quantized_tensors()
    own = {t.untyped_storage().data_ptr() for t in targets.values()}
    first = locals_[0]
    for projection in PROJECTIONS:
        # A round trip of the layer's own state may hand back views of its tensors: read first.
        given = {
            name: t.clone() if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in own else t
            for name, t in tensors[projection].items()
        }
        packed, scales, zeros = _slots(module, first, projection)
        weight = unpack_int4_checkpoint(given, quant, _expert_name(prefix, e, projection), out=packed)
        module.experts.hold_int4_scales(
            "down_scale" if projection == "down_proj" else "gate_up_scale", weight.scales.dtype
        )
        scales = _slots(module, first, projection)[1]  # the scales as now held
        scales.copy_(weight.scales)
        if zeros is not None:
            zeros.copy_(weight.zeros)
    if down_perm is not None:
        rows = down_perm.to(targets["w_gate_up"].device)
        for name in ("w_gate_up", "gate_up_scale", "gate_up_zero"):
            if name in targets:
                row = targets[name][first]
                row.copy_(row.view(2, inter, -1)[:, rows].reshape(row.shape))
    for local in locals_[1:]:
        for tensor in targets.values():
            tensor[local].copy_(tensor[first])
    held = module.experts.gate_up_perm
    if gate_up_perm is not None:
        held[locals_] = gate_up_perm.to(device=held.device, dtype=held.dtype)


def set_gate_up_perms(module, perms: dict) -> None:
    """The layer's ``experts.gate_up_perm`` for a load whose checked experts have ``perms``
    ``{e: check_int4_expert's}``: None when no expert has act order on gate_proj/up_proj,
    else int32 [L, H] of identity rows, which `write_int4_expert` overwrites per expert."""
    experts = module.experts
    if all(p[1] is None for p in perms.values()):
        experts.gate_up_perm = None
        return
    local, hidden = experts.num_local_experts, experts.hidden_size
    device = experts.w_gate_up.device
    experts.gate_up_perm = torch.arange(hidden, dtype=torch.int32, device=device).repeat(local, 1)


def _local_rows(module) -> dict:
    """logical expert -> its local rows on this rank (replicas included), in order."""
    rows = {}
    for local, e in enumerate(module.routed_expert_ids()):
        rows.setdefault(e, []).append(local)
    return rows


def note_int4_layout(module, tensors: dict) -> None:
    """An `Int4Checkpoint` layer remembers how its checkpoint stored what the packing leaves
    open (scale dtype, g_idx present, zero-point layout), to save it back the same way."""
    fmt = module.checkpoint_format
    if not isinstance(fmt, Int4Checkpoint):
        return
    scale = tensors.get("weight_scale", tensors.get("scales"))
    zero = tensors.get("weight_zero_point")
    module.checkpoint_format = dataclasses.replace(
        fmt,
        scale_dtype=scale.dtype,
        g_idx="g_idx" in tensors,
        zero_point_dtype=zero.dtype if zero is not None else fmt.zero_point_dtype,
    )


@torch.no_grad()
def map_int4_expert_keys(module, state_dict: dict, prefix: str) -> bool:
    """Per-expert INT4 checkpoint keys of ``state_dict`` -> the layer's own tensors.

    Every expert this rank holds is checked first (`check_int4_expert`; the other ranks'
    experts are dropped unread), together with the layer's other tensors in the state dict
    (shapes, dtypes); then each expert is written into the layer's tensors, which are handed
    on for torch to copy onto themselves. Beyond the state dict, the peak is one expert's
    unpacking temporaries. Returns False (nothing done) when there are no such keys.

    Raises
    ------
    KeyError, ValueError
        As `check_int4_expert`, and: a key of an expert outside [0, N), moeroute's own
        ``experts.w_gate_up``/``w_down`` beside per-expert keys, a layer without a
        checkpoint layout. Nothing is written when one is raised.
    """
    found = find_int4_expert_keys(list(state_dict), prefix)
    if not found:
        return False
    layout, ids = expected_int4_keys(module, found, prefix)
    for name in ("experts.w_gate_up", "experts.w_down"):
        if prefix + name in state_dict:
            raise ValueError(
                f"the state dict holds both {prefix + name} and per-expert {layout} keys "
                f"({next(iter(found[next(iter(found))].values()))}); give one of the two"
            )
    targets = module.experts.quantized_tensors()
    if any(t.is_meta for t in targets.values()):
        raise ValueError(
            f"the layer under {prefix!r} is on the meta device: per-expert INT4 keys are written into its own "
            "tensors; build it on a device (or load with load_experts after moving it)"
        )

    def tensors_of(e):
        return {p: {n: state_dict[k] for n, k in found.get((e, p), {}).items()} for p in PROJECTIONS}

    perms = {e: check_int4_expert(module, e, tensors_of(e), prefix) for e in ids}
    module._check_state_before_copy(state_dict, prefix)  # the layer's other tensors, before any write
    note_int4_layout(module, tensors_of(ids[0])["gate_proj"])
    set_gate_up_perms(module, perms)
    for e, locals_ in _local_rows(module).items():
        write_int4_expert(module, locals_, e, tensors_of(e), prefix, perms[e])
    for names in found.values():
        for key in names.values():
            state_dict.pop(key)
    for name, tensor in targets.items():
        state_dict[prefix + "experts." + name] = tensor
    if module.experts.gate_up_perm is not None:
        state_dict[prefix + "experts.gate_up_perm"] = module.experts.gate_up_perm
    return True


def read_int4_plan(module, keys, prefix: str, meta: Callable, get: Callable) -> list:
    """The first pass of a file load for one INT4 layer: every expert this rank holds checked
    (dtypes and shapes from the files' headers through ``meta(key) -> (shape, dtype)``, the
    small tensors read with ``get(key)``), nothing written. Returns ``[(e, local rows,
    {projection: {name: key}}, perms)]`` for `write_int4_plan`, and the first expert's
    gate_proj tensors (what `note_int4_layout` records)."""
    found = find_int4_expert_keys(keys, prefix)
    if not found:
        return [], None
    layout, ids = expected_int4_keys(module, found, prefix)
    weight_key = INT4_WEIGHT_KEY[layout]
    rows = _local_rows(module)
    plan = []
    for e in ids:
        tensors = {}
        for projection in PROJECTIONS:
            tensors[projection] = {}
            for name, key in found[e, projection].items():
                if name == weight_key:
                    shape, dtype = meta(key)
                    if not isinstance(dtype, torch.dtype):
                        raise ValueError(f"{key} has dtype {dtype}; {layout} stores its integers as int32")
                    tensors[projection][name] = torch.empty(shape, dtype=dtype, device="meta")
                else:
                    tensors[projection][name] = get(key)
        perm = check_int4_expert(module, e, tensors, prefix)
        if not plan:
            first = tensors["gate_proj"]
        plan.append((e, rows[e], {p: found[e, p] for p in PROJECTIONS}, perm))
    return plan, first


def write_int4_plan(module, plan: list, prefix: str, get: Callable, first: dict | None = None) -> None:
    """The second pass: each expert's tensors read (``get(key)``), unpacked into its rows and
    released before the next; ``first`` (from `read_int4_plan`) recorded by an `Int4Checkpoint`."""
    if first is not None:
        note_int4_layout(module, first)
    set_gate_up_perms(module, {e: perm for e, _, _, perm in plan})
    for e, locals_, keys, perm in plan:
        tensors = {p: {name: get(key) for name, key in keys[p].items()} for p in PROJECTIONS}
        write_int4_expert(module, locals_, e, tensors, prefix, perm)
        del tensors


@dataclasses.dataclass(frozen=True)
class Int4Checkpoint:
    """The ``checkpoint_format`` of an INT4 layer whose checkpoint keeps per-expert modules:
    ``state_dict()`` (and ``save_pretrained``) gives ``experts.{e}.{projection}.*`` in the
    layout's own packing, the router as ``gate.weight`` (``gate.e_score_correction_bias``)
    and the shared MLP under ``shared_prefix``; loading takes those names (and moeroute's).

    Attributes
    ----------
    shared_prefix : str
        "shared_experts." (DeepSeek, Kimi-K2) or "shared_expert." (Qwen2-MoE).
    scale_dtype : torch.dtype or None
        The dtype scales are saved in; None: the layout's usual one (bfloat16 for
        compressed-tensors, float16 for GPTQ and AWQ). A load records the checkpoint's.
    g_idx : bool
        GPTQ: save ``g_idx`` (k // g); a load records whether the checkpoint had it.
    zero_point_dtype : torch.dtype
        compressed-tensors asymmetric zero points: int32 packed along the rows (current
        writers) or int8 unpacked (older ones); a load records the checkpoint's.

    The layout itself is the layer's ``quant.checkpoint``.
    """

    shared_prefix: str = "shared_experts."
    scale_dtype: torch.dtype | None = None
    g_idx: bool = True
    zero_point_dtype: torch.dtype = torch.int32

    #: No mapping of its own: the checkpoint's per-expert keys are the transformers names
    #: that `MoE` maps on every load (`moeroute.bindings.torch.hf_keys`, which reads INT4's
    #: through `map_int4_expert_keys`).
    load = None

    def save(self, module: nn.Module, state_dict: dict, prefix: str) -> None:
        """Replace the module's keys under ``prefix`` by the checkpoint's, in place.

        Raises
        ------
        RuntimeError
            The module holds only its rank's experts (expert parallelism), or its shared
            MLP lives in fused INT4 slots (the checkpoint keeps it as its own module).
        """
        layout, quant = module.layout, module.quant
        if layout.ep_size > 1:
            raise RuntimeError(
                f"the MoE at {prefix or 'the root'!r} holds rank {module.rank}'s experts of an expert-parallel "
                f"layer ({layout.ep_size} ranks), so it cannot save the whole block's INT4 checkpoint; set "
                "module.checkpoint_format = None to save this rank's state under moeroute's names"
            )
        if layout.shared == "fused":
            raise RuntimeError(
                f"the MoE at {prefix or 'the root'!r} holds its shared MLP quantized into fused INT4 expert slots, "
                "which its checkpoint keeps as a module of its own; build it with shared='runner' (or 'overlap') "
                "to save the checkpoint, or set module.checkpoint_format = None"
            )
        names = ("w_gate_up", "gate_up_scale", "gate_up_zero", "w_down", "down_scale", "down_zero")
        held = {
            name: state_dict.pop(prefix + "experts." + name)
            for name in names
            if prefix + "experts." + name in state_dict
        }
        perms = state_dict.pop(prefix + "experts.gate_up_perm", None)
        out = {"gate.weight": state_dict.pop(prefix + "router_weight")}
        if prefix + "correction_bias" in state_dict:
            out["gate.e_score_correction_bias"] = state_dict.pop(prefix + "correction_bias")
        own = {t.untyped_storage().data_ptr() for t in held.values()}
        rows = _local_rows(module)
        scale_dtype = self.scale_dtype or _DEFAULT_SCALE_DTYPE[quant.checkpoint]
        inter = module.intermediate_size
        hidden = torch.arange(module.routed_hidden_size, dtype=torch.int64)
        for e in range(module.router.num_experts):
            local = rows[e][0]
            perm = None if perms is None else perms[local].to(torch.int64)
            if perm is not None and torch.equal(perm.cpu(), hidden):
                perm = None
            for projection in PROJECTIONS:
                kind, cut = ("down", slice(None)) if projection == "down_proj" else ("gate_up", None)
                if cut is None:
                    cut = slice(0, inter) if projection == "gate_proj" else slice(inter, 2 * inter)
                zero = held[kind + "_zero"][local, cut] if kind + "_zero" in held else None
                # gate_proj's and up_proj's act order back to the checkpoint's column order and g_idx
                columns = perm if kind == "gate_up" else None
                packed = pack_int4_checkpoint(
                    Int4Weight(held["w_" + kind][local, cut], held[kind + "_scale"][local, cut], zero, columns),
                    quant,
                    scale_dtype=scale_dtype,
                    g_idx=self.g_idx,
                    zero_point_dtype=self.zero_point_dtype,
                )
                for name, tensor in packed.items():
                    # Own storage per tensor: savers refuse tensors that share memory.
                    shares = tensor.untyped_storage().data_ptr() in own
                    out[f"experts.{e}.{projection}.{name}"] = tensor.clone() if shares else tensor
        for key in [k for k in state_dict if k.startswith(prefix + "shared_experts.")]:
            out[self.shared_prefix + key[len(prefix + "shared_experts.") :]] = state_dict.pop(key)
        state_dict.update((prefix + name, tensor) for name, tensor in out.items())


def int4_checkpoint_for(quant: QuantConfig | None, shared_prefix: str = "shared_experts.") -> Int4Checkpoint | None:
    """The `Int4Checkpoint` of a layer with ``quant`` (None unless INT4 with a checkpoint layout)."""
    if quant is None or quant.format != "int4" or quant.checkpoint not in INT4_CHECKPOINT_KEYS:
        return None
    return Int4Checkpoint(shared_prefix=shared_prefix)
