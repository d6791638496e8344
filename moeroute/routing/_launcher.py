"""Launch the routing kernels without numba-cuda's per-call argument marshalling.

numba-cuda spends host time on every launch, and more for every array argument (typing
every argument, wrapping foreign arrays, building ctypes values), which adds up at decode
sizes, where the kernels themselves are short (bench/launch_overhead.py measures it). For
a kernel whose signature is fixed, none of that has to happen per call:

* once per (kernel, signature): numba compiles the kernel to PTX (`cuda.compile_ptx`, which
  links libdevice, so the PTX is self-contained), nvJitLink turns it into a cubin, and the
  argument layout of numba's kernel ABI is fixed (`make_packer`);
* once per device: CuPy loads the cubin (``cupy.cuda.function.Module``) and keeps the
  kernel's function handle;
* per call: the arguments are flattened straight from torch tensors (``data_ptr()``,
  ``shape``, ``stride()``), CuPy arrays (``.data.ptr``) or numba device arrays into the
  list CuPy's launcher takes, and the kernel goes on the caller's stream. No DLPack, no
  ``__cuda_array_interface__`` (so no stream sync), no allocation.

Every routing kernel launches through `launch`. A caller may state the signature (select
does); otherwise it is read from the arguments (`signature_of`: numba's typing of the same
memory, looked up per dtype/rank/layout), so the cubin is the specialisation numba's
dispatcher would have compiled for those arguments.

numba's kernel ABI: every array argument is numba's array struct, passed field by field:
meminfo, parent, nitems, itemsize, data, shape[ndim], strides[ndim] (all 64-bit); scalars
are passed as their numba type. ``parameter_types`` states that list in PTX types and the
tests compare it with the ``.entry`` parameters numba emits.

Which launcher runs is chosen by ``MOEROUTE_CUDA_LAUNCHER``:

* ``auto`` (default): the cached launcher when CuPy (a CUDA build) sees a device, else numba;
* ``numba``: always numba's dispatcher (``kernel[grid, block, stream](...)``);
* ``cached``: always the cached launcher; a launch raises RuntimeError saying why when it
  cannot run (under the CUDA simulator, without CuPy or without a device).

Under the CUDA simulator ``auto`` is numba: the simulator keeps running the same kernels.
"""

from __future__ import annotations

import re
import threading
from functools import lru_cache

import numpy as np
from numba.core import types

from moeroute._validate import environ_choice
from moeroute.routing import _arrays

LAUNCHER_ENV = "MOEROUTE_CUDA_LAUNCHER"
LAUNCHERS = ("auto", "numba", "cached")
# numba's array struct before shape and strides: meminfo, parent, nitems, itemsize, data.
ARRAY_HEADER_FIELDS = ("meminfo", "parent", "nitems", "itemsize", "data")

# PTX parameter type of each scalar numba type (what numba's NVVM backend emits).
_SCALAR_PTX_TYPES = {
    types.int64: "u64",
    types.uint64: "u64",
    types.int32: "u32",
    types.uint32: "u32",
    types.int16: "u16",
    types.uint16: "u16",
    types.int8: "u8",
    types.uint8: "u8",
    types.float64: "f64",
    types.float32: "f32",
    types.float16: "u16",
    types.boolean: "u8",
}
# Python value CuPy's launcher turns into exactly that many bytes: it passes an int as
# int64 and a float as float64, NumPy scalars at their own size.
_SCALAR_CONVERTERS = {
    types.int64: int,
    types.uint64: int,
    types.int32: np.int32,
    types.uint32: np.uint32,
    types.int16: np.int16,
    types.uint16: np.uint16,
    types.int8: np.int8,
    types.uint8: np.uint8,
    types.float64: float,
    types.float32: np.float32,
    types.float16: np.float16,
    types.boolean: np.bool_,
}


# --------------------------------------------------------------------------------------
# The argument layout of numba's kernel ABI
# --------------------------------------------------------------------------------------


