"""FP8 (w8a8) routed experts on a GPU: kernels/moe_gemm_fp8.cu launched with CuPy.

    quantize hidden states per token group     q_x [T, H] e4m3, s_x [T, ceil(H/bk)]
    gate_up FP8 GEMM + act(gate) * up          intermediate [T*K, I] (input dtype)
    quantize the intermediate per group        q_i [T*K, I], s_i [T*K, ceil(I/bk)]
    down FP8 GEMM (x router weight)            expert_out [T*K, H]
    sum over each token's slots                out [T, H]

The numerics are docs/quant.md's (moeroute.quant.reference): fp8_block uses groups of the
weight's bk columns and its (bn, bk) scale blocks; fp8_tensor one group per row and one
weight scale per expert and projection (the same kernels with bn = n, bk = k). The planning
functions are pure Python: the same plans run on a GPU (``CupyFp8Backend``) and on the host
emulation of the kernels (tests/gpu).
"""

from __future__ import annotations

import numpy as np

from moeroute.gpu import driver as D
from moeroute.gpu import launch as L
from moeroute.gpu.gemm_mxfp4 import MMA_A_PITCH, MMA_DTYPES, MMA_SLICE_K, MMA_TILE_HEIGHTS
from moeroute.gpu.gemm_mxfp4 import MMA_TILES as NARROW_MMA_TILES
from moeroute.gpu.gemm_mxfp4 import Mxfp4MmaTile, check_mma_dtype

KERNEL_FILE = "moe_gemm_fp8"  # kernels/moe_gemm_fp8.cu, kernels/moe_gemm_fp8.hip

QUANT_THREADS = 128  # kQuantThreads
FP8_MMA_MIN_COMPUTE_CAPABILITY = 89  # mma.sync m16n8k32 e4m3 arrived with sm_89 (Ada)
FORMATS = ("fp8_block", "fp8_tensor")
# w8a16 mma (moe_gemm_fp8w16_mma): MXFP4's pipeline and tiles with one e4m3 byte per value; B
# rows of a stage are 64 bytes + 16 (NarrowBPitch<1>), scales applied per 32 columns.
W8A16_MMA_B_PITCH = MMA_SLICE_K + 16
W8A16_MMA_COLUMNS = 32  # kNarrowBlockValues: k, bk (and so each scale group) in whole blocks of it


class Fp8MmaTile:
    """One moe_gemm_fp8_mma instantiation: tile_m x block_n outputs per gate, warps_m x warps_n
    warps, ``min_blocks`` resident blocks per multiprocessor asked of ptxas."""

    def __init__(self, tile_m, block_n, warps_m, warps_n, min_blocks=2):
        self.tile_m, self.block_n, self.warps_m, self.warps_n, self.min_blocks = (
            tile_m,
            block_n,
            warps_m,
            warps_n,
            min_blocks,
        )

    @property
    def threads(self) -> int:
        return self.warps_m * self.warps_n * 32


# (tile_m, gated) -> tile, for sm_89 / sm_90. Eight warps on 64 rows: each thread holds 16
# float32 accumulators per gate plus as many partial sums of the current k group. The gated
# 64-row tile (64 of each) asks for one resident block: capped at 128 registers for two, ptxas
# spilled it.
FP8_MMA_TILES = {
    (16, False): Fp8MmaTile(16, 64, 1, 4),
    (16, True): Fp8MmaTile(16, 64, 1, 4),
    (64, False): Fp8MmaTile(64, 64, 2, 4),
    (64, True): Fp8MmaTile(64, 64, 2, 4, min_blocks=1),
}
FP8_MMA_TILE_HEIGHTS = (64, 16)


def quantize_name(dtype: str) -> str:
    return f"fp8_quantize_groups<{L.KERNEL_TYPE_NAMES[dtype]}>"


def quantize_static_name(dtype: str) -> str:
    return f"fp8_quantize_static<{L.KERNEL_TYPE_NAMES[dtype]}>"


