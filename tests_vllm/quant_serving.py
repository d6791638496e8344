"""What the quantized-checkpoint tests (test_vllm_fp8, test_vllm_int4, test_vllm_mxfp4) share:
serving a checkpoint with and without the plugin, and the checks every format makes of the
runs (which method served the layers, the greedy tokens against the dequantized model)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from test_vllm_plugin import _compare, _serve  # noqa: E402


def serve_quantized(root: Path, name: str, quant_dir: str, bf16_dir: str | None = None) -> dict:
    """The checkpoint at ``quant_dir`` served with the plugin (each MoE layer's calls captured:
    "on", "on_log", "captured"); with ``bf16_dir`` (the same model dequantized) also under vLLM's
    torch.compile with the plugin ("compiled") and the dequantized model without it
    ("dequantized"). ``name`` -> ``quant_dir`` and "bf16" -> ``bf16_dir`` name the runs' specs."""
    on, on_log = _serve(root / "on.json", [quant_dir], "--capture", VLLM_PLUGINS="moeroute")
    served = {name: quant_dir, "on": on, "on_log": on_log}
    if bf16_dir is not None:
        served["compiled"], _ = _serve(root / "compiled.json", [quant_dir], "--compiled", VLLM_PLUGINS="moeroute")
        served["dequantized"], _ = _serve(root / "dequantized.json", [bf16_dir])
        served["bf16"] = bf16_dir
    served["captured"] = torch.load(str(root / "on.json") + ".0.pt")
    return served


def vllm_alone_log(out_path: Path, quant_dir: str) -> str:
    """The log of vLLM CPU serving ``quant_dir`` without the plugin, which must fail."""
    environment = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "MOEROUTE_VLLM")}
    done = subprocess.run(
        [sys.executable, str(HERE / "serve.py"), str(out_path), quant_dir],
        env=environment,
        capture_output=True,
        text=True,
        timeout=900,
    )
    log = done.stdout + done.stderr
    assert done.returncode != 0, log[-3000:]
    return log


def assert_plugin_served(run: dict, spec: str, method: str, layers: int, whole: bool = True) -> list:
    """Every one of the ``layers`` MoE layers of ``spec`` served by the plugin's ``method``
    (monolithic); with ``whole``, the run's stats count every call and token row of them and
    nothing declined. Returns the layers' counts."""
    counts = list(run[spec]["counts"].values())
    assert len(counts) == layers
    assert all(c["method"] == method and c["monolithic"] for c in counts), counts
    stats = run["stats"]
    assert stats["quantized_layers"] == layers
    if whole:
        assert stats["layers"] == layers
        assert stats.get("declined", 0) == 0
        assert stats["calls"] == sum(c["runner_calls"] for c in counts) > 0
        assert stats["tokens"] == sum(c["runner_rows"] for c in counts)
    return counts


def assert_greedy_tokens_match(served: dict, name: str, method: str, layers: int, batch: str, run: str) -> None:
    """The greedy tokens of ``run`` ("on", or "compiled" after checking the compiled run served
    its layers with ``method``) are the dequantized model's, but after a tie (`_compare`)."""
    if run == "compiled":
        assert_plugin_served(served["compiled"], served[name], method, layers, whole=False)
    reference = served["dequantized"][served["bf16"]]["batches"][batch]
    candidate = served[run][served[name]]["batches"][batch]
    assert len(reference) == len(candidate) == int(batch)
    compared = [_compare(r, c) for r, c in zip(reference, candidate)]
    assert all(n >= 1 for n in compared), compared


def read_config(checkpoint_dir: str) -> dict:
    with open(os.path.join(checkpoint_dir, "config.json")) as f:
        return json.load(f)


def deepseek_routing(config: dict, call: dict, bias: torch.Tensor):
    """(weights, ids) of one captured call of a DeepSeek-V3 layer (``config``: its
    config.json) by the NumPy reference router, after checking the call's correction bias,
    with the routed_scaling_factor the layer was handed (vLLM's DeepSeek-V3 hands the layer
    its own or applies it outside the layer, per dtype)."""
    from moeroute.config import RouterConfig
    from moeroute.routing.reference import select_experts

    assert torch.equal(call["bias"].float(), bias)
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
    return torch.from_numpy(weights), torch.from_numpy(ids)
