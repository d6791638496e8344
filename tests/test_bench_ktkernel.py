"""bench/ktkernel.py's parts that need no kt-kernel: the GGUF Q8_0 / Q4_0 packers against a
block-by-block reference written from ggml's block definitions, the MXFP4 scale widening, the
error measure, and the binding of moeroute's experts to given routing."""

from __future__ import annotations

import math
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import ktkernel  # noqa: E402


def _round_away(v: float) -> int:
    """C's roundf: halves away from zero."""
    r = math.floor(abs(v))
    if abs(v) - r >= 0.5:
        r += 1
    return int(math.copysign(r, v)) if r else 0


def q8_0_block(x) -> bytes:
    """ggml's block_q8_0 {ggml_half d; int8_t qs[32]} of 32 floats (quantize_row_q8_0_ref)."""
    x = [np.float32(v) for v in x]
    amax = max(abs(v) for v in x)
    d = np.float32(amax / np.float32(127))
    inv = np.float32(1) / d if d else np.float32(0)
    qs = [_round_away(float(np.float32(v * inv))) for v in x]
    return struct.pack("<e", float(d)) + struct.pack("<32b", *qs)


def q4_0_block(x) -> bytes:
    """ggml's block_q4_0 {ggml_half d; uint8_t qs[16]} of 32 floats (quantize_row_q4_0_ref):
    element j in the low nibble of byte j, element j + 16 in its high nibble."""
    x = [np.float32(v) for v in x]
    amax, m = np.float32(0), np.float32(0)
    for v in x:
        if amax < abs(v):
            amax, m = abs(v), v
    d = np.float32(m / np.float32(-8))
    inv = np.float32(1) / d if d else np.float32(0)
    q = [min(15, int(np.float32(np.float32(v * inv) + np.float32(8.5)))) for v in x]
    return struct.pack("<e", float(d)) + bytes(q[j] | (q[j + 16] << 4) for j in range(16))


def _weights(rows=6, cols=96, seed=0):
    w = (np.random.default_rng(seed).standard_normal((rows, cols)) * 0.02).astype(np.float32)
    w[0, :32] = 0  # an all-zero block: d = 0
    w[1, :32] = 0.5  # ties in the largest magnitude
    w[2, 32:64] = np.linspace(-1, 1, 32)  # exact halves after scaling
    w[3, :32] *= 1e4
    return w


