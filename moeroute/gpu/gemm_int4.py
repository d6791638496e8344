"""INT4 (w4a16) routed experts on a GPU: kernels/moe_gemm_int4.cu launched with CuPy.

    align_block_size(topk_ids)                 expert-sorted, block-padded (token, slot) indices
    gate_up INT4 GEMM, act(gate) * up          intermediate [T*K, I] (input dtype)
    down INT4 GEMM (x router weight)           expert_out [T*K, H]
    sum over each token's slots                out [T, H]

Weights stay packed (`moeroute.quant.int4`): packed uint8 [E, rows, cols/2], scales [E, rows,
cols/g] (float32, bfloat16 or float16, as the layer holds them) and zero points uint8 [E, rows,
cols/g] when asymmetric, decoded in registers by the kernels, ``w = (q - z) * s``; activations
are not quantized. The planning functions are pure Python: the same plans run on a GPU
(``CupyInt4Backend``) and on the host emulation of the kernels (tests/gpu).
"""

from __future__ import annotations

from moeroute.gpu import driver as D
from moeroute.gpu import launch as L
from moeroute.gpu.gemm_mxfp4 import MMA_A_PITCH, MMA_B_PITCH, MMA_DTYPES, MMA_TILES
from moeroute.gpu.gemm_mxfp4 import MMA_TILE_HEIGHTS, Mxfp4MmaTile, check_mma_dtype

KERNEL_FILE = "moe_gemm_int4"  # kernels/moe_gemm_int4.cu, kernels/moe_gemm_int4.hip

GROUP_SIZES = (32, 64, 128)  # moeroute.quant.int4's; each a multiple of the kernels' 32-column block
SCALE_DTYPES = ("float32", "bfloat16", "float16")
SYMMETRIC_ZERO = 8  # kInt4SymmetricZero

__all__ = [
    "KERNEL_FILE",
    "GROUP_SIZES",
    "SCALE_DTYPES",
    "simt_name",
    "mma_name",
    "shared_memory_bytes",
    "shipped_name_expressions",
    "plan_int4_gemm",
    "check_int4_experts_args",
    "run_int4_experts",
    "fused_experts_int4",
]


def simt_name(dtype: str, scale_dtype: str, tile_m: int, gated: bool) -> str:
    return (
        f"moe_gemm_int4_simt<{L.KERNEL_TYPE_NAMES[dtype]}, {L.KERNEL_TYPE_NAMES[scale_dtype]}, {tile_m}, {int(gated)}>"
    )


def mma_name(dtype: str, scale_dtype: str, tile: Mxfp4MmaTile, gated: bool) -> str:
    return (
        f"moe_gemm_int4_mma<{L.KERNEL_TYPE_NAMES[dtype]}, {L.KERNEL_TYPE_NAMES[scale_dtype]}, {tile.tile_m}, "
        f"{tile.block_n}, {tile.warps_m}, {tile.warps_n}, {tile.stages}, {tile.min_blocks}, {int(gated)}>"
    )


