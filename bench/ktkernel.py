"""moeroute's CPU experts side by side with kt-kernel's (KTransformers' CPU MoE kernels).

The three expert shapes of bench/quant.py and bench/quant_mxfp4.py, with their expert
counts and routing (softmax, renormalized top-k, router weights N(0, 0.02)):

* Qwen3-30B-A3B: H = 2048, I = 768, N = 128, K = 8;
* a DeepSeek-V3 expert shape: H = 7168, I = 2048, N = 16, K = 8;
* the gpt-oss-20b expert shape: H = 2880, I = 2880, N = 32, K = 4;
* Kimi-K2's expert shape (DeepSeek-V3's, 384 experts in the model): H = 7168, I = 2048,
  N = 16, K = 8, for INT4 only (`SHAPE_GROUPS`);

at T = 1, 8, 64 and 512 tokens, bfloat16 activations, SiLU-gated experts without biases
(kt-kernel's experts take no biases; the gpt-oss figures are its shape, not its
activation). One set of float32 weights per shape is converted to every format:

* 8 bits: moeroute ``fp8_block`` (128 x 128 block scales, w8a8), kt-kernel's FP8 method
  on the very same e4m3 bytes and scales, and kt-kernel's LLAMAFILE method (the ggml
  kernels of llama.cpp) on GGUF Q8_0;
* 16 bits: moeroute bfloat16 and kt-kernel's BF16 method on the same bfloat16 weights;
* 4 bits: moeroute ``mxfp4`` (w4a16), kt-kernel's MXFP4 method on the same e2m1 bytes and
  scales (the scale bytes widened to the bfloat16 its kernel reads), and LLAMAFILE on
  GGUF Q4_0;
* INT4 (Qwen3-30B-A3B with group 128, GPTQ's usual, and Kimi-K2 with its checkpoint's group
  32): moeroute ``QuantConfig("int4", group_size=g, symmetric=True)`` (w4a16), kt-kernel's
  RAWINT4 method (Kimi-K2's compressed-tensors ``pack-quantized`` layout) on moeroute's very
  packed bytes with the scales in bfloat16 (`int4_to_rawint4`), and its GPTQ_INT4 method on
  the same codes repacked as GPTQ ``qweight`` / ``scales`` (`int4_to_gptq`), and its AMXINT4
  method (its default), which quantizes the bfloat16 weights itself while loading: its own
  codes, so only its error against the float layer compares. kt-kernel's
  AMX/AVX-512 RAWINT4 kernel reads group 32 only; at group 128 the script takes the next
  RAWINT4 backend kt-kernel's wrapper offers (`KtKernel.moe_class`). Each case records the
  kt-kernel class that ran.

Each kt-kernel method runs against its moeroute layer in turn, call by call, in one
process on the same inputs and routing (moeroute's `select_experts` ids and weights, given
to both as they are: moeroute's experts step, ``MoE.experts``, and kt-kernel's MoE task);
the figure is the median of the per-pair time ratios (kt-kernel time / moeroute time: above
1, moeroute is faster). Every call starts with the other side's threads idle: kt-kernel's
workers spin for 50 ms after a job before they sleep, so the script waits after each call.
Both run on the same number of threads (kt-kernel's worker pool; moeroute's Numba and torch
threads). Each format's error is max |out - ref| / max |ref| against the float32 layer on
the float weights, at every T; its bytes per weight count the scales. The JSON also records
the kt-kernel extension variant and MoE classes that ran, moeroute's ISA path and the load
average before and after the run.

JSON goes to bench/results/ktkernel.json. Run it in the environment of ``make
bench-ktkernel`` (kt-kernel installed beside moeroute): ``python bench/ktkernel.py
[--quick] [--check] [--shapes ...] [--formats fp8_block bf16 mxfp4 int4] [--tokens 1 8 64
512] [--merge]``; ``--check`` runs tiny shapes for correctness only; ``--merge`` keeps what
is not measured now (other shapes, widths and T) from the existing JSON, so that a run can
be split into short pieces (``make bench-ktkernel KT_ARGS="--formats int4 --tokens 1 8
--merge"``).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from _common import print_table, write_results  # noqa: E402

SHAPES = {
    "qwen3_30b_a3b": dict(hidden=2048, inter=768, experts=128, top_k=8),
    "deepseek_v3_experts": dict(hidden=7168, inter=2048, experts=16, top_k=8),
    "gpt_oss_20b": dict(hidden=2880, inter=2880, experts=32, top_k=4),
    "kimi_k2_experts": dict(hidden=7168, inter=2048, experts=16, top_k=8),
}
#: Tiny shapes of ``--check``: every kernel family's divisibility (128-blocks, 256-wide
#: llamafile splits, 32-blocks) with a few experts.
CHECK_SHAPES = {
    "tiny": dict(hidden=256, inter=256, experts=8, top_k=2),
    "tiny_odd_inter": dict(hidden=256, inter=384, experts=6, top_k=3),
}
#: The bit-width groups (`GROUPS`) each shape runs, all of them where a shape is not named:
#: INT4 on Qwen3-30B-A3B and Kimi-K2 (released natively as INT4), and Kimi-K2's expert shape,
#: DeepSeek-V3's, for INT4 alone (its other formats are measured on deepseek_v3_experts).
SHAPE_GROUPS = {
    "deepseek_v3_experts": ("fp8_block", "bf16", "mxfp4"),
    "gpt_oss_20b": ("fp8_block", "bf16", "mxfp4"),
    "kimi_k2_experts": ("int4",),
}
#: INT4 group size per shape: Kimi-K2's checkpoint uses 32, GPTQ checkpoints usually 128.
INT4_GROUP_SIZE = {"kimi_k2_experts": 32, "tiny": 32}
DEFAULT_INT4_GROUP_SIZE = 128
#: The one group size of kt-kernel's AMX/AVX-512 RAWINT4 kernel (AMXInt4_KGroup_MOE).
RAWINT4_AMX_GROUP = 32
#: AMXINT4's row step: its ``max_len`` must be a multiple of it.
AMXINT4_M_STEP = 32
TOKENS = (1, 8, 64, 512)
THREADS = 2
#: Rounds per (shape, T): decode calls take milliseconds, prefill ones up to seconds.
REPEATS = {1: 15, 8: 15, 64: 5, 512: 2}
#: Experts generated per step (bounds the float temporaries).
BUILD_STEP = 8

#: GGUF blocks (ggml's block_q8_0 and block_q4_0): 32 weights, a float16 scale d first.
QK = 32
Q8_0_BLOCK_BYTES = 2 + QK
Q4_0_BLOCK_BYTES = 2 + QK // 2


# -- GGUF packers: ggml's quantize_row_q8_0_ref / quantize_row_q4_0_ref, vectorized ----------


def _blocks(w) -> np.ndarray:
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.shape[-1] % QK:
        raise ValueError(f"the last dimension ({w.shape[-1]}) must be a multiple of {QK}")
    return w.reshape(*w.shape[:-1], w.shape[-1] // QK, QK)


def quantize_q8_0(w) -> np.ndarray:
    """GGUF Q8_0 of float rows ``w [..., K]``: uint8 ``[..., K/32*34]``, per block of 32 the
    float16 ``d = amax / 127`` then ``round(x / d)`` as int8 (ties away from zero)."""
    x = _blocks(w)
    amax = np.abs(x).max(axis=-1)
    d = (amax / 127).astype(np.float32)
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0).astype(np.float32)
    v = x * inv[..., None]
    whole = np.trunc(v)  # roundf: ties away from zero (v - trunc(v) is exact in float32)
    q = (whole + np.sign(v) * (np.abs(v - whole) >= 0.5)).astype(np.int8)
    out = np.empty((*x.shape[:-1], Q8_0_BLOCK_BYTES), np.uint8)
    out[..., :2] = d.astype(np.float16)[..., None].view(np.uint8)
    out[..., 2:] = q.view(np.uint8)
    return out.reshape(*x.shape[:-2], -1)


def dequantize_q8_0(packed, k: int) -> np.ndarray:
    """Float32 ``[..., k]`` values of Q8_0 rows."""
    b = np.ascontiguousarray(packed).reshape(*packed.shape[:-1], k // QK, Q8_0_BLOCK_BYTES)
    d = b[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = b[..., 2:].view(np.int8).astype(np.float32)
    return (q * d[..., None]).reshape(*packed.shape[:-1], k)


def quantize_q4_0(w) -> np.ndarray:
    """GGUF Q4_0 of float rows ``w [..., K]``: uint8 ``[..., K/32*18]``, per block of 32 the
    float16 ``d = m / -8`` (m the value of largest magnitude, the first one on ties) then
    ``min(15, trunc(x / d + 8.5))``, element j in the low nibble of byte j and element
    j + 16 in its high nibble."""
    x = _blocks(w)
    first = np.argmax(np.abs(x), axis=-1)
    m = np.take_along_axis(x, first[..., None], axis=-1)[..., 0]
    d = (m / -8).astype(np.float32)
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0).astype(np.float32)
    q = np.minimum(15, np.trunc(x * inv[..., None] + np.float32(8.5))).astype(np.uint8)
    out = np.empty((*x.shape[:-1], Q4_0_BLOCK_BYTES), np.uint8)
    out[..., :2] = d.astype(np.float16)[..., None].view(np.uint8)
    out[..., 2:] = q[..., : QK // 2] | (q[..., QK // 2 :] << 4)
    return out.reshape(*x.shape[:-2], -1)


def dequantize_q4_0(packed, k: int) -> np.ndarray:
    """Float32 ``[..., k]`` values of Q4_0 rows."""
    b = np.ascontiguousarray(packed).reshape(*packed.shape[:-1], k // QK, Q4_0_BLOCK_BYTES)
    d = b[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = b[..., 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32) - 8
    return (q * d[..., None]).reshape(*packed.shape[:-1], k)


_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_mxfp4_kernel = None


def _mxfp4_rows_kernel():
    """A Numba kernel quantizing float32 rows ``x [n, cols]`` into blocks/scales (compiled on
    first use, so that importing this module needs no compile)."""
    global _mxfp4_kernel
    if _mxfp4_kernel is None:
        import math

        import numba

        midpoints = np.array(_E2M1_MIDPOINTS, np.float64)

        @numba.njit(parallel=True, cache=False)
        def kernel(x, blocks, scales):
            n, cols = x.shape
            for r in numba.prange(n):
                for b in range(cols // 32):
                    amax = 0.0
                    for j in range(32):
                        amax = max(amax, abs(np.float64(x[r, 32 * b + j])))
                    e = -127
                    if amax > 0:
                        mantissa, exponent = math.frexp(amax)
                        e = exponent - 3 if mantissa <= 0.75 else exponent - 2
                    e = min(max(e, -127), 127)
                    scales[r, b] = e + 127
                    inverse = math.ldexp(1.0, -e)
                    for j in range(16):
                        pair = 0
                        for half in range(2):
                            v = np.float64(x[r, 32 * b + 2 * j + half]) * inverse
                            magnitude = min(abs(v), 6.0)
                            code = 0
                            while code < 7 and midpoints[code] < magnitude:
                                code += 1
                            if code < 7 and magnitude == midpoints[code] and code % 2 == 1:
                                code += 1  # ties go to the even code
                            if math.copysign(1.0, v) < 0:
                                code |= 8
                            pair |= code << (4 * half)
                        blocks[r, b, j] = pair

        _mxfp4_kernel = kernel
    return _mxfp4_kernel


def quantize_mxfp4_numba(w: torch.Tensor):
    """`moeroute.quant.quantize_mxfp4`'s bytes from a Numba loop over the rows (that one works
    in float64 a few rows at a time to bound its memory, which makes the benchmark's 1.8e9
    weights take many minutes). Per block of 32: ``e = ceil(log2(amax / 6))`` exactly (from
    frexp), the codes the nearest e2m1 value of ``w / 2**e`` (exact: a power of two), ties to
    the even code, the first value of each pair in the low nibble; the tests hold it to
    moeroute's bytes.

    Returns (blocks uint8 [..., rows, cols/32, 16], scales uint8 [..., rows, cols/32])."""
    cols = w.shape[-1]
    if cols % QK:
        raise ValueError(f"the last dimension ({cols}) must be a multiple of {QK}")
    x = w.detach().float().contiguous().reshape(-1, cols).numpy()
    blocks = np.empty((x.shape[0], cols // QK, QK // 2), np.uint8)
    scales = np.empty((x.shape[0], cols // QK), np.uint8)
    _mxfp4_rows_kernel()(x, blocks, scales)
    lead = tuple(w.shape[:-1])
    return (
        torch.from_numpy(blocks).reshape(*lead, cols // QK, QK // 2),
        torch.from_numpy(scales).reshape(*lead, cols // QK),
    )


def ue8m0_to_bfloat16(scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 scale bytes (2 ** (s - 127)) as the bfloat16 values kt-kernel's MXFP4 kernel reads
    (exact: bfloat16 has float32's 8 exponent bits; byte 0 is 2 ** -127, a subnormal)."""
    bits = scales.to(torch.int32) << 7
    bits = torch.where(scales == 0, torch.full_like(bits, 0x0040), bits)
    return bits.to(torch.int16).view(torch.bfloat16).contiguous()


