"""The MXFP4 kernels of moe_gemm_mxfp4.cu without a GPU: compiled for the host (tests/gpu/host_emulation.h)
and run against a float64 reference that decodes the packed bytes from the format's definition
(tests/helpers/reference.py: ``e2m1[nibble] * 2 ** (scale - 127)``) and runs the dense experts;
NVRTC compiles for sm_80 / sm_90 with no spills; hipcc compiles the HIP variant.

Kept cheap: one host build (SIMT and mma kernels of float32 / bfloat16 only) shared by the
module, shapes of a few hundred columns.
"""

import functools

import numpy as np
import pytest
import torch

import gpu_host_emulator as host
from gpu_host_emulator import HIPCC, GuardedArrays, HostBackend, nvrtc_available
from gpu_reference import from_storage, ragged_routing, to_storage
from helpers.reference import dense_experts, dequantize_mxfp4
from moeroute.gpu import gemm_mxfp4 as G
from moeroute.gpu import launch as L
from moeroute.gpu.loader import nvrtc_compile

# max |kernel - reference| / max |reference|. float32: the decoded weights are exact, only float32
# against float64 accumulation differs. bfloat16: the activations, the intermediate and the
# output are rounded to bfloat16 (float16) by the kernels (the reference keeps float64 throughout).
TOLERANCE = {"float32": 1e-5, "float16": 4e-3, "bfloat16": 2e-2}
TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
COUNTS = [0, 1, 15, 17]  # B - 1 and B + 1 rows at align block 16; expert 0 has none
H, I, TOP_K = 288, 64, 2  # 9 and 2 scale blocks: the mma kernel's 4-stage ring wraps and ends half full


def _host_names():
    names = []
    for dtype in ("float32", "bfloat16"):
        names.append(L.sum_name(dtype))
        names += [G.simt_name(dtype, 16, gated) for gated in (True, False)]
    names.append(L.sum_name("float16"))
    names += [G.mma_name(dtype, G.MMA_TILES[(16, gated)], gated) for dtype in G.MMA_DTYPES for gated in (True, False)]
    names += [G.mma_name("bfloat16", G.MMA_TILES[(64, gated)], gated) for gated in (True, False)]
    return names


@pytest.fixture(scope="module")
def mxfp4_emulator(tmp_path_factory):
    """moe_gemm_mxfp4.cu's kernels (SIMT, and mma with m16n8k16 emulated from the PTX tables) on the host."""
    return host.format_emulator(G.KERNEL_FILE, _host_names(), tmp_path_factory)


