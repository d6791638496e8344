"""Loading INT4 checkpoints (compressed-tensors, GPTQ, AWQ) into MoE and saving them back.

The checkpoints are written here by the packers of test_int4_checkpoint (plain Python,
word by word, from each writer's published layout) from known integers q, zero points z and
scales s, under the per-expert names of DeepSeek-V3 / Kimi-K2 and Qwen3-MoE
(``mlp.experts.{e}.{gate,up,down}_proj.*``). The reference output is a plain float64
computation: softmax top-k (renormalized) of the given router logits, and each expert's
``down(silu(gate x) * up x)`` with the dequantized weights ``(q - z) * s`` in the
checkpoint's own column order (GPTQ act order included). Tolerance: max abs diff <= 1e-5 x
max abs reference (float32 activations and sums in another order). Held tensors are compared
exactly; a refused load must leave every tensor of the layer bit-identical.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from moeroute.bindings.torch import MoE, load_experts
from moeroute.bindings.torch.int4_keys import Int4Checkpoint
from moeroute.config import RouterConfig
from moeroute.quant import QuantConfig, dequantize_int4
from test_int4_checkpoint import awq_pack, ct_pack, gptq_pack, moeroute_q

safetensors_torch = pytest.importorskip("safetensors.torch")

H, I, N, K, G = 128, 64, 4, 2, 32
ROUTER = RouterConfig(N, K, "softmax", renormalize=True)
RTOL = 1e-5
#: (layout, symmetric, how the compressed-tensors zero points are stored)
CASES = [
    ("compressed-tensors", True, None),  # Kimi-K2-Thinking
    ("compressed-tensors", False, "packed"),
    ("compressed-tensors", False, "int8"),
    ("gptq", True, None),  # Qwen3-MoE GPTQ-Int4
    ("gptq_v2", False, None),
    ("awq", False, None),
]
IDS = ["ct-sym", "ct-asym", "ct-asym-int8", "gptq-sym", "gptq_v2-asym", "awq"]


def quant_of(layout, symmetric):
    return QuantConfig("int4", group_size=G, symmetric=symmetric, checkpoint=layout)


def projection(rng, rows, cols, layout, symmetric, zero_layout, g_idx=None):
    """(checkpoint tensors, dense float64 weight [rows, cols]) of one projection."""
    q = rng.integers(0, 16, (rows, cols))
    z = np.full((rows, cols // G), 8) if symmetric else rng.integers(1, 16, (rows, cols // G))
    s = (rng.random((rows, cols // G)) * 0.02 + 0.005).astype(np.float16)
    groups = np.arange(cols) // G if g_idx is None else g_idx
    dense = (q - z[:, groups]) * s.astype(np.float64)[:, groups]
    if layout == "compressed-tensors":
        tensors = ct_pack(q, z, torch.from_numpy(s.astype(np.float32)).to(torch.bfloat16), symmetric, zero_layout)
        dense = (q - z[:, groups]) * tensors["weight_scale"].double().numpy()[:, groups]
    elif layout == "awq":
        tensors = awq_pack(q, z, s)
    else:
        tensors = gptq_pack(q, z, s, groups, layout == "gptq")
    return tensors, dense


def checkpoint(layout, symmetric, zero_layout=None, prefix="mlp.", seed=0, down_act_order=False):
    """(state dict of per-expert keys and the router, dense weights [(gate, up, down)] per expert)."""
    rng = np.random.default_rng(seed)
    state, dense = {}, []
    for e in range(N):
        weights = []
        for name, rows, cols in (("gate_proj", I, H), ("up_proj", I, H), ("down_proj", H, I)):
            g_idx = None
            if down_act_order and name == "down_proj":
                g_idx = np.empty(cols, np.int64)
                g_idx[rng.permutation(cols)] = np.arange(cols) // G
            tensors, w = projection(rng, rows, cols, layout, symmetric, zero_layout, g_idx)
            state.update({f"{prefix}experts.{e}.{name}.{k}": v for k, v in tensors.items()})
            weights.append(w)
        dense.append(weights)
    state[prefix + "gate.weight"] = torch.from_numpy(rng.standard_normal((N, H)).astype(np.float32) * 0.1)
    return state, dense


def reference(x, logits, dense):
    """Plain float64 MoE: softmax top-k renormalized, SiLU-gated experts."""
    x, logits = x.double().numpy(), logits.double().numpy()
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        top = np.argsort(-p[t], kind="stable")[:K]
        weights = p[t, top] / p[t, top].sum()
        for e, w in zip(top, weights):
            gate, up, down = dense[e]
            h = x[t] @ gate.T
            out[t] += w * ((h / (1 + np.exp(-h)) * (x[t] @ up.T)) @ down.T)
    return out


def check_output(layer, dense, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(6, H, generator=gen)
    logits = torch.randn(6, N, generator=gen)
    got = layer(x, logits).double().numpy()
    want = reference(x, logits, dense)
    assert np.abs(got - want).max() <= RTOL * np.abs(want).max()


class Holder(nn.Module):
    def __init__(self, quant, **kwargs):
        super().__init__()
        self.mlp = MoE(ROUTER, H, I, quant=quant, **kwargs)


def assert_same_tensors(got: dict, expected: dict) -> None:
    """The same keys, under each a tensor of the same dtype and bits."""
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def saved_after_load(quant, state) -> dict:
    """What a layer of ``quant`` saving the checkpoint's names (`Int4Checkpoint`) saves after
    loading ``state``."""
    model = Holder(quant)
    model.mlp.checkpoint_format = Int4Checkpoint()
    model.load_state_dict(state)
    return model.state_dict()


def loaded(quant, state) -> MoE:
    """A new layer of ``quant`` that loaded ``state``."""
    model = Holder(quant)
    model.load_state_dict(state)
    return model.mlp


def snapshot(module):
    return {k: v.clone() for k, v in module.state_dict(keep_vars=False).items()}


def assert_unchanged(module, before):
    after = module.state_dict()
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert after[key].dtype == value.dtype and torch.equal(after[key].view(-1), value.view(-1)), key


def assert_holds_dense(layer, dense):
    """The layer's tensors dequantize to each expert's dense weights (in canonical order)."""
    g = layer.quant.group_size
    held = layer.experts
    for e, (gate, up, down) in enumerate(dense):
        zeros = (None, None) if held.gate_up_zero is None else (held.gate_up_zero[e], held.down_zero[e])
        gu = dequantize_int4(held.w_gate_up[e], held.gate_up_scale[e], zeros[0], group_size=g).double().numpy()
        dn = dequantize_int4(held.w_down[e], held.down_scale[e], zeros[1], group_size=g).double().numpy()
        np.testing.assert_array_equal(gu, np.concatenate([gate, up]))
        np.testing.assert_array_equal(dn, down)


# ------------------------------------------------------------------ load_state_dict


@pytest.mark.parametrize("layout, symmetric, zero_layout", CASES, ids=IDS)
def test_load_state_dict_of_per_expert_keys(layout, symmetric, zero_layout):
    state, dense = checkpoint(layout, symmetric, zero_layout)
    model = Holder(quant_of(layout, symmetric))
    model.load_state_dict(state)
    layer = model.mlp
    # The integers themselves, in moeroute's bytes (GPTQ/AWQ: the transposed words).
    weight_key = "weight_packed" if layout == "compressed-tensors" else "qweight"
    first = {k.rsplit(".", 1)[1]: v for k, v in state.items() if k.startswith("mlp.experts.2.up_proj.")}
    if layout == "compressed-tensors":
        assert torch.equal(layer.experts.w_gate_up[2, I:], first[weight_key].view(torch.uint8))
    assert moeroute_q(layer.experts.w_down[3]).max() <= 15
    assert_holds_dense(layer, dense)
    assert torch.equal(layer.router_weight, state["mlp.gate.weight"])
    check_output(layer, dense)


def test_gptq_down_act_order_is_folded_into_gate_and_up():
    state, dense = checkpoint("gptq", False, down_act_order=True, seed=3)
    model = Holder(quant_of("gptq", False))
    model.load_state_dict(state)
    check_output(model.mlp, dense)  # the same function, no permutation left per token
    # The held down projection is the checkpoint's columns in group order.
    g_idx = state["mlp.experts.1.down_proj.g_idx"].numpy()
    perm = np.argsort(g_idx, kind="stable")
    held = model.mlp.experts
    down = dequantize_int4(held.w_down[1], held.down_scale[1], held.down_zero[1], group_size=G).double().numpy()
    np.testing.assert_array_equal(down, dense[1][2][:, perm])


def test_gptq_act_order_on_gate_alone_is_refused_naming_gate_and_up():
    state, _ = checkpoint("gptq", False, seed=4)
    g_idx = np.empty(H, np.int64)
    g_idx[np.random.default_rng(5).permutation(H)] = np.arange(H) // G
    state["mlp.experts.2.gate_proj.g_idx"] = torch.from_numpy(g_idx).to(torch.int32)
    model = Holder(quant_of("gptq", False))
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"mlp\.experts\.2\.gate_proj\.g_idx and mlp\.experts\.2\.up_proj\.g_idx"):
        model.load_state_dict(state)
    assert_unchanged(model, before)


def _damaged(layout):
    """(name, change to the state dict, expected message) of broken checkpoints."""
    w = "weight_packed" if layout == "compressed-tensors" else "qweight"
    s = "weight_scale" if layout == "compressed-tensors" else "scales"
    p = "mlp.experts.1.up_proj."
    cases = [
        ("missing", lambda st: st.pop(p + w), rf"{p}{w} is missing"),
        ("extra", lambda st: st.__setitem__(p + "bias", torch.zeros(I)), rf"{p}bias is not a tensor of a"),
        (
            "expert past N",
            lambda st: st.__setitem__(f"mlp.experts.{N}.up_proj.{w}", st[p + w].clone()),
            rf"names expert {N}",
        ),
        (
            "misshapen weight",
            lambda st: st.__setitem__(p + w, st[p + w][:-1].contiguous()),
            rf"{p}{w} has shape .* the layer's up_proj is \[{I}, {H}\]",
        ),
        ("misshapen scales", lambda st: st.__setitem__(p + s, st[p + s][:-1]), rf"{p}{s} has shape"),
        ("weight dtype", lambda st: st.__setitem__(p + w, st[p + w].to(torch.int64)), rf"{p}{w} must be int32"),
        ("inf scale", lambda st: st[p + s].view(-1).__setitem__(5, float("inf")), rf"{p}{s}\[.*\] is inf"),
        ("router", lambda st: st.__setitem__("mlp.gate.weight", torch.zeros(N, H + 1)), r"gate.weight|router_weight"),
    ]
    if layout == "compressed-tensors":
        cases.append(
            (
                "weight_shape",
                lambda st: st.__setitem__(p + "weight_shape", torch.tensor([I, 2 * H])),
                rf"{p}weight_shape is \[{I}, {2 * H}\]",
            )
        )
    if layout.startswith("gptq"):
        cases.append(("g_idx", lambda st: st[p + "g_idx"].fill_(9), rf"{p}g_idx\[0\] is 9, outside"))
    return cases


@pytest.mark.parametrize("layout, symmetric", [("compressed-tensors", False), ("gptq", True), ("awq", False)])
def test_refused_state_dict_leaves_the_layer_bit_identical(layout, symmetric):
    clean, _ = checkpoint(layout, symmetric, "packed", seed=6)
    model = Holder(quant_of(layout, symmetric))
    model.load_state_dict(checkpoint(layout, symmetric, "packed", seed=7)[0])  # something loaded already
    before = snapshot(model)
    for what, change, message in _damaged(layout):
        state = {k: v.clone() for k, v in clean.items()}
        change(state)
        with pytest.raises((KeyError, ValueError, TypeError), match=message):
            model.load_state_dict(state)
        assert_unchanged(model, before)


def test_layer_without_checkpoint_layout_names_the_key():
    state, _ = checkpoint("gptq", True, seed=8)
    model = Holder(QuantConfig("int4", group_size=G, symmetric=True))
    with pytest.raises(ValueError, match=r"mlp\.experts\.\d\.\w+_proj\.\w+ is an INT4 checkpoint tensor .*from_hf"):
        model.load_state_dict(state)


def test_replicas_and_placement_take_their_logical_experts():
    state, dense = checkpoint("awq", False, seed=9)
    model = Holder(quant_of("awq", False), physical_to_logical=[3, 1, 1, 0, 2])
    model.load_state_dict(state)
    ids = model.mlp.routed_expert_ids()
    assert ids == [3, 1, 1, 0, 2]
    g = G
    held = model.mlp.experts
    for local, e in enumerate(ids):
        dn = dequantize_int4(held.w_down[local], held.down_scale[local], held.down_zero[local], group_size=g)
        np.testing.assert_array_equal(dn.double().numpy(), dense[e][2])
    check_output(model.mlp, dense)


# ------------------------------------------------------------------ safetensors files


def write_checkpoint(directory, state, shards=2):
    keys = sorted(state)
    weight_map = {}
    for s in range(shards):
        part = {k: state[k].contiguous() for k in keys[s::shards]}
        name = f"model-{s:05d}-of-{shards:05d}.safetensors"
        safetensors_torch.save_file(part, str(directory / name))
        weight_map.update({k: name for k in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("layout, symmetric, zero_layout", CASES, ids=IDS)
def test_load_experts_from_safetensors(tmp_path, layout, symmetric, zero_layout):
    state, dense = checkpoint(layout, symmetric, zero_layout, prefix="model.layers.1.mlp.", seed=10)
    state["lm_head.weight"] = torch.zeros(4, H)
    write_checkpoint(tmp_path, state)
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList(
        [nn.Identity(), nn.ModuleDict({"mlp": MoE(ROUTER, H, I, quant=quant_of(layout, symmetric))})]
    )
    stats = load_experts(model, tmp_path)
    layer = model.model.layers[1]["mlp"]
    assert stats["layers"] == 1
    expert_bytes = sum(v.numel() * v.element_size() for k, v in state.items() if ".experts." in k)
    # The second pass reads every expert tensor once (and the router); the first only the small ones.
    assert stats["bytes"] - stats["checked_bytes"] == expert_bytes + N * H * 4
    assert stats["checked_bytes"] < expert_bytes / 4
    assert_holds_dense(layer, dense)
    check_output(layer, dense)


def test_load_experts_act_order_and_a_rank_s_experts(tmp_path):
    state, dense = checkpoint("gptq", False, prefix="mlp.", seed=11, down_act_order=True)
    write_checkpoint(tmp_path, state, shards=1)
    model = Holder(quant_of("gptq", False), physical_to_logical=[2, 2, 0, 1, 3])
    load_experts(model, tmp_path)
    check_output(model.mlp, dense)


@pytest.mark.parametrize("layout, symmetric", [("compressed-tensors", False), ("gptq", True), ("awq", False)])
def test_refused_file_load_leaves_the_layer_bit_identical(tmp_path, layout, symmetric):
    clean, _ = checkpoint(layout, symmetric, "packed", seed=12)
    model = Holder(quant_of(layout, symmetric))
    model.load_state_dict(checkpoint(layout, symmetric, "packed", seed=13)[0])
    before = snapshot(model)
    for index, (what, change, message) in enumerate(_damaged(layout)):
        state = {k: v.clone() for k, v in clean.items()}
        change(state)
        directory = tmp_path / str(index)
        directory.mkdir()
        write_checkpoint(directory, state, shards=1)
        with pytest.raises((KeyError, ValueError, TypeError), match=message):
            load_experts(model, directory)
        assert_unchanged(model, before)


# ------------------------------------------------------------------ saving back


@pytest.mark.parametrize("layout, symmetric, zero_layout", CASES, ids=IDS)
def test_state_dict_round_trip_is_byte_identical(layout, symmetric, zero_layout):
    state, dense = checkpoint(layout, symmetric, zero_layout, seed=14)
    saved = saved_after_load(quant_of(layout, symmetric), state)
    assert_same_tensors(saved, state)
    # And back in: the same layer.
    assert_holds_dense(loaded(quant_of(layout, symmetric), saved), dense)


def test_gptq_act_order_saves_the_canonical_order():
    """What differs after act order: g_idx is k // g, down's columns are in group order and
    gate's and up's rows follow them; the dequantized weights are the permuted ones."""
    state, dense = checkpoint("gptq", False, seed=15, down_act_order=True)
    saved = saved_after_load(quant_of("gptq", False), state)
    assert saved.keys() == state.keys()
    for e in range(N):
        perm = np.argsort(state[f"mlp.experts.{e}.down_proj.g_idx"].numpy(), kind="stable")
        assert torch.equal(saved[f"mlp.experts.{e}.down_proj.g_idx"], torch.arange(I, dtype=torch.int32) // G)
        layer = loaded(quant_of("gptq", False), saved)
        held = layer.experts
        gu = dequantize_int4(held.w_gate_up[e], held.gate_up_scale[e], held.gate_up_zero[e], group_size=G)
        dn = dequantize_int4(held.w_down[e], held.down_scale[e], held.down_zero[e], group_size=G)
        gate, up, down = dense[e]
        np.testing.assert_array_equal(gu.double().numpy(), np.concatenate([gate[perm], up[perm]]))
        np.testing.assert_array_equal(dn.double().numpy(), down[:, perm])
    check_output(layer, dense)


# ------------------------------------------------------------------ transformers models


def _qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=H,
        intermediate_size=256,
        moe_intermediate_size=I,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=N,
        num_experts_per_tok=K,
        norm_topk_prob=True,
    )
    config.quantization_config = {"quant_method": "gptq", "bits": 4, "group_size": G, "sym": True, "desc_act": False}
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config).eval(), "gptq", True, [0, 1]


def _kimi_k2():
    """DeepSeek-V3's architecture with Kimi-K2-Thinking's compressed-tensors INT4 experts."""
    from test_int4 import KIMI_K2
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=64,
        hidden_size=H,
        intermediate_size=256,
        moe_intermediate_size=I,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=N,
        num_experts_per_tok=K,
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    )
    config.quantization_config = KIMI_K2
    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(config).eval(), "compressed-tensors", True, [1]


@pytest.mark.interop
@pytest.mark.parametrize("family", [_qwen3_moe, _kimi_k2], ids=["qwen3_moe-gptq", "kimi_k2-compressed_tensors"])
def test_patched_model_loads_the_checkpoint_and_save_pretrained_gives_it_back(tmp_path, monkeypatch, family):
    pytest.importorskip("transformers")
    from moeroute.bindings.torch import hf, moe, replace_moe_blocks

    model, layout, symmetric, moe_layers = family()
    float_state = model.state_dict()
    quant = QuantConfig.from_hf(model.config)
    assert quant.checkpoint == layout
    quantized = []
    for where in (hf, moe):  # the block's random float experts are not quantized: the load fills the layer
        monkeypatch.setattr(where, "quantize_int4", lambda *args, **kwargs: quantized.append(args))
    assert replace_moe_blocks(model, quant=quant, shared="runner") == len(moe_layers)
    monkeypatch.undo()
    assert quantized == []
    for layer in moe_layers:
        held = model.model.layers[layer].mlp.experts
        assert torch.equal(held.w_gate_up, torch.full_like(held.w_gate_up, 0x88))  # codes 8: zero weights
        assert torch.equal(held.down_scale, torch.ones_like(held.down_scale))
    checkpoint_state = {k: v for k, v in float_state.items() if ".mlp.experts." not in k}
    dense = {}
    for layer in moe_layers:
        prefix = f"model.layers.{layer}.mlp."
        state, dense[layer] = checkpoint(layout, symmetric, prefix=prefix, seed=20 + layer)
        state[prefix + "gate.weight"] = float_state[prefix + "gate.weight"]
        checkpoint_state.update(state)
    model.load_state_dict(checkpoint_state)
    for layer in moe_layers:
        moe = model.model.layers[layer].mlp
        assert isinstance(moe, MoE) and moe.layout.shared in ("runner", "none")
        assert_holds_dense(moe, dense[layer])
    if family is _qwen3_moe:  # plain softmax top-k routing: the float64 reference applies
        check_output(model.model.layers[1].mlp, dense[1])
    model.save_pretrained(tmp_path)
    saved = {}
    for file in tmp_path.glob("*.safetensors"):
        saved.update(safetensors_torch.load_file(str(file)))
    assert_same_tensors(saved, checkpoint_state)
    # And from the files, one tensor at a time: the same layer.
    again, *_ = family()
    replace_moe_blocks(again, quant=quant, shared="runner")
    load_experts(again, tmp_path)
    for layer in moe_layers:
        assert_holds_dense(again.model.layers[layer].mlp, dense[layer])


# ------------------------------------------------------------------ memory

_PEAK_SCRIPT = r"""
import json, os, sys, tempfile
import torch
from safetensors.torch import save_file
from torch import nn
from moeroute.bindings.torch import MoE, load_experts
from moeroute.config import RouterConfig
from moeroute.quant import QuantConfig, pack_int4_checkpoint

