"""Where an array lives, and how a kernel gets at it without a copy.

An array crosses into an op once: the op calls `enter(array, name)` for each input and gets
a `Boundary`, which answers, asked once at entry, the caller's framework ("numpy", "torch",
"cupy", "numba"), host or device, and the dtype (bfloat16 included, which NumPy lacks), and
keeps, once first used, the NumPy view of a host input (`Boundary.host`), the kernel view of
a device input (`Boundary.kernel`, bfloat16 as its 16-bit pattern on request) and its
contiguity. Results leave through the same object: `Boundary.wrap` hands NumPy results back
in the caller's framework, `Boundary.empty` allocates device outputs with the caller's
framework on its device, and `Boundary.stream` names the caller's current stream. The ops'
helpers take the boundary, not the array, so nothing below the op asks again.

Host inputs (NumPy) take the CPU kernels. Device inputs take the CUDA kernels: numba device
arrays, anything with ``__cuda_array_interface__`` (CuPy arrays, torch CUDA tensors), or
anything whose ``__dlpack_device__`` says CUDA. Under ``NUMBA_ENABLE_CUDASIM=1`` the
simulator's device arrays count as device arrays, so the CUDA kernels run on the CPU.

Outputs of a device call are allocated by the caller's framework (`device_empty`: CuPy in,
CuPy out; torch in, torch out; otherwise numba device arrays). This
module never imports torch or CuPy: it only uses them when the caller's array already
comes from them.

Host inputs may also be CPU torch tensors: `host_array` views their memory as NumPy (no
copy; bfloat16, which NumPy lacks, as its raw 16-bit pattern, never as NumPy floats) and
`as_caller` hands the NumPy results back as torch tensors over the same memory. The
free functions (`host_array`, `as_caller`, `is_device_array`, ...) remain for callers
outside the ops (the torch bindings, tests); the ops use their inputs' boundaries.
"""

from __future__ import annotations

import sys

import numpy as np

_DLPACK_CUDA_DEVICES = (2, 13)  # kDLCUDA, kDLCUDAManaged
#: Bound on NumPy's exact overlap search (``np.shares_memory``); past it the two arrays are
#: taken to overlap. With one C-contiguous side (every ``out=`` buffer) it needs far less.
SHARES_MEMORY_MAX_WORK = 1 << 20


_DTYPE_NAMES: dict = {}


def dtype_name(dtype) -> str:
    """'float32', 'float16', 'bfloat16', ... for NumPy, CuPy, torch and numba dtypes (and ""
    for None); remembered per dtype object, since ``str`` of a NumPy dtype costs microseconds."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        name = _DTYPE_NAMES[dtype] = "" if dtype is None else str(dtype).rsplit(".", 1)[-1]
        return name
    except TypeError:  # an unhashable dtype-like object
        return str(dtype).rsplit(".", 1)[-1]


def torch_of(x):
    """The torch module when ``x`` is a torch tensor, else None (torch is never imported)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return torch
    return None


def is_bfloat16(x) -> bool:
    """True for a bfloat16 array of any framework (torch, CuPy/NumPy with ml_dtypes)."""
    return dtype_name(getattr(x, "dtype", None)) == "bfloat16"


def host_array(x):
    """A NumPy view of a host input, without a copy.

    Parameters
    ----------
    x : numpy.ndarray, CPU torch tensor, or anything ``np.asarray`` takes

    Returns
    -------
    numpy.ndarray of ``x``'s shape. A CPU torch tensor is viewed through ``Tensor.numpy()``
    (detached; no copy); a bfloat16 tensor comes back as its raw bit pattern (``uint16``),
    never as NumPy floats: callers that accept bfloat16 check `is_bfloat16` on ``x``.
    Other inputs go through ``np.asarray`` (NumPy arrays are returned as they are).

    Raises
    ------
    ValueError
        ``x`` is a torch tensor that is not on the CPU (device tensors take the device path).
    """
    if isinstance(x, np.ndarray):
        return x
    return _host_view(x, torch_of(x))


