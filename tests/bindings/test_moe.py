"""The MoE module and its parts: LocalExperts, LocalDispatcher, input checks, dtypes, GPU path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers.reference import dense_experts, rel_error
from helpers.reference import generator as _generator
from helpers.reference import swigluoai as swigluoai_reference
from moeroute import cpu_features
from moeroute.bindings.torch.dispatch import DispatchHandle, LocalDispatcher, check_dispatch_inputs
from moeroute.bindings.torch import arrays
from moeroute.experts import modules as experts_modules
from moeroute.experts.modules import LocalExperts
from moeroute.experts.choose import (
    BF16_ROWS_MAX_MEAN_ROWS,
    PADDED_MAX_ROWS,
    ROWS_MAX_MEAN_ROWS,
    choose,
    rows_bound,
)
from moeroute.experts.formats.unquantized import (
    expert_mlp,
    onednn_linear_serves,
    padded_expert_mlp,
    streamed_expert_mlp,
)
from moeroute.bindings.torch.moe import MoE
from moeroute.config import RouterConfig
from moeroute.layout import ExpertLayout
from moeroute.routing import reference

H, I, N, K = 24, 16, 8, 3
ROUTER = RouterConfig(N, K, "softmax", renormalize=True, routed_scaling_factor=1.5)
FP32_RTOL = 1e-5
# Normwise tolerances for half precision: the layer rounds its input, each expert's
# intermediate and output to the dtype (ulp 2**-11 for float16, 2**-8 for bfloat16).
HALF_RTOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2}


def make_moe(seed=0, dtype=torch.float32, activation="silu", **kwargs):
    module = MoE(ROUTER, H, I, activation=activation, dtype=dtype, **kwargs)
    generator = _generator(seed)
    w_gate_up = torch.randn(N, 2 * I, H, generator=generator) * 0.3
    w_down = torch.randn(N, H, I, generator=generator) * 0.3
    with torch.no_grad():
        module.router_weight.copy_(torch.randn(N, H, generator=generator))
        module.load_routed_weights(w_gate_up.to(dtype), w_down.to(dtype))
    return module, (w_gate_up.to(dtype), w_down.to(dtype))


def dense_reference(module, x, weights, activation="silu"):
    """sum_k w_k * expert_k(x) in float64, routing from moeroute.routing.reference."""
    logits = F.linear(x.to(module.router_weight.dtype), module.router_weight).float()
    topk_weights, topk_ids = reference.select_experts(logits.numpy(), module.router)
    return dense_experts(x, topk_weights, topk_ids, *weights, activation)


# ------------------------------------------------------------------ the module


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
def test_forward_matches_dense_reference(activation):
    module, weights = make_moe(activation=activation)
    x = torch.randn(10, H, generator=_generator(1))
    out = module(x)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_error(out, dense_reference(module, x, weights, activation)) < FP32_RTOL


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    module, weights = make_moe(seed=2, dtype=dtype)
    x = torch.randn(16, H, generator=_generator(3)).to(dtype)
    out = module(x)
    assert out.dtype == dtype
    expected = dense_reference(module, x, weights)
    assert rel_error(out, expected) < HALF_RTOL[dtype]


def test_three_dimensional_input_and_given_router_logits():
    module, _ = make_moe(seed=4)
    x = torch.randn(2, 5, H, generator=_generator(5))
    out = module(x)
    assert out.shape == (2, 5, H)
    flat = module(x.reshape(10, H))
    assert torch.equal(out.reshape(10, H), flat)
    logits = module.compute_router_logits(x.reshape(10, H))
    assert torch.equal(module(x, router_logits=logits), out)
    # different logits give a different answer: the given logits are really used
    assert not torch.allclose(module(x, router_logits=-logits), out)


def test_zero_tokens():
    module, _ = make_moe()
    assert module(torch.zeros(0, H)).shape == (0, H)
    assert module(torch.zeros(3, 0, H)).shape == (3, 0, H)


def test_redundant_experts_compute_their_logical_expert():
    module, weights = make_moe(seed=6, num_redundant_experts=3)
    assert module.experts.num_local_experts == N + 3
    assert module.routed_expert_ids() == list(range(N)) + [0, 1, 2]
    x = torch.randn(40, H, generator=_generator(7))
    assert rel_error(module(x), dense_reference(module, x, weights)) < FP32_RTOL


def test_output_regime_without_shared_expert():
    module, weights = make_moe(seed=8, scaling_regime="output")
    x = torch.randn(9, H, generator=_generator(9))
    assert rel_error(module(x), dense_reference(module, x, weights)) < FP32_RTOL


def test_inference_only():
    module, _ = make_moe()
    x = torch.randn(4, H, requires_grad=True)
    with pytest.raises(RuntimeError, match="inference-only.*hidden_states"):
        module(x)
    with pytest.raises(RuntimeError, match="inference-only.*router_logits"):
        module(x.detach(), torch.zeros(4, N, requires_grad=True))
    with torch.no_grad():
        no_grad_out = module(x)
    with torch.inference_mode():
        assert torch.equal(module(x), no_grad_out)
    # Parameters that require grad do not ask for gradients: the layer runs as inference.
    module.experts.w_down.requires_grad_(True)
    out = module(x.detach())
    assert not out.requires_grad and torch.equal(out, no_grad_out)


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda: torch.randn(4, H + 1), "H=24"),
        (lambda: torch.randn(H), r"\[T, H\]"),
        (lambda: torch.randn(4, H, dtype=torch.float64), "dtype"),
        (lambda: np.zeros((4, H), np.float32), "torch.Tensor"),
    ],
)
def test_forward_rejects_bad_hidden_states(bad, match):
    module, _ = make_moe()
    with pytest.raises((ValueError, TypeError), match=match):
        module(bad())


def test_forward_rejects_bad_router_logits():
    module, _ = make_moe()
    x = torch.randn(4, H)
    with pytest.raises(ValueError, match=r"router_logits must be \[T=4, N=8\]"):
        module(x, router_logits=torch.randn(4, N + 1))
    with pytest.raises(ValueError, match="float tensor"):
        module(x, router_logits=torch.zeros(4, N, dtype=torch.int64))


def test_forward_rejects_device_mismatch():
    module = MoE(ROUTER, H, I, device="meta")
    with pytest.raises(ValueError, match="device meta is not supported"):
        module(torch.zeros(2, H, device="meta"))
    with pytest.raises(ValueError, match="expert weights are on meta"):
        module(torch.zeros(2, H))


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(router=(8, 2)), TypeError, "RouterConfig"),
        (dict(hidden_size=0), ValueError, "hidden_size=0"),
        (dict(intermediate_size=2.5), ValueError, "intermediate_size=2.5"),
        (dict(shared="sometimes"), ValueError, "shared='sometimes'"),
        (dict(shared_expert_gate=nn.Linear(H, 1)), ValueError, "without shared_experts"),
        (dict(activation="relu"), ValueError, "activation='relu'"),
        (dict(scaling_regime="input"), ValueError, "scaling_regime='input'"),
        (dict(dtype=torch.float64), ValueError, "dtype=torch.float64"),
        (dict(device="mps"), ValueError, "device=mps"),
        (dict(shared_experts=3), TypeError, "shared_experts"),
        (dict(routed_hidden_size=12), ValueError, "routed_hidden_size=12"),
        (dict(ep_group=object(), dispatch="none"), ValueError, "dispatch='none'"),
        (dict(dispatch="ring"), ValueError, "dispatch='ring'"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs, error, match):
    args = dict(router=ROUTER, hidden_size=H, intermediate_size=I)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        MoE(**args)


def test_load_weights_checks_shapes_and_mode():
    module, _ = make_moe()
    with pytest.raises(ValueError, match="w_gate_up has shape"):
        module.load_routed_weights(torch.zeros(N, I, H), torch.zeros(N, H, I))
    with pytest.raises(ValueError, match="w_down has shape"):
        module.load_routed_weights(torch.zeros(N, 2 * I, H), torch.zeros(N, I, H))
    with pytest.raises(ValueError, match="fused layout"):
        module.load_shared_weights(nn.Module())


# ------------------------------------------------------------------ LocalExperts


@pytest.mark.parametrize("gemm", ["auto", "loop", "padded", "rows"])
def test_local_experts_weighted_sum_skips_foreign_slots(gemm):
    experts = LocalExperts(4, H, I, gemm=gemm)
    generator = _generator(10)
    with torch.no_grad():
        experts.w_gate_up.copy_(torch.randn(4, 2 * I, H, generator=generator) * 0.3)
        experts.w_down.copy_(torch.randn(4, H, I, generator=generator) * 0.3)
    x = torch.randn(6, H, generator=generator)
    ids = torch.tensor([[0, 3], [-1, 2], [-1, -1], [1, 1], [4, 0], [2, -1]], dtype=torch.int32)
    weights = torch.rand(6, 2, generator=generator)
    out = experts(x, weights, ids)
    expected = torch.zeros(6, H, dtype=torch.float64)
    for t in range(6):
        for k in range(2):
            e = int(ids[t, k])
            if 0 <= e < 4:  # -1 and ids past L are held elsewhere
                h = experts.w_gate_up[e].double() @ x[t].double()
                expected[t] += float(weights[t, k]) * (experts.w_down[e].double() @ (F.silu(h[:I]) * h[I:]))
    assert torch.equal(out[2], torch.zeros(H))
    assert rel_error(out, expected) < FP32_RTOL


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 0, 2], [40, 1, 0, 7], [0, 0, 0, 0]])
def test_gemm_strategies_agree_with_per_row_reference(counts):
    generator = _generator(sum(counts))
    offsets = np.concatenate([[0], np.cumsum(counts)]).tolist()
    rows = offsets[-1]
    x = torch.randn(rows, H, generator=generator)
    w_gate_up = torch.randn(4, 2 * I, H, generator=generator) * 0.3
    w_down = torch.randn(4, H, I, generator=generator) * 0.3
    expected = torch.zeros(rows, H, dtype=torch.float64)
    for e in range(4):
        for r in range(offsets[e], offsets[e + 1]):
            h = w_gate_up[e].double() @ x[r].double()
            expected[r] = w_down[e].double() @ (F.silu(h[:I]) * h[I:])
    results = [expert_mlp(x, offsets, w_gate_up, w_down, linear="mm"), padded_expert_mlp(x, offsets, w_gate_up, w_down)]
    if onednn_linear_serves(torch.float32):
        results.append(expert_mlp(x, offsets, w_gate_up, w_down, linear="onednn"))
    for out in results:
        assert out.shape == (rows, H)
        if rows:
            assert rel_error(out, expected) < FP32_RTOL


@pytest.mark.parametrize(
    "dtype,rtol", [(torch.bfloat16, HALF_RTOL[torch.bfloat16]), (torch.float16, HALF_RTOL[torch.float16])]
)
def test_loop_strategy_half_precision(dtype, rtol):
    """The loop takes oneDNN or torch.mm depending on the dtype; both agree with float64."""
    generator = _generator(21)
    offsets = [0, 5, 5, 12]
    x = torch.randn(12, H, generator=generator)
    w_gate_up = torch.randn(3, 2 * I, H, generator=generator) * 0.3
    w_down = torch.randn(3, H, I, generator=generator) * 0.3
    expected = torch.cat(
        [
            expert_mlp(
                x[a:b].double(), [0, b - a], w_gate_up[e : e + 1].double(), w_down[e : e + 1].double(), linear="mm"
            )
            for e, (a, b) in enumerate(zip(offsets[:-1], offsets[1:]))
        ]
    )
    out = expert_mlp(x.to(dtype), offsets, w_gate_up.to(dtype), w_down.to(dtype))
    assert out.dtype == dtype
    assert rel_error(out, expected) < rtol


def _slot_reference(x, local_ids, weights, w_gate_up, w_down):
    """sum over each row's valid slots of w * expert(x), in float64, slot by slot."""
    return dense_experts(x, weights, local_ids, w_gate_up, w_down)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streamed_expert_mlp_against_slot_reference(dtype):
    """Gather, MLP and float32 sums per expert: equal to the slot-by-slot float64 sum,
    rows without a local slot zero; the stage clock adds up its three stages."""
    generator = _generator(33)
    num_tokens, experts = 40, 5
    x = torch.randn(num_tokens, H, generator=generator)
    local_ids = torch.randint(-1, experts, (num_tokens, 3), generator=generator, dtype=torch.int32)
    local_ids[:, 1] = torch.where(local_ids[:, 1] == local_ids[:, 0], -1, local_ids[:, 1])
    local_ids[:, 2] = torch.where(
        (local_ids[:, 2] == local_ids[:, 0]) | (local_ids[:, 2] == local_ids[:, 1]), -1, local_ids[:, 2]
    )
    local_ids[7] = -1  # a row with nothing here
    weights = torch.rand(num_tokens, 3, generator=generator)
    w_gate_up = torch.randn(experts, 2 * I, H, generator=generator) * 0.3
    w_down = torch.randn(experts, H, I, generator=generator) * 0.3
    sorted_slots, offsets, _ = arrays.sort_by_expert(local_ids, experts)
    seconds = {}
    out = streamed_expert_mlp(
        x.to(dtype),
        sorted_slots,
        offsets.tolist(),
        weights,
        w_gate_up.to(dtype),
        w_down.to(dtype),
        stage_seconds=seconds,
    )
    assert out.dtype == dtype and out.shape == (num_tokens, H)
    expected = _slot_reference(x.to(dtype), local_ids, weights, w_gate_up.to(dtype), w_down.to(dtype))
    assert rel_error(out, expected) < (FP32_RTOL if dtype == torch.float32 else HALF_RTOL[dtype])
    assert torch.equal(out[7], torch.zeros(H, dtype=dtype))
    assert set(seconds) == {"permute", "gemm", "combine"} and all(v >= 0 for v in seconds.values())


