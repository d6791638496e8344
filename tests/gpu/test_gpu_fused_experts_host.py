"""fused_experts without a GPU: the whole launch sequence of moeroute.gpu.gemm on the host
emulation (align fallback, both GEMMs, the top-k sum) against the NumPy reference, and the
argument checks."""

import dataclasses

import numpy as np
import pytest
import torch

from gpu_host_emulator import HostBackend
from gpu_reference import assert_close, from_storage, random_problem, reference_fused_experts, to_storage
from moeroute.gpu import fused_experts
from moeroute.gpu import launch as L
from moeroute.gpu.gemm import check_fused_experts_args, run_fused_experts

# (dtype, H, I, tokens, experts, top_k, block_size, path); path None = chosen by the launcher.
PIPELINE_CASES = [
    ("float32", 37, 23, 11, 4, 2, None, None),
    ("float16", 72, 40, 20, 6, 3, 16, None),
    ("bfloat16", 72, 40, 20, 6, 3, 64, None),
    ("bfloat16", 70, 40, 9, 3, 2, 32, None),  # H % 8 != 0: the launcher falls back to SIMT
    ("bfloat16", 72, 40, 9, 3, 2, 32, "simt"),
    ("float16", 64, 32, 1, 8, 4, None, None),  # one token (decode)
]


def run_on_host(emulator, dtype, x, w_gate_up, w_down, topk_weights, topk_ids, **options):
    backend = HostBackend(emulator)
    stored = [to_storage(v, dtype) for v in (x, w_gate_up, w_down)]
    # NumPy has no bfloat16: check the float32 arrays, then name the stored type.
    checked = check_fused_experts_args(
        x, w_gate_up, w_down, topk_weights, topk_ids, **{k: v for k, v in options.items() if k != "path"}
    )
    problem = dataclasses.replace(checked, dtype=dtype)
    inputs = [backend.arrays.copy(v) for v in (*stored, topk_weights, topk_ids)]
    out = backend.empty((problem.num_tokens, problem.hidden_size), dtype)
    run_fused_experts(backend, problem, *inputs, out, **options)
    backend.arrays.check_guards()
    values = [from_storage(v, dtype) for v in stored]
    return from_storage(out, dtype), values, backend.launched


def routing(rng, tokens, experts, top_k):
    topk_ids = np.stack([rng.permutation(experts)[:top_k] for _ in range(tokens)]).astype(np.int32)
    topk_ids[rng.random(topk_ids.shape) < 0.2] = -1  # slots on other ranks
    topk_weights = rng.uniform(0.1, 1.0, size=topk_ids.shape).astype(np.float32)
    return topk_weights, topk_ids


@pytest.mark.parametrize("dtype, H, I, tokens, experts, top_k, block_size, path", PIPELINE_CASES)
def test_pipeline_matches_reference(emulator, dtype, H, I, tokens, experts, top_k, block_size, path):
    rng = np.random.default_rng(tokens * 31 + H)
    x, w_gate_up, w_down = random_problem(rng, tokens, H, I, experts)
    topk_weights, topk_ids = routing(rng, tokens, experts, top_k)
    out, (xs, w13s, w2s), launched = run_on_host(
        emulator, dtype, x, w_gate_up, w_down, topk_weights, topk_ids, block_size=block_size, path=path
    )
    expected = reference_fused_experts(xs, w13s, w2s, topk_weights, topk_ids, dtype=dtype)
    assert_close(out, expected, dtype)
    expect_mma = path is None and dtype != "float32" and H % 8 == 0 and I % 8 == 0
    assert all(("moe_gemm_mma" in name) == expect_mma for name in launched[:2]), launched
    assert launched[2] == L.sum_name(dtype)


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("apply_router_weight", [True, False])
def test_pipeline_options(emulator, activation, apply_router_weight):
    rng = np.random.default_rng(3)
    x, w_gate_up, w_down = random_problem(rng, 7, 40, 24, 3)
    topk_weights, topk_ids = routing(rng, 7, 3, 2)
    out, values, _ = run_on_host(
        emulator,
        "bfloat16",
        x,
        w_gate_up,
        w_down,
        topk_weights,
        topk_ids,
        activation=activation,
        apply_router_weight=apply_router_weight,
    )
    expected = reference_fused_experts(
        *values,
        topk_weights,
        topk_ids,
        activation=activation,
        apply_router_weight=apply_router_weight,
        dtype="bfloat16",
    )
    assert_close(out, expected, "bfloat16")