def _packed(rows, cols, seed, scale_range=(118, 128)):
    """Random MXFP4 bytes [E, rows, cols/32, 16] and scale bytes [E, rows, cols/32]: every nibble,
    scales 2^-9 .. 2^0 by default."""
    gen = torch.Generator().manual_seed(seed)
    E = len(COUNTS)
    blocks = torch.randint(0, 256, (E, rows, cols // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(*scale_range, (E, rows, cols // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


def _problem(seed, biases):
    rng = np.random.default_rng(seed)
    topk_ids, topk_weights = ragged_routing(COUNTS, TOP_K, len(COUNTS), rng)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(topk_ids.shape[0], H, generator=gen)
    # Scales around 2^-4 for gate_up and 2^-5 for down keep the products O(1) (|e2m1| <= 6).
    gate_up = _packed(2 * I, H, seed + 1, (120, 124))
    down = _packed(H, I, seed + 2, (119, 123))
    bias = None
    if biases:
        bias = (torch.randn(len(COUNTS), 2 * I, generator=gen), torch.randn(len(COUNTS), H, generator=gen))
    return x, topk_ids, topk_weights, gate_up, down, bias


def _run(
    emulator, dtype, path, x, topk_ids, topk_weights, gate_up, down, bias, activation, launched=None, align_block=16
):
    arrays = GuardedArrays()
    backend = HostBackend(emulator, arrays)
    T = x.shape[0]
    out = arrays.empty((T, H), L.STORAGE_DTYPES[dtype])
    bytes_of = lambda t: arrays.copy(t.numpy())  # noqa: E731
    biases = {} if bias is None else dict(gate_up_bias=bytes_of(bias[0]), down_bias=bytes_of(bias[1]))
    G.run_mxfp4_experts(
        backend,
        dtype,
        arrays.copy(to_storage(x.numpy(), dtype)),
        bytes_of(gate_up[0]),
        bytes_of(gate_up[1]),
        bytes_of(down[0]),
        bytes_of(down[1]),
        arrays.copy(topk_weights),
        arrays.copy(topk_ids),
        out,
        activation=activation,
        align_block=align_block,
        path=path,
        **biases,
    )
    arrays.check_guards()
    assert any(name.startswith(f"moe_gemm_mxfp4_{launched or path}") for name in backend.launched)
    return from_storage(out, dtype)


def _reference(dtype, x, topk_ids, topk_weights, gate_up, down, bias, activation):
    x = x.to(TORCH[dtype]).double()  # the values the kernel reads
    b_gate_up, b_down = bias if bias is not None else (None, None)
    return dense_experts(
        x,
        torch.from_numpy(topk_weights),
        torch.from_numpy(topk_ids),
        dequantize_mxfp4(*gate_up),
        dequantize_mxfp4(*down),
        activation,
        b_gate_up,
        b_down,
    ).numpy()


def test_host_build_has_no_warnings(mxfp4_emulator):
    assert mxfp4_emulator.build_warnings == ""


CASES = [  # path (None: the launcher's choice on the emulated sm_90), dtype, activation, biases, align block
    pytest.param("simt", "float32", "swigluoai", True, 16, id="simt-float32-swigluoai-bias"),
    pytest.param("simt", "float32", "silu", False, 16, id="simt-float32-silu"),
    pytest.param("simt", "bfloat16", "swigluoai", True, 16, id="simt-bfloat16-swigluoai-bias"),
    pytest.param("mma", "bfloat16", "swigluoai", True, 16, id="mma-bfloat16-swigluoai-bias"),
    pytest.param("mma", "bfloat16", "silu", False, 16, id="mma-bfloat16-silu"),
    pytest.param("mma", "float16", "swigluoai", True, 16, id="mma-float16-swigluoai-bias"),
    # The 64-row tiles: eight warps, two 16-row mma tiles per warp.
    pytest.param("mma", "bfloat16", "swigluoai", True, 64, id="mma-tile64-bfloat16-swigluoai-bias"),
    pytest.param(None, "bfloat16", "silu", True, 16, id="auto-bfloat16-silu-bias"),
    pytest.param(None, "float32", "silu", True, 16, id="auto-float32-silu-bias"),
]


@pytest.mark.parametrize("path, dtype, activation, biases, align_block", CASES)
def test_mxfp4_experts_match_dense_reference(mxfp4_emulator, path, dtype, activation, biases, align_block):
    x, topk_ids, topk_weights, gate_up, down, bias = _problem(seed=3, biases=biases)
    launched = path or ("simt" if dtype == "float32" else "mma")
    actual = _run(
        mxfp4_emulator, dtype, path, x, topk_ids, topk_weights, gate_up, down, bias, activation, launched, align_block
    )
    expected = _reference(dtype, x, topk_ids, topk_weights, gate_up, down, bias, activation)
    assert np.isfinite(actual).all()
    error = np.abs(actual - expected).max() / np.abs(expected).max()
    assert error <= TOLERANCE[dtype], f"{path} {dtype} {activation} bias={biases}: relative error {error:.3g}"
    # Tokens with no slot on this device get exact zeros.
    on_device = ((topk_ids >= 0) & (topk_ids < len(COUNTS))).any(axis=1)
    assert (actual[~on_device] == 0).all()


@pytest.mark.parametrize("path", ["simt", "mma"])
def test_scales_outside_the_16_bit_range_are_exact(mxfp4_emulator, path):
    # Scale bytes 8 and 250 (2^-119 and 2^123), far outside float16's range, on the first two k
    # blocks; activations scaled the other way (to bfloat16's edges) keep the products O(1). A
    # kernel that mixed up the blocks' scales, or lost them to a 16-bit range, is far off.
    x, topk_ids, topk_weights, gate_up, down, _ = _problem(seed=5, biases=False)
    blocks, scales = gate_up
    scales = scales.clone()
    scales[:, :, 0] = 8  # 2^-119 (k block 0)
    scales[:, :, 1] = 250  # 2^123  (k block 1)
    scales[:, :, 2] = 127  # 2^0
    x = x.clone()
    x[:, :32] *= 2.0**115
    x[:, 32:64] *= 2.0**-127
    x = x.to(torch.bfloat16).float()
    gate_up = (blocks, scales)
    actual = _run(mxfp4_emulator, "bfloat16", path, x, topk_ids, topk_weights, gate_up, down, None, "silu")
    expected = _reference("bfloat16", x, topk_ids, topk_weights, gate_up, down, None, "silu")
    error = np.abs(actual - expected).max() / np.abs(expected).max()
    assert error <= TOLERANCE["bfloat16"], f"{path}: relative error {error:.3g}"


def test_bad_shapes_name_the_argument():
    x, topk_ids, topk_weights, gate_up, down, _ = _problem(seed=1, biases=False)
    args = (x, *gate_up, *down, topk_weights, topk_ids)
    with pytest.raises(ValueError, match="w_down scales"):
        G.check_mxfp4_experts_args(x, *gate_up, down[0], down[1][:, :, :1], topk_weights, topk_ids)
    with pytest.raises(ValueError, match="w_gate_up blocks"):
        G.check_mxfp4_experts_args(x[:, :64], *args[1:])
    with pytest.raises(ValueError, match="gate_up_bias"):
        G.check_mxfp4_experts_args(*args, gate_up_bias=torch.zeros(len(COUNTS), I))
    with pytest.raises(ValueError, match="path='mma' needs float16 or bfloat16"):
        G.plan_mxfp4_gemm(
            path="mma",
            dtype="float32",
            gated=True,
            block_size=16,
            a=None,
            blocks=None,
            scales=None,
            c=None,
            sorted_token_ids=np.zeros(16, np.int32),
            expert_ids=None,
            topk_weights=None,
            numel=1,
            top_k=1,
            n=I,
            k=H,
        )


def test_fused_experts_mxfp4_rejects_bad_input_before_launching():
    # CPU tensors: every check below fires before any device is needed.
    from moeroute.gpu import fused_experts
    from moeroute.quant import QuantConfig

    x, topk_ids, topk_weights, gate_up, down, bias = _problem(seed=2, biases=True)
    ids, weights = torch.from_numpy(topk_ids), torch.from_numpy(topk_weights)
    quant = QuantConfig(format="mxfp4")
    with pytest.raises(TypeError, match="w_gate_up must be a \\(blocks, scales\\) pair"):
        fused_experts(x, torch.zeros(4, 2 * I, H), down, weights, ids, quant=quant)
    with pytest.raises(ValueError, match="w_down scales has dtype"):
        fused_experts(x, gate_up, (down[0], down[1].float()), weights, ids, quant=quant)
    with pytest.raises(ValueError, match="down_bias has shape"):
        fused_experts(x, gate_up, down, weights, ids, quant=quant, down_bias=bias[0])
    with pytest.raises(ValueError, match="gate_up_scale"):
        fused_experts(x, gate_up, down, weights, ids, quant=quant, gate_up_scale=gate_up[1])
    with pytest.raises(TypeError, match="CUDA"):
        fused_experts(x, gate_up, down, weights, ids, quant=quant)


def test_shipped_names_leave_out_the_mma_kernels_where_they_do_not_exist():
    mma = {name for name in G.shipped_name_expressions("cuda") if name.startswith("moe_gemm_mxfp4_mma")}
    assert len(mma) == len(G.MMA_DTYPES) * len(G.MMA_TILES)
    assert not mma & set(G.shipped_name_expressions("cuda", 75))
    assert not mma & set(G.shipped_name_expressions("hip"))


@functools.cache
def _compile(arch):
    # The MXFP4 GEMMs; moe_sum_topk (from moe_gemm.cu) is checked by test_gpu_compile.py.
    names = [name for name in G.shipped_name_expressions("cuda") if name.startswith("moe_gemm_mxfp4")]
    return nvrtc_compile(G.KERNEL_FILE, names, arch)


@pytest.mark.slow
@pytest.mark.skipif(not nvrtc_available(), reason="CuPy's NVRTC binding is not available")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_nvrtc_compiles_without_spills(arch):
    result = _compile(arch)
    report = host.assert_no_spills(result, arch)
    for (_, gated), tile in G.MMA_TILES.items():
        registers = result.resources[G.mma_name("bfloat16", tile, gated)].registers
        assert registers <= L.REGISTERS_PER_MULTIPROCESSOR // (tile.min_blocks * tile.threads), report


@pytest.mark.skipif(HIPCC is None, reason="hipcc not found (apt-get install hipcc): HIP compile check skipped")
def test_hipcc_compiles_the_hip_variant(tmp_path):
    code_object = host.hipcc_code_object(G.KERNEL_FILE, G.shipped_name_expressions("hip"), tmp_path)
    assert b"moe_gemm_mxfp4_simt" in code_object
    assert b"moe_gemm_mxfp4_mma" not in code_object, "the mma.sync path must be compiled out on AMD"
