"""MXFP4: QuantConfig("mxfp4"), from_hf, and quantize/dequantize against a plain reference.

The reference below decodes byte by byte in Python from the format's definition (low nibble
= even element, e2m1 table, 2 ** (s - 127)) and shares nothing with moeroute.quant.mxfp4.
"""

from __future__ import annotations

import math

import pytest
import torch

from moeroute.quant import QuantConfig, dequantize_experts, dequantize_mxfp4, quantize_experts, quantize_mxfp4

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]

GPT_OSS = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def reference_dequantize(blocks, scales):
    """Plain Python: one byte at a time."""
    rows, groups, _ = blocks.shape
    out = torch.zeros(rows, groups * 32, dtype=torch.float64)
    for r in range(rows):
        for g in range(groups):
            scale = 2.0 ** (int(scales[r, g]) - 127)
            for j in range(16):
                byte = int(blocks[r, g, j])
                out[r, g * 32 + 2 * j] = E2M1[byte & 15] * scale
                out[r, g * 32 + 2 * j + 1] = E2M1[byte >> 4] * scale
    return out


def local_step(magnitude):
    """Spacing of the e2m1 grid interval holding ``magnitude`` (in units of the scale)."""
    for low, high in zip(GRID, GRID[1:]):
        if magnitude <= high:
            return high - low
    return 2.0


# ------------------------------------------------------------------------------ config


def test_config_defaults_and_shapes():
    config = QuantConfig("mxfp4")
    assert (config.block_size, config.activation) == ((1, 32), "none")
    assert config.scale_shapes(3, 64, 96) == ((3, 192, 2), (3, 64, 3))
    # 3*H*I nibbles (half a byte each) plus one scale byte per 32 of them.
    assert config.expert_bytes(64, 96) == 3 * 64 * 96 // 2 + 3 * 64 * 96 // 32
    assert QuantConfig("fp8_block").activation == "dynamic"  # the FP8 defaults are unchanged


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(format="mxfp4", block_size=(1, 64)), "block_size"),
        (dict(format="mxfp4", activation="dynamic"), "activation"),
        (dict(format="fp8_tensor", activation="none"), "activation"),  # fp8_block takes "none" (w8a16)
    ],
)
def test_config_invalid_fields_are_named(kwargs, field):
    with pytest.raises(ValueError, match=field):
        QuantConfig(**kwargs)


def test_scale_shapes_need_multiples_of_32():
    with pytest.raises(ValueError, match="intermediate_size=40"):
        QuantConfig("mxfp4").scale_shapes(2, 64, 40)


def test_from_hf_gpt_oss():
    expected = QuantConfig("mxfp4", modules_to_not_convert=tuple(GPT_OSS["modules_to_not_convert"]))
    assert QuantConfig.from_hf(GPT_OSS) == expected
    assert QuantConfig.from_hf({"model_type": "gpt_oss", "quantization_config": GPT_OSS}) == expected
    with pytest.raises(ValueError, match="awq"):
        QuantConfig.from_hf({"quant_method": "awq"})


# ----------------------------------------------------------------- hand-computed bytes


def test_dequantize_hand_computed_bytes():
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x72  # element 0: code 2 (1.0), element 1: code 7 (6.0)
    blocks[0, 0, 1] = 0xF9  # element 2: code 9 (-0.5), element 3: code 15 (-6.0)
    blocks[0, 0, 15] = 0x0D  # element 30: code 13 (-3.0), element 31: code 0
    scales = torch.tensor([[129]], dtype=torch.uint8)  # 2 ** 2
    expected = torch.zeros(1, 32)
    expected[0, :4] = torch.tensor([4.0, 24.0, -2.0, -24.0])
    expected[0, 30] = -12.0
    assert torch.equal(dequantize_mxfp4(blocks, scales), expected)
    # Scale byte 0 is 2**-127 (a float32 subnormal), exactly.
    assert dequantize_mxfp4(blocks, torch.zeros(1, 1, dtype=torch.uint8))[0, 0].item() == 2.0**-127


def test_quantize_hand_computed_bytes():
    w = torch.zeros(1, 32)
    w[0, :6] = torch.tensor([3.0, -1.5, 0.25, 0.8, -12.0, 5.0])
    # amax 12: e = ceil(log2(12 / 6)) = 1, byte 128; w / 2 = 1.5, -0.75, 0.125, 0.4, -6, 2.5
    # -> codes 3, 10 (tie -0.75 goes to even code 2 -> 1.0, sign 8), 0, 1, 15, 4 (tie 2.5 -> 2).
    blocks, scales = quantize_mxfp4(w)
    assert scales.tolist() == [[128]]
    assert blocks[0, 0, :3].tolist() == [3 | (10 << 4), 0 | (1 << 4), 15 | (4 << 4)]
    assert blocks[0, 0, 3:].tolist() == [0] * 13
    # An all-zero block: scale byte 0, codes 0.
    zero_blocks, zero_scales = quantize_mxfp4(torch.zeros(2, 64))
    assert zero_scales.tolist() == [[0, 0], [0, 0]] and not zero_blocks.any()


