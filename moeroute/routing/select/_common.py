"""select_experts: what the CPU and CUDA kernels share (the warp width both sum in, float32
constants, scoring codes, order keys) and the dtype-name helper of validation and launch."""

from __future__ import annotations

import numpy as np

from moeroute.routing._arrays import dtype_name
from moeroute.routing.reference import FLOAT32_MAX, RENORMALIZE_EPS

WARP_SIZE = 32  # lanes of an NVIDIA warp; the device kernel gives one warp to a token row

# A softmax pick more than this many nats below the row max may have a subnormal or zero
# float32 score (exp(-87.3) is the smallest normal float32, less ln N for the division):
# such rows rank the computed scores so that underflow ties go to the lower id.
SOFTMAX_EXACT_GAP = 64.0

_F32_MAX = np.float32(FLOAT32_MAX)
_F32_NEG_MAX = np.float32(-FLOAT32_MAX)
_F32_ONE = np.float32(1.0)
_F32_ZERO = np.float32(0.0)
_F32_EPS = np.float32(RENORMALIZE_EPS)
_F32_NEG_INF = np.float32(-np.inf)
_F32_INF = np.float32(np.inf)
_F32_HALF = np.float32(0.5)

# exp on the host (_host._exp, and _simd._vector_exp op for op): Cody-Waite reduction by
# ln 2 and Cephes' degree-6 polynomial in float32 with fused multiply-adds, from plain
# arithmetic that vectorizes (libm's expf is a scalar call; Numba's SVML route needs an
# SVML-patched llvmlite, which PyPI's wheels are not). Within 1 ulp of the correctly rounded
# exp, 99% of inputs exact (every 7th float32 in [-104, 89] against float64 exp); 2**n is
# applied as two normal factors so that subnormal results and overflow round correctly.
_EXP_LOWEST = np.float32(-104.0)  # exp(-104) rounds to float32 zero
_EXP_HIGHEST = np.float32(89.0)  # exp(89) overflows float32 to inf
_ROUND_MAGIC = np.float32(1.5 * 2.0**23)  # x + M - M rounds a float32 to an integer
_LOG2_E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)  # ln 2 split so that n * hi is exact (9 significant bits)
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_P0, _EXP_P1, _EXP_P2, _EXP_P3, _EXP_P4, _EXP_P5 = (
    np.float32(c)
    for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)
)
_F32_EXPONENT_BIAS = 127

# config.scoring as the CPU kernel's integer argument (one compiled kernel serves all four).
_SOFTMAX, _SIGMOID, _SQRTSOFTPLUS, _RAW = 0, 1, 2, 3
_SCORING_CODES = {"softmax": _SOFTMAX, "sigmoid": _SIGMOID, "sqrtsoftplus": _SQRTSOFTPLUS, "none": _RAW}

_INT32_LOW31 = np.int32(0x7FFFFFFF)
# Order keys: int32 that sort like the float32 choices, -0 == +0, NaN below -inf.
_NAN_KEY = np.int32((int(np.float32(-np.inf).view(np.int32)) ^ 0x7FFFFFFF) - 1)  # key(-inf) - 1
_NO_KEY = np.int32(np.iinfo(np.int32).min)  # below every key: "nothing picked yet"


_dtype_name = dtype_name  # 'float32', 'float16', 'bfloat16', ... of any framework's dtype