NEEDS_ONEDNN = pytest.mark.skipif(
    not onednn_linear_serves(torch.float32), reason="this torch build has no oneDNN linear"
)


@NEEDS_ONEDNN
def test_packed_cpu_weights_give_identical_outputs():
    module, _ = make_moe(seed=4, gemm="loop")
    x = torch.randn(50, H, generator=_generator(5))
    with torch.inference_mode():
        plain = module(x)
    assert module.pack_cpu_weights() is module
    packed_gate_up, _ = module.experts.cpu_weights()
    assert isinstance(packed_gate_up, list) and len(packed_gate_up) == N
    with torch.inference_mode():
        assert torch.equal(module(x), plain)  # the same oneDNN kernels: bit for bit
    module.pack_cpu_weights(False)
    assert module.experts.cpu_weights()[0] is module.experts.w_gate_up


def _change_by_copy(module, other):
    with torch.no_grad():
        module.experts.w_gate_up.copy_(other.experts.w_gate_up)
        module.experts.w_down.copy_(other.experts.w_down)


def _change_by_load_state_dict(module, other):
    module.load_state_dict(other.state_dict())


def _change_by_assigning_data(module, other):
    module.experts.w_gate_up.data = other.experts.w_gate_up.detach().clone()
    module.experts.w_down.data = other.experts.w_down.detach().clone()


