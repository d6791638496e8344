"""The expert compute: the received rows, their local expert ids and weights in, the weighted
sum of the expert MLPs out, for every weight format moeroute holds.

    experts/
      modules.py     LocalExperts (float32, float16, bfloat16) and QuantizedExperts (FP8, MXFP4):
                     the torch modules that own one rank's stacked weights
      formats/       one file per weight format: its data checks and its forward
                     (unquantized.cpu_experts, fp8.fp8_experts_forward,
                     mxfp4.mxfp4_experts_forward), which picks a strategy and runs it
      choose.py      the strategy chooser of the quantized formats
      activations.py the gated MLP's activations in torch
      cpu/           the Numba kernels: rows.py (the tiled rows driver of the float formats and
                     its plan), dot.py (the bfloat16-dot tile every row kernel builds on),
                     fp8.py, mxfp4.py, mxfp4_dot.py (each format's decode and row kernels),
                     quant_rows.py and mxfp4_rows.py (the quantized formats' one-call forwards)

The CUDA kernels are `moeroute.gpu`'s; the formats' definitions and conversions are
`moeroute.quant`'s. This package sits between them and the torch bindings: it imports
`moeroute.gpu`, `moeroute.quant` and `moeroute.routing`, and nothing above it.
"""

from moeroute.experts.formats.fp8 import fp8_experts_forward
from moeroute.experts.formats.mxfp4 import mxfp4_experts_forward
from moeroute.experts.formats.unquantized import cpu_experts
from moeroute.experts.modules import LocalExperts, QuantizedExperts

__all__ = ["LocalExperts", "QuantizedExperts", "cpu_experts", "fp8_experts_forward", "mxfp4_experts_forward"]
