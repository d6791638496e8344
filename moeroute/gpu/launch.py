"""Launch configuration of the expert GEMM kernels: which instantiation, grid, block, shared memory.

Pure Python (no CuPy): the same plans drive the GPU (gemm.py, through the loader) and the host
emulation used by the tests. Every number the kernels assume is a named constant here; the ones
that mirror a ``constexpr`` in kernels/moe_gemm.cu say so.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeroute.config import EXPERT_ACTIVATIONS

KERNEL_FILE = "moe_gemm"  # kernels/moe_gemm.cu, kernels/moe_gemm.hip

DTYPES = ("float32", "float16", "bfloat16")
# C++ spelling of each element type in the kernels' template arguments (kernels/compat.cuh).
KERNEL_TYPE_NAMES = {"float32": "float", "float16": "moeroute::float16", "bfloat16": "moeroute::bfloat16"}
# NumPy dtype that stores each element type; bfloat16 travels as its 16 raw bits.
STORAGE_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}

# Activation codes of moe_gemm.cu (kActivation*). gelu is the exact erf form, gelu_tanh torch's
# approximate="tanh", swigluoai gpt-oss's clamped SwiGLU (alpha 1.702, limit 7).
# The codes are the positions in moeroute.config.EXPERT_ACTIVATIONS.
ACTIVATIONS = {name: code for code, name in enumerate(EXPERT_ACTIVATIONS)}

# align_block_size block sizes the kernels accept: every tile height below divides one of them.
BLOCK_SIZES = (16, 32, 64, 128)

# Mirrors of moe_gemm.cu.
SIMT_THREADS = 256
SIMT_BLOCK_N = 64
SIMT_TILE_HEIGHTS = (64, 16)  # tallest first: the widest tile that divides block_size wins
MMA_ROW_PADDING = 8  # kMmaRowPadding: 16-bit values after each shared-memory row
MMA_CHUNK = 8  # kMmaChunk: 16-bit values per 16-byte cp.async
MMA_ELEMENT_BYTES = 2
SUM_THREADS = 256

# The mma path reads 16-byte chunks: rows must be a multiple of 8 values and start 16-byte aligned.
MMA_ROW_MULTIPLE = 8
MMA_POINTER_ALIGNMENT = 16
MMA_MIN_COMPUTE_CAPABILITY = 80  # cp.async, ldmatrix and bf16 mma.sync arrived with sm_80
HOPPER_COMPUTE_CAPABILITY = 90  # from here on the launcher picks MMA_TILES_SM90
REGISTERS_PER_MULTIPROCESSOR = 65536  # sm_80 and sm_90

# Dynamic shared memory a kernel may use without opting in to more (cudaFuncAttribute).
DEFAULT_SHARED_MEMORY_LIMIT = 48 * 1024

# Rows per expert below which a smaller block wastes less padding than it costs in reuse.
# Thresholds sit halfway between block sizes: 24 -> 16, 48 -> 32, 96 -> 64, else 128.
BLOCK_SIZE_THRESHOLDS = ((24, 16), (48, 32), (96, 64))
LARGEST_BLOCK_SIZE = 128

INT32_MAX = 2**31 - 1  # kernels index rows and tiles with int
GRID_Y_LIMIT = 65535  # CUDA's limit on gridDim.y, which the SIMT kernels use for column tiles
MAX_OUTPUT_COLUMNS = GRID_Y_LIMIT * SIMT_BLOCK_N


@dataclass(frozen=True)
class MmaTile:
    """Tile of one moe_gemm_mma instantiation: tile_m rows x block_n output columns (per gate),
    computed by warps_m x warps_n warps of 32 threads; block_k reduction values per pipeline
    stage, ``stages`` stages in shared memory, and ``min_blocks`` resident blocks per
    multiprocessor asked of ptxas (``__launch_bounds__``), which caps the registers per thread
    at ``max_registers``."""

    tile_m: int
    block_n: int
    warps_m: int
    warps_n: int
    block_k: int = 32
    stages: int = 3
    min_blocks: int = 1

    @property
    def threads(self) -> int:
        return self.warps_m * self.warps_n * 32

    @property
    def row_pitch(self) -> int:
        return self.block_k + MMA_ROW_PADDING

    @property
    def max_registers(self) -> int:
        """Registers per thread that still let ``min_blocks`` blocks share a multiprocessor."""
        return REGISTERS_PER_MULTIPROCESSOR // (self.min_blocks * self.threads)

    def accumulators(self, gated: bool) -> int:
        """float32 accumulators per thread."""
        warp_m, warp_n = self.tile_m // self.warps_m, self.block_n // self.warps_n
        return (2 if gated else 1) * (warp_m // 16) * (warp_n // 8) * 4

    def shared_memory_bytes(self, gated: bool) -> int:
        rows = self.tile_m + (2 if gated else 1) * self.block_n
        return self.stages * rows * self.row_pitch * MMA_ELEMENT_BYTES


# (tile_m, gated) -> tile, for sm_80 (Ampere). Gated tiles have half the columns: the gate and
# up halves together are as wide as the down tile, so every configuration holds at most 128
# accumulators per thread (no spills; tests/gpu/test_gpu_compile.py checks).
MMA_TILES = {
    (16, False): MmaTile(16, 128, 1, 4),
    (16, True): MmaTile(16, 64, 1, 4),
    (64, False): MmaTile(64, 128, 2, 2),
    (64, True): MmaTile(64, 64, 2, 2),
    (128, False): MmaTile(128, 128, 2, 2),
    (128, True): MmaTile(128, 64, 2, 2),
}

# sm_90 (Hopper): twice the warps on the same tiles (8 warps on the 64- and 128-row tiles), so
# each thread holds at most 64 accumulators; __launch_bounds__(threads, 2) caps ptxas at 128
# registers (two blocks of 256 threads fill the 65536-register file), and a fourth pipeline
# stage keeps three k slices in flight. The 64-row tiles take 64 k values per stage (one
# barrier per four k16 steps; 108 KiB of shared memory, two blocks still fit in Hopper's
# 228 KiB per multiprocessor); at 128 rows that slice made ptxas spill the down tile, and the
# 16-row tile would fit only two blocks, so those keep 32 (at most 80 KiB per block).
HOPPER_STAGES = 4
HOPPER_MIN_BLOCKS = 2
HOPPER_WIDE_BLOCK_K = 64
MMA_TILES_SM90 = {
    (16, False): MmaTile(16, 128, 1, 4, stages=HOPPER_STAGES, min_blocks=HOPPER_MIN_BLOCKS),
    (16, True): MmaTile(16, 64, 1, 4, stages=HOPPER_STAGES, min_blocks=HOPPER_MIN_BLOCKS),
    (64, False): MmaTile(
        64, 128, 2, 4, block_k=HOPPER_WIDE_BLOCK_K, stages=HOPPER_STAGES, min_blocks=HOPPER_MIN_BLOCKS
    ),
    (64, True): MmaTile(64, 64, 2, 4, block_k=HOPPER_WIDE_BLOCK_K, stages=HOPPER_STAGES, min_blocks=HOPPER_MIN_BLOCKS),
    (128, False): MmaTile(128, 128, 4, 2, stages=HOPPER_STAGES, min_blocks=HOPPER_MIN_BLOCKS),
    (128, True): MmaTile(128, 64, 4, 2, stages=HOPPER_STAGES, min_blocks=HOPPER_MIN_BLOCKS),
}
MMA_TILE_HEIGHTS = (128, 64, 16)  # tallest first


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel launch: template instantiation, grid and block (x, y, z), dynamic shared memory
    in bytes, and the arguments (device arrays and NumPy scalars, in the kernel's order)."""

    name: str
    grid: tuple
    block: tuple
    shared_memory: int
    args: tuple


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def choose_block_size(numel: int, num_experts: int) -> int:
    """Block size for align_block_size from the expected rows per expert, ``numel / num_experts``."""
    rows_per_expert = numel / max(num_experts, 1)
    for threshold, block_size in BLOCK_SIZE_THRESHOLDS:
        if rows_per_expert <= threshold:
            return block_size
    return LARGEST_BLOCK_SIZE