def _change_by_load_routed_weights(module, other):
    module.load_routed_weights(other.experts.w_gate_up, other.experts.w_down)


@NEEDS_ONEDNN
@pytest.mark.parametrize(
    "change", [_change_by_copy, _change_by_load_state_dict, _change_by_assigning_data, _change_by_load_routed_weights]
)
def test_weight_changes_torch_sees_after_packing_ask_for_a_repack(change):
    """Explicit packing: a change torch can see raises at the next CPU forward (it used to
    be served stale or silently repacked); re-packing serves the new weights."""
    module, _ = make_moe(seed=4, gemm="loop")
    other, _ = make_moe(seed=9, gemm="loop")
    with torch.no_grad():
        other.router_weight.copy_(module.router_weight)
    x = torch.randn(50, H, generator=_generator(5))
    module.pack_cpu_weights()
    change(module, other)
    with (
        torch.inference_mode(),
        pytest.raises(
            RuntimeError,
            match=r"after pack_cpu_weights\(\).*"
            r"call pack_cpu_weights\(\) again",
        ),
    ):
        module(x)
    module.pack_cpu_weights()
    with torch.inference_mode():
        assert torch.equal(module(x), other(x))


@NEEDS_ONEDNN
def test_writes_through_data_need_an_explicit_repack():
    """``.data`` writes bypass torch's version counter: as documented, the packed snapshot
    keeps serving the weights of the last pack_cpu_weights() until the caller re-packs."""
    module, _ = make_moe(seed=4, gemm="loop")
    other, _ = make_moe(seed=9, gemm="loop")
    with torch.no_grad():
        other.router_weight.copy_(module.router_weight)
    x = torch.randn(50, H, generator=_generator(5))
    with torch.inference_mode():
        before = module(x)
    module.pack_cpu_weights()
    module.experts.w_gate_up.data.copy_(other.experts.w_gate_up)
    module.experts.w_down.data.copy_(other.experts.w_down)
    with torch.inference_mode():
        assert torch.equal(module(x), before)  # the snapshot, as documented
        module.pack_cpu_weights()
        assert torch.equal(module(x), other(x))
        module.pack_cpu_weights(False)
        assert torch.equal(module(x), other(x))


