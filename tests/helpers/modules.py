"""Small torch modules the tests build MoE layers from."""

from __future__ import annotations

import torch
from torch import nn


class CountingMLP(nn.Module):
    """A transformers-style gated shared MLP (``down(silu(gate x) * up x)``, no biases) that
    counts its calls and the rows it was given."""

    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act_fn = nn.SiLU()
        self.calls = 0
        self.rows = 0

    def forward(self, x):
        self.calls += 1
        self.rows += x.shape[0]
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def randomize(module, seed, scale, buffer_scale):
    """Every parameter of ``module`` set to ``scale`` * N(0, 1) and every floating buffer (the
    correction biases) to ``buffer_scale`` * N(0, 1), drawn in order from one generator
    seeded with ``seed``; returns ``module``."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
        for buffer in module.buffers():
            if buffer.is_floating_point():
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * buffer_scale)
    return module
