"""select_experts: what the CPU and CUDA kernels share (the warp width both sum in, float32
constants, scoring codes, order keys) and the dtype-name helper of validation and launch."""

from __future__ import annotations

import numpy as np

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

# config.scoring as the CPU kernel's integer argument (one compiled kernel serves all four).
_SOFTMAX, _SIGMOID, _SQRTSOFTPLUS, _RAW = 0, 1, 2, 3
_SCORING_CODES = {"softmax": _SOFTMAX, "sigmoid": _SIGMOID, "sqrtsoftplus": _SQRTSOFTPLUS,
                  "none": _RAW}

_INT32_LOW31 = np.int32(0x7FFFFFFF)
# Order keys: int32 that sort like the float32 choices, -0 == +0, NaN below -inf.
_NAN_KEY = np.int32((int(np.float32(-np.inf).view(np.int32)) ^ 0x7FFFFFFF) - 1)  # key(-inf) - 1
_NO_KEY = np.int32(np.iinfo(np.int32).min)  # below every key: "nothing picked yet"


def _dtype_name(dtype) -> str:
    """'float32', 'float16', 'bfloat16', ... for NumPy, CuPy, torch and numba dtypes."""
    return str(dtype).rsplit(".", 1)[-1]
