"""The INT4 kernels of moe_gemm_int4.cu without a GPU: compiled for the host (tests/gpu/host_emulation.h)
and run against a float64 reference that decodes the packed bytes from the format's definition
(``w = (q - z) * s`` per row and group of g input columns, z = 8 when symmetric, byte j holding
column 2j in its low nibble) and runs the dense experts; NVRTC compiles for sm_80 / sm_90 with no
spills; hipcc compiles the HIP variant for gfx90a and gfx940.

Kept cheap: one host build of the instantiations the cases use, shapes of a few hundred columns.
"""

import functools

import numpy as np
import pytest
import torch

import gpu_host_emulator as host
from gpu_host_emulator import HIPCC, GuardedArrays, HostBackend, nvrtc_available
from gpu_reference import from_storage, ragged_routing, to_storage
from helpers.reference import dense_experts
from moeroute.gpu import gemm_int4 as G
from moeroute.gpu import launch as L
from moeroute.gpu.loader import nvrtc_compile

# max |kernel - reference| / max |reference|. float32: the decoded weights are one float32
# rounding from (q - z) * s, the sums float32 against the reference's float64. 16-bit: the
# activations, the intermediate and the output are rounded to the activations' type.
TOLERANCE = {"float32": 1e-5, "float16": 4e-3, "bfloat16": 2e-2}
TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
COUNTS = [0, 1, 15, 17]  # B - 1 and B + 1 rows at align block 16; expert 0 has none
I, TOP_K = 128, 2
# H per group size: g = 32 gives 9 blocks of 32 (the mma kernel's 4-stage ring wraps and its
# last stage is half full); 64 and 128 give 384 (6 and 3 groups).
HIDDEN = {32: 288, 64: 384, 128: 384}

CASES = [  # path, activation dtype, scale dtype, group size, symmetric, align block
    pytest.param("simt", "float32", "float32", 32, True, 16, id="simt-f32-s32-g32-sym"),
    pytest.param("simt", "float32", "bfloat16", 128, False, 16, id="simt-f32-sbf16-g128-asym"),
    pytest.param("simt", "bfloat16", "bfloat16", 64, False, 16, id="simt-bf16-sbf16-g64-asym"),
    pytest.param("mma", "bfloat16", "bfloat16", 32, True, 16, id="mma-bf16-sbf16-g32-sym"),
    pytest.param("mma", "bfloat16", "float32", 128, False, 16, id="mma-bf16-s32-g128-asym"),
    pytest.param("mma", "float16", "float16", 32, False, 16, id="mma-f16-sf16-g32-asym"),
    pytest.param("mma", "float16", "float16", 128, True, 16, id="mma-f16-sf16-g128-sym"),
    # The 64-row tiles: eight warps, two 16-row mma tiles per warp.
    pytest.param("mma", "bfloat16", "bfloat16", 32, False, 64, id="mma-tile64-bf16-g32-asym"),
    pytest.param(None, "bfloat16", "bfloat16", 128, True, 16, id="auto-bf16-g128-sym"),
]


def _host_names():
    names = {L.sum_name(dtype) for dtype in TORCH}
    for path, dtype, scale_dtype, _, _, align_block in (case.values for case in CASES):
        for gated in (True, False):
            if path == "simt":
                names.add(G.simt_name(dtype, scale_dtype, L.simt_tile_height(align_block), gated))
            else:
                tile = G.MMA_TILES[(next(h for h in G.MMA_TILE_HEIGHTS if align_block % h == 0), gated)]
                names.add(G.mma_name(dtype, scale_dtype, tile, gated))
    return sorted(names)


@pytest.fixture(scope="module")
def int4_emulator(tmp_path_factory):
    """moe_gemm_int4.cu's kernels (SIMT, and mma with m16n8k16 emulated from the PTX tables) on the host."""
    return host.format_emulator(G.KERNEL_FILE, _host_names(), tmp_path_factory)


