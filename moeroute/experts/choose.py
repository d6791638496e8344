"""Which strategy computes a call of the expert compute: one table of what each (weight format,
backend) combination offers, and one `choose` that the three forwards call.

=====  =======  ===========================================================================
format backend  "auto" takes
=====  =======  ===========================================================================
float  cpu      "rows" up to `rows_bound` mean rows per hit expert (bfloat16: 8 where the
                CPU has bfloat16 dot instructions, else any count); else "padded" (float32 on torch.mm, few rows per expert, most
                experts hit) or "loop"
fp8    cpu      "rows" up to `ROWS_MAX_MEAN_ROWS` mean rows per hit expert, and at any count
                where the bfloat16-dot kernels serve the shapes (CPU feature `BF16_DOT`);
                else "blocks". Within "rows", the bfloat16-dot kernels past
                `FP8_WIDENED_MAX_MEAN_ROWS` (`fp8_bf16_dot`), the widened ones below
mxfp4  cpu      "rows" (few rows per expert decode in registers, more decode once per call)
int4   cpu      "rows" (bfloat16 activations: one call on `int4_dot`'s tiles where they serve,
                the bfloat16 dot or, at few rows per expert, float32 FMAs; else the row
                kernels of `moeroute.experts.cpu.int4`); bfloat16 activations where the CPU
                has bfloat16 dot instructions: "blocks" (bfloat16 decode, oneDNN's bfloat16
                GEMMs) past `int4_rows_bound` mean rows per hit expert
any    cuda     "cuda": `moeroute.gpu.fused_experts` (the quantized formats, INT4 and FP8
                w8a16 included, where CuPy is installed and the call is one its kernels
                take; else "blocks")
=====  =======  ===========================================================================

A strategy a caller names is checked against its format's row of `STRATEGIES` (`check_strategy`),
whatever the device: a module built on the CPU may move to CUDA. On CUDA a CPU strategy
("rows", "loop", "padded") means the CUDA kernels; "blocks" stays a choice there.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from moeroute import cpu_features

__all__ = [
    "FORMATS",
    "BACKENDS",
    "STRATEGIES",
    "ROWS_MAX_MEAN_ROWS",
    "BF16_ROWS_MAX_MEAN_ROWS",
    "INT4_BF16_ROWS_MAX_MEAN_ROWS",
    "FP8_WIDENED_MAX_MEAN_ROWS",
    "ROWS_DTYPES",
    "PADDED_MAX_ROWS",
    "PADDED_MIN_HIT_FRACTION",
    "PADDED_DTYPES",
    "format_of",
    "cupy_installed",
    "check_strategy",
    "rows_bound",
    "int4_rows_bound",
    "fp8_bf16_dot",
    "choose",
]

#: The weight formats of the expert compute ("float": float32, float16 or bfloat16 weights).
FORMATS = ("float", "fp8", "mxfp4", "int4")
#: Where a call runs: the weights' device type.
BACKENDS = ("cpu", "cuda")
#: What a caller may name for each format ("auto" first): the CPU strategies; on CUDA "auto"
#: (and any CPU strategy) is "cuda", and the quantized formats keep "blocks".
STRATEGIES = {
    "float": ("auto", "loop", "padded", "rows"),
    "fp8": ("auto", "rows", "blocks"),
    "mxfp4": ("auto", "rows", "blocks"),
    "int4": ("auto", "rows", "blocks"),
}
#: Largest mean rows per hit expert that "auto" gives the CPU row kernels: below it an
#: expert's GEMMs are bound by reading its weights, which the row kernels read once; past it
#: a BLAS GEMM (over decoded blocks, for the quantized formats) is faster (bench/layer.py
#: --rows-only, bench/quant.py). bfloat16 has its own bound (`rows_bound`).
ROWS_MAX_MEAN_ROWS = 16
#: bfloat16's bound where oneDNN multiplies bfloat16 on the CPU's own dot instructions
#: (AVX512-BF16, AMX): past about 8 rows per expert its GEMM, blocked for the caches and
#: registers, outruns the row kernels (which dot one weight tile with four activation rows
#: at a time); below it reading each weight once wins. The bfloat16 prefill rows of
#: bench/ktkernel.py (T = 64, 512) run past the bound.
BF16_ROWS_MAX_MEAN_ROWS = 8
#: INT4's bound for bfloat16 activations where the CPU has bfloat16 dot instructions: past it
#: "blocks" (each chunk of weight rows decoded to bfloat16, then oneDNN's bfloat16 GEMM)
#: outruns the row kernels, which read half a byte per weight but dot four rows at a time.
#: Higher than bfloat16's: "blocks" pays the decode and a store and load of each decoded
#: chunk besides the GEMM, so the row kernels still win at 16 rows per expert and the two
#: meet near 32 (the T = 512 rows of bench/quant.py --int4 run past the bound).
INT4_BF16_ROWS_MAX_MEAN_ROWS = 24
#: FP8's row kernels where the bfloat16-dot ones serve: up to this many mean rows per hit
#: expert the widened kernels (e4m3 widened to float32 in registers, two weight rows per
#: pass) run instead. With one activation row per expert, as in a decode step, the
#: bfloat16-dot kernels' conversion of every e4m3 weight to bfloat16 and their four-row
#: tiles buy nothing, and the widened kernels are faster; from about two rows per expert
#: the dot instruction's products pay for it (bench/results/quant_fp8_kernels.json).
FP8_WIDENED_MAX_MEAN_ROWS = 1.5
#: Dtypes of the float row kernels.
ROWS_DTYPES = (torch.float32, torch.bfloat16)
#: Largest per-expert row count the padded batch is used for: below it an expert's
#: GEMM is bound by reading its weights, so padding rows costs little compute.
PADDED_MAX_ROWS = 32
#: The padded batch covers every local expert; it is used only when at least this share
#: of them has rows, so idle experts' weights are not read for nothing (decode: few hit).
PADDED_MIN_HIT_FRACTION = 0.5
#: Dtypes the padded batch is chosen for: torch's CPU bmm is slow in half precision.
PADDED_DTYPES = (torch.float32,)


def format_of(quant) -> str:
    """The `FORMATS` entry of a `moeroute.quant.QuantConfig` (None: "float")."""
    if quant is None:
        return "float"
    return quant.format if quant.format in ("mxfp4", "int4") else "fp8"


def cupy_installed() -> bool:
    """CuPy importable: the CUDA kernels can run (else the quantized formats take "blocks")."""
    return importlib.util.find_spec("cupy") is not None


def check_strategy(name: str, strategy: str, format: str = "float") -> str:
    """``strategy`` when ``format`` offers it (`STRATEGIES`), else ValueError naming ``name``,
    the value and the allowed ones."""
    if format not in STRATEGIES:
        raise ValueError(f"format={format!r} is not an experts format; use one of {FORMATS}")
    allowed = STRATEGIES[format]
    if strategy not in allowed:
        what = "a GEMM strategy" if format == "float" else f"an {format.upper()} strategy"
        raise ValueError(f"{name}={strategy!r} is not {what}; use one of {allowed}")
    return strategy


@functools.cache
def rows_bound(dtype: torch.dtype) -> float:
    """The mean rows per hit expert up to which "auto" picks the float row kernels for
    ``dtype``: `ROWS_MAX_MEAN_ROWS`; for bfloat16 `BF16_ROWS_MAX_MEAN_ROWS` where the CPU
    (on the path in use, `moeroute.cpu_isa`) has bfloat16 dot instructions, else no bound (inf).

    bfloat16 without bfloat16 instructions: oneDNN converts each expert's weights on every
    call, and the row kernels win at every row count. With them oneDNN's per-expert GEMM is
    blocked for the caches and registers and outruns the row kernels (one weight tile dotted
    with four activation rows at a time) once an expert serves more than a few rows.
    """
    if dtype == torch.bfloat16:
        if cpu_features.FEATURES & {"avx512bf16", "amx-bf16"}:
            return float(BF16_ROWS_MAX_MEAN_ROWS)
        return float("inf")
    return float(ROWS_MAX_MEAN_ROWS)


@functools.cache
def int4_rows_bound(dtype: torch.dtype) -> float:
    """The mean rows per hit expert up to which "auto" keeps INT4 on "rows":
    `INT4_BF16_ROWS_MAX_MEAN_ROWS` for bfloat16 where the CPU (on the path in use) has bfloat16
    dot instructions, else no bound (inf): without them, or for float32 activations, "blocks"
    runs float32 GEMMs, which the decode-once row kernels beat at every row count."""
    if dtype == torch.bfloat16 and cpu_features.FEATURES & {"avx512bf16", "amx-bf16"}:
        return float(INT4_BF16_ROWS_MAX_MEAN_ROWS)
    return float("inf")


def fp8_bf16_dot(served: bool, rows: int, hit: int) -> bool:
    """Whether FP8's "rows" strategy runs the bfloat16-dot kernels: they serve the call
    (``served``: the CPU feature and the shapes, `moeroute.experts.cpu.fp8.bf16_dot_serves`)
    and its ``rows`` over ``hit`` experts exceed `FP8_WIDENED_MAX_MEAN_ROWS` per expert."""
    return served and rows > FP8_WIDENED_MAX_MEAN_ROWS * hit


def choose(
    format: str,
    backend: str,
    counts: list[int] | None = None,
    *,
    strategy: str = "auto",
    dtype: torch.dtype = torch.float32,
    onednn: bool = False,
    bf16_dot: bool = False,
    cuda_kernels: bool = True,
) -> str:
    """The strategy that computes one call.

    Parameters
    ----------
    format : one of `FORMATS`
    backend : one of `BACKENDS` (the weights' device type)
    counts : list of int, rows of each local expert (the CPU "auto" choices read them)
    strategy : what the caller asked for (`STRATEGIES`); "auto" decides here
    dtype : the activations' dtype (float: the weights' too)
    onednn : float on the CPU: the loop's linears run on oneDNN
    bf16_dot : fp8 and int4 on the CPU: the bfloat16-dot row kernels serve this call
    cuda_kernels : quantized formats on CUDA: CuPy is installed and the call is one the
        CUDA kernels take

    Returns
    -------
    str: "rows", "loop", "padded", "blocks" (CPU, quantized formats on CUDA) or "cuda".

    Raises
    ------
    ValueError
        An unknown format, backend or strategy (naming it and the allowed values).
    """
    check_strategy("strategy", strategy, format)
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not an experts backend; use one of {BACKENDS}")
    if backend == "cuda":
        if format != "float" and (strategy == "blocks" or not cuda_kernels):
            return "blocks"
        return "cuda"
    if strategy != "auto":
        return strategy
    counts = counts or []
    hit = len(counts) - counts.count(0)
    if format == "int4":
        return "blocks" if hit and sum(counts) > int4_rows_bound(dtype) * hit else "rows"
    if format == "mxfp4":
        return "rows"
    if format == "fp8":
        return "rows" if bf16_dot or not hit or sum(counts) <= ROWS_MAX_MEAN_ROWS * hit else "blocks"
    if not hit:
        return "loop"
    if dtype in ROWS_DTYPES and sum(counts) <= rows_bound(dtype) * hit:
        return "rows"
    if onednn or dtype not in PADDED_DTYPES:
        return "loop"
    if max(counts) <= PADDED_MAX_ROWS and hit >= PADDED_MIN_HIT_FRACTION * len(counts):
        return "padded"
    return "loop"
