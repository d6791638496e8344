"""Loading FP8 experts: DeepSeek-V3's per-expert keys, transformers' FP8Experts, safetensors.

Every check compares the loaded tensors bit for bit with the quantized tensors the test
made (FP8 stays FP8: nothing is dequantized on the way), and the layer's output with the
w8a8 reference.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers.modules import CountingMLP
from helpers.reference import randn
from moeroute.bindings.torch import MoE, load_experts, replace_moe_blocks
from moeroute.config import RouterConfig
from moeroute.quant import QuantConfig, quantize_experts, quantize_fp8_block
from moeroute.quant.reference import moe_experts_reference
from moeroute.routing import reference

safetensors_torch = pytest.importorskip("safetensors.torch")

H, I, N, K = 128, 96, 6, 2
QUANT = QuantConfig("fp8_block", block_size=(32, 64))
ROUTER = RouterConfig(N, K, "softmax", renormalize=True)
REPO_ROOT = Path(__file__).resolve().parents[2]


_randn = functools.partial(randn, scale=0.1)


def _experts(seed=0, quant=QUANT, inter=I):
    return quantize_experts(_randn(N, 2 * inter, H, seed=seed), _randn(N, H, inter, seed=seed + 1), quant)


def per_expert_state(prefix, q_gu, s_gu, q_d, s_d, inter=I, first=0):
    """DeepSeek-V3's published layout: one FP8 weight and one scale_inv per expert and projection
    (experts numbered from ``first``)."""
    nb = s_gu.shape[1] // 2
    state = {}
    for i in range(q_gu.shape[0]):
        e = first + i
        for name, weight, scale in (
            ("gate_proj", q_gu[i, :inter], s_gu[i, :nb]),
            ("up_proj", q_gu[i, inter:], s_gu[i, nb:]),
            ("down_proj", q_d[i], s_d[i]),
        ):
            state[f"{prefix}experts.{e}.{name}.weight"] = weight.contiguous()
            state[f"{prefix}experts.{e}.{name}.weight_scale_inv"] = scale.contiguous()
    return state


def _same_bytes(a, b):
    return (
        torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn else torch.equal(a, b)
    )


def _assert_holds(module, expected, ids):
    q_gu, s_gu, q_d, s_d = expected
    index = torch.tensor(ids)
    experts = module.experts
    n = len(ids)
    assert _same_bytes(experts.w_gate_up[:n], q_gu[index]) and _same_bytes(experts.w_down[:n], q_d[index])
    assert torch.equal(experts.gate_up_scale[:n], s_gu[index]) and torch.equal(experts.down_scale[:n], s_d[index])


def test_load_state_dict_deepseek_per_expert_keys():
    expected = _experts()
    module = MoE(ROUTER, H, I, quant=QUANT)
    state = per_expert_state("", *expected)
    state["gate.weight"] = _randn(N, H, seed=5, scale=1.0)
    module.load_state_dict(state)
    _assert_holds(module, expected, list(range(N)))
    # The loaded layer computes the w8a8 reference.
    x = _randn(5, H, seed=6, scale=1.0)
    weights, ids = reference.select_experts((x @ state["gate.weight"].T).numpy(), ROUTER, None)
    want = moe_experts_reference(
        x, torch.from_numpy(weights), torch.from_numpy(ids).long(), *expected, QUANT.block_size
    )
    with torch.no_grad():
        got = module(x)
    assert float((got - want).abs().max() / want.abs().max()) < 2e-2


def test_load_state_dict_replicas_take_their_logical_experts():
    expected = _experts(seed=2)
    module = MoE(ROUTER, H, I, quant=QUANT, num_redundant_experts=2)
    module.load_state_dict(per_expert_state("", *expected), strict=False)
    ids = module.routed_expert_ids()
    assert ids == [0, 1, 2, 3, 4, 5, 0, 1]
    _assert_holds(module, expected, ids)


@pytest.mark.parametrize("keys", ["per_expert", "stacked"])
def test_replicas_load_into_the_layers_own_tensors(keys):
    """Per-expert and stacked keys for another subset of the experts (replicas) are written
    into the layer's own tensors, expert by expert, after every value this rank takes is
    checked: a NaN byte is refused naming the key and leaves the layer as it was."""
    expected = _experts(seed=4)
    module = MoE(ROUTER, H, I, quant=QUANT, num_redundant_experts=2)
    ids = module.routed_expert_ids()
    experts = module.experts
    held = experts.quantized_tensors()
    pointers = {name: tensor.data_ptr() for name, tensor in held.items()}
    q_gu, s_gu, q_d, s_d = expected
    if keys == "per_expert":
        state = per_expert_state("", *expected)
        poisoned = {**state, "experts.5.down_proj.weight": q_d[5].clone()}
        poisoned["experts.5.down_proj.weight"].view(torch.uint8)[3, 4] = 0x7F
        message = r"experts\.5\.down_proj\.weight\[3, 4\] \(expert 5\) is the byte 0x7F"
    else:
        state = {
            "experts.gate_up_proj": q_gu,
            "experts.down_proj": q_d,
            "experts.gate_up_proj_scale_inv": s_gu,
            "experts.down_proj_scale_inv": s_d,
        }
        bad = q_d.clone()
        bad.view(torch.uint8)[5, 3, 4] = 0x7F
        poisoned = {**state, "experts.down_proj": bad}
        message = r"experts\.down_proj\[3, 4\] \(expert 5\) is the byte 0x7F"
    before = {name: tensor.clone() for name, tensor in held.items()}
    with pytest.raises(ValueError, match=message):
        module.load_state_dict(poisoned, strict=False)
    assert all(_same_bytes(held[name], before[name]) for name in held)
    module.load_state_dict(state, strict=False)
    assert {name: tensor.data_ptr() for name, tensor in experts.quantized_tensors().items()} == pointers
    _assert_holds(module, expected, ids)


@pytest.mark.parametrize("shared_fp8", [False, True])
def test_fused_shared_slots_from_state_dict(shared_fp8):
    expected = _experts(seed=3)
    shared = CountingMLP(H, I)
    module = MoE(ROUTER, H, I, shared_experts=shared, shared="fused", quant=QUANT)
    gate, up, down = (_randn(I, H, seed=10), _randn(I, H, seed=11), _randn(H, I, seed=12))
    state = per_expert_state("", *expected)
    if shared_fp8:  # DeepSeek-V3's FP8 shared MLP: weight + weight_scale_inv
        for name, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            q, s = quantize_fp8_block(w, QUANT.block_size)
            state[f"shared_experts.{name}.weight"], state[f"shared_experts.{name}.weight_scale_inv"] = q, s
        gate, up, down = (
            state[f"shared_experts.{n}.weight"].float()
            * state[f"shared_experts.{n}.weight_scale_inv"]
            .repeat_interleave(32, 0)
            .repeat_interleave(64, 1)[: w.shape[0], : w.shape[1]]
            for n, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", down))
        )
    else:
        state.update(
            {
                "shared_experts.gate_proj.weight": gate,
                "shared_experts.up_proj.weight": up,
                "shared_experts.down_proj.weight": down,
            }
        )
    module.load_state_dict(state, strict=False)
    _assert_holds(module, expected, list(range(N)))
    slot = quantize_experts(torch.cat([gate, up])[None], down[None], QUANT)
    experts = module.experts
    assert _same_bytes(experts.w_gate_up[N:], slot[0]) and _same_bytes(experts.w_down[N:], slot[2])
    assert torch.equal(experts.gate_up_scale[N:], slot[1]) and torch.equal(experts.down_scale[N:], slot[3])


def test_state_dict_errors():
    module = MoE(ROUTER, H, I, quant=QUANT)
    state = per_expert_state("", *_experts())
    del state["experts.4.up_proj.weight_scale_inv"]
    with pytest.raises(KeyError, match=r"experts\.4\.up_proj\.weight_scale_inv is missing"):
        module.load_state_dict(state)
    state = per_expert_state("", *_experts())
    state["experts.0.down_proj.weight"] = state["experts.0.down_proj.weight"].float()
    with pytest.raises(ValueError, match=r"experts\.0\.down_proj\.weight has dtype torch\.float32"):
        module.load_state_dict(state)


# ------------------------------------------------------------------ transformers

transformers = pytest.importorskip("transformers")


def _deepseek_model(seed=0):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=64,
        hidden_size=H,
        intermediate_size=128,
        moe_intermediate_size=I,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=N,
        num_experts_per_tok=K,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    )
    torch.manual_seed(seed)
    return DeepseekV3ForCausalLM(config)


@pytest.mark.interop
@pytest.mark.parametrize("shared", ["runner", "fused"])
def test_patched_deepseek_loads_fp8_checkpoint_keys(shared):
    model = _deepseek_model()
    float_state = model.state_dict()
    assert replace_moe_blocks(model, quant=QUANT, shared=shared) == 1
    layer = model.model.layers[1].mlp
    assert isinstance(layer, MoE) and layer.layout.shared == shared
    expected = _experts(seed=7)
    checkpoint = {k: v for k, v in float_state.items() if ".mlp.experts." not in k}
    checkpoint.update(per_expert_state("model.layers.1.mlp.", *expected))
    model.load_state_dict(checkpoint)
    _assert_holds(layer, expected, list(range(N)))
    assert layer.experts.w_gate_up.dtype == torch.float8_e4m3fn


@pytest.mark.interop
def test_from_hf_fp8_experts_block_keeps_its_tensors():
    from transformers.integrations.finegrained_fp8 import FP8Experts

    model = _deepseek_model()
    block = model.model.layers[1].mlp
    fp8 = FP8Experts(block.experts.config, block_size=QUANT.block_size)
    q_gu, s_gu, q_d, s_d = _experts(seed=9, inter=I)
    with torch.no_grad():
        fp8.gate_up_proj.data, fp8.gate_up_proj_scale_inv.data = q_gu.clone(), s_gu.clone()
        fp8.down_proj.data, fp8.down_proj_scale_inv.data = q_d.clone(), s_d.clone()
    block.experts = fp8
    module = MoE.from_hf(block, shared="runner")
    assert module.quant == QUANT
    _assert_holds(module, (q_gu, s_gu, q_d, s_d), list(range(N)))
    with pytest.raises(ValueError, match="differs from the block's FP8 experts"):
        MoE.from_hf(block, quant=QuantConfig("fp8_tensor"))


def test_fp8_experts_scales_spanning_gate_and_up_are_refused():
    from moeroute.experts.formats.fp8 import gate_up_scale_from_stacked

    with pytest.raises(ValueError, match="not a multiple of the block rows 128"):
        gate_up_scale_from_stacked(torch.ones(2, 3, 1), QuantConfig("fp8_block"), 100)


# ------------------------------------------------------------------ safetensors


class TwoLayers(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.layers = nn.ModuleList(
            [nn.ModuleDict({"mlp": MoE(ROUTER, H, I, quant=QUANT, **kwargs)}) for _ in range(2)]
        )


def _write_checkpoint(directory, states, shards=2):
    """The tensors over ``shards`` files with a model.safetensors.index.json, as published."""
    keys = sorted(states)
    weight_map = {}
    for s in range(shards):
        part = {k: states[k] for k in keys[s::shards]}
        name = f"model-{s:05d}-of-{shards:05d}.safetensors"
        safetensors_torch.save_file(part, str(directory / name))
        weight_map.update({k: name for k in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_load_experts_from_safetensors(tmp_path):
    experts = [_experts(seed=20), _experts(seed=30)]
    states = {}
    for layer, expected in enumerate(experts):
        states.update(per_expert_state(f"layers.{layer}.mlp.", *expected))
        states[f"layers.{layer}.mlp.gate.weight"] = _randn(N, H, seed=40 + layer)
    states["lm_head.weight"] = _randn(4, H, seed=50)
    _write_checkpoint(tmp_path, states)
    model = TwoLayers()
    stats = load_experts(model, tmp_path)
    assert stats["layers"] == 2
    fp8_bytes = sum(v.numel() * v.element_size() for k, v in states.items() if ".experts." in k)
    scale_bytes = sum(v.numel() * v.element_size() for k, v in states.items() if k.endswith("_scale_inv"))
    router_bytes = 2 * N * H * 4
    # The copy pass reads nothing else (lm_head is not a layer's); the check pass before it
    # reads expert tensors only, the scales at least.
    assert stats["bytes"] - stats["checked_bytes"] == fp8_bytes + router_bytes
    assert scale_bytes <= stats["checked_bytes"] <= fp8_bytes
    for layer, expected in enumerate(experts):
        mlp = model.layers[layer]["mlp"]
        _assert_holds(mlp, expected, list(range(N)))
        assert torch.equal(mlp.router_weight, states[f"layers.{layer}.mlp.gate.weight"])


def test_load_experts_reads_only_the_experts_a_rank_holds(tmp_path):
    # A physical_to_logical table placing only experts 1, 4 and 4 here: the others are never read.
    expected = _experts(seed=21)
    states = per_expert_state("mlp.", *expected)
    _write_checkpoint(tmp_path, states, shards=1)
    model = nn.Module()
    model.mlp = MoE(RouterConfig(N, K), H, I, quant=QUANT, physical_to_logical=[1, 4, 4, 0, 2, 3, 5])
    ids = model.mlp.routed_expert_ids()
    stats = load_experts(model, tmp_path)
    _assert_holds(model.mlp, expected, ids)
    per_expert = sum(states[k].numel() * states[k].element_size() for k in states if k.startswith("mlp.experts.0."))
    assert stats["bytes"] - stats["checked_bytes"] == len(ids) * per_expert
    assert stats["checked_bytes"] <= len(ids) * per_expert


def test_load_experts_errors(tmp_path):
    expected = _experts(seed=22)
    states = per_expert_state("layers.0.mlp.", *expected)
    states.update({k: v.clone() for k, v in per_expert_state("layers.1.mlp.", *expected).items()})
    states["layers.1.mlp.experts.2.gate_proj.weight_scale_inv"] = -states[
        "layers.1.mlp.experts.2.gate_proj.weight_scale_inv"
    ]
    _write_checkpoint(tmp_path, states, shards=1)
    with pytest.raises(
        ValueError, match=r"layers\.1\.mlp\.experts\.2\.gate_proj\.weight_scale_inv must be finite and > 0"
    ):
        load_experts(TwoLayers(), tmp_path)
    with pytest.raises(ValueError, match="neither a safetensors file nor a directory"):
        load_experts(TwoLayers(), tmp_path / "missing")


_RSS_SCRIPT = r"""
import json, resource, sys, torch
from torch import nn
from moeroute.bindings.torch import MoE, load_experts
from moeroute.config import RouterConfig
from moeroute.quant import QuantConfig

