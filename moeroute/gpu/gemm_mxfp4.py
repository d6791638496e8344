"""MXFP4 (w4a16) routed experts on a GPU: kernels/moe_gemm_mxfp4.cu launched with CuPy.

    align_block_size(topk_ids)                 expert-sorted, block-padded (token, slot) indices
    gate_up MXFP4 GEMM (+ bias), act * up      intermediate [T*K, I] (input dtype)
    down MXFP4 GEMM (+ bias, x router weight)  expert_out [T*K, H]
    sum over each token's slots                out [T, H]

Weights stay packed: blocks uint8 [E, rows, cols/32, 16] and scale bytes uint8 [E, rows, cols/32]
(`moeroute.quant.mxfp4`), decoded in registers by the kernels; activations are not quantized.
The planning functions are pure Python: the same plans run on a GPU (``CupyMxfp4Backend``) and
on the host emulation of the kernels (tests/gpu).
"""

from __future__ import annotations

import numpy as np

from moeroute.gpu import driver as D
from moeroute.gpu import launch as L

KERNEL_FILE = "moe_gemm_mxfp4"  # kernels/moe_gemm_mxfp4.cu, kernels/moe_gemm_mxfp4.hip

BLOCK_VALUES = 32  # kMxfp4BlockValues: values per scale byte
BLOCK_BYTES = 16  # kMxfp4BlockBytes: packed bytes per block
MMA_DTYPES = D.NARROW_MMA_DTYPES
MMA_POINTER_ALIGNMENT = D.NARROW_MMA_POINTER_ALIGNMENT
# Mirrors of moe_gemm_mxfp4.cu: k values per pipeline stage, and the shared-memory row pitches
# of a stage (A in 16-bit values, B in packed bytes).
MMA_SLICE_K = 64  # kMxfp4SliceK
MMA_A_PITCH = MMA_SLICE_K + 8  # kMxfp4APitch
MMA_B_PITCH = MMA_SLICE_K // 2 + 16  # kMxfp4BPitch
MMA_STAGES = 4  # three k slices in flight while one is consumed