def test_tokens_with_no_local_expert_get_zeros(emulator):
    rng = np.random.default_rng(4)
    x, w_gate_up, w_down = random_problem(rng, 5, 32, 16, 2)
    topk_weights, topk_ids = routing(rng, 5, 2, 2)
    topk_ids[1:3] = -1
    out, values, _ = run_on_host(emulator, "float32", x, w_gate_up, w_down, topk_weights, topk_ids)
    assert (out[1:3] == 0).all()
    assert_close(out, reference_fused_experts(*values, topk_weights, topk_ids), "float32")


def test_zero_tokens_launch_nothing(emulator):
    backend = HostBackend(emulator)
    x = np.zeros((0, 16), np.float32)
    w_gate_up, w_down = np.zeros((2, 8, 16), np.float32), np.zeros((2, 16, 4), np.float32)
    weights, ids = np.zeros((0, 2), np.float32), np.zeros((0, 2), np.int32)
    problem = check_fused_experts_args(x, w_gate_up, w_down, weights, ids)
    out = np.zeros((0, 16), np.float32)
    assert run_fused_experts(backend, problem, x, w_gate_up, w_down, weights, ids, out) is out
    assert backend.launched == []


def _valid_args(T=4, H=16, I=8, E=3, K=2):
    return dict(
        hidden_states=np.zeros((T, H), np.float16),
        w_gate_up=np.zeros((E, 2 * I, H), np.float16),
        w_down=np.zeros((E, H, I), np.float16),
        topk_weights=np.zeros((T, K), np.float32),
        topk_ids=np.zeros((T, K), np.int32),
    )


def test_check_returns_the_sizes():
    problem = check_fused_experts_args(**_valid_args())
    assert (
        problem.num_tokens,
        problem.hidden_size,
        problem.intermediate_size,
        problem.num_experts,
        problem.top_k,
        problem.dtype,
    ) == (4, 16, 8, 3, 2, "float16")


BAD_ARGUMENTS = [
    ("hidden_states", np.zeros((4, 16, 1), np.float16), "hidden_states must be 2-D"),
    ("hidden_states", np.zeros((4, 16), np.float64), "hidden_states has dtype float64"),
    ("w_gate_up", np.zeros((3, 16, 16), np.float32), "w_gate_up has dtype float32; expected float16"),
    ("w_gate_up", np.zeros((3, 16, 12), np.float16), "last dim 12 != hidden size 16"),
    ("w_gate_up", np.zeros((3, 15, 16), np.float16), "positive even number, got 15"),
    ("w_gate_up", np.zeros((3, 0, 16), np.float16), "positive even number, got 0"),
    ("w_down", np.zeros((3, 8, 16), np.float16), r"w_down has shape \(3, 8, 16\); expected .* \[3, 16, 8\]"),
    ("w_down", np.zeros((2, 16, 8), np.float16), r"w_down has shape \(2, 16, 8\)"),
    ("topk_ids", np.zeros((4, 2), np.int64), "topk_ids has dtype int64; expected int32"),
    ("topk_ids", np.zeros((5, 2), np.int32), r"topk_ids has shape \(5, 2\); expected \[4, top_k >= 1\]"),
    ("topk_ids", np.zeros((4, 0), np.int32), r"topk_ids has shape \(4, 0\)"),
    ("topk_weights", np.zeros((4, 2), np.float16), "topk_weights has dtype float16; expected float32"),
    ("topk_weights", np.zeros((4, 3), np.float32), r"topk_weights has shape \(4, 3\); expected \[4, 2\]"),
    ("hidden_states", np.zeros((16, 4), np.float16).T, "hidden_states must be C-contiguous"),
]


@pytest.mark.parametrize("name, value, message", BAD_ARGUMENTS)
def test_bad_arrays_raise_value_error(name, value, message):
    args = _valid_args()
    args[name] = value
    with pytest.raises(ValueError, match=message):
        check_fused_experts_args(**args)


@pytest.mark.parametrize(
    "options, error, message",
    [
        (dict(activation="relu"), ValueError, "activation='relu'; expected one of"),
        (dict(block_size=48), ValueError, r"block_size=48; expected None .* \[16, 32, 64, 128\]"),
        (dict(apply_router_weight=1), TypeError, "apply_router_weight must be a bool, got 1"),
    ],
)
def test_bad_options(options, error, message):
    with pytest.raises(error, match=message):
        check_fused_experts_args(**_valid_args(), **options)