path, H, I, N, layout, symmetric = sys.argv[1], *map(int, sys.argv[2:5]), sys.argv[5], sys.argv[6] == "1"
quant = QuantConfig("int4", group_size=32, symmetric=symmetric, checkpoint=layout)

def status(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field))

def layer(n):
    holder = nn.Module()
    holder.mlp = MoE(RouterConfig(n, 2), H, I, quant=quant)
    return holder

# One-time set-up (lazy imports, the first safetensors read of a tensor this size, torch's
# first calls) is not the load's: two experts of the same shapes first.
small, state = layer(2), {}
for e in range(2):
    for name, rows, cols in (("gate_proj", I, H), ("up_proj", I, H), ("down_proj", H, I)):
        weight = (torch.zeros(rows, cols // 2, dtype=torch.uint8), torch.ones(rows, cols // 32, dtype=torch.float16))
        if not symmetric:
            weight = (*weight, torch.full((rows, cols // 32), 8, dtype=torch.uint8))
        state.update({f"mlp.experts.{e}.{name}.{k}": v for k, v in pack_int4_checkpoint(weight, quant).items()})
warm = tempfile.mkdtemp()
save_file(state, os.path.join(warm, "model.safetensors"))
load_experts(small, warm)
del state
if sys.argv[7] == "state_dict":  # the layer built and the state dict read before: only the load's own memory
    from safetensors.torch import load_file

    small.load_state_dict(load_file(os.path.join(warm, "model.safetensors")), strict=False)
    model = layer(N)
    state = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            # Resident copies: load_file's tensors may be views of the mapped file, read in only when touched.
            state.update({key: tensor.clone() for key, tensor in load_file(os.path.join(path, name)).items()})
del small
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) reset to the current resident size
before = status("VmRSS")
if sys.argv[7] == "state_dict":
    model.load_state_dict(state, strict=False)
else:
    model = layer(N)
    load_experts(model, path)
held = sum(t.nbytes for t in model.mlp.experts.quantized_tensors().values())
print(json.dumps({"growth": status("VmHWM") - before, "held": held}))
"""


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="reads the peak resident size in /proc")
@pytest.mark.parametrize(
    "layout, symmetric, how",
    [("compressed-tensors", True, "files"), ("awq", False, "files"), ("gptq", False, "state_dict")],
)
def test_load_experts_peak_is_the_packed_bytes_and_ten_percent(tmp_path, layout, symmetric, how):
    """Building a layer of 32 experts of H = 2048, I = 1024 and loading them from the files
    (one module per expert and projection): the resident size grows by at most the layer's
    INT4 bytes (packed integers, scales in the checkpoint's float16, zero points) + 10%.
    compressed-tensors' words are the
    layer's bytes (a copy, no temporaries); AWQ's are reordered nibble by nibble, the most
    temporaries of the three layouts (GPTQ's are a byte transpose). ``load_state_dict`` of the
    same keys (the layer built and the state dict read before the call) writes into the
    layer's own tensors: it grows by at most 10% of the layer's bytes."""
    import subprocess
    import sys
    from pathlib import Path

    from moeroute.quant import pack_int4_checkpoint

    hidden, inter, n = 2048, 1024, 32
    quant = QuantConfig("int4", group_size=32, symmetric=symmetric, checkpoint=layout)
    gen = torch.Generator().manual_seed(0)
    one = {}  # one expert's tensors, packed once and copied for each expert (the values do not matter here)
    for name, rows, cols in (("gate_proj", inter, hidden), ("up_proj", inter, hidden), ("down_proj", hidden, inter)):
        weight = (
            torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=gen),
            torch.rand(rows, cols // 32, generator=gen).half() + 0.01,
        )
        if not symmetric:
            weight = (*weight, torch.randint(0, 16, (rows, cols // 32), dtype=torch.uint8, generator=gen))
        one.update({f"{name}.{key}": tensor for key, tensor in pack_int4_checkpoint(weight, quant).items()})
    state = {f"mlp.experts.{e}.{key}": tensor.clone() for e in range(n) for key, tensor in one.items()}
    write_checkpoint(tmp_path, state, shards=2)
    checkpoint_bytes = sum(t.numel() * t.element_size() for t in state.values())
    del state
    root = Path(__file__).resolve().parents[2]
    args = [str(tmp_path), str(hidden), str(inter), str(n), layout, str(int(symmetric)), how]
    done = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, *args], capture_output=True, text=True, cwd=root, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    # the layer holds the checkpoint's packed bytes and float16 scales (zero points a byte each):
    # QuantConfig.expert_bytes of every expert
    assert figures["held"] == quant.expert_bytes(hidden, inter) * n
    allowed = (0.1 if how == "state_dict" else 1.1) * figures["held"]
    assert figures["growth"] <= allowed, (
        f"{layout}: grew {figures['growth'] / 2**20:.1f} MiB for a layer of {figures['held'] / 2**20:.1f} MiB "
        f"({checkpoint_bytes / 2**20:.1f} MiB in the checkpoint)"
    )


@pytest.mark.interop
def test_kimi_k2_with_fused_shared_slots_loads_and_refuses_to_save_the_checkpoint():
    """shared="auto" fuses Kimi-K2's float shared MLP into INT4 expert slots (quantized with the
    layer's config): the routed experts load from the checkpoint's keys as they are; saving
    the checkpoint, which keeps the shared MLP as a module of its own, is refused."""
    from moeroute.bindings.torch import replace_moe_blocks

    model, layout, symmetric, _ = _kimi_k2()
    float_state = model.state_dict()
    replace_moe_blocks(model, quant=QuantConfig.from_hf(model.config))
    layer = model.model.layers[1].mlp
    assert layer.layout.shared == "fused"
    state, dense = checkpoint(layout, symmetric, prefix="model.layers.1.mlp.", seed=30)
    state.update(
        {k: v for k, v in float_state.items() if ".mlp.experts." not in k and "layers.1.mlp.gate.weight" not in k}
    )
    model.load_state_dict(state)
    held = layer.experts
    for e, (gate, up, down) in enumerate(dense):
        gu = dequantize_int4(held.w_gate_up[e], held.gate_up_scale[e], group_size=G).double().numpy()
        np.testing.assert_array_equal(gu, np.concatenate([gate, up]))
    shared = float_state["model.layers.1.mlp.shared_experts.down_proj.weight"].double()
    slot = dequantize_int4(held.w_down[N], held.down_scale[N], group_size=G).double()
    assert (slot - shared).abs().max() <= held.down_scale[N].max() / 2 + 1e-6  # quantized to the nearest step
    with pytest.raises(RuntimeError, match="fused INT4 expert slots"):
        model.state_dict()
