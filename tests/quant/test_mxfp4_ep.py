"""MXFP4 gpt-oss experts under expert parallelism (2 gloo ranks): all2all and allgather,
linear, round-robin and a placement table; float32 and bfloat16 activations.

Each rank holds only its experts' packed bytes and must reproduce the single-process
float32 reference (the same bytes dequantized, the gpt-oss MLP) on its own tokens.
"""

from __future__ import annotations

import functools

import pytest
import torch

import _mxfp4_ep_workers as workers
from helpers.gloo import spawn_group
from helpers.reference import dense_experts, rel_error
from test_mxfp4_moe import RTOL, plain_dequantize
from moeroute.routing import reference


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_group(workers.worker, 2, tmp_path_factory.mktemp("mxfp4_ep"), join_timeout_s=workers.JOIN_TIMEOUT_S)


@functools.cache
def _float_weights():
    w = workers.weights()
    return w, plain_dequantize(*w["gate_up"]), plain_dequantize(*w["down"])


def _reference(x):
    w, w_gate_up, w_down = _float_weights()
    x = x.double()
    logits = (x @ w["router_weight"].double().T + w["router_bias"].double()).float()
    topk_weights, topk_ids = reference.select_experts(logits.numpy(), workers.ROUTER, None)
    return dense_experts(x, topk_weights, topk_ids, w_gate_up, w_down, "swigluoai", w["gate_up_bias"], w["down_bias"])


def test_every_case_matches_the_reference(results):
    cases = [case for rank_cases in results for case in rank_cases]
    assert len(cases) == 2 * len(workers.CASES) * 2
    for case in cases:
        expected = _reference(case["x"])
        error = rel_error(case["out"], expected)
        dtype = torch.float32 if case["dtype"] == "torch.float32" else torch.bfloat16
        assert error < RTOL[dtype], (case["dispatch"], case["placement"], case["dtype"], case["rank"], error)


def test_each_rank_holds_only_its_experts(results):
    for rank, rank_cases in enumerate(results):
        for case in rank_cases:
            assert case["holds_only_local"]
            if case["placement"] == "linear" and case["table"] is None:
                assert case["local_experts"] == [3 * rank, 3 * rank + 1, 3 * rank + 2]
            elif case["table"] is not None:
                assert case["local_experts"] == case["table"][3 * rank : 3 * rank + 3]
            else:  # round robin
                assert case["local_experts"] == [rank, rank + 2, rank + 4]
