"""INT4 (w4a16) experts under expert parallelism (2 gloo ranks): groups of 32, 64 and 128,
symmetric and asymmetric, all2all and allgather, linear, round-robin and a placement table,
runner/overlap/fused shared expert, float32 and bfloat16 activations.

Each rank holds only its experts' packed bytes, scales and zero points and must reproduce,
on its own tokens, the single-process float64 reference written here: the weights decoded
from the definition ``(q - z) * s`` (nibbles low first, z = 8 when symmetric), routed by
moeroute.routing.reference, the dense experts of helpers.reference, plus the gated shared
MLP once (in a fused slot: quantized as the experts are, as the layer does). Tolerances
(max abs diff / max abs reference): 1e-5 with float32 activations (float32 sums in another
order), 2e-2 with bfloat16 ones (the layer's and the shared MLP's bfloat16 roundings).

The shared expert's plan does not depend on the format: each rank also runs the same layer
with float experts (the INT4 weights dequantized), and its shared MLP must be called as
often, on as many rows, as the INT4 layer's.
"""

from __future__ import annotations

import functools

import pytest
import torch

import _int4_ep_workers as workers
from helpers.gloo import spawn_group
from helpers.reference import dense_experts, rel_error
from moeroute.quant import quantize_int4
from moeroute.routing import reference

RTOL = {"torch.float32": 1e-5, "torch.bfloat16": 2e-2}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_group(workers.worker, 2, tmp_path_factory.mktemp("int4_ep"), join_timeout_s=workers.JOIN_TIMEOUT_S)


def plain_dequantize(packed, scales, zeros=None, *, group):
    """float64 [..., N, K]: ``(q - z) * s`` per group of ``group`` input columns; byte j holds
    column 2j in its low nibble and 2j+1 in its high one; z = 8 without zero points."""
    q = torch.stack([packed % 16, packed // 16], dim=-1).flatten(-2).double()
    z = torch.full_like(scales, 8, dtype=torch.float64) if zeros is None else zeros.double()
    return (q - z.repeat_interleave(group, dim=-1)) * scales.double().repeat_interleave(group, dim=-1)


@functools.cache
def _weights(group, symmetric, inter):
    w = workers.weights(group, symmetric, inter)
    return w, plain_dequantize(*w["gate_up"], group=group), plain_dequantize(*w["down"], group=group)


def _reference(case, x):
    group, symmetric, inter, _, shared, _, _, dtype = case
    w, w_gate_up, w_down = _weights(group, symmetric, inter)
    x64 = x.double()
    logits = (x64 @ w["router_weight"].double().T).float()
    topk_weights, topk_ids = reference.select_experts(logits.numpy(), workers.ROUTER, None)
    out = dense_experts(x64, topk_weights, topk_ids, w_gate_up, w_down)
    # The shared MLP and its gate as the layer holds them (cast to the activations' dtype).
    float_dtype = getattr(torch, dtype.split(".")[1])
    gate_w, up_w, down_w = (t.to(float_dtype).double() for t in w["shared"])
    g = torch.sigmoid(x64 @ w["shared_gate"].to(float_dtype).double().T)
    if shared == "fused":
        kwargs = {"group_size": group, "symmetric": symmetric}
        slot_gu = plain_dequantize(*quantize_int4(torch.cat([gate_w, up_w]).float(), **kwargs), group=group)
        slot_d = plain_dequantize(*quantize_int4(down_w.float(), **kwargs), group=group)
        ids = torch.zeros(x.shape[0], 1, dtype=torch.long)
        return out + dense_experts(x64, g, ids, slot_gu[None], slot_d[None])
    act = torch.nn.functional.silu(x64 @ gate_w.T) * (x64 @ up_w.T)
    return out + g * (act @ down_w.T)


def _cases(results):
    cases = [case for rank_cases in results for case in rank_cases]
    assert len(cases) == 2 * len(workers.CASES)
    return cases


def test_every_case_matches_the_float64_reference(results):
    for record in _cases(results):
        assert record["out"].dtype == record["x"].dtype and record["out"].shape == record["x"].shape
        error = rel_error(record["out"], _reference(record["case"], record["x"]))
        assert error < RTOL[record["case"][-1]], (record["case"], record["rank"], error)


def test_shared_expert_plan_and_calls_are_the_float_layers(results):
    for record in _cases(results):
        shared = record["case"][4]
        assert record["shared_plan"] == record["float_shared_plan"] == shared, record["case"]
        assert record["shared_calls"] == record["float_shared_calls"] == (0 if shared == "fused" else 1), record
        assert record["shared_rows"] == record["float_shared_rows"] == (0 if shared == "fused" else workers.T)


def test_each_rank_holds_only_its_experts(results):
    for record in _cases(results):
        rank, (placement, table) = record["rank"], record["case"][5:7]
        assert record["holds_only_local"], record["case"]
        if table is not None:
            assert record["local_experts"] == table[3 * rank : 3 * rank + 3]
        elif placement == "linear":
            assert record["local_experts"] == [3 * rank, 3 * rank + 1, 3 * rank + 2]
        else:
            assert record["local_experts"] == [rank, rank + 2, rank + 4]
