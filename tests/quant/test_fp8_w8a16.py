"""FP8 with unquantized activations (w8a16, ``QuantConfig("fp8_block", activation="none")``):
``y = x @ dequant(W)^T`` accumulated in float32, the intermediate rounded to the activation
dtype and not quantized.

Every CPU strategy, float32 and bfloat16 activations, one and two threads, against the
float64 layer on the dequantized weights (`moeroute.quant.reference` with
``quantize_activations=False``, itself checked against a dense float64 layer written here),
within the bound of docs/quant.md; then the stack: MoE, load_state_dict, the custom op,
from_hf, and the refusals (FP8 dispatch, formats without w8a16); the FP8 CUDA kernels take it.
"""

from __future__ import annotations

import pytest
import torch

from helpers.reference import rel_error
from moeroute.bindings.torch import MoE
from moeroute.config import RouterConfig
from moeroute.experts.formats.fp8 import fp8_experts_forward
from moeroute.quant import QuantConfig, quantize_experts
from moeroute.quant.reference import moe_experts_reference

#: max |out - ref| / max |ref| against the float64 layer on the dequantized weights
#: (docs/quant.md): bfloat16 activations lose up to 2**-9 of each output to its rounding.
W8A16_BOUND = 5e-3

#: (H, I, block): whole 64-column steps (the bfloat16-dot kernels and the one-call forward
#: where the CPU has AVX512-BF16) and odd sizes (the float32 row kernels everywhere).
SHAPES = [(128, 128, (64, 64)), (96, 80, (32, 32))]
EXPERTS = 4


def _dequantize(q: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    """float64 ``q * s`` of stacked fp8_block weights [N, R, C] with scales [N, ceil(R/bn), ceil(C/bk)]."""
    bn, bk = block
    rows, cols = q.shape[1:]
    s = scale.double().repeat_interleave(bn, dim=1).repeat_interleave(bk, dim=2)[:, :rows, :cols]
    return q.double() * s


def _gate_up_dequantized(q, scale, block, inter):
    """The gate's and the up's block rows are numbered apart (QuantConfig.scale_shapes)."""
    half = scale.shape[1] // 2
    return torch.cat(
        [_dequantize(q[:, :inter], scale[:, :half], block), _dequantize(q[:, inter:], scale[:, half:], block)], dim=1
    )


def _dense(x, ids, weights, w_gate_up, w_down, intermediate_dtype):
    """float64 MoE on dense weights, written from the formula (silu)."""
    out = torch.zeros(x.shape[0], w_down.shape[1], dtype=torch.float64)
    inter = w_down.shape[2]
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = w_gate_up[e] @ x[t].double()
            act = torch.nn.functional.silu(h[:inter]) * h[inter:]
            act = act.to(intermediate_dtype).double()
            out[t] += float(weights[t, k]) * (w_down[e] @ act)
    return out


def _case(hidden, inter, block, tokens, seed=0):
    quant = QuantConfig("fp8_block", block_size=block, activation="none")
    generator = torch.Generator().manual_seed(seed)
    tensors = quantize_experts(
        torch.randn(EXPERTS, 2 * inter, hidden, generator=generator) * 0.05,
        torch.randn(EXPERTS, hidden, inter, generator=generator) * 0.05,
        quant,
    )
    x = torch.randn(tokens, hidden, generator=generator)
    ids = torch.stack([torch.randperm(EXPERTS, generator=generator)[:2] for _ in range(tokens)]).int()
    weights = torch.rand(tokens, 2, generator=generator)
    return quant, x, ids, weights, tensors


def test_config():
    quant = QuantConfig("fp8_block", activation="none")
    assert quant.activation == "none" and not quant.quantizes_activations
    assert QuantConfig("fp8_block").activation == "dynamic"  # w8a8 stays the default
    assert QuantConfig("fp8_block").quantizes_activations
    assert quant != QuantConfig("fp8_block")
    with pytest.raises(ValueError, match="activation='none' is not served by format='fp8_tensor'"):
        QuantConfig("fp8_tensor", activation="none")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_dense_layer_on_dequantized_weights(dtype):
    hidden, inter, block = 96, 80, (32, 32)
    quant, x, ids, weights, (q_gu, s_gu, q_d, s_d) = _case(hidden, inter, block, tokens=5)
    x = x.to(dtype)
    expected = _dense(
        x, ids, weights, _gate_up_dequantized(q_gu, s_gu, block, inter), _dequantize(q_d, s_d, block), dtype
    )
    got = moe_experts_reference(
        x, weights, ids, q_gu, s_gu, q_d, s_d, block, intermediate_dtype=dtype, quantize_activations=False
    )
    assert rel_error(got, expected) < 1e-6


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_every_strategy_within_the_bound(shape, dtype, threads):
    hidden, inter, block = shape
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for tokens in (1, 5, 40):
            quant, x, ids, weights, tensors = _case(hidden, inter, block, tokens, seed=tokens)
            x = x.to(dtype)
            expected = moe_experts_reference(
                x, weights, ids, *tensors, block, intermediate_dtype=dtype, quantize_activations=False
            )
            w8a8 = moe_experts_reference(x, weights, ids, *tensors, block, intermediate_dtype=dtype)
            for strategy in ("auto", "rows", "blocks"):
                out = fp8_experts_forward(x, weights, ids, *tensors, quant, strategy=strategy)
                assert out.dtype == dtype
                error = rel_error(out, expected)
                assert error < W8A16_BOUND, (tokens, strategy, error)
                # Not the w8a8 layer: quantizing the activations costs far more than the bound.
                assert rel_error(out, w8a8) > 2 * error, (tokens, strategy)
                if dtype == torch.float32:  # the float32 kernels: the definition to float32 sums
                    assert error < 1e-5, (tokens, strategy, error)
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------------------- through the stack

H, I, N, K = 128, 128, 6, 2
BLOCK = (64, 64)


def _modules():
    router = RouterConfig(N, K, "softmax", renormalize=True)
    w8a16 = MoE(router, H, I, quant=QuantConfig("fp8_block", block_size=BLOCK, activation="none"))
    w8a8 = MoE(router, H, I, quant=QuantConfig("fp8_block", block_size=BLOCK))
    generator = torch.Generator().manual_seed(7)
    tensors = quantize_experts(
        torch.randn(N, 2 * I, H, generator=generator) * 0.05,
        torch.randn(N, H, I, generator=generator) * 0.05,
        QuantConfig("fp8_block", block_size=BLOCK),
    )
    router_weight = torch.randn(N, H, generator=generator) * 0.1
    with torch.no_grad():
        w8a8.router_weight.copy_(router_weight)
        w8a8.load_routed_weights(tensors[0], tensors[2], gate_up_scale=tensors[1], down_scale=tensors[3])
    return w8a16, w8a8, tensors


def test_moe_load_state_dict_and_forward():
    w8a16, w8a8, tensors = _modules()
    # The same data as w8a8: a w8a8 layer's state dict loads into the w8a16 layer as it is.
    w8a16.load_state_dict(w8a8.state_dict())
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(8)).bfloat16()
    from moeroute.bindings.torch import arrays

    with torch.no_grad():
        weights, ids = arrays.select_experts(w8a16.compute_router_logits(x), w8a16.router, None)
        out = w8a16(x)
    expected = moe_experts_reference(
        x, torch.as_tensor(weights), torch.as_tensor(ids).long(), *tensors, BLOCK,
        intermediate_dtype=torch.bfloat16, quantize_activations=False,
    )  # fmt: skip
    assert out.dtype == torch.bfloat16
    assert rel_error(out, expected) < W8A16_BOUND
    with torch.no_grad():
        assert rel_error(w8a8(x), expected) > 2 * rel_error(out, expected)