@NEEDS_ONEDNN
def test_to_after_packing():
    """.to() to the same dtype keeps the copies; a conversion drops them at once and the
    next CPU forward asks for a re-pack (or pack_cpu_weights(False))."""
    module, _ = make_moe(seed=4, gemm="loop")
    x = torch.randn(50, H, generator=_generator(5))
    with torch.inference_mode():
        plain = module(x)
    module.pack_cpu_weights()
    module.to(torch.float32)
    assert module.experts._packed is not None
    with torch.inference_mode():
        assert torch.equal(module(x), plain)
    module.to(torch.bfloat16)
    assert module.experts._packed is None  # the old copies' memory is freed now
    with torch.inference_mode(), pytest.raises(RuntimeError, match="call pack_cpu_weights"):
        module(x.bfloat16())
    module.pack_cpu_weights(False)
    reference_module, _ = make_moe(seed=4, gemm="loop")
    reference_module.to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(module(x.bfloat16()), reference_module(x.bfloat16()))
        unpacked = module.to(torch.float32)(x)
        module.pack_cpu_weights()
        assert torch.equal(module(x), unpacked)


def test_pack_cpu_weights_refuses_what_onednn_cannot_serve(monkeypatch):
    module, _ = make_moe(seed=1)
    monkeypatch.setattr(experts_modules, "onednn_linear_serves", lambda dtype: False)
    with pytest.raises(ValueError, match="oneDNN cannot serve torch.float32"):
        module.pack_cpu_weights()


