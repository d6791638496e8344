"""The gated MLP of a shared expert, in the shape transformers writes it.

``down_proj(act(gate_proj(x)) * up_proj(x))`` (or the "swigluoai" form) with bias-free linears: the shape that
`MoE` can fuse into expert slots (`moeroute.bindings.torch.moe.shared_mlp_slots`).
"""

from __future__ import annotations

import torch
from torch import nn

from moeroute._validate import integer
from moeroute.experts.activations import apply_activation, check_activation, gated_activation

__all__ = ["GatedMLP"]


class GatedMLP(nn.Module):
    """A shared expert: ``down_proj(act(gate_proj(x)) * up_proj(x))``.

    Parameters
    ----------
    hidden_size, intermediate_size : int
        H and the MLP's intermediate size (S * I when it is to be fused into S slots of I).
    activation : str
        "silu" (default) or one of the experts' other activations.
    dtype, device : optional
        Of the three weights: ``gate_proj`` [I, H], ``up_proj`` [I, H], ``down_proj`` [H, I].

    Raises
    ------
    ValueError
        A size below 1 or an unknown activation.
    """

    def __init__(
        self, hidden_size: int, intermediate_size: int, activation: str = "silu", *, dtype=None, device=None
    ) -> None:
        super().__init__()
        hidden_size = integer("hidden_size", hidden_size, 1)
        intermediate_size = integer("intermediate_size", intermediate_size, 1)
        self.activation = check_activation(activation)
        kwargs = {"bias": False, "dtype": dtype, "device": device}
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kwargs)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kwargs)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kwargs)

    def act_fn(self, x: torch.Tensor) -> torch.Tensor:
        return apply_activation(x, self.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated_activation(self.gate_proj(x), self.up_proj(x), self.activation))
