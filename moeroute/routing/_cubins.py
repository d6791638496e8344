"""On-disk cache of the cached launcher's cubins, so a new process does not compile again.

A routing kernel is built by a factory from compile-time constants (the select kernels
close over device functions that close over the expert count, the scoring, ...). Its
cubin is kept under a key that names everything the code generated from it depends on:

* the sources of the routing package (`moeroute.routing._cache.sources_stamp`), which
  hold every function body and module-level constant the kernels read;
* the kernel's description (`describe`): qualified name, a hash of its code object (some
  device functions are generated per constant) and, recursively, the values its closure
  and defaults hold (numbers, strings, tuples, numba types, functions and device functions
  with their jit options); a kernel closing over anything else is not kept on disk;
* the signature, the target architecture and the versions of numba, numba-cuda and
  cuda.core (nvJitLink).

The directory is ``MOEROUTE_CUBIN_CACHE`` when set, else ``cubins/`` in the directory
where Numba caches moeroute's CPU kernels (`moeroute.runtime.cache_dir`, defined in `moeroute.routing._cache`); entries are
written atomically (a temporary file, then a rename), so concurrent processes never read
a partial cubin, and the ``.name`` file beside each cubin records its SHA-256: a cubin
damaged later (truncated, overwritten) is compiled again and replaced, with one
`UnreadableCacheWarning` naming it. ``MOEROUTE_CUBIN_CACHE=off`` disables the cache.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import types as pytypes
import warnings
from pathlib import Path

import numpy as np

from moeroute._validate import environ_directory
from moeroute.routing._cache import UnreadableCacheWarning

CACHE_ENV = "MOEROUTE_CUBIN_CACHE"
_SIMPLE = (bool, int, float, str, bytes, type(None), np.generic)


def describe(value):
    """A string naming ``value`` as a kernel's code depends on it, or None when it cannot
    be named (the kernel is then compiled in each process and not kept on disk)."""
    from numba.core import types as numba_types

    if isinstance(value, _SIMPLE):
        return f"{type(value).__name__}:{value!r}"
    if isinstance(value, numba_types.Type):
        return f"numba:{value}"
    if isinstance(value, tuple):
        parts = [describe(v) for v in value]
        return None if None in parts else f"({', '.join(parts)})"
    py_func = getattr(value, "py_func", None)
    if py_func is not None:  # a numba dispatcher: its function and its options
        inner = describe(py_func)
        options = getattr(value, "targetoptions", {})
        return None if inner is None else f"jit{sorted(options.items())!r}:{inner}"
    if isinstance(value, pytypes.FunctionType):
        # The code itself too: some device functions are generated (exec) per constant.
        cells = [f"code={_code_digest(value.__code__)}"]
        defaults = describe(tuple(value.__defaults__ or ()))
        if defaults is None:
            return None
        cells.append(f"defaults={defaults}")
        for name, cell in zip(value.__code__.co_freevars, value.__closure__ or ()):
            try:
                content = cell.cell_contents
            except ValueError:  # an empty cell (a name assigned later)
                return None
            part = describe(content)
            if part is None:
                return None
            cells.append(f"{name}={part}")
        return f"{value.__module__}.{value.__qualname__}[{'; '.join(cells)}]"
    return None


def _code_digest(code) -> str:
    """A stable digest of a code object: its bytecode, names and constants (nested code
    objects by their own digest). Not marshal: its output depends on reference counts."""
    digest = hashlib.sha256(code.co_code)
    digest.update(repr((code.co_names, code.co_varnames, code.co_freevars)).encode())
    for constant in code.co_consts:
        if isinstance(constant, pytypes.CodeType):
            digest.update(_code_digest(constant).encode())
        else:
            digest.update(f"{type(constant).__name__}:{constant!r};".encode())
    return digest.hexdigest()[:16]


def cache_dir() -> Path | None:
    """Where cubins are kept, or None when ``MOEROUTE_CUBIN_CACHE=off``; ValueError when
    the variable names a file."""
    chosen = environ_directory(CACHE_ENV, "where compiled routing cubins are kept")
    if chosen == "off":
        return None
    if chosen is not None:
        return chosen
    from moeroute.routing import _cache

    return Path(_cache.cache_dir()) / "cubins"


def cache_key(dispatcher, signature, arch: str) -> str | None:
    """The entry name of ``dispatcher``'s kernel at ``signature`` for ``arch``, or None."""
    import numba
    import numba_cuda

    from moeroute.routing import _cache

    description = describe(dispatcher)
    if description is None:
        return None
    try:
        import cuda.core

        linker = cuda.core.__version__
    except (ImportError, AttributeError):
        linker = "?"
    text = "\n".join(
        [
            _cache.sources_stamp(),
            description,
            str(tuple(signature)),
            arch,
            numba.__version__,
            numba_cuda.__version__,
            linker,
        ]
    )
    return hashlib.sha256(text.encode()).hexdigest()


def _read_entry(directory: Path, key: str):
    """(cubin, name) of entry ``key``, None when there is none, or the Path of the damaged
    file when the cubin does not match the digest its ``.name`` file records."""
    try:
        record = (directory / f"{key}.name").read_text()
        cubin = (directory / f"{key}.cubin").read_bytes()
    except OSError:
        return None
    name, _, digest = record.partition("\n")
    if not name or digest != hashlib.sha256(cubin).hexdigest():
        return directory / f"{key}.cubin"
    return cubin, name


def load_or_compile(dispatcher, signature, arch: str, compile_image):
    """(cubin bytes, entry name) of the kernel: from the disk cache when an entry exists,
    else ``compile_image(dispatcher, signature, arch)`` and kept for the next process.
    A cache that cannot be read or written is passed over (the kernel is compiled); an
    entry whose cubin is damaged (its SHA-256 is not the one recorded beside it) is
    compiled again and replaced, with one `UnreadableCacheWarning` naming the file."""
    directory = cache_dir()
    key = None if directory is None else cache_key(dispatcher, signature, arch)
    if key is not None:
        entry = _read_entry(directory, key)
        if isinstance(entry, tuple):
            return entry
        if entry is not None:
            warnings.warn(
                f"moeroute: the cached cubin {entry} is damaged (its SHA-256 is not "
                "the one recorded beside it); compiling it again and replacing the "
                "entry",
                UnreadableCacheWarning,
                stacklevel=2,
            )
    cubin, name, _ = compile_image(dispatcher, signature, arch)
    if key is not None:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            _write_atomically(directory / f"{key}.cubin", cubin)
            # Written last: the entry's name and the digest its cubin is checked against.
            record = f"{name}\n{hashlib.sha256(cubin).hexdigest()}"
            _write_atomically(directory / f"{key}.name", record.encode())
        except OSError:
            pass
    return cubin, name


def _write_atomically(path: Path, data: bytes) -> None:
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