def test_linear_backend_argument():
    x = torch.randn(2, H)
    with pytest.raises(ValueError, match="linear='mkl'"):
        expert_mlp(x, [0, 2], torch.zeros(1, 2 * I, H), torch.zeros(1, H, I), linear="mkl")
    if not onednn_linear_serves(torch.float16):
        with pytest.raises(ValueError, match="cannot serve torch.float16"):
            expert_mlp(x.half(), [0, 2], torch.zeros(1, 2 * I, H).half(), torch.zeros(1, H, I).half(), linear="onednn")


def test_choose_float_on_the_cpu():
    many = ROWS_MAX_MEAN_ROWS + 1
    # Row kernels: bfloat16/float32 experts serving few rows each (mean over hit experts).
    for dtype in (torch.float32, torch.bfloat16):
        assert choose("float", "cpu", [3, 0, 5, 1], dtype=dtype) == "rows"
        assert choose("float", "cpu", [1, 0, 0, 0], dtype=dtype) == "rows"  # decode: most experts idle
        assert choose("float", "cpu", [3, 0, 5, 1], onednn=True, dtype=dtype) == "rows"
    assert choose("float", "cpu", [ROWS_MAX_MEAN_ROWS] * 4, dtype=torch.float32) == "rows"
    assert choose("float", "cpu", [many, many, 0, many], onednn=True, dtype=torch.float32) == "loop"
    # bfloat16: the row kernels at every count, but bounded where the CPU multiplies bfloat16
    # natively (oneDNN's GEMMs then take prefill).
    native = bool({"avx512bf16", "amx-bf16"} & cpu_features.FEATURES)
    assert rows_bound(torch.bfloat16) == (BF16_ROWS_MAX_MEAN_ROWS if native else float("inf"))
    assert rows_bound(torch.float32) == ROWS_MAX_MEAN_ROWS
    assert choose("float", "cpu", [BF16_ROWS_MAX_MEAN_ROWS] * 4, dtype=torch.bfloat16) == "rows"
    assert choose("float", "cpu", [many, 0, many, many], dtype=torch.bfloat16) == ("loop" if native else "rows")
    assert choose("float", "cpu", [4096, 1], onednn=True, dtype=torch.bfloat16) == ("loop" if native else "rows")
    # float16 has no row kernel: the padded batch or the loop, as before.
    assert choose("float", "cpu", [3, 0, 5, 1], dtype=torch.float16) == "loop"  # half-precision CPU bmm is slow
    assert choose("float", "cpu", []) == "loop"
    assert choose("float", "cpu", [0, 0]) == "loop"
    assert choose("float", "cpu", [many, many, many, 2 * PADDED_MAX_ROWS], dtype=torch.float32) == "loop"
    assert choose("float", "cpu", [PADDED_MAX_ROWS] * 3 + [many], dtype=torch.float32) == "padded"
    assert choose("float", "cpu", [PADDED_MAX_ROWS] * 3 + [many], onednn=True, dtype=torch.float32) == "loop"