def parameter_types(signature) -> list[str]:
    """The PTX ``.param`` types of the kernel entry numba emits for ``signature``, in order.

    An array of ndim d is 5 + 2 d ``u64`` fields (`ARRAY_HEADER_FIELDS`, shape, strides);
    a scalar is one parameter of its own PTX type. ValueError for a type the launcher does
    not marshal (records, tuples, complex numbers, ...).
    """
    found = []
    for position, argument_type in enumerate(signature):
        if isinstance(argument_type, types.Array):
            found += ["u64"] * (len(ARRAY_HEADER_FIELDS) + 2 * argument_type.ndim)
        elif argument_type in _SCALAR_PTX_TYPES:
            found.append(_SCALAR_PTX_TYPES[argument_type])
        else:
            scalars = sorted(map(str, _SCALAR_PTX_TYPES))
            raise ValueError(
                f"argument {position} has type {argument_type}, which the cached "
                f"launcher does not marshal (arrays and {scalars})"
            )
    return found


_ENTRY = re.compile(r"\.entry\s+([\w$]+)\s*\(([^)]*)\)")
_PARAM = re.compile(r"\.param\s+\.(\w+)")


def parse_entry(ptx: str) -> tuple[str, list[str]]:
    """(mangled name, parameter PTX types) of the one ``.entry`` in numba's ``ptx``."""
    entries = _ENTRY.findall(ptx)
    if len(entries) != 1:
        raise ValueError(f"expected one .entry in the PTX, found {len(entries)}")
    name, parameters = entries[0]
    return name, _PARAM.findall(parameters)


def _torch_fields(x):
    itemsize = x.element_size()
    return x.data_ptr(), x.shape, [s * itemsize for s in x.stride()], itemsize


def _cupy_fields(x):
    return x.data.ptr, x.shape, x.strides, x.itemsize


def _numba_fields(x):
    return x.device_ctypes_pointer.value or 0, x.shape, x.strides, x.dtype.itemsize


_FIELD_READERS: dict = {}  # array type -> one of the readers above


def _reader(x):
    """How to read (data pointer, shape, byte strides, itemsize) from arrays of x's type,
    by the attributes they have: torch's ``data_ptr``, numba's ``device_ctypes_pointer``,
    CuPy's ``data.ptr``."""
    kind = type(x)
    reader = _FIELD_READERS.get(kind)
    if reader is None:
        if callable(getattr(x, "data_ptr", None)):
            reader = _torch_fields
        elif hasattr(x, "device_ctypes_pointer"):
            reader = _numba_fields
        elif hasattr(getattr(x, "data", None), "ptr"):
            reader = _cupy_fields
        else:
            raise TypeError(
                f"the cached launcher takes torch tensors, CuPy arrays or numba device arrays, got {kind.__name__}"
            )
        _FIELD_READERS[kind] = reader
    return reader


def _wrong_array(position, array_type, shape, itemsize):
    raise ValueError(
        f"argument {position} must be a {array_type.ndim}-D array of "
        f"{array_type.dtype.bitwidth // 8}-byte items ({array_type}), got shape "
        f"{tuple(shape)} of {itemsize}-byte items"
    )


def _not_contiguous(position, array_type, strides):
    raise ValueError(f"argument {position} must be C-contiguous ({array_type}), got strides {tuple(strides)}")


