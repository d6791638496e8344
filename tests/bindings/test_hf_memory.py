"""replace_moe_blocks: aliased expert weights, a bounded memory peak, and transformers state dicts.

* At one rank without fused shared slots the patched module's expert parameters ARE the
  transformers parameters (same memory); fused slots or expert parallelism copy.
* The peak resident memory of a swap, measured in a subprocess (VmHWM after resetting it
  through /proc/self/clear_refs), grows by at most 25% of the model's expert weight bytes.
* A patched model loads the unpatched model's state dict (transformers names) and then
  computes what the unpatched model computes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moeroute.bindings.torch import MoE, replace_moe_blocks  # noqa: E402
from helpers.reference import rel_error  # noqa: E402
from test_hf import BLOCKS, FP32_RTOL, H, _randomize  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
#: Peak growth allowed while swapping, as a share of the model's expert weight bytes.
MAX_PEAK_GROWTH = 0.25
MEMORY_TIMEOUT_S = 600  # building a ~300 MB model takes seconds; this guards against a hang


def _qwen3_model(layers=2, experts=8, seed=0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=H,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=experts,
        num_experts_per_tok=2,
        head_dim=16,
    )
    torch.manual_seed(seed)
    return _randomize(Qwen3MoeForCausalLM(config), seed=seed)


def _deepseek_model(seed=0):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=64,
        hidden_size=H,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    )
    torch.manual_seed(seed)
    return _randomize(DeepseekV3ForCausalLM(config), seed=seed)


def _qwen2_model(seed=0):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=64,
        hidden_size=H,
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=12,
        num_experts_per_tok=4,
    )
    torch.manual_seed(seed)
    return _randomize(Qwen2MoeForCausalLM(config), seed=seed)


MODELS = {"qwen3_moe": _qwen3_model, "deepseek_v3": _deepseek_model, "qwen2_moe": _qwen2_model}


def _tokens(seed=1):
    return torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ aliasing


@pytest.mark.parametrize("name", [n for n, (_, has_shared, _) in BLOCKS.items() if not has_shared])
def test_from_hf_aliases_expert_weights_at_one_rank(name):
    block = _randomize(BLOCKS[name][0](), seed=1)
    moe = MoE.from_hf(block)
    assert moe.shares_weights_with(block.experts.gate_up_proj, block.experts.down_proj)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel_error(moe(x), block(x[None])[0]) < FP32_RTOL
        block.experts.down_proj.mul_(2)  # one memory: a change through transformers shows
        assert rel_error(moe(x), block(x[None])[0]) < FP32_RTOL


@pytest.mark.parametrize("shared,aliased", [("runner", True), ("overlap", True), ("fused", False)])
def test_fused_slots_copy_other_modes_alias(shared, aliased):
    block = _randomize(BLOCKS["deepseek_v3"][0](), seed=3)
    moe = MoE.from_hf(block, shared=shared)
    assert moe.shares_weights_with(block.experts.gate_up_proj, block.experts.down_proj) == aliased


def test_replicas_copy_instead_of_aliasing():
    block = _randomize(BLOCKS["qwen3_moe"][0](), seed=4)
    moe = MoE.from_hf(block, num_redundant_experts=4)
    assert not moe.shares_weights_with(block.experts.gate_up_proj, block.experts.down_proj)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert rel_error(moe(x), block(x[None])[0]) < FP32_RTOL


def test_replace_moe_blocks_releases_each_block():
    import gc
    import weakref

    model = _qwen3_model(layers=3)
    blocks = [weakref.ref(layer.mlp) for layer in model.model.layers]
    gate_up = [layer.mlp.experts.gate_up_proj.data_ptr() for layer in model.model.layers]
    assert replace_moe_blocks(model) == 3
    gc.collect()
    assert all(ref() is None for ref in blocks)
    assert [layer.mlp.experts.w_gate_up.data_ptr() for layer in model.model.layers] == gate_up


# ------------------------------------------------------------------ peak memory

MEMORY_SCRIPT = r"""
import gc, json, sys
import torch
from transformers import {config_cls}, {model_cls}
from moeroute.bindings.torch import replace_moe_blocks

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

torch.manual_seed(0)
with torch.no_grad():
    model = {model_cls}({config_cls}(**json.loads(sys.argv[1])))
expert_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                   if n.endswith(("gate_up_proj", "down_proj")) and p.dim() == 3)
gc.collect()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM to the current resident size
before = status("VmRSS")
replace_moe_blocks(model, **json.loads(sys.argv[2]))
gc.collect()
print(json.dumps(dict(expert_bytes=expert_bytes, before=before, peak=status("VmHWM"),
                      after=status("VmRSS"))))
