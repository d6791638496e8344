"""The FP8 w8a16 kernels of moe_gemm_fp8.cu (SIMT and sm_80+ mma) (``QuantConfig("fp8_block", activation="none")``) without
a GPU: compiled for the host (tests/gpu/host_emulation.h) and run against a float64 reference on the
dequantized weights (each e4m3 value times its (bn, bk) block's scale, written here from the format)
with the activations as they are; NVRTC compiles the w8a16 kernels for sm_80 (the sm_89 / sm_90
NVRTC and the hipcc compiles of every shipped FP8 instantiation, w8a16 included, are
test_gpu_fp8_host.py's).

Problems are ragged (experts with 0, 1, B-1 and B+1 rows, slots of other ranks), H and I are not
multiples of the weight blocks (partial last blocks both ways), and one block shape has a bk that
is no multiple of the kernels' k slices.
"""

import numpy as np
import pytest
import torch

from gpu_host_emulator import (
    GuardedArrays,
    HostBackend,
    assert_no_spills,
    format_emulator,
    nvrtc_available,
    run_fp8_on_host,
)
from gpu_reference import from_storage, ragged_routing
from helpers.reference import dense_experts
from moeroute.gpu import gemm_fp8 as G
from moeroute.gpu import launch as L
from moeroute.gpu.loader import nvrtc_compile
from moeroute.quant import QuantConfig
from moeroute.quant.fp8 import quantize_experts

TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# max |kernel - reference| / max |reference|. float32: each weight is one float32 rounding of
# e4m3 * s, sums float32 against float64. bfloat16: the activations are exact in the reference,
# but the kernels round the intermediate and the output to bfloat16.
TOLERANCE = {"float32": 1e-5, "float16": 4e-3, "bfloat16": 2e-2}
COUNTS = [0, 1, 15, 17]
BLOCKS = [(128, 128), (64, 128), (32, 48)]
# The mma path: H, I and bk multiples of 32 (H = 288: nine 32-column blocks, the 4-stage ring wraps
# and its last 64-wide stage is half full); (32, 64) puts two scale rows in one 64-column tile.
MMA_CASES = [
    pytest.param("bfloat16", (128, 128), 16, id="bf16-block128x128"),
    pytest.param("float16", (32, 64), 16, id="f16-block32x64"),
    pytest.param("bfloat16", (64, 128), 64, id="bf16-block64x128-tile64"),
]


def _host_names():
    names = [L.sum_name(dtype) for dtype in TORCH]
    names += [G.w8a16_simt_name(dtype, 16, gated) for dtype in ("float32", "bfloat16") for gated in (True, False)]
    for dtype, _, align_block in (case.values for case in MMA_CASES):
        tile_m = next(h for h in G.MMA_TILE_HEIGHTS if align_block % h == 0)
        names += [G.w8a16_mma_name(dtype, G.NARROW_MMA_TILES[(tile_m, gated)], gated) for gated in (True, False)]
    return sorted(set(names))


@pytest.fixture(scope="module")
def w8a16_emulator(tmp_path_factory):
    return format_emulator(G.KERNEL_FILE, _host_names(), tmp_path_factory)


def dequantize_blocks(q, scale, block, halves):
    """float64 [E, rows, cols] of e4m3 ``q`` and block scales (``halves`` 2: gate_up, whose scale
    rows are the gate's blocks then the up's; 1: down)."""
    bn, bk = block
    values = q.to(torch.float64)
    rows, cols = values.shape[1] // halves, values.shape[2]
    parts = []
    for half, s in enumerate(scale.double().chunk(halves, dim=1)):
        full = s.repeat_interleave(bn, dim=1)[:, :rows].repeat_interleave(bk, dim=2)[:, :, :cols]
        parts.append(values[:, half * rows : (half + 1) * rows] * full)
    return torch.cat(parts, dim=1)


def _problem(block, dtype, seed, H=144, I=100, top_k=2):
    rng = np.random.default_rng(seed)
    topk_ids, topk_weights = ragged_routing(COUNTS, top_k, len(COUNTS), rng)
    E, T = len(COUNTS), topk_ids.shape[0]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(TORCH[dtype])
    w_gate_up = torch.randn(E, 2 * I, H, generator=gen) / H**0.5
    w_down = torch.randn(E, H, I, generator=gen) / I**0.5
    config = QuantConfig("fp8_block", block_size=block, activation="none")
    return x, topk_ids, topk_weights, quantize_experts(w_gate_up, w_down, config)