def simt_name(dtype: str, tile_m: int, gated: bool) -> str:
    return f"moe_gemm_fp8_simt<{L.KERNEL_TYPE_NAMES[dtype]}, {tile_m}, {int(gated)}>"


def w8a16_simt_name(dtype: str, tile_m: int, gated: bool) -> str:
    return f"moe_gemm_fp8w16_simt<{L.KERNEL_TYPE_NAMES[dtype]}, {tile_m}, {int(gated)}>"


def w8a16_mma_name(dtype: str, tile: Mxfp4MmaTile, gated: bool) -> str:
    return (
        f"moe_gemm_fp8w16_mma<{L.KERNEL_TYPE_NAMES[dtype]}, {tile.tile_m}, {tile.block_n}, {tile.warps_m}, "
        f"{tile.warps_n}, {tile.stages}, {tile.min_blocks}, {int(gated)}>"
    )


def w8a16_shared_memory_bytes(tile: Mxfp4MmaTile, gated: bool) -> int:
    """Dynamic shared memory of moe_gemm_fp8w16_mma: the pipeline's stages, nothing after."""
    rows = (2 if gated else 1) * tile.block_n
    return tile.stages * (tile.tile_m * MMA_A_PITCH * 2 + rows * W8A16_MMA_B_PITCH)


def mma_name(dtype: str, tile: Fp8MmaTile, gated: bool) -> str:
    return (
        f"moe_gemm_fp8_mma<{L.KERNEL_TYPE_NAMES[dtype]}, {tile.tile_m}, {tile.block_n}, {tile.warps_m}, "
        f"{tile.warps_n}, {tile.min_blocks}, {int(gated)}>"
    )


def shipped_name_expressions(platform: str = "cuda", compute_capability=None) -> list:
    """Every instantiation of moe_gemm_fp8.cu the launcher can ask for on ``platform``
    ("cuda": with the sm_89+ w8a8 mma kernels, unless ``compute_capability`` is below 89, where
    they do not exist, and the sm_80+ w8a16 mma kernels for float16 / bfloat16; "hip": SIMT
    only)."""
    if platform not in ("cuda", "hip"):
        raise ValueError(f"platform={platform!r}: expected 'cuda' or 'hip'")
    with_mma = platform == "cuda" and (
        compute_capability is None or compute_capability >= FP8_MMA_MIN_COMPUTE_CAPABILITY
    )
    with_w8a16_mma = platform == "cuda" and (
        compute_capability is None or compute_capability >= L.MMA_MIN_COMPUTE_CAPABILITY
    )
    names = []
    for dtype in L.DTYPES:
        names += [quantize_name(dtype), quantize_static_name(dtype)]
        names.append(L.sum_name(dtype))
        for tile_m in L.SIMT_TILE_HEIGHTS:
            for gated in (True, False):
                names.append(simt_name(dtype, tile_m, gated))
                names.append(w8a16_simt_name(dtype, tile_m, gated))
        if with_mma:
            for (_, gated), tile in FP8_MMA_TILES.items():
                names.append(mma_name(dtype, tile, gated))
        if with_w8a16_mma and dtype in MMA_DTYPES:
            for (_, gated), tile in NARROW_MMA_TILES.items():
                names.append(w8a16_mma_name(dtype, tile, gated))
    return names


def plan_quantize(
    *, dtype: str, x, q, scales, rows: int, cols: int, group_size: int, ue8m0: bool = False
) -> L.KernelLaunch:
    """Launch quantizing ``x [rows, cols]`` of ``dtype`` into ``q`` (uint8 e4m3 bits) and
    ``scales [rows, ceil(cols / group_size)]`` float32."""
    return L.KernelLaunch(
        quantize_name(dtype),
        (rows, 1, 1),
        (QUANT_THREADS, 1, 1),
        0,
        (x, q, scales, np.int32(cols), np.int32(group_size), np.int32(bool(ue8m0))),
    )