def _array_source(k, array_type):
    """Lines of the generated packer reading array argument ``k``, and its ABI fields."""
    ndim = array_type.ndim
    if ndim == 0:
        raise ValueError(
            f"argument {k} is a 0-D array ({array_type}); the cached launcher marshals arrays of 1 or more dimensions"
        )
    itemsize = array_type.dtype.bitwidth // 8
    extents = [f"e{k}_{j}" for j in range(ndim)]
    strides = [f"f{k}_{j}" for j in range(ndim)]
    lines = [
        f"p{k}, s{k}, t{k}, w{k} = (readers_get(type(x{k})) or reader(x{k}))(x{k})",
        f"if len(s{k}) != {ndim} or w{k} != {itemsize}: wrong_array({k}, types[{k}], s{k}, w{k})",
        f"{', '.join(extents)}, = s{k}",
        f"{', '.join(strides)}, = t{k}",
    ]
    if array_type.layout == "C":
        # Size-1 dimensions may have any stride (torch gives them arbitrary ones).
        terms, expected = [], str(itemsize)
        for j in reversed(range(ndim)):
            terms.append(f"({strides[j]} == {expected} or {extents[j]} == 1)")
            expected = f"{expected} * {extents[j]}"
        lines.append(f"if not ({' and '.join(terms)}): not_contiguous({k}, types[{k}], t{k})")
    fields = ["0", "0", " * ".join(extents), str(itemsize), f"p{k}", *extents, *strides]
    return lines, fields


def make_packer(signature):
    """A function ``pack(args) -> list`` flattening ``args`` into numba's kernel ABI.

    Parameters
    ----------
    signature : sequence of numba types
        The kernel's argument types (arrays and the scalars of `parameter_types`).

    Returns
    -------
    pack(args) : the kernel parameters in order, one value per PTX parameter: Python ints
        for the 64-bit fields, NumPy scalars of the parameter's width for the others (what
        CuPy's launcher copies at the right size). Arrays are torch tensors, CuPy arrays or
        numba device arrays (any object with the same attributes); ValueError when one
        has the wrong ndim or item size, or is not C-contiguous where the signature says
        C. Element dtypes are the calling op's to validate (at its boundary).

    The function is generated once per signature (straight-line code, no per-argument
    loop or call): it is the launcher's whole per-call Python work besides the launch.
    """
    signature = tuple(signature)
    parameter_types(signature)  # refuses what cannot be marshalled, naming it
    count = len(signature)
    body = [f"if len(args) != {count}: raise TypeError(f'the kernel takes {count} arguments, got {{len(args)}}')"]
    if count:
        body.append(f"{''.join(f'x{k}, ' for k in range(count))}= args")
    fields = []
    namespace = {
        "readers_get": _FIELD_READERS.get,
        "reader": _reader,
        "types": signature,
        "wrong_array": _wrong_array,
        "not_contiguous": _not_contiguous,
    }
    for k, argument_type in enumerate(signature):
        if isinstance(argument_type, types.Array):
            lines, array_fields = _array_source(k, argument_type)
            body += lines
            fields += array_fields
        else:
            namespace[f"convert{k}"] = _SCALAR_CONVERTERS[argument_type]
            fields.append(f"convert{k}(x{k})")
    body.append(f"return [{', '.join(fields)}]")
    source = "def pack(args):\n" + "".join(f"    {line}\n" for line in body)
    exec(compile(source, f"<moeroute packer {signature}>", "exec"), namespace)
    pack = namespace["pack"]
    pack.source = source
    return pack


# --------------------------------------------------------------------------------------
# The signature of a launch, from its arguments
# --------------------------------------------------------------------------------------

# Python scalars as numba's dispatcher types them.
_PYTHON_SCALAR_TYPES = {int: types.int64, float: types.float64, bool: types.boolean}
_SCALAR_TYPES: dict = {}  # Python or NumPy scalar type -> numba type
_ARRAY_TYPES: dict = {}  # (dtype name, ndim, layout) -> numba array type


def _array_type(dtype_name: str, ndim: int, layout: str):
    key = (dtype_name, ndim, layout)
    found = _ARRAY_TYPES.get(key)
    if found is None:
        from numba import from_dtype

        found = _ARRAY_TYPES[key] = types.Array(from_dtype(np.dtype(dtype_name)), ndim, layout)
    return found


def _torch_layout(x) -> str:
    """numba's layout letter of torch tensor ``x``: "C", "F" (Fortran-contiguous) or "A"."""
    if x.is_contiguous():
        return "C"
    ndim = x.dim()
    if ndim > 1 and x.permute(*reversed(range(ndim))).is_contiguous():
        return "F"
    return "A"


