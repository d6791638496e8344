"""How the CPU quantized experts (FP8 and MXFP4) compute a call: "rows" decodes one weight
row at a time into cache and dots it with the expert's tokens (decode-sized batches);
"blocks" decodes chunks of rows for BLAS GEMMs (prefill)."""

from __future__ import annotations

__all__ = ["ROWS_MAX_ROWS_PER_EXPERT", "choose_strategy"]

#: Largest rows-per-expert (mean over hit experts) served by the row-streaming kernels:
#: their dot products are not register-blocked over rows, so past a few dozen rows a
#: BLAS GEMM over decoded blocks is faster (bench/quant.py).
ROWS_MAX_ROWS_PER_EXPERT = 16


def choose_strategy(counts: list[int], bf16_dot: bool = False) -> str:
    """ "rows" when the hit experts average at most `ROWS_MAX_ROWS_PER_EXPERT` rows, or at any
    count when the row kernels run on the bfloat16 dot instructions (``bf16_dot``: row
    kernels register-blocked over four rows, which read each weight once per four rows and
    write no decode buffer, bench/quant.py); else "blocks"."""
    hit = [c for c in counts if c]
    if bf16_dot or not hit or sum(hit) <= ROWS_MAX_ROWS_PER_EXPERT * len(hit):
        return "rows"
    return "blocks"
