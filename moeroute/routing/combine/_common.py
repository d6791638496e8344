"""The bfloat16 rounding rule every combine kernel compiles (CPU, GPU, simulator)."""

import numpy as np

from moeroute.routing._float16 import BF16_SHIFT as _BF16_SHIFT

#: The quiet NaN torch writes for any NaN converted to bfloat16.
_BF16_NAN = 0x7FC0
#: Half of a bfloat16 ulp minus one, in float32 bits: the round-to-nearest-even bias.
_BF16_ROUND_BIAS = 0x7FFF
_FLOAT32_ABS_MASK = 0x7FFFFFFF
_FLOAT32_INF_BITS = 0x7F800000


def _bf16_from_float_bits(bits):
    """bfloat16 pattern of the float32 with bit pattern ``bits`` (uint32): rounded to
    nearest even, as torch does; any NaN becomes the quiet NaN 0x7FC0.

    One definition for the CPU (njit), the GPU (device function) and the simulator.
    """
    wide = np.int64(bits)  # room for the bias without wrapping
    if wide & _FLOAT32_ABS_MASK > _FLOAT32_INF_BITS:
        return np.uint16(_BF16_NAN)
    return np.uint16((wide + _BF16_ROUND_BIAS + ((wide >> _BF16_SHIFT) & 1)) >> _BF16_SHIFT)


def _float_bits_from_bf16(bits):
    """float32 bit pattern (uint32) of the bfloat16 pattern ``bits`` (uint16)."""
    return np.uint32(bits) << np.uint32(_BF16_SHIFT)
