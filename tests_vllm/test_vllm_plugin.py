"""moeroute as vLLM's MoE backend, end to end on vLLM's CPU build (``make test-vllm``).

Tiny random Qwen3-MoE, Qwen2-MoE (gated shared expert), Mixtral and DeepSeek-V3 (MLA,
sigmoid grouped routing with a correction bias, routed_scaling_factor 2.5, a shared
expert) are saved with transformers and served by vLLM twice, each time in a fresh
process: without the plugin acting (it is installed, ``VLLM_PLUGINS`` unset) and with
``VLLM_PLUGINS=moeroute``. vLLM's own run is the reference.

Greedy tokens must be identical, except that the two runs may part at a step where vLLM's
own top-2 log-probabilities are within `TIE` (after that the contexts differ and nothing
more is compared). These tiny random models have flat output distributions, so each
prompt's count of compared steps is reported in the assertion messages.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import checkpoints  # noqa: E402

#: Top-2 log-probability gap of vLLM's own run below which a step is a tie.
TIE = 1e-2
SHARED_MODELS = ("qwen2_moe", "deepseek_v3")
#: Also served with vLLM's torch.compile (enforce_eager=False) and the plugin.
COMPILED_MODEL = "qwen2_moe"
#: MoE layers of each tiny checkpoint (DeepSeek-V3's first layer is dense).
MOE_LAYERS = {"qwen3_moe": 2, "qwen2_moe": 2, "mixtral": 2, "deepseek_v3": 2}


def _serve(out_path, specs, *options, **env):
    environment = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "MOEROUTE_VLLM")}
    environment.update(env)
    done = subprocess.run(
        [sys.executable, str(HERE / "serve.py"), *options, str(out_path), *specs],
        env=environment,
        capture_output=True,
        text=True,
        timeout=900,
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-6000:]
    with open(out_path) as f:
        return json.load(f), log


@pytest.fixture(scope="session")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    dirs = {name: str(checkpoints.save(name, root / name)) for name in checkpoints.MODELS}
    specs = [dirs[name] for name in checkpoints.MODELS]
    off, off_log = _serve(root / "off.json", specs)
    on, on_log = _serve(root / "on.json", specs, VLLM_PLUGINS="moeroute")
    compiled, _ = _serve(root / "compiled.json", [dirs[COMPILED_MODEL]], "--compiled", VLLM_PLUGINS="moeroute")
    return {"dirs": dirs, "off": off, "on": on, "compiled": compiled, "off_log": off_log, "on_log": on_log}


def _counts(run, spec):
    return list(run[spec]["counts"].values())


def test_installed_but_not_asked_changes_nothing(served):
    off = served["off"]
    assert off["stats"] == {}
    for spec in served["dirs"].values():
        methods = {c["method"] for c in _counts(off, spec)}
        assert methods == {"UnquantizedFusedMoEMethod"}, (spec, methods)
    assert "moeroute:" not in served["off_log"]


def test_plugin_serves_every_layer_and_its_code_ran(served):
    on = served["on"]
    calls = rows = 0
    for name, spec in served["dirs"].items():
        counts = _counts(on, spec)
        assert len(counts) == MOE_LAYERS[name]
        assert all(c["method"] == "MoerouteMoEMethod" and c["monolithic"] for c in counts), counts
        calls += sum(c["runner_calls"] for c in counts)
        rows += sum(c["runner_rows"] for c in counts)
    assert calls > 0
    # Every MoE call went through moeroute's routing and experts, on every token row.
    assert on["stats"]["layers"] == sum(MOE_LAYERS.values())
    assert on["stats"]["calls"] == calls
    assert on["stats"]["tokens"] == rows
    assert on["stats"].get("declined", 0) == 0
    assert "moeroute: serving MoE layer" in served["on_log"]


@pytest.mark.parametrize("name", SHARED_MODELS)
@pytest.mark.parametrize("run", ["off", "on"])
def test_shared_expert_computed_once_per_token(served, name, run):
    counts = _counts(served[run], served["dirs"][name])
    for c in counts:
        assert c["has_shared"]
        assert c["runner_calls"] > 0
        assert c["shared_calls"] == c["runner_calls"], c
        assert c["shared_rows"] == c["runner_rows"], c


def _compare(reference, candidate):
    """Number of steps compared; AssertionError when the runs part at a step that is not
    a tie of ``reference``."""
    for step, (ref_token, token) in enumerate(zip(reference["tokens"], candidate["tokens"])):
        gap = reference["top2"][step][0] - reference["top2"][step][1]
        if ref_token != token:
            assert gap < TIE, (
                f"step {step}: vLLM picked {ref_token}, with moeroute {token}, but vLLM's "
                f"top-2 log-probabilities differ by {gap:.4f} >= {TIE}"
            )
            return step + 1
    assert len(reference["tokens"]) == len(candidate["tokens"])
    return len(reference["tokens"])


@pytest.mark.parametrize("batch", ["1", "4"])
@pytest.mark.parametrize("name", checkpoints.MODELS)
def test_same_greedy_tokens_as_vllm(served, name, batch):
    spec = served["dirs"][name]
    reference, candidate = served["off"][spec]["batches"][batch], served["on"][spec]["batches"][batch]
    assert len(reference) == len(candidate) == int(batch)
    compared = [_compare(r, c) for r, c in zip(reference, candidate)]
    # The first tokens come from the prefill: at least those are compared for every prompt.
    assert all(n >= 1 for n in compared), compared


@pytest.mark.parametrize("batch", ["1", "4"])
def test_compiled_model_gives_vllm_tokens(served, batch):
    # vLLM compiles the model with the plugin's layers inside: moeroute's ops are opaque
    # custom ops with fake kernels, so the graph holds them and the tokens stay vLLM's.
    spec = served["dirs"][COMPILED_MODEL]
    compiled = served["compiled"][spec]
    assert all(c["method"] == "MoerouteMoEMethod" and c["monolithic"] for c in compiled["counts"].values())
    assert served["compiled"]["stats"]["layers"] == MOE_LAYERS[COMPILED_MODEL]
    reference = served["off"][spec]["batches"][batch]
    compared = [_compare(r, c) for r, c in zip(reference, compiled["batches"][batch])]
    assert len(compared) == int(batch) and all(n >= 1 for n in compared), compared