@pytest.mark.parametrize(
    "pack, block, size",
    [
        (ktkernel.quantize_q8_0, q8_0_block, ktkernel.Q8_0_BLOCK_BYTES),
        (ktkernel.quantize_q4_0, q4_0_block, ktkernel.Q4_0_BLOCK_BYTES),
    ],
)
def test_gguf_packers_match_ggml_blocks_byte_for_byte(pack, block, size):
    w = _weights()
    packed = pack(w)
    assert packed.dtype == np.uint8 and packed.shape == (w.shape[0], w.shape[1] // 32 * size)
    expected = b"".join(block(w[r, c : c + 32]) for r in range(w.shape[0]) for c in range(0, w.shape[1], 32))
    assert packed.tobytes() == expected
    # Leading dimensions are kept (experts x rows x blocks).
    assert np.array_equal(pack(w.reshape(2, 3, -1)).reshape(packed.shape), packed)


def test_gguf_dequantize_is_within_a_step_of_the_floats():
    w = _weights()
    for pack, unpack, step in (
        (ktkernel.quantize_q8_0, ktkernel.dequantize_q8_0, 0.5),
        (ktkernel.quantize_q4_0, ktkernel.dequantize_q4_0, 1.0),
    ):
        packed = pack(w)
        blocks = packed.reshape(w.shape[0], w.shape[1] // 32, -1)
        d = np.abs(blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))
        scale = np.repeat(d, 32, axis=1)
        error = np.abs(unpack(packed, w.shape[1]) - w)
        # One quantization step (Q4_0: the top code is 7 of 8), plus float16 rounding of d.
        assert np.all(error <= step * scale * (1 + 1e-3) + 8 * scale * 2**-10 + 1e-12)
        assert np.array_equal(unpack(packed, w.shape[1])[0, :32], np.zeros(32, np.float32))


def test_gguf_packers_refuse_a_width_off_the_block():
    with pytest.raises(ValueError, match="multiple of 32"):
        ktkernel.quantize_q8_0(np.zeros((2, 48), np.float32))


def test_ue8m0_scales_widen_to_their_power_of_two_in_bfloat16():
    codes = torch.arange(255, dtype=torch.uint8)
    widened = ktkernel.ue8m0_to_bfloat16(codes)
    assert widened.dtype == torch.bfloat16
    expected = torch.tensor([2.0 ** (c - 127) for c in range(255)], dtype=torch.float64)
    assert torch.equal(widened.double(), expected)


def test_relative_error_is_max_difference_over_max_reference():
    ref = torch.tensor([[1.0, -4.0], [2.0, 0.0]])
    out = torch.tensor([[1.5, -4.0], [2.0, -1.0]])
    assert ktkernel.relative_error(out, ref) == pytest.approx(1.0 / 4.0)


def test_bytes_per_weight_count_the_scales():
    assert ktkernel.BYTES_PER_WEIGHT["q8_0"] == 34 / 32
    assert ktkernel.BYTES_PER_WEIGHT["q4_0"] == 18 / 32
    assert ktkernel.BYTES_PER_WEIGHT["mxfp4"] == 17 / 32
    assert ktkernel.BYTES_PER_WEIGHT["fp8_block"] == 1 + 4 / 128**2


def test_llamafile_refuses_intermediate_sizes_off_256():
    assert ktkernel.llamafile_refusal(ktkernel.SHAPES["qwen3_30b_a3b"]) is None
    assert "256" in ktkernel.llamafile_refusal(ktkernel.SHAPES["gpt_oss_20b"])


def test_check_failures_name_the_case_out_of_bounds():
    case = {"method": "FP8", "error": 0.5, "difference_to_moeroute": 0.01}
    payload = {"results": {"s": {"fp8_block": [{"tokens": 8, "moeroute_error": 0.05, "kt": {"fp8_block": case}}]}}}
    assert ktkernel.check_failures(payload) == ["s T=8 kt fp8_block: error 0.5"]
    case["error"] = 0.05
    assert ktkernel.check_failures(payload) == []


def test_experts_call_runs_the_module_experts_on_the_given_routing():
    """The bound call equals the float reference layer on the selection it was given."""
    shape = dict(hidden=64, inter=32, experts=4, top_k=2)
    w_gate_up, w_down = ktkernel.float_weights(shape)
    router_w = ktkernel.router_weight(shape)
    x, logits, weights, ids = ktkernel.inputs(shape, 5, router_w)
    module = ktkernel.moeroute_layer(shape, "bf16", w_gate_up, w_down, router_w)
    out = ktkernel.experts_call(module, x, ids, weights)()
    ref = ktkernel.reference_layer(x, ids, weights, w_gate_up.bfloat16(), w_down.bfloat16())
    assert out.shape == (5, 64)
    assert ktkernel.relative_error(out, ref) < 2e-2
    with torch.no_grad():
        assert torch.allclose(out.float(), module(x, logits).float(), rtol=0, atol=1e-6)


def test_the_mxfp4_packer_writes_moeroutes_bytes():
    from moeroute.quant import quantize_mxfp4

    w = torch.randn(3, 8, 128, generator=torch.Generator().manual_seed(0)) * 0.02
    w[0, 0, :32] = 0  # an all-zero block
    w[0, 1, :32] = -0.0
    grid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)
    w[1, 0, :32] = grid  # every tie between e2m1 values
    w[1, 1, :32] = -grid * 2.0**-20
    w[2, 0, :32] *= 1e30
    blocks, scales = ktkernel.quantize_mxfp4_numba(w)
    expected_blocks, expected_scales = quantize_mxfp4(w)
    assert blocks.shape == expected_blocks.shape and scales.shape == expected_scales.shape
    assert torch.equal(blocks, expected_blocks)
    assert torch.equal(scales, expected_scales)