def plan_quantize_static(
    *,
    dtype: str,
    x,
    q,
    scales,
    topk_ids,
    input_scale,
    rows: int,
    cols: int,
    row_divisor: int,
    which: int,
    num_experts: int,
) -> L.KernelLaunch:
    """Launch quantizing, for each slot j < rows, row j // row_divisor of ``x`` with the given
    scale ``input_scale[topk_ids[j], which]`` ([E, 2] float32: gate_up input, down input) into
    row j of ``q`` [rows, cols]; ``scales [rows]`` receives the scale."""
    return L.KernelLaunch(
        quantize_static_name(dtype),
        (rows, 1, 1),
        (QUANT_THREADS, 1, 1),
        0,
        (
            x,
            q,
            scales,
            topk_ids,
            input_scale,
            np.int32(cols),
            np.int32(row_divisor),
            np.int32(2),
            np.int32(which),
            np.int32(num_experts),
        ),
    )


def plan_fp8_gemm(
    *,
    path: str,
    dtype: str,
    gated: bool,
    block_size: int,
    a,
    a_scale,
    b,
    b_scale,
    c,
    sorted_token_ids,
    expert_ids,
    topk_weights,
    numel: int,
    top_k: int,
    n: int,
    k: int,
    bn: int,
    bk: int,
    activation: str = "silu",
    apply_router_weight: bool = False,
) -> L.KernelLaunch:
    """Launch of one FP8 grouped GEMM over ``len(sorted_token_ids)`` block-padded rows.

    a: e4m3 bits [rows, k] with a_scale [rows, ceil(k / bk)]; b: [E, GATES * n, k] with
    b_scale [E, GATES * ceil(n / bn), ceil(k / bk)]; c: [numel, n] of ``dtype``. Per-tensor
    FP8: bn = n, bk = k.
    """
    args = (a, a_scale, b, b_scale, c, sorted_token_ids, expert_ids, topk_weights) + L.gemm_scalars(
        numel,
        top_k,
        n,
        k,
        bn,
        bk,
        block_size=block_size,
        activation=activation,
        apply_router_weight=apply_router_weight,
    )

    def mma():
        tile = L.pick_tile(FP8_MMA_TILES, FP8_MMA_TILE_HEIGHTS, block_size, gated)
        return mma_name(dtype, tile, gated), tile, 0

    return L.plan_tiled_gemm(
        path, block_size, sorted_token_ids, n, args, lambda tile_m: simt_name(dtype, tile_m, gated), mma
    )


def plan_fp8_w8a16_gemm(
    *,
    path: str = "simt",
    dtype: str,
    gated: bool,
    block_size: int,
    a,
    b,
    b_scale,
    c,
    sorted_token_ids,
    expert_ids,
    topk_weights,
    numel: int,
    top_k: int,
    n: int,
    k: int,
    bn: int,
    bk: int,
    activation: str = "silu",
    apply_router_weight: bool = False,
) -> L.KernelLaunch:
    """Launch of one w8a16 FP8 grouped GEMM (moe_gemm_fp8w16_simt, or moe_gemm_fp8w16_mma with
    ``path="mma"``: float16 / bfloat16, k and bk multiples of 32): ``a`` [rows, k] of ``dtype``
    (not quantized), ``b`` and ``b_scale`` as plan_fp8_gemm's, c: [numel, n] of ``dtype``."""
    args = (a, b, b_scale, c, sorted_token_ids, expert_ids, topk_weights) + L.gemm_scalars(
        numel,
        top_k,
        n,
        k,
        bn,
        bk,
        block_size=block_size,
        activation=activation,
        apply_router_weight=apply_router_weight,
    )

    def mma():
        check_mma_dtype(dtype)
        if k % W8A16_MMA_COLUMNS or bk % W8A16_MMA_COLUMNS:
            raise ValueError(
                f"path='mma' needs k ({k}) and the scale block's bk ({bk}) to be multiples of {W8A16_MMA_COLUMNS}"
            )
        tile = L.pick_tile(NARROW_MMA_TILES, MMA_TILE_HEIGHTS, block_size, gated)
        return w8a16_mma_name(dtype, tile, gated), tile, w8a16_shared_memory_bytes(tile, gated)

    return L.plan_tiled_gemm(
        path, block_size, sorted_token_ids, n, args, lambda tile_m: w8a16_simt_name(dtype, tile_m, gated), mma
    )


