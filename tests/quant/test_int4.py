"""INT4 (w4a16): QuantConfig's int4 fields and from_hf, quantize/dequantize, and the plain reference.

Expected values come from NumPy written here from the formula in docs/quant.md: nibbles
(element 2j in byte j's low nibble), ``w = (q - z) * s`` per row and group of g input
columns, z = 8 when symmetric, round to nearest (half to even) with s = amax / 7 or
(hi - lo) / 15 over the group's range widened to hold 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from moeroute.quant import QuantConfig, check_int4, dequantize_int4, quantize_int4
from moeroute.quant import int4 as int4_module
from moeroute.quant.reference import (
    int4_dequantize_reference,
    int4_expert_mlp_reference,
    int4_linear_reference,
    int4_moe_experts_reference,
)

ROOT = Path(__file__).resolve().parents[2]


def np_pack(q: np.ndarray) -> np.ndarray:
    """Bytes [..., K/2] of integers q [..., K]: byte j = q[2j] + 16 * q[2j + 1]."""
    q = q.astype(np.uint8)
    out = np.zeros((*q.shape[:-1], q.shape[-1] // 2), np.uint8)
    for j in range(q.shape[-1] // 2):
        out[..., j] = q[..., 2 * j] + 16 * q[..., 2 * j + 1]
    return out


def np_dequantize(q: np.ndarray, s: np.ndarray, z, g: int) -> np.ndarray:
    """float64 w [..., N, K] = (q - z) * s, group k // g."""
    z = np.full(s.shape, 8.0) if z is None else z.astype(np.float64)
    return (q.astype(np.float64) - np.repeat(z, g, axis=-1)) * np.repeat(s.astype(np.float64), g, axis=-1)


def np_quantize(w: np.ndarray, g: int, symmetric: bool):
    """Integers q, float64 scales and zero points per row and group, from the rule (float32 scales)."""
    groups = w.astype(np.float64).reshape(*w.shape[:-1], w.shape[-1] // g, g)
    if symmetric:
        s = np.abs(groups).max(-1) / 7
        z = np.full(s.shape, 8.0)
    else:
        lo = np.minimum(groups.min(-1), 0)
        s = (np.maximum(groups.max(-1), 0) - lo) / 15
    s = s.astype(np.float32).astype(np.float64)
    safe = np.where(s > 0, s, 1.0)
    if symmetric:
        q = np.clip(np.round(groups / safe[..., None]), -8, 7) + 8
    else:
        z = np.where(s > 0, np.clip(np.round(-lo / safe), 0, 15), 0)
        q = np.clip(np.round(groups / safe[..., None]) + z[..., None], 0, 15)
    q = np.where((s > 0)[..., None], q, z[..., None])
    return q.reshape(w.shape).astype(np.int64), s, z


# -- QuantConfig -------------------------------------------------------------------------------


def test_int4_config_fields_and_defaults():
    config = QuantConfig("int4")
    assert (config.format, config.group_size, config.symmetric) == ("int4", 128, True)
    assert (config.activation, config.block_size, config.checkpoint) == ("none", (1, 128), None)
    asym = QuantConfig("int4", group_size=32, symmetric=False)
    assert (asym.group_size, asym.symmetric, asym.block_size) == (32, False, (1, 32))
    assert QuantConfig("int4", group_size=64, block_size=(1, 64)).group_size == 64
    # The checkpoint layout is informational: equal configs whatever it says.
    assert QuantConfig("int4", group_size=32, checkpoint="gptq") == QuantConfig("int4", group_size=32)
    assert QuantConfig("int4", group_size=32) != QuantConfig("int4", group_size=64)
    assert QuantConfig("int4", symmetric=False) != QuantConfig("int4")
    assert QuantConfig("fp8_block").group_size is None and QuantConfig("mxfp4").symmetric is None


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(group_size=16), "group_size"),
        (dict(group_size=256), "group_size"),
        (dict(group_size="32"), "group_size"),
        (dict(group_size=True), "group_size"),
        (dict(symmetric="yes"), "symmetric"),
        (dict(symmetric=1), "symmetric"),
        (dict(checkpoint="marlin"), "checkpoint"),
        (dict(group_size=32, block_size=(1, 128)), "block_size"),
        (dict(activation="dynamic"), "activation"),
        (dict(scale_fmt="ue8m0"), "scale_fmt"),
    ],
)
def test_int4_config_refuses_bad_fields(kwargs, field):
    with pytest.raises(ValueError, match=field):
        QuantConfig("int4", **kwargs)