def argument_type(x):
    """The numba type numba's dispatcher gives kernel argument ``x``.

    Arrays: numba device arrays carry theirs; torch tensors and CuPy arrays are typed by
    dtype, ndim and layout ("C" when C-contiguous, else "F" when Fortran-contiguous, else
    "A"), as ``numba.typeof`` types the same memory. Scalars: Python int, float and bool as
    int64, float64 and boolean; NumPy scalars as their own dtype. TypeError otherwise
    (bfloat16 has no numba type: the ops pass it as its int16 bits).
    """
    kind = type(x)
    found = _SCALAR_TYPES.get(kind)
    if found is not None:
        return found
    if kind in _PYTHON_SCALAR_TYPES or isinstance(x, np.generic):
        if kind in _PYTHON_SCALAR_TYPES:
            found = _PYTHON_SCALAR_TYPES[kind]
        else:
            from numba import from_dtype

            found = from_dtype(x.dtype)
        _SCALAR_TYPES[kind] = found
        return found
    numba_type = getattr(x, "_numba_type_", None)
    if numba_type is not None:
        return numba_type
    if callable(getattr(x, "data_ptr", None)):  # torch
        dtype_name = _arrays.dtype_name(x.dtype)
        if dtype_name == "bfloat16":
            raise TypeError("bfloat16 tensors have no numba type; pass their int16 bits")
        return _array_type(dtype_name, x.dim(), _torch_layout(x))
    flags = getattr(x, "flags", None)
    if flags is not None and hasattr(x, "dtype"):  # CuPy
        layout = "C" if flags.c_contiguous else "F" if flags.f_contiguous else "A"
        return _array_type(np.dtype(x.dtype).name, x.ndim, layout)
    raise TypeError(
        f"cannot type kernel argument of type {kind.__name__}: the launcher takes "
        f"torch tensors, CuPy arrays, numba device arrays and scalars"
    )


def _argument_key(x):
    """What `argument_type` of ``x`` depends on, read cheaply: the Python type of a scalar;
    dtype, rank and contiguity of a torch or CuPy array; a numba array's own type."""
    kind = type(x)
    if kind in _PYTHON_SCALAR_TYPES or kind in _SCALAR_TYPES:
        return kind
    dim = getattr(x, "dim", None)
    if dim is not None:  # torch: by layout letter, so the keys stay few whatever the shapes
        return x.dtype, dim(), "C" if x.is_contiguous() else _torch_layout(x)
    numba_type = getattr(x, "_numba_type_", None)
    if numba_type is not None:
        return numba_type
    if isinstance(x, np.generic):  # a NumPy scalar not typed yet (it has flags too)
        return kind
    flags = getattr(x, "flags", None)
    if flags is not None:
        return (x.dtype, x.ndim, flags.c_contiguous, flags.f_contiguous)
    return kind  # an argument argument_type refuses


_SIGNATURES: dict = {}  # tuple of _argument_key -> signature (one tuple object per key)


def signature_of(args) -> tuple:
    """The kernel signature of ``args``: `argument_type` of each.

    Looked up by cheap per-argument keys (`_argument_key`), so a launch whose arguments
    have the dtypes, ranks and layouts of an earlier one reuses that signature object,
    without typing anything (numba types hash slowly).
    """
    key = tuple(map(_argument_key, args))
    found = _SIGNATURES.get(key)
    if found is None:
        found = _SIGNATURES.setdefault(key, tuple(argument_type(x) for x in args))
    return found


# --------------------------------------------------------------------------------------
# Which launcher runs
# --------------------------------------------------------------------------------------


def requested_launcher() -> str:
    """The value of MOEROUTE_CUDA_LAUNCHER ("auto" when unset); ValueError for others."""
    return environ_choice(LAUNCHER_ENV, LAUNCHERS, "auto", "which launcher starts the routing CUDA kernels")


