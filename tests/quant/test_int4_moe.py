"""INT4 (w4a16) experts: `int4_experts_forward` and MoE(quant=QuantConfig("int4", ...)).

The reference is moeroute.quant.reference's float64 layer on the same packed integers,
scales and zero points (each weight ``(q - z) * s`` from the definition), routed with
moeroute.routing.reference. Tolerances (max abs diff / max abs reference): 1e-5 with float32
activations (float32 sums in another order), 1e-2 with bfloat16 ones (the output, and the
intermediate before the down projection, rounded to bfloat16: 2 ** -8 relative each).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers.modules import CountingMLP
from helpers.reference import randn, rel_error
from moeroute import cpu_features
from moeroute.bindings.torch import MoE
from moeroute.experts.cpu import int4 as cpu_int4
from moeroute.experts.cpu import mxfp4 as cpu_mxfp4
from moeroute.config import RouterConfig
from moeroute.experts.choose import INT4_BF16_ROWS_MAX_MEAN_ROWS
from moeroute.experts.formats import int4 as int4_formats
from moeroute.experts.formats.int4 import int4_experts_forward
from moeroute.quant import QuantConfig, quantize_int4
from moeroute.quant.reference import int4_moe_experts_reference
from moeroute.routing import reference

H, I, N, K = 256, 128, 8, 2
RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
ROUTER = RouterConfig(N, K, "softmax", renormalize=True)


def experts(group, symmetric, seed=0, inter=I, scale_dtype=torch.bfloat16):
    gate_up = quantize_int4(
        randn(N, 2 * inter, H, seed=seed, scale=0.1), group_size=group, symmetric=symmetric, scale_dtype=scale_dtype
    )
    down = quantize_int4(
        randn(N, H, inter, seed=seed + 1, scale=0.1), group_size=group, symmetric=symmetric, scale_dtype=scale_dtype
    )
    return gate_up, down


def routed(tokens, seed=0):
    """ids with some outside [0, N) (held by another rank), router weights."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(-2, N + 2, (tokens, K), generator=gen, dtype=torch.int32)
    return ids, torch.rand(tokens, K, generator=gen)