_shape = D.shape


def check_fp8_experts_args(
    hidden_states,
    w_gate_up,
    gate_up_scale,
    w_down,
    down_scale,
    topk_weights,
    topk_ids,
    *,
    format: str,
    block_size=(128, 128),
):
    """Shapes of an FP8 fused_experts call: returns (T, H, I, E, K, (bn_gate_up, bk_gate_up),
    (bn_down, bk_down)) or raises ValueError naming the argument."""
    if format not in FORMATS:
        raise ValueError(f"format={format!r}; expected one of {list(FORMATS)}")
    if len(_shape(hidden_states)) != 2:
        raise ValueError(f"hidden_states must be [T, H], got shape {_shape(hidden_states)}")
    T, H = _shape(hidden_states)
    if len(_shape(w_gate_up)) != 3 or _shape(w_gate_up)[1] % 2 or _shape(w_gate_up)[2] != H:
        raise ValueError(f"w_gate_up has shape {_shape(w_gate_up)}; expected [num_experts, 2 * I, {H}]")
    E, two_I, _ = _shape(w_gate_up)
    I = two_I // 2
    if _shape(w_down) != (E, H, I):
        raise ValueError(f"w_down has shape {_shape(w_down)}; expected {[E, H, I]}")
    K = D.check_routing(topk_weights, topk_ids, T)
    D.check_kernel_limits(T, K, E, H, I)
    if format == "fp8_block":
        bn, bk = (int(v) for v in block_size)
        if bn < 1 or bk < 1:
            raise ValueError(f"block_size={tuple(block_size)} must be two positive integers (bn, bk)")
        expected_gu = (E, 2 * L.ceil_div(I, bn), L.ceil_div(H, bk))
        expected_d = (E, L.ceil_div(H, bn), L.ceil_div(I, bk))
        gate_up_tile, down_tile = (bn, bk), (bn, bk)
    else:
        expected_gu, expected_d = (E, 2), (E,)
        gate_up_tile, down_tile = (I, H), (H, I)
    if _shape(gate_up_scale) != expected_gu:
        raise ValueError(f"gate_up_scale has shape {_shape(gate_up_scale)}; expected {list(expected_gu)} for {format}")
    if _shape(down_scale) != expected_d:
        raise ValueError(f"down_scale has shape {_shape(down_scale)}; expected {list(expected_d)} for {format}")
    return T, H, I, E, K, gate_up_tile, down_tile