def _host_view(x, torch):
    """`host_array` of a non-NumPy ``x``; ``torch``: `torch_of(x)`."""
    if torch is None:
        return np.asarray(x)
    if not x.is_cpu:  # cheaper than x.device.type, which builds a device object
        raise ValueError(f"host_array needs a CPU tensor, got one on {x.device}")
    if x.dtype is torch.bfloat16:
        x = x.detach().view(torch.uint16)
    # force=True: detach, resolve_conj, resolve_neg in one call (no copy for a CPU tensor
    # without the conjugate or negative bit), half the cost of the three calls.
    return x.numpy(force=True)


def as_caller(result, template, bfloat16: bool = False):
    """``result`` (a NumPy array or a Python scalar) in the framework of ``template``.

    A torch ``template`` gives a CPU torch tensor over the same memory
    (``torch.from_numpy``, no copy); ``bfloat16=True`` reinterprets a ``uint16`` result as
    bfloat16 (the raw bits `host_array` produced). Any other template returns ``result``
    as it is (NumPy in, NumPy out); scalars stay Python scalars.
    """
    torch = torch_of(template)
    if torch is None or not isinstance(result, np.ndarray):
        return result
    tensor = torch.from_numpy(result)
    return tensor.view(torch.bfloat16) if bfloat16 else tensor


def device_bits16(x):
    """A bfloat16 device array as its raw 16-bit pattern (int16 view, no copy): numba and
    CuPy know no bfloat16 (torch describes it as ``<V2`` in the CUDA array interface)."""
    torch = torch_of(x)
    if torch is not None:
        return x.view(torch.int16)
    return x.view(np.int16)


def from_device_bits16(array, template):
    """Undo `device_bits16` on a result allocated like ``template``: torch results become
    bfloat16 again (a view); other frameworks keep the int16 pattern (they have no bfloat16)."""
    torch = torch_of(template)
    if torch is not None and torch_of(array) is not None:
        return array.view(torch.bfloat16)
    return array


def host_floats(x):
    """`host_array` of a float input that the op reads as float32 (weights): a bfloat16
    torch tensor is converted by torch (never through NumPy floats), others are viewed."""
    torch = torch_of(x)
    if torch is not None and x.dtype == torch.bfloat16:
        x = x.detach().float()
    return host_array(x)


def simulator_enabled() -> bool:
    from numba import config

    return bool(config.ENABLE_CUDASIM)


def is_device_array(x) -> bool:
    """True when ``x`` lives on a CUDA device (or is a simulator device array)."""
    if isinstance(x, np.ndarray):
        return False
    torch = torch_of(x)
    if torch is not None:  # the common case, answered without the interface probes below
        return x.is_cuda
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
    """ "torch", "cupy" or "numba": which framework produced ``x``."""
    module = type(x).__module__
    if module.startswith("torch"):
        return "torch"
    if module.startswith("cupy"):
        return "cupy"
    return "numba"