_int4_kernel = None


def _int4_codes_kernel():
    """A Numba kernel writing the packed INT4 codes of float32 rows ``x [n, cols]`` for given
    float64 scales ``divisors [n, cols/g]`` (compiled on first use)."""
    global _int4_kernel
    if _int4_kernel is None:
        import numba

        @numba.njit(parallel=True, cache=False)
        def kernel(x, divisors, packed):
            n, cols = x.shape
            group = cols // divisors.shape[1]
            for r in numba.prange(n):
                for j in range(cols // 2):
                    pair = 0
                    for half in range(2):
                        c = 2 * j + half
                        s = divisors[r, c // group]
                        q = 8
                        if s > 0:
                            # round half to even of the float64 quotient, as torch.round
                            q = int(min(max(np.rint(np.float64(x[r, c]) / s), -8.0), 7.0)) + 8
                        pair |= q << (4 * half)
                    packed[r, j] = pair

        _int4_kernel = kernel
    return _int4_kernel


def quantize_int4_numba(w: torch.Tensor, group_size: int):
    """`moeroute.quant.quantize_int4`'s symmetric bytes (bfloat16 scales) with the codes from
    a Numba loop (that one works in float64 a few rows at a time to bound its memory, about a
    microsecond a weight). The scales come from the same torch operations (``amax / 7`` in
    float64, rounded to bfloat16), each code is ``clamp(round(w / s), -8, 7) + 8`` in float64
    (8 where s = 0), element 2j in byte j's low nibble; the tests hold it to moeroute's bytes.

    Returns (packed uint8 [..., rows, cols/2], scales bfloat16 [..., rows, cols/g])."""
    cols = w.shape[-1]
    if cols % group_size:
        raise ValueError(f"the last dimension ({cols}) must be a multiple of group_size={group_size}")
    x = w.detach().float().contiguous().reshape(-1, cols)
    groups = x.view(x.shape[0], cols // group_size, group_size)
    amax = torch.maximum(groups.amax(dim=-1), groups.amin(dim=-1).neg())
    scales = (amax.double() / 7).to(torch.bfloat16)
    packed = np.empty((x.shape[0], cols // 2), np.uint8)
    _int4_codes_kernel()(x.numpy(), scales.double().numpy(), packed)
    lead = tuple(w.shape[:-1])
    return torch.from_numpy(packed).reshape(*lead, cols // 2), scales.reshape(*lead, cols // group_size)


def exact_bfloat16(scales: torch.Tensor, name: str = "scales") -> torch.Tensor:
    """``scales`` as bfloat16, refusing any value that bfloat16 does not hold exactly (moeroute
    keeps INT4 scales in float32; a checkpoint's are bfloat16)."""
    narrow = scales.to(torch.bfloat16)
    if not torch.equal(narrow.float(), scales.float()):
        raise ValueError(f"{name} hold values that bfloat16 cannot represent exactly")
    return narrow.contiguous()


def int4_to_rawint4(packed: torch.Tensor, scales: torch.Tensor):
    """kt-kernel's RAWINT4 weight (the compressed-tensors ``pack-quantized`` bytes its loader
    hands the kernel) from moeroute's symmetric INT4 ``packed`` uint8 [..., N, K/2] and
    ``scales`` [..., N, K/g].

    compressed-tensors stores ``q + 8`` (q in -8..7) eight to a little-endian int32 word,
    element i of a word at bits 4i; kt-kernel's loader views those words as bytes, so byte j
    of a row holds element 2j in its low nibble and 2j+1 in its high nibble: moeroute's codes
    and order. Returns (packed uint8 [..., N, K/2], the same bytes; scales bfloat16
    [..., N, K/g], exact or refused)."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed must be uint8, got {packed.dtype}")
    return packed.contiguous(), exact_bfloat16(scales)


def int4_to_gptq(packed: torch.Tensor, scales: torch.Tensor):
    """kt-kernel's GPTQ_INT4 weight (GPTQ's symmetric ``qweight`` / ``scales``, no ``g_idx``) from
    moeroute's symmetric INT4 ``packed`` uint8 [N, K/2] and ``scales`` [N, K/g] of one matrix.

    GPTQ packs along the input dimension: ``qweight[i, n]`` (int32 [K/8, N]) holds the code
    of input column 8i + j at bits 4j; the zero point is 8 (what kt-kernel's GPTQ kernels
    assume for sym=True), ``scales`` is transposed to float32 [K/g, N]. Bytes 4i..4i+3 of
    moeroute's row n hold columns 8i..8i+7, element 8i + j at bits 4j of their little-endian
    int32: that word is ``qweight[i, n]``, so the repacking is a transpose of the words.
    Returns (qweight, scales), contiguous."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"packed must be uint8 [N, K/2], got {packed.dtype} {tuple(packed.shape)}")
    if packed.shape[1] % 4:
        raise ValueError(f"K = {2 * packed.shape[1]} must be a multiple of 8 for GPTQ's int32 words")
    if sys.byteorder != "little":
        raise RuntimeError("the int32 view of the packed bytes assumes a little-endian host")
    return packed.contiguous().view(torch.int32).T.contiguous(), scales.float().T.contiguous()


#: Bytes per weight of each format, scales included (H and I multiples of the blocks).
BYTES_PER_WEIGHT = {
    "bf16": 2.0,
    "fp8_block": 1.0 + 4 / (128 * 128),
    "mxfp4": 0.5 + 1 / 32,
    "q8_0": Q8_0_BLOCK_BYTES / QK,
    "q4_0": Q4_0_BLOCK_BYTES / QK,
    # INT4 with bfloat16 scales (a checkpoint's, kt-kernel's RAWINT4); moeroute holds its INT4
    # scales as float32 (2 / g bytes more), kt-kernel's GPTQ_INT4 reads float32 scales too.
    "int4_g32": 0.5 + 2 / 32,
    "int4_g128": 0.5 + 2 / 128,
}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (both as float32)."""
    out, ref = out.float(), ref.float()
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def reference_layer(x, ids, weights, w_gate_up, w_down) -> torch.Tensor:
    """The float32 expert layer: per token, sum_k weight_k * down(silu(gate x) * up x) of its
    experts (``w_gate_up [N, 2I, H]`` gate rows first, ``w_down [N, H, I]``)."""
    x = x.float()
    out = torch.zeros(x.shape[0], w_down.shape[1])
    inter = w_down.shape[2]
    for e in ids.unique().tolist():
        rows, slots = (ids == e).nonzero(as_tuple=True)
        gate_up = x[rows] @ w_gate_up[e].float().T
        act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, rows, (act @ w_down[e].float().T) * weights[rows, slots, None])
    return out


# -- the inputs -----------------------------------------------------------------------------


def float_weights(shape, seed=0):
    """The float32 weights of a shape: w_gate_up [N, 2I, H] and w_down [N, H, I], N(0, 0.02)."""
    h, inter, n = shape["hidden"], shape["inter"], shape["experts"]
    generator = torch.Generator().manual_seed(seed)
    w_gate_up = torch.empty(n, 2 * inter, h)
    w_down = torch.empty(n, h, inter)
    for first in range(0, n, BUILD_STEP):
        rows = slice(first, min(n, first + BUILD_STEP))
        count = rows.stop - rows.start
        w_gate_up[rows] = torch.randn(count, 2 * inter, h, generator=generator) * 0.02
        w_down[rows] = torch.randn(count, h, inter, generator=generator) * 0.02
    return w_gate_up, w_down


def router_weight(shape, seed=1):
    return torch.randn(shape["experts"], shape["hidden"], generator=torch.Generator().manual_seed(seed)) * 0.02


def inputs(shape, tokens, router_w):
    """bfloat16 tokens, their router logits (float32) and moeroute's selection of them."""
    import moeroute
    from moeroute.config import RouterConfig

    x = torch.randn(tokens, shape["hidden"], generator=torch.Generator().manual_seed(tokens)).bfloat16()
    logits = x.float() @ router_w.T
    router = RouterConfig(shape["experts"], shape["top_k"], "softmax", renormalize=True)
    weights, ids = moeroute.select_experts(logits, router)
    return x, logits, torch.as_tensor(weights).float().contiguous(), torch.as_tensor(ids).long().contiguous()


# -- moeroute -------------------------------------------------------------------------------


def moeroute_layer(shape, fmt, w_gate_up, w_down, router_w, int4_group_size=DEFAULT_INT4_GROUP_SIZE):
    """moeroute's MoE module holding the weights in ``fmt`` ("bf16", "fp8_block", "mxfp4", or
    "int4": ``QuantConfig("int4", group_size=int4_group_size, symmetric=True)``)."""
    from moeroute.bindings.torch import MoE
    from moeroute.config import RouterConfig
    from moeroute.quant import QuantConfig, quantize_experts

    h, inter, n, k = shape["hidden"], shape["inter"], shape["experts"], shape["top_k"]
    router = RouterConfig(n, k, "softmax", renormalize=True)
    if fmt == "bf16":
        module = MoE(router, h, inter, dtype=torch.bfloat16)
    elif fmt == "int4":
        module = MoE(router, h, inter, quant=QuantConfig("int4", group_size=int4_group_size, symmetric=True))
    else:
        module = MoE(router, h, inter, quant=QuantConfig(fmt))
    with torch.no_grad():
        module.router_weight.copy_(router_w)
        for first in range(0, n, BUILD_STEP):
            rows = slice(first, min(n, first + BUILD_STEP))
            experts = module.experts
            if fmt == "bf16":
                experts.w_gate_up[rows] = w_gate_up[rows]
                experts.w_down[rows] = w_down[rows]
            elif fmt == "fp8_block":
                q_gu, s_gu, q_d, s_d = quantize_experts(w_gate_up[rows], w_down[rows], module.quant)
                experts.w_gate_up[rows], experts.gate_up_scale[rows] = q_gu, s_gu
                experts.w_down[rows], experts.down_scale[rows] = q_d, s_d
            elif fmt == "int4":
                experts.w_gate_up[rows], experts.gate_up_scale[rows] = quantize_int4_numba(
                    w_gate_up[rows], int4_group_size
                )
                experts.w_down[rows], experts.down_scale[rows] = quantize_int4_numba(w_down[rows], int4_group_size)
            else:
                experts.w_gate_up[rows], experts.gate_up_scale[rows] = quantize_mxfp4_numba(w_gate_up[rows])
                experts.w_down[rows], experts.down_scale[rows] = quantize_mxfp4_numba(w_down[rows])
    return module


# -- kt-kernel ------------------------------------------------------------------------------


class KtKernel:
    """kt-kernel's extension: one worker pool of ``threads`` threads, the MoE classes it
    picks for this CPU, and the kernel variant it loaded."""

    def __init__(self, threads: int):
        try:
            import kt_kernel  # noqa: F401 - loads the extension variant for this CPU
        except ImportError as error:
            raise SystemExit(f"kt-kernel is not importable here ({error}): `make bench-ktkernel` builds .venv-kt")

        ext = sys.modules["kt_kernel_ext"]
        from kt_kernel.utils import amx as kt_amx

        self.kt_kernel = kt_kernel
        self.ext = ext
        self.moe = ext.moe
        config = ext.WorkerPoolConfig()
        config.subpool_count = 1
        config.subpool_numa_map = [0]
        config.subpool_thread_count = [threads]
        self.cpu_infer = ext.CPUInfer(config)
        self.threads = threads
        # The classes kt-kernel's own wrapper (NativeMoEWrapper) picks for each method.
        self.classes = {
            "fp8_block": kt_amx.AMXFP8_MOE or kt_amx.AVX2FP8_MOE,
            "bf16": kt_amx.AMXBF16_MOE or kt_amx.AVX2BF16_MOE,
            "mxfp4": kt_amx._select_mxfp4_backend(),
            "q8_0": ext.moe.MOE,
            "q4_0": ext.moe.MOE,
            "int4_amx": getattr(ext.moe, "AMXInt4_MOE", None),
        }
        # INT4: the backend kt-kernel's wrapper selects for a group size (AMX/AVX-512 k-group,
        # AVX-VNNI-256 or AVX2 for RAWINT4; packed AVX-VNNI-256, AVX-VNNI-256 or AVX2 for GPTQ_INT4).
        self.int4_selectors = {"int4": kt_amx._select_rawint4_backend, "int4_gptq": kt_amx._select_gptq_int4_backend}

    def describe(self) -> dict:
        return {
            "version": self.kt_kernel.__version__,
            "cpu_variant": self.kt_kernel.__cpu_variant__,
            "int8_kernel": getattr(self.kt_kernel, "__int8_kernel__", None),
            "moe_classes": {fmt: cls.__name__ if cls else None for fmt, cls in self.classes.items()},
            "int4_classes": {
                fmt: {str(g): self._int4_class_name(fmt, g) for g in (32, 128)} for fmt in self.int4_selectors
            },
            "threads": self.threads,
            "threadpool_count": 1,
            "env": {
                key: os.environ.get(key)
                for key in ("KT_KERNEL_CPU_VARIANT", "KT_MXFP4_BACKEND", "KT_RAWINT4_BACKEND", "KT_GPTQ_INT4_BACKEND")
            },
        }

    def _int4_class_name(self, fmt, group_size):
        try:
            cls = self.moe_class(fmt, group_size)
        except RuntimeError as error:
            return f"none ({error})"
        return cls.__name__ if cls else None

    def moe_class(self, fmt, group_size=None):
        """The MoE class that runs ``fmt`` (INT4: for ``group_size``): the one kt-kernel's
        wrapper selects, except that RAWINT4 off group 32 takes the next backend the wrapper
        offers (as ``KT_RAWINT4_BACKEND=avxvnni``, else ``avx2``): its AMX k-group kernel
        reads Kimi-K2's group 32 only (group 64 gives NaN, 128 crashes the process)."""
        select = self.int4_selectors.get(fmt)
        if select is None:
            return self.classes[fmt]
        cls = select(group_size)
        if fmt == "int4" and group_size != RAWINT4_AMX_GROUP and cls is self.ext.moe.AMXInt4_KGroup_MOE:
            if not os.environ.get("KT_RAWINT4_BACKEND"):
                for backend in ("avxvnni", "avx2"):
                    os.environ["KT_RAWINT4_BACKEND"] = backend
                    try:
                        return select(group_size)
                    except RuntimeError:
                        continue
                    finally:
                        del os.environ["KT_RAWINT4_BACKEND"]
            raise RuntimeError(f"RAWINT4's {cls.__name__} reads group size {RAWINT4_AMX_GROUP} only, not {group_size}")
        return cls

    def _config(self, shape, max_tokens):
        n = shape["experts"]
        self._mask = torch.zeros(n, dtype=torch.bool)  # no expert on a GPU
        config = self.moe.MOEConfig(n, shape["top_k"], shape["hidden"], shape["inter"], self._mask.data_ptr())
        config.layer_idx = 0
        config.pool = self.cpu_infer.backend_
        config.max_len = max_tokens
        return config

    def layer(self, shape, fmt, tensors, max_tokens, group_size=None):
        """A kt-kernel MoE over ``tensors`` (kept alive by the returned layer):

        * "fp8_block": (q_gate_up e4m3 [N, 2I, H], scale [N, 2I/128, H/128], q_down, scale);
        * "bf16": (w_gate_up bfloat16 [N, 2I, H], w_down [N, H, I]);
        * "mxfp4": (blocks uint8 [N, 2I, H/32, 16], scales uint8 [N, 2I, H/32], down ...);
        * "q8_0" / "q4_0": (gate [N, I, row bytes], up, down [N, H, row bytes]) uint8 GGUF rows;
        * "int4" / "int4_gptq" (``group_size``): per-expert lists (gates, ups, downs, gate
          scales, up scales, down scales) in RAWINT4 / GPTQ_INT4 layout (`kt_int4_tensors`);
        * "int4_amx": (gate [N, I, H], up [N, I, H], down [N, H, I]) bfloat16, which AMXINT4
          quantizes itself while loading (writing its INT4 copy to a temporary folder).
        """
        cls = self.moe_class(fmt, group_size)
        if cls is None:
            raise RuntimeError(f"kt-kernel has no {fmt} kernel on this CPU")
        config = self._config(shape, max_tokens)
        inter = shape["inter"]
        keep = list(tensors)
        if fmt == "int4_amx":
            import tempfile

            gate, up, down = (t.contiguous() for t in tensors)
            folder = tempfile.TemporaryDirectory(prefix="moeroute-kt-amxint4-")
            keep = [gate, up, down, folder]
            # its activation buffers come in whole steps of 32 rows
            config.max_len = -(-max_tokens // AMXINT4_M_STEP) * AMXINT4_M_STEP
            config.save, config.load, config.path = True, False, folder.name
            config.gate_proj, config.up_proj, config.down_proj = gate.data_ptr(), up.data_ptr(), down.data_ptr()
        elif fmt in ("q8_0", "q4_0"):
            gate, up, down = (t.contiguous() for t in tensors)
            keep = [gate, up, down]
            kind = getattr(self.ext.kvcache.ggml_type, fmt.upper())
            config.m_block = 32
            config.group_min_len = 10
            config.group_max_len = max_tokens
            config.gate_proj, config.up_proj, config.down_proj = gate.data_ptr(), up.data_ptr(), down.data_ptr()
            config.gate_type = config.up_type = config.down_type = kind
            config.hidden_type = self.ext.kvcache.ggml_type.BF16
        else:
            if fmt in ("int4", "int4_gptq"):
                gates, ups, downs, *parts = tensors
                scales = tuple(parts)
                config.quant_config.bits = 4
                config.quant_config.group_size = group_size
                config.quant_config.zero_point = False
            elif fmt == "bf16":
                w_gu, w_d = tensors
                gates, ups, downs = (
                    [w_gu[e, :inter] for e in range(len(w_gu))],
                    [w_gu[e, inter:] for e in range(len(w_gu))],
                    list(w_d),
                )
                scales = None
            elif fmt == "fp8_block":
                q_gu, s_gu, q_d, s_d = tensors
                split = s_gu.shape[1] // 2
                gates, ups, downs = [q[:inter] for q in q_gu], [q[inter:] for q in q_gu], list(q_d)
                scales = (
                    [s[:split].contiguous() for s in s_gu],
                    [s[split:].contiguous() for s in s_gu],
                    [s.contiguous() for s in s_d],
                )
                config.quant_config.bits = 8
                config.quant_config.group_size = 128
                config.quant_config.zero_point = False
            else:
                b_gu, sc_gu, b_d, sc_d = tensors
                flat = [b.reshape(b.shape[0], -1) for b in b_gu]
                gates, ups = [f[:inter] for f in flat], [f[inter:] for f in flat]
                downs = [b.reshape(b.shape[0], -1) for b in b_d]
                wide_gu, wide_d = ue8m0_to_bfloat16(sc_gu), ue8m0_to_bfloat16(sc_d)
                scales = (
                    [s[:inter].contiguous() for s in wide_gu],
                    [s[inter:].contiguous() for s in wide_gu],
                    list(wide_d),
                )
                config.quant_config.bits = 4
                config.quant_config.group_size = QK
                config.quant_config.zero_point = False
            for part in (gates, ups, downs):
                for t in part:
                    if not t.is_contiguous():
                        raise ValueError("kt-kernel reads contiguous per-expert matrices")
            keep += [gates, ups, downs, scales]
            config.gate_projs = [[t.data_ptr() for t in gates]]
            config.up_projs = [[t.data_ptr() for t in ups]]
            config.down_projs = [[t.data_ptr() for t in downs]]
            if scales is None:
                config.gate_scales = config.up_scales = config.down_scales = [[0] * len(gates)]
            else:
                config.gate_scales = [[t.data_ptr() for t in scales[0]]]
                config.up_scales = [[t.data_ptr() for t in scales[1]]]
                config.down_scales = [[t.data_ptr() for t in scales[2]]]
        moe = cls(config)
        identity = torch.arange(shape["experts"], dtype=torch.int64)  # uint64_t in the C++ side
        self.cpu_infer.submit(moe.load_weights_task(identity.data_ptr()))
        self.cpu_infer.sync()
        layer = KtLayer(self, moe, shape, keep, config)
        layer.class_name = cls.__name__
        return layer


class KtLayer:
    """One kt-kernel MoE: ``layer(x, ids, weights)`` runs it synchronously (bfloat16 out)."""

    def __init__(self, kt, moe, shape, keep, config):
        self.kt, self.moe, self.shape = kt, moe, shape
        self._keep, self._config = keep, config
        self._buffers = {}

    def prepare(self, x, ids, weights):
        """Pinned-free CPU buffers for one input; returns the call (copies nothing per call)."""
        tokens = x.shape[0]
        bsz = torch.tensor([tokens], dtype=torch.int32)
        ids = ids.to(torch.int64).contiguous()
        weights = weights.to(torch.float32).contiguous()
        x = x.to(torch.bfloat16).contiguous()
        out = torch.empty(tokens, self.shape["hidden"], dtype=torch.bfloat16)
        self._buffers[tokens] = (bsz, ids, weights, x, out)
        args = (bsz.data_ptr(), ids.shape[1], ids.data_ptr(), weights.data_ptr(), x.data_ptr(), out.data_ptr(), False)
        cpu_infer, moe = self.kt.cpu_infer, self.moe

        def call():
            cpu_infer.submit(moe.forward_task(*args))
            cpu_infer.sync()
            return out

        return call

    def __call__(self, x, ids, weights):
        return self.prepare(x, ids, weights)().clone()


# -- timing ---------------------------------------------------------------------------------

#: Seconds to wait after every timed call: kt-kernel's workers spin for 50 ms after a job
#: before they sleep, which would take a core from whichever layer runs next.
SETTLE_S = 0.06


def rotated_settled(callables: dict, repeats: int, warmup: int = 1, settle: float = SETTLE_S) -> dict:
    """`rotated`'s rounds (each callable once per round, the first one rotating), with a pause
    of ``settle`` seconds after every call so that each starts with the others' threads idle.
    Returns ``{name: [seconds per round]}``."""
    names = list(callables)
    for _ in range(warmup):
        for name in names:
            callables[name]()
            time.sleep(settle)
    samples = {name: [] for name in names}
    for r in range(repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter_ns()
            callables[name]()
            samples[name].append(max(time.perf_counter_ns() - start, 1) / 1e9)
            time.sleep(settle)
    return samples


def experts_call(module, x, ids, weights):
    """A zero-argument call of moeroute's experts (``module.experts``) on given routing: the
    routed-experts step alone, as kt-kernel's is. The arguments are bound by name (the
    selection's ids and weights), whichever order the experts' forward takes them in."""
    import inspect

    experts = module.experts
    ids32 = ids.to(torch.int32).contiguous()
    params = [p for p in inspect.signature(experts.forward).parameters if p != "self"]
    by_name = {}
    for name in params[1:3]:
        by_name[name] = ids32 if "id" in name else weights
    if len(by_name) != 2 or any(value is None for value in by_name.values()):
        raise TypeError(f"unexpected experts forward parameters {params}")

    def call():
        with torch.no_grad():
            return experts(x, **by_name)

    return call


# -- the comparison -------------------------------------------------------------------------

#: Per bit width: moeroute's format and the kt-kernel methods run against it.
GROUPS = (
    ("fp8_block", ("fp8_block", "q8_0")),
    ("bf16", ("bf16",)),
    ("mxfp4", ("mxfp4", "q4_0")),
    ("int4", ("int4", "int4_gptq", "int4_amx")),
)
#: Names of kt-kernel's methods for each format the script gives it.
KT_METHODS = {
    "fp8_block": "FP8",
    "bf16": "BF16",
    "mxfp4": "MXFP4",
    "q8_0": "LLAMAFILE Q8_0",
    "q4_0": "LLAMAFILE Q4_0",
    "int4": "RAWINT4",
    "int4_gptq": "GPTQ_INT4",
    "int4_amx": "AMXINT4",
}


def moeroute_tensors(module, fmt):
    experts = module.experts
    if fmt == "bf16":
        return experts.w_gate_up, experts.w_down
    return experts.w_gate_up, experts.gate_up_scale, experts.w_down, experts.down_scale


#: kt-kernel formats that read moeroute's own codes and scales (the rest: GGUF of the floats).
SAME_CODES = ("fp8_block", "bf16", "mxfp4", "int4", "int4_gptq")


def kt_int4_tensors(kt_fmt, module, inter):
    """moeroute's INT4 experts in kt-kernel's layout, per expert: (gates, ups, downs, gate
    scales, up scales, down scales). RAWINT4 reads moeroute's packed bytes themselves (row
    slices of its tensors) with the scales in bfloat16; GPTQ_INT4 reads each matrix repacked
    by `int4_to_gptq`."""
    experts = module.experts
    w_gu, s_gu, w_d, s_d = experts.w_gate_up, experts.gate_up_scale, experts.w_down, experts.down_scale
    n = len(w_gu)
    if kt_fmt == "int4":
        (w_gu, s_gu), (w_d, s_d) = int4_to_rawint4(w_gu.data, s_gu.data), int4_to_rawint4(w_d.data, s_d.data)
        return (
            [w_gu[e, :inter] for e in range(n)],
            [w_gu[e, inter:] for e in range(n)],
            list(w_d),
            [s_gu[e, :inter] for e in range(n)],
            [s_gu[e, inter:] for e in range(n)],
            list(s_d),
        )
    gates = [int4_to_gptq(w_gu[e, :inter], s_gu[e, :inter]) for e in range(n)]
    ups = [int4_to_gptq(w_gu[e, inter:], s_gu[e, inter:]) for e in range(n)]
    downs = [int4_to_gptq(w_d[e], s_d[e]) for e in range(n)]
    matrices = [[q for q, _ in part] for part in (gates, ups, downs)]
    scales = [[scale for _, scale in part] for part in (gates, ups, downs)]
    return (*matrices, *scales)


def gguf_tensors(fmt, w_gate_up, w_down, inter):
    """GGUF rows of the float weights: gate [N, I, .], up [N, I, .], down [N, H, .] uint8."""
    pack = quantize_q8_0 if fmt == "q8_0" else quantize_q4_0
    parts = []
    for rows in (slice(None, inter), slice(inter, None)):
        parts.append(
            torch.from_numpy(
                np.concatenate([pack(w_gate_up[e, rows].numpy()) for e in range(len(w_gate_up))]).reshape(
                    len(w_gate_up), inter, -1
                )
            )
        )
    parts.append(torch.from_numpy(np.stack([pack(w_down[e].numpy()) for e in range(len(w_down))])))
    return parts


def llamafile_refusal(shape) -> str | None:
    """Why kt-kernel's LLAMAFILE method cannot hold this shape, or None."""
    if shape["inter"] % 256:
        return f"LLAMAFILE needs I to be a multiple of 256 (QK_K); I = {shape['inter']}"
    return None


def run_shape(kt, shape, tokens_list, repeats, log=print, groups=None, int4_group_size=DEFAULT_INT4_GROUP_SIZE):
    """The bit widths ``groups`` (names of `GROUPS`, all by default) on one shape: errors and
    interleaved times per T, and the load average around each width.

    One kt-kernel layer lives at a time (two of its MoE objects in one process share scratch
    buffers and the first one's output goes wrong), so each kt-kernel method is timed in its
    own pass against the same moeroute layer."""
    w_gate_up, w_down = float_weights(shape)
    router_w = router_weight(shape)
    cases = {t: inputs(shape, t, router_w) for t in tokens_list}
    refs = {t: reference_layer(cases[t][0], cases[t][3], cases[t][2], w_gate_up, w_down) for t in tokens_list}
    max_tokens = max(tokens_list)
    results, not_run, loads = {}, {}, {}
    for fmt, kt_formats in GROUPS:
        if groups is not None and fmt not in groups:
            continue
        before = os.getloadavg()
        start = time.perf_counter()
        module = moeroute_layer(shape, fmt, w_gate_up, w_down, router_w, int4_group_size)
        entries, ours = {}, {}
        for t in tokens_list:
            x, _, weights, ids = cases[t]
            ours[t] = experts_call(module, x, ids, weights)().clone()
            entries[t] = {
                "tokens": t,
                "experts_hit": len(set(ids.reshape(-1).tolist())),
                "moeroute_error": relative_error(ours[t], refs[t]),
                "kt": {},
            }
        log(f"  {fmt}: moeroute built in {time.perf_counter() - start:.1f} s")
        for kt_fmt in kt_formats:
            if kt_fmt in ("q8_0", "q4_0"):
                reason = llamafile_refusal(shape)
                if reason:
                    not_run[kt_fmt] = reason
                    log(f"  {KT_METHODS[kt_fmt]}: not run ({reason})")
                    continue
            start = time.perf_counter()
            if kt_fmt in ("q8_0", "q4_0"):
                tensors = gguf_tensors(kt_fmt, w_gate_up, w_down, shape["inter"])
            elif kt_fmt in ("int4", "int4_gptq"):
                tensors = kt_int4_tensors(kt_fmt, module, shape["inter"])
            elif kt_fmt == "int4_amx":  # kt-kernel's own INT4 codes, from the bfloat16 weights
                inter = shape["inter"]
                tensors = (w_gate_up[:, :inter].bfloat16(), w_gate_up[:, inter:].bfloat16(), w_down.bfloat16())
            else:
                tensors = moeroute_tensors(module, kt_fmt)
            try:
                layer = kt.layer(shape, kt_fmt, tensors, max_tokens, group_size=int4_group_size)
            except (ValueError, RuntimeError) as error:  # e.g. FP8 needs H and I multiples of 128
                not_run[kt_fmt] = f"kt-kernel refused the shape: {error}"
                log(f"  {KT_METHODS[kt_fmt]}: not run ({error})")
                continue
            finally:
                del tensors
            log(f"  {KT_METHODS[kt_fmt]} ({layer.class_name}): built in {time.perf_counter() - start:.1f} s")
            for t in tokens_list:
                x, _, weights, ids = cases[t]
                calls = {"moeroute": experts_call(module, x, ids, weights), "kt": layer.prepare(x, ids, weights)}
                theirs = calls["kt"]().clone()
                error = relative_error(theirs, refs[t])
                samples = rotated_settled(calls, repeats[t])
                ratios = [k / m for k, m in zip(samples["kt"], samples["moeroute"])]
                case = {
                    "method": KT_METHODS[kt_fmt],
                    "kt_class": layer.class_name,
                    "moeroute_us": float(np.median(samples["moeroute"])) * 1e6,
                    "kt_us": float(np.median(samples["kt"])) * 1e6,
                    "speedup": float(np.median(ratios)),
                    "speedup_range": [min(ratios), max(ratios)],
                    "repeats": repeats[t],
                    "error": error,
                }
                if kt_fmt in SAME_CODES:  # the same codes: how far the two computations are apart
                    case["difference_to_moeroute"] = relative_error(theirs, ours[t])
                entries[t]["kt"][kt_fmt] = case
                log(
                    f"  {fmt} T={t}: moeroute {case['moeroute_us'] / 1e3:.2f} ms "
                    f"(err {entries[t]['moeroute_error']:.1e}), {case['method']} {case['kt_us'] / 1e3:.2f} ms "
                    f"(err {error:.1e}): kt/moeroute {case['speedup']:.2f}x"
                )
            del layer, calls
            gc.collect()
        if fmt == "int4":
            for entry in entries.values():
                entry["group_size"] = int4_group_size
        results[fmt] = [entries[t] for t in tokens_list]
        loads[fmt] = [list(before), list(os.getloadavg())]
        del module, ours
        gc.collect()
    return {"results": results, "not_run": not_run, "loadavg_per_format": loads}


def shape_groups(name, formats=None) -> tuple:
    """The bit widths (`GROUPS` names) that shape ``name`` runs, within ``formats`` if given."""
    groups = SHAPE_GROUPS.get(name, tuple(fmt for fmt, _ in GROUPS))
    return tuple(fmt for fmt in groups if formats is None or fmt in formats)


def merge_results(earlier: dict, measured: dict) -> dict:
    """``earlier`` results (shape -> width -> entries) with ``measured``'s laid over them, entry
    by entry (one per T): a rerun of some shapes, widths or T keeps everything else."""
    merged = {name: {fmt: list(entries) for fmt, entries in groups.items()} for name, groups in earlier.items()}
    for name, groups in measured.items():
        for fmt, entries in groups.items():
            by_tokens = {e["tokens"]: e for e in merged.setdefault(name, {}).get(fmt, [])}
            by_tokens.update({e["tokens"]: e for e in entries})
            merged[name][fmt] = [by_tokens[t] for t in sorted(by_tokens)]
    return merged


def run(shapes, tokens_list, repeats, save=None, merge=None, formats=None) -> dict:
    """Measure ``shapes`` (the widths `shape_groups` gives each, within ``formats``); with
    ``merge`` (an earlier payload), keep its results for every shape, width and T not measured
    now (shapes not measured at all keep their run dates in ``earlier_runs``)."""
    import moeroute

    torch.set_num_threads(THREADS)
    try:
        import numba

        numba.set_num_threads(min(THREADS, numba.config.NUMBA_NUM_THREADS))
    except ImportError:
        pass
    kt = KtKernel(THREADS)
    load_before = os.getloadavg()
    shapes = {name: shape for name, shape in shapes.items() if shape_groups(name, formats)}
    payload = {
        "cpu_isa": moeroute.cpu_isa(),
        "kt_kernel": kt.describe(),
        "threads": THREADS,
        "activation": "silu",
        "activation_dtype": "bfloat16",
        "shapes": {name: {**shape, **int4_fields(name)} for name, shape in shapes.items()},
        "bytes_per_weight": BYTES_PER_WEIGHT,
        "formats": {
            "fp8_block": "moeroute QuantConfig('fp8_block') (w8a8) / kt-kernel FP8 on the same bytes",
            "bf16": "bfloat16 weights, both",
            "mxfp4": "moeroute QuantConfig('mxfp4') (w4a16) / kt-kernel MXFP4 on the same bytes",
            "q8_0": "kt-kernel LLAMAFILE on GGUF Q8_0 of the float weights",
            "q4_0": "kt-kernel LLAMAFILE on GGUF Q4_0 of the float weights",
            "int4": "moeroute QuantConfig('int4', group_size=g, symmetric=True) (w4a16, float32 scales in memory) "
            "/ kt-kernel RAWINT4 on the same packed bytes and their bfloat16 scales (compressed-tensors layout)",
            "int4_gptq": "kt-kernel GPTQ_INT4 on the same codes repacked as GPTQ qweight int32 [K/8, N] "
            "with float32 scales [K/g, N] (sym, zero point 8)",
            "int4_amx": "kt-kernel AMXINT4 quantizing the bfloat16 weights itself while loading (its own "
            "codes: compare its error against the float layer, not the bytes)",
        },
        "settle_s": SETTLE_S,
        "loadavg_before": list(load_before),
        "results": {},
        "not_run": {},
        "loadavg_per_format": {},
    }
    if merge:
        measured = set(shapes)
        payload["shapes"] = {**merge.get("shapes", {}), **payload["shapes"]}
        payload["results"] = merge_results(merge.get("results", {}), {})
        payload["not_run"] = {k: dict(v) for k, v in merge.get("not_run", {}).items()}
        payload["loadavg_per_format"] = {k: dict(v) for k, v in merge.get("loadavg_per_format", {}).items()}
        payload["loadavg_per_shape"] = {
            k: v for k, v in merge.get("loadavg_per_shape", {}).items() if k not in measured
        }
        payload["earlier_loadavg"] = merge.get("earlier_loadavg") or [
            merge.get("loadavg_before"),
            merge.get("loadavg_after"),
        ]
        payload["earlier_runs"] = {
            k: merge.get("earlier_runs", {}).get(k, merge.get("machine", {}).get("date"))
            for k in merge.get("results", {})
            if k not in measured
        }
    for name, shape in shapes.items():
        groups = shape_groups(name, formats)
        print(f"{name}: {shape}, {', '.join(groups)}", flush=True)
        start = time.perf_counter()
        before = os.getloadavg()
        out = run_shape(
            kt,
            shape,
            tokens_list,
            repeats,
            log=lambda text: print(text, flush=True),
            groups=groups,
            int4_group_size=INT4_GROUP_SIZE.get(name, DEFAULT_INT4_GROUP_SIZE),
        )
        payload["results"] = merge_results(payload["results"], {name: out["results"]})
        not_run = payload["not_run"].setdefault(name, {})
        for fmt, kt_formats in GROUPS:  # what runs now is no longer "not run"
            if fmt in groups:
                for kt_fmt in kt_formats:
                    not_run.pop(kt_fmt, None)
        not_run.update(out["not_run"])
        if not not_run:
            del payload["not_run"][name]
        payload["loadavg_per_format"].setdefault(name, {}).update(out["loadavg_per_format"])
        payload.setdefault("loadavg_per_shape", {})[name] = [list(before), list(os.getloadavg())]
        print(f"{name}: {time.perf_counter() - start:.0f} s", flush=True)
        gc.collect()
        if save is not None:  # what is measured so far survives an interrupted run
            save({**payload, "loadavg_after": list(os.getloadavg()), "complete": False})
    payload["loadavg_after"] = list(os.getloadavg())
    payload["complete"] = True
    return payload


def int4_fields(name) -> dict:
    """The INT4 group size a shape runs with, for the JSON's shapes (shapes without INT4: none)."""
    if "int4" not in shape_groups(name):
        return {}
    return {"int4_group_size": INT4_GROUP_SIZE.get(name, DEFAULT_INT4_GROUP_SIZE)}


def print_summary(payload) -> None:
    rows = []
    for name, groups in payload["results"].items():
        for fmt, entries in groups.items():
            for e in entries:
                for kt_fmt, k in e["kt"].items():
                    rows.append(
                        [
                            name,
                            fmt,
                            k["method"],
                            e["tokens"],
                            k["moeroute_us"] / 1e3,
                            k["kt_us"] / 1e3,
                            k["speedup"],
                            e["moeroute_error"],
                            k["error"],
                        ]
                    )
    print_table(
        ["shape", "moeroute", "kt-kernel", "T", "moeroute ms", "kt ms", "kt/moeroute", "err moeroute", "err kt"], rows
    )


#: ``--check``'s bounds: each output against the float layer (max |diff| / max |ref|), and
#: kt-kernel against moeroute where both read the same bytes (FP8: kt-kernel keeps the
#: activations in bfloat16, moeroute quantizes them to e4m3 per 128 columns).
CHECK_ERROR = {"bf16": 0.02, "fp8_block": 0.1, "q8_0": 0.05, "mxfp4": 0.35, "q4_0": 0.35, "int4": 0.35}
CHECK_ERROR["int4_gptq"] = CHECK_ERROR["int4_amx"] = CHECK_ERROR["int4"]
CHECK_DIFFERENCE = {"bf16": 0.02, "fp8_block": 0.1, "mxfp4": 0.02, "int4": 0.02, "int4_gptq": 0.02}


def check_failures(payload) -> list[str]:
    """The cases of a run outside `CHECK_ERROR` / `CHECK_DIFFERENCE`."""
    failures = []
    for name, groups in payload["results"].items():
        for fmt, entries in groups.items():
            for e in entries:
                if e["moeroute_error"] > CHECK_ERROR[fmt]:
                    failures.append(f"{name} T={e['tokens']} moeroute {fmt}: error {e['moeroute_error']:.3g}")
                for kt_fmt, case in e["kt"].items():
                    if case["error"] > CHECK_ERROR[kt_fmt]:
                        failures.append(f"{name} T={e['tokens']} kt {kt_fmt}: error {case['error']:.3g}")
                    difference = case.get("difference_to_moeroute")
                    if difference is not None and difference > CHECK_DIFFERENCE[kt_fmt]:
                        failures.append(f"{name} T={e['tokens']} kt {kt_fmt}: {difference:.3g} from moeroute")
    return failures


def mxfp4_failures() -> list[str]:
    """`quantize_mxfp4_numba` against moeroute's `quantize_mxfp4`, byte for byte."""
    from moeroute.quant import quantize_mxfp4

    w = torch.randn(4, 96, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    w[0, 0, :32] = 0
    w[1, 0, :64] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 8)
    ours, theirs = quantize_mxfp4_numba(w), quantize_mxfp4(w)
    if all(torch.equal(a, b) for a, b in zip(ours, theirs)):
        return []
    return ["quantize_mxfp4_numba: the bytes differ from moeroute.quant.quantize_mxfp4's"]


def int4_failures() -> list[str]:
    """`quantize_int4_numba` against moeroute's `quantize_int4`, byte for byte."""
    from moeroute.quant import quantize_int4

    w = torch.randn(2, 16, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    w[0, 0, :32] = 0
    failures = []
    for group in (32, 128):
        ours, theirs = quantize_int4_numba(w, group), quantize_int4(w, group_size=group)
        if not all(torch.equal(a, b) for a, b in zip(ours, theirs)):
            failures.append(f"quantize_int4_numba g{group}: the bytes differ from moeroute.quant.quantize_int4's")
    return failures


def gguf_failures() -> list[str]:
    """The GGUF packers against gguf-py's (kt-kernel's GGUF reader), byte for byte."""
    from gguf import GGMLQuantizationType, quants

    w = (np.random.default_rng(0).standard_normal((64, 1024)) * 0.02).astype(np.float32)
    failures = []
    for fmt, pack in (("Q8_0", quantize_q8_0), ("Q4_0", quantize_q4_0)):
        if not np.array_equal(pack(w), quants.quantize(w, getattr(GGMLQuantizationType, fmt))):
            failures.append(f"{fmt}: the packer's bytes differ from gguf-py's")
    return failures


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T = 1 and 8 only")
    parser.add_argument("--check", action="store_true", help="tiny shapes, no JSON: correctness only")
    parser.add_argument("--shapes", nargs="*", choices=list(SHAPES), help="a subset of the shapes")
    parser.add_argument(
        "--formats", nargs="*", choices=[fmt for fmt, _ in GROUPS], help="a subset of the bit widths (moeroute formats)"
    )
    parser.add_argument("--tokens", nargs="*", type=int, choices=TOKENS, help="a subset of T (overrides --quick)")
    parser.add_argument("--repeats", type=float, default=1.0, help="scale the rounds per T (at least 1)")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep what is not measured now (other shapes, widths, T) from the existing ktkernel.json",
    )
    args = parser.parse_args(argv)
    tokens = tuple(sorted(set(args.tokens))) if args.tokens else (1, 8) if args.quick else TOKENS
    repeats = {t: max(1, round(REPEATS[t] * args.repeats)) for t in TOKENS}
    if args.check:
        payload = run(CHECK_SHAPES, (1, 8, 64), {1: 2, 8: 2, 64: 2}, formats=args.formats)
        print_summary(payload)
        failures = check_failures(payload) + gguf_failures() + mxfp4_failures() + int4_failures()
        print("\n".join(failures) if failures else "check: every output within its bound")
        raise SystemExit(1 if failures else 0)
    shapes = {name: SHAPES[name] for name in (args.shapes or SHAPES)}
    merge = None
    if args.merge:
        import json

        from _common import RESULTS_DIR

        existing = RESULTS_DIR / "ktkernel.json"
        merge = json.loads(existing.read_text(encoding="utf-8")) if existing.exists() else None
    payload = run(
        shapes,
        tokens,
        repeats,
        save=lambda partial: write_results("ktkernel", partial),
        merge=merge,
        formats=args.formats,
    )
    print_summary(payload)
    path = write_results("ktkernel", payload)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