@lru_cache(maxsize=None)
def _cached_unavailable_reason(simulated: bool) -> str | None:
    if simulated:
        return "the CUDA simulator runs kernels through numba's dispatcher"
    try:
        import cupy
    except ImportError as error:
        return f"CuPy is not installed ({error})"
    try:
        if cupy.cuda.runtime.is_hip:
            return "CuPy is a ROCm build; the numba.cuda kernels need CUDA"
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "CuPy sees no CUDA device"
    except Exception as error:  # no driver, no device: CuPy raises its runtime error
        return f"CuPy cannot reach a CUDA device ({type(error).__name__}: {error})"
    return None


def cached_unavailable_reason() -> str | None:
    """Why the cached launcher cannot run here, or None when it can."""
    return _cached_unavailable_reason(_arrays.simulator_enabled())


@lru_cache(maxsize=None)
def _resolve(requested: str, simulated: bool) -> str:
    if requested == "numba" or (requested == "auto" and _cached_unavailable_reason(simulated)):
        return "numba"
    return "cached"


def active_launcher() -> str:
    """ "cached" or "numba": the launcher the routing ops use now (MOEROUTE_CUDA_LAUNCHER,
    resolved against what this process can run; see the module docstring)."""
    return _resolve(requested_launcher(), _arrays.simulator_enabled())


# --------------------------------------------------------------------------------------
# The cached kernel
# --------------------------------------------------------------------------------------


class _Stream:
    """What CuPy's launcher reads a stream from (its ``ptr``)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


# numba.cuda.jit options compile_ptx reproduces; a kernel with other options set (linked
# files, extensions, ...) stays on numba's dispatcher.
_PTX_OPTIONS = ("debug", "lineinfo", "fastmath", "opt", "launch_bounds")
_IGNORED_OPTIONS = ("device", "inline", "forceinline", "lto", "shared_memory_carveout")


def compile_image(dispatcher, signature, arch: str):
    """(cubin bytes, entry name, PTX) of ``dispatcher``'s kernel at ``signature`` for ``arch``
    ("sm_90"), without a GPU: numba's PTX (libdevice included), linked by nvJitLink.

    Raises
    ------
    RuntimeError
        the kernel uses numba.cuda.jit options the cached launcher cannot reproduce.
    """
    from numba import cuda

    options = dict(dispatcher.targetoptions)
    unsupported = {
        k: v
        for k, v in options.items()
        if k not in _PTX_OPTIONS + _IGNORED_OPTIONS and v not in (None, (), [], False, 0)
    }
    if unsupported:
        raise RuntimeError(f"the cached launcher cannot reproduce the jit options {unsupported}")
    cc = (int(arch[3:-1]), int(arch[-1]))
    ptx, _ = cuda.compile_ptx(
        dispatcher.py_func, tuple(signature), cc=cc, **{k: options[k] for k in _PTX_OPTIONS if k in options}
    )
    name, _ = parse_entry(ptx)
    from cuda.core import Linker, LinkerOptions, ObjectCode

    linked = Linker(ObjectCode.from_ptx(ptx.encode()), options=LinkerOptions(arch=arch)).link("cubin")
    return bytes(linked.code), name, ptx


class CachedKernel:
    """One numba.cuda kernel at one signature, loaded once per device through CuPy."""

    def __init__(self, dispatcher, signature):
        self.dispatcher = dispatcher
        self.signature = signature if type(signature) is tuple else tuple(signature)
        self.pack = make_packer(self.signature)
        self._functions = {}  # device id -> cupy.cuda.function.Function
        self._lock = threading.Lock()

    def function(self, device_id: int):
        """The loaded kernel on ``device_id`` (compiled and loaded on first use)."""
        function = self._functions.get(device_id)
        if function is None:
            with self._lock:
                function = self._functions.get(device_id)
                if function is None:
                    function = self._functions[device_id] = self._load(device_id)
        return function

    def _load(self, device_id: int):
        import cupy

        from moeroute.routing import _cubins

        device = cupy.cuda.Device(device_id)
        cubin, name = _cubins.load_or_compile(
            self.dispatcher, self.signature, f"sm_{device.compute_capability}", compile_image
        )
        with device:
            module = cupy.cuda.function.Module()
            module.load(cubin)
            return module.get_function(name)

    def __call__(self, griddim, blockdim, stream_handle: int, args):
        """Launch on the current CUDA device, on the raw stream ``stream_handle``."""
        import cupy

        function = self._functions.get(cupy.cuda.runtime.getDevice())
        if function is None:
            function = self.function(cupy.cuda.runtime.getDevice())
        function(griddim, blockdim, self.pack(args), 0, _Stream(stream_handle))


_CACHE: dict = {}  # (dispatcher, signature) -> CachedKernel
# (dispatcher, id(signature)) -> (CachedKernel, signature): the per-call lookup. The ops'
# signatures come from lru-cached functions or `signature_of`, one tuple object each, so
# the identity of the tuple finds the kernel without hashing numba types (slow per
# type); the entry holds the tuple, so its id is never reused while the entry exists.
_BY_IDENTITY: dict = {}


def cached_kernel(dispatcher, signature) -> CachedKernel:
    """The CachedKernel of ``dispatcher`` at ``signature``, built once (the device
    modules inside it are loaded once per device)."""
    found = _BY_IDENTITY.get((dispatcher, id(signature)))
    if found is not None:
        return found[0]
    key = (dispatcher, tuple(signature))
    kernel = _CACHE.get(key)
    if kernel is None:
        kernel = _CACHE.setdefault(key, CachedKernel(dispatcher, signature))
    _BY_IDENTITY[(dispatcher, id(signature))] = kernel, signature  # keeps the id taken
    return kernel


def kernel_array(x, launcher: str):
    """``x`` as the kernels take it under ``launcher``: the caller's own array for the
    cached launcher, a numba device array view (no copy, no sync) for numba's."""
    return x if launcher == "cached" else _arrays.as_device_array(x)


