"""A compressed-tensors W4A16 DeepSeek-V3 checkpoint (Kimi-K2's format) served by vLLM CPU
through the plugin.

The tiny DeepSeek-V3 of `quant_checkpoints` (MLA, sigmoid grouped routing with a correction
bias, a shared expert) has its routed experts as Kimi-K2-Thinking publishes its own:
``pack-quantized`` INT4, symmetric, groups of 32 input columns, bfloat16 scales, under
``weight_packed`` / ``weight_scale`` / ``weight_shape`` and a compressed-tensors
``quantization_config`` (everything else bfloat16). On x86 CPUs without AMX, vLLM CPU alone
cannot build the model: choosing the MoE method raises NotImplementedError "No WNA16 MoE
backend supports the deployment configuration" (its CPU INT4 experts need AMX; its DA8W4 path
is off by default). With the plugin, vLLM loads the words and scales into its stacked
buffers and moeroute's INT4 experts run on them (the words repacked once into moeroute's
bytes).

Checked against two references:

* layer by layer: every call of each served MoE layer (input rows, router logits, output
  captured inside vLLM) against a float64 MoE written out below on the checkpoint's words
  decoded here from the published layout (routing from the NumPy reference
  `moeroute.routing.reference.select_experts`);
* end to end: greedy tokens against vLLM serving the same model with the experts dequantized
  to bfloat16 (exact: the scales carry 5 significant bits, so each q * scale is a bfloat16),
  identical except after a step where that run's top-2 log-probabilities are within `TIE`;
  eager, and with vLLM's torch.compile.

The asymmetric form (``"symmetric": false``, each weight's ``weight_zero_point`` packed
along its rows) is served too and checked layer by layer against the same float64 MoE on
``(q - zp) * scale``.

The shared expert is vLLM's runner's with INT4 routed experts as with float ones: its calls
and rows are counted in both runs and must be equal.
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
#: Largest |moeroute - reference| / max |reference| per call, bfloat16 activations (the
#: layer's intermediate and output rounded to bfloat16: 2 ** -8 relative each).
LAYER_BOUND = 2e-2


METHOD = "MoerouteInt4MoEMethod"


@pytest.fixture(scope="session")
def served_int4_asymmetric(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_int4_asymmetric")
    int4_dir = quant_checkpoints.save_int4_deepseek(str(root / "int4"), symmetric=False)
    return serve_quantized(root, "int4", int4_dir)


@pytest.fixture(scope="session")
def served_int4(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_int4")
    int4_dir, bf16_dir = str(root / "int4"), str(root / "dequantized")
    quant_checkpoints.save_int4_deepseek(int4_dir, bf16_dir)
    return serve_quantized(root, "int4", int4_dir, bf16_dir)


def test_vllm_alone_cannot_serve_it_here(tmp_path):
    """What vLLM CPU does with the checkpoint without the plugin, on a CPU without AMX."""
    if torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has AMX tiles: vLLM's own CPU INT4 experts may serve the checkpoint")
    log = vllm_alone_log(tmp_path / "off.json", quant_checkpoints.save_int4_deepseek(str(tmp_path / "int4")))
    assert "Using CompressedTensorsWNA16MoEMethod" in log, log[-3000:]
    assert "NotImplementedError: No WNA16 MoE backend supports the deployment configuration" in log, log[-3000:]


def test_plugin_serves_the_int4_layers(served_int4):
    assert_plugin_served(served_int4["on"], served_int4["int4"], METHOD, len(MOE_LAYERS))
    assert "int4 (groups of 32, symmetric) silu experts; shared expert: runner" in served_int4["on_log"]


def test_shared_expert_calls_are_the_float_models(served_int4):
    """The shared MLP runs as often, on as many rows, with INT4 routed experts (moeroute's)
    as with float ones (vLLM's own, on the dequantized model): once per token row."""
    int4 = served_int4["on"][served_int4["int4"]]["counts"]
    floats = served_int4["dequantized"][served_int4["bf16"]]["counts"]
    assert sorted(int4) == sorted(floats) and len(int4) == len(MOE_LAYERS)
    for name, c in int4.items():
        f = floats[name]
        assert c["has_shared"] and f["has_shared"]
        assert f["method"] == "UnquantizedFusedMoEMethod"
        assert (c["shared_calls"], c["shared_rows"]) == (f["shared_calls"], f["shared_rows"]), (c, f)
        assert c["shared_calls"] == c["runner_calls"] > 0 and c["shared_rows"] == c["runner_rows"], c


def _decode(packed, scale, shape, zero_point=None):
    """float64 [N, K] of one compressed-tensors pack-quantized weight, from the published
    layout: column k's q + 8 in bits 4 * (k % 8) of word k // 8, W = q * scale per group;
    asymmetric, W = (q - zp) * scale with row n's zp + 8 in bits 4 * (n % 8) of word n // 8
    of ``zero_point``."""
    rows, cols = (int(v) for v in shape)
    words = packed.to(torch.int64) & 0xFFFFFFFF
    nibbles = (words[:, :, None] >> (4 * torch.arange(8))) & 0xF
    q = nibbles.reshape(rows, -1)[:, :cols].double() - 8
    group = cols // scale.shape[1]
    if zero_point is not None:
        zp_words = zero_point.to(torch.int64) & 0xFFFFFFFF
        zp = ((zp_words[:, None, :] >> (4 * torch.arange(8))[:, None]) & 0xF).reshape(-1, scale.shape[1])[:rows]
        q = q - (zp.double() - 8).repeat_interleave(group, dim=1)
    return q * scale.double().repeat_interleave(group, dim=1)


def _checkpoint_experts(int4_dir, layer_name):
    """The layer's experts decoded from the file: W_gate_up [N, 2I, H] (gate rows first),
    W_down [N, H, I], and the correction bias."""
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(int4_dir, "model.safetensors"))
    prefix = layer_name.rsplit(".experts", 1)[0]

    def weight(e, p):
        key = f"{prefix}.experts.{e}.{p}"
        return _decode(
            tensors[key + ".weight_packed"],
            tensors[key + ".weight_scale"],
            tensors[key + ".weight_shape"],
            tensors.get(key + ".weight_zero_point"),
        )

    gate_up = torch.stack([torch.cat([weight(e, "gate_proj"), weight(e, "up_proj")]) for e in range(NUM_EXPERTS)])
    down = torch.stack([weight(e, "down_proj") for e in range(NUM_EXPERTS)])
    return gate_up, down, tensors[f"{prefix}.gate.e_score_correction_bias"].float()


def _moe_reference(x, ids, weights, w_gate_up, w_down):
    """float64 [T, H]: sum_k weights[t, k] * down_e(silu(gate_e x) * up_e x)."""
    x = x.double()
    inter = w_down.shape[2]
    out = torch.zeros_like(x)
    for k in range(ids.shape[1]):
        for e in range(NUM_EXPERTS):
            rows = (ids[:, k] == e).nonzero().reshape(-1)
            if rows.numel() == 0:
                continue
            h = x[rows] @ w_gate_up[e].T
            act = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
            out[rows] += weights[rows, k, None].double() * (act @ w_down[e].T)
    return out


@pytest.mark.parametrize("layer_name", MOE_LAYERS)
def test_layer_outputs_match_the_float64_reference(served_int4, layer_name):
    _check_layer_outputs(served_int4, layer_name)


def test_plugin_serves_the_asymmetric_int4_layers(served_int4_asymmetric):
    served = served_int4_asymmetric
    assert_plugin_served(served["on"], served["int4"], METHOD, len(MOE_LAYERS), whole=False)
    assert "int4 (groups of 32, asymmetric) silu experts; shared expert: runner" in served["on_log"]


@pytest.mark.parametrize("layer_name", MOE_LAYERS)
def test_asymmetric_layer_outputs_match_the_float64_reference(served_int4_asymmetric, layer_name):
    _check_layer_outputs(served_int4_asymmetric, layer_name)


def _check_layer_outputs(served, layer_name):
    calls = served["captured"][layer_name]
    assert len(calls) == served["on"]["stats"]["calls"] // len(MOE_LAYERS)
    config = read_config(served["int4"])
    w_gate_up, w_down, bias = _checkpoint_experts(served["int4"], layer_name)
    errors = []
    for call in calls:
        weights, ids = deepseek_routing(config, call, bias)
        reference = _moe_reference(call["x"], ids, weights, w_gate_up, w_down)
        assert call["out"].shape == reference.shape and call["out"].dtype == torch.bfloat16
        errors.append(float((call["out"].double() - reference).abs().max() / reference.abs().max()))
    assert max(errors) <= LAYER_BOUND, errors


@pytest.mark.parametrize("run", ["on", "compiled"])
@pytest.mark.parametrize("batch", ["1", "4"])
def test_greedy_tokens_match_the_dequantized_model(served_int4, batch, run):
    # "compiled": vLLM's torch.compile (enforce_eager=False) with the plugin's INT4 layers
    # inside the graph (torch.ops.moeroute.experts with quant_format="int4", an opaque custom op).
    assert_greedy_tokens_match(served_int4, "int4", METHOD, len(MOE_LAYERS), batch, run)