def test_local_experts_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_local_experts=0"):
        LocalExperts(0, H, I)
    with pytest.raises(ValueError, match="dtype=torch.int32"):
        LocalExperts(2, H, I, dtype=torch.int32)
    with pytest.raises(ValueError, match="gemm='blas'"):
        LocalExperts(2, H, I, gemm="blas")


# ------------------------------------------------------------------ LocalDispatcher


def test_local_dispatcher_maps_ids_and_passes_rows_through():
    layout = ExpertLayout(8, 1, num_redundant_experts=2)  # physical 0..9 routed, 10 shared
    dispatcher = LocalDispatcher(layout)
    x = torch.randn(3, 4)
    ids = torch.tensor([[0, 10], [9, 11], [-1, 5]], dtype=torch.int32)
    weights = torch.rand(3, 2)
    handle = dispatcher.dispatch(x, weights, ids, async_op=True)
    recv_hidden, recv_weights, local_ids = handle.wait()
    assert recv_hidden is x and recv_weights is weights  # nothing travels, nothing is copied
    assert np.array_equal(local_ids.numpy(), reference.remap_to_local(ids.numpy(), layout.expert_map(0)))
    assert local_ids.tolist() == [[0, 10], [9, -1], [-1, 5]]
    partial = torch.randn(3, 4)
    assert dispatcher.combine(partial, handle) is partial
    with pytest.raises(ValueError, match="partial_out has 2 rows"):
        dispatcher.combine(partial[:2], handle)


def test_local_dispatcher_rejects_bad_arguments():
    with pytest.raises(ValueError, match="ep_size=1"):
        LocalDispatcher(ExpertLayout(8, 0, ep_size=2, dispatch="all2all"))
    with pytest.raises(TypeError, match="ExpertLayout"):
        LocalDispatcher("layout")
    dispatcher = LocalDispatcher(ExpertLayout(8))
    with pytest.raises(ValueError, match="int32"):
        dispatcher.dispatch(torch.zeros(2, 4), torch.zeros(2, 1), torch.zeros(2, 1, dtype=torch.int64))
    with pytest.raises(TypeError, match="DispatchHandle"):
        dispatcher.combine(torch.zeros(2, 4), "handle")


@pytest.mark.parametrize(
    "args,match",
    [
        ((torch.zeros(4), torch.zeros(4, 1), torch.zeros(4, 1, dtype=torch.int32)), "2-D"),
        ((torch.zeros(4, 2), torch.zeros(3, 1), torch.zeros(3, 1, dtype=torch.int32)), "T=4"),
        ((torch.zeros(4, 2), torch.zeros(4, 2), torch.zeros(4, 1, dtype=torch.int32)), "must equal"),
        ((torch.zeros(4, 2), torch.zeros(4, 1, dtype=torch.float64), torch.zeros(4, 1, dtype=torch.int32)), "float32"),
    ],
)
def test_check_dispatch_inputs(args, match):
    with pytest.raises(ValueError, match=match):
        check_dispatch_inputs(*args)


def test_dispatch_takes_weights_then_ids_and_refuses_the_old_order():
    # ids first (the order before 0.2) is refused by dtype, naming the argument, before any
    # id is read as a weight: by the check every dispatcher runs first and by LocalDispatcher.
    x, ids, weights = torch.zeros(2, 4), torch.zeros(2, 1, dtype=torch.int32), torch.zeros(2, 1)
    message = r"topk_weights must be a floating array, got dtype int32 \(weights come before ids since 0\.2"
    with pytest.raises(TypeError, match=message):
        check_dispatch_inputs(x, ids, weights)
    with pytest.raises(TypeError, match=message):
        LocalDispatcher(ExpertLayout(8)).dispatch(x, ids, weights)
    # float ids in the second place (weights passed twice): named as topk_ids
    with pytest.raises(TypeError, match=r"topk_ids must be an integer array, got dtype float32"):
        check_dispatch_inputs(x, weights, weights)
    check_dispatch_inputs(x, weights, ids)


