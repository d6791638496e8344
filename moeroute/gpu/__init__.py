"""Expert GEMMs on GPUs: CuPy RawKernels (kernels/*.cu, HIP variants kernels/*.hip).

``fused_experts`` runs the routed experts of one MoE layer (align, gate_up GEMM with the fused
activation, down GEMM with the router weight, sum over the top-k slots) on CuPy arrays or torch
CUDA tensors. Importing this package does not import CuPy.
"""

from moeroute.gpu.experts import fused_experts
from moeroute.gpu.gemm import check_fused_experts_args

__all__ = ["check_fused_experts_args", "fused_experts"]
