"""Launch configuration: block size choice, tile selection, grids, shared memory, and the
constants that must agree with kernels/moe_gemm.cu and moe_tile.cuh."""

import re

import numpy as np
import pytest

from moeroute.gpu import launch as L
from moeroute.gpu.loader import KERNEL_DIR

# the float kernels' file and the tile loop they share with the other formats
KERNEL_SOURCE = (KERNEL_DIR / "moe_gemm.cu").read_text() + (KERNEL_DIR / "moe_tile.cuh").read_text()
# Largest dynamic shared memory a block may opt into on sm_80 (A100: 163 KB) and sm_90 (227 KB),
# and the shared memory of one multiprocessor on sm_90 (228 KB, 1 KB of it reserved per block).
SM80_SHARED_MEMORY_OPT_IN = 163 * 1024
SM90_SHARED_MEMORY_PER_MULTIPROCESSOR = 228 * 1024
SM90_RESERVED_SHARED_MEMORY_PER_BLOCK = 1024
TILE_TABLES = [(80, L.MMA_TILES), (90, L.MMA_TILES_SM90)]


def _kernel_constant(name: str) -> int:
    match = re.search(rf"constexpr int {name} = ([^;]+);", KERNEL_SOURCE)
    assert match, f"{name} not found in moe_gemm.cu or moe_tile.cuh"
    expression = match.group(1)
    for other in re.findall(r"k[A-Z]\w+", expression):  # e.g. kMmaBlockK + 8
        expression = expression.replace(other, str(_kernel_constant(other)))
    return int(eval(expression, {}))  # integer arithmetic on literals only


@pytest.mark.parametrize(
    "python_value, kernel_name",
    [
        (L.SIMT_THREADS, "kSimtThreads"),
        (L.SIMT_BLOCK_N, "kSimtBlockN"),
        (L.MMA_ROW_PADDING, "kMmaRowPadding"),
        (L.MMA_CHUNK, "kMmaChunk"),
        (L.SUM_THREADS, "kSumThreads"),
        (L.MMA_ROW_MULTIPLE, "kMmaChunk"),
        (L.ACTIVATIONS["silu"], "kActivationSilu"),
        (L.ACTIVATIONS["gelu"], "kActivationGelu"),
        (L.ACTIVATIONS["gelu_tanh"], "kActivationGeluTanh"),
        (L.ACTIVATIONS["swigluoai"], "kActivationSwigluOai"),
    ],
)
def test_constants_match_the_kernels(python_value, kernel_name):
    assert python_value == _kernel_constant(kernel_name)


def test_kernel_thread_grid_matches_simt_threads():
    assert _kernel_constant("kSimtThreadsX") * _kernel_constant("kSimtThreadsY") == L.SIMT_THREADS


@pytest.mark.parametrize(
    "numel, num_experts, expected",
    [
        (8, 8, 16),
        (24 * 8, 8, 16),
        (25 * 8, 8, 32),
        (48, 1, 32),
        (49, 1, 64),
        (96 * 4, 4, 64),
        (97 * 4, 4, 128),
        (4096 * 8, 8, 128),
        (0, 4, 16),
    ],
)
def test_choose_block_size(numel, num_experts, expected):
    assert L.choose_block_size(numel, num_experts) == expected


@pytest.mark.parametrize("block_size", L.BLOCK_SIZES)
def test_tiles_divide_every_block_size(block_size):
    assert block_size % L.simt_tile_height(block_size) == 0
    assert block_size % L.mma_tile_height(block_size) == 0
    for _, table in TILE_TABLES:
        assert (L.mma_tile_height(block_size), True) in table
        assert (L.mma_tile_height(block_size), False) in table


