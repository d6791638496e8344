"""Independent references and inputs for the expert GEMM tests (host emulation and GPU).

The reference is a per-(token, slot) loop in float64 written from docs/semantics.md section 5, with torch's
activation functions; it rounds the intermediate and each slot's output to the element type
where the kernels store them, so the remaining difference is float32 vs float64 accumulation.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F

# Largest |kernel - reference| allowed, as a fraction of max |reference|: a few units in the
# last place of the element type (the rounding points can flip between float32 and float64
# accumulation), float32 accumulation error for float32.
TOLERANCE = {"float32": 1e-5, "float16": 4e-3, "bfloat16": 3e-2}

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def activation_reference(x: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return F.silu(x)
    if activation == "gelu":
        return F.gelu(x, approximate="none")
    if activation == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    raise ValueError(activation)


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """float64 values rounded to ``dtype`` (round to nearest even, by torch) and back."""
    return torch.from_numpy(np.asarray(x, np.float64)).to(TORCH_DTYPES[dtype]).to(torch.float64).numpy()


def to_storage(x: np.ndarray, dtype: str) -> np.ndarray:
    """The NumPy array the kernels read for ``dtype``; bfloat16 as its raw bits in uint16."""
    t = torch.from_numpy(np.asarray(x, np.float32)).to(TORCH_DTYPES[dtype])
    if dtype == "bfloat16":
        return t.view(torch.int16).numpy().view(np.uint16).copy()
    return t.numpy().copy()


def from_storage(x: np.ndarray, dtype: str) -> np.ndarray:
    """float64 values of a kernel array of ``dtype``."""
    if dtype == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16).to(torch.float64).numpy()
    return np.asarray(x, np.float64)


def reference_slots(
    x, w_gate_up, w_down, topk_weights, topk_ids, *, activation="silu", apply_router_weight=True, dtype="float32"
):
    """Per-slot results: intermediate [T*K, I] and expert_out [T*K, H] in float64, NaN rows for
    slots whose id is outside [0, E); x, weights are float64 values of the stored inputs."""
    T, H = x.shape
    E, two_I, _ = w_gate_up.shape
    I = two_I // 2
    K = topk_ids.shape[1]
    intermediate = np.full((T * K, I), np.nan)
    expert_out = np.full((T * K, H), np.nan)
    for t in range(T):
        for k in range(K):
            e = int(topk_ids[t, k])
            if not 0 <= e < E:
                continue
            gate = w_gate_up[e, :I] @ x[t]
            up = w_gate_up[e, I:] @ x[t]
            act = activation_reference(torch.from_numpy(gate), activation).numpy()
            inter = round_to(act * up, dtype)
            y = w_down[e] @ inter
            if apply_router_weight:
                y = y * np.float64(topk_weights[t, k])
            intermediate[t * K + k] = inter
            expert_out[t * K + k] = round_to(y, dtype)
    return intermediate, expert_out


def reference_fused_experts(
    x, w_gate_up, w_down, topk_weights, topk_ids, *, activation="silu", apply_router_weight=True, dtype="float32"
):
    """out [T, H] float64: the sum of each token's valid slot outputs, rounded to ``dtype``."""
    T, H = x.shape
    K = topk_ids.shape[1]
    _, expert_out = reference_slots(
        x,
        w_gate_up,
        w_down,
        topk_weights,
        topk_ids,
        activation=activation,
        apply_router_weight=apply_router_weight,
        dtype=dtype,
    )
    out = np.nan_to_num(expert_out, nan=0.0).reshape(T, K, H).sum(axis=1)
    return round_to(out, dtype)


def assert_close(actual, expected, dtype: str, what: str = "output") -> None:
    actual = np.asarray(actual, np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    missing = np.count_nonzero(~np.isfinite(actual))
    assert missing == 0, f"{what}: {missing} elements not written or not finite"
    scale = max(float(np.abs(expected).max(initial=0.0)), 1e-30)
    error = float(np.abs(actual - expected).max(initial=0.0)) / scale
    assert error <= TOLERANCE[dtype], f"{what}: max error {error:.3g} of max |reference| > {TOLERANCE[dtype]} ({dtype})"


def ragged_routing(counts, top_k: int, num_experts: int, rng, num_other_rank: int = 2):
    """topk_ids [T, top_k] int32 where expert e appears counts[e] times, plus ``num_other_rank``
    slots of id -1 and one id >= num_experts (both not on this device), padded with -1 so that
    T * top_k entries fill; topk_weights [T, top_k] float32 in (0.1, 1)."""
    flat = [e for e, c in enumerate(counts) for _ in range(c)]
    flat += [-1] * num_other_rank + [num_experts + 3]
    flat += [-1] * ((-len(flat)) % top_k)
    flat = np.array(flat, dtype=np.int32)
    rng.shuffle(flat)
    topk_ids = flat.reshape(-1, top_k)
    topk_weights = rng.uniform(0.1, 1.0, size=topk_ids.shape).astype(np.float32)
    return topk_ids, topk_weights


def random_problem(rng, num_tokens, hidden_size, intermediate_size, num_experts):
    """float32 hidden_states [T, H], w_gate_up [E, 2I, H], w_down [E, H, I] with O(1) outputs."""
    x = rng.standard_normal((num_tokens, hidden_size)).astype(np.float32)
    w_gate_up = (rng.standard_normal((num_experts, 2 * intermediate_size, hidden_size)) / np.sqrt(hidden_size)).astype(
        np.float32
    )
    w_down = (rng.standard_normal((num_experts, hidden_size, intermediate_size)) / np.sqrt(intermediate_size)).astype(
        np.float32
    )
    return x, w_gate_up, w_down


@functools.lru_cache(maxsize=1)
def cuda_device_available() -> bool:
    """True when both CuPy and torch see a CUDA device (the GPU tests use both)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0 and torch.cuda.is_available()
    except Exception:  # no driver, no CuPy, or no device: all mean "skip the GPU tests"
        return False