class Boundary:
    """One array at an op's entry: what it is, asked once, and the way results go back.

    Made by `enter` when an op is called; the op and its helpers then read these answers
    instead of asking this module again.

    Attributes (answered at entry)
    ------------------------------
    array : the caller's array, as given
    name : the argument's name, for error messages
    torch : the torch module when ``array`` is a torch tensor, else None
    framework : "numpy", "torch", "cupy" or "numba" ("other" for a host object such as a
        list); a device array's framework allocates the outputs and names the stream
    on_device : whether ``array`` lives on a CUDA device (or is a simulator device array)
    bfloat16 : whether the dtype is bfloat16

    Kept after their first use: the dtype's name (`dtype`), the NumPy view of a host array
    (`host`), the kernel view of a device array (`kernel`), its contiguity (`contiguous`).
    Results leave through `wrap` (host) or are allocated in the caller's framework by
    `empty` (device).
    """

    __slots__ = (
        "array",
        "name",
        "torch",
        "framework",
        "on_device",
        "bfloat16",
        "_dtype",
        "_host",
        "_kernel",
        "_contiguous",
    )

    def __init__(self, array, name="array"):
        self.array = array
        self.name = name
        self._dtype = self._host = self._kernel = self._contiguous = None
        if isinstance(array, np.ndarray):  # the common host case, no further probe
            self.torch, self.framework, self.on_device = None, "numpy", False
            self.bfloat16 = self.dtype == "bfloat16"
            return
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(array, torch.Tensor):
            self.torch, self.framework, self.on_device = torch, "torch", array.is_cuda
            self.bfloat16 = array.dtype is torch.bfloat16
            return
        self.torch = None
        self.on_device = is_device_array(array)
        self.framework = framework_of(array) if self.on_device else "other"
        self.bfloat16 = self.dtype == "bfloat16"

    @property
    def dtype(self) -> str:
        """The dtype's name ("float32", "bfloat16", ...; "" for an object without one)."""
        if self._dtype is None:
            self._dtype = dtype_name(getattr(self.array, "dtype", None))
        return self._dtype

    def __repr__(self):
        where = "device" if self.on_device else "host"
        return f"Boundary({self.name}: {self.framework} {self.dtype} on the {where})"

    def host(self) -> np.ndarray:
        """`host_array` of a host input: its NumPy view (no copy; bfloat16 as its raw bits)."""
        if self._host is None:
            array = self.array
            self._host = array if self.framework == "numpy" else _host_view(array, self.torch)
        return self._host

    def host_floats(self) -> np.ndarray:
        """`host_floats` of a host input: bfloat16 torch tensors converted by torch."""
        if self.torch is not None and self.bfloat16:
            return _host_view(self.array.detach().float(), self.torch)
        return self.host()

    def wrap(self, result, bfloat16: bool = False):
        """`as_caller`: a host ``result`` (NumPy or scalar) in this input's framework."""
        torch = self.torch
        if torch is None or not isinstance(result, np.ndarray):
            return result
        tensor = torch.from_numpy(result)
        return tensor.view(torch.bfloat16) if bfloat16 else tensor

    def kernel(self, launcher: str = "numba", bits16: bool = False):
        """The device array as the kernels take it under ``launcher``: the array itself for
        the cached launcher, a numba device array view (`as_device_array`) for numba's;
        with ``bits16`` a bfloat16 array as its int16 pattern (`device_bits16`)."""
        kept = self._kernel
        if kept is not None and kept[0] == (launcher, bits16):
            return kept[1]
        array = self.array
        if bits16 and self.bfloat16:
            array = array.view(self.torch.int16 if self.torch is not None else np.int16)
        view = array if launcher == "cached" else as_device_array(array)
        self._kernel = ((launcher, bits16), view)
        return view

    def from_bits16(self, result):
        """Undo ``kernel(bits16=True)`` on a result allocated by `empty`: a torch result is
        bfloat16 again (a view); other frameworks keep the int16 pattern (`from_device_bits16`)."""
        torch = self.torch
        if self.bfloat16 and torch is not None and isinstance(result, torch.Tensor):
            return result.view(torch.bfloat16)
        return result

    def contiguous(self) -> bool:
        """`is_c_contiguous` of the device array."""
        if self._contiguous is None:
            array = self.array
            if self.framework == "torch":
                self._contiguous = array.is_contiguous()
            elif self.framework == "cupy":
                self._contiguous = bool(array.flags.c_contiguous)
            else:
                self._contiguous = self.kernel().is_c_contiguous()
        return self._contiguous

    def stream(self, stream=None, launcher: str = "numba"):
        """The stream to launch on: ``stream`` if given, else the current stream of this
        array's framework; a raw handle (int) for the cached launcher, a numba stream
        (`resolve_stream`) for numba's."""
        if launcher == "cached":
            if stream is not None:
                return stream_handle(stream)
            return current_stream_handle(self.framework, self.array)
        return _resolve_stream(self.framework, self.array, stream)

    def empty(self, shape, dtype, stream=None, view=True):
        """`device_empty` in this array's framework and on its device."""
        return device_empty(shape, dtype, self, stream, view)


def enter(array, name: str = "array") -> Boundary:
    """The `Boundary` of an op's input ``array``: the one call through which an op asks
    what an array is (framework, host or device, dtype)."""
    return Boundary(array, name)