def _weight(rows, cols, group_size, symmetric, scale_dtype, seed, scale):
    """Random INT4 tensors [E, rows, cols/2], [E, rows, cols/g] (+ zeros): every nibble, scales
    in scale * (0.5, 1.5) rounded to scale_dtype, zero points 0..15."""
    gen = torch.Generator().manual_seed(seed)
    E = len(COUNTS)
    packed = torch.randint(0, 256, (E, rows, cols // 2), generator=gen, dtype=torch.uint8)
    scales = (scale * (0.5 + torch.rand(E, rows, cols // group_size, generator=gen))).to(TORCH[scale_dtype])
    zeros = None if symmetric else torch.randint(0, 16, (E, rows, cols // group_size), generator=gen, dtype=torch.uint8)
    return packed, scales, zeros


def dequantize(packed, scales, zeros, group_size):
    """float64 [..., rows, cols]: (q - z) * s, q = the nibbles (low first), z = 8 without zeros."""
    q = torch.stack([packed % 16, packed // 16], dim=-1).flatten(-2).double()
    z = torch.full_like(scales, 8, dtype=torch.float64) if zeros is None else zeros.double()
    return (q - z.repeat_interleave(group_size, dim=-1)) * scales.double().repeat_interleave(group_size, dim=-1)


def _problem(group_size, symmetric, scale_dtype, seed):
    rng = np.random.default_rng(seed)
    topk_ids, topk_weights = ragged_routing(COUNTS, TOP_K, len(COUNTS), rng)
    H = HIDDEN[group_size]
    x = torch.randn(topk_ids.shape[0], H, generator=torch.Generator().manual_seed(seed))
    # |q - z| <= 15: scales around 1 / (8 sqrt(k)) keep the products O(1).
    gate_up = _weight(2 * I, H, group_size, symmetric, scale_dtype, seed + 1, 1 / (8 * H**0.5))
    down = _weight(H, I, group_size, symmetric, scale_dtype, seed + 2, 1 / (8 * I**0.5))
    return x, topk_ids, topk_weights, gate_up, down


def _run(emulator, path, dtype, scale_dtype, group_size, x, topk_ids, topk_weights, gate_up, down, align_block):
    arrays = GuardedArrays()
    backend = HostBackend(emulator, arrays)
    T, H = x.shape
    out = arrays.empty((T, H), L.STORAGE_DTYPES[dtype])

    def stored(weight):
        packed, scales, zeros = weight
        s = to_storage(scales.float().numpy(), scale_dtype)
        return arrays.copy(packed.numpy()), arrays.copy(s), None if zeros is None else arrays.copy(zeros.numpy())

    G.run_int4_experts(
        backend,
        dtype,
        arrays.copy(to_storage(x.numpy(), dtype)),
        stored(gate_up),
        stored(down),
        arrays.copy(topk_weights),
        arrays.copy(topk_ids),
        out,
        group_size=group_size,
        gate_up_scale_dtype=scale_dtype,
        down_scale_dtype=scale_dtype,
        align_block=align_block,
        path=path,
    )
    arrays.check_guards()
    return from_storage(out, dtype), backend.launched


def _reference(dtype, group_size, x, topk_ids, topk_weights, gate_up, down):
    return dense_experts(
        x.to(TORCH[dtype]).double(),  # the values the kernel reads
        torch.from_numpy(topk_weights),
        torch.from_numpy(topk_ids),
        dequantize(*gate_up, group_size),
        dequantize(*down, group_size),
    ).numpy()


def test_host_build_has_no_warnings(int4_emulator):
    assert int4_emulator.build_warnings == ""


@pytest.mark.parametrize("path, dtype, scale_dtype, group_size, symmetric, align_block", CASES)
def test_int4_experts_match_dense_reference(
    int4_emulator, path, dtype, scale_dtype, group_size, symmetric, align_block
):
    x, topk_ids, topk_weights, gate_up, down = _problem(group_size, symmetric, scale_dtype, seed=3)
    actual, launched = _run(
        int4_emulator, path, dtype, scale_dtype, group_size, x, topk_ids, topk_weights, gate_up, down, align_block
    )
    assert any(name.startswith(f"moe_gemm_int4_{path or 'mma'}") for name in launched), launched
    expected = _reference(dtype, group_size, x, topk_ids, topk_weights, gate_up, down)
    assert np.isfinite(actual).all()
    error = np.abs(actual - expected).max() / np.abs(expected).max()
    assert error <= TOLERANCE[dtype], f"{path} {dtype} g={group_size} sym={symmetric}: relative error {error:.3g}"
    # Tokens with no slot on this device get exact zeros.
    on_device = ((topk_ids >= 0) & (topk_ids < len(COUNTS))).any(axis=1)
    assert (actual[~on_device] == 0).all()


@pytest.mark.parametrize("path", ["simt", "mma"])
def test_zero_points_and_scales_are_per_group(int4_emulator, path):
    # One group of every gate_up row gets zero point 0 and a scale 2^6 times the others: a kernel
    # that took a neighbouring group's zero point or scale is far off there.
    x, topk_ids, topk_weights, gate_up, down = _problem(128, False, "bfloat16", seed=7)
    packed, scales, zeros = (t.clone() for t in gate_up)
    scales[:, :, 1] *= 64
    zeros[:, :, 1] = 0
    gate_up = (packed, scales, zeros)
    actual, _ = _run(int4_emulator, path, "bfloat16", "bfloat16", 128, x, topk_ids, topk_weights, gate_up, down, 16)
    expected = _reference("bfloat16", 128, x, topk_ids, topk_weights, gate_up, down)
    error = np.abs(actual - expected).max() / np.abs(expected).max()
    assert error <= TOLERANCE["bfloat16"], f"{path}: relative error {error:.3g}"


def test_bad_shapes_name_the_argument():
    x, topk_ids, topk_weights, gate_up, down = _problem(32, False, "float32", seed=1)
    with pytest.raises(ValueError, match="w_down zeros"):
        G.check_int4_experts_args(x, gate_up, (*down[:2], down[2][:, :, :1]), topk_weights, topk_ids, group_size=32)
    with pytest.raises(ValueError, match="w_gate_up packed"):
        G.check_int4_experts_args(x[:, :64], gate_up, down, topk_weights, topk_ids, group_size=32)
    with pytest.raises(ValueError, match="both have zero points"):
        G.check_int4_experts_args(x, gate_up, (*down[:2], None), topk_weights, topk_ids, group_size=32)
    with pytest.raises(ValueError, match="whole groups"):
        sliced = tuple(t[:, list(range(48)) + list(range(I, I + 48))] for t in gate_up)
        G.check_int4_experts_args(x, sliced, down, topk_weights, topk_ids, group_size=32)
    with pytest.raises(ValueError, match="group_size=96"):
        G.check_int4_experts_args(x, gate_up, down, topk_weights, topk_ids, group_size=96)


def test_fused_experts_int4_rejects_bad_input_before_launching():
    # CPU tensors: every check below fires before any device is needed.
    from moeroute.gpu import fused_experts
    from moeroute.quant import QuantConfig

    x, topk_ids, topk_weights, gate_up, down = _problem(32, True, "bfloat16", seed=2)
    ids, weights = torch.from_numpy(topk_ids), torch.from_numpy(topk_weights)
    gate_up, down = gate_up[:2], down[:2]
    quant = QuantConfig("int4", group_size=32)
    with pytest.raises(TypeError, match="w_gate_up must be a \\(packed, scales\\)"):
        fused_experts(x, torch.zeros(4, 2 * I, 288), down, weights, ids, quant=quant)
    with pytest.raises(ValueError, match="w_down scales has dtype"):
        fused_experts(x, gate_up, (down[0], down[1].to(torch.int32)), weights, ids, quant=quant)
    with pytest.raises(ValueError, match="symmetric=False"):
        fused_experts(x, gate_up, down, weights, ids, quant=QuantConfig("int4", group_size=32, symmetric=False))
    with pytest.raises(ValueError, match="down_bias is not supported"):
        fused_experts(x, gate_up, down, weights, ids, quant=quant, down_bias=torch.zeros(4, 288))
    with pytest.raises(TypeError, match="CUDA"):
        fused_experts(x, gate_up, down, weights, ids, quant=quant)


def test_shipped_names_leave_out_the_mma_kernels_where_they_do_not_exist():
    names = G.shipped_name_expressions("cuda")
    mma = {name for name in names if name.startswith("moe_gemm_int4_mma")}
    assert len(mma) == len(G.MMA_DTYPES) * len(G.SCALE_DTYPES) * len(G.MMA_TILES)
    assert not mma & set(G.shipped_name_expressions("cuda", 75))
    assert not mma & set(G.shipped_name_expressions("hip"))
    assert set(_host_names()) <= set(names)


@functools.cache
def _compile(arch):
    # The INT4 GEMMs; moe_sum_topk (from moe_gemm.cu) is checked by test_gpu_compile.py.
    names = [name for name in G.shipped_name_expressions("cuda") if name.startswith("moe_gemm_int4")]
    return nvrtc_compile(G.KERNEL_FILE, names, arch)


@pytest.mark.slow
@pytest.mark.skipif(not nvrtc_available(), reason="CuPy's NVRTC binding is not available")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_nvrtc_compiles_without_spills(arch):
    result = _compile(arch)
    report = host.assert_no_spills(result, arch)
    for dtype in G.MMA_DTYPES:
        for scale_dtype in G.SCALE_DTYPES:
            for (_, gated), tile in G.MMA_TILES.items():
                registers = result.resources[G.mma_name(dtype, scale_dtype, tile, gated)].registers
                assert registers <= L.REGISTERS_PER_MULTIPROCESSOR // (tile.min_blocks * tile.threads), report


@pytest.mark.skipif(HIPCC is None, reason="hipcc not found (apt-get install hipcc): HIP compile check skipped")
def test_hipcc_compiles_the_hip_variant(tmp_path):
    code_object = host.hipcc_code_object(G.KERNEL_FILE, G.shipped_name_expressions("hip"), tmp_path)
    assert b"moe_gemm_int4_simt" in code_object
    assert b"moe_gemm_int4_mma" not in code_object, "the mma.sync path must be compiled out on AMD"