def test_dispatch_handle_refuses_received_in_the_old_order():
    # A dispatcher handing out (hidden, local_ids, weights) would have its consumers read
    # ids as weights: the handle refuses it when the entries are set, synchronous or not.
    hidden, weights, local_ids = torch.zeros(2, 4), torch.zeros(2, 1), torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(TypeError, match="recv_weights must be a floating array, got dtype int32"):
        DispatchHandle((hidden, local_ids, weights))
    handle = DispatchHandle(wait_fn=lambda: (hidden, local_ids, weights))
    with pytest.raises(TypeError, match="recv_weights must be a floating array"):
        handle.wait()
    with pytest.raises(ValueError, match="recv_hidden, recv_weights, recv_local_ids"):
        DispatchHandle((hidden, weights))
    received = (hidden, weights, local_ids)
    assert DispatchHandle(received).wait() is received


def test_dispatch_handle_waits_once():
    calls = []
    received = (torch.zeros(1), torch.zeros(1), torch.zeros(1, dtype=torch.int32))
    handle = DispatchHandle(wait_fn=lambda: calls.append(1) or received)
    assert not handle.is_completed()
    assert handle.wait() is received and handle.wait() is received
    assert calls == [1] and handle.is_completed()
    with pytest.raises(ValueError, match="exactly one"):
        DispatchHandle()


# ------------------------------------------------------------------ GPU path


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_cpu(dtype):
    module, _ = make_moe(seed=11, dtype=dtype)
    x = torch.randn(33, H, generator=_generator(12)).to(dtype)
    expected = module(x)
    module_cuda = module.to("cuda")
    out = module_cuda(x.cuda())
    tolerance = FP32_RTOL if dtype == torch.float32 else HALF_RTOL[dtype]
    assert out.device.type == "cuda" and out.dtype == dtype
    assert rel_error(out.cpu(), expected.double()) < tolerance


# ------------------------------------------------------------------ biases, swigluoai, weight on input


def biased_reference(
    router, router_weight, x, w_gate_up, w_down, b_gate_up, b_down, activation, router_bias=None, weight_on_input=False
):
    """sum_k w_k * (down(act(gate x + bg) * (up x + bu)) + bd) in float64."""
    logits = F.linear(x, router_weight, router_bias).float()
    topk_weights, topk_ids = reference.select_experts(logits.numpy(), router)
    return dense_experts(
        x, topk_weights, topk_ids, w_gate_up, w_down, activation, b_gate_up, b_down, weight_on_input=weight_on_input
    )


def make_biased_moe(seed, activation, **kwargs):
    module = MoE(
        ROUTER if "router" not in kwargs else kwargs.pop("router"),
        H,
        I,
        activation=activation,
        expert_bias=True,
        router_bias=True,
        **kwargs,
    )
    g = _generator(seed)
    n = module.router.num_experts
    # Large enough that the swigluoai clamps at +-7 are reached.
    tensors = (
        torch.randn(n, 2 * I, H, generator=g) * 1.5,
        torch.randn(n, H, I, generator=g) * 0.3,
        torch.randn(n, 2 * I, generator=g) * 2.0,
        torch.randn(n, H, generator=g),
    )
    with torch.no_grad():
        module.router_weight.copy_(torch.randn(n, H, generator=g))
        module.router_bias.copy_(torch.randn(n, generator=g))
        module.load_routed_weights(*tensors)
    return module, tensors


@pytest.mark.parametrize("gemm", ["loop", "padded"])
@pytest.mark.parametrize("activation", ["swigluoai", "silu"])
def test_expert_bias_and_activation_match_reference(gemm, activation):
    module, tensors = make_biased_moe(31, activation, gemm=gemm)
    x = torch.randn(37, H, generator=_generator(32))
    pre = torch.einsum("eih,th->tei", tensors[0], x) + tensors[2]
    if activation == "swigluoai":
        assert (pre[..., :I] > 7).any() and (pre[..., I:].abs() > 7).any()
    with torch.no_grad():
        out = module(x)
    expected = biased_reference(
        module.router, module.router_weight, x, *tensors, activation, router_bias=module.router_bias
    )
    assert (out.double() - expected).abs().max() / expected.abs().max() < FP32_RTOL


