"""FP8 numerics at the edges: NaN weight bytes refused at load, a NaN activation giving NaN
on every path (as the definition does), and one numerics on every CPU path (the AVX512-BF16
kernels, the AVX2 and the portable fallbacks) against the w8a8 reference."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from helpers.isa import on_avx2
from helpers.reference import randn, rel_error
from moeroute.bindings.torch import MoE
from moeroute.experts.formats.fp8 import fp8_experts_forward
from moeroute.experts.modules import QuantizedExperts
from moeroute.config import RouterConfig
from moeroute.quant import QuantConfig, quantize_experts, quantize_fp8_activations
from moeroute.experts.cpu import fp8 as cpu_fp8
from moeroute.quant.reference import moe_experts_reference

_randn = functools.partial(randn, scale=0.1)

#: The bound every CPU path meets against `moeroute.quant.reference` (max |out - ref| / max
#: |ref|, docs/quant.md): bfloat16 activations lose up to 2**-9 of each output to its final
#: rounding, and a float32 summation order may flip an e4m3 rounding tie of the intermediate.
CPU_BOUND = 5e-3


# ------------------------------------------------------------------------------ NaN weight bytes

H, I, N, K = 128, 64, 4, 2
QUANT = QuantConfig("fp8_block", block_size=(32, 64))


def _poisoned(byte=0x7F, expert=2, tensor="w_down"):
    q_gu, s_gu, q_d, s_d = quantize_experts(_randn(N, 2 * I, H, seed=0), _randn(N, H, I, seed=1), QUANT)
    target = q_d if tensor == "w_down" else q_gu
    target.view(torch.uint8)[expert, 5, 7] = byte
    return q_gu, s_gu, q_d, s_d


@pytest.mark.parametrize("byte", [0x7F, 0xFF])
@pytest.mark.parametrize("tensor", ["w_gate_up", "w_down"])
def test_nan_weight_byte_refused_by_load_routed_weights(byte, tensor):
    module = MoE(RouterConfig(N, K), H, I, quant=QUANT)
    before = {name: p.detach().clone() for name, p in module.experts.quantized_tensors().items()}
    q_gu, s_gu, q_d, s_d = _poisoned(byte, 2, tensor)
    with pytest.raises(ValueError, match=rf"{tensor}\[2, 5, 7\] \(expert 2\).*0x{byte:02X}.*NaN"):
        module.load_routed_weights(q_gu, q_d, gate_up_scale=s_gu, down_scale=s_d)
    for name, tensor_after in module.experts.quantized_tensors().items():  # nothing written
        assert torch.equal(tensor_after.view(torch.uint8), before[name].view(torch.uint8))
    # 0x7E (448) and 0xFE (-448), the largest finite codes, load.
    q_gu, s_gu, q_d, s_d = _poisoned(byte - 1, 2, tensor)
    module.load_routed_weights(q_gu, q_d, gate_up_scale=s_gu, down_scale=s_d)


def test_nan_weight_byte_refused_by_load_state_dict():
    q_gu, s_gu, q_d, s_d = _poisoned(0xFF, 1, "w_gate_up")
    experts = QuantizedExperts(N, H, I, quant=QUANT)
    state = {"w_gate_up": q_gu, "w_down": q_d, "gate_up_scale": s_gu, "down_scale": s_d}
    with pytest.raises(ValueError, match=r"w_gate_up\[1, 5, 7\] \(expert 1\).*NaN"):
        experts.load_state_dict(state)
    assert not experts.w_gate_up.view(torch.uint8).any()  # still the zeros it was built with
    # The module's own names under an MoE, and DeepSeek-V3's per-expert keys.
    module = MoE(RouterConfig(N, K), H, I, quant=QUANT)
    router = module.router_weight.detach().clone()
    with pytest.raises(ValueError, match=r"w_gate_up\[1, 5, 7\].*NaN"):
        module.load_state_dict(
            {**module.state_dict(), "router_weight": router + 1.0, "experts.w_gate_up": q_gu}, strict=False
        )
    assert torch.equal(module.router_weight, router)  # refused before the router was copied
    nb = s_gu.shape[1] // 2
    per_expert = {}
    for e in range(N):
        for name, weight, scale in (
            ("gate_proj", q_gu[e, :I], s_gu[e, :nb]),
            ("up_proj", q_gu[e, I:], s_gu[e, nb:]),
            ("down_proj", q_d[e], s_d[e]),
        ):
            per_expert[f"experts.{e}.{name}.weight"] = weight.contiguous()
            per_expert[f"experts.{e}.{name}.weight_scale_inv"] = scale.contiguous()
    # named by its checkpoint key; checked before anything is written into the layer
    before = module.experts.w_gate_up.view(torch.uint8).clone()
    with pytest.raises(ValueError, match=r"experts\.1\.gate_proj\.weight\[5, 7\] \(expert 1\) is the byte 0xFF.*NaN"):
        module.load_state_dict({**per_expert, "gate.weight": module.router_weight.detach().clone()}, strict=False)
    assert torch.equal(module.experts.w_gate_up.view(torch.uint8), before)


def test_nan_weight_byte_refused_by_load_experts(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from moeroute.bindings.torch import load_experts

    q_gu, s_gu, q_d, s_d = _poisoned(0x7F, 3, "w_down")
    model = torch.nn.Module()
    model.mlp = MoE(RouterConfig(N, K), H, I, quant=QUANT)
    nb = s_gu.shape[1] // 2
    state = {}
    for e in range(N):
        for name, weight, scale in (
            ("gate_proj", q_gu[e, :I], s_gu[e, :nb]),
            ("up_proj", q_gu[e, I:], s_gu[e, nb:]),
            ("down_proj", q_d[e], s_d[e]),
        ):
            state[f"mlp.experts.{e}.{name}.weight"] = weight.contiguous()
            state[f"mlp.experts.{e}.{name}.weight_scale_inv"] = scale.contiguous()
    safetensors_torch.save_file(state, str(tmp_path / "per_expert.safetensors"))
    with pytest.raises(ValueError, match=r"mlp\.experts\.3\.down_proj\.weight.*\[5, 7\].*NaN"):
        load_experts(model, tmp_path / "per_expert.safetensors")
    assert not model.mlp.experts.w_down.view(torch.uint8).any()
    stacked = {
        "mlp.experts.gate_up_proj": q_gu,
        "mlp.experts.down_proj": q_d,
        "mlp.experts.gate_up_proj_scale_inv": s_gu,
        "mlp.experts.down_proj_scale_inv": s_d,
    }
    (tmp_path / "per_expert.safetensors").unlink()
    safetensors_torch.save_file(stacked, str(tmp_path / "stacked.safetensors"))
    with pytest.raises(ValueError, match=r"mlp\.experts\.down_proj\[3\].*\[5, 7\].*NaN"):
        load_experts(model, tmp_path / "stacked.safetensors")
    assert not model.mlp.experts.w_down.view(torch.uint8).any()


# ------------------------------------------------------------------------- NaN in an activation


def test_quantize_rows_nan_and_inf_as_torch():
    x = _randn(3, 256, seed=4, scale=1.0)
    x[0, 5] = float("nan")
    x[1, 200] = float("inf")
    for dtype in (torch.float32, torch.bfloat16):
        rows = x.to(dtype)
        q_ref, s_ref = quantize_fp8_activations(rows, 128)
        q = np.empty((3, 256), np.float32)
        s = np.empty((3, 2), np.float32)
        cpu_fp8.quantize_rows(rows.float().numpy(), 128, False, np.float32(1e-10), q, s)
        torch.testing.assert_close(torch.from_numpy(s), s_ref, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(torch.from_numpy(q), q_ref.float(), rtol=0, atol=0, equal_nan=True)
        assert torch.isnan(torch.from_numpy(q[0, :128])).all() and not np.isnan(q[0, 128:]).any()
    # The float32 -> bfloat16 rounding (the intermediate) keeps a NaN a NaN.
    nan_payload = torch.tensor([0x7F800001], dtype=torch.int32).view(torch.float32)
    x[2, :1] = nan_payload
    cpu_fp8.quantize_rows(x.numpy(), 128, True, np.float32(1e-10), q, s)
    assert np.isnan(s[2, 0]) and np.isnan(q[2, :128]).all() and not np.isnan(s[2, 1])


def _fp8_args(hidden, inter, block, tokens, experts, seed=0):
    quant = QuantConfig("fp8_block", block_size=block)
    q_gu, s_gu, q_d, s_d = quantize_experts(
        _randn(experts, 2 * inter, hidden, seed=seed), _randn(experts, hidden, inter, seed=seed + 1), quant
    )
    x = randn(tokens, hidden, seed=seed + 2)
    generator = torch.Generator().manual_seed(seed + 3)
    ids = torch.stack([torch.randperm(experts, generator=generator)[:2] for _ in range(tokens)]).int()
    weights = torch.rand(tokens, 2, generator=generator)
    return quant, x, ids, weights, (q_gu, s_gu, q_d, s_d)


def _op(quant, x, ids, weights, tensors, gemm):
    q_gu, s_gu, q_d, s_d = tensors
    return torch.ops.moeroute.experts(
        x,
        q_gu,
        q_d,
        weights,
        ids,
        "silu",
        gemm,
        gate_up_scale=s_gu,
        down_scale=s_d,
        quant_format=quant.format,
        block_size=list(quant.block_size),
    )


# (H, I, block): whole 64-column steps (the bfloat16-dot kernels and the one-call forward
# where the CPU has AVX512-BF16), and odd sizes (the float32 row kernels everywhere).
@pytest.mark.parametrize("shape", [(128, 128, (64, 64)), (96, 80, (32, 32))])
@pytest.mark.parametrize("tokens", [3, 12])
@pytest.mark.parametrize("gemm", ["auto", "rows", "blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_activation_gives_nan_for_its_token(shape, tokens, gemm, dtype):
    hidden, inter, block = shape
    quant, x, ids, weights, tensors = _fp8_args(hidden, inter, block, tokens, experts=2)
    x[1, 7] = float("nan")
    x = x.to(dtype)
    out = _op(quant, x, ids, weights, tensors, gemm)
    expected = moe_experts_reference(x, weights, ids.long(), *tensors, quant.block_size, intermediate_dtype=dtype)
    assert torch.isnan(expected[1]).all()  # the definition
    assert torch.isnan(out[1]).all(), f"finite outputs for the NaN token: {out[1][~torch.isnan(out[1])][:4]}"
    rest = torch.ones(tokens, dtype=torch.bool)
    rest[1] = False
    assert not torch.isnan(out[rest]).any()
    assert rel_error(out[rest].float(), expected[rest]) < CPU_BOUND


# ----------------------------------------------------------------- one numerics on every CPU path


def _path_errors() -> dict:
    """{"bf16_dot": whether the bfloat16-dot kernels serve the shape, "errors": {case: max
    |out - ref| / max |ref|}} of the FP8 layer on this process's CPU path: H = I = 256 in
    blocks of 128 (two groups per row), 4 experts, T in (1, 5, 40) (40: "auto" takes the
    blocks where the bfloat16-dot kernels do not run), every strategy, both dtypes."""
    hidden = inter = 256
    quant = QuantConfig("fp8_block", block_size=(128, 128))
    generator = torch.Generator().manual_seed(0)
    tensors = quantize_experts(
        torch.randn(4, 2 * inter, hidden, generator=generator) * 0.05,
        torch.randn(4, hidden, inter, generator=generator) * 0.05,
        quant,
    )
    errors = {}
    for tokens in (1, 5, 40):
        x = torch.randn(tokens, hidden, generator=generator)
        ids = torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(tokens)]).int()
        weights = torch.rand(tokens, 2, generator=generator)
        for dtype in (torch.float32, torch.bfloat16):
            expected = moe_experts_reference(
                x.to(dtype), weights, ids, *tensors, quant.block_size, intermediate_dtype=dtype
            )
            for strategy in ("auto", "rows", "blocks"):
                out = fp8_experts_forward(x.to(dtype), weights, ids, *tensors, quant, strategy=strategy)
                errors[f"T={tokens} {dtype} {strategy}"] = rel_error(out, expected)
    return {"bf16_dot": bool(cpu_fp8.bf16_dot_serves(hidden, inter, (128, 128), (128, 128))), "errors": errors}


def test_every_cpu_path_one_numerics():
    """The default path (the AVX512-BF16 kernels where the CPU has them) and the AVX2 path
    (the float32 row kernels; the blocks at 40 rows) meet one bound against the reference."""
    avx2 = on_avx2("quant.test_fp8_numerics", "_path_errors")
    assert not avx2["bf16_dot"], "the AVX2 run took the bfloat16-dot kernels"
    failures = [
        f"{path} {case}: {error:.2e}"
        for path, report in (("default", _path_errors()), ("avx2", avx2))
        for case, error in report["errors"].items()
        if not error < CPU_BOUND
    ]
    assert not failures, failures
