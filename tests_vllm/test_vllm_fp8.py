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

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import quant_checkpoints  # noqa: E402
from test_vllm_plugin import _compare, _serve  # noqa: E402

NUM_EXPERTS = 16
MOE_LAYERS = ("model.layers.1.mlp.experts", "model.layers.2.mlp.experts")
#: Largest |moeroute - reference| / max |reference| per call, bfloat16 activations
#: (docs/quant.md's bound for bfloat16 FP8 experts).
LAYER_BOUND = 4e-2


@pytest.fixture(scope="session")
def served_fp8(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_fp8")
    fp8_dir, bf16_dir = str(root / "fp8"), str(root / "dequantized")
    quant_checkpoints.save_fp8_deepseek(fp8_dir, bf16_dir)
    on, on_log = _serve(root / "on.json", [fp8_dir], "--capture", VLLM_PLUGINS="moeroute")
    compiled, _ = _serve(root / "compiled.json", [fp8_dir], "--compiled", VLLM_PLUGINS="moeroute")
    dequantized, _ = _serve(root / "dequantized.json", [bf16_dir])
    return {
        "fp8": fp8_dir,
        "bf16": bf16_dir,
        "on": on,
        "on_log": on_log,
        "dequantized": dequantized,
        "compiled": compiled,
        "captured": torch.load(str(root / "on.json") + ".0.pt"),
    }


def test_vllm_alone_cannot_serve_it_here(tmp_path):
    """What vLLM CPU does with the checkpoint without the plugin, on a CPU without AMX."""
    if torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has AMX tiles: vLLM's own CPU FP8 experts may serve the checkpoint")
    fp8_dir = quant_checkpoints.save_fp8_deepseek(str(tmp_path / "fp8"))
    environment = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "MOEROUTE_VLLM")}
    done = subprocess.run(
        [sys.executable, str(HERE / "serve.py"), str(tmp_path / "off.json"), fp8_dir],
        env=environment,
        capture_output=True,
        text=True,
        timeout=900,
    )
    log = done.stdout + done.stderr
    assert done.returncode != 0, log[-3000:]
    assert "ValueError: Unsupported FP8 MoE backend: NONE" in log, log[-3000:]


def test_plugin_serves_the_fp8_layers(served_fp8):
    on = served_fp8["on"]
    counts = list(on[served_fp8["fp8"]]["counts"].values())
    assert len(counts) == len(MOE_LAYERS)
    assert all(c["method"] == "MoerouteFp8MoEMethod" and c["monolithic"] for c in counts), counts
    stats = on["stats"]
    assert stats["layers"] == stats["quantized_layers"] == len(MOE_LAYERS)
    assert stats.get("declined", 0) == 0
    assert stats["calls"] == sum(c["runner_calls"] for c in counts) > 0
    assert stats["tokens"] == sum(c["runner_rows"] for c in counts)
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
    from moeroute.config import RouterConfig
    from moeroute.quant.reference import moe_experts_reference
    from moeroute.routing.reference import select_experts

    calls = served_fp8["captured"][layer_name]
    assert len(calls) == served_fp8["on"]["stats"]["calls"] // len(MOE_LAYERS)
    with open(os.path.join(served_fp8["fp8"], "config.json")) as f:
        config = json.load(f)
    q_gate_up, gate_up_scale, q_down, down_scale, bias = _checkpoint_experts(served_fp8["fp8"], layer_name)
    errors = []
    for call in calls:
        assert torch.equal(call["bias"].float(), bias)
        # vLLM's DeepSeek-V3 hands the layer its routed_scaling_factor or applies it outside
        # the layer (per dtype); the layer's output follows the layer's value.
        assert call["routed_scaling_factor"] in (1.0, config["routed_scaling_factor"])
        router = RouterConfig(
            config["n_routed_experts"],
            config["num_experts_per_tok"],
            "sigmoid",
            num_expert_group=config["n_group"],
            topk_group=config["topk_group"],
            renormalize=config["norm_topk_prob"],
            routed_scaling_factor=call["routed_scaling_factor"],
        )
        weights, ids = select_experts(call["router_logits"].float().numpy(), router, bias.numpy())
        reference = moe_experts_reference(
            call["x"].float(),
            torch.from_numpy(weights),
            torch.from_numpy(ids),
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
    if run == "compiled":
        counts = served_fp8["compiled"][served_fp8["fp8"]]["counts"].values()
        assert all(c["method"] == "MoerouteFp8MoEMethod" and c["monolithic"] for c in counts)
        assert served_fp8["compiled"]["stats"]["quantized_layers"] == len(MOE_LAYERS)
    reference = served_fp8["dequantized"][served_fp8["bf16"]]["batches"][batch]
    candidate = served_fp8[run][served_fp8["fp8"]]["batches"][batch]
    assert len(reference) == len(candidate) == int(batch)
    compared = [_compare(r, c) for r, c in zip(reference, candidate)]
    assert all(n >= 1 for n in compared), compared