def simt_tile_height(block_size: int) -> int:
    return next(h for h in SIMT_TILE_HEIGHTS if block_size % h == 0)


def mma_tile_height(block_size: int) -> int:
    return next(h for h in MMA_TILE_HEIGHTS if block_size % h == 0)


def mma_tiles(compute_capability: int) -> dict:
    """The tile table for a GPU of ``compute_capability`` (major * 10 + minor): MMA_TILES_SM90
    from sm_90 on, MMA_TILES before."""
    return MMA_TILES_SM90 if compute_capability >= HOPPER_COMPUTE_CAPABILITY else MMA_TILES


def mma_eligible(
    dtype: str, compute_capability: int, is_hip: bool, hidden_size: int, intermediate_size: int, pointers
) -> bool:
    """True when the mma.sync path can run: float16/bfloat16 on sm_80+ (not HIP), H and I
    multiples of 8, every pointer 16-byte aligned."""
    return (
        dtype in ("float16", "bfloat16")
        and not is_hip
        and compute_capability >= MMA_MIN_COMPUTE_CAPABILITY
        and hidden_size % MMA_ROW_MULTIPLE == 0
        and intermediate_size % MMA_ROW_MULTIPLE == 0
        and all(int(p) % MMA_POINTER_ALIGNMENT == 0 for p in pointers)
    )