def device_empty(shape, dtype, template, stream=None, view=True):
    """An uninitialised device array allocated by the framework of ``template``.

    Returns ``(array, view)``: ``array`` in the caller's framework (torch tensors from
    torch's caching allocator, CuPy arrays from CuPy's pool: no cudaMalloc per call),
    ``view`` a numba device array over the same memory for the kernels (no copy), or
    ``array`` itself when ``view=False`` (the cached launcher reads torch and CuPy arrays
    directly). Other
    callers (and the simulator) get a numba device array as both. This is the one place
    where the device ops allocate (scratch included), so under CUDA graph capture every
    buffer comes from the framework's graph-aware allocator.

    ``template``: the caller's device array, or its `Boundary` (whose framework is not
    asked again). Allocation happens in this function's own body: the simulator suite
    takes its code object as the one allowed gateway to ``cuda.device_array``.

    ``stream``: the numba stream (or raw handle) the buffer is used on. torch allocates on its current
    stream; when ``stream`` is another one, the tensor is recorded on it
    (``Tensor.record_stream``), so the caching allocator does not hand the memory out
    again before that stream's work on it is done.
    """
    from numba import cuda

    if isinstance(template, Boundary):
        kind, template = template.framework, template.array
    else:
        kind = framework_of(template)
    shape = tuple(int(s) for s in shape)
    dtype = np.dtype(dtype)
    if kind == "torch" and not simulator_enabled():
        torch = sys.modules["torch"]
        array = torch.empty(shape, dtype=getattr(torch, dtype.name), device=template.device)
        _record_on_stream(torch, array, stream)
    elif kind == "cupy" and not simulator_enabled():
        cupy = sys.modules["cupy"]
        with template.device:
            array = cupy.empty(shape, dtype=dtype)
    else:
        numba_stream = 0 if isinstance(stream, int) else stream or 0
        array = cuda.device_array(shape, dtype=dtype, stream=numba_stream)
        return array, array
    if not view:
        return array, array
    if 0 in shape:
        # Nothing to view; kernels are not launched on empty outputs.
        return array, cuda.device_array(shape, dtype=dtype)
    return array, cuda.as_cuda_array(array, sync=False)


def column_view(x):
    """A [n, 1] view of device array ``x`` of shape [n] (or [1, 1] of a 0-d one), no copy.

    numba's ``DeviceNDArray.reshape`` refuses a strided vector ("operation requires
    copying") although the view exists (strides (s, s)), so a numba array is viewed by
    hand; torch and CuPy reshape to a view themselves.
    """
    if x.ndim == 1 and hasattr(x, "gpu_data") and not x.is_c_contiguous():
        from numba.cuda.cudadrv.devicearray import DeviceNDArray

        stride = x.strides[0]
        return DeviceNDArray(shape=(int(x.shape[0]), 1), strides=(stride, stride), dtype=x.dtype, gpu_data=x.gpu_data)
    return x.reshape(1 if x.ndim == 0 else int(x.shape[0]), 1)


def is_c_contiguous(x) -> bool:
    """True when device array ``x`` (numba, CuPy, torch) is C-contiguous."""
    if framework_of(x) == "torch":
        return x.is_contiguous()
    flags = getattr(x, "flags", None)
    if flags is not None and hasattr(flags, "c_contiguous"):  # CuPy
        return bool(flags.c_contiguous)
    return x.is_c_contiguous()


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
    return _resolve_stream(framework_of(template), template, stream)


def _resolve_stream(kind, template, stream):
    """`resolve_stream` for a ``template`` of framework ``kind``."""
    from numba import cuda

    if stream is not None and not isinstance(stream, int):
        return stream
    if simulator_enabled():
        return cuda.default_stream()
    handle = stream
    if handle is None:
        handle = current_stream_handle(kind, template)
    return cuda.external_stream(handle) if handle else cuda.default_stream()


def current_stream_handle(kind, template) -> int:
    """The raw handle of the current stream of framework ``kind`` ("torch": on
    ``template``'s device; "cupy"; anything else: 0, the default stream)."""
    if kind == "torch":
        return sys.modules["torch"].cuda.current_stream(template.device).cuda_stream
    if kind == "cupy":
        return sys.modules["cupy"].cuda.get_current_stream().ptr
    return 0


# --------------------------------------------------------------------------------------
# Overlap of out= buffers with the other arrays of a call
# --------------------------------------------------------------------------------------


def _host_memory(x):
    """The NumPy array over ``x``'s memory for a host array (NumPy, CPU torch) or a
    simulator device array, else None (a real device array)."""
    if isinstance(x, np.ndarray):
        return x
    torch = torch_of(x)
    if torch is not None and x.device.type == "cpu":
        return host_array(x)
    if simulator_enabled():
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        if isinstance(x, FakeCUDAArray):
            return x._ary
    return None