H, I, N = {H}, {I}, {N}
model = nn.Module()
model.mlp = MoE(RouterConfig(N, 2), H, I, quant=QuantConfig("fp8_block"))
def rss_kb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS"))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak (VmHWM) to the current RSS
before = rss_kb()
load_experts(model, sys.argv[1])
with open("/proc/self/status") as f:
    peak = next(int(l.split()[1]) for l in f if l.startswith("VmHWM"))
print(json.dumps({{"before_kb": before, "peak_kb": peak}}))
"""


def test_load_experts_peak_memory(tmp_path):
    # 32 experts of H = 1024, I = 512: 48 MiB of FP8 weights in per-expert tensors of 0.5 MiB.
    h, inter, n, step = 1024, 512, 32, 8
    quant = QuantConfig("fp8_block")
    states = {}
    for first in range(0, n, step):
        q = quantize_experts(_randn(step, 2 * inter, h, seed=first), _randn(step, h, inter, seed=first + 1), quant)
        states.update(per_expert_state("mlp.", *q, inter=inter, first=first))
    _write_checkpoint(tmp_path, states, shards=2)
    del states
    fp8_bytes = n * 3 * h * inter
    script = _RSS_SCRIPT.format(H=h, I=inter, N=n)
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, cwd=REPO_ROOT, timeout=300
    )
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    growth = (figures["peak_kb"] - figures["before_kb"]) * 1024
    # The layer's own FP8 weights (first touched here) plus one tensor at a time.
    assert growth <= 1.1 * fp8_bytes, (growth, fp8_bytes)


@pytest.mark.interop
def test_from_hf_fp8_layer_state_dict_round_trips():
    # An FP8 layer saves its FP8 weights with their scales (moeroute's names) and loads them back.
    model = _deepseek_model()
    replace_moe_blocks(model, quant=QUANT, shared="runner")
    layer = model.model.layers[1].mlp
    state = layer.state_dict()
    assert state["experts.w_gate_up"].dtype == torch.float8_e4m3fn and "experts.gate_up_scale" in state
    copy = MoE(layer.router, H, I, shared_experts=CountingMLP(H, I), shared="runner", quant=QUANT, correction_bias=True)
    copy.load_state_dict(state)
    _assert_holds(
        copy,
        (
            state["experts.w_gate_up"],
            state["experts.gate_up_scale"],
            state["experts.w_down"],
            state["experts.down_scale"],
        ),
        list(range(N)),
    )
