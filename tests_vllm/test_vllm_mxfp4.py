"""A gpt-oss MXFP4 checkpoint served by vLLM CPU through the plugin.

The tiny gpt-oss of `quant_checkpoints` (attention sinks, sliding and full attention, 8
experts top-2 with biases and gpt-oss's clamped SwiGLU) keeps its experts as gpt-oss
publishes them: MXFP4 blocks and scale bytes, gate_up rows interleaved, and
``quantization_config`` ``{"quant_method": "mxfp4", ...}``. On x86 CPUs without AMX, vLLM CPU
alone cannot build the model: choosing the MoE method raises NotImplementedError "No MXFP4
MoE backend supports the deployment configuration" (its CPU MXFP4 experts need AMX; its
emulation backend needs the amd-quark package). With the plugin, moeroute's MXFP4 experts
run on the bytes vLLM loaded.

Checked against two references:

* layer by layer: every call of each MoE layer (input rows, router logits, output captured
  inside vLLM) against the gpt-oss MLP written out below in float64 on the checkpoint's bytes
  decoded by `moeroute.quant.dequantize_mxfp4` (interleaved rows read as gpt-oss defines
  them, softmax top-2 renormalized, clamped SwiGLU with alpha 1.702 and limit 7, biases);
* end to end: greedy tokens against vLLM serving the same model with the experts dequantized
  to bfloat16 (exact: every MXFP4 value is a bfloat16), identical except after a step where
  that run's top-2 log-probabilities are within `TIE`.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import quant_checkpoints  # noqa: E402
from quant_serving import assert_greedy_tokens_match, assert_plugin_served, serve_quantized, vllm_alone_log  # noqa: E402

MOE_LAYERS = ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")
NUM_EXPERTS, TOP_K = 8, 2
ALPHA, LIMIT = 1.702, 7.0
#: Largest |moeroute - reference| / max |reference| per call with bfloat16 activations
#: (docs/quant.md's bound for the MXFP4 layer).
LAYER_BOUND = 2e-2


METHOD = "MoerouteMxfp4MoEMethod"


@pytest.fixture(scope="session")
def served_mxfp4(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_mxfp4")
    mxfp4_dir, bf16_dir = str(root / "mxfp4"), str(root / "dequantized")
    quant_checkpoints.save_mxfp4_gpt_oss(mxfp4_dir, bf16_dir)
    return serve_quantized(root, "mxfp4", mxfp4_dir, bf16_dir)


def test_vllm_alone_cannot_serve_it_here(tmp_path):
    """What vLLM CPU does with the checkpoint without the plugin, on a CPU without AMX."""
    if torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has AMX tiles: vLLM's own CPU MXFP4 experts may serve the checkpoint")
    log = vllm_alone_log(tmp_path / "off.json", quant_checkpoints.save_mxfp4_gpt_oss(str(tmp_path / "mxfp4")))
    assert "NotImplementedError: No MXFP4 MoE backend supports the deployment configuration" in log, log[-3000:]


def test_plugin_serves_the_mxfp4_layers(served_mxfp4):
    assert_plugin_served(served_mxfp4["on"], served_mxfp4["mxfp4"], METHOD, len(MOE_LAYERS))
    assert "mxfp4 swigluoai experts" in served_mxfp4["on_log"]


def _gpt_oss_moe_reference(x, router_logits, blocks_and_biases):
    """float64 [T, H]: gpt-oss's MoE on the checkpoint's MXFP4 bytes (interleaved gate/up)."""
    from moeroute.quant import dequantize_mxfp4

    gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales, down_bias = blocks_and_biases
    w_gate_up = dequantize_mxfp4(gate_up_blocks, gate_up_scales).double()  # [E, 2I, H], rows gate, up, ...
    w_down = dequantize_mxfp4(down_blocks, down_scales).double()  # [E, H, I]
    b_gate_up, b_down = gate_up_bias.double(), down_bias.double()
    # top-k with ties to the lower expert id (moeroute's rule; torch.topk's order among equal
    # values is unspecified, and bfloat16 router logits do tie)
    ordered = torch.sort(router_logits.float(), dim=1, descending=True, stable=True)
    top, ids = ordered.values[:, :TOP_K], ordered.indices[:, :TOP_K]
    weights = torch.softmax(top.double(), dim=1)
    x = x.double()
    out = torch.zeros_like(x)
    for k in range(TOP_K):
        for e in range(NUM_EXPERTS):
            rows = (ids[:, k] == e).nonzero().reshape(-1)
            if rows.numel() == 0:
                continue
            gate = x[rows] @ w_gate_up[e, 0::2].T + b_gate_up[e, 0::2]
            up = x[rows] @ w_gate_up[e, 1::2].T + b_gate_up[e, 1::2]
            gate, up = gate.clamp(max=LIMIT), up.clamp(-LIMIT, LIMIT)
            act = (up + 1) * gate * torch.sigmoid(ALPHA * gate)
            out[rows] += weights[rows, k, None] * (act @ w_down[e].T + b_down[e])
    return out


@pytest.mark.parametrize("layer_name", MOE_LAYERS)
def test_layer_outputs_match_the_gpt_oss_reference(served_mxfp4, layer_name):
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(served_mxfp4["mxfp4"], "model.safetensors"))
    weights = tuple(
        tensors[f"{layer_name}.{name}"]
        for name in (
            "gate_up_proj_blocks",
            "gate_up_proj_scales",
            "gate_up_proj_bias",
            "down_proj_blocks",
            "down_proj_scales",
            "down_proj_bias",
        )
    )
    calls = served_mxfp4["captured"][layer_name]
    assert len(calls) == served_mxfp4["on"]["stats"]["calls"] // len(MOE_LAYERS)
    errors = []
    for call in calls:
        reference = _gpt_oss_moe_reference(call["x"], call["router_logits"], weights)
        assert call["out"].shape == reference.shape and call["out"].dtype == torch.bfloat16
        errors.append(float((call["out"].double() - reference).abs().max() / reference.abs().max()))
    assert max(errors) <= LAYER_BOUND, errors


@pytest.mark.parametrize("run", ["on", "compiled"])
@pytest.mark.parametrize("batch", ["1", "4"])
def test_greedy_tokens_match_the_dequantized_model(served_mxfp4, batch, run):
    # "compiled": vLLM's torch.compile (enforce_eager=False) with the plugin's MXFP4 layers
    # inside the graph (torch.ops.moeroute.experts on the packed bytes, an opaque custom op).
    assert_greedy_tokens_match(served_mxfp4, "mxfp4", METHOD, len(MOE_LAYERS), batch, run)
