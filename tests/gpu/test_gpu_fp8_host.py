"""The FP8 kernels of moe_gemm_fp8.cu without a GPU: compiled for the host (tests/gpu/host_emulation.h)
and run against moeroute.quant (the activation quantizer, bit for bit) and the plain-torch w8a8
reference (moeroute.quant.reference); NVRTC compiles for sm_89 / sm_90 with no spills; hipcc
compiles the HIP variant.

Problems are ragged (experts with 0, 1, B-1 and B+1 rows, slots of other ranks), H and I are
not multiples of the weight blocks (partial last blocks in both directions) and the block
shapes include one whose bk is no multiple of the kernels' k slices.
"""

import functools

import numpy as np
import pytest
import torch

import gpu_host_emulator as host
from gpu_host_emulator import HIPCC, GuardedArrays, nvrtc_available, run_fp8_on_host
from gpu_reference import from_storage, ragged_routing, to_storage
from moeroute.gpu import gemm_fp8 as G
from moeroute.gpu import launch as L
from moeroute.gpu.loader import KERNEL_DIR, nvrtc_compile
from moeroute.quant import QuantConfig
from moeroute.quant.fp8 import quantize_experts, quantize_fp8_activations
from moeroute.quant.reference import moe_experts_reference

TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# max |kernel - reference| / max |reference|. The kernels sum each k group in float32 (the
# reference in float64): an intermediate value on a rounding boundary of e4m3 can round the
# other way, which moves one of I terms of a down product by one e4m3 step. bfloat16 also
# rounds the intermediate and the output.
TOLERANCE = {"float32": 5e-3, "bfloat16": 2e-2}
HOST_DTYPES = ("float32", "bfloat16")


def _host_names():
    names = []
    for dtype in HOST_DTYPES:
        names += [G.quantize_name(dtype), G.quantize_static_name(dtype), L.sum_name(dtype)]
        names += [G.simt_name(dtype, tile_m, gated) for tile_m in L.SIMT_TILE_HEIGHTS for gated in (True, False)]
        names += [G.mma_name(dtype, tile, gated) for (_, gated), tile in G.FP8_MMA_TILES.items()]
    return names


@pytest.fixture(scope="module")
def fp8_emulator(tmp_path_factory):
    """moe_gemm_fp8.cu's kernels (SIMT, and mma with m16n8k32 emulated from the PTX tables) on the host."""
    return host.format_emulator(G.KERNEL_FILE, _host_names(), tmp_path_factory)


def test_host_build_has_no_warnings(fp8_emulator):
    assert fp8_emulator.build_warnings == ""