def run_fp8_experts(
    backend,
    dtype: str,
    hidden_states,
    w_gate_up,
    gate_up_scale,
    w_down,
    down_scale,
    topk_weights,
    topk_ids,
    out,
    *,
    format: str,
    block_size=(128, 128),
    scale_fmt: str = "float",
    activation: str = "silu",
    apply_router_weight: bool = True,
    align_block=None,
    path=None,
    input_scale=None,
    w8a16: bool = False,
):
    """Enqueue the FP8 expert MLPs on ``backend`` (arrays in its framework: e4m3 weights as
    uint8 bits, scales float32, hidden_states and out of ``dtype``) and return ``out``.

    ``input_scale`` (fp8_tensor only): [E, 2] float32 static activation scales (gate_up input,
    down input) instead of dynamic per-token ones; each slot's rows are then quantized with
    its expert's scale.

    ``w8a16``: the activations are not quantized (QuantConfig activation="none"):
    moe_gemm_fp8w16_simt decodes the weights to float32 (e4m3 * s) in its tiles;
    moe_gemm_fp8w16_mma (float16 / bfloat16 on sm_80+, H, I and bk multiples of 32, 16-byte
    aligned activations and weights: what None picks there) decodes e4m3 to 16-bit values in
    registers and applies the scales per 32 columns. ``scale_fmt`` is not used (the weight
    scales are as stored).

    ``backend`` provides ``empty(shape, dtype_name)`` (including "uint8"), ``launch(plan)``,
    ``align_block_size``, ``compute_capability`` and ``is_hip``; ``path`` is "mma", "simt" or
    None (mma on sm_89+ CUDA, else simt).
    """
    if scale_fmt not in ("float", "ue8m0"):
        raise ValueError(f"scale_fmt={scale_fmt!r}; expected 'float' or 'ue8m0'")
    D.check_activation(activation)
    T, H, I, E, K, (bn_gu, bk_gu), (bn_d, bk_d) = check_fp8_experts_args(
        hidden_states,
        w_gate_up,
        gate_up_scale,
        w_down,
        down_scale,
        topk_weights,
        topk_ids,
        format=format,
        block_size=block_size,
    )
    if input_scale is not None:
        if format != "fp8_tensor":
            raise ValueError(f"input_scale (static activation scales) needs format='fp8_tensor', got {format!r}")
        if _shape(input_scale) != (E, 2):
            raise ValueError(f"input_scale has shape {_shape(input_scale)}; expected {[E, 2]} (gate_up, down)")
    if w8a16 and input_scale is not None:
        raise ValueError("input_scale (static activation scales) does not apply to w8a16 (activations not quantized)")
    problem = (dtype, (T, H, I, E, K), hidden_states, topk_weights, topk_ids, out)
    run = dict(
        gate_up=dict(b=w_gate_up, b_scale=gate_up_scale, bn=bn_gu, bk=bk_gu),
        down=dict(b=w_down, b_scale=down_scale, bn=bn_d, bk=bk_d),
        activation=activation,
        apply_router_weight=apply_router_weight,
        align_block=align_block,
        path=path,
    )
    if w8a16:
        columns = all(v % W8A16_MMA_COLUMNS == 0 for v in (H, I, bk_gu, bk_d))
        choose_w8a16_path = D.narrow_path_chooser(backend, dtype, hidden_states, w_gate_up, w_down, eligible=columns)
        return D.run_expert_mlp(backend, plan_fp8_w8a16_gemm, *problem, choose_path=choose_w8a16_path, **run)

    def choose_path(intermediate):
        sm89 = not backend.is_hip and backend.compute_capability >= FP8_MMA_MIN_COMPUTE_CAPABILITY
        return "mma" if sm89 else "simt"

    numel = T * K
    ue8m0 = scale_fmt == "ue8m0"
    flat_ids = topk_ids.reshape(-1)

    def quantize(x, rows, cols, group_size, row_divisor, which):
        """A operand of one FP8 GEMM: ``x`` [rows / row_divisor, cols] quantized per group of
        ``group_size`` columns, or per slot with the static ``input_scale`` column ``which``."""
        q = backend.empty((rows, cols), "uint8")
        if input_scale is None:
            scales = backend.empty((rows, L.ceil_div(cols, group_size)), "float32")
            backend.launch(
                plan_quantize(
                    dtype=dtype, x=x, q=q, scales=scales, rows=rows, cols=cols, group_size=group_size, ue8m0=ue8m0
                )
            )
        else:
            scales = backend.empty((rows, 1), "float32")
            backend.launch(
                plan_quantize_static(
                    dtype=dtype,
                    x=x,
                    q=q,
                    scales=scales,
                    topk_ids=flat_ids,
                    input_scale=input_scale,
                    rows=rows,
                    cols=cols,
                    row_divisor=row_divisor,
                    which=which,
                    num_experts=E,
                )
            )
        return dict(a=q, a_scale=scales)

    def gate_up_input():
        if input_scale is None:
            return dict(quantize(hidden_states, T, H, bk_gu, 1, 0), top_k=K)
        # one quantized row per slot: the scale depends on the slot's expert
        return dict(quantize(hidden_states, numel, H, bk_gu, K, 0), top_k=1)

    def down_input(intermediate):
        return quantize(intermediate, numel, I, bk_d, 1, 1)

    return D.run_expert_mlp(
        backend,
        plan_fp8_gemm,
        *problem,
        choose_path=choose_path,
        gate_up_input=gate_up_input,
        down_input=down_input,
        **run,
    )