def _check(emulator, dtype, block, path, align_block=16, H=144, I=100):
    x, topk_ids, topk_weights, (q_gu, s_gu, q_d, s_d) = _problem(block, dtype, seed=3, H=H, I=I)
    out, backend = run_fp8_on_host(
        emulator,
        dtype,
        x,
        topk_ids,
        topk_weights,
        (q_gu, s_gu, q_d, s_d),
        format="fp8_block",
        block_size=block,
        align_block=align_block,
        w8a16=True,
        path=path,
    )
    assert backend.launched[0].startswith(f"moe_gemm_fp8w16_{path or 'mma'}"), backend.launched
    assert not any(name.startswith("fp8_quantize") for name in backend.launched), "w8a16 quantizes no activations"
    expected = dense_experts(
        x.double(),
        torch.from_numpy(topk_weights),
        torch.from_numpy(topk_ids),
        dequantize_blocks(q_gu, s_gu, block, 2),
        dequantize_blocks(q_d, s_d, block, 1),
    ).numpy()
    actual = from_storage(out, dtype)
    assert np.isfinite(actual).all()
    error = np.abs(actual - expected).max() / np.abs(expected).max()
    assert error <= TOLERANCE[dtype], f"{block} {dtype} {path}: relative error {error:.3g}"
    on_device = ((topk_ids >= 0) & (topk_ids < len(COUNTS))).any(axis=1)
    assert (actual[~on_device] == 0).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"block{b[0]}x{b[1]}")
def test_w8a16_simt_matches_the_dequantized_reference(w8a16_emulator, dtype, block):
    _check(w8a16_emulator, dtype, block, "simt")


@pytest.mark.parametrize("dtype, block, align_block", MMA_CASES)
def test_w8a16_mma_matches_the_dequantized_reference(w8a16_emulator, dtype, block, align_block):
    _check(w8a16_emulator, dtype, block, "mma", align_block, H=288, I=96)


def test_w8a16_launcher_picks_mma_where_it_applies(w8a16_emulator):
    # path=None on the emulated sm_90: 16-bit activations and whole 32-column blocks take mma.
    _check(w8a16_emulator, "bfloat16", (128, 128), None, 16, H=288, I=96)


@pytest.mark.parametrize(
    "dtype, block, match",
    [("float32", (128, 128), "float16 or bfloat16"), ("bfloat16", (32, 48), "multiples of 32")],
)
def test_w8a16_mma_refuses_what_it_cannot_run(dtype, block, match):
    x, topk_ids, topk_weights, (q_gu, s_gu, q_d, s_d) = _problem(block, dtype, seed=1, H=288, I=96)
    arrays = GuardedArrays()
    args = (x.float().numpy(), q_gu.view(torch.uint8).numpy(), s_gu.numpy(), q_d.view(torch.uint8).numpy(), s_d.numpy())
    with pytest.raises(ValueError, match=match):
        G.run_fp8_experts(
            HostBackend(None, arrays),
            dtype,
            *args,
            topk_weights,
            topk_ids,
            None,
            format="fp8_block",
            block_size=block,
            w8a16=True,
            path="mma",
        )


def test_fused_experts_takes_w8a16_to_the_kernels():
    # CPU tensors: the argument checks pass (w8a16 is no longer refused by name) and the
    # device check is what stops the call.
    from moeroute.gpu import fused_experts

    x, topk_ids, topk_weights, (q_gu, s_gu, q_d, s_d) = _problem((128, 128), "bfloat16", seed=2)
    quant = QuantConfig("fp8_block", activation="none")
    with pytest.raises(TypeError, match="CUDA"):
        fused_experts(
            x,
            q_gu,
            q_d,
            torch.from_numpy(topk_weights),
            torch.from_numpy(topk_ids),
            quant=quant,
            gate_up_scale=s_gu,
            down_scale=s_d,
        )


@pytest.mark.slow
@pytest.mark.skipif(not nvrtc_available(), reason="CuPy's NVRTC binding is not available")
@pytest.mark.parametrize("arch", ["sm_80"])
def test_nvrtc_compiles_the_w8a16_kernels_without_spills(arch):
    # w8a16 needs no FP8 instruction, so it runs below sm_89 too, where the shipped FP8 list is
    # the SIMT kernels alone. (sm_89 / sm_90 compile it with every FP8 kernel: test_gpu_fp8_host.)
    names = [name for name in G.shipped_name_expressions("cuda", 80) if name.startswith("moe_gemm_fp8w16")]
    assert len(names) == len(L.DTYPES) * len(L.SIMT_TILE_HEIGHTS) * 2 + len(G.MMA_DTYPES) * len(G.NARROW_MMA_TILES)
    result = nvrtc_compile(G.KERNEL_FILE, names, arch)
    assert_no_spills(result, arch)
    for (_, gated), tile in G.NARROW_MMA_TILES.items():
        registers = result.resources[G.w8a16_mma_name("bfloat16", tile, gated)].registers
        assert registers <= L.REGISTERS_PER_MULTIPROCESSOR // (tile.min_blocks * tile.threads), registers
