"""Numba's on-disk cache of the CPU kernels, invalidated by a change to any of their sources.

Numba checks a cached function against the source file it is defined in, and nothing else.
A kernel that inlines code or reads constants from another module (the row kernels of
``select/_host.py`` call ``select/_simd.py``'s intrinsics; ``remap.py`` reads the layout's
hash multiplier; the one-call expert forwards of ``experts/cpu/quant_rows.py`` inline
the tiles of ``experts/cpu/fp8.py`` and ``experts/cpu/mxfp4_dot.py``, which build on
``experts/cpu/dot.py``)
would be loaded stale from ``__pycache__`` after an edit to that other module alone.
`install` adds cache locators for every moeroute function (routing, experts, eplb,
...) whose source stamp is the pair (the function's file, `sources_stamp`): a hash of every
Python file of the package. The cache directories stay Numba's own (``NUMBA_CACHE_DIR``,
else ``__pycache__`` beside the source, else the per-user directory), and functions outside
moeroute keep Numba's locators.

An installed package never changes, so this costs one hash of those files per process; in
a working tree, an edit to any of them recompiles the CPU kernels once.

A cache entry of one of moeroute's kernels that cannot be read (a truncated or corrupted
``.nbi`` index or ``.nbc`` data file: Numba would raise ``UnpicklingError``/``EOFError``
from the call) is removed and the kernel compiled again, which writes a fresh entry, with
one `UnreadableCacheWarning` naming the file.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from functools import lru_cache
from pathlib import Path

ROUTING_DIR = Path(__file__).resolve().parent
PACKAGE_DIR = ROUTING_DIR.parent


def source_files(package_dir: Path = PACKAGE_DIR) -> list[Path]:
    """The files behind `sources_stamp`: every .py file of the package, in path order."""
    return sorted(package_dir.rglob("*.py"))


def stamp_of(files, root: Path) -> str:
    """SHA-256 over each file's path relative to ``root`` and its contents."""
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(Path(path).relative_to(root)).encode())
        digest.update(hashlib.sha256(Path(path).read_bytes()).digest())
    return digest.hexdigest()


@lru_cache(maxsize=None)
def sources_stamp() -> str:
    """`stamp_of` moeroute's kernel sources, computed once per process."""
    return stamp_of(source_files(), PACKAGE_DIR)


def _in_package(py_file) -> bool:
    return os.path.realpath(py_file).startswith(str(PACKAGE_DIR) + os.sep)


def _stamped(base):
    """``base`` (one of Numba's source-file locators), for moeroute's kernels only, with
    `sources_stamp` added to its source stamp."""

    class Locator(base):
        @classmethod
        def from_function(cls, py_func, py_file):
            if not _in_package(py_file):
                return None  # the next locator in Numba's list takes it
            return super().from_function(py_func, py_file)

        def get_source_stamp(self):
            return super().get_source_stamp(), sources_stamp()

    Locator.__name__ = Locator.__qualname__ = f"Moeroute{base.__name__}"
    return Locator


class UnreadableCacheWarning(RuntimeWarning):
    """A cached kernel could not be read; it is compiled again and the entry replaced."""


def _is_ours(cache) -> bool:
    locator = getattr(getattr(cache, "_impl", None), "locator", None)
    return type(locator).__name__.startswith("Moeroute")


def _unreadable_file(cache, sig, target_context) -> str:
    """The file of ``cache``'s entry for ``sig`` that failed to load: the index when it
    cannot be read itself, else the data file it names."""
    cache_file = cache._cache_file
    try:
        overloads = cache_file._load_index()
    except Exception:
        return cache_file._index_path
    name = overloads.get(cache._index_key(sig, target_context.codegen()))
    return cache_file._index_path if name is None else cache_file._data_path(name)


def _healing(load_overload):
    """Numba's ``Cache.load_overload``, which for moeroute's kernels turns an entry that
    cannot be read into a miss: the file is removed (so the compile that follows writes a
    new one, where Numba would fail again on the bad index) and one warning names it."""

    def load(self, sig, target_context):
        try:
            return load_overload(self, sig, target_context)
        except Exception as error:  # any damage: unpickling, truncation, a foreign object
            if not _is_ours(self):
                raise
            path = _unreadable_file(self, sig, target_context)
            try:
                os.unlink(path)
            except OSError:
                pass
            warnings.warn(
                f"moeroute: the cached kernel {path} could not be read "
                f"({type(error).__name__}: {error}); compiling it again and "
                "replacing the entry",
                UnreadableCacheWarning,
                stacklevel=2,
            )
            return None

    load.moeroute_healing = True
    return load


def install() -> None:
    """Put moeroute's locators in front of Numba's and make unreadable entries of
    moeroute's kernels recompile (idempotent). Must run before the first
    ``njit(cache=True)`` of moeroute is decorated: Numba picks a function's locator then."""
    from numba.core import caching

    if not getattr(caching.Cache.load_overload, "moeroute_healing", False):
        caching.Cache.load_overload = _healing(caching.Cache.load_overload)
    impl = caching.CacheImpl
    if any(getattr(c, "__name__", "").startswith("Moeroute") for c in impl._locator_classes):
        return
    ours = [
        _stamped(c)
        for c in (caching.UserProvidedCacheLocator, caching.InTreeCacheLocator, caching.UserWideCacheLocator)
    ]
    impl._locator_classes = ours + list(impl._locator_classes)


def _probe():
    """A function of this package for asking Numba's locators where a kernel would be cached."""


def cache_dir() -> str:
    """The directory holding moeroute's compiled CPU kernels (Numba's on-disk cache).

    ``NUMBA_CACHE_DIR``'s mirror of the package when that variable was set before Numba was
    imported, else the ``__pycache__`` directory beside the select kernel's source
    (``moeroute/routing/select/``; each routing module's kernels are cached beside it), or
    Numba's per-user fallback when that is not writable: the directory Numba's own locators
    (moeroute's stamped ones in front) choose for a function of ``select/_host.py``.
    """
    from numba.core import caching

    install()
    source = str(ROUTING_DIR / "select" / "_host.py")
    for locator_class in caching.CacheImpl._locator_classes:
        locator = locator_class.from_function(_probe, source)
        if locator is not None:
            return str(locator.get_cache_path())
    raise RuntimeError("no Numba cache locator accepts moeroute's kernels (read-only install?)")