class CupyFp8Backend(D.CupyBackend):
    """The backend of ``run_fp8_experts`` on the current CuPy device and stream."""

    kernel_file = KERNEL_FILE


def fused_experts_fp8(
    hidden_states,
    w_gate_up,
    gate_up_scale,
    w_down,
    down_scale,
    topk_weights,
    topk_ids,
    *,
    quant,
    activation: str = "silu",
    apply_router_weight: bool = True,
    path=None,
    input_scale=None,
):
    """Routed FP8 expert MLPs on torch CUDA tensors: ``out[t] = sum_k w[t,k] * expert(x_t)`` with
    the numerics of ``quant`` (a moeroute.quant.QuantConfig): w8a8 with activation="dynamic" or
    "static", w8a16 with activation="none" (activations as they are, weights e4m3 * block scale).

    hidden_states [T, H] float32 / float16 / bfloat16; w_gate_up [E, 2I, H] and w_down [E, H, I]
    torch.float8_e4m3fn; scales float32 as QuantConfig.scale_shapes; topk_weights [T, K]
    float32; topk_ids [T, K] int32 (ids outside [0, E) contribute nothing); input_scale [E, 2]
    float32 (gate_up input, down input), required with fp8_tensor and activation="static".
    Returns [T, H] in the dtype of hidden_states, enqueued on torch's current stream.
    """
    import torch

    from moeroute.quant import QuantConfig

    if not isinstance(quant, QuantConfig):
        raise TypeError(f"quant must be a moeroute.quant.QuantConfig, got {type(quant).__name__}")
    static = quant.activation == "static"
    if static != (input_scale is not None):
        raise ValueError(
            f"input_scale must be given exactly when quant.activation='static' "
            f"(got activation={quant.activation!r}, input_scale={'set' if input_scale is not None else None})"
        )
    named = (
        ("hidden_states", hidden_states, (torch.float32, torch.float16, torch.bfloat16)),
        ("w_gate_up", w_gate_up, (torch.float8_e4m3fn,)),
        ("w_down", w_down, (torch.float8_e4m3fn,)),
        ("gate_up_scale", gate_up_scale, (torch.float32,)),
        ("down_scale", down_scale, (torch.float32,)),
        ("topk_weights", topk_weights, (torch.float32,)),
        ("topk_ids", topk_ids, (torch.int32,)),
    ) + ((("input_scale", input_scale, (torch.float32,)),) if static else ())
    D.check_torch_dtypes(named, repr(quant.format))
    check_fp8_experts_args(
        hidden_states,
        w_gate_up,
        gate_up_scale,
        w_down,
        down_scale,
        topk_weights,
        topk_ids,
        format=quant.format,
        block_size=quant.block_size,
    )
    D.check_torch_placement(named, hidden_states.device)
    device = hidden_states.device
    dtype = str(hidden_states.dtype).removeprefix("torch.")
    out = torch.empty(hidden_states.shape, dtype=hidden_states.dtype, device=device)
    with D.torch_stream(device) as allocate:
        arrays = [
            D.torch_as_cupy(t)
            for t in (
                hidden_states,
                w_gate_up.view(torch.uint8),
                gate_up_scale,
                w_down.view(torch.uint8),
                down_scale,
                topk_weights,
                topk_ids,
            )
        ]
        run_fp8_experts(
            CupyFp8Backend(allocate),
            dtype,
            *arrays,
            D.torch_as_cupy(out),
            format=quant.format,
            block_size=quant.block_size,
            scale_fmt=quant.scale_fmt,
            activation=activation,
            apply_router_weight=apply_router_weight,
            path=path,
            input_scale=D.torch_as_cupy(input_scale) if static else None,
            w8a16=quant.activation == "none",
        )
    return out