def launch(dispatcher, signature, griddim, blockdim, stream, args, launcher: str | None = None) -> None:
    """Launch ``dispatcher`` at ``signature`` with ``args`` on ``stream``.

    Parameters
    ----------
    dispatcher : numba.cuda dispatcher (``cuda.jit(function)``)
    signature : tuple of numba types, the argument types ``args`` have, or None: derived
        from ``args`` (`signature_of`, as numba's dispatcher would type them)
    griddim, blockdim : int or tuple of ints, blocks and threads per block
    stream : a numba stream, a raw stream handle (int), or None (the default stream)
    args : the kernel arguments; arrays as `kernel_array` gives them for ``launcher``
    launcher : "cached" or "numba"; default `active_launcher()`

    Raises
    ------
    RuntimeError
        the cached launcher was asked for (MOEROUTE_CUDA_LAUNCHER=cached) and cannot run.
    """
    launcher = launcher or active_launcher()
    if launcher == "numba":
        if stream is not None and isinstance(stream, int):
            from numba import cuda

            stream = cuda.external_stream(stream) if stream else cuda.default_stream()
        dispatcher[griddim, blockdim, stream or 0](*args)
        return
    reason = cached_unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"{LAUNCHER_ENV}=cached, but the cached launcher cannot run: {reason}")
    if signature is None:
        signature = signature_of(args)
    cached_kernel(dispatcher, signature)(
        griddim if isinstance(griddim, tuple) else (griddim,),
        blockdim if isinstance(blockdim, tuple) else (blockdim,),
        _arrays.stream_handle(stream),
        args,
    )


def stream_handle_of(template, stream=None) -> int:
    """The raw handle of the stream to launch on, for the cached launcher: ``stream`` if
    given, else the current stream of ``template``'s framework (torch, CuPy), else 0."""
    if stream is not None:
        return _arrays.stream_handle(stream)
    return _arrays.current_stream_handle(_arrays.framework_of(template), template)
