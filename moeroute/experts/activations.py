"""The activations of the gated expert MLP, in torch: the names, their check and their compute.

The names are `moeroute.config.EXPERT_ACTIVATIONS` (one list for the presets, the torch
experts, the GPU kernels' codes and the engine name mappings); the definitions are those of
docs/semantics.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeroute.config import EXPERT_ACTIVATIONS

__all__ = [
    "ACTIVATIONS",
    "SWIGLUOAI_ALPHA",
    "SWIGLUOAI_LIMIT",
    "check_activation",
    "apply_activation",
    "gated_activation",
]

#: Activations of the gated MLP: "silu" (SwiGLU), "gelu" (erf GeGLU), "gelu_tanh", and
#: "swigluoai" (gpt-oss: clamped gate and up, ``(up + 1) * gate * sigmoid(1.702 * gate)``).
ACTIVATIONS = EXPERT_ACTIVATIONS
#: gpt-oss's swiglu_alpha: the sigmoid's slope in ``gate * sigmoid(alpha * gate)``.
SWIGLUOAI_ALPHA = 1.702
#: gpt-oss's swiglu_limit: gate clamped above at it, up clamped to [-limit, limit].
SWIGLUOAI_LIMIT = 7.0


def check_activation(activation: str) -> str:
    """Return ``activation``; ValueError naming it and the allowed ones otherwise."""
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not supported; use one of {ACTIVATIONS}")
    return activation


def apply_activation(gate: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate)`` for "silu", "gelu" or "gelu_tanh"; same shape and dtype.

    Raises ValueError for "swigluoai", which also transforms the up projection (use
    `gated_activation`).
    """
    if activation == "silu":
        return F.silu(gate)
    if activation == "gelu":
        return F.gelu(gate)
    if activation == "swigluoai":
        raise ValueError(
            "activation='swigluoai' clamps and shifts the up projection too; it has no "
            "gate-only form (use gated_activation(gate, up, 'swigluoai'))"
        )
    return F.gelu(gate, approximate="tanh")


def gated_activation(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """The gated MLP's intermediate: ``act(gate) * up``, or for "swigluoai"
    ``(clamp(up, -7, 7) + 1) * g * sigmoid(1.702 * g)`` with ``g = min(gate, 7)``.

    ``gate`` and ``up`` have the same shape; the result has it too, in their dtype. ``gate``
    may be modified in place (it is a scratch slice of the gate_up product).
    """
    if activation != "swigluoai":
        return apply_activation(gate, activation).mul_(up)
    gate = gate.clamp(max=SWIGLUOAI_LIMIT)
    glu = gate * torch.sigmoid(gate * SWIGLUOAI_ALPHA)
    return glu.mul_(up.clamp(-SWIGLUOAI_LIMIT, SWIGLUOAI_LIMIT) + 1)