@pytest.mark.parametrize("linear", ["mm", "onednn"])
def test_expert_mlp_bias_backends_agree(linear):
    if linear == "onednn" and not onednn_linear_serves(torch.float32):
        pytest.skip("this torch build's oneDNN cannot serve float32 linears")
    g = _generator(33)
    x = torch.randn(10, H, generator=g)
    w_gate_up, w_down = torch.randn(2, 2 * I, H, generator=g), torch.randn(2, H, I, generator=g)
    b_gate_up, b_down = torch.randn(2, 2 * I, generator=g), torch.randn(2, H, generator=g)
    offsets = [0, 4, 10]
    out = expert_mlp(x, offsets, w_gate_up, w_down, "swigluoai", linear=linear, b_gate_up=b_gate_up, b_down=b_down)
    padded = padded_expert_mlp(x, offsets, w_gate_up, w_down, "swigluoai", b_gate_up, b_down)
    for e in range(2):
        rows = slice(offsets[e], offsets[e + 1])
        h = x[rows].double() @ w_gate_up[e].double().T + b_gate_up[e].double()
        y = swigluoai_reference(h[:, :I], h[:, I:]) @ w_down[e].double().T + b_down[e].double()
        torch.testing.assert_close(out[rows].double(), y, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(padded[rows].double(), y, rtol=1e-4, atol=1e-4)


def test_expert_bias_with_round_robin_replicas_loads_each_logical_expert():
    module, tensors = make_biased_moe(34, "swigluoai", num_redundant_experts=3, placement="round_robin")
    logical = module.routed_expert_ids()
    for local, e in enumerate(logical):
        torch.testing.assert_close(module.experts.b_gate_up[local], tensors[2][e], rtol=0, atol=0)
        torch.testing.assert_close(module.experts.b_down[local], tensors[3][e], rtol=0, atol=0)
    x = torch.randn(11, H, generator=_generator(35))
    with torch.no_grad():
        out = module(x)
    expected = biased_reference(
        module.router, module.router_weight, x, *tensors, "swigluoai", router_bias=module.router_bias
    )
    assert (out.double() - expected).abs().max() / expected.abs().max() < FP32_RTOL


def test_apply_router_weight_on_input_matches_reference():
    router = RouterConfig(N, 1, "sigmoid", renormalize=False)
    module, tensors = make_biased_moe(36, "silu", router=router, apply_router_weight_on_input=True)
    x = torch.randn(21, H, generator=_generator(37))
    with torch.no_grad():
        out = module(x)
    expected = biased_reference(
        router, module.router_weight, x, *tensors, "silu", router_bias=module.router_bias, weight_on_input=True
    )
    assert (out.double() - expected).abs().max() / expected.abs().max() < FP32_RTOL
    # Not the same as weighting the output: the experts are not linear.
    weighted_output = biased_reference(
        router, module.router_weight, x, *tensors, "silu", router_bias=module.router_bias
    )
    assert (weighted_output - expected).abs().max() > 1e-2 * expected.abs().max()


def test_apply_router_weight_on_input_keeps_the_shared_expert_unscaled():
    from moeroute.bindings.torch import GatedMLP

    router = RouterConfig(N, 1, "softmax", renormalize=False)
    shared = GatedMLP(H, I)
    module = MoE(router, H, I, shared_experts=shared, apply_router_weight_on_input=True)
    assert module.layout.shared == "runner"
    assert "apply_router_weight_on_input" in module.layout.shared_reason
    with torch.no_grad():
        module.load_routed_weights(torch.zeros(N, 2 * I, H), torch.zeros(N, H, I))
        x = torch.randn(5, H, generator=_generator(38))
        torch.testing.assert_close(module(x), shared(x))


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        (
            dict(apply_router_weight_on_input=True),
            ValueError,
            "apply_router_weight_on_input=True needs top_k=1.*got top_k=3",
        ),
        (dict(expert_bias=1), ValueError, "expert_bias=1 must be a bool"),
        (dict(router_bias="yes"), ValueError, "router_bias='yes' must be a bool"),
        (dict(activation="swiglu"), ValueError, "activation='swiglu' is not supported"),
    ],
)
def test_bias_and_weight_on_input_errors(kwargs, error, words):
    with pytest.raises(error, match=words):
        MoE(ROUTER, H, I, **kwargs)


def test_load_routed_weights_bias_errors():
    plain = MoE(ROUTER, H, I)
    weights = (torch.zeros(N, 2 * I, H), torch.zeros(N, H, I))
    with pytest.raises(ValueError, match="gate_up_bias was given but the module has no expert biases"):
        plain.load_routed_weights(*weights, gate_up_bias=torch.zeros(N, 2 * I))
    biased = MoE(ROUTER, H, I, expert_bias=True)
    with pytest.raises(ValueError, match=r"down_bias has shape \(8, 5\), expected \[8, 24\]"):
        biased.load_routed_weights(*weights, down_bias=torch.zeros(N, 5))