def shared_memory_bytes(tile: Mxfp4MmaTile, gated: bool, k: int, group_size: int, has_zeros: bool) -> int:
    """Dynamic shared memory of moe_gemm_int4_mma: the pipeline's stages (as MXFP4's: A in 16-bit
    values, B in packed bytes), then the tile's zero points when asymmetric (all of k)."""
    rows = (2 if gated else 1) * tile.block_n
    stage = tile.tile_m * MMA_A_PITCH * 2 + rows * MMA_B_PITCH
    return tile.stages * stage + (rows * (k // group_size) if has_zeros else 0)


def shipped_name_expressions(platform: str = "cuda", compute_capability=None) -> list:
    """Every instantiation of moe_gemm_int4.cu the launcher can ask for on ``platform``
    ("cuda": with the sm_80+ mma kernels for float16 / bfloat16 activations, unless
    ``compute_capability`` is below 80; "hip": SIMT only)."""
    if platform not in ("cuda", "hip"):
        raise ValueError(f"platform={platform!r}: expected 'cuda' or 'hip'")
    with_mma = platform == "cuda" and (compute_capability is None or compute_capability >= L.MMA_MIN_COMPUTE_CAPABILITY)
    names = []
    for dtype in L.DTYPES:
        names.append(L.sum_name(dtype))
        for scale_dtype in SCALE_DTYPES:
            for tile_m in L.SIMT_TILE_HEIGHTS:
                for gated in (True, False):
                    names.append(simt_name(dtype, scale_dtype, tile_m, gated))
            if with_mma and dtype in MMA_DTYPES:
                for (_, gated), tile in MMA_TILES.items():
                    names.append(mma_name(dtype, scale_dtype, tile, gated))
    return names


def plan_int4_gemm(
    *,
    path: str,
    dtype: str,
    scale_dtype: str,
    gated: bool,
    block_size: int,
    a,
    packed,
    scales,
    zeros,
    c,
    sorted_token_ids,
    expert_ids,
    topk_weights,
    numel: int,
    top_k: int,
    n: int,
    k: int,
    group_size: int,
    activation: str = "silu",
    apply_router_weight: bool = False,
) -> L.KernelLaunch:
    """Launch of one INT4 grouped GEMM over ``len(sorted_token_ids)`` block-padded rows.

    a: [rows of A, k] of ``dtype``; packed uint8 [E, GATES * n, k / 2], scales of ``scale_dtype``
    [E, GATES * n, k / group_size], zeros uint8 of the scales' shape or None (symmetric);
    c: [numel, n] of ``dtype``.
    """
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype={scale_dtype!r}; expected one of {SCALE_DTYPES}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size={group_size!r}; expected one of {GROUP_SIZES}")
    has_zeros = zeros is not None
    # Symmetric weights: the kernel never reads the zero points; the packed bytes fill the slot.
    args = (a, packed, scales, zeros if has_zeros else packed, c, sorted_token_ids, expert_ids, topk_weights)
    args += L.gemm_scalars(
        numel,
        top_k,
        n,
        k,
        group_size,
        has_zeros,
        block_size=block_size,
        activation=activation,
        apply_router_weight=apply_router_weight,
    )

    def mma():
        check_mma_dtype(dtype)
        tile = L.pick_tile(MMA_TILES, MMA_TILE_HEIGHTS, block_size, gated)
        return (
            mma_name(dtype, scale_dtype, tile, gated),
            tile,
            shared_memory_bytes(tile, gated, k, group_size, has_zeros),
        )

    return L.plan_tiled_gemm(
        path, block_size, sorted_token_ids, n, args, lambda tile_m: simt_name(dtype, scale_dtype, tile_m, gated), mma
    )


_shape = D.shape


def _parts(name: str, weight) -> tuple:
    """(packed, scales, zeros or None) of a (packed, scales[, zeros]) tuple."""
    if not isinstance(weight, (tuple, list)) or len(weight) not in (2, 3):
        raise TypeError(
            f"{name} must be a (packed, scales) or (packed, scales, zeros) tuple with quant='int4', "
            f"got {type(weight).__name__}"
        )
    packed, scales, *rest = weight
    return packed, scales, (rest[0] if rest else None)


def check_int4_experts_args(hidden_states, gate_up, down, topk_weights, topk_ids, *, group_size: int):
    """Shapes of an INT4 fused_experts call (``gate_up`` / ``down`` as (packed, scales, zeros or
    None)): returns (T, H, I, E, K) or raises ValueError naming the argument."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size={group_size!r}; expected one of {GROUP_SIZES}")
    if len(_shape(hidden_states)) != 2:
        raise ValueError(f"hidden_states must be [T, H], got shape {_shape(hidden_states)}")
    T, H = _shape(hidden_states)
    if H % group_size:
        raise ValueError(f"hidden size {H} is not a multiple of group_size={group_size}")
    packed = _shape(gate_up[0])
    if len(packed) != 3 or packed[1] % 2 or packed[2] != H // 2:
        raise ValueError(f"w_gate_up packed has shape {packed}; expected [num_experts, 2 * I, {H // 2}]")
    E, two_I = packed[:2]
    I = two_I // 2
    if I % group_size:
        raise ValueError(
            f"intermediate size {I} is not a multiple of group_size={group_size}: an expert-parallel slice of "
            f"the intermediate dimension must hold whole groups"
        )
    for label, (p, s, z), shape in (("w_gate_up", gate_up, (E, 2 * I, H)), ("w_down", down, (E, H, I))):
        rows, cols = shape[1], shape[2]
        if _shape(p) != (E, rows, cols // 2):
            raise ValueError(f"{label} packed has shape {_shape(p)}; expected {[E, rows, cols // 2]}")
        groups = (E, rows, cols // group_size)
        if _shape(s) != groups:
            raise ValueError(f"{label} scales has shape {_shape(s)}; expected {list(groups)}")
        if z is not None and _shape(z) != groups:
            raise ValueError(f"{label} zeros has shape {_shape(z)}; expected {list(groups)}")
    if (gate_up[2] is None) != (down[2] is None):
        raise ValueError("w_gate_up and w_down must both have zero points (asymmetric) or neither (symmetric)")
    K = D.check_routing(topk_weights, topk_ids, T)
    D.check_kernel_limits(T, K, E, H, I)
    return T, H, I, E, K


def run_int4_experts(
    backend,
    dtype: str,
    hidden_states,
    gate_up,
    down,
    topk_weights,
    topk_ids,
    out,
    *,
    group_size: int,
    gate_up_scale_dtype: str,
    down_scale_dtype: str,
    activation: str = "silu",
    apply_router_weight: bool = True,
    align_block=None,
    path=None,
):
    """Enqueue the INT4 expert MLPs on ``backend`` (arrays in its framework: ``gate_up`` and
    ``down`` (packed, scales, zeros or None) with scales of the named dtypes, hidden_states and
    out of ``dtype``) and return ``out``.

    ``backend`` provides ``empty(shape, dtype_name)``, ``launch(plan)``, ``align_block_size``,
    ``pointer``, ``compute_capability`` and ``is_hip``; ``path`` is "mma", "simt" or None (mma
    for float16 / bfloat16 on sm_80+ CUDA with 16-byte aligned activations and packed bytes, else
    simt).
    """
    D.check_activation(activation)
    gate_up, down = _parts("w_gate_up", gate_up), _parts("w_down", down)
    sizes = check_int4_experts_args(hidden_states, gate_up, down, topk_weights, topk_ids, group_size=group_size)

    choose_path = D.narrow_path_chooser(backend, dtype, hidden_states, gate_up[0], down[0])

    def weight(parts, scale_dtype):
        return dict(packed=parts[0], scales=parts[1], zeros=parts[2], scale_dtype=scale_dtype)

    return D.run_expert_mlp(
        backend,
        plan_int4_gemm,
        *(dtype, sizes, hidden_states, topk_weights, topk_ids, out),
        gate_up=weight(gate_up, gate_up_scale_dtype),
        down=weight(down, down_scale_dtype),
        activation=activation,
        apply_router_weight=apply_router_weight,
        align_block=align_block,
        path=path,
        choose_path=choose_path,
        plan_args=dict(group_size=group_size),
    )


class CupyInt4Backend(D.CupyBackend):
    """The backend of ``run_int4_experts`` on the current CuPy device and stream."""

    kernel_file = KERNEL_FILE


def fused_experts_int4(
    hidden_states,
    w_gate_up,
    w_down,
    topk_weights,
    topk_ids,
    *,
    group_size: int,
    symmetric=None,
    activation: str = "silu",
    apply_router_weight: bool = True,
    path=None,
):
    """Routed INT4 expert MLPs on torch CUDA tensors: ``out[t] = sum_k w[t,k] * expert(x_t)`` with
    each weight ``(q - z) * s`` decoded in the kernels (z = 8 when symmetric).

    hidden_states [T, H] float32 / float16 / bfloat16; w_gate_up = (packed uint8 [E, 2I, H/2],
    scales [E, 2I, H/g][, zeros uint8 [E, 2I, H/g]]) gate rows first; w_down = (packed [E, H, I/2],
    scales [E, H, I/g][, zeros]); scales float32, bfloat16 or float16; ``group_size`` g one of
    32, 64, 128; ``symmetric`` (optional) must agree with the zero points' absence; topk_weights
    [T, K] float32; topk_ids [T, K] int32 (ids outside [0, E) contribute nothing). Zero points
    are not range-checked here (`moeroute.quant.check_int4` does). Returns [T, H] in the dtype of
    hidden_states, enqueued on torch's current stream.
    """
    import torch

    gate_up, down = _parts("w_gate_up", w_gate_up), _parts("w_down", w_down)
    if symmetric is not None and bool(symmetric) != (gate_up[2] is None):
        raise ValueError(
            f"quant symmetric={symmetric} but the weights {'have no' if gate_up[2] is None else 'have'} zero points"
        )
    floats = (torch.float32, torch.float16, torch.bfloat16)
    named = [
        ("hidden_states", hidden_states, floats),
        ("topk_weights", topk_weights, (torch.float32,)),
        ("topk_ids", topk_ids, (torch.int32,)),
    ]
    for label, (p, s, z) in (("w_gate_up", gate_up), ("w_down", down)):
        named += [(f"{label} packed", p, (torch.uint8,)), (f"{label} scales", s, floats)]
        if z is not None:
            named.append((f"{label} zeros", z, (torch.uint8,)))
    D.check_torch_dtypes(named, "'int4'")
    check_int4_experts_args(hidden_states, gate_up, down, topk_weights, topk_ids, group_size=group_size)
    D.check_torch_placement(named, hidden_states.device)
    device = hidden_states.device
    name_of = lambda t: str(t.dtype).removeprefix("torch.")  # noqa: E731

    def as_cupy(weight):
        return tuple(None if t is None else D.torch_as_cupy(t) for t in weight)

    out = torch.empty(hidden_states.shape, dtype=hidden_states.dtype, device=device)
    with D.torch_stream(device) as allocate:
        run_int4_experts(
            CupyInt4Backend(allocate, align_template=topk_ids),
            name_of(hidden_states),
            D.torch_as_cupy(hidden_states),
            as_cupy(gate_up),
            as_cupy(down),
            D.torch_as_cupy(topk_weights),
            D.torch_as_cupy(topk_ids),
            D.torch_as_cupy(out),
            group_size=group_size,
            gate_up_scale_dtype=name_of(gate_up[1]),
            down_scale_dtype=name_of(down[1]),
            activation=activation,
            apply_router_weight=apply_router_weight,
            path=path,
        )
    return out