"""

# ~300 MB of float32 expert weights in 4 MoE layers (~75 MB each), small everything else.
QWEN3_BIG = dict(
    vocab_size=64,
    hidden_size=512,
    intermediate_size=256,
    moe_intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=32,
    num_experts_per_tok=4,
    head_dim=64,
)
# Fused shared slots copy each block once: 8 layers of ~38 MB, so one block is ~12%.
DEEPSEEK_BIG = dict(
    vocab_size=64,
    hidden_size=512,
    intermediate_size=256,
    moe_intermediate_size=192,
    num_hidden_layers=8,
    first_k_dense_replace=0,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=32,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    q_lora_rank=64,
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=32,
)


def _measure(config_cls, model_cls, config, kwargs):
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak resident size")
    script = MEMORY_SCRIPT.format(config_cls=config_cls, model_cls=model_cls)
    result = subprocess.run(
        [sys.executable, "-c", script, json.dumps(config), json.dumps(kwargs)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=MEMORY_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("case", ["qwen3_moe aliased", "deepseek_v3 fused"])
def test_replace_moe_blocks_peak_memory(case):
    if case.startswith("qwen3"):
        figures = _measure("Qwen3MoeConfig", "Qwen3MoeForCausalLM", QWEN3_BIG, {})
    else:
        figures = _measure("DeepseekV3Config", "DeepseekV3ForCausalLM", DEEPSEEK_BIG, {})
    assert figures["expert_bytes"] > 250e6  # the experts dominate the model
    growth = figures["peak"] - figures["before"]
    assert growth <= MAX_PEAK_GROWTH * figures["expert_bytes"], figures
    # Nothing is held twice afterwards either.
    assert figures["after"] - figures["before"] <= MAX_PEAK_GROWTH * figures["expert_bytes"], figures


# ------------------------------------------------------------------ state dict


@pytest.mark.parametrize(
    "name,kwargs",
    [
        ("qwen3_moe", {}),
        ("deepseek_v3", {}),
        ("deepseek_v3", {"shared": "runner"}),
        ("qwen2_moe", {}),
        ("qwen2_moe", {"shared": "runner"}),
        ("qwen3_moe", {"num_redundant_experts": 3}),
    ],
)
@pytest.mark.interop
def test_patched_model_loads_a_transformers_state_dict(name, kwargs):
    source = MODELS[name](seed=1)
    state = source.state_dict()
    target = MODELS[name](seed=1)
    with torch.no_grad():  # other weights; the same non-persistent buffers (rotary tables)
        for parameter in target.parameters():
            parameter.mul_(-0.5)
    assert replace_moe_blocks(target, **kwargs) > 0
    result = target.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    with torch.no_grad():
        expected = source(_tokens()).logits
        actual = target(_tokens()).logits
    assert rel_error(actual, expected) < FP32_RTOL


def test_state_dict_loading_keeps_aliasing_and_own_names_still_load():
    model = _qwen3_model(seed=3)
    state = {k: -v for k, v in model.state_dict().items()}
    replace_moe_blocks(model)
    experts = model.model.layers[0].mlp.experts
    pointer = experts.w_gate_up.data_ptr()
    model.load_state_dict(state)
    assert experts.w_gate_up.data_ptr() == pointer  # copied into, not replaced
    torch.testing.assert_close(experts.w_gate_up, state["model.layers.0.mlp.experts.gate_up_proj"], rtol=0, atol=0)
    saved = model.state_dict()  # saved under transformers' names again
    assert set(saved) == set(state)
    blocks = [m for m in model.modules() if isinstance(m, MoE)]
    formats = [block.checkpoint_format for block in blocks]
    for block in blocks:
        block.checkpoint_format = None
    own = {k: v.clone() for k, v in model.state_dict().items()}  # moeroute's own names, which still load
    assert "model.layers.0.mlp.experts.w_gate_up" in own
    for block, checkpoint_format in zip(blocks, formats):
        block.checkpoint_format = checkpoint_format
    model.load_state_dict({k: -v for k, v in own.items()}, strict=True)
    torch.testing.assert_close(experts.w_gate_up, -own["model.layers.0.mlp.experts.w_gate_up"], rtol=0, atol=0)


def test_fused_state_dict_without_shared_mlp_is_named():
    model = _deepseek_model(seed=5)
    state = {k: v for k, v in model.state_dict().items() if ".shared_experts." not in k}
    replace_moe_blocks(model)
    with pytest.raises(KeyError, match="no shared MLP gate_proj.weight"):
        model.load_state_dict(state)
