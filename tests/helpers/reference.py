"""float64 dense references of the MoE pieces, written from their formulas, and the small
seeded generators the tests draw their tensors from.

Nothing here calls moeroute: a test compares the code under test with these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeroute._validate import weights_then_ids

#: gpt-oss's clamped SwiGLU ("swigluoai"): gate clamped above, up clamped both sides, at 7;
#: the gate's sigmoid is scaled by 1.702.
SWIGLUOAI_LIMIT = 7.0
SWIGLUOAI_ALPHA = 1.702


#: The e2m1 value of each 4-bit MXFP4 code.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks, scales):
    """float64 [..., rows, cols] of MXFP4 ``blocks`` [..., rows, cols/32, 16] and ``scales``
    [..., rows, cols/32]: ``e2m1[nibble] * 2 ** (scale - 127)``, byte j holding element 2j in
    its low nibble and 2j+1 in its high one."""
    table = torch.tensor(E2M1, dtype=torch.float64)
    low, high = table[(blocks % 16).long()], table[(blocks // 16).long()]
    values = torch.stack([low, high], dim=-1).flatten(-2)
    values = values * torch.pow(2.0, scales.double() - 127)[..., None]
    return values.flatten(-2)


def generator(seed):
    """A CPU torch.Generator seeded with ``seed``."""
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed, scale=1.0):
    """``scale`` * standard normal float32 values of ``shape``, drawn from ``seed`` alone."""
    return torch.randn(*shape, generator=generator(seed)) * scale


def rel_error(actual, expected):
    """max |actual - expected| / max |expected|, computed in float64."""
    expected = expected.double()
    return float((actual.double() - expected).abs().max() / expected.abs().max())


def swigluoai(gate, up):
    """``(clamp(up, -7, 7) + 1) * g * sigmoid(1.702 * g)`` with ``g = clamp(gate, max=7)``."""
    gate = torch.clamp(gate, max=SWIGLUOAI_LIMIT)
    up = torch.clamp(up, min=-SWIGLUOAI_LIMIT, max=SWIGLUOAI_LIMIT)
    return (up + 1.0) * gate * torch.sigmoid(SWIGLUOAI_ALPHA * gate)


#: act(gate) of the gated activations ``act(gate) * up``.
GATE_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh")}


def gated_activation(gate, up, activation="silu"):
    """The expert MLP's activation of the gate and up halves: ``act(gate) * up``, or swigluoai."""
    if activation == "swigluoai":
        return swigluoai(gate, up)
    return GATE_ACTIVATIONS[activation](gate) * up


def dense_experts(
    x, weights, ids, w_gate_up, w_down, activation="silu", b_gate_up=None, b_down=None, weight_on_input=False
):
    """``out[t] = sum_k weights[t, k] * expert_{ids[t, k]}(x[t])`` in float64, slot by slot.

    ``expert_e(v) = W_down[e] act(W_gate_up[e] v + b_gate_up[e]) + b_down[e]`` with the gate
    rows first in ``W_gate_up`` ([E, 2I, H], ``W_down`` [E, H, I]); a slot whose id is outside
    [0, E) (held elsewhere, or -1) adds nothing. With ``weight_on_input`` the weight scales the
    expert's input row instead of its output. The routing pair comes weights then ids, as the
    library's entry points take it (ids first: TypeError naming the argument).
    """
    weights_then_ids(weights, ids, "weights", "ids")
    inter = w_down.shape[2]
    x64 = x.double()
    out = torch.zeros(x.shape[0], w_down.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if not 0 <= e < w_gate_up.shape[0]:
                continue
            w = float(weights[t, k])
            row = x64[t] * w if weight_on_input else x64[t]
            h = w_gate_up[e].double() @ row
            if b_gate_up is not None:
                h = h + b_gate_up[e].double()
            y = w_down[e].double() @ gated_activation(h[:inter], h[inter:], activation)
            if b_down is not None:
                y = y + b_down[e].double()
            out[t] += y if weight_on_input else w * y
    return out
