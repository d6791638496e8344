"""MoE(quant=QuantConfig("mxfp4")): packed gpt-oss experts against a float32 reference.

The reference dequantizes the same bytes from the format's definition (a table lookup per
nibble, low nibble = even element, times 2 ** (s - 127)), routes with
moeroute.routing.reference and runs the gpt-oss MLP in float64: gate_up = W x + b, the
swigluoai activation (alpha 1.702, limit 7), down = W a + b, weighted by the router.
Tolerances (max abs diff / max abs reference): 1e-4 with float32 activations, 2e-2 with
bfloat16 ones.
"""

from __future__ import annotations

import pytest
import torch

import helpers.reference
from helpers.reference import dense_experts, randn
from moeroute.bindings.torch import MoE
from moeroute.config import RouterConfig
from moeroute.quant import QuantConfig, quantize_mxfp4
from moeroute.routing import reference

H, I, N, K = 128, 96, 8, 2
RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
ROUTER = RouterConfig(N, K, "softmax", renormalize=True)  # gpt-oss: softmax over the top-k logits
plain_dequantize = helpers.reference.dequantize_mxfp4


def gpt_oss_weights(seed=0, inter=I):
    """Packed experts (gate rows first) and float biases, as a checkpoint would hold them."""
    w_gate_up, w_down = randn(N, 2 * inter, H, seed=seed, scale=0.1), randn(N, H, inter, seed=seed + 1, scale=0.1)
    return (
        quantize_mxfp4(w_gate_up),
        quantize_mxfp4(w_down),
        randn(N, 2 * inter, seed=seed + 2, scale=0.5),
        randn(N, H, seed=seed + 3, scale=0.5),
    )


def build(gemm="auto", seed=0, inter=I, **kwargs):
    module = MoE(
        ROUTER,
        H,
        inter,
        activation="swigluoai",
        expert_bias=True,
        router_bias=True,
        quant=QuantConfig("mxfp4"),
        gemm=gemm,
        **kwargs,
    )
    gate_up, down, gate_up_bias, down_bias = weights = gpt_oss_weights(seed, inter)
    with torch.no_grad():
        module.router_weight.copy_(randn(N, H, seed=seed + 4))
        module.router_bias.copy_(randn(N, seed=seed + 5))
    module.load_routed_weights(w_gate_up=gate_up, w_down=down, gate_up_bias=gate_up_bias, down_bias=down_bias)
    return module, weights


@torch.no_grad()
def reference_output(module, x, weights):
    (gu_blocks, gu_scales), (d_blocks, d_scales), gate_up_bias, down_bias = weights
    w_gate_up, w_down = plain_dequantize(gu_blocks, gu_scales), plain_dequantize(d_blocks, d_scales)
    x = x.reshape(-1, H).double()
    logits = (x @ module.router_weight.double().T + module.router_bias.double()).float()
    topk_weights, topk_ids = reference.select_experts(logits.numpy(), module.router, None)
    return dense_experts(x, topk_weights, topk_ids, w_gate_up, w_down, "swigluoai", gate_up_bias, down_bias)


def rel_error(actual, expected):
    """helpers.reference.rel_error of the output flattened to the reference's [T, H]."""
    return helpers.reference.rel_error(actual.reshape(expected.shape), expected)


@pytest.mark.parametrize("gemm", ["rows", "blocks", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(12, H), (2, 5, H)])
@pytest.mark.parametrize("inter", [I, 128])
def test_matches_float32_reference(gemm, dtype, shape, inter):
    # I = 128 (H and I whole pairs of blocks): with bfloat16 activations the row strategy
    # runs the bfloat16-dot kernels on CPUs that have them.
    from moeroute.experts.cpu import mxfp4_dot

    assert mxfp4_dot.serves(dtype == torch.bfloat16, H, inter) == (
        mxfp4_dot.BF16_DOT and dtype == torch.bfloat16 and inter == 128
    )
    module, weights = build(gemm, inter=inter)
    x = randn(*shape, seed=99).to(dtype)
    with torch.no_grad():
        out = module(x)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_error(out, reference_output(module, x, weights)) < RTOL[dtype]


def test_one_thread_and_two_give_the_same_bits():
    # One torch thread runs the serial kernels (each expert's down weights one stream), two
    # the parallel ones (output columns split): a dot does not depend on its neighbours. At
    # I = 128 with bfloat16 activations that is the one-call forward on AVX512-BF16 CPUs.
    module, weights = build("rows", inter=128)
    x = randn(12, H, seed=98).to(torch.bfloat16)
    outs = []
    previous = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            with torch.no_grad():
                outs.append(module(x))
        finally:
            torch.set_num_threads(previous)
    assert torch.equal(outs[0], outs[1])
    assert rel_error(outs[0], reference_output(module, x, weights)) < RTOL[torch.bfloat16]


def test_prefill_sized_batch_uses_blocks_and_matches():
    # 96 tokens x 2 over 8 experts: 24 rows per expert, past the "rows" strategy's limit.
    module, weights = build("auto")
    x = randn(96, H, seed=7)
    with torch.no_grad():
        out = module(x)
    assert rel_error(out, reference_output(module, x, weights)) < RTOL[torch.float32]