@pytest.mark.parametrize("dtype", HOST_DTYPES)
@pytest.mark.parametrize("group_size, scale_fmt", [(128, "float"), (48, "float"), (128, "ue8m0"), (None, "float")])
def test_quantize_kernel_matches_quantize_fp8_activations(fp8_emulator, dtype, group_size, scale_fmt):
    rng = np.random.default_rng(5)
    rows, cols = 7, 200
    # Magnitudes over 12 binades (e4m3 subnormals after scaling), an all-zero row, a row with one
    # large value and ties of the rounding (multiples of the e4m3 step halves).
    x = (rng.standard_normal((rows, cols)) * np.exp2(rng.integers(-8, 4, (rows, cols)))).astype(np.float32)
    x[2] = 0.0
    x[3, 5] = 3e4
    x[4] = np.arange(cols, dtype=np.float32) / 16.0 - 6.0
    x = from_storage(to_storage(x, dtype), dtype).astype(np.float32)
    group = group_size or cols
    arrays = GuardedArrays()
    stored = arrays.copy(to_storage(x, dtype))
    q = arrays.empty((rows, cols), np.uint8)
    scales = arrays.empty((rows, -(-cols // group)), np.float32)
    fp8_emulator.launch(
        G.plan_quantize(
            dtype=dtype,
            x=stored,
            q=q,
            scales=scales,
            rows=rows,
            cols=cols,
            group_size=group,
            ue8m0=scale_fmt == "ue8m0",
        )
    )
    arrays.check_guards()
    q_ref, s_ref = quantize_fp8_activations(torch.from_numpy(x).to(TORCH[dtype]), group_size, scale_fmt)
    np.testing.assert_array_equal(scales, s_ref.numpy())
    np.testing.assert_array_equal(q, q_ref.view(torch.uint8).numpy())


COUNTS = [0, 1, 15, 17]  # B - 1 and B + 1 rows at align block 16; expert 0 has none
FORMAT_CASES = [
    pytest.param("fp8_block", (128, 128), "float", id="block128x128"),
    pytest.param("fp8_block", (64, 128), "float", id="block64x128"),
    pytest.param("fp8_block", (32, 48), "ue8m0", id="block32x48-ue8m0"),
    pytest.param("fp8_tensor", None, "float", id="tensor"),
]


def _problem(config, dtype, seed, H=144, I=100, top_k=2):
    rng = np.random.default_rng(seed)
    topk_ids, topk_weights = ragged_routing(COUNTS, top_k, len(COUNTS), rng)
    E, T = len(COUNTS), topk_ids.shape[0]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(TORCH[dtype])
    w_gate_up = torch.randn(E, 2 * I, H, generator=gen) / H**0.5
    w_down = torch.randn(E, H, I, generator=gen) / I**0.5
    return x, topk_ids, topk_weights, quantize_experts(w_gate_up, w_down, config)


@pytest.mark.parametrize("path", ["simt", "mma"])
@pytest.mark.parametrize("dtype", HOST_DTYPES)
@pytest.mark.parametrize("format, block_size, scale_fmt", FORMAT_CASES)
def test_fp8_experts_match_w8a8_reference(fp8_emulator, path, dtype, format, block_size, scale_fmt):
    config = QuantConfig(format=format, block_size=block_size, scale_fmt=scale_fmt)
    x, topk_ids, topk_weights, (q_gu, s_gu, q_d, s_d) = _problem(config, dtype, seed=3)
    out, backend = run_fp8_on_host(
        fp8_emulator,
        dtype,
        x,
        topk_ids,
        topk_weights,
        (q_gu, s_gu, q_d, s_d),
        format=format,
        block_size=block_size or (128, 128),
        scale_fmt=scale_fmt,
        align_block=16,
        path=path,
    )
    assert any(name.startswith(f"moe_gemm_fp8_{path}") for name in backend.launched)
    expected = (
        moe_experts_reference(
            x.float(),
            torch.from_numpy(topk_weights),
            torch.from_numpy(topk_ids).long(),
            q_gu,
            s_gu,
            q_d,
            s_d,
            block_size=block_size,
            scale_fmt=scale_fmt,
            intermediate_dtype=TORCH[dtype],
        )
        .double()
        .numpy()
    )
    actual = from_storage(out, dtype)
    assert np.isfinite(actual).all()
    error = np.abs(actual - expected).max() / np.abs(expected).max()
    assert error <= TOLERANCE[dtype], f"{format} {block_size} {dtype} {path}: relative error {error:.3g}"
    # Tokens with no slot on this device get exact zeros.
    on_device = ((topk_ids >= 0) & (topk_ids < len(COUNTS))).any(axis=1)
    assert (actual[~on_device] == 0).all()


def test_scales_are_applied_per_block(fp8_emulator):
    # One weight block row scaled by 2**10 against the rest: a kernel that took the wrong block's
    # scale (or applied one scale to the whole row) is off by orders of magnitude there.
    config = QuantConfig(format="fp8_block", block_size=(32, 48))
    x, topk_ids, topk_weights, (q_gu, s_gu, q_d, s_d) = _problem(config, "float32", seed=11)
    s_d = s_d.clone()
    s_d[:, 2, 1] *= 1024.0
    out, _ = run_fp8_on_host(
        fp8_emulator,
        "float32",
        x,
        topk_ids,
        topk_weights,
        (q_gu, s_gu, q_d, s_d),
        format="fp8_block",
        block_size=(32, 48),
        align_block=16,
        path="mma",
    )
    expected = (
        moe_experts_reference(
            x,
            torch.from_numpy(topk_weights),
            torch.from_numpy(topk_ids).long(),
            q_gu,
            s_gu,
            q_d,
            s_d,
            block_size=(32, 48),
        )
        .double()
        .numpy()
    )
    error = np.abs(out - expected).max() / np.abs(expected).max()
    assert error <= TOLERANCE["float32"], error


def test_bad_scale_shape_names_the_argument():
    config = QuantConfig(format="fp8_block", block_size=(64, 128))
    x, topk_ids, topk_weights, (q_gu, s_gu, q_d, s_d) = _problem(config, "float32", seed=1)
    with pytest.raises(ValueError, match="down_scale"):
        G.check_fp8_experts_args(
            x, q_gu, s_gu, q_d, s_d[:, :1], topk_weights, topk_ids, format="fp8_block", block_size=(64, 128)
        )
    with pytest.raises(ValueError, match="gate_up_scale"):
        G.check_fp8_experts_args(x, q_gu, s_gu, q_d, s_d, topk_weights, topk_ids, format="fp8_tensor")
    with pytest.raises(ValueError, match="format"):
        G.check_fp8_experts_args(x, q_gu, s_gu, q_d, s_d, topk_weights, topk_ids, format="int8")


@functools.cache
def _compile(arch):
    return nvrtc_compile(G.KERNEL_FILE, G.shipped_name_expressions("cuda"), arch)


@pytest.mark.slow
@pytest.mark.skipif(not nvrtc_available(), reason="CuPy's NVRTC binding is not available")
@pytest.mark.parametrize("arch", ["sm_89", "sm_90"])
def test_nvrtc_compiles_without_spills(arch):
    result = _compile(arch)
    report = host.assert_no_spills(result, arch)
    for (_, gated), tile in G.FP8_MMA_TILES.items():
        registers = result.resources[G.mma_name("bfloat16", tile, gated)].registers
        assert registers <= L.REGISTERS_PER_MULTIPROCESSOR // (tile.min_blocks * tile.threads), report


@pytest.mark.skipif(not nvrtc_available(), reason="CuPy's NVRTC binding is not available")
def test_mma_kernel_emits_the_e4m3_instruction(tmp_path):
    from cupy.cuda import nvrtc

    name = G.mma_name("float32", G.FP8_MMA_TILES[(16, False)], False)
    program = nvrtc.createProgram((KERNEL_DIR / f"{G.KERNEL_FILE}.cu").read_text(), "fp8.cu", [], [])
    try:
        nvrtc.addNameExpression(program, name)
        nvrtc.compileProgram(program, [f"-I{KERNEL_DIR}", "-std=c++17", "-arch=compute_89"])
        ptx = nvrtc.getPTX(program)
    finally:
        nvrtc.destroyProgram(program)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    assert "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32" in ptx


@pytest.mark.skipif(HIPCC is None, reason="hipcc not found (apt-get install hipcc): HIP compile check skipped")
@pytest.mark.parametrize("arch", ["gfx90a", "gfx940"])
def test_hipcc_compiles_the_hip_variant(tmp_path, arch):
    code_object = host.hipcc_code_object(G.KERNEL_FILE, G.shipped_name_expressions("hip"), tmp_path, archs=(arch,))
    assert b"moe_gemm_fp8_simt" in code_object and b"fp8_quantize_groups" in code_object
    assert b"moe_gemm_fp8_mma" not in code_object, "the FP8 mma.sync path must be compiled out on AMD"


def test_fused_experts_quant_rejects_bad_input_before_launching():
    # CPU tensors: every check below fires before any device is needed.
    from moeroute.gpu import fused_experts

    config = QuantConfig(format="fp8_block", block_size=(64, 128))
    x, topk_ids, topk_weights, (q_gu, s_gu, q_d, s_d) = _problem(config, "float32", seed=2)
    ids, weights = torch.from_numpy(topk_ids), torch.from_numpy(topk_weights)
    call = dict(quant=config, gate_up_scale=s_gu, down_scale=s_d)
    with pytest.raises(ValueError, match="w_gate_up has dtype torch.float32"):
        fused_experts(x, q_gu.float(), q_d, weights, ids, **call)
    with pytest.raises(ValueError, match="down_scale is required"):
        fused_experts(x, q_gu, q_d, weights, ids, quant=config, gate_up_scale=s_gu)
    with pytest.raises(ValueError, match="gate_up_scale has dtype"):
        fused_experts(x, q_gu, q_d, weights, ids, quant=config, gate_up_scale=s_gu.double(), down_scale=s_d)
    with pytest.raises(ValueError, match="gate_up_scale has shape"):
        fused_experts(x, q_gu, q_d, weights, ids, quant=config, gate_up_scale=s_gu[:, 1:], down_scale=s_d)
    with pytest.raises(ValueError, match="block_size"):
        fused_experts(x, q_gu, q_d, weights, ids, block_size=16, **call)
    with pytest.raises(ValueError, match="input_scale must be given exactly when"):
        fused_experts(
            x, q_gu, q_d, weights, ids, **{**call, "quant": QuantConfig(format="fp8_tensor", activation="static")}
        )
    with pytest.raises(ValueError, match="quant="):
        fused_experts(x, x, x, weights, ids, gate_up_scale=s_gu)
    with pytest.raises(TypeError, match="CUDA"):
        fused_experts(x, q_gu, q_d, weights, ids, **call)


def test_shipped_names_leave_out_the_mma_kernels_where_they_do_not_exist():
    mma = {name for name in G.shipped_name_expressions("cuda") if name.startswith("moe_gemm_fp8_mma")}
    assert len(mma) == len(L.DTYPES) * len(G.FP8_MMA_TILES)
    assert not mma & set(G.shipped_name_expressions("cuda", 80))
    assert not mma & set(G.shipped_name_expressions("hip"))
    assert mma <= set(G.shipped_name_expressions("cuda", 90))


@pytest.mark.parametrize("path", ["simt", "mma"])
@pytest.mark.parametrize("dtype", HOST_DTYPES)
def test_static_activation_scales_match_reference(fp8_emulator, path, dtype):
    # fp8_tensor with given input scales [E, 2]: each slot's rows are quantized with its expert's
    # scales. Scales differ per expert by 4x, and values beyond 448 * scale saturate.
    config = QuantConfig(format="fp8_tensor", activation="static")
    x, topk_ids, topk_weights, (q_gu, s_gu, q_d, s_d) = _problem(config, dtype, seed=4)
    E = len(COUNTS)
    input_scale = torch.tensor([[0.004 * 4.0**e, 0.0005 * 2.0**e] for e in range(E)], dtype=torch.float32)
    out, backend = run_fp8_on_host(
        fp8_emulator,
        dtype,
        x,
        topk_ids,
        topk_weights,
        (q_gu, s_gu, q_d, s_d),
        format="fp8_tensor",
        align_block=16,
        path=path,
        input_scale=input_scale,
    )
    assert G.quantize_static_name(dtype) in backend.launched
    expected = (
        moe_experts_reference(
            x.float(),
            torch.from_numpy(topk_weights),
            torch.from_numpy(topk_ids).long(),
            q_gu,
            s_gu,
            q_d,
            s_d,
            input_scale=input_scale,
            intermediate_dtype=TORCH[dtype],
        )
        .double()
        .numpy()
    )
    actual = from_storage(out, dtype)
    error = np.abs(actual - expected).max() / np.abs(expected).max()
    assert error <= TOLERANCE[dtype], f"static {dtype} {path}: relative error {error:.3g}"
    with pytest.raises(ValueError, match="input_scale has shape"):
        G.run_fp8_experts(
            backend,
            dtype,
            x,
            q_gu,
            s_gu,
            q_d,
            s_d,
            topk_weights,
            topk_ids,
            out,
            format="fp8_tensor",
            input_scale=input_scale[:2],
        )