def simt_name(dtype: str, tile_m: int, gated: bool) -> str:
    return f"moe_gemm_simt<{KERNEL_TYPE_NAMES[dtype]}, {tile_m}, {int(gated)}>"


def mma_name(dtype: str, tile: MmaTile, gated: bool) -> str:
    return (
        f"moe_gemm_mma<{KERNEL_TYPE_NAMES[dtype]}, {tile.tile_m}, {tile.block_n}, "
        f"{tile.warps_m}, {tile.warps_n}, {tile.block_k}, {tile.stages}, {tile.min_blocks}, {int(gated)}>"
    )


def sum_name(dtype: str) -> str:
    return f"moe_sum_topk<{KERNEL_TYPE_NAMES[dtype]}>"


def shipped_name_expressions(platform: str = "cuda") -> list:
    """Every instantiation the launcher can ask for on ``platform`` ("cuda" or "hip")."""
    if platform not in ("cuda", "hip"):
        raise ValueError(f"platform={platform!r}: expected 'cuda' or 'hip'")
    names = []
    for dtype in DTYPES:
        for tile_m in SIMT_TILE_HEIGHTS:
            for gated in (True, False):
                names.append(simt_name(dtype, tile_m, gated))
        names.append(sum_name(dtype))
    if platform == "cuda":
        for dtype in ("float16", "bfloat16"):
            for table in (MMA_TILES, MMA_TILES_SM90):
                for (_, gated), tile in table.items():
                    names.append(mma_name(dtype, tile, gated))
    return names