def test_the_report_tabulates_each_pair_and_says_what_did_not_run(tmp_path):
    import json

    from bench import report

    machine = {"date": "2030-01-02T00:00:00+00:00", "cpu_model": "X", "isa": "avx2", "cpu_count": 2}
    case = {"method": "FP8", "moeroute_us": 1500.0, "kt_us": 3000.0, "speedup": 2.0, "speedup_range": [1.5, 2.5]}
    case.update(repeats=3, error=0.05)
    payload = {
        "machine": machine,
        "kt_kernel": {"version": "0.7.2", "cpu_variant": "avx2", "moe_classes": {"fp8_block": "AVX2FP8_MOE"}},
        "threads": 2,
        "activation": "silu",
        "activation_dtype": "bfloat16",
        "shapes": {"s": {"hidden": 256, "inter": 384, "experts": 6, "top_k": 3}},
        "bytes_per_weight": ktkernel.BYTES_PER_WEIGHT,
        "results": {"s": {"fp8_block": [{"tokens": 8, "moeroute_error": 0.06, "kt": {"fp8_block": case}}]}},
        "not_run": {"s": {"q8_0": "LLAMAFILE needs I to be a multiple of 256 (QK_K); I = 384"}},
        "loadavg_per_shape": {"s": [[1.0, 1.0, 1.0], [3.0, 2.0, 1.0]]},
    }
    (tmp_path / "ktkernel.json").write_text(json.dumps(payload))
    page = report.render(tmp_path)
    assert "| FP8 block 128x128 | FP8 | 8 | 1.50 ms | 3.00 ms | 2.00x (1.50-2.50) | 6.0e-02 | 5.0e-02 |" in page
    assert "`avx2` extension" in page and "`AVX2FP8_MOE`" in page
    assert "(load average 1.0/1.0/1.0 before, 3.0/2.0/1.0 after):" in page
    assert "Not run: kt-kernel GGUF Q8_0 (LLAMAFILE needs I to be a multiple of 256 (QK_K); I = 384)." in page


# -- INT4: moeroute's layout against kt-kernel's RAWINT4 and GPTQ_INT4 -----------------------


def _int4_weight(rows=6, cols=128, seed=0):
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.02
    w[0, :32] = 0  # an all-zero group: s = 0, every code 8
    s = 2.0**-6  # exact in bfloat16: the group below has amax = 7 s and every tie k s / 2
    w[1, :32] = torch.tensor([7.0, -7.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5] * 4) * s
    w[2, 32:64] *= 1e3
    return w