def test_custom_op_takes_quant_activation_none():
    quant, x, ids, weights, (q_gu, s_gu, q_d, s_d) = _case(128, 128, (64, 64), tokens=6)
    x = x.bfloat16()
    out = torch.ops.moeroute.experts(
        x,
        q_gu,
        q_d,
        weights,
        ids,
        "silu",
        "auto",
        gate_up_scale=s_gu,
        down_scale=s_d,
        quant_format="fp8_block",
        block_size=[64, 64],
        quant_activation="none",
    )
    direct = fp8_experts_forward(x, weights, ids, q_gu, s_gu, q_d, s_d, quant)
    assert torch.equal(out, direct)


def test_refusals_name_the_argument():
    router = RouterConfig(N, K)
    with pytest.raises(ValueError, match=r"dispatch_dtype='fp8' needs w8a8 experts.*activation='none'"):
        MoE(router, H, I, quant=QuantConfig("fp8_block", activation="none"), dispatch_dtype="fp8")
    module = MoE(router, H, I, quant=QuantConfig("fp8_block", block_size=BLOCK, activation="none"))
    with pytest.raises(ValueError, match="input_scale was given.*activation='none'"):
        module.load_routed_weights(
            module.experts.w_gate_up,
            module.experts.w_down,
            gate_up_scale=module.experts.gate_up_scale,
            down_scale=module.experts.down_scale,
            input_scale=torch.ones(N, 2),
        )


def test_fp8_cuda_kernels_take_w8a16():
    # The quant check lets w8a16 through (it has its own CUDA kernel); these CPU tensors are
    # then stopped by the device check, before anything is launched.
    from moeroute.gpu.gemm_fp8 import fused_experts_fp8

    config = QuantConfig("fp8_block", activation="none")
    gen = torch.Generator().manual_seed(0)
    q_gu, s_gu, q_d, s_d = quantize_experts(
        torch.randn(2, 256, 128, generator=gen), torch.randn(2, 128, 128, generator=gen), config
    )
    x = torch.randn(3, 128, generator=gen)
    weights, ids = torch.rand(3, 2, generator=gen), torch.zeros(3, 2, dtype=torch.int32)
    with pytest.raises(TypeError, match="CUDA tensors"):
        fused_experts_fp8(x, q_gu, s_gu, q_d, s_d, weights, ids, quant=config)


def test_from_hf_chooses_w8a16_over_the_same_bytes():
    pytest.importorskip("transformers")
    from test_fp8_hf_quant_config import BLOCK as HF_BLOCK
    from test_fp8_hf_quant_config import H as HF_H
    from test_fp8_hf_quant_config import _fp8_block

    block = _fp8_block()
    w8a8 = MoE.from_hf(block, shared="runner")
    w8a16 = MoE.from_hf(block, quant=QuantConfig("fp8_block", block_size=HF_BLOCK, activation="none"), shared="runner")
    assert w8a16.quant.activation == "none" and w8a8.quant.activation == "dynamic"
    for name in ("w_gate_up", "gate_up_scale", "w_down", "down_scale"):
        a, b = getattr(w8a16.experts, name), getattr(w8a8.experts, name)
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    x = torch.randn(5, HF_H, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert not torch.equal(w8a16(x), w8a8(x))
    with pytest.raises(ValueError, match="differs from the block's FP8 experts"):
        MoE.from_hf(block, quant=QuantConfig("fp8_block", block_size=(64, 64), activation="none"))
