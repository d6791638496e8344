"""QuantConfig: its fields, their validation, and reading Hugging Face quantization configs."""

from __future__ import annotations

import json

import pytest

from moeroute.quant import QuantConfig

DEEPSEEK_V3 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def test_defaults_per_format():
    block = QuantConfig("fp8_block")
    assert (block.block_size, block.activation, block.scale_fmt) == ((128, 128), "dynamic", "float")
    assert block.activation_group_size == 128
    tensor = QuantConfig("fp8_tensor")
    assert tensor.block_size is None and tensor.activation_group_size is None
    assert QuantConfig("fp8_block", block_size=[64, 128]).block_size == (64, 128)


def test_scale_shapes():
    # gate and up keep their own block rows: 2 * ceil(200 / 64) = 8 rows, not ceil(400 / 64) = 7.
    assert QuantConfig("fp8_block", block_size=(64, 128)).scale_shapes(3, 300, 200) == ((3, 8, 3), (3, 5, 2))
    assert QuantConfig("fp8_tensor").scale_shapes(3, 300, 200) == ((3, 2), (3,))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(format="int8"), "format"),
        (dict(format="fp8_block", block_size=(0, 128)), "block_size"),
        (dict(format="fp8_block", block_size=(128,)), "block_size"),
        (dict(format="fp8_block", block_size=(128.0, 128)), "block_size"),
        (dict(format="fp8_tensor", block_size=(128, 128)), "block_size"),
        (dict(format="fp8_block", activation="static"), "activation"),
        (dict(format="fp8_tensor", activation="per_channel"), "activation"),
        (dict(format="fp8_block", scale_fmt="e8m0"), "scale_fmt"),
        (dict(format="fp8_block", modules_to_not_convert="lm_head"), "modules_to_not_convert"),
    ],
)
def test_invalid_fields_are_named(kwargs, field):
    with pytest.raises(ValueError, match=field):
        QuantConfig(**kwargs)


def test_from_hf_deepseek_v3_mapping_and_whole_config():
    expected = QuantConfig("fp8_block", block_size=(128, 128))
    assert QuantConfig.from_hf(DEEPSEEK_V3) == expected
    assert QuantConfig.from_hf({"model_type": "deepseek_v3", "quantization_config": DEEPSEEK_V3}) == expected
    v31 = QuantConfig.from_hf({**DEEPSEEK_V3, "scale_fmt": "ue8m0"})
    assert v31 == QuantConfig("fp8_block", scale_fmt="ue8m0")


def test_from_hf_per_tensor_and_static():
    config = QuantConfig.from_hf(
        {"quant_method": "fp8", "activation_scheme": "static", "modules_to_not_convert": ["lm_head"]}
    )
    assert config == QuantConfig("fp8_tensor", activation="static", modules_to_not_convert=("lm_head",))


def test_from_hf_paths(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {"model_type": "deepseek_v3", "quantization_config": {**DEEPSEEK_V3, "weight_block_size": [64, 128]}}
        )
    )
    expected = QuantConfig("fp8_block", block_size=(64, 128))
    assert QuantConfig.from_hf(tmp_path) == expected
    assert QuantConfig.from_hf(str(tmp_path / "config.json")) == expected


@pytest.mark.interop
def test_from_hf_transformers_config():
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV3Config(num_hidden_layers=1, quantization_config=dict(DEEPSEEK_V3))
    assert QuantConfig.from_hf(config) == QuantConfig("fp8_block")
    assert QuantConfig.from_hf(transformers.DeepseekV3Config(num_hidden_layers=1)) is None


def test_from_hf_unquantized_is_none():
    assert QuantConfig.from_hf({"model_type": "qwen3_moe"}) is None


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"quant_method": "awq"}, "quant_method='awq'"),
        ({**DEEPSEEK_V3, "fmt": "e5m2"}, "fmt='e5m2'"),
        ({**DEEPSEEK_V3, "activation_scheme": "static"}, "activation"),
    ],
)
def test_from_hf_refuses_what_it_cannot_serve(fields, match):
    with pytest.raises(ValueError, match=match):
        QuantConfig.from_hf(fields)


def test_expert_bytes():
    # DeepSeek-V3: 3 * 7168 * 2048 one-byte weights + 4 bytes x (2*16*56 + 56*16) block scales.
    assert QuantConfig("fp8_block").expert_bytes(7168, 2048) == 3 * 7168 * 2048 + 4 * (2 * 16 * 56 + 56 * 16)
    assert QuantConfig("fp8_tensor").expert_bytes(7168, 2048) == 3 * 7168 * 2048 + 4 * 3
    # Partial blocks count whole: I = 200 in 128-row blocks -> 2 block rows each for gate and up.
    assert QuantConfig("fp8_block").expert_bytes(256, 200) == 3 * 256 * 200 + 4 * (2 * 2 * 2 + 2 * 2)


def test_cli_plan_reports_fp8_bytes_per_rank(capsys):
    from moeroute.cli import main

    assert main(["plan", "--preset", "deepseek-v3", "--ep", "8", "--quant", "fp8_block"]) == 0
    out = capsys.readouterr().out
    per_expert = QuantConfig("fp8_block").expert_bytes(7168, 2048)
    # 256 routed experts / 8 ranks + 1 fused shared slot per rank = 33 experts per rank.
    line = f"  rank 7: 33 experts, {33 * per_expert / 2**30:.2f} GiB fp8_block ({33 * 3 * 7168 * 2048 * 2 / 2**30:.2f} GiB bfloat16)"
    assert line in out.splitlines()
