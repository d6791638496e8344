"""MoE(quant=...): FP8 experts against the plain w8a8 reference, in every shared mode.

The reference routes with moeroute.routing.reference, runs the experts with
moeroute.quant.reference (one k-group at a time, float64 sums) and adds the shared
contribution once: the float shared MLP for runner/overlap, the w8a8 of its quantized slots
for fused. Tolerances (max abs diff / max abs reference): 2e-2 with float32 activations,
4e-2 with bfloat16 ones, 8e-2 against the float32 layer on the dequantized weights.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers.modules import CountingMLP
from helpers.reference import randn as _randn
from helpers.reference import rel_error
from moeroute.bindings.torch import MoE
from moeroute.experts.formats.fp8 import fp8_experts_forward
from moeroute.config import RouterConfig
from moeroute.layout import LayoutError
from moeroute.quant import QuantConfig, dequantize_experts, dequantize_fp8_block, quantize_experts
from moeroute.quant.reference import moe_experts_reference
from moeroute.routing import reference

H, N, K, T = 256, 8, 2, 12
RTOL = {torch.float32: 2e-2, torch.bfloat16: 4e-2}
DEQUANTIZED_RTOL = 8e-2
ROUTER = RouterConfig(N, K, "softmax", renormalize=True)

FORMATS = {
    "block128": QuantConfig("fp8_block"),
    "block64x128": QuantConfig("fp8_block", block_size=(64, 128)),
    "block_ue8m0": QuantConfig("fp8_block", scale_fmt="ue8m0"),
    "tensor": QuantConfig("fp8_tensor"),
}


def build(quant, inter, shared="runner", num_shared=1, gated=True, dtype=torch.float32, seed=0):
    shared_mlp = gate = None
    if num_shared:
        shared_mlp = CountingMLP(H, num_shared * inter)
        gate = nn.Linear(H, 1, bias=False)
        with torch.no_grad():
            for i, p in enumerate(list(shared_mlp.parameters()) + list(gate.parameters())):
                p.copy_(_randn(*p.shape, seed=seed + 10 + i, scale=0.1))
        shared_mlp.to(dtype)
        gate = gate.to(dtype) if gated else None
    module = MoE(ROUTER, H, inter, shared_experts=shared_mlp, shared_expert_gate=gate, shared=shared, quant=quant)
    w_gate_up, w_down = _randn(N, 2 * inter, H, seed=seed, scale=0.1), _randn(N, H, inter, seed=seed + 1, scale=0.1)
    q_gu, s_gu, q_d, s_d = quantize_experts(w_gate_up, w_down, quant)
    input_scale = None
    if quant.activation == "static":
        input_scale = torch.tensor([[4.0 / 448, 2.0 / 448]]).repeat(N, 1)
    with torch.no_grad():
        module.router_weight.copy_(_randn(N, H, seed=seed + 2))
    module.load_routed_weights(q_gu, w_down=q_d, gate_up_scale=s_gu, down_scale=s_d, input_scale=input_scale)
    return module, shared_mlp, gate, (q_gu, s_gu, q_d, s_d, input_scale)


def _routing(module, x):
    logits = F.linear(x.float(), module.router_weight.float())
    weights, ids = reference.select_experts(logits.numpy(), module.router, None)
    return torch.from_numpy(weights), torch.from_numpy(ids).long()


@torch.no_grad()
def reference_output(module, x, quantized, shared_mlp, gate, dtype, shared_times=1):
    """Routed w8a8 experts + ``shared_times`` x the shared contribution, float32."""
    quant = module.quant
    q_gu, s_gu, q_d, s_d, input_scale = quantized
    topk_weights, topk_ids = _routing(module, x)
    routed = moe_experts_reference(
        x,
        topk_weights,
        topk_ids,
        q_gu,
        s_gu,
        q_d,
        s_d,
        quant.block_size,
        quant.scale_fmt,
        input_scale=input_scale,
        intermediate_dtype=dtype,
    )
    if shared_mlp is None:
        return routed
    g = torch.ones(x.shape[0], 1) if gate is None else torch.sigmoid(x.double() @ gate.weight.double().T)
    inter = module.intermediate_size
    if module.layout.shared == "fused":
        # The slots hold the shared MLP quantized with the layer's config.
        num_slots = module.num_shared_experts
        gate_w, up_w, down_w = (
            shared_mlp.gate_proj.weight.float(),
            shared_mlp.up_proj.weight.float(),
            shared_mlp.down_proj.weight.float(),
        )
        slots_gu = torch.stack(
            [
                torch.cat([gate_w[j * inter : (j + 1) * inter], up_w[j * inter : (j + 1) * inter]])
                for j in range(num_slots)
            ]
        )
        slots_d = torch.stack([down_w[:, j * inter : (j + 1) * inter] for j in range(num_slots)])
        q = quantize_experts(slots_gu, slots_d, quant)
        ids = torch.arange(num_slots).repeat(x.shape[0], 1)
        shared = moe_experts_reference(
            x, g.float().expand(-1, num_slots), ids, *q, quant.block_size, quant.scale_fmt, intermediate_dtype=dtype
        )
    else:
        x64 = x.double()
        s = F.silu(x64 @ shared_mlp.gate_proj.weight.double().T) * (x64 @ shared_mlp.up_proj.weight.double().T)
        shared = (g * (s @ shared_mlp.down_proj.weight.double().T)).float()
    return routed + shared_times * shared


# Every (format x shared mode); the (I, activation dtype) pairs rotate over the shared modes so
# that each format meets I = 200 and I = 100 (EP-split size, not a block multiple) in both dtypes.
SIZES = [(200, torch.float32), (100, torch.bfloat16), (200, torch.bfloat16), (100, torch.float32)]
CASES = [
    (fmt, *SIZES[(i + j) % 4], shared)
    for i, fmt in enumerate(FORMATS)
    for j, shared in enumerate(["runner", "overlap", "fused", "auto"])
]


@pytest.mark.parametrize("fmt,inter,dtype,shared", CASES)
def test_matches_w8a8_reference_and_shared_once(fmt, inter, dtype, shared):
    quant = FORMATS[fmt]
    module, shared_mlp, gate, quantized = build(quant, inter, shared, dtype=dtype)
    assert module.layout.shared == ("fused" if shared == "auto" else shared)
    x = _randn(T, H, seed=99).to(dtype)
    with torch.no_grad():
        out = module(x)
    assert out.dtype == dtype and out.shape == x.shape
    expected = reference_output(module, x, quantized, shared_mlp, gate, dtype)
    assert rel_error(out, expected) < RTOL[dtype]
    # The shared contribution is large enough that missing or doubling it would fail.
    for times in (0, 2):
        wrong = reference_output(module, x, quantized, shared_mlp, gate, dtype, shared_times=times)
        assert rel_error(out, wrong) > 5 * RTOL[dtype]
    # Computed exactly once: by the MLP itself (runner/overlap), or by its slots (fused).
    assert shared_mlp.calls == (0 if module.layout.shared == "fused" else 1)


@pytest.mark.parametrize("fmt", ["block128", "block64x128", "tensor"])
def test_close_to_float_layer_on_dequantized_weights(fmt):
    quant = FORMATS[fmt]
    module, _, _, (q_gu, s_gu, q_d, s_d, _) = build(quant, 200, num_shared=0)
    float_layer = MoE(ROUTER, H, 200)
    with torch.no_grad():
        float_layer.router_weight.copy_(module.router_weight)
    float_layer.load_routed_weights(*dequantize_experts(q_gu, s_gu, q_d, s_d, quant))
    x = _randn(T, H, seed=5)
    with torch.no_grad():
        assert rel_error(module(x), float_layer(x).double().float()) < DEQUANTIZED_RTOL


def test_static_per_tensor():
    quant = QuantConfig("fp8_tensor", activation="static")
    module, shared_mlp, gate, quantized = build(quant, 200, shared="auto")
    # Static activation scales leave the shared MLP without slot scales: auto runs it itself.
    assert module.layout.shared == "runner"
    x = _randn(T, H, seed=3)
    with torch.no_grad():
        out = module(x)
    assert rel_error(out, reference_output(module, x, quantized, shared_mlp, gate, torch.float32)) < 2e-2
    with pytest.raises(LayoutError, match="static"):
        build(quant, 200, shared="fused")


@pytest.mark.parametrize("strategy", ["rows", "blocks"])
@pytest.mark.parametrize("rows_per_expert", [1, 5, 40])
def test_cpu_strategies_agree_with_reference(strategy, rows_per_expert):
    quant = QuantConfig("fp8_block", block_size=(64, 128))
    inter, experts = 200, 3
    q = quantize_experts(
        _randn(experts, 2 * inter, H, seed=1, scale=0.1), _randn(experts, H, inter, seed=2, scale=0.1), quant
    )
    tokens = rows_per_expert * experts
    x = _randn(tokens, H, seed=3)
    ids = torch.stack([torch.arange(tokens) % experts, (torch.arange(tokens) + 1) % (experts + 1) - 1], 1)
    weights = torch.rand(tokens, 2, generator=torch.Generator().manual_seed(4))
    out = fp8_experts_forward(x, weights, ids.int(), *q, quant, strategy=strategy)
    expected = moe_experts_reference(x, weights, ids, *q, quant.block_size)
    # float32: the same numerics up to float32 rounding and summation order, which can flip an
    # e4m3 rounding tie of the re-quantized intermediate (one step of one value moves that
    # token's row by up to about 5e-4 of the largest output, docs/quant.md). Every other row
    # agrees to float32 rounding.
    row_error = (out - expected).abs().amax(1) / expected.abs().max()
    assert row_error.max() < 1e-3
    assert int((row_error > 1e-5).sum()) <= max(1, tokens // 50)


def test_to_dtype_keeps_fp8_weights():
    module, _, _, (q_gu, s_gu, _, _, _) = build(FORMATS["block128"], 200, num_shared=0)
    module.to(torch.bfloat16)
    assert module.experts.w_gate_up.dtype == torch.float8_e4m3fn
    assert module.experts.gate_up_scale.dtype == torch.float32
    assert torch.equal(module.experts.w_gate_up.view(torch.uint8), q_gu.view(torch.uint8))
    assert torch.equal(module.experts.gate_up_scale, s_gu)


def test_state_dict_round_trip():
    module, _, _, _ = build(FORMATS["block64x128"], 200, num_shared=0)
    copy = MoE(ROUTER, H, 200, quant=FORMATS["block64x128"])
    copy.load_state_dict(module.state_dict())
    x = _randn(4, H, seed=8)
    with torch.no_grad():
        assert torch.equal(copy(x), module(x))


# ------------------------------------------------------------------ bad input


def _quantized(quant, inter=200):
    return quantize_experts(_randn(N, 2 * inter, H, seed=0, scale=0.1), _randn(N, H, inter, seed=1, scale=0.1), quant)


def test_errors_name_the_argument():
    quant = FORMATS["block128"]
    module = MoE(ROUTER, H, 200, quant=quant)
    q_gu, s_gu, q_d, s_d = _quantized(quant)
    w_gu = _randn(N, 400, H, seed=0)
    with pytest.raises(ValueError, match="w_gate_up has dtype torch.float32.*quantize_experts"):
        module.load_routed_weights(w_gu, q_d, gate_up_scale=s_gu, down_scale=s_d)
    with pytest.raises(ValueError, match="gate_up_scale is missing"):
        module.load_routed_weights(q_gu, q_d, down_scale=s_d)
    with pytest.raises(ValueError, match=r"gate_up_scale has shape \(8, 3, 2\), expected \[8, 4, 2\]"):
        module.load_routed_weights(q_gu, q_d, gate_up_scale=s_gu[:, :3], down_scale=s_d)
    with pytest.raises(ValueError, match="down_scale has dtype torch.bfloat16"):
        module.load_routed_weights(q_gu, q_d, gate_up_scale=s_gu, down_scale=s_d.bfloat16())
    bad = s_d.clone()
    bad[3, 1, 0] = float("nan")
    with pytest.raises(
        ValueError, match=r"down_scale must be finite and > 0.*\[\(3, 1, 0\)\]|down_scale\[\(3, 1, 0\)\]"
    ):
        module.load_routed_weights(q_gu, q_d, gate_up_scale=s_gu, down_scale=bad)
    bad = s_gu.clone()
    bad[0, 0, 0] = 0.0
    with pytest.raises(ValueError, match="gate_up_scale must be finite and > 0"):
        module.load_routed_weights(q_gu, q_d, gate_up_scale=bad, down_scale=s_d)
    # A checkpoint whose block size is not the declared one: its scales do not divide as declared.
    _, s_gu64, _, s_d64 = _quantized(QuantConfig("fp8_block", block_size=(64, 128)))
    with pytest.raises(ValueError, match="gate_up_scale has shape"):
        module.load_routed_weights(q_gu, q_d, gate_up_scale=s_gu64, down_scale=s_d64)
    with pytest.raises(ValueError, match="input_scale was given"):
        module.load_routed_weights(q_gu, q_d, gate_up_scale=s_gu, down_scale=s_d, input_scale=torch.ones(N, 2))
    float_layer = MoE(ROUTER, H, 200)
    with pytest.raises(ValueError, match="gate_up_scale was given but this layer holds float experts"):
        float_layer.load_routed_weights(w_gu, _randn(N, H, 200, seed=1), gate_up_scale=s_gu)
    with pytest.raises(ValueError, match="expert_weights takes float weights"):
        MoE(ROUTER, H, 200, quant=quant, expert_weights=(w_gu, _randn(N, H, 200, seed=1)))
    with pytest.raises(TypeError, match="quant must be"):
        MoE(ROUTER, H, 200, quant="fp8_block")
    with pytest.raises(ValueError, match="expert_bias"):
        MoE(ROUTER, H, 200, quant=quant, expert_bias=True)
    static = MoE(ROUTER, H, 200, quant=QuantConfig("fp8_tensor", activation="static"))
    q = _quantized(QuantConfig("fp8_tensor"))
    with pytest.raises(ValueError, match="input_scale is missing"):
        static.load_routed_weights(q[0], q[2], gate_up_scale=q[1], down_scale=q[3])
    with pytest.raises(ValueError, match="hidden_states dtype torch.float64"):
        module(torch.zeros(2, H, dtype=torch.float64))


def test_torch_decoder_of_the_device_path_matches_numba():
    # The blocks strategy decodes with torch's e4m3 conversion on devices: run that branch on
    # the CPU against the Numba decoder (same chunks, same float32 values).
    from moeroute.experts.formats import fp8 as fp8_experts

    quant = QuantConfig("fp8_block", block_size=(64, 128))
    q_gu, s_gu, _, _ = quantize_experts(_randn(3, 400, H, seed=1, scale=0.1), _randn(3, H, 200, seed=2), quant)
    x = _randn(9, H, seed=3)
    offsets = torch.tensor([0, 4, 4, 9])
    args = (x, offsets, [0, 2], q_gu, s_gu, quant.block_size, torch.float32)
    numba_out = fp8_experts._blocks_gemm(*args, halves=(200, s_gu.shape[1] // 2), decoder="numba")
    torch_out = fp8_experts._blocks_gemm(*args, halves=(200, s_gu.shape[1] // 2), decoder="torch")
    rows = torch.cat([torch.arange(0, 4), torch.arange(4, 9)])
    assert torch.equal(numba_out[rows], torch_out[rows])
    nb = s_gu.shape[1] // 2

    def weight(e):  # gate and up decoded from their own block rows
        return torch.cat(
            [
                dequantize_fp8_block(q_gu[e, :200], s_gu[e, :nb], quant.block_size),
                dequantize_fp8_block(q_gu[e, 200:], s_gu[e, nb:], quant.block_size),
            ]
        )

    expected = torch.cat([x[0:4] @ weight(0).T, x[4:9] @ weight(2).T])
    torch.testing.assert_close(torch_out, expected, rtol=1e-5, atol=1e-5)


def test_row_kernel_decodes_every_e4m3_code():
    # The row kernels' in-register decode (integer bit moves) against torch's e4m3 conversion,
    # for all 254 finite codes, subnormals and both zeros included.
    import numba
    import numpy as np

    from moeroute.experts.cpu import fp8 as cpu_fp8

    @numba.njit
    def decode(codes, out):
        for i in range(codes.shape[0]):
            out[i] = cpu_fp8._e4m3_times_2_pow_minus_120(codes[i])

    codes = torch.arange(256, dtype=torch.uint8)
    finite = (codes & 0x7F) != 0x7F
    out = np.empty(256, np.float32)
    decode(codes.numpy(), out)
    expected = codes.view(torch.float8_e4m3fn).float()
    decoded = torch.from_numpy(out).double() * 2.0**120
    assert torch.equal(decoded[finite], expected[finite].double())
    assert torch.equal(torch.signbit(decoded[finite]), torch.signbit(expected[finite]))


def test_float_row_kernels_rescale_large_activations():
    # The float row kernels fold the decode's 2**120 into the scaled activations; a row whose
    # values times its group factors would pass float32's range there (unquantized w8a16 rows,
    # large scales) is scaled down by a power of two that its dots undo. Rows from 1e-3 to
    # 1e25, experts with 1 to 7 rows (the one-row pass, pairs and 2x4 tiles): finite, equal
    # to the float64 dots of the dequantized operands, and scaling the rows by 2**40 scales
    # the dots by exactly 2**40.
    import numpy as np

    from moeroute.experts.cpu import fp8 as cpu_fp8

    hidden, inter, bn, bk = 256, 96, 64, 128
    generator = torch.Generator().manual_seed(11)
    counts = [1, 2, 3, 4, 7]
    experts, rows = len(counts), sum(counts)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    codes = torch.randint(0, 256, (experts, 2 * inter + hidden, max(hidden, inter)), generator=generator)
    codes = torch.where((codes & 0x7F) == 0x7F, 0, codes).to(torch.uint8)
    q_gu, q_d = codes[:, : 2 * inter, :hidden].contiguous(), codes[:, 2 * inter :, :inter].contiguous()
    nb = -(-inter // bn)
    s_gu = torch.rand(experts, 2 * nb, hidden // bk, generator=generator) * 4 + 0.5
    s_d = torch.rand(experts, hidden // bn, -(-inter // bk), generator=generator) * 4 + 0.5
    magnitudes = torch.logspace(-3, 25, rows, dtype=torch.float64)
    x = (torch.randn(rows, hidden, generator=generator, dtype=torch.float64) * magnitudes[:, None]).float()
    acts = (torch.randn(rows, inter, generator=generator, dtype=torch.float64) * magnitudes[:, None]).float()
    s_x = torch.rand(rows, hidden // bk, generator=generator) + 0.5
    s_act = torch.rand(rows, -(-inter // bk), generator=generator) + 0.5
    tokens = np.arange(rows, dtype=np.int64)
    work = np.array([(e, c) for e in range(experts) for c in range(-(-2 * inter // cpu_fp8.ROW_BLOCK))], np.int64)
    hit = np.arange(experts, dtype=np.int64)
    slot_weights = np.ones(rows, np.float32)

    def kernels(x, acts):
        gate_up = np.zeros((rows, 2 * inter), np.float32)
        no_bias = np.empty((0, 0), np.float32)
        cpu_fp8.gate_up_rows_serial(
            (x.numpy(), s_x.numpy()),
            tokens,
            offsets,
            work,
            q_gu.numpy(),
            (s_gu.numpy(), inter, bn, bk),
            no_bias,
            gate_up,
        )
        sums = np.zeros((rows, hidden), np.float32)
        cpu_fp8.down_rows_serial(
            (acts.numpy(), s_act.numpy()),
            tokens,
            slot_weights,
            offsets,
            hit,
            q_d.numpy(),
            (s_d.numpy(), hidden, bn, bk),
            no_bias,
            sums,
        )
        return torch.from_numpy(gate_up), torch.from_numpy(sums)

    def dequantized(q, scale, row_block):
        values = q.view(torch.float8_e4m3fn).double()
        rows_of = torch.arange(q.shape[0]) // row_block
        return values * scale.double()[rows_of][:, torch.arange(q.shape[1]) // bk]

    gate_up, sums = kernels(x, acts)
    expected_gu = torch.empty(rows, 2 * inter, dtype=torch.float64)
    expected_d = torch.empty(rows, hidden, dtype=torch.float64)
    for e in range(experts):
        m = slice(offsets[e], offsets[e + 1])
        w_gu = torch.cat(
            [dequantized(q_gu[e, :inter], s_gu[e, :nb], bn), dequantized(q_gu[e, inter:], s_gu[e, nb:], bn)]
        )
        expected_gu[m] = (x[m].double() * s_x[m].double().repeat_interleave(bk, 1)) @ w_gu.T
        a = acts[m].double() * s_act[m].double().repeat_interleave(bk, 1)[:, :inter]
        expected_d[m] = a @ dequantized(q_d[e], s_d[e], bn).T
    for got, expected in ((gate_up, expected_gu), (sums, expected_d)):
        assert torch.isfinite(got).all()
        error = (got.double() - expected).abs().amax(1) / expected.abs().amax(1)
        assert error.max() < 1e-5
    gate_up_up, sums_up = kernels(x * 2.0**40, acts * 2.0**40)
    assert torch.equal(gate_up_up, gate_up * 2.0**40)
    assert torch.equal(sums_up, sums * 2.0**40)
    # An inf in a row: that row's dots are inf or NaN, the others as before.
    x[2, 5] = float("inf")
    gate_up_inf, _ = kernels(x, acts)
    assert not torch.isfinite(gate_up_inf[2]).all()
    assert torch.equal(torch.cat([gate_up_inf[:2], gate_up_inf[3:]]), torch.cat([gate_up[:2], gate_up[3:]]))


@pytest.mark.parametrize("fmt", ["block64x128", "tensor"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("inter", [200, 192])
def test_row_kernels_every_tile_shape_against_reference(fmt, threads, inter):
    # 1 to 9 rows per expert cover the one-row pass, the pairs and the 2x4 tiles with every
    # remainder; I = 200 leaves partial weight blocks and a block of 64 weight rows that
    # spans gate and up. One torch thread runs the serial kernels. I = 192 (rows and blocks
    # whole 64-weight steps) runs the bfloat16-dot kernels on CPUs that have them, where the
    # expert with 21 rows takes the packed outer products.
    from moeroute.experts.cpu import fp8 as cpu_fp8

    quant = FORMATS[fmt]
    experts = 10
    blocks = ((64, 128), (64, 128)) if fmt != "tensor" else ((inter, H), (H, inter))
    assert cpu_fp8.bf16_dot_serves(H, inter, *blocks) == (cpu_fp8.BF16_DOT and inter == 192)
    q = quantize_experts(
        _randn(experts, 2 * inter, H, seed=1, scale=0.1), _randn(experts, H, inter, seed=2, scale=0.1), quant
    )
    counts = torch.tensor([*range(1, experts), 21])
    assert 4 < cpu_fp8._DECODE_ROWS_ABOVE < 21
    ids = torch.repeat_interleave(torch.arange(experts), counts)
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(5))]
    ids = torch.stack([ids, torch.full_like(ids, -1)], 1)  # a slot held elsewhere: skipped
    x = _randn(ids.shape[0], H, seed=3)
    weights = torch.rand(ids.shape[0], 2, generator=torch.Generator().manual_seed(4))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = fp8_experts_forward(x, weights, ids.int(), *q, quant, strategy="rows")
    finally:
        torch.set_num_threads(previous)
    expected = moe_experts_reference(x, weights, ids, *q, quant.block_size if fmt != "tensor" else None)
    # As in test_cpu_strategies_agree_with_reference: float32 summation order may flip an
    # e4m3 rounding tie of the re-quantized intermediate in a row or so (one step of one
    # value: up to about 1.2e-3 of the largest output here with per-tensor scales, whose
    # per-token activation scale spans the whole intermediate row); the rest agree to
    # float32 rounding.
    row_error = (out - expected).abs().amax(1) / expected.abs().max()
    assert row_error.max() < 2e-3
    assert int((row_error > 1e-5).sum()) <= max(1, ids.shape[0] // 50)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols,group", [(256, 128), (200, 64), (300, 128)])
def test_row_quantizer_matches_quantize_fp8_activations(dtype, cols, group):
    # The Numba quantizer of the row strategy, bit for bit against moeroute.quant's torch
    # definition: every e4m3 value, the midpoints between neighbours and one float32 step to
    # either side of each, plus random rows over a wide range of magnitudes.
    import numpy as np

    from moeroute.quant import quantize_fp8_activations
    from moeroute.experts.cpu import fp8 as cpu_fp8

    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = values[torch.isfinite(values)].unique()
    mids = (values[1:] + values[:-1]) / 2
    probes = torch.cat([values, mids, mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9))])
    rows = -(-probes.numel() // (group - 1))
    x = _randn(rows + 16, cols, seed=6) * torch.logspace(-6, 3, rows + 16)[:, None]
    grid = torch.zeros(rows, group - 1)
    grid.view(-1)[: probes.numel()] = probes
    x[:rows, 0] = 448.0  # amax 448: scale 1, the probes quantized as they are
    x[:rows, 1:group] = grid
    x = x.to(dtype)
    q_ref, s_ref = quantize_fp8_activations(x, group)
    q = np.empty(x.shape, np.float32)
    s = np.empty((x.shape[0], -(-cols // group)), np.float32)
    cpu_fp8.quantize_rows(x.float().numpy(), group, False, np.float32(1e-10), q, s)
    assert torch.equal(torch.from_numpy(q), q_ref.float())
    assert torch.equal(torch.from_numpy(s), s_ref)
    # Rounded to bfloat16 first, as the intermediate is.
    cpu_fp8.quantize_rows(x.float().numpy() * np.float32(1.01), group, True, np.float32(1e-10), q, s)
    q_ref, s_ref = quantize_fp8_activations((x.float() * 1.01).bfloat16(), group)
    assert torch.equal(torch.from_numpy(q), q_ref.float())
    assert torch.equal(torch.from_numpy(s), s_ref)


BF16_DOT_REASON = "this CPU has no bfloat16 dot-product instructions (AVX512-BF16)"


def _e4m3_tile(w, w_rows, xs, x_rows, factors, bk, out):
    import numba

    from moeroute.experts.cpu import fp8 as cpu_fp8

    @numba.njit
    def run(w, w_rows, xs, x_rows, factors, bk, out):
        # The tile's row counts are part of its type: one call per shape (1 or 4 by 1 or 3).
        if w_rows.shape[0] == 4 and x_rows.shape[0] == 3:
            cpu_fp8._dot_e4m3_tile(
                w, (w_rows[0], w_rows[1], w_rows[2], w_rows[3]), xs, (x_rows[0], x_rows[1], x_rows[2]), factors, bk, out
            )
        elif w_rows.shape[0] == 4:
            cpu_fp8._dot_e4m3_tile(w, (w_rows[0], w_rows[1], w_rows[2], w_rows[3]), xs, (x_rows[0],), factors, bk, out)
        elif x_rows.shape[0] == 3:
            cpu_fp8._dot_e4m3_tile(w, (w_rows[0],), xs, (x_rows[0], x_rows[1], x_rows[2]), factors, bk, out)
        else:
            cpu_fp8._dot_e4m3_tile(w, (w_rows[0],), xs, (x_rows[0],), factors, bk, out)

    run(w, w_rows, xs, x_rows, factors, bk, out)


@pytest.mark.parametrize("weight_rows,act_rows", [(1, 1), (4, 1), (1, 3), (4, 3)])
@pytest.mark.parametrize("cols,bk", [(256, 64), (320, 128), (4608, 128), (4160, 192)])
def test_bf16_dot_e4m3_tile_against_float64(weight_rows, act_rows, cols, bk):
    # The e4m3 weights decoded to bfloat16 in registers (every one of the 254 finite codes,
    # subnormals and both zeros, sits in weight row 0) and dotted with the instruction, group
    # by group of bk columns (a partial last group at 320 / 128 and 4160 / 192; two steps
    # unrolled at 4608 / 128), each group's sum times its factor, whole rows or, with three
    # activation rows at 4608 and 4160 columns, chunks of one group of each weight row in
    # turn: against the float64 sum of the exact e4m3 products.
    import numpy as np

    from moeroute.experts.cpu import fp8 as cpu_fp8

    if not cpu_fp8.BF16_DOT:
        pytest.skip(BF16_DOT_REASON)
    generator = torch.Generator().manual_seed(cols + bk)
    codes = torch.randint(0, 256, (5, cols), generator=generator, dtype=torch.uint8)
    codes[0, :256] = torch.arange(256, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3A  # no NaN codes
    weights = codes.view(torch.float8_e4m3fn).double()
    acts = (torch.randn(4, cols, generator=generator) * 40).to(torch.float8_e4m3fn)
    groups = -(-cols // bk)
    w_rows, x_rows = np.array([0, 3, 1, 4][:weight_rows]), np.array([2, 0, 3][:act_rows])
    factors = (torch.rand(act_rows, groups, generator=generator) + 0.25).numpy()
    out = np.full(13, np.nan, np.float32)
    _e4m3_tile(codes.numpy(), w_rows, acts.to(torch.bfloat16).view(torch.uint16).numpy(), x_rows, factors, bk, out)
    for i, w_row in enumerate(w_rows):
        for j, x_row in enumerate(x_rows):
            products = weights[w_row] * acts[x_row].double()
            group_sums = torch.stack([products[g * bk : (g + 1) * bk].sum() for g in range(groups)])
            expected = float((group_sums * torch.from_numpy(factors[j]).double()).sum())
            bound = 2 * cols * 2.0**-24 * float((products.abs().view(-1)).sum()) * float(factors[j].max())
            assert abs(float(out[i * act_rows + j]) - expected) <= bound
    assert np.isnan(out[weight_rows * act_rows :]).all()


def test_bf16_dot_fp8_kernels_serial_and_parallel_give_the_same_bits():
    # One thread reads each expert's down weights as one stream, the parallel kernels split
    # the output columns and the gate_up rows: a dot does not depend on its neighbours.
    # Expert 4 (45 rows) takes the packed outer products, the others (2 to 6 rows) the bytes.
    from moeroute.experts.cpu import fp8 as cpu_fp8

    if not cpu_fp8.BF16_DOT:
        pytest.skip(BF16_DOT_REASON)
    quant = FORMATS["block64x128"]
    inter, experts = 192, 5
    q = quantize_experts(
        _randn(experts, 2 * inter, H, seed=1, scale=0.1), _randn(experts, H, inter, seed=2, scale=0.1), quant
    )
    ids = torch.stack(
        [
            torch.repeat_interleave(torch.arange(experts), torch.tensor([1, 2, 3, 4, 20])),
            torch.repeat_interleave(torch.arange(experts), torch.tensor([1, 1, 1, 2, 25])),
        ],
        1,
    ).int()
    assert 6 <= cpu_fp8._DECODE_ROWS_ABOVE < 45
    x = _randn(ids.shape[0], H, seed=3)
    weights = torch.rand(ids.shape[0], 2, generator=torch.Generator().manual_seed(4))
    outs = []
    previous = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            outs.append(fp8_experts_forward(x, weights, ids, *q, quant, strategy="rows"))
        finally:
            torch.set_num_threads(previous)
    assert torch.equal(outs[0], outs[1])


def test_thread_columns_are_one_aligned_contiguous_range_per_thread():
    # The one-call forwards' down GEMM: the output columns in at most one range per thread,
    # each a multiple of the tile (or of the 64-row packs), the smallest such size.
    from moeroute.experts.cpu.quant_rows import thread_columns

    for columns, threads, multiple in [
        (2880, 2, 4),
        (7168, 2, 64),
        (2048, 3, 64),
        (100, 8, 64),
        (2880, 7, 4),
        (64, 1, 64),
    ]:
        size = thread_columns(columns, threads, multiple)
        assert size % multiple == 0
        assert -(-columns // size) <= threads
        assert size - multiple < -(-columns // threads) <= size or size == multiple
    assert [thread_columns(2880, 2, 4), thread_columns(7168, 2, 64), thread_columns(100, 8, 64)] == [1440, 3584, 64]


def test_strategy_choice_follows_the_row_bound_unless_the_dot_kernels_serve():
    from moeroute.experts.choose import ROWS_MAX_MEAN_ROWS, choose

    bound = ROWS_MAX_MEAN_ROWS
    assert choose("fp8", "cpu", [bound, 0, bound]) == "rows"
    assert choose("fp8", "cpu", [bound + 1, 0, bound + 1]) == "blocks"
    assert choose("fp8", "cpu", []) == "rows"
    assert choose("fp8", "cpu", [bound * 40, 3], bf16_dot=True) == "rows"


def test_e4m3_rows_decode_and_pack_to_bfloat16_pairs_exactly():
    # `_decode_e4m3_packed` (experts with many rows) against torch's e4m3 -> bfloat16
    # conversion for every finite code and sign: packed[p, r] holds columns 2p and 2p + 1 of
    # row first + r, the lower column in the low half.
    import numba
    import numpy as np

    from moeroute.experts.cpu import fp8 as cpu_fp8

    if not cpu_fp8.BF16_DOT:
        pytest.skip(BF16_DOT_REASON)

    @numba.njit
    def pack(w, first, packed):
        cpu_fp8._decode_e4m3_packed(w, first, packed)

    rows, cols, first = cpu_fp8._PACKED_ROWS, 512, 3
    codes = torch.randint(
        0, 256, (first + rows + 2, cols), generator=torch.Generator().manual_seed(7), dtype=torch.uint8
    )
    codes[first : first + rows, :256] = torch.arange(256, dtype=torch.uint8)
    codes[first + 1 : first + rows, 256:] = codes[first + 1 : first + rows, :256].flip(1)
    codes[(codes & 0x7F) == 0x7F] = 0x11  # no NaN codes
    packed = np.zeros((cols // 2, rows), np.uint32)
    pack(codes.numpy(), first, packed)
    bits = codes[first : first + rows].view(torch.float8_e4m3fn).to(torch.bfloat16).view(torch.int16).numpy()
    bits = bits.astype(np.uint16).astype(np.uint32)
    expected = (bits[:, 0::2] | (bits[:, 1::2] << 16)).T
    assert np.array_equal(packed, expected)


@pytest.mark.parametrize("act_rows", [1, 3, 4])
@pytest.mark.parametrize("cols,bk", [(256, 64), (320, 128), (4160, 192)])
def test_packed_tile_against_float64(act_rows, cols, bk):
    # The outer-product dots of 32 packed weight rows against 1 to 4 activation rows, group by
    # group of bk columns (a partial last group at 320 / 128 and 4160 / 192), each group's
    # sum times its factor: against the float64 sum of the exact e4m3 products.
    import numba
    import numpy as np

    from moeroute.experts.cpu import fp8 as cpu_fp8

    if not cpu_fp8.BF16_DOT:
        pytest.skip(BF16_DOT_REASON)

    @numba.njit
    def run(codes, packed, xs, x_rows, factors, bk, out):
        cpu_fp8._decode_e4m3_packed(codes, 0, packed)
        if x_rows.shape[0] == 4:
            cpu_fp8._dot_packed_tile(packed, xs, (x_rows[0], x_rows[1], x_rows[2], x_rows[3]), factors, bk, out)
        elif x_rows.shape[0] == 3:
            cpu_fp8._dot_packed_tile(packed, xs, (x_rows[0], x_rows[1], x_rows[2]), factors, bk, out)
        else:
            cpu_fp8._dot_packed_tile(packed, xs, (x_rows[0],), factors, bk, out)

    rows = cpu_fp8._PACKED_ROWS
    generator = torch.Generator().manual_seed(cols + bk + act_rows)
    codes = torch.randint(0, 256, (rows, cols), generator=generator, dtype=torch.uint8)
    codes[0, :256] = torch.arange(256, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3A  # no NaN codes
    weights = codes.view(torch.float8_e4m3fn).double()
    acts = (torch.randn(5, cols, generator=generator) * 40).to(torch.float8_e4m3fn)
    groups = -(-cols // bk)
    x_rows = np.array([2, 0, 4, 1][:act_rows])
    factors = (torch.rand(act_rows, groups, generator=generator) + 0.25).numpy()
    out = np.full(4 * rows + 1, np.nan, np.float32)
    packed = np.zeros((cols // 2, rows), np.uint32)
    run(codes.numpy(), packed, acts.to(torch.bfloat16).view(torch.uint16).numpy(), x_rows, factors, bk, out)
    for j, x_row in enumerate(x_rows):
        products = weights * acts[x_row].double()
        group_sums = torch.stack([products[:, g * bk : (g + 1) * bk].sum(1) for g in range(groups)], 1)
        expected = (group_sums * torch.from_numpy(factors[j]).double()).sum(1)
        bound = 2 * cols * 2.0**-24 * products.abs().sum(1) * float(factors[j].max())
        got = torch.from_numpy(out[j * rows : (j + 1) * rows]).double()
        assert bool(((got - expected).abs() <= bound).all())
    assert np.isnan(out[act_rows * rows :]).all()