def test_not_an_array():
    args = _valid_args()
    args["topk_ids"] = [[0, 1]] * 4
    with pytest.raises(TypeError, match="topk_ids must be an array"):
        check_fused_experts_args(**args)


def test_fused_experts_refuses_host_arrays():
    with pytest.raises(TypeError, match="hidden_states must be a CuPy array or a torch CUDA tensor, got numpy.ndarray"):
        fused_experts(**_valid_args())


def test_fused_experts_refuses_cpu_tensors():
    args = {name: torch.from_numpy(value) for name, value in _valid_args().items()}
    with pytest.raises(TypeError, match="hidden_states is a torch tensor on cpu"):
        fused_experts(**args)


def test_fused_experts_checks_shapes_before_devices():
    args = {name: torch.from_numpy(value) for name, value in _valid_args().items()}
    args["w_down"] = torch.zeros((3, 8, 8), dtype=torch.float16)
    with pytest.raises(ValueError, match="w_down has shape"):
        fused_experts(**args)


@pytest.mark.parametrize("dtype, H, I", [("float32", 37, 23), ("bfloat16", 72, 40)])
def test_pipeline_with_biases_and_swigluoai(emulator, dtype, H, I):
    # The gpt-oss expert on the whole launch sequence against a plain NumPy definition.
    rng = np.random.default_rng(H)
    x, w_gate_up, w_down = random_problem(rng, 9, H, I, 4)
    w_gate_up = w_gate_up * 8.0  # products of a few units: the clamps at +-7 are reached
    topk_weights, topk_ids = routing(rng, 9, 4, 3)
    b_gate_up = (rng.standard_normal((4, 2 * I)) * 2.0).astype(np.float32)
    b_down = rng.standard_normal((4, H)).astype(np.float32)
    backend = HostBackend(emulator)
    problem = dataclasses.replace(
        check_fused_experts_args(
            x.astype(np.float32),
            w_gate_up.astype(np.float32),
            w_down.astype(np.float32),
            topk_weights,
            topk_ids,
            activation="swigluoai",
            gate_up_bias=b_gate_up,
            down_bias=b_down,
        ),
        dtype=dtype,
    )
    stored = [to_storage(v, dtype) for v in (x, w_gate_up, w_down, b_gate_up, b_down)]
    inputs = [backend.arrays.copy(v) for v in stored[:3]] + [
        backend.arrays.copy(topk_weights),
        backend.arrays.copy(topk_ids),
    ]
    out = backend.empty((9, H), dtype)
    run_fused_experts(
        backend,
        problem,
        *inputs,
        out,
        activation="swigluoai",
        gate_up_bias=backend.arrays.copy(stored[3]),
        down_bias=backend.arrays.copy(stored[4]),
    )
    backend.arrays.check_guards()
    xs, w13, w2, b13, b2 = (from_storage(v, dtype) for v in stored)
    expected = np.zeros((9, H))
    for t in range(9):
        for k in range(3):
            e = topk_ids[t, k]
            if e < 0:
                continue
            h = w13[e] @ xs[t] + b13[e]
            gate, up = np.minimum(h[:I], 7.0), np.clip(h[I:], -7.0, 7.0)
            inter = (up + 1.0) * gate / (1.0 + np.exp(-1.702 * gate))
            expected[t] += topk_weights[t, k] * (w2[e] @ inter + b2[e])
    # bfloat16 rounds the intermediate and each slot's output: allow a few of its ulps.
    scale = np.abs(expected).max()
    tolerance = 1e-5 if dtype == "float32" else 3e-2
    assert np.abs(from_storage(out, dtype) - expected).max() <= tolerance * scale


@pytest.mark.parametrize(
    "name, bias, words",
    [
        ("gate_up_bias", np.zeros((3, 15), np.float16), r"gate_up_bias has shape \(3, 15\); expected \[3, 16\]"),
        ("down_bias", np.zeros((3, 16), np.float32), "down_bias has dtype float32; expected float16"),
        ("down_bias", np.zeros(16, np.float16), "down_bias must be 2-D"),
    ],
)
def test_check_rejects_bad_biases(name, bias, words):
    with pytest.raises(ValueError, match=words):
        check_fused_experts_args(**_valid_args(), **{name: bias})
