"""Unpacking INT4 checkpoint tensors (compressed-tensors, GPTQ, AWQ) into moeroute's layout.

Each checkpoint tensor is built here from known integers q, zero points z and scales s by a
packer written from the layout its writer publishes (plain Python integers, word by word),
and the unpacked result must give back exactly q (through moeroute's nibbles), z and s, and
the weight ``(q - z) * s``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeroute.quant import (
    QuantConfig,
    dequantize_int4,
    fold_act_order,
    unpack_awq,
    unpack_compressed_tensors,
    unpack_gptq,
    unpack_int4_checkpoint,
)
from moeroute.quant import int4_checkpoint

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def word(nibbles) -> int:
    """The int32 (two's complement) whose bits 4i..4i+3 hold nibbles[i]."""
    value = sum((int(v) & 0xF) << (4 * i) for i, v in enumerate(nibbles))
    return value - (1 << 32) if value >= 1 << 31 else value


def words(rows) -> torch.Tensor:
    return torch.tensor([[word(n) for n in row] for row in rows], dtype=torch.int32)


def moeroute_q(packed: torch.Tensor) -> np.ndarray:
    """q [N, K] read back from moeroute's bytes: element k in byte k // 2, low nibble when even."""
    b = packed.numpy().astype(np.int64)
    q = np.zeros((b.shape[0], 2 * b.shape[1]), np.int64)
    q[:, 0::2], q[:, 1::2] = b & 15, b >> 4
    return q


def weight(q, z, s, g) -> np.ndarray:
    return (q - np.repeat(z, g, axis=1)) * np.repeat(s.astype(np.float64), g, axis=1)


def integers(seed, n, k, g, symmetric):
    gen = np.random.default_rng(seed)
    q = gen.integers(0, 16, (n, k))
    z = np.full((n, k // g), 8) if symmetric else gen.integers(0, 16, (n, k // g))
    s = torch.from_numpy(gen.random((n, k // g)) + 0.01).to(torch.bfloat16)
    return q, z, s


# -- compressed-tensors --------------------------------------------------------------------------


def ct_pack(q, z, s, symmetric, zero_layout="packed"):
    """compressed-tensors pack-quantized: signed values (q - 8) stored plus 8, eight a word along K;
    the signed zero points (z - 8) stored plus 8, eight a word along N (rows padded with 0)."""
    n, k = q.shape
    signed = q - 8
    packed = words([[signed[r, c + i] + 8 for i in range(8)] for c in range(0, k, 8)] for r in range(n))
    tensors = {"weight_packed": packed, "weight_scale": s, "weight_shape": torch.tensor([n, k])}
    if not symmetric:
        zp = z - 8
        if zero_layout == "packed":
            rows = -(-n // 8) * 8
            padded = np.zeros((rows, zp.shape[1]), np.int64)
            padded[:n] = zp + 8
            tensors["weight_zero_point"] = words(
                [[padded[r + i, col] for i in range(8)] for col in range(zp.shape[1])] for r in range(0, rows, 8)
            )
        else:
            tensors["weight_zero_point"] = torch.from_numpy(zp.astype(np.int8))
    return tensors


@pytest.mark.parametrize(
    "symmetric, zero_layout, n", [(True, None, 16), (False, "packed", 16), (False, "packed", 12), (False, "int8", 12)]
)
def test_compressed_tensors(symmetric, zero_layout, n):
    g = 32
    q, z, s = integers(1, n, 128, g, symmetric)
    tensors = ct_pack(q, z, s, symmetric, zero_layout)
    out = unpack_compressed_tensors(**tensors, group_size=g, symmetric=symmetric, name="m.experts.3.up_proj")
    assert out.packed.dtype == torch.uint8 and out.packed.shape == (n, 64)
    np.testing.assert_array_equal(moeroute_q(out.packed), q)
    assert out.scales.dtype == torch.bfloat16 and torch.equal(out.scales, s)
    assert out.perm is None
    if symmetric:
        assert out.zeros is None and len(out.tensors()) == 2
    else:
        assert out.zeros.dtype == torch.uint8
        np.testing.assert_array_equal(out.zeros.numpy(), z)
    expected = weight(q, z, s.double().numpy(), g)
    np.testing.assert_array_equal(dequantize_int4(*out.tensors(), group_size=g).double().numpy(), expected)
    via_config = unpack_int4_checkpoint(
        tensors, QuantConfig("int4", group_size=g, symmetric=symmetric, checkpoint="compressed-tensors")
    )
    assert all(torch.equal(a, b) for a, b in zip(via_config.tensors(), out.tensors()))


def test_compressed_tensors_symmetric_with_stored_zero_points():
    q, z, s = integers(2, 16, 64, 32, True)
    tensors = ct_pack(q, z, s, False)  # zero points 8 (signed 0) stored
    out = unpack_compressed_tensors(**tensors, group_size=32, symmetric=True)
    assert out.zeros is None
    tensors = ct_pack(q, integers(3, 16, 64, 32, False)[1], s, False)
    with pytest.raises(ValueError, match="weight_zero_point gives the zero point .* symmetric"):
        unpack_compressed_tensors(**tensors, group_size=32, symmetric=True)


def test_compressed_tensors_errors_name_the_key():
    q, z, s = integers(4, 16, 128, 32, False)
    t = ct_pack(q, z, s, False)
    name = "model.layers.1.mlp.experts.0.gate_proj"
    cases = [
        (dict(t, weight_packed=t["weight_packed"].long()), f"{name}.weight_packed must be int32"),
        (dict(t, weight_packed=t["weight_packed"][0]), "weight_packed must have 2 dims"),
        (dict(t, weight_scale=s[:, :2]), r"weight_scale has shape \(16, 2\).*\[16, 4\]"),
        (dict(t, weight_scale=s.to(torch.int32)), "weight_scale must be"),
        (dict(t, weight_shape=torch.tensor([16, 256])), r"weight_shape is \[16, 256\]"),
        (
            dict(t, weight_packed=t["weight_packed"][:, :15], weight_shape=torch.tensor([16, 120])),
            "K = 120 is not a multiple of group_size=32",
        ),
        (dict(t, weight_zero_point=t["weight_zero_point"][:1]), "weight_zero_point has shape"),
        (dict(t, weight_zero_point=t["weight_zero_point"].float()), "weight_zero_point must be"),
        (dict(t, weight_zero_point=None), "weight_zero_point is missing"),
    ]
    for tensors, match in cases:
        with pytest.raises(ValueError, match=match):
            unpack_compressed_tensors(**tensors, group_size=32, symmetric=False, name=name)
    bad = s.clone()
    bad[3, 1] = float("inf")
    with pytest.raises(ValueError, match=r"weight_scale\[3, 1\] is inf"):
        unpack_compressed_tensors(**dict(t, weight_scale=bad), group_size=32, symmetric=False)
    with pytest.raises(ValueError, match="outside -8..7"):
        unpack_compressed_tensors(
            **dict(t, weight_zero_point=torch.full((16, 4), 9, dtype=torch.int8)), group_size=32, symmetric=False
        )


# -- GPTQ ----------------------------------------------------------------------------------------


def gptq_pack(q, z, s, g_idx, v1):
    """GPTQ: qweight [K/8, N] eight input columns a word; qzeros [K/g, N/8] eight output columns a
    word, stored minus one in v1; scales [K/g, N]; element (n, k) uses group g_idx[k]."""
    n, k = q.shape
    groups = z.shape[1]
    qweight = words([[q[col, r + i] for i in range(8)] for col in range(n)] for r in range(0, k, 8))
    stored = (z - 1) if v1 else z
    qzeros = words([[stored[c + i, grp] for i in range(8)] for c in range(0, n, 8)] for grp in range(groups))
    return {
        "qweight": qweight,
        "qzeros": qzeros,
        "scales": torch.from_numpy(s.T.copy()).to(torch.float16),
        "g_idx": torch.tensor(g_idx, dtype=torch.int32),
    }


@pytest.mark.parametrize("checkpoint", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_gptq_without_act_order(checkpoint, symmetric):
    g, n, k = 64, 24, 256
    q, z, _ = integers(5, n, k, g, symmetric)
    if checkpoint == "gptq":
        z = np.maximum(z, 1)  # v1 cannot store z = 0 (it would be -1)
    s = np.random.default_rng(6).random((n, k // g)).astype(np.float16)
    tensors = gptq_pack(q, z, s, np.arange(k) // g, checkpoint == "gptq")
    out = unpack_gptq(**tensors, group_size=g, symmetric=symmetric, checkpoint=checkpoint)
    assert out.perm is None
    np.testing.assert_array_equal(moeroute_q(out.packed), q)
    assert out.scales.dtype == torch.float16 and out.scales.shape == (n, k // g)
    np.testing.assert_array_equal(out.scales.numpy(), s)
    if symmetric:
        assert out.zeros is None
    else:
        np.testing.assert_array_equal(out.zeros.numpy(), z)
    np.testing.assert_array_equal(dequantize_int4(*out.tensors(), group_size=g).double().numpy(), weight(q, z, s, g))
    # Without g_idx: the same.
    del tensors["g_idx"]
    again = unpack_gptq(**tensors, group_size=g, symmetric=symmetric, checkpoint=checkpoint)
    assert all(torch.equal(a, b) for a, b in zip(again.tensors(), out.tensors()))


def test_gptq_act_order_makes_groups_contiguous():
    """desc_act: column k belongs to group g_idx[k], scattered; canonical column j is perm[j]."""
    g, n, k = 32, 16, 128
    gen = np.random.default_rng(7)
    q, z, _ = integers(8, n, k, g, False)
    z = np.maximum(z, 1)
    s = gen.random((n, k // g)).astype(np.float16)
    order = gen.permutation(k)  # GPTQ's quantization order; group i // g for the i-th column quantized
    g_idx = np.empty(k, np.int64)
    g_idx[order] = np.arange(k) // g
    w = (q - z[:, g_idx]) * s.astype(np.float64)[:, g_idx]  # the checkpoint's weight, column by column
    tensors = gptq_pack(q, z, s, g_idx, v1=True)
    out = unpack_gptq(**tensors, group_size=g, symmetric=False, name="experts.2.down_proj")
    perm = out.perm.numpy()
    assert sorted(perm.tolist()) == list(range(k))
    assert np.all(np.diff(g_idx[perm]) >= 0) and np.all(g_idx[perm] == np.arange(k) // g)
    np.testing.assert_array_equal(moeroute_q(out.packed), q[:, perm])
    np.testing.assert_array_equal(out.zeros.numpy(), z)
    np.testing.assert_array_equal(out.scales.numpy(), s)
    canonical = dequantize_int4(*out.tensors(), group_size=g).double().numpy()
    np.testing.assert_array_equal(canonical, w[:, perm])
    # The layer multiplies the permuted activations: the same product.
    x = gen.standard_normal((3, k))
    np.testing.assert_allclose(x[:, perm] @ canonical.T, x @ w.T, rtol=1e-12, atol=1e-12)


def test_gptq_errors_name_the_key():
    g, n, k = 32, 16, 128
    q, z, _ = integers(9, n, k, g, True)
    s = np.ones((n, k // g), np.float16)
    t = gptq_pack(q, z, s, np.arange(k) // g, v1=True)
    name = "model.layers.0.mlp.experts.5.gate_proj"
    uneven = np.arange(k) // g
    uneven[0] = 1  # group 0 holds 31 columns, group 1 holds 33
    cases = [
        (dict(t, qweight=t["qweight"].to(torch.int64)), f"{name}.qweight must be int32"),
        (
            dict(t, qzeros=t["qzeros"][:, :1]),
            r"qzeros has shape \(4, 1\); \[K/g, N/8\] with group_size=32 needs \[4, 2\]",
        ),
        (dict(t, scales=t["scales"].T), r"scales has shape \(16, 4\)"),
        (dict(t, scales=t["scales"].to(torch.float64)), "scales must be"),
        (dict(t, g_idx=t["g_idx"][:-1]), r"g_idx has shape \(127,\)"),
        (dict(t, g_idx=t["g_idx"].float()), "g_idx must be int32/int64"),
        (dict(t, g_idx=torch.full((k,), 4)), r"g_idx\[0\] is 4, outside the 4 groups"),
        (dict(t, g_idx=torch.from_numpy(uneven)), "g_idx gives group 0 31 columns"),
        (dict(t, qweight=t["qweight"][:3]), "K = 24 is not a multiple of group_size=32"),
    ]
    for tensors, match in cases:
        with pytest.raises(ValueError, match=match):
            unpack_gptq(**tensors, group_size=g, symmetric=True, name=name)
    asym = gptq_pack(q, np.full_like(z, 5), s, np.arange(k) // g, v1=True)
    with pytest.raises(ValueError, match=rf"{name}.qzeros gives the zero point 5 .* symmetric"):
        unpack_gptq(**asym, group_size=g, symmetric=True, name=name)
    with pytest.raises(ValueError, match="checkpoint='marlin'"):
        unpack_gptq(**t, group_size=g, symmetric=True, checkpoint="marlin")


# -- AWQ -----------------------------------------------------------------------------------------


def awq_pack(q, z, s):
    """AWQ GEMM: the [K, N] integers (q transposed), eight output columns a word in the order
    0, 2, 4, 6, 1, 3, 5, 7 (nibble i holds column 8c + ORDER[i]); zero points likewise."""
    qt, zt = q.T, z.T
    qweight = words([[row[c + AWQ_ORDER[i]] for i in range(8)] for c in range(0, row.shape[0], 8)] for row in qt)
    qzeros = words([[row[c + AWQ_ORDER[i]] for i in range(8)] for c in range(0, row.shape[0], 8)] for row in zt)
    return {"qweight": qweight, "qzeros": qzeros, "scales": torch.from_numpy(s.T.copy())}


def test_awq():
    g, n, k = 128, 40, 256
    q, z, _ = integers(10, n, k, g, False)
    s = np.random.default_rng(11).random((n, k // g)).astype(np.float16)
    tensors = awq_pack(q, z, s)
    assert tensors["qweight"].shape == (k, n // 8) and tensors["qzeros"].shape == (k // g, n // 8)
    out = unpack_awq(**tensors, group_size=g)
    np.testing.assert_array_equal(moeroute_q(out.packed), q)
    np.testing.assert_array_equal(out.zeros.numpy(), z)
    np.testing.assert_array_equal(out.scales.numpy(), s)
    np.testing.assert_array_equal(dequantize_int4(*out.tensors(), group_size=g).double().numpy(), weight(q, z, s, g))
    via_config = unpack_int4_checkpoint(
        tensors, QuantConfig.from_hf({"quant_method": "awq", "bits": 4, "group_size": g})
    )
    assert all(torch.equal(a, b) for a, b in zip(via_config.tensors(), out.tensors()))


def test_awq_steps_agree(monkeypatch):
    q, z, _ = integers(12, 64, 128, 32, False)
    s = np.ones((64, 4), np.float16)
    tensors = awq_pack(q, z, s)
    whole = unpack_awq(**tensors, group_size=32)
    monkeypatch.setattr(int4_checkpoint, "_STEP_ELEMENTS", 1000)  # a few words of columns a step
    stepped = unpack_awq(**tensors, group_size=32)
    assert torch.equal(whole.packed, stepped.packed)
    gptq = gptq_pack(q, np.maximum(z, 1), s, np.arange(128) // 32, v1=True)
    assert torch.equal(
        unpack_gptq(**gptq, group_size=32, symmetric=False).packed,
        moeroute_packed(q),
    )


def moeroute_packed(q) -> torch.Tensor:
    return torch.from_numpy((q[:, 0::2] + 16 * q[:, 1::2]).astype(np.uint8))


def test_awq_errors_name_the_key():
    q, z, _ = integers(13, 16, 64, 32, False)
    t = awq_pack(q, z, np.ones((16, 2), np.float16))
    cases = [
        (dict(t, qweight=t["qweight"].to(torch.int16)), "experts.1.up_proj.qweight must be int32"),
        (dict(t, qzeros=t["qzeros"][:1]), r"qzeros has shape \(1, 2\)"),
        (dict(t, scales=t["scales"][:, :8]), r"scales has shape \(2, 8\); \[K/g, N\]"),
    ]
    for tensors, match in cases:
        with pytest.raises(ValueError, match=match):
            unpack_awq(**tensors, group_size=32, name="experts.1.up_proj")


def test_unpack_by_config_names_missing_and_extra_keys():
    q, z, _ = integers(14, 16, 64, 32, False)
    t = awq_pack(q, z, np.ones((16, 2), np.float16))
    awq = QuantConfig("int4", group_size=32, symmetric=False, checkpoint="awq")
    with pytest.raises(KeyError, match="experts.0.down_proj.qzeros is missing"):
        unpack_int4_checkpoint({"qweight": t["qweight"], "scales": t["scales"]}, awq, name="experts.0.down_proj")
    with pytest.raises(ValueError, match="experts.0.down_proj.g_idx is not a tensor of a awq INT4 weight"):
        unpack_int4_checkpoint(dict(t, g_idx=torch.zeros(64)), awq, name="experts.0.down_proj")
    with pytest.raises(ValueError, match="names no checkpoint layout"):
        unpack_int4_checkpoint(t, QuantConfig("int4", group_size=32))
    with pytest.raises(ValueError, match="format 'int4'"):
        unpack_int4_checkpoint(t, QuantConfig("mxfp4"))


def test_fold_act_order_moves_the_down_permutation_into_gate_and_up():
    """An expert MLP with GPTQ act order: after the fold, down has no permutation and the
    expert, with the hidden columns gathered by the shared gate/up permutation, is unchanged."""
    g, hidden, inter = 32, 64, 96
    gen = np.random.default_rng(15)

    def act_order(k):
        order = gen.permutation(k)
        g_idx = np.empty(k, np.int64)
        g_idx[order] = np.arange(k) // g
        return g_idx

    def gptq_weight(n, k, g_idx):
        q, z, _ = integers(int(gen.integers(1 << 30)), n, k, g, False)
        z = np.maximum(z, 1)
        s = (gen.random((n, k // g)) / 8).astype(np.float16)
        dense = (q - z[:, g_idx]) * s.astype(np.float64)[:, g_idx]
        return unpack_gptq(**gptq_pack(q, z, s, g_idx, v1=True), group_size=g, symmetric=False), dense

    hidden_order = act_order(hidden)
    gate, w_gate = gptq_weight(inter, hidden, hidden_order)
    up, w_up = gptq_weight(inter, hidden, hidden_order)
    down, w_down = gptq_weight(hidden, inter, act_order(inter))
    x = gen.standard_normal((4, hidden))

    def silu(v):
        return v / (1 + np.exp(-v))

    expected = (silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T
    gate2, up2, down2 = fold_act_order(gate, up, down)
    assert down2.perm is None and torch.equal(gate2.perm, gate.perm) and torch.equal(down2.packed, down.packed)
    dq = [dequantize_int4(*w.tensors(), group_size=g).double().numpy() for w in (gate2, up2, down2)]
    xp = x[:, gate2.perm.numpy()]  # the gather a kernel does on the hidden columns
    got = (silu(xp @ dq[0].T) * (xp @ dq[1].T)) @ dq[2].T
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-10)
    other, _ = gptq_weight(inter, hidden, act_order(hidden))
    with pytest.raises(ValueError, match="experts.4.gate_proj and experts.4.up_proj have different act orders"):
        fold_act_order(gate, other, down, name="experts.4")
    with pytest.raises(ValueError, match="down_proj has 96 input columns"):
        fold_act_order(gate._replace(packed=gate.packed[:64]), up, down)