class Mxfp4MmaTile:
    """One moe_gemm_mxfp4_mma instantiation: tile_m x block_n outputs per gate, warps_m x warps_n
    warps, ``stages`` k slices in the cp.async pipeline, ``min_blocks`` resident blocks per
    multiprocessor asked of ptxas."""

    def __init__(self, tile_m, block_n, warps_m, warps_n, stages=MMA_STAGES, min_blocks=2):
        self.tile_m, self.block_n, self.warps_m, self.warps_n, self.stages, self.min_blocks = (
            tile_m,
            block_n,
            warps_m,
            warps_n,
            stages,
            min_blocks,
        )

    @property
    def threads(self) -> int:
        return self.warps_m * self.warps_n * 32

    def shared_memory_bytes(self, gated: bool, k: int) -> int:
        """Dynamic shared memory: the pipeline's stages, then the tile's scale bytes (all of k)."""
        rows = (2 if gated else 1) * self.block_n
        stage = self.tile_m * MMA_A_PITCH * 2 + rows * MMA_B_PITCH
        return self.stages * stage + rows * (k // BLOCK_VALUES)


# (tile_m, gated) -> tile, sm_80 and sm_90. Each thread holds at most 32 float32 accumulators
# plus as many partial sums of the current 32-column scale block. The 64-row tiles (eight warps)
# ask for one resident block: capped at 128 registers for two, ptxas spilled both.
MMA_TILES = {
    (16, False): Mxfp4MmaTile(16, 64, 1, 4),
    (16, True): Mxfp4MmaTile(16, 64, 1, 4),
    (64, False): Mxfp4MmaTile(64, 64, 2, 4, min_blocks=1),
    (64, True): Mxfp4MmaTile(64, 64, 2, 4, min_blocks=1),
}
MMA_TILE_HEIGHTS = (64, 16)  # tallest first: the widest tile that divides block_size wins


def check_mma_dtype(dtype: str) -> None:
    """ValueError unless ``dtype`` is one the narrow-weight mma kernels take (float16, bfloat16)."""
    if dtype not in MMA_DTYPES:
        raise ValueError(f"path='mma' needs float16 or bfloat16 activations, got {dtype}")


def simt_name(dtype: str, tile_m: int, gated: bool) -> str:
    return f"moe_gemm_mxfp4_simt<{L.KERNEL_TYPE_NAMES[dtype]}, {tile_m}, {int(gated)}>"


def mma_name(dtype: str, tile: Mxfp4MmaTile, gated: bool) -> str:
    return (
        f"moe_gemm_mxfp4_mma<{L.KERNEL_TYPE_NAMES[dtype]}, {tile.tile_m}, {tile.block_n}, {tile.warps_m}, "
        f"{tile.warps_n}, {tile.stages}, {tile.min_blocks}, {int(gated)}>"
    )


def shipped_name_expressions(platform: str = "cuda", compute_capability=None) -> list:
    """Every instantiation of moe_gemm_mxfp4.cu the launcher can ask for on ``platform``
    ("cuda": with the sm_80+ mma kernels for float16 / bfloat16, unless ``compute_capability``
    is below 80; "hip": SIMT only)."""
    if platform not in ("cuda", "hip"):
        raise ValueError(f"platform={platform!r}: expected 'cuda' or 'hip'")
    with_mma = platform == "cuda" and (compute_capability is None or compute_capability >= L.MMA_MIN_COMPUTE_CAPABILITY)
    names = []
    for dtype in L.DTYPES:
        names.append(L.sum_name(dtype))
        for tile_m in L.SIMT_TILE_HEIGHTS:
            for gated in (True, False):
                names.append(simt_name(dtype, tile_m, gated))
        if with_mma and dtype in MMA_DTYPES:
            for (_, gated), tile in MMA_TILES.items():
                names.append(mma_name(dtype, tile, gated))
    return names


def plan_mxfp4_gemm(
    *,
    path: str,
    dtype: str,
    gated: bool,
    block_size: int,
    a,
    blocks,
    scales,
    c,
    sorted_token_ids,
    expert_ids,
    topk_weights,
    numel: int,
    top_k: int,
    n: int,
    k: int,
    bias=None,
    activation: str = "silu",
    apply_router_weight: bool = False,
) -> L.KernelLaunch:
    """Launch of one MXFP4 grouped GEMM over ``len(sorted_token_ids)`` block-padded rows.

    a: [rows of A, k] of ``dtype``; blocks uint8 [E, GATES * n, k / 32, 16], scales uint8
    [E, GATES * n, k / 32]; c: [numel, n] of ``dtype``; bias float32 [E, GATES * n] or None.
    """
    # Without a bias the kernel never reads the pointer: topk_weights (float32) fills the slot.
    args = (a, blocks, scales, c, sorted_token_ids, expert_ids, topk_weights, topk_weights if bias is None else bias)
    args += L.gemm_scalars(
        numel, top_k, n, k, block_size=block_size, activation=activation, apply_router_weight=apply_router_weight
    ) + (np.int32(bias is not None),)

    def mma():
        check_mma_dtype(dtype)
        tile = L.pick_tile(MMA_TILES, MMA_TILE_HEIGHTS, block_size, gated)
        return mma_name(dtype, tile, gated), tile, tile.shared_memory_bytes(gated, k)

    return L.plan_tiled_gemm(
        path, block_size, sorted_token_ids, n, args, lambda tile_m: simt_name(dtype, tile_m, gated), mma
    )


_shape = D.shape


def check_mxfp4_experts_args(
    hidden_states,
    gate_up_blocks,
    gate_up_scales,
    down_blocks,
    down_scales,
    topk_weights,
    topk_ids,
    gate_up_bias=None,
    down_bias=None,
):
    """Shapes of an MXFP4 fused_experts call: returns (T, H, I, E, K) or raises ValueError
    naming the argument."""
    if len(_shape(hidden_states)) != 2:
        raise ValueError(f"hidden_states must be [T, H], got shape {_shape(hidden_states)}")
    T, H = _shape(hidden_states)
    if H % BLOCK_VALUES:
        raise ValueError(f"hidden size {H} is not a multiple of {BLOCK_VALUES}, which MXFP4 needs")
    gate_up = _shape(gate_up_blocks)
    if len(gate_up) != 4 or gate_up[1] % 2 or gate_up[2:] != (H // BLOCK_VALUES, BLOCK_BYTES):
        raise ValueError(
            f"w_gate_up blocks have shape {gate_up}; expected [num_experts, 2 * I, {H // BLOCK_VALUES}, {BLOCK_BYTES}]"
        )
    E, two_I = gate_up[:2]
    I = two_I // 2
    if I % BLOCK_VALUES:
        raise ValueError(f"intermediate size {I} is not a multiple of {BLOCK_VALUES}, which MXFP4 needs")
    if _shape(gate_up_scales) != gate_up[:3]:
        raise ValueError(f"w_gate_up scales have shape {_shape(gate_up_scales)}; expected {list(gate_up[:3])}")
    down = (E, H, I // BLOCK_VALUES, BLOCK_BYTES)
    if _shape(down_blocks) != down:
        raise ValueError(f"w_down blocks have shape {_shape(down_blocks)}; expected {list(down)}")
    if _shape(down_scales) != down[:3]:
        raise ValueError(f"w_down scales have shape {_shape(down_scales)}; expected {list(down[:3])}")
    K = D.check_routing(topk_weights, topk_ids, T)
    if gate_up_bias is not None and _shape(gate_up_bias) != (E, 2 * I):
        raise ValueError(f"gate_up_bias has shape {_shape(gate_up_bias)}; expected {[E, 2 * I]}")
    if down_bias is not None and _shape(down_bias) != (E, H):
        raise ValueError(f"down_bias has shape {_shape(down_bias)}; expected {[E, H]}")
    D.check_kernel_limits(T, K, E, H, I)
    return T, H, I, E, K


def run_mxfp4_experts(
    backend,
    dtype: str,
    hidden_states,
    gate_up_blocks,
    gate_up_scales,
    down_blocks,
    down_scales,
    topk_weights,
    topk_ids,
    out,
    *,
    gate_up_bias=None,
    down_bias=None,
    activation: str = "silu",
    apply_router_weight: bool = True,
    align_block=None,
    path=None,
):
    """Enqueue the MXFP4 expert MLPs on ``backend`` (arrays in its framework: blocks and scales
    uint8, biases float32 or None, hidden_states and out of ``dtype``) and return ``out``.

    ``backend`` provides ``empty(shape, dtype_name)``, ``launch(plan)``, ``align_block_size``,
    ``pointer``, ``compute_capability`` and ``is_hip``; ``path`` is "mma", "simt" or None (mma
    for float16 / bfloat16 on sm_80+ CUDA with 16-byte aligned activations and blocks, else simt).
    """
    D.check_activation(activation)
    sizes = check_mxfp4_experts_args(
        hidden_states,
        gate_up_blocks,
        gate_up_scales,
        down_blocks,
        down_scales,
        topk_weights,
        topk_ids,
        gate_up_bias,
        down_bias,
    )

    choose_path = D.narrow_path_chooser(backend, dtype, hidden_states, gate_up_blocks, down_blocks)

    return D.run_expert_mlp(
        backend,
        plan_mxfp4_gemm,
        *(dtype, sizes, hidden_states, topk_weights, topk_ids, out),
        gate_up=dict(blocks=gate_up_blocks, scales=gate_up_scales, bias=gate_up_bias),
        down=dict(blocks=down_blocks, scales=down_scales, bias=down_bias),
        activation=activation,
        apply_router_weight=apply_router_weight,
        align_block=align_block,
        path=path,
        choose_path=choose_path,
    )


class CupyMxfp4Backend(D.CupyBackend):
    """The backend of ``run_mxfp4_experts`` on the current CuPy device and stream."""

    kernel_file = KERNEL_FILE


def _pair(name: str, pair):
    import torch

    if isinstance(pair, torch.Tensor) or not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise TypeError(
            f"{name} must be a (blocks, scales) pair of uint8 tensors with quant='mxfp4', got {type(pair).__name__}"
        )
    return pair


def fused_experts_mxfp4(
    hidden_states,
    w_gate_up,
    w_down,
    topk_weights,
    topk_ids,
    *,
    gate_up_bias=None,
    down_bias=None,
    activation: str = "silu",
    apply_router_weight: bool = True,
    path=None,
):
    """Routed MXFP4 expert MLPs on torch CUDA tensors: ``out[t] = sum_k w[t,k] * expert(x_t)`` with
    each weight ``e2m1[nibble] * 2 ** (scale - 127)`` decoded in the kernels.

    hidden_states [T, H] float32 / float16 / bfloat16; w_gate_up = (blocks uint8 [E, 2I, H/32, 16],
    scales uint8 [E, 2I, H/32]) gate rows first; w_down = (blocks [E, H, I/32, 16], scales
    [E, H, I/32]); gate_up_bias [E, 2I] and down_bias [E, H] of any float dtype (added in
    float32), optional; topk_weights [T, K] float32; topk_ids [T, K] int32 (ids outside [0, E)
    contribute nothing). Scale bytes are not checked here (a scale byte 255 gives NaN; the
    loaders refuse it). Returns [T, H] in the dtype of hidden_states, enqueued on torch's
    current stream.
    """
    import torch

    gate_up_blocks, gate_up_scales = _pair("w_gate_up", w_gate_up)
    down_blocks, down_scales = _pair("w_down", w_down)
    floats = (torch.float32, torch.float16, torch.bfloat16)
    named = [
        ("hidden_states", hidden_states, floats),
        ("w_gate_up blocks", gate_up_blocks, (torch.uint8,)),
        ("w_gate_up scales", gate_up_scales, (torch.uint8,)),
        ("w_down blocks", down_blocks, (torch.uint8,)),
        ("w_down scales", down_scales, (torch.uint8,)),
        ("topk_weights", topk_weights, (torch.float32,)),
        ("topk_ids", topk_ids, (torch.int32,)),
    ]
    named += [
        (name, bias, floats)
        for name, bias in (("gate_up_bias", gate_up_bias), ("down_bias", down_bias))
        if bias is not None
    ]
    D.check_torch_dtypes(named, "'mxfp4'")
    check_mxfp4_experts_args(
        hidden_states,
        gate_up_blocks,
        gate_up_scales,
        down_blocks,
        down_scales,
        topk_weights,
        topk_ids,
        gate_up_bias,
        down_bias,
    )
    D.check_torch_placement(named, hidden_states.device)
    device = hidden_states.device
    dtype = str(hidden_states.dtype).removeprefix("torch.")
    biases = [None if b is None else b.to(torch.float32).contiguous() for b in (gate_up_bias, down_bias)]

    out = torch.empty(hidden_states.shape, dtype=hidden_states.dtype, device=device)
    with D.torch_stream(device) as allocate:
        arrays = [
            D.torch_as_cupy(t)
            for t in (hidden_states, gate_up_blocks, gate_up_scales, down_blocks, down_scales, topk_weights, topk_ids)
        ]
        gate_up_b, down_b = (None if b is None else D.torch_as_cupy(b) for b in biases)
        run_mxfp4_experts(
            CupyMxfp4Backend(allocate, align_template=topk_ids),
            dtype,
            *arrays,
            D.torch_as_cupy(out),
            gate_up_bias=gate_up_b,
            down_bias=down_b,
            activation=activation,
            apply_router_weight=apply_router_weight,
            path=path,
        )
    return out