@pytest.mark.parametrize(
    "amax, byte", [(6.0, 127), (6.0001, 128), (3.0, 126), (3.5, 127), (0.75, 124), (0.7, 124), (1e-30, 127 - 102)]
)
def test_scale_exponent(amax, byte):
    """byte = 127 + ceil(log2(amax / 6)), at and around powers of two."""
    w = torch.zeros(1, 32)
    w[0, 5] = amax
    _, scales = quantize_mxfp4(w)
    assert int(scales[0, 0]) == byte
    assert byte == 127 + math.ceil(math.log2(torch.tensor(amax).item() / 6))


# --------------------------------------------------------------------- round trips


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_within_half_a_step(device, dtype):
    generator = torch.Generator().manual_seed(0)
    w = (torch.randn(3, 8, 128, generator=generator) * torch.logspace(-3, 3, 8)[None, :, None]).to(dtype)
    blocks, scales = quantize_mxfp4(w.to(device))
    assert blocks.shape == (3, 8, 4, 16) and scales.shape == (3, 8, 4)
    assert blocks.dtype == scales.dtype == torch.uint8
    got = dequantize_mxfp4(blocks, scales).cpu().double()
    reference = torch.stack([reference_dequantize(blocks[e].cpu(), scales[e].cpu()) for e in range(3)])
    assert torch.equal(got, reference)
    w64 = w.double()
    scale = (2.0 ** (scales.cpu().double() - 127)).repeat_interleave(32, dim=-1)
    steps = torch.tensor(
        [local_step(v) for v in (w64.abs() / scale).reshape(-1).tolist()], dtype=torch.float64
    ).reshape(w.shape)
    assert bool(((got - w64).abs() <= steps * scale / 2).all())
    # The scale is the smallest power of two fitting amax onto 6.
    amax = w64.reshape(3, 8, 4, 32).abs().amax(-1)
    s = 2.0 ** (scales.cpu().double() - 127)
    assert bool((amax <= 6 * s).all()) and bool((amax > 3 * s).all())


@pytest.mark.parametrize("device", DEVICES)
def test_round_trip_exact_on_grid(device):
    generator = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (4, 6, 64), generator=generator)
    exponents = torch.randint(-20, 20, (4, 6, 2), generator=generator).repeat_interleave(32, dim=-1)
    w = torch.tensor(E2M1)[codes] * torch.pow(2.0, exponents.float())
    blocks, scales = quantize_mxfp4(w.to(device))
    assert torch.equal(dequantize_mxfp4(blocks, scales).cpu(), w)


def test_experts_helpers_use_mxfp4():
    generator = torch.Generator().manual_seed(2)
    w_gate_up, w_down = torch.randn(2, 128, 64, generator=generator), torch.randn(2, 64, 64, generator=generator)
    config = QuantConfig("mxfp4")
    quantized = quantize_experts(w_gate_up, w_down, config)
    assert [tuple(t.shape) for t in quantized] == [(2, 128, 2, 16), (2, 128, 2), (2, 64, 2, 16), (2, 64, 2)]
    gate_up, down = dequantize_experts(*quantized, config)
    assert torch.equal(gate_up, dequantize_mxfp4(*quantize_mxfp4(w_gate_up)))
    assert torch.equal(down, dequantize_mxfp4(*quantize_mxfp4(w_down)))


# --------------------------------------------------------------------------- errors


def test_errors():
    blocks, scales = quantize_mxfp4(torch.randn(4, 64))
    with pytest.raises(ValueError, match="scales has shape"):
        dequantize_mxfp4(blocks, scales[:, :1])
    with pytest.raises(ValueError, match=r"blocks has shape"):
        dequantize_mxfp4(blocks[..., :8], scales)
    bad = scales.clone()
    bad[2, 1] = 255
    with pytest.raises(ValueError, match=r"scales\[2, 1\] is 255"):
        dequantize_mxfp4(blocks, bad)
    with pytest.raises(ValueError, match="dtype torch.float32"):
        dequantize_mxfp4(blocks.float(), scales)
    with pytest.raises(ValueError, match="scales has dtype"):
        dequantize_mxfp4(blocks, scales.float())
    with pytest.raises(TypeError, match="blocks must be a torch.Tensor"):
        dequantize_mxfp4(blocks.numpy(), scales)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.randn(4, 48))
    with pytest.raises(ValueError, match="float32/bfloat16"):
        quantize_mxfp4(torch.ones(4, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="at least 2 dims"):
        quantize_mxfp4(torch.ones(32))
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_mxfp4(torch.full((1, 32), float("inf")))