@pytest.mark.parametrize(
    "decode",
    [
        pytest.param("simd", marks=pytest.mark.skipif(not cpu_mxfp4.SIMD, reason="no AVX2, FMA and F16C here")),
        "portable",
    ],
)
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_row_decode_is_the_definition_bit_for_bit(group, symmetric, decode):
    """Each value (float(q) - z) * s in float32, in split order, with float32 scales (the
    product rounded once) and every code in both nibbles."""
    rng = np.random.default_rng(group + symmetric)
    rows, cols = 5, 256
    blocks = rng.integers(0, 256, (rows, cols // 32, 16), dtype=np.uint8)
    blocks[0, 0] = np.arange(0, 256, 16) + np.arange(16)
    params = np.empty((rows, 1 if symmetric else 2, cols // group), np.float32)
    params[:, 0] = rng.standard_normal((rows, cols // group)) * 0.0123
    params[1, 0, 0] = 0.0
    if not symmetric:
        params[:, 1] = rng.integers(0, 16, (rows, cols // group))
    out = np.full((rows, cols), np.nan, np.float32)
    decoder = cpu_int4._decode_row_split_vector if decode == "simd" else cpu_int4._decode_row_split_portable
    for r in range(rows):
        decoder(blocks[r], params[r], out[r])
    q = np.concatenate([blocks & 0x0F, blocks >> 4], axis=2).astype(np.float32)  # split order
    z = np.float32(8.0) if symmetric else np.repeat(params[:, 1], group // 32, axis=1)[:, :, None]
    s = np.repeat(params[:, 0], group // 32, axis=1)[:, :, None]
    want = ((q - z) * s).reshape(rows, cols)
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize(
    "dots",
    [
        pytest.param("simd", marks=pytest.mark.skipif(not cpu_mxfp4.SIMD, reason="no AVX2, FMA and F16C here")),
        "portable",
    ],
)
@pytest.mark.parametrize("rows", [(0,), (3, 1), (2, 2, 5), (5, 0, 4, 1)])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [32, 128])
def test_block_dots_match_the_definition(group, symmetric, rows, dots):
    """The few-row kernels' dot (a packed row decoded in registers) against float64 sums of
    x * (q - z) * s, every code in both nibbles."""
    rng = np.random.default_rng(group + len(rows))
    cols = 256
    blocks = rng.integers(0, 256, (cols // 32, 16), dtype=np.uint8)
    blocks[0] = np.arange(0, 256, 16) + np.arange(16)
    params = np.empty((1 if symmetric else 2, cols // group), np.float32)
    params[0] = rng.standard_normal(cols // group) * 0.0123
    if not symmetric:
        params[1] = rng.integers(0, 16, cols // group)
    x = rng.standard_normal((6, cols)).astype(np.float32)
    xs = np.empty_like(x)
    cpu_mxfp4.split_blocks(x, xs)
    out = np.full(4, np.nan, np.float32)
    (cpu_int4.dots_simd if dots == "simd" else cpu_int4.dots_portable)(blocks, params, xs, rows, out)
    q = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(-1).astype(np.float64)  # natural order
    z = 8.0 if symmetric else np.repeat(params[1].astype(np.float64), group)
    w = (q - z) * np.repeat(params[0].astype(np.float64), group)
    expected = x.astype(np.float64)[list(rows)] @ w
    np.testing.assert_array_less(np.abs(out[: len(rows)] - expected) / np.abs(expected).max(), 1e-5)


@pytest.mark.parametrize("strategy", ["rows", "blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_forward_matches_the_float64_reference(group, symmetric, dtype, strategy):
    gate_up, down = experts(group, symmetric, seed=group + symmetric)
    x = randn(9, H, seed=5).to(dtype)
    ids, weights = routed(9, seed=group)
    out = int4_experts_forward(x, weights, ids, gate_up, down, group, strategy=strategy)
    assert out.dtype == dtype and out.shape == x.shape
    expected = int4_moe_experts_reference(x.float(), weights, ids, gate_up, down, group, intermediate_dtype=dtype)
    assert rel_error(out.float(), expected) < RTOL[dtype]


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
def test_every_scale_dtype_and_auto_past_the_row_bound(scale_dtype):
    gate_up, down = experts(64, False, seed=3, scale_dtype=scale_dtype)
    x = randn(80, H, seed=6)  # 160 slots over 8 experts: prefill-sized, "auto" still takes "rows"
    ids, weights = routed(80, seed=1)
    expected = int4_moe_experts_reference(x, weights, ids, gate_up, down, 64)
    for strategy in ("auto", "rows", "blocks"):
        out = int4_experts_forward(x, weights, ids, gate_up, down, 64, strategy=strategy)
        assert rel_error(out, expected) < RTOL[torch.float32]


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_bfloat16_decode_is_the_float32_decode_rounded_once(group, symmetric):
    from moeroute.experts.cpu import decode_bf16

    blocks = np.random.default_rng(group).integers(0, 256, (5, 2 * 128 // 32, 16), dtype=np.uint8)
    params = np.empty((5, 1 if symmetric else 2, 256 // group), np.float32)
    params[:, 0] = np.random.default_rng(1).standard_normal(params[:, 0].shape) * 0.0123
    if not symmetric:
        params[:, 1] = np.random.default_rng(2).integers(0, 16, params[:, 1].shape)
    out = np.full((4, 256), 0xFFFF, np.uint16)
    decode_bf16.dequantize_rows_bf16(blocks, params, 1, 4, out)
    # the definition in float64, in `split_blocks` order: per block of 32 its 16 low then its 16 high nibbles
    q = np.concatenate([blocks & 0x0F, blocks >> 4], axis=-1).reshape(5, 256).astype(np.float64)
    z = 8.0 if symmetric else np.repeat(params[:, 1].astype(np.float64), group, axis=1)
    w = torch.from_numpy((q - z) * np.repeat(params[:, 0].astype(np.float64), group, axis=1))
    expected = w.float().to(torch.bfloat16).view(torch.uint16).numpy()  # float32 product, one bfloat16 rounding
    np.testing.assert_array_equal(out[:3], expected[1:4])
    assert (out[3] == 0xFFFF).all()  # rows past row_stop - row_start are left alone


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_bfloat16_blocks_past_the_row_bound(group, symmetric, monkeypatch):
    """bfloat16 activations with ~53 rows per expert: "auto" takes "blocks" where the CPU has
    bfloat16 dot instructions (the weights decoded to bfloat16 for oneDNN's GEMMs), within the
    bfloat16 tolerance of the float64 reference."""
    # chunks of 100 gate_up rows (200 down rows): several per weight, the last one partial
    monkeypatch.setattr(int4_formats, "BF16_CHUNK_BYTES", 100 * 2 * H)
    gate_up, down = experts(group, symmetric, seed=7 + group + symmetric)
    x = randn(320, H, seed=9).to(torch.bfloat16)
    ids, weights = routed(320, seed=group + 1)
    counts = torch.bincount(ids[(ids >= 0) & (ids < N)].long(), minlength=N)
    assert counts.sum() > INT4_BF16_ROWS_MAX_MEAN_ROWS * (counts > 0).sum()
    expected = int4_moe_experts_reference(
        x.float(), weights, ids, gate_up, down, group, intermediate_dtype=torch.bfloat16
    )
    blocks = int4_experts_forward(x, weights, ids, gate_up, down, group, strategy="blocks")
    assert blocks.dtype == torch.bfloat16
    assert rel_error(blocks.float(), expected) < RTOL[torch.bfloat16]
    auto = int4_experts_forward(x, weights, ids, gate_up, down, group)
    if cpu_features.BFLOAT16_INSTRUCTIONS:
        assert torch.equal(auto, blocks)
    else:
        assert torch.equal(auto, int4_experts_forward(x, weights, ids, gate_up, down, group, strategy="rows"))


def test_one_thread_and_two_give_the_same_bits():
    gate_up, down = experts(32, True)
    x = randn(12, H, seed=8)
    ids, weights = routed(12, seed=2)
    outs = []
    previous = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            outs.append(int4_experts_forward(x, weights, ids, gate_up, down, 32, strategy="rows"))
        finally:
            torch.set_num_threads(previous)
    assert torch.equal(outs[0], outs[1])
    expected = int4_moe_experts_reference(x, weights, ids, gate_up, down, 32)
    assert rel_error(outs[0], expected) < RTOL[torch.float32]


def test_no_local_rows_gives_zeros():
    gate_up, down = experts(32, True)
    out = int4_experts_forward(
        randn(3, H, seed=1), torch.ones(3, K), torch.full((3, K), N, dtype=torch.int32), gate_up, down, 32
    )
    assert torch.equal(out, torch.zeros(3, H))


def test_forward_bad_input_names_the_argument():
    gate_up, down = experts(32, True)
    x, (ids, weights) = randn(2, H, seed=1), routed(2)
    with pytest.raises(ValueError, match=r"strategy='loop' is not an INT4 strategy"):
        int4_experts_forward(x, weights, ids, gate_up, down, 32, strategy="loop")
    with pytest.raises(TypeError, match="gate_up must be a \\(packed, scales\\)"):
        int4_experts_forward(x, weights, ids, gate_up[0], down, 32)
    with pytest.raises(ValueError, match="scales has shape"):
        int4_experts_forward(x, weights, ids, gate_up, down, 64)
    with pytest.raises(ValueError, match="gate_up packed has shape"):
        int4_experts_forward(randn(2, 2 * H, seed=1), weights, ids, gate_up, down, 32)


# -- MoE(quant=QuantConfig("int4")) ---------------------------------------------------------------


def build(quant, shared="runner", seed=0, inter=I, gemm="auto"):
    shared_mlp = CountingMLP(H, inter)
    gate = nn.Linear(H, 1, bias=False)
    with torch.no_grad():
        for i, p in enumerate(list(shared_mlp.parameters()) + list(gate.parameters())):
            p.copy_(randn(*p.shape, seed=seed + 10 + i, scale=0.1))
    module = MoE(
        ROUTER, H, inter, shared_experts=shared_mlp, shared_expert_gate=gate, shared=shared, quant=quant, gemm=gemm
    )
    gate_up, down = experts(quant.group_size, quant.symmetric, seed=seed, inter=inter)
    with torch.no_grad():
        module.router_weight.copy_(randn(N, H, seed=seed + 2))
    module.load_routed_weights(gate_up, down)
    return module, shared_mlp, gate, (gate_up, down)


@torch.no_grad()
def reference_output(module, x, weights, shared_mlp, gate, dtype):
    quant = module.quant
    logits = F.linear(x.float(), module.router_weight.float())
    topk_weights, topk_ids = reference.select_experts(logits.numpy(), module.router, None)
    out = int4_moe_experts_reference(
        x.float(),
        torch.from_numpy(topk_weights),
        torch.from_numpy(topk_ids).long(),
        *weights,
        quant.group_size,
        intermediate_dtype=dtype,
    )
    g = torch.sigmoid(x.double() @ gate.weight.double().T)
    if module.layout.shared == "fused":  # the slot holds the shared MLP quantized with the layer's config
        w = shared_mlp.gate_proj.weight, shared_mlp.up_proj.weight, shared_mlp.down_proj.weight
        kwargs = {"group_size": quant.group_size, "symmetric": quant.symmetric}
        slot_gu = tuple(t[None] for t in quantize_int4(torch.cat(w[:2]).float(), **kwargs))
        slot_d = tuple(t[None] for t in quantize_int4(w[2].float(), **kwargs))
        ids = torch.zeros(x.shape[0], 1, dtype=torch.long)
        shared = int4_moe_experts_reference(
            x.float(), g.float(), ids, slot_gu, slot_d, quant.group_size, intermediate_dtype=dtype
        )
    else:
        x64 = x.double()
        s = F.silu(x64 @ shared_mlp.gate_proj.weight.double().T) * (x64 @ shared_mlp.up_proj.weight.double().T)
        shared = (g * (s @ shared_mlp.down_proj.weight.double().T)).float()
    return out + shared


@pytest.mark.parametrize(
    "quant, shared, dtype",
    [
        (QuantConfig("int4", group_size=32), "runner", torch.float32),
        (QuantConfig("int4", group_size=128, symmetric=False), "overlap", torch.bfloat16),
        (QuantConfig("int4", group_size=64, symmetric=False), "fused", torch.float32),
    ],
)
def test_moe_matches_the_reference_and_runs_the_shared_mlp_once(quant, shared, dtype):
    module, shared_mlp, gate, weights = build(quant, shared)
    shared_mlp.to(dtype)
    gate.to(dtype)
    assert module.layout.shared == shared
    x = randn(10, H, seed=99).to(dtype)
    with torch.no_grad():
        out = module(x)
    assert out.dtype == dtype and out.shape == x.shape
    # bfloat16: the shared MLP runs in bfloat16 too (its own rounding, beside the experts')
    tolerance = RTOL[dtype] if dtype == torch.float32 else 2e-2
    assert rel_error(out.float(), reference_output(module, x, weights, shared_mlp, gate, dtype)) < tolerance
    assert shared_mlp.calls == (0 if shared == "fused" else 1)


def test_moe_holds_packed_bytes_and_round_trips_its_state():
    quant = QuantConfig("int4", group_size=64, symmetric=False)
    module, shared_mlp, gate, weights = build(quant)
    (gu_q, gu_s, gu_z), (d_q, d_s, d_z) = weights
    experts_ = module.experts
    assert torch.equal(experts_.w_gate_up, gu_q) and torch.equal(experts_.gate_up_zero, gu_z)
    assert (
        torch.equal(experts_.down_scale, d_s)
        and experts_.down_scale.dtype == d_s.dtype
        and torch.equal(experts_.w_down, d_q)
    )
    assert experts_.w_gate_up.dtype == torch.uint8 and experts_.w_gate_up.shape == (N, 2 * I, H // 2)
    # Into the same layout, and into one that fuses the shared MLP as a slot (quantized there).
    same = MoE(
        ROUTER,
        H,
        I,
        shared_experts=CountingMLP(H, I),
        shared_expert_gate=nn.Linear(H, 1, bias=False),
        shared="runner",
        quant=quant,
    )
    same.load_state_dict(module.state_dict())
    fused = MoE(
        ROUTER,
        H,
        I,
        shared_experts=CountingMLP(H, I),
        shared_expert_gate=nn.Linear(H, 1, bias=False),
        shared="fused",
        quant=quant,
    )
    fused.load_state_dict(module.state_dict())
    x = randn(6, H, seed=8)
    with torch.no_grad():
        assert torch.equal(same(x), module(x))
        out = fused(x)
    assert rel_error(out, reference_output(fused, x, weights, shared_mlp, gate, torch.float32)) < RTOL[torch.float32]
    slot = quantize_int4(
        torch.cat([shared_mlp.gate_proj.weight, shared_mlp.up_proj.weight]).detach(), group_size=64, symmetric=False
    )
    for name in ("w_gate_up", "gate_up_scale", "gate_up_zero", "w_down", "down_scale", "down_zero"):
        assert torch.equal(getattr(fused.experts, name)[:N], getattr(experts_, name)), name
    assert torch.equal(fused.experts.w_gate_up[N], slot[0]) and torch.equal(fused.experts.gate_up_zero[N], slot[2])
    module.to(torch.bfloat16)
    assert module.experts.w_gate_up.dtype == torch.uint8 and module.experts.gate_up_scale.dtype == gu_s.dtype


def test_moe_load_errors_are_clear():
    quant = QuantConfig("int4", group_size=32, symmetric=False)
    module = MoE(ROUTER, H, I, quant=quant)
    gate_up, down = experts(32, False)
    with pytest.raises(ValueError, match="w_gate_up is a torch.float32 tensor.*quantize_int4"):
        module.load_routed_weights(randn(N, 2 * I, H, seed=0), down)
    with pytest.raises(ValueError, match=r"w_gate_up must be a \(packed, scales, zeros\) tuple"):
        module.load_routed_weights(gate_up[:2], down)
    with pytest.raises(ValueError, match="w_down scales has shape"):
        module.load_routed_weights(gate_up, (down[0], down[1][:, :, :1], down[2]))
    with pytest.raises(ValueError, match=r"w_down packed has shape \(8, 128, 64\), expected \[8, 256, 64\]"):
        module.load_routed_weights(gate_up, tuple(t[:, :128] for t in down))
    with pytest.raises(ValueError, match="gate_up_scale was given"):
        module.load_routed_weights(gate_up, down, gate_up_scale=gate_up[1])
    bad = gate_up[2].clone()
    bad[1, 2, 3] = 16
    with pytest.raises(ValueError, match=r"w_gate_up zeros\[1, 2, 3\] is 16"):
        module.load_routed_weights((gate_up[0], gate_up[1], bad), down)
    # An expert-parallel slice of I that is not a whole number of groups has no scale for its tail.
    with pytest.raises(ValueError, match="intermediate_size=48 is not a multiple of group_size=32"):
        MoE(ROUTER, H, 48, quant=quant)
    with pytest.raises(ValueError, match="expert_bias=True is not served"):
        MoE(ROUTER, H, I, expert_bias=True, quant=quant)
    with pytest.raises(ValueError, match="gemm='padded' is not an INT4 strategy"):
        MoE(ROUTER, H, I, quant=quant, gemm="padded")


# --------------------------------------------------------------------------- moeroute run --quant int4


def test_run_command_checks_an_int4_layer_against_the_reference(capsys):
    """Two gloo ranks, a fused shared slot quantized as the experts are, bfloat16 activations."""
    import re

    from moeroute.bindings import ep_run

    argv = ["--preset", "deepseek-v3", "--ep", "2", "--tokens", "4", "--hidden", "128", "--intermediate", "128"]
    status = ep_run.main(argv + ["--repeat", "1", "--quant", "int4", "--dtype", "bfloat16", "--shared", "fused"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "experts int4, dispatch dtype auto" in out
    found = re.findall(
        r"w4a16 reference \(moeroute.quant.reference\): max relative error ([0-9.e+-]+) over 2 ranks \(< 0.02\): PASS",
        out,
    )
    assert len(found) == 1, out
    assert 0 < float(found[0]) < ep_run.INT4_TOLERANCE["bfloat16"]
    assert "every rank matches" in out


def test_run_command_fails_an_int4_layer_off_its_bound():
    """INT4's float32 bound (summation order only) is tighter than FP8's."""
    import argparse

    from moeroute.bindings import ep_run

    args = argparse.Namespace(
        preset="mixtral-8x7b", ep=2, dispatch="all2all", tokens=4, hidden=128, intermediate=128, dtype="float32"
    )
    report = dict(
        rank=0,
        tokens=4,
        received_rows=4,
        slots_computed=8,
        max_expert_load=3,
        local_experts=4,
        bytes=None,
        forward_ms=1.0,
        error=0.0,
        shared="none",
        shared_reason="no shared expert",
        reference_error=1e-6,
    )
    reports = [report, dict(report, rank=1, reference_error=5e-4)]
    text, status = ep_run._format(argparse.Namespace(**vars(args), quant="fp8_block", dispatch_dtype="auto"), reports)
    assert status == 0 and "w8a8 reference" in text and ": PASS" in text
    text, status = ep_run._format(argparse.Namespace(**vars(args), quant="int4", dispatch_dtype="auto"), reports)
    assert status == ep_run.EXIT_MISMATCH and "w4a16 reference" in text and "5.00e-04" in text and ": FAIL" in text


@pytest.mark.parametrize(
    "argv,message",
    [
        ([], "--quant int4 quantizes groups of 128 input columns: --hidden 64 is not a multiple of 128"),
        (
            ["--hidden", "256"],
            "--quant int4 quantizes groups of 128 input columns: --intermediate 32 is not a multiple",
        ),
        (["--hidden", "128", "--intermediate", "128", "--dispatch-dtype", "fp8"], "--dispatch-dtype fp8 needs FP8"),
        (["--preset", "gpt-oss-20b"], "carry biases, which quantized experts do not"),
    ],
)
def test_run_command_refuses_int4_requests_it_cannot_serve(argv, message, capsys):
    from moeroute.bindings import ep_run

    preset = [] if "--preset" in argv else ["--preset", "deepseek-v3"]
    assert ep_run.main(preset + argv + ["--ep", "2", "--tokens", "4", "--quant", "int4"]) == ep_run.EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [f"moeroute: error: {captured.err.split('error: ', 1)[1].strip()}"]
    assert message in captured.err