def test_holds_packed_bytes_only():
    module, ((gu_blocks, gu_scales), (d_blocks, d_scales), gate_up_bias, down_bias) = build()
    experts = module.experts
    assert torch.equal(experts.w_gate_up, gu_blocks) and torch.equal(experts.gate_up_scale, gu_scales)
    assert torch.equal(experts.w_down, d_blocks) and torch.equal(experts.down_scale, d_scales)
    assert torch.equal(experts.b_gate_up, gate_up_bias) and torch.equal(experts.b_down, down_bias)
    float_tensors = [name for name, t in experts.state_dict().items() if t.dtype != torch.uint8]
    assert sorted(float_tensors) == ["b_down", "b_gate_up"]  # no dequantized weight anywhere
    packed = sum(t.numel() for t in experts.state_dict().values() if t.dtype == torch.uint8)
    assert packed == N * (3 * H * I // 2 + 3 * H * I // 32)
    # module.to(dtype) keeps the bytes as they are.
    module.to(torch.bfloat16)
    assert module.experts.w_gate_up.dtype == torch.uint8 and torch.equal(module.experts.w_gate_up, gu_blocks)


def test_load_errors_are_clear():
    module = MoE(ROUTER, H, I, activation="swigluoai", expert_bias=True, quant=QuantConfig("mxfp4"))
    gate_up, down, _, _ = gpt_oss_weights()
    with pytest.raises(ValueError, match="w_gate_up is a torch.float32 tensor.*quantize_mxfp4"):
        module.load_routed_weights(randn(N, 2 * I, H, seed=0), down)
    bad_scales = gate_up[1].clone()
    bad_scales[3, 5, 1] = 255
    with pytest.raises(ValueError, match=r"w_gate_up scales\[3, 5, 1\] is 255"):
        module.load_routed_weights((gate_up[0], bad_scales), down)
    with pytest.raises(ValueError, match="w_down scales has shape"):
        module.load_routed_weights(gate_up, (down[0], down[1][:, :, :1]))
    with pytest.raises(ValueError, match=r"w_down scales has shape \(8, 64, 3\), expected \[8, 128, 3\]"):
        module.load_routed_weights(gate_up, (down[0][:, :64], down[1][:, :64]))
    with pytest.raises(ValueError, match="gate_up_scale was given"):
        module.load_routed_weights(gate_up, down, gate_up_scale=gate_up[1])
    with pytest.raises(ValueError, match="multiple of 32"):
        MoE(ROUTER, H, 40, quant=QuantConfig("mxfp4"))
    with pytest.raises(ValueError, match="expert_bias=True is not served"):
        MoE(ROUTER, H, I, expert_bias=True, quant=QuantConfig("fp8_block"))


def test_expert_parallel_slice_keeps_only_local_bytes():
    """A rank's experts are the rows of the full packed tensors it holds (one process: the
    layout of rank 1 of 2 built by hand is covered by the EP tests; here the module's own
    copy path with replicas)."""
    module, weights = build(physical_to_logical=[3, 1, 4, 1, 5, 0, 2, 6, 7, 3])
    ids = module.routed_expert_ids()
    (gu_blocks, gu_scales), (d_blocks, _), gate_up_bias, _ = weights
    assert torch.equal(module.experts.w_gate_up[: len(ids)], gu_blocks[ids])
    assert torch.equal(module.experts.gate_up_scale[: len(ids)], gu_scales[ids])
    assert torch.equal(module.experts.w_down[: len(ids)], d_blocks[ids])
    assert torch.equal(module.experts.b_gate_up[: len(ids)], gate_up_bias[ids])
    x = randn(10, H, seed=3)
    with torch.no_grad():
        out = module(x)
    assert rel_error(out, reference_output(module, x, weights)) < RTOL[torch.float32]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_blocks_match_reference():
    module, weights = build("auto")
    module = module.cuda()
    x = randn(12, H, seed=99)
    with torch.no_grad():
        out = module(x.cuda()).cpu()
    assert rel_error(out, reference_output(module.cpu(), x, weights)) < 1e-3


def test_state_dict_round_trip():
    module, weights = build()
    fresh = MoE(ROUTER, H, I, activation="swigluoai", expert_bias=True, router_bias=True, quant=QuantConfig("mxfp4"))
    fresh.load_state_dict(module.state_dict())
    x = randn(6, H, seed=8)
    with torch.no_grad():
        assert torch.equal(fresh(x), module(x))
    assert torch.equal(fresh.experts.w_down, weights[1][0])


def test_fused_shared_slots_are_quantized_with_the_layer():
    """A shared MLP fused as an expert slot is quantized with quantize_mxfp4 (no biases)."""
    from torch import nn

    shared = nn.Module()
    shared.gate_proj, shared.up_proj = nn.Linear(H, I, bias=False), nn.Linear(H, I, bias=False)
    shared.down_proj = nn.Linear(I, H, bias=False)
    shared.act_fn = nn.SiLU()
    shared.forward = lambda x: shared.down_proj(shared.act_fn(shared.gate_proj(x)) * shared.up_proj(x))
    module = MoE(ROUTER, H, I, shared_experts=shared, shared="fused", quant=QuantConfig("mxfp4"))
    slot = module.experts.w_gate_up.shape[0] - 1
    gate_up = torch.cat([shared.gate_proj.weight, shared.up_proj.weight]).detach()
    blocks, scales = quantize_mxfp4(gate_up)
    assert torch.equal(module.experts.w_gate_up[slot], blocks)
    assert torch.equal(module.experts.gate_up_scale[slot], scales)
    assert torch.equal(module.experts.w_down[slot], quantize_mxfp4(shared.down_proj.weight.detach())[0])