@pytest.mark.parametrize("field", ["group_size", "symmetric", "checkpoint"])
def test_int4_fields_refused_on_other_formats(field):
    value = {"group_size": 32, "symmetric": True, "checkpoint": "gptq"}[field]
    with pytest.raises(ValueError, match=field):
        QuantConfig("fp8_block", **{field: value})


def test_int4_scale_shapes_and_bytes():
    config = QuantConfig("int4", group_size=32)
    assert config.scale_shapes(4, 7168, 2048) == ((4, 4096, 224), (4, 7168, 64))
    # Kimi-K2's expert: 3*H*I nibbles plus a 16-bit scale per 32 weights.
    groups = 3 * 7168 * 2048 // 32
    assert config.expert_bytes(7168, 2048) == 3 * 7168 * 2048 // 2 + 2 * groups
    assert QuantConfig("int4", group_size=32, symmetric=False).expert_bytes(7168, 2048) == (
        3 * 7168 * 2048 // 2 + 3 * groups
    )
    with pytest.raises(ValueError, match="intermediate_size=100 is not a multiple of group_size=64"):
        QuantConfig("int4", group_size=64).scale_shapes(1, 128, 100)


KIMI_K2 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "input_activations": None,
            "output_activations": None,
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": 32,
                "dynamic": False,
                "actorder": None,
                "observer": "minmax",
            },
        }
    },
    "ignore": ["lm_head", "re:.*self_attn.*"],
    "kv_cache_scheme": None,
}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False, "damp_percent": 0.01}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}


def _ct(**weights):
    group = dict(KIMI_K2["config_groups"]["group_0"], weights={**KIMI_K2["config_groups"]["group_0"]["weights"]})
    group["weights"].update(weights)
    return {**KIMI_K2, "config_groups": {"group_0": group}}


def test_from_hf_compressed_tensors():
    config = QuantConfig.from_hf({"model_type": "kimi_k2", "quantization_config": KIMI_K2})
    assert config == QuantConfig("int4", group_size=32, symmetric=True)
    assert config.checkpoint == "compressed-tensors"
    assert config.modules_to_not_convert == ("lm_head", "re:.*self_attn.*")
    asym = QuantConfig.from_hf(_ct(symmetric=False, group_size=128, actorder="weight"))
    assert asym == QuantConfig("int4", group_size=128, symmetric=False)
    # A scheme's own "format" (mixed-format configs) is read too; two equal groups are one scheme.
    two = {**KIMI_K2, "format": None}
    scheme = {**KIMI_K2["config_groups"]["group_0"], "format": "pack-quantized"}
    two["config_groups"] = {"group_0": scheme, "group_1": scheme}
    assert QuantConfig.from_hf(two) == QuantConfig("int4", group_size=32)


def test_from_hf_gptq_and_awq(tmp_path):
    gptq = QuantConfig.from_hf(GPTQ)
    assert gptq == QuantConfig("int4", group_size=128) and gptq.checkpoint == "gptq"
    v2 = QuantConfig.from_hf({**GPTQ, "sym": False, "desc_act": True, "group_size": 64, "checkpoint_format": "gptq_v2"})
    assert v2 == QuantConfig("int4", group_size=64, symmetric=False) and v2.checkpoint == "gptq_v2"
    awq = QuantConfig.from_hf({**AWQ, "version": "GEMM", "modules_to_not_convert": ["gate"]})
    assert awq == QuantConfig("int4", group_size=128, symmetric=False)
    assert (awq.checkpoint, awq.modules_to_not_convert) == ("awq", ("gate",))
    # AutoAWQ's older key names.
    old = {"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": True, "version": "gemm"}
    assert QuantConfig.from_hf(old) == QuantConfig("int4", group_size=64, symmetric=False)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "quantization_config": GPTQ}))
    assert QuantConfig.from_hf(tmp_path) == QuantConfig("int4", group_size=128)