def plan_expert_gemm(
    *,
    path: str,
    dtype: str,
    gated: bool,
    block_size: int,
    a,
    b,
    c,
    sorted_token_ids,
    expert_ids,
    topk_weights,
    numel: int,
    top_k: int,
    n: int,
    k: int,
    activation: str = "silu",
    apply_router_weight: bool = False,
    bias=None,
    compute_capability: int = MMA_MIN_COMPUTE_CAPABILITY,
) -> KernelLaunch:
    """Launch of one grouped GEMM over ``len(sorted_token_ids)`` block-padded rows.

    gate_up (``gated``): a = hidden_states [T, H], b = w_gate_up [E, 2n, k], c = [numel, n],
    a's row of flat index j is j // top_k. down: a = intermediate [numel, k] (pass top_k=1),
    b = w_down [E, n, k], c = [numel, n], weighted by topk_weights [numel] float32 when
    ``apply_router_weight``. ``bias`` (optional, dtype of b): [E, 2n] for gate_up (gate
    entries first), [E, n] for down, added to the products before the activation / weight.
    ``compute_capability`` (major * 10 + minor) picks the mma tile table (``mma_tiles``).
    """
    rows = int(sorted_token_ids.shape[0])
    scalars = gemm_scalars(
        numel, top_k, n, k, block_size=block_size, activation=activation, apply_router_weight=apply_router_weight
    ) + (np.int32(bias is not None),)
    # Without a bias the kernel never reads the pointer: b fills the slot.
    arrays = (a, b, c, sorted_token_ids, expert_ids, topk_weights, b if bias is None else bias)
    if path == "simt":
        tile_m = simt_tile_height(block_size)
        return KernelLaunch(
            simt_name(dtype, tile_m, gated),
            (rows // tile_m, ceil_div(n, SIMT_BLOCK_N), 1),
            (SIMT_THREADS, 1, 1),
            0,
            arrays + scalars,
        )
    if path == "mma":
        tile = mma_tiles(compute_capability)[(mma_tile_height(block_size), gated)]
        num_m_tiles = rows // tile.tile_m
        grid = num_m_tiles * ceil_div(n, tile.block_n)
        return KernelLaunch(
            mma_name(dtype, tile, gated),
            (grid, 1, 1),
            (tile.threads, 1, 1),
            tile.shared_memory_bytes(gated),
            arrays + scalars + (np.int32(num_m_tiles),),
        )
    raise ValueError(f"path={path!r}: expected 'simt' or 'mma'")


def gemm_scalars(numel: int, top_k: int, n: int, k: int, *shape, block_size: int, activation: str, apply_router_weight):
    """The int32 scalars every quantized grouped GEMM kernel takes, in its order: numel, top_k, n,
    k, then the format's own ``shape`` values, block_size, the activation code, apply_router_weight."""
    return tuple(
        np.int32(v)
        for v in (numel, top_k, n, k, *shape, block_size, ACTIVATIONS[activation], bool(apply_router_weight))
    )


def pick_tile(tiles: dict, heights: tuple, block_size: int, gated: bool):
    """The tile of ``tiles`` ((tile_m, gated) -> tile) whose height is the tallest of ``heights``
    dividing ``block_size``."""
    return tiles[(next(h for h in heights if block_size % h == 0), gated)]


def plan_tiled_gemm(path: str, block_size: int, sorted_token_ids, n: int, args: tuple, simt_name, mma) -> KernelLaunch:
    """Launch of a grouped GEMM over ``len(sorted_token_ids)`` block-padded rows whose grid is
    (row tiles, column tiles): ``path="simt"`` takes the SIMT tile that divides ``block_size``
    and ``simt_name(tile_m)``; ``path="mma"`` calls ``mma()`` for (name, tile, dynamic shared
    memory bytes), where it may refuse the problem with a ValueError."""
    rows = int(sorted_token_ids.shape[0])
    if path == "simt":
        tile_m = simt_tile_height(block_size)
        return KernelLaunch(
            simt_name(tile_m), (rows // tile_m, ceil_div(n, SIMT_BLOCK_N), 1), (SIMT_THREADS, 1, 1), 0, args
        )
    if path == "mma":
        name, tile, shared_memory = mma()
        return KernelLaunch(
            name, (rows // tile.tile_m, ceil_div(n, tile.block_n), 1), (tile.threads, 1, 1), shared_memory, args
        )
    raise ValueError(f"path={path!r}: expected 'simt' or 'mma'")


def plan_sum_topk(
    *, dtype: str, expert_out, topk_ids, out, num_tokens: int, top_k: int, hidden_size: int, num_experts: int
) -> KernelLaunch:
    """Launch of ``out[t] = sum of expert_out[t*top_k + k] over slots with a valid id``."""
    return KernelLaunch(
        sum_name(dtype),
        (num_tokens, 1, 1),
        (SUM_THREADS, 1, 1),
        0,
        (expert_out, topk_ids, out, np.int32(top_k), np.int32(hidden_size), np.int32(num_experts)),
    )