def test_the_int4_packer_writes_moeroutes_bytes():
    from moeroute.quant import quantize_int4

    w = torch.stack([_int4_weight(seed=0), _int4_weight(seed=1)])
    for group in (32, 128):
        packed, scales = ktkernel.quantize_int4_numba(w, group)
        expected_packed, expected_scales = quantize_int4(w, group_size=group, symmetric=True)
        assert packed.shape == (2, 6, 64) and scales.shape == (2, 6, 128 // group)
        assert scales.dtype == torch.bfloat16
        assert torch.equal(packed, expected_packed)
        assert torch.equal(scales, expected_scales)
    with pytest.raises(ValueError, match="multiple of group_size=128"):
        ktkernel.quantize_int4_numba(torch.zeros(2, 96), 128)


def _codes(packed: torch.Tensor) -> list[list[int]]:
    """The 0..15 codes of moeroute's rows, element 2j in byte j's low nibble."""
    return [[(byte >> (4 * (k % 2))) & 0xF for byte in row.tolist() for k in (0, 1)] for row in packed]


def test_rawint4_is_the_compressed_tensors_words_as_bytes():
    """kt-kernel's RAWINT4 loader views compressed-tensors' pack-quantized int32 words (q + 8,
    element i of a word at bits 4i) as bytes: the converter gives those bytes."""
    from moeroute.quant import quantize_int4

    packed, scales = quantize_int4(_int4_weight(), group_size=32)
    codes = _codes(packed)
    words = [
        sum(row[8 * w + i] << (4 * i) for i in range(8)) for row in codes for w in range(len(row) // 8)
    ]  # pack_to_int32, unsigned
    expected = struct.pack(f"<{len(words)}I", *words)
    raw, raw_scales = ktkernel.int4_to_rawint4(packed, scales.float())
    assert raw.dtype == torch.uint8 and raw.shape == packed.shape
    assert raw.numpy().tobytes() == expected
    assert raw_scales.dtype == torch.bfloat16 and torch.equal(raw_scales, scales)
    with pytest.raises(ValueError, match="bfloat16 cannot represent"):
        ktkernel.int4_to_rawint4(packed, scales.float() + 2.0**-20)


def test_gptq_repacking_against_the_plain_definition():
    """GPTQ's qweight[i, n] holds input column 8i + j of output row n at bits 4j (int32 [K/8, N]),
    scales [K/g, N]; with zero point 8 its weights are moeroute's dequantized ones."""
    from moeroute.quant import dequantize_int4, quantize_int4

    group = 32
    packed, scales = quantize_int4(_int4_weight(), group_size=group)
    codes = _codes(packed)
    n, k = len(codes), len(codes[0])
    qweight, gptq_scales = ktkernel.int4_to_gptq(packed, scales.float())
    assert qweight.dtype == torch.int32 and qweight.shape == (k // 8, n)
    assert gptq_scales.dtype == torch.float32 and gptq_scales.shape == (k // group, n)
    words = [[sum(codes[r][8 * i + j] << (4 * j) for j in range(8)) for r in range(n)] for i in range(k // 8)]
    assert qweight.numpy().view(np.uint32).tolist() == words
    assert torch.equal(gptq_scales, scales.float().T)
    unpacked = torch.tensor(
        [[((words[c // 8][r] >> (4 * (c % 8))) & 0xF) - 8 for c in range(k)] for r in range(n)],
        dtype=torch.float32,
    ) * gptq_scales.T.repeat_interleave(group, dim=1)
    assert torch.equal(unpacked, dequantize_int4(packed, scales, group_size=group))
    with pytest.raises(ValueError, match="uint8"):
        ktkernel.int4_to_gptq(packed.to(torch.int32), scales)


def test_kt_int4_tensors_hand_kt_kernel_the_modules_own_bytes():
    shape = dict(hidden=64, inter=32, experts=3, top_k=2)
    w_gate_up, w_down = ktkernel.float_weights(shape)
    module = ktkernel.moeroute_layer(shape, "int4", w_gate_up, w_down, ktkernel.router_weight(shape), 32)
    experts = module.experts
    gates, ups, downs, gate_s, up_s, down_s = ktkernel.kt_int4_tensors("int4", module, 32)
    for e in range(3):
        # RAWINT4 reads moeroute's packed bytes in place: gate rows first, then up.
        assert gates[e].data_ptr() == experts.w_gate_up[e].data_ptr()
        assert ups[e].data_ptr() == experts.w_gate_up[e, 32:].data_ptr()
        assert downs[e].data_ptr() == experts.w_down[e].data_ptr()
        assert all(t.is_contiguous() for t in (gates[e], ups[e], downs[e], gate_s[e], up_s[e], down_s[e]))
        assert torch.equal(gate_s[e].float(), experts.gate_up_scale[e, :32])
        assert torch.equal(down_s[e].float(), experts.down_scale[e])
    gates, ups, downs, gate_s, up_s, down_s = ktkernel.kt_int4_tensors("int4_gptq", module, 32)
    assert gates[0].shape == (64 // 8, 32) and downs[0].shape == (32 // 8, 64) and up_s[0].shape == (2, 32)
    assert torch.equal(ups[1], ktkernel.int4_to_gptq(experts.w_gate_up[1, 32:], experts.gate_up_scale[1, 32:])[0])


def test_shapes_run_their_widths_and_a_partial_run_merges_by_t():
    assert ktkernel.shape_groups("qwen3_30b_a3b") == ("fp8_block", "bf16", "mxfp4", "int4")
    assert ktkernel.shape_groups("kimi_k2_experts") == ("int4",)
    assert ktkernel.shape_groups("deepseek_v3_experts", ["int4"]) == ()
    assert ktkernel.int4_fields("kimi_k2_experts") == {"int4_group_size": 32}
    assert ktkernel.int4_fields("qwen3_30b_a3b") == {"int4_group_size": 128}
    assert ktkernel.int4_fields("gpt_oss_20b") == {}
    earlier = {"a": {"bf16": [{"tokens": 1, "v": 0}, {"tokens": 8, "v": 0}]}, "b": {"bf16": [{"tokens": 1, "v": 0}]}}
    merged = ktkernel.merge_results(earlier, {"a": {"bf16": [{"tokens": 8, "v": 1}], "int4": [{"tokens": 1, "v": 2}]}})
    assert merged == {
        "a": {"bf16": [{"tokens": 1, "v": 0}, {"tokens": 8, "v": 1}], "int4": [{"tokens": 1, "v": 2}]},
        "b": {"bf16": [{"tokens": 1, "v": 0}]},
    }
    assert earlier["a"]["bf16"][1] == {"tokens": 8, "v": 0}  # the earlier payload is left as it was


def test_the_report_names_the_int4_group_and_the_kt_class_that_ran(tmp_path):
    import json

    from bench import report

    machine = {"date": "2030-01-02T00:00:00+00:00", "cpu_model": "X", "isa": "avx512bf16", "cpu_count": 2}
    case = {"method": "RAWINT4", "kt_class": "AMXInt4_KGroup_MOE", "moeroute_us": 1000.0, "kt_us": 1500.0}
    case.update(speedup=1.5, speedup_range=[1.2, 1.8], repeats=3, error=0.1)
    entry = {"tokens": 1, "moeroute_error": 0.1, "group_size": 32, "kt": {"int4": case}}
    kt = {"version": "0.7.2", "cpu_variant": "avx512_bf16", "moe_classes": {"bf16": "AMXBF16_MOE"}}
    kt["int4_classes"] = {"int4": {"32": "AMXInt4_KGroup_MOE", "128": "AVXVNNI256RawInt4_MOE"}}
    payload = {
        "machine": machine,
        "kt_kernel": kt,
        "threads": 2,
        "shapes": {"kimi_k2_experts": {"hidden": 7168, "inter": 2048, "experts": 16, "top_k": 8}},
        "bytes_per_weight": ktkernel.BYTES_PER_WEIGHT,
        "results": {"kimi_k2_experts": {"int4": [entry]}},
        "loadavg_per_format": {"kimi_k2_experts": {"int4": [[1.0, 1.0, 1.0], [2.0, 1.0, 1.0]]}},
    }
    (tmp_path / "ktkernel.json").write_text(json.dumps(payload))
    page = report.render(tmp_path)
    assert "| INT4 g32 | RAWINT4 (`AMXInt4_KGroup_MOE`) | 1 | 1.00 ms | 1.50 ms | 1.50x (1.20-1.80) |" in page
    assert "RAWINT4 at group 32: `AMXInt4_KGroup_MOE`, RAWINT4 at group 128: `AVXVNNI256RawInt4_MOE`" in page
    assert "Load average per format: INT4 1.0/1.0/1.0 before, 2.0/1.0/1.0 after." in page
    assert "INT4 g32 (bfloat16 scales) 0.5625" in page


def test_every_kt_method_has_a_name_a_bound_and_a_label():
    from bench import report

    for fmt, kt_formats in ktkernel.GROUPS:
        assert fmt in ktkernel.CHECK_ERROR and fmt in report._KT_LABELS
        for kt_fmt in kt_formats:
            assert kt_fmt in ktkernel.KT_METHODS and kt_fmt in ktkernel.CHECK_ERROR and kt_fmt in report._KT_LABELS
            if kt_fmt in ktkernel.SAME_CODES:
                assert kt_fmt in ktkernel.CHECK_DIFFERENCE
    assert [kt for fmt, kts in ktkernel.GROUPS if fmt == "int4" for kt in kts] == ["int4", "int4_gptq", "int4_amx"]