@pytest.mark.parametrize(
    "cc, key, tile", [(cc, key, tile) for cc, table in TILE_TABLES for key, tile in sorted(table.items())]
)
def test_mma_tiles_fit(cc, key, tile):
    tile_m, gated = key
    assert tile.tile_m == tile_m
    warp_m, warp_n = tile.tile_m // tile.warps_m, tile.block_n // tile.warps_n
    assert warp_m % 16 == 0 and warp_n % 16 == 0, "whole 16x16 fragment pairs per warp"
    accumulators = (2 if gated else 1) * (warp_m // 16) * (warp_n // 8) * 4
    assert tile.accumulators(gated) == accumulators <= 128
    assert tile.block_k % 16 == 0 and tile.stages >= 2
    # B rows are split evenly over the threads (static_assert in mma_load_stage)
    assert ((2 if gated else 1) * tile.block_n * tile.block_k // 8) % tile.threads == 0
    expected = tile.stages * (tile.tile_m + (2 if gated else 1) * tile.block_n) * (tile.block_k + 8) * 2
    assert tile.shared_memory_bytes(gated) == expected <= SM80_SHARED_MEMORY_OPT_IN
    assert tile.max_registers == 65536 // (tile.min_blocks * tile.threads)


@pytest.mark.parametrize("key, tile", sorted(L.MMA_TILES_SM90.items()))
def test_hopper_tiles_are_leaner_and_deeper(key, tile):
    # Against the sm_80 tile of the same height: at least as many resident blocks asked of
    # ptxas, at most half the accumulators per thread (or the same where sm_80 already has
    # four warps per 16-row tile), a deeper pipeline, and two blocks' shared memory in one SM.
    tile_m, gated = key
    ampere = L.MMA_TILES[key]
    assert (tile.tile_m, tile.block_n) == (ampere.tile_m, ampere.block_n)
    assert tile.min_blocks >= 2 and tile.max_registers >= 128
    assert tile.stages > ampere.stages
    assert tile.accumulators(gated) <= max(ampere.accumulators(gated) // 2, 32 if tile_m == 16 else 0)
    per_block = tile.shared_memory_bytes(gated) + 4 * tile_m + SM90_RESERVED_SHARED_MEMORY_PER_BLOCK
    assert tile.min_blocks * per_block <= SM90_SHARED_MEMORY_PER_MULTIPROCESSOR


@pytest.mark.parametrize(
    "cc, table",
    [
        (0, L.MMA_TILES),
        (75, L.MMA_TILES),
        (80, L.MMA_TILES),
        (86, L.MMA_TILES),
        (89, L.MMA_TILES),
        (90, L.MMA_TILES_SM90),
        (100, L.MMA_TILES_SM90),
    ],
)
def test_mma_tiles_by_compute_capability(cc, table):
    assert L.mma_tiles(cc) is table


def test_shipped_names():
    cuda, hip = L.shipped_name_expressions("cuda"), L.shipped_name_expressions("hip")
    assert len(set(cuda)) == len(cuda) == 3 * 2 * 2 + 3 + 2 * (len(L.MMA_TILES) + len(L.MMA_TILES_SM90))
    assert set(hip) == {n for n in cuda if not n.startswith("moe_gemm_mma")}
    with pytest.raises(ValueError, match="platform='metal'"):
        L.shipped_name_expressions("metal")


def _plan(path, block_size, rows, n, gated=True, compute_capability=80):
    arrays = [np.zeros(1, np.float32)] * 3
    return L.plan_expert_gemm(
        path=path,
        dtype="bfloat16",
        gated=gated,
        block_size=block_size,
        a=arrays[0],
        b=arrays[1],
        c=arrays[2],
        sorted_token_ids=np.zeros(rows, np.int32),
        expert_ids=np.zeros(rows // block_size, np.int32),
        topk_weights=arrays[0],
        numel=5,
        top_k=2,
        n=n,
        k=64,
        activation="gelu_tanh",
        apply_router_weight=True,
        compute_capability=compute_capability,
    )


def test_simt_plan():
    plan = _plan("simt", 128, 512, 100)
    assert plan.name == "moe_gemm_simt<moeroute::bfloat16, 64, 1>"
    assert plan.grid == (512 // 64, 2, 1) and plan.block == (256, 1, 1) and plan.shared_memory == 0
    assert plan.args[6] is plan.args[1]  # no bias: the kernel never reads the pointer
    scalars = [int(a) for a in plan.args[7:]]
    assert scalars == [5, 2, 100, 64, 128, L.ACTIVATIONS["gelu_tanh"], 1, 0]
    assert _plan("simt", 32, 64, 100).name == "moe_gemm_simt<moeroute::bfloat16, 16, 1>"


def test_mma_plan():
    plan = _plan("mma", 32, 640, 200, gated=False)
    tile = L.MMA_TILES[(16, False)]
    assert plan.name == "moe_gemm_mma<moeroute::bfloat16, 16, 128, 1, 4, 32, 3, 1, 0>"
    assert plan.grid == ((640 // 16) * 2, 1, 1) and plan.block == (128, 1, 1)
    assert plan.shared_memory == tile.shared_memory_bytes(False) == 3 * (16 + 128) * 40 * 2
    assert int(plan.args[-1]) == 640 // 16


def test_mma_plan_on_hopper():
    plan = _plan("mma", 128, 640, 200, gated=True, compute_capability=90)
    assert plan.name == "moe_gemm_mma<moeroute::bfloat16, 128, 64, 4, 2, 32, 4, 2, 1>"
    assert plan.grid == ((640 // 128) * 4, 1, 1) and plan.block == (256, 1, 1)
    assert plan.shared_memory == 4 * (128 + 2 * 64) * 40 * 2
    assert int(plan.args[-1]) == 640 // 128


def test_unknown_path():
    with pytest.raises(ValueError, match="path='wmma'"):
        _plan("wmma", 16, 16, 8)


@pytest.mark.parametrize(
    "dtype, cc, hip, H, I, pointer, expected",
    [
        ("bfloat16", 90, False, 64, 32, 256, True),
        ("float16", 80, False, 64, 32, 256, True),
        ("float32", 90, False, 64, 32, 256, False),
        ("bfloat16", 75, False, 64, 32, 256, False),
        ("bfloat16", 0, True, 64, 32, 256, False),
        ("bfloat16", 90, False, 60, 32, 256, False),
        ("bfloat16", 90, False, 64, 36, 256, False),
        ("bfloat16", 90, False, 64, 32, 258, False),
    ],
)
def test_mma_eligible(dtype, cc, hip, H, I, pointer, expected):
    assert L.mma_eligible(dtype, cc, hip, H, I, [256, pointer]) is expected


def test_plan_with_bias_passes_it_and_sets_the_flag():
    arrays = [np.zeros(1, np.float32)] * 3
    bias = np.zeros(4, np.float32)
    plan = L.plan_expert_gemm(
        path="simt",
        dtype="float32",
        gated=True,
        block_size=16,
        a=arrays[0],
        b=arrays[1],
        c=arrays[2],
        sorted_token_ids=np.zeros(16, np.int32),
        expert_ids=np.zeros(1, np.int32),
        topk_weights=arrays[0],
        numel=5,
        top_k=2,
        n=2,
        k=8,
        activation="swigluoai",
        bias=bias,
    )
    assert plan.args[6] is bias
    assert int(plan.args[12]) == L.ACTIVATIONS["swigluoai"] == 3 and int(plan.args[-1]) == 1
