"""GPTQ act order on gate_proj/up_proj: the INT4 layer's per-expert hidden-column order.

With ``desc_act`` GPTQ stores each expert's gate_proj and up_proj with one ``g_idx`` (the
group of each hidden column), a permutation of contiguous groups. The checkpoints here are
written by the packers of test_int4_checkpoint (plain Python, from GPTQ's published layout)
from known integers with a random such ``g_idx`` per expert (one expert without act order,
to mix both), and down_proj's own act order in some cases. The reference is the plain
float64 MoE of test_int4_loading on the dequantized weights in the checkpoint's own column
order, ``(q - z[:, g_idx]) * s[:, g_idx]``: g_idx applied directly, no permutation.
Tolerances (max abs diff / max abs reference): 1e-5 with float32 activations (float32 sums
in another order); 2e-2 with bfloat16 ones (the layer's bfloat16 intermediate and output),
against the reference of the bfloat16-rounded inputs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import _int4_act_order_workers as workers
from helpers.gloo import spawn_group
from moeroute.bindings.torch import load_experts
from moeroute.experts.formats.int4 import act_order_rows, int4_experts_forward
from moeroute.quant import dequantize_int4, pack_gptq, unpack_gptq
from test_int4_checkpoint import gptq_pack
from test_int4_loading import (
    G,
    H,
    Holder,
    I,
    K,
    N,
    assert_same_tensors,
    assert_unchanged,
    loaded,
    projection,
    quant_of,
    reference,
    saved_after_load,
    snapshot,
    write_checkpoint,
)

RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
#: Expert 1 keeps the natural order (g_idx = k // g): its permutation row is the identity.
PLAIN = 1


def act_order_g_idx(rng, cols):
    """A random act-order g_idx: every group g columns, scattered."""
    g_idx = np.empty(cols, np.int64)
    g_idx[rng.permutation(cols)] = np.arange(cols) // G
    return g_idx


def checkpoint(layout="gptq_v2", symmetric=False, seed=0, down_act_order=False, prefix="mlp."):
    """(state dict of per-expert GPTQ keys and the router, dense weights per expert, g_idx per expert)."""
    rng = np.random.default_rng(seed)
    state, dense, orders = {}, [], []
    for e in range(N):
        order = np.arange(H) // G if e == PLAIN else act_order_g_idx(rng, H)
        weights = []
        for name, rows, cols in (("gate_proj", I, H), ("up_proj", I, H), ("down_proj", H, I)):
            g_idx = order if name != "down_proj" else (act_order_g_idx(rng, I) if down_act_order else None)
            tensors, w = projection(rng, rows, cols, layout, symmetric, None, g_idx)
            state.update({f"{prefix}experts.{e}.{name}.{k}": v for k, v in tensors.items()})
            weights.append(w)
        dense.append(weights)
        orders.append(order)
    state[prefix + "gate.weight"] = torch.from_numpy(rng.standard_normal((N, H)).astype(np.float32) * 0.1)
    return state, dense, orders


def check_output(layer, dense, tokens=6, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen).to(dtype)
    logits = torch.randn(tokens, N, generator=gen)
    got = layer(x, logits).double().numpy()
    want = reference(x, logits, dense)
    assert np.abs(got - want).max() <= RTOL[dtype] * np.abs(want).max()


# ------------------------------------------------------------------ loading and the forward


@pytest.mark.parametrize("layout, symmetric", [("gptq", True), ("gptq_v2", False)])
@pytest.mark.parametrize("down_act_order", [False, True], ids=["", "down-act-order"])
def test_gate_up_act_order_loads_and_computes_the_checkpoint_s_function(layout, symmetric, down_act_order):
    state, dense, orders = checkpoint(layout, symmetric, seed=2, down_act_order=down_act_order)
    for gemm in ("rows", "blocks"):
        model = Holder(quant_of(layout, symmetric), gemm=gemm)
        model.load_state_dict(state)
        held = model.mlp.experts
        # The layer keeps each expert's stable argsort of its g_idx (the identity for expert 1).
        assert held.gate_up_perm.dtype == torch.int32 and tuple(held.gate_up_perm.shape) == (N, H)
        for e in range(N):
            np.testing.assert_array_equal(held.gate_up_perm[e].numpy(), np.argsort(orders[e], kind="stable"))
        np.testing.assert_array_equal(held.gate_up_perm[PLAIN].numpy(), np.arange(H))
        # Its gate_up weights hold the checkpoint's columns in that order, groups contiguous.
        zeros = None if held.gate_up_zero is None else held.gate_up_zero[0]
        gate_up = dequantize_int4(held.w_gate_up[0], held.gate_up_scale[0], zeros, group_size=G).double().numpy()
        perm = np.argsort(orders[0], kind="stable")
        down_rows = np.arange(I)
        if down_act_order:
            down_rows = np.argsort(state["mlp.experts.0.down_proj.g_idx"].numpy(), kind="stable")
        np.testing.assert_array_equal(gate_up[:I], dense[0][0][down_rows][:, perm])
        # Few rows per expert (registers), many (decoded once), bfloat16 activations.
        for tokens, dtype in ((1, torch.float32), (6, torch.float32), (64, torch.float32), (24, torch.bfloat16)):
            check_output(model.mlp, dense, tokens, dtype)


def test_the_forward_gathers_each_row_in_its_expert_s_order():
    """`int4_experts_forward` with ``gate_up_perm`` against a plain float64 MoE on the dense
    weights in the hidden columns' order (the held ones with their columns put back)."""
    gen = torch.Generator().manual_seed(7)
    packed = torch.randint(0, 256, (N, 2 * I, H // 2), dtype=torch.uint8, generator=gen)
    scales = torch.rand(N, 2 * I, H // G, generator=gen) * 0.02 + 0.005
    down = (
        torch.randint(0, 256, (N, H, I // 2), dtype=torch.uint8, generator=gen),
        torch.rand(N, H, I // G, generator=gen) * 0.02 + 0.005,
    )
    perm = torch.stack([torch.randperm(H, generator=gen) for _ in range(N)]).to(torch.int32)
    held = dequantize_int4(packed, scales, group_size=G).double()
    natural = torch.empty_like(held)
    for e in range(N):
        natural[e][:, perm[e].long()] = held[e]  # canonical column j is hidden column perm[e, j]
    down_dense = dequantize_int4(*down, group_size=G).double()
    x = torch.randn(9, H, generator=gen)
    ids = torch.stack([torch.randperm(N, generator=gen)[:K] for _ in range(9)])
    ids[0, 1] = N  # held elsewhere: not computed here
    weights = torch.rand(9, K, generator=gen)
    want = torch.zeros(9, H, dtype=torch.float64)
    for t in range(9):
        for k in range(K):
            e = int(ids[t, k])
            if e < N:
                h = natural[e] @ x[t].double()
                want[t] += float(weights[t, k]) * (down_dense[e] @ (h[:I] * torch.sigmoid(h[:I]) * h[I:]))
    for strategy in ("rows", "blocks"):
        got = int4_experts_forward(x, weights, ids, (packed, scales), down, G, strategy=strategy, gate_up_perm=perm)
        assert (got.double() - want).abs().max() <= RTOL[torch.float32] * want.abs().max()
    with pytest.raises(ValueError, match=r"gate_up_perm has shape \(4, 127\), expected \[4, 128\]"):
        int4_experts_forward(x, weights, ids, (packed, scales), down, G, gate_up_perm=perm[:, 1:])


def test_without_a_permutation_the_hook_hands_the_inputs_through():
    x = torch.randn(3, H)
    tokens = torch.tensor([2, 0, 1])
    rows, row_tokens = act_order_rows(x, tokens, torch.tensor([0, 3]), [0], None)
    assert rows is x and row_tokens is tokens
    perm = torch.randperm(H).to(torch.int32)[None]
    rows, row_tokens = act_order_rows(x, tokens, torch.tensor([0, 3]), [0], perm)
    assert torch.equal(rows, x[tokens][:, perm[0].long()]) and torch.equal(row_tokens, torch.arange(3))
    # Enough rows for the threaded gather (moeroute.experts.cpu.act_order), every activation dtype.
    gen = torch.Generator().manual_seed(15)
    perm = torch.stack([torch.randperm(H, generator=gen) for _ in range(N)]).to(torch.int32)
    tokens = torch.randint(0, 300, (700,), generator=gen)
    offsets = torch.tensor([0, 200, 200, 650, 700])  # expert 1 without rows
    experts = torch.repeat_interleave(torch.arange(N), offsets.diff())
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(300, H, generator=gen).to(dtype)
        rows, row_tokens = act_order_rows(x, tokens, offsets.numpy(), [0, 2, 3], perm)
        want = torch.stack([x[tokens[m]][perm[experts[m]].long()] for m in range(700)])
        assert rows.dtype == dtype and torch.equal(rows, want) and torch.equal(row_tokens, torch.arange(700))


def test_a_layer_without_act_order_keeps_no_permutation():
    state, dense, _ = checkpoint(seed=3)
    plain = {k: v for k, v in state.items() if not k.endswith("_proj.g_idx")}
    model = Holder(quant_of("gptq_v2", False))
    model.load_state_dict(state)
    assert model.mlp.experts.gate_up_perm is not None
    model.load_state_dict(
        {
            **plain,
            **{
                f"mlp.experts.{e}.{p}.g_idx": torch.arange(c, dtype=torch.int32) // G
                for e in range(N)
                for p, c in (("gate_proj", H), ("up_proj", H), ("down_proj", I))
            },
        }
    )
    assert model.mlp.experts.gate_up_perm is None


# ------------------------------------------------------------------ refusals


def test_inconsistent_g_idx_is_refused_naming_the_key():
    state, _, _ = checkpoint(seed=4)
    g_idx = state["mlp.experts.2.up_proj.g_idx"]
    g_idx[g_idx == 1] = 0  # group 0 gets 2g columns, group 1 none
    state["mlp.experts.2.gate_proj.g_idx"] = g_idx.clone()
    model = Holder(quant_of("gptq_v2", False))
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"mlp\.experts\.2\.gate_proj\.g_idx gives group 0 64 columns"):
        model.load_state_dict(state)
    assert_unchanged(model, before)


def test_gate_and_up_with_different_g_idx_are_refused_naming_both():
    state, _, _ = checkpoint(seed=5)
    state["mlp.experts.3.up_proj.g_idx"] = torch.from_numpy(act_order_g_idx(np.random.default_rng(6), H)).to(
        torch.int32
    )
    model = Holder(quant_of("gptq_v2", False))
    before = snapshot(model)
    with pytest.raises(
        ValueError, match=r"mlp\.experts\.3\.gate_proj\.g_idx and mlp\.experts\.3\.up_proj\.g_idx give different"
    ):
        model.load_state_dict(state)
    assert_unchanged(model, before)
    # Act order on one of the two only.
    state, _, _ = checkpoint(seed=5)
    state["mlp.experts.0.up_proj.g_idx"] = torch.arange(H, dtype=torch.int32) // G
    with pytest.raises(ValueError, match=r"mlp\.experts\.0\.gate_proj\.g_idx and mlp\.experts\.0\.up_proj\.g_idx"):
        model.load_state_dict(state)
    assert_unchanged(model, before)


# ------------------------------------------------------------------ saving back


def test_pack_gptq_writes_the_act_order_back_byte_for_byte():
    rng = np.random.default_rng(8)
    q, z = rng.integers(0, 16, (I, H)), rng.integers(1, 16, (I, H // G))
    s = (rng.random((I, H // G)) * 0.02 + 0.005).astype(np.float16)
    g_idx = act_order_g_idx(rng, H)
    tensors = gptq_pack(q, z, s, g_idx, False)
    weight = unpack_gptq(**tensors, group_size=G, symmetric=False, checkpoint="gptq_v2")
    assert weight.perm is not None
    assert_same_tensors(pack_gptq(weight, group_size=G, symmetric=False, checkpoint="gptq_v2"), tensors)
    with pytest.raises(ValueError, match=r"act-order perm, which GPTQ stores as g_idx"):
        pack_gptq(weight, group_size=G, symmetric=False, checkpoint="gptq_v2", g_idx=False)


@pytest.mark.parametrize("layout, symmetric", [("gptq", True), ("gptq_v2", False)])
def test_state_dict_round_trip_is_byte_identical(layout, symmetric):
    state, dense, _ = checkpoint(layout, symmetric, seed=9)
    saved = saved_after_load(quant_of(layout, symmetric), state)
    assert_same_tensors(saved, state)
    check_output(loaded(quant_of(layout, symmetric), saved), dense)


def test_down_act_order_too_keeps_gate_and_up_g_idx():
    state, dense, _ = checkpoint(seed=10, down_act_order=True)
    saved = saved_after_load(quant_of("gptq_v2", False), state)
    for e in range(N):
        for p in ("gate_proj", "up_proj"):
            assert torch.equal(saved[f"mlp.experts.{e}.{p}.g_idx"], state[f"mlp.experts.{e}.{p}.g_idx"])
    check_output(loaded(quant_of("gptq_v2", False), saved), dense)


def test_moeroute_names_carry_the_permutation():
    state, dense, _ = checkpoint(seed=11)
    model = Holder(quant_of("gptq_v2", False))
    model.load_state_dict(state)
    own = model.state_dict()
    assert torch.equal(own["mlp.experts.gate_up_perm"], model.mlp.experts.gate_up_perm)
    again = Holder(quant_of("gptq_v2", False))
    again.load_state_dict(own)
    assert torch.equal(again.mlp.experts.gate_up_perm, model.mlp.experts.gate_up_perm)
    check_output(again.mlp, dense)
    bad = dict(own)
    bad["mlp.experts.gate_up_perm"] = torch.zeros(N, H, dtype=torch.int32)
    bad["mlp.router_weight"] = own["mlp.router_weight"] + 1.0
    target = Holder(quant_of("gptq_v2", False))
    before = {key: value.clone() for key, value in target.state_dict().items()}
    with pytest.raises(ValueError, match=r"mlp\.experts\.gate_up_perm\[0\] is not a permutation"):
        target.load_state_dict(bad)
    # refused before anything is copied: the router and the experts as they were
    after = target.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[key], after[key]) for key in before)
    # Weights without one (moeroute's names, another layer's) drop it.
    plain = Holder(quant_of("gptq_v2", False)).state_dict()
    again.load_state_dict(plain)
    assert again.mlp.experts.gate_up_perm is None


# ------------------------------------------------------------------ files, replicas, ranks


def test_load_experts_with_replicas(tmp_path):
    state, dense, orders = checkpoint(seed=12, down_act_order=True)
    write_checkpoint(tmp_path, state, shards=2)
    model = Holder(quant_of("gptq_v2", False), physical_to_logical=[2, 2, 0, 1, 3])
    load_experts(model, tmp_path)
    perm = model.mlp.experts.gate_up_perm
    for local, e in enumerate(model.mlp.routed_expert_ids()):
        np.testing.assert_array_equal(perm[local].numpy(), np.argsort(orders[e], kind="stable"))
    check_output(model.mlp, dense, tokens=12)


def test_expert_parallel_ranks_hold_their_experts_permutations(tmp_path):
    state, dense, orders = checkpoint(seed=13)
    gen = torch.Generator().manual_seed(14)
    x, logits = torch.randn(2, 5, H, generator=gen), torch.randn(2, 5, N, generator=gen)
    results = spawn_group(workers.worker, 2, tmp_path, (state, (H, I, N, K, G), x, logits), join_timeout_s=600)
    for rank, result in enumerate(results):
        ids = result["local_experts"]
        assert len(ids) == N // 2
        want = np.stack([np.argsort(orders[e], kind="stable") for e in ids])
        np.testing.assert_array_equal(result["gate_up_perm"].numpy(), want)
        ref = reference(x[rank], logits[rank], dense)
        assert np.abs(result["out"].double().numpy() - ref).max() <= RTOL[torch.float32] * np.abs(ref).max()
