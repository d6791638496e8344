"""An FP8 block-scaled DeepSeek-V3 checkpoint served by vLLM CPU through the plugin.

The tiny DeepSeek-V3 of `quant_checkpoints` (MLA, sigmoid grouped routing with a correction
bias, a shared expert) has its routed experts in float8_e4m3fn with 128 x 128 block scales
under DeepSeek-V3's names and ``quantization_config``. On x86 CPUs without AMX, vLLM CPU
alone cannot serve it: its FP8 MoE backend selection finds no kernel (vLLM's CPU FP8 experts
need AMX) and loading raises "Unsupported FP8 MoE backend: NONE". With the plugin,
moeroute's FP8 experts run on the weights and scales vLLM loaded.

Checked against two references:

* layer by layer: every call of each served MoE layer (its input rows, router logits and
  output captured inside vLLM) against moeroute's plain-torch w8a8 reference
  (`moeroute.quant.reference.moe_experts_reference`, the checkpoint's FP8 bytes and scales,
  routing from the NumPy reference `moeroute.routing.reference.select_experts`);
* end to end: greedy tokens against vLLM serving the same model with those experts
  dequantized to bfloat16 (the values q * scale_inv), identical except after a step where
  that run's top-2 log-probabilities are within `TIE`; eager, and with vLLM's torch.compile.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import quant_checkpoints  # noqa: E402
from quant_serving import (  # noqa: E402
    assert_greedy_tokens_match,
    assert_plugin_served,
    deepseek_routing,
    read_config,
    serve_quantized,
    vllm_alone_log,
)

NUM_EXPERTS = 16
MOE_LAYERS = ("model.layers.1.mlp.experts", "model.layers.2.mlp.experts")
#: Largest |moeroute - reference| / max |reference| per call, bfloat16 activations
#: (docs/quant.md's bound for bfloat16 FP8 experts).
LAYER_BOUND = 4e-2


METHOD = "MoerouteFp8MoEMethod"


@pytest.fixture(scope="session")
def served_fp8(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_fp8")
    fp8_dir, bf16_dir = str(root / "fp8"), str(root / "dequantized")
    quant_checkpoints.save_fp8_deepseek(fp8_dir, bf16_dir)
    return serve_quantized(root, "fp8", fp8_dir, bf16_dir)


def test_vllm_alone_cannot_serve_it_here(tmp_path):
    """What vLLM CPU does with the checkpoint without the plugin, on a CPU without AMX."""
    if torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has AMX tiles: vLLM's own CPU FP8 experts may serve the checkpoint")
    log = vllm_alone_log(tmp_path / "off.json", quant_checkpoints.save_fp8_deepseek(str(tmp_path / "fp8")))
    assert "ValueError: Unsupported FP8 MoE backend: NONE" in log, log[-3000:]


def test_plugin_serves_the_fp8_layers(served_fp8):
    counts = assert_plugin_served(served_fp8["on"], served_fp8["fp8"], METHOD, len(MOE_LAYERS))
    # The shared expert: computed by vLLM's runner once per token row.
    assert all(c["has_shared"] and c["shared_rows"] == c["runner_rows"] for c in counts), counts
    assert "fp8_block 128x128 silu experts" in served_fp8["on_log"]


def _checkpoint_experts(fp8_dir, layer_name):
    """The layer's FP8 experts as stored: q_gate_up [N, 2I, H], gate_up_scale [N, 2, 1], q_down,
    down_scale, and the correction bias, read from the safetensors file."""
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(fp8_dir, "model.safetensors"))
    prefix = layer_name.rsplit(".experts", 1)[0]

    def stack(projections, suffix):
        return torch.stack(
            [
                torch.cat([tensors[f"{prefix}.experts.{e}.{p}.{suffix}"] for p in projections])
                for e in range(NUM_EXPERTS)
            ]
        )

    return (
        stack(("gate_proj", "up_proj"), "weight"),
        stack(("gate_proj", "up_proj"), "weight_scale_inv"),
        stack(("down_proj",), "weight"),
        stack(("down_proj",), "weight_scale_inv"),
        tensors[f"{prefix}.gate.e_score_correction_bias"].float(),
    )


@pytest.mark.parametrize("layer_name", MOE_LAYERS)
def test_layer_outputs_match_the_w8a8_reference(served_fp8, layer_name):
    from moeroute.quant.reference import moe_experts_reference

    calls = served_fp8["captured"][layer_name]
    assert len(calls) == served_fp8["on"]["stats"]["calls"] // len(MOE_LAYERS)
    config = read_config(served_fp8["fp8"])
    q_gate_up, gate_up_scale, q_down, down_scale, bias = _checkpoint_experts(served_fp8["fp8"], layer_name)
    errors = []
    for call in calls:
        # the layer's output follows the routed_scaling_factor the layer was handed
        weights, ids = deepseek_routing(config, call, bias)
        reference = moe_experts_reference(
            call["x"].float(),
            weights,
            ids,
            q_gate_up,
            gate_up_scale,
            q_down,
            down_scale,
            block_size=quant_checkpoints.BLOCK,
            intermediate_dtype=torch.bfloat16,
        )
        assert call["out"].shape == reference.shape and call["out"].dtype == torch.bfloat16
        errors.append(float((call["out"].float() - reference).abs().max() / reference.abs().max()))
    assert max(errors) <= LAYER_BOUND, errors


@pytest.mark.parametrize("run", ["on", "compiled"])
@pytest.mark.parametrize("batch", ["1", "4"])
def test_greedy_tokens_match_the_dequantized_model(served_fp8, batch, run):
    # "compiled": vLLM's torch.compile (enforce_eager=False) with the plugin's FP8 layers
    # inside the graph (torch.ops.moeroute.experts is an opaque custom op with a fake kernel).
    assert_greedy_tokens_match(served_fp8, "fp8", METHOD, len(MOE_LAYERS), batch, run)
