"""FP8's one-call "rows" forward (the tiled loop of `moeroute.experts.cpu.tiles` with FP8's
dots: widened e4m3 rows on any CPU, the bfloat16-dot tiles where they serve) against the plain
reference `moe_experts_reference`: decode and prefill row counts, with and without shared
slots (every token routed to the last experts too, so those experts hold T rows), and an EP
slice (ids outside [0, L) are held elsewhere and skipped)."""

from __future__ import annotations

import pytest
import torch

from helpers.reference import randn as _randn
from moeroute.experts.formats.fp8 import fp8_experts_forward
from moeroute.quant import QuantConfig, quantize_experts
from moeroute.quant.reference import moe_experts_reference

H, L, K, SHARED = 256, 8, 3, 2


def _routing(tokens: int, shared: bool):
    """Routed ids from -2 to L + 1 (some outside this slice; the first token's first id 0),
    then the shared slots."""
    generator = torch.Generator().manual_seed(tokens)
    routed = L - SHARED if shared else L
    ids = torch.randint(-2, routed + 2, (tokens, K), generator=generator)
    ids = torch.where(ids >= routed, ids + SHARED, ids)  # never a shared slot by routing
    ids[0, 0] = 0  # the first token reaches this slice at least once (a nonzero output row)
    weights = torch.rand(tokens, K, generator=generator)
    if shared:
        ids = torch.cat([ids, torch.arange(routed, L).repeat(tokens, 1)], 1)
        weights = torch.cat([weights, torch.full((tokens, SHARED), 0.5)], 1)
    return weights, ids.int()


@pytest.mark.parametrize("inter", [200, 192])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("mode", ["w8a8", "w8a16"])
def test_one_call_rows_forward_against_reference(inter, shared, threads, mode):
    # I = 200: partial weight blocks and blocks of weight rows that end inside a tile of the
    # loop (the widened kernels); I = 192 runs the bfloat16-dot kernels where the CPU has them.
    activation = "dynamic" if mode == "w8a8" else "none"
    quant = QuantConfig("fp8_block", block_size=(64, 128), activation=activation)
    q = quantize_experts(
        _randn(L, 2 * inter, H, seed=1, scale=0.1),
        _randn(L, H, inter, seed=2, scale=0.1),
        QuantConfig("fp8_block", block_size=(64, 128)),
    )
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for tokens in (1, 8, 64):
            weights, ids = _routing(tokens, shared)
            x = _randn(tokens, H, seed=3 + tokens)
            out = fp8_experts_forward(x, weights, ids, *q, quant, strategy="rows")
            expected = moe_experts_reference(x, weights, ids, *q, quant.block_size, quantize_activations=mode == "w8a8")
            assert out.dtype == torch.float32 and out.shape == x.shape
            assert bool((ids < 0).any() or (ids >= L).any()) or tokens == 1
            row_error = (out - expected).abs().amax(1) / expected.abs().max()
            if mode == "w8a16":  # float32 sums of the same products
                assert row_error.max() < 1e-5, (tokens, row_error.max())
            else:
                # A flipped e4m3 rounding tie of the re-quantized intermediate moves one
                # token's row by up to about 5e-4 of the largest output (docs/quant.md).
                assert row_error.max() < 1e-3, (tokens, row_error.max())
                assert int((row_error > 1e-5).sum()) <= max(1, tokens // 50)
    finally:
        torch.set_num_threads(before)