@pytest.mark.parametrize(
    "fields, match",
    [
        ({**KIMI_K2, "format": "float-quantized"}, "format='float-quantized'"),
        ({**KIMI_K2, "format": "naive-quantized"}, "format='naive-quantized'"),
        ({**KIMI_K2, "config_groups": {}}, "config_groups"),
        (_ct(num_bits=8), "num_bits=8"),
        (_ct(type="float"), "type='float'"),
        (_ct(strategy="channel"), "strategy='channel'"),
        (_ct(group_size=16), "group_size=16"),
        (_ct(group_size=None), "group_size=None"),
        (_ct(actorder="group"), "actorder='group'"),
        (_ct(dynamic=True), "dynamic"),
        (_ct(symmetric="yes"), "symmetric"),
        (
            {**KIMI_K2, "config_groups": {"g": {**KIMI_K2["config_groups"]["group_0"], "input_activations": {}}}},
            "input_activations",
        ),
        (
            {
                **KIMI_K2,
                "config_groups": {
                    "a": KIMI_K2["config_groups"]["group_0"],
                    "b": _ct(group_size=64)["config_groups"]["group_0"],
                },
            },
            "config_groups quantize weights differently",
        ),
        ({**GPTQ, "bits": 8}, "bits=8"),
        ({**GPTQ, "bits": 3}, "bits=3"),
        ({**GPTQ, "group_size": -1}, "group_size=-1"),
        ({**GPTQ, "checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
        ({**GPTQ, "sym": "true"}, "sym"),
        ({**GPTQ, "desc_act": None}, "desc_act"),
        ({**AWQ, "version": "gemv"}, "version='gemv'"),
        ({**AWQ, "zero_point": False}, "zero_point=False"),
        ({**AWQ, "bits": 8}, "bits=8"),
        ({**AWQ, "group_size": 48}, "group_size=48"),
        ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes'"),
    ],
)
def test_from_hf_refuses_other_int4_layouts_naming_the_field(fields, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace("[", r"\[")):
        QuantConfig.from_hf(fields)


def test_stacked_helpers_refuse_int4():
    """INT4 is quantized per weight (MoE serves it: tests/quant/test_int4_moe.py), never as FP8."""
    from moeroute.quant import dequantize_experts, quantize_experts

    config = QuantConfig("int4", group_size=32)
    with pytest.raises(ValueError, match="quantize_int4"):
        quantize_experts(torch.zeros(2, 128, 64), torch.zeros(2, 64, 64), config)
    with pytest.raises(ValueError, match="dequantize_int4"):
        dequantize_experts(None, None, None, None, config)


# -- quantize / dequantize -------------------------------------------------------------------------


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_quantize_matches_the_rule_exactly(symmetric, group):
    gen = torch.Generator().manual_seed(group + symmetric)
    w = torch.randn(3, 24, 256, generator=gen) * torch.rand(3, 24, 1, generator=gen)
    w[0, 0, :group] = 0  # an all-zero group: s = 0, q = z
    w[1, 2, group : 2 * group] = torch.rand(group, generator=gen) + 0.5  # all positive: the range holds 0
    out = quantize_int4(w, group_size=group, symmetric=symmetric, scale_dtype=torch.float32)
    q, s, z = np_quantize(w.numpy(), group, symmetric)
    assert len(out) == (2 if symmetric else 3)
    assert out[0].dtype == torch.uint8 and out[0].shape == (3, 24, 128)
    np.testing.assert_array_equal(out[0].numpy(), np_pack(q))
    np.testing.assert_array_equal(out[1].double().numpy(), s)
    if not symmetric:
        assert out[2].dtype == torch.uint8
        np.testing.assert_array_equal(out[2].numpy(), z)
    back = dequantize_int4(*out, group_size=group)
    assert back.dtype == torch.float32 and back.shape == w.shape
    np.testing.assert_allclose(back.numpy(), np_dequantize(q, s, None if symmetric else z, group), rtol=2**-23)
    # Within half a step of each value.
    step = np.repeat(s, group, axis=-1)
    assert np.all(np.abs(back.double().numpy() - w.double().numpy()) <= step / 2 * (1 + 1e-6) + 1e-30)
    assert float(back[0, 0, :group].abs().max()) == 0.0


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_grid_values_round_trip_exactly(scale_dtype):
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(-7, 8, (2, 8, 128), generator=gen)
    q[..., ::32] = 7  # every group of 32 reaches 7 * s
    s = 2.0 ** torch.randint(-8, 3, (2, 8, 4), generator=gen).double()
    w = (q.double() * s.repeat_interleave(32, -1)).float()
    packed, scales = quantize_int4(w, group_size=32, scale_dtype=scale_dtype)
    assert scales.dtype == scale_dtype
    np.testing.assert_array_equal(packed.numpy(), np_pack((q + 8).numpy()))
    torch.testing.assert_close(scales.double(), s, rtol=0, atol=0)
    torch.testing.assert_close(dequantize_int4(packed, scales, group_size=32), w, rtol=0, atol=0)


def test_bfloat16_scales_stay_within_a_step():
    """q is computed with the stored (rounded) scale: half a step symmetric, one step asymmetric."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(4, 16, 256, generator=gen, dtype=torch.bfloat16)
    for symmetric, bound in ((True, 0.5), (False, 1.0)):
        out = quantize_int4(w, group_size=64, symmetric=symmetric)
        assert out[1].dtype == torch.bfloat16
        back = dequantize_int4(*out, group_size=64)
        step = out[1].float().repeat_interleave(64, -1)
        assert bool(((back - w.float()).abs() <= bound * step + 1e-12).all())


def test_leading_dims_steps_and_strides_agree(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(3, 40, 128, generator=gen)
    whole = quantize_int4(w, group_size=32, symmetric=False)
    for e in range(3):
        one = quantize_int4(w[e], group_size=32, symmetric=False)
        for a, b in zip(one, whole):
            assert torch.equal(a, b[e])
    # A non-contiguous input, and steps of a few rows, give the same bits.
    monkeypatch.setattr(int4_module, "_STEP_ELEMENTS", 300)
    strided = quantize_int4(w.transpose(1, 2).contiguous().transpose(1, 2), group_size=32, symmetric=False)
    for a, b in zip(strided, whole):
        assert torch.equal(a, b)
    torch.testing.assert_close(
        dequantize_int4(*whole, group_size=32), dequantize_int4(*strided, group_size=32), rtol=0, atol=0
    )


def test_quantize_refuses_bad_input():
    with pytest.raises(ValueError, match="multiple of 64"):
        quantize_int4(torch.zeros(4, 96), group_size=64)
    with pytest.raises(ValueError, match="group_size=48"):
        quantize_int4(torch.zeros(4, 96), group_size=48)
    with pytest.raises(ValueError, match="symmetric"):
        quantize_int4(torch.zeros(4, 64), group_size=32, symmetric=None)
    with pytest.raises(ValueError, match="scale_dtype"):
        quantize_int4(torch.zeros(4, 64), group_size=32, scale_dtype=torch.int8)
    with pytest.raises(ValueError, match="float32/bfloat16"):
        quantize_int4(torch.zeros(4, 64, dtype=torch.int32), group_size=32)
    with pytest.raises(ValueError, match="at least 2 dims"):
        quantize_int4(torch.zeros(64), group_size=32)
    with pytest.raises(TypeError, match="torch.Tensor"):
        quantize_int4(np.zeros((4, 64)), group_size=32)
    w = torch.zeros(3, 4, 64)
    w[2, 1, 5] = float("nan")
    with pytest.raises(ValueError, match=r"w\[2\] holds inf or NaN"):
        quantize_int4(w, group_size=32)
    with pytest.raises(ValueError, match="overflows"):
        quantize_int4(torch.full((2, 32), 1e6), group_size=32, scale_dtype=torch.float16)


def test_check_and_dequantize_refuse_bad_tensors():
    packed, scales, zeros = quantize_int4(torch.randn(2, 8, 128), group_size=64, symmetric=False)
    check_int4(packed, scales, zeros, group_size=64)
    with pytest.raises(ValueError, match=r"scales has shape \(2, 8, 2\).*group_size=32 needs \[2, 8, 4\]"):
        dequantize_int4(packed, scales, group_size=32)
    with pytest.raises(ValueError, match="packed must be uint8"):
        dequantize_int4(packed.to(torch.int8), scales, group_size=64)
    with pytest.raises(ValueError, match="scales must be float32, bfloat16 or float16"):
        dequantize_int4(packed, scales.double(), group_size=64)
    with pytest.raises(ValueError, match="zeros has shape"):
        dequantize_int4(packed, scales, zeros[..., :1], group_size=64)
    with pytest.raises(ValueError, match="zeros must be uint8"):
        dequantize_int4(packed, scales, zeros.int(), group_size=64)
    bad = zeros.clone()
    bad[1, 3, 1] = 16
    with pytest.raises(ValueError, match=r"zeros\[1, 3, 1\] is 16"):
        dequantize_int4(packed, scales, bad, group_size=64)
    with pytest.raises(ValueError, match="not a multiple of group_size=128"):
        check_int4(packed[..., :32], scales[..., :1], group_size=128)


def test_check_int4_reads_zero_points_once_per_version(monkeypatch):
    scans = []
    scan = int4_module._scan_zeros
    monkeypatch.setattr(int4_module, "_scan_zeros", lambda zeros, name: scans.append(name) or scan(zeros, name))
    packed, scales, zeros = quantize_int4(torch.randn(2, 8, 128), group_size=64, symmetric=False)
    for _ in range(3):
        check_int4(packed, scales, zeros, group_size=64)
    assert len(scans) == 1
    zeros[1, 3, 1] = 16  # in place: torch bumps the version, so the values are read again
    for _ in range(2):  # a failed check remembers nothing
        with pytest.raises(ValueError, match=r"zeros\[1, 3, 1\] is 16"):
            check_int4(packed, scales, zeros, group_size=64)
    assert len(scans) == 3
    zeros[1, 3, 1] = 15
    check_int4(packed, scales, zeros, group_size=64)
    check_int4(packed, scales, zeros, group_size=64)
    assert len(scans) == 4
    held = torch.nn.Parameter(zeros.clone(), requires_grad=False)
    check_int4(packed, scales, held, group_size=64)
    held.data = torch.full_like(zeros, 16)  # new data under the same parameter
    with pytest.raises(ValueError, match=r"zeros\[0, 0, 0\] is 16"):
        check_int4(packed, scales, held, group_size=64)
    with torch.inference_mode():  # no version counter: read every time
        fresh = zeros.clone()
    before = len(scans)
    check_int4(packed, scales, fresh, group_size=64)
    check_int4(packed, scales, fresh, group_size=64)
    assert len(scans) == before + 2


# -- the reference ---------------------------------------------------------------------------------


def test_reference_dequantize_and_linear():
    gen = torch.Generator().manual_seed(4)
    q = torch.randint(0, 16, (12, 64), generator=gen)
    z = torch.randint(0, 16, (12, 2), generator=gen)
    s = torch.rand(12, 2, generator=gen, dtype=torch.float64).to(torch.bfloat16)
    packed = torch.from_numpy(np_pack(q.numpy()))
    expected = np_dequantize(q.numpy(), s.double().numpy(), z.numpy(), 32)
    np.testing.assert_array_equal(int4_dequantize_reference(packed, s, z.to(torch.uint8), 32).numpy(), expected)
    sym = np_dequantize(q.numpy(), s.double().numpy(), None, 32)
    np.testing.assert_array_equal(int4_dequantize_reference(packed, s, None, 32).numpy(), sym)
    x = torch.randn(5, 64, generator=gen)
    y = int4_linear_reference(x, packed, s, z.to(torch.uint8), group_size=32)
    np.testing.assert_allclose(y.numpy(), x.double().numpy() @ expected.T, rtol=1e-6, atol=1e-6)


def test_reference_expert_mlp_and_moe():
    gen = torch.Generator().manual_seed(5)
    experts, hidden, inter, tokens = 3, 64, 96, 6
    w_gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) / 8
    w_down = torch.randn(experts, hidden, inter, generator=gen) / 8
    gate_up = quantize_int4(w_gate_up, group_size=32, symmetric=False)
    down = quantize_int4(w_down, group_size=32)
    fg, fd = dequantize_int4(*gate_up, group_size=32).double(), dequantize_int4(*down, group_size=32).double()
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.tensor([[0, 2], [1, 0], [2, 2], [0, 1], [1, 2], [7, 0]])  # 7: not an expert here, skipped
    weights = torch.rand(tokens, 2, generator=gen)
    expected = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for k in range(2):
            e = int(ids[t, k])
            if e >= experts:
                continue
            h = fg[e] @ x[t].double()
            act = torch.nn.functional.silu(h[:inter]) * h[inter:]
            expected[t] += float(weights[t, k]) * (fd[e] @ act)
    one = int4_expert_mlp_reference(x[:1], tuple(t[0] for t in gate_up), tuple(t[0] for t in down), 32)
    torch.testing.assert_close(
        one[0].double(),
        (fd[0] @ (torch.nn.functional.silu((fg[0] @ x[0].double())[:inter]) * (fg[0] @ x[0].double())[inter:])),
        rtol=1e-5,
        atol=1e-5,
    )
    out = int4_moe_experts_reference(x, weights, ids, gate_up, down, 32)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


# -- memory ----------------------------------------------------------------------------------------

PEAK_CODE = textwrap.dedent("""
    import json, resource, sys
    import torch
    from moeroute.quant import quantize_int4

    def resident():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()

    def peak_resident():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

    experts, rows, cols = 16, 1024, 1024
    w = torch.randn(experts, rows, cols, generator=torch.Generator().manual_seed(0))
    quantize_int4(w[:1, :32], group_size=32, symmetric=False)  # torch's one-time set-up
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = resident()
    out = quantize_int4(w, group_size=32, symmetric=False)
    print(json.dumps({"extra": peak_resident() - before, "output": sum(t.nbytes for t in out)}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads and resets the peak resident size")
def test_quantize_peak_memory_is_bounded_by_one_expert():
    # 4 KB pages for NumPy's temporaries and a fixed glibc mmap threshold: with transparent
    # huge pages a temporary's resident size rounds up to 2 MB pages when the kernel has them
    # free, and glibc's threshold moves after each large free, so the same code's peak moved
    # by up to an expert between runs
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        NUMPY_MADVISE_HUGEPAGE="0",
        MALLOC_MMAP_THRESHOLD_="131072",
    )
    done = subprocess.run(
        [sys.executable, "-c", PEAK_CODE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    expert = 1024 * 1024 * 4  # one float32 expert
    # Beyond the outputs (about 0.6 byte a weight), one step's temporaries (about 8 MB: float64
    # values and codes of 2**18 elements) and the allocator's slack: under three experts' floats,
    # where a whole-stack float64 copy alone would be 32.
    assert report["extra"] - report["output"] < 3 * expert, report
