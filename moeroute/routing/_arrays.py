"""Where an array lives, and how a kernel gets at it without a copy.

Host inputs (NumPy) take the CPU kernels. Device inputs take the CUDA kernels: numba device
arrays, anything with ``__cuda_array_interface__`` (CuPy arrays, torch CUDA tensors), or
anything whose ``__dlpack_device__`` says CUDA. Under ``NUMBA_ENABLE_CUDASIM=1`` the
simulator's device arrays count as device arrays, so the CUDA kernels run on the CPU.

Outputs of a device call are allocated by the caller's framework (`device_empty`: CuPy in,
CuPy out; torch in, torch out; otherwise numba device arrays). This
module never imports torch or CuPy: it only uses them when the caller's array already
comes from them.
"""

from __future__ import annotations

import sys

import numpy as np

_DLPACK_CUDA_DEVICES = (2, 13)  # kDLCUDA, kDLCUDAManaged


def simulator_enabled() -> bool:
    from numba import config

    return bool(config.ENABLE_CUDASIM)


def is_device_array(x) -> bool:
    """True when ``x`` lives on a CUDA device (or is a simulator device array)."""
    if isinstance(x, np.ndarray):
        return False
    if simulator_enabled():
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        if isinstance(x, FakeCUDAArray):
            return True
    try:
        if hasattr(x, "__cuda_array_interface__"):
            return True
    except RuntimeError:
        # torch raises (instead of AttributeError) for CUDA tensors that require grad.
        return True
    dlpack_device = getattr(x, "__dlpack_device__", None)
    if dlpack_device is not None:
        try:
            return dlpack_device()[0] in _DLPACK_CUDA_DEVICES
        except Exception:  # an object that claims DLPack but cannot answer is not ours
            return False
    return False


def as_device_array(x):
    """A numba device array viewing ``x`` (no copy, no synchronization).

    numba-cuda would otherwise synchronize on the stream named by the producer's
    ``__cuda_array_interface__`` (``NUMBA_CUDA_ARRAY_INTERFACE_SYNC``): a host wait per
    conversion, and an error under CUDA graph capture. The kernels are enqueued on the
    producer's current stream (`resolve_stream`), so stream order already covers it.
    """
    from numba import cuda

    if simulator_enabled():
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        if isinstance(x, FakeCUDAArray):
            return x
    if hasattr(x, "__cuda_array_interface__"):
        return cuda.as_cuda_array(x, sync=False)
    import cupy  # DLPack-only producers: CuPy imports them without a copy

    return cuda.as_cuda_array(cupy.from_dlpack(x), sync=False)


def framework_of(x) -> str:
    """"torch", "cupy" or "numba": which framework produced ``x``."""
    module = type(x).__module__
    if module.startswith("torch"):
        return "torch"
    if module.startswith("cupy"):
        return "cupy"
    return "numba"


def device_empty(shape, dtype, template, stream=None):
    """An uninitialised device array allocated by the framework of ``template``.

    Returns ``(array, view)``: ``array`` in the caller's framework (torch tensors from
    torch's caching allocator, CuPy arrays from CuPy's pool: no cudaMalloc per call),
    ``view`` a numba device array over the same memory for the kernels (no copy). Other
    callers (and the simulator) get a numba device array as both. This is the one place
    where the device ops allocate (scratch included), so under CUDA graph capture every
    buffer comes from the framework's graph-aware allocator.

    ``stream``: the numba stream the buffer is used on. torch allocates on its current
    stream; when ``stream`` is another one, the tensor is recorded on it
    (``Tensor.record_stream``), so the caching allocator does not hand the memory out
    again before that stream's work on it is done.
    """
    from numba import cuda

    shape = tuple(int(s) for s in shape)
    dtype = np.dtype(dtype)
    kind = framework_of(template)
    if kind == "torch" and not simulator_enabled():
        torch = sys.modules["torch"]
        array = torch.empty(shape, dtype=getattr(torch, dtype.name), device=template.device)
        _record_on_stream(torch, array, stream)
    elif kind == "cupy" and not simulator_enabled():
        cupy = sys.modules["cupy"]
        with template.device:
            array = cupy.empty(shape, dtype=dtype)
    else:
        array = cuda.device_array(shape, dtype=dtype, stream=stream or 0)
        return array, array
    if 0 in shape:
        # Nothing to view; kernels are not launched on empty outputs.
        return array, cuda.device_array(shape, dtype=dtype)
    return array, cuda.as_cuda_array(array, sync=False)


def stream_handle(stream) -> int:
    """The raw CUDA stream handle of a numba stream (0: the default stream)."""
    handle = getattr(stream, "handle", stream)
    return int(getattr(handle, "value", handle) or 0)


def _record_on_stream(torch, tensor, stream) -> None:
    """``tensor.record_stream`` on ``stream`` when it is not torch's current stream."""
    if stream is None or tensor.numel() == 0:
        return
    handle = stream_handle(stream)
    if handle != torch.cuda.current_stream(tensor.device).cuda_stream:
        tensor.record_stream(torch.cuda.ExternalStream(handle, device=tensor.device))


def resolve_stream(template, stream=None):
    """The numba stream to launch on: ``stream`` if given (a numba stream or a raw handle),
    else the current stream of the framework that produced ``template``."""
    from numba import cuda

    if stream is not None and not isinstance(stream, int):
        return stream
    if simulator_enabled():
        return cuda.default_stream()
    handle = stream
    if handle is None:
        kind = framework_of(template)
        if kind == "torch":
            handle = sys.modules["torch"].cuda.current_stream(template.device).cuda_stream
        elif kind == "cupy":
            handle = sys.modules["cupy"].cuda.get_current_stream().ptr
        else:
            handle = 0
    return cuda.external_stream(handle) if handle else cuda.default_stream()