def _span(start: int, shape, strides, item: int) -> tuple[int, int] | None:
    if 0 in tuple(shape):
        return None
    low = start + sum(min(0, (n - 1) * s) for n, s in zip(shape, strides))
    high = start + sum(max(0, (n - 1) * s) for n, s in zip(shape, strides)) + item
    return low, high


def memory_span(x) -> tuple[str, int, int] | None:
    """``(space, first, last + 1)``: the byte addresses of the elements of array ``x``, in
    "host" or "device" memory, from its framework's own description (NumPy's array
    interface, torch's ``data_ptr``/``stride``, else the CUDA array interface: data
    pointer, shape, strides, item size); None when ``x`` is empty."""
    if isinstance(x, np.ndarray) and x.flags.c_contiguous:  # the common case, no loop
        start = x.__array_interface__["data"][0]
        return None if x.size == 0 else ("host", start, start + x.nbytes)
    torch = torch_of(x)
    if torch is not None:
        space = "host" if x.device.type == "cpu" else "device"
        item = x.element_size()
        if x.is_contiguous():
            start = x.data_ptr()
            return None if x.numel() == 0 else (space, start, start + x.numel() * item)
        span = _span(x.data_ptr(), tuple(x.shape), tuple(s * item for s in x.stride()), item)
    else:
        host = _host_memory(x)
        if host is not None:
            interface, space = host.__array_interface__, "host"
        else:
            if not hasattr(x, "__cuda_array_interface__"):
                x = as_device_array(x)
            interface, space = x.__cuda_array_interface__, "device"
        shape = tuple(interface["shape"])
        item = np.dtype(interface["typestr"]).itemsize
        strides = interface.get("strides")
        if strides is None:  # C-contiguous
            strides, step = [], item
            for n in reversed(shape):
                strides.insert(0, step)
                step *= n
        span = _span(int(interface["data"][0]), shape, strides, item)
    return None if span is None else (space, *span)


def overlaps(a, b) -> bool:
    """Whether arrays ``a`` and ``b`` share any byte of memory.

    Two NumPy arrays: ``np.may_share_memory`` (their bounds, in C), then, when the bounds
    meet, ``np.shares_memory`` (exact, so interleaved strided views that share no element
    pass; taken as overlapping when the search would exceed `SHARES_MEMORY_MAX_WORK`).
    Otherwise their byte spans (`memory_span`) first: disjoint spans, or one on the host and
    one on a device, never overlap; host arrays (CPU torch) whose spans meet are then
    compared exactly as above, device arrays whose spans meet count as overlapping.
    """
    return _overlapping(a, b, memory_span)


def _overlapping(a, b, span_of) -> bool:
    """`overlaps`, with ``span_of(array)`` giving `memory_span` (memoized by the caller)."""
    if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
        span_a, span_b = span_of(a), span_of(b)
        if span_a is None or span_b is None or span_a[0] != span_b[0]:
            return False
        if not (span_a[1] < span_b[2] and span_b[1] < span_a[2]):
            return False
        if span_a[0] == "device":
            return True
        a, b = _host_memory(a), _host_memory(b)
    elif not np.may_share_memory(a, b):
        return False
    try:
        return bool(np.shares_memory(a, b, max_work=SHARES_MEMORY_MAX_WORK))
    except np.exceptions.TooHardError:
        return True


def check_no_overlap(outputs: dict, inputs: dict) -> None:
    """ValueError when a buffer an op writes overlaps another one it writes or an array it
    reads: a kernel would read what it has already overwritten, or two outputs would
    overwrite each other (``out=(w, w.view(np.int32))``). No alias is allowed, exact or
    partial.

    Parameters
    ----------
    outputs : {argument name: array}
        The buffers the op writes (``out=``).
    inputs : {argument name: array or None}
        The arrays it reads; None entries (optional arguments not given) are skipped.
    """
    spans = {}

    def span_of(array):  # each array's span computed once
        if id(array) not in spans:
            spans[id(array)] = memory_span(array)
        return spans[id(array)]

    written = list(outputs.items())
    read = [(n, a) for n, a in inputs.items() if a is not None]
    for index, (name, buffer) in enumerate(written):
        for other_name, other in written[index + 1 :] + read:
            if _overlapping(buffer, other, span_of):
                raise ValueError(
                    f"{name} overlaps {other_name} in memory; pass an out= buffer "
                    "that shares no memory with the op's other arguments"
                )
