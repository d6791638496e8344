"""combine on a CUDA device: one block per (token, column tile); float16 natively, bfloat16
by a shift, rounded by `_common`'s rule."""

import numpy as np

from moeroute.routing import _sort
from moeroute.routing._arrays import simulator_enabled
from moeroute.routing.combine._common import _bf16_from_float_bits, _float_bits_from_bf16

try:
    from numba import cuda
except ImportError:  # pragma: no cover - CPU-only installs
    cuda = None


# Only the float32 <-> uint32 reinterpretation differs between the GPU (libdevice) and
# the simulator (which has no libdevice); the rounding arithmetic is shared.
def _float_as_bits_python(value):
    return np.array(value, dtype=np.float32).view(np.uint32)[()]


def _bits_as_float_python(bits):
    return np.array(bits, dtype=np.uint32).view(np.float32)[()]


def _float_as_bits_device(value):
    return np.uint32(cuda.libdevice.float_as_int(value))


def _bits_as_float_device(bits):
    return cuda.libdevice.int_as_float(np.int32(bits))


if cuda is None:  # pragma: no cover - CPU-only installs
    float_as_bits = bits_as_float = bf16_from_float_bits = float_bits_from_bf16 = None
elif simulator_enabled():
    float_as_bits, bits_as_float = _float_as_bits_python, _bits_as_float_python
    bf16_from_float_bits, float_bits_from_bf16 = _bf16_from_float_bits, _float_bits_from_bf16
else:
    float_as_bits = cuda.jit(device=True, inline="always")(_float_as_bits_device)
    bits_as_float = cuda.jit(device=True, inline="always")(_bits_as_float_device)
    bf16_from_float_bits = cuda.jit(device=True, inline="always")(_bf16_from_float_bits)
    float_bits_from_bf16 = cuda.jit(device=True, inline="always")(_float_bits_from_bf16)


def _combine_kernel(expert_out, inverse_index, weights, has_weights, out):
    """Block (t, c): columns ``c*blockDim + tid`` of token t (`row_launch_config`: 32-bit
    index math, no division); float32 or float16 activations."""
    t = cuda.blockIdx.x
    h = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if t < out.shape[0] and h < out.shape[1]:
        rows = expert_out.shape[0]
        acc = np.float32(0)
        for k in range(inverse_index.shape[1]):
            r = inverse_index[t, k]
            if r >= 0 and r < rows:
                w = np.float32(1)
                if has_weights:
                    w = weights[t, k]
                acc += w * np.float32(expert_out[r, h])
        out[t, h] = acc


def _combine_bf16_kernel(expert_bits, inverse_index, weights, has_weights, out_bits):
    """As `_combine_kernel`; bfloat16 activations as raw uint16 bits."""
    t = cuda.blockIdx.x
    h = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if t < out_bits.shape[0] and h < out_bits.shape[1]:
        rows = expert_bits.shape[0]
        acc = np.float32(0)
        for k in range(inverse_index.shape[1]):
            r = inverse_index[t, k]
            if r >= 0 and r < rows:
                w = np.float32(1)
                if has_weights:
                    w = weights[t, k]
                acc += w * bits_as_float(float_bits_from_bf16(expert_bits[r, h]))
        out_bits[t, h] = bf16_from_float_bits(float_as_bits(acc))


def _kernel(raw_bf16: bool):
    return _sort.jit_kernel(_combine_bf16_kernel if raw_bf16 else _combine_kernel)
