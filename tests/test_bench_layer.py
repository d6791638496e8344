"""bench/layer.py's torch._grouped_mm comparison point against the per-row float64 definition
(it lives in the benchmark: moeroute's "auto" never takes it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.reference import dense_experts, generator, rel_error

H, I = 24, 16
FP32_RTOL = 1e-5


@pytest.fixture(scope="module")
def bench_layer():
    path = Path(__file__).resolve().parents[1] / "bench" / "layer.py"
    spec = importlib.util.spec_from_file_location("bench_layer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch build has no torch._grouped_mm")
@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 0, 2], [40, 1, 0, 7], [0, 0, 0, 0]])
def test_grouped_expert_mlp_matches_per_row_reference(bench_layer, counts):
    g = generator(sum(counts))
    offsets = np.concatenate([[0], np.cumsum(counts)]).tolist()
    rows = offsets[-1]
    x = torch.randn(rows, H, generator=g)
    w_gate_up = torch.randn(4, 2 * I, H, generator=g) * 0.3
    w_down = torch.randn(4, H, I, generator=g) * 0.3
    # Row r belongs to expert e for offsets[e] <= r < offsets[e + 1], with weight 1.
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))[:, None]
    expected = dense_experts(x, torch.ones(rows, 1), ids, w_gate_up, w_down)
    out = bench_layer.grouped_expert_mlp(x, torch.tensor(offsets, dtype=torch.int32), w_gate_up, w_down)
    assert out.shape == (rows, H)
    if rows:
        assert rel_error(out, expected) < FP32_RTOL
