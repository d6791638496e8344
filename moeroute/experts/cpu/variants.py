"""Serial kernels generated from the parallel ones, not written twice.

A kernel's one-thread form runs the same loop with no parallel region to start (next to
torch's spinning OpenMP workers, starting Numba's pool costs more than a decode step's work).
`parallel_and_serial` compiles one function twice: with ``parallel=True``, and without, where
``numba.prange`` is ``range``. A loop whose schedule depends on the threads takes a last
argument ``threaded=True`` that callers leave to its default: the serial form's default is
False, a compile-time constant there (one thread: all output columns as one block).

Numba's on-disk cache names a function's index file after its qualified name and first line,
not after the compile options: two dispatchers of one function would share one index, and
the parallel and serial entries of one signature would overwrite each other. The serial
form is therefore its own function object (same code and globals) named ``<name>_serial``,
with its own cache files; its source file, and so its cache stamp, is the parallel one's.
"""

from __future__ import annotations

import types

import numba

__all__ = ["parallel_and_serial", "specialize"]


def parallel_and_serial(**options):
    """Decorator: the function compiled with ``numba.njit(parallel=True, **options)``, whose
    ``serial`` attribute is the same function compiled with ``numba.njit(**options)`` under
    the name ``<name>_serial`` (bind it at module level so warm-up and the cache tests find it).

    Raises
    ------
    ValueError
        ``options`` names ``parallel`` (the decorator decides it).
    """
    if "parallel" in options:
        raise ValueError(f"parallel_and_serial decides `parallel` itself; got parallel={options['parallel']!r}")

    def compile_both(function):
        name = function.__name__ + "_serial"
        code, defaults = function.__code__, function.__defaults__
        arguments = code.co_varnames[: code.co_argcount]
        if "threaded" in arguments:
            index = arguments.index("threaded") - (len(arguments) - len(defaults or ()))
            if index < 0:
                raise ValueError(f"{function.__name__}: `threaded` needs a default (True)")
            defaults = defaults[:index] + (False,) + defaults[index + 1 :]
        serial = types.FunctionType(code, function.__globals__, name, defaults, function.__closure__)
        serial.__qualname__ = function.__qualname__ + "_serial"
        serial.__kwdefaults__ = function.__kwdefaults__
        serial.__doc__ = f"`{function.__name__}` on the calling thread (generated: no parallel region)."
        parallel = numba.njit(parallel=True, **options)(function)
        parallel.serial = numba.njit(**options)(serial)
        return parallel

    return compile_both


def specialize(module: str, prefix: str, namespace: dict, helpers=(), kernels=(), **options):
    """One format's copies of template kernels: each function of ``helpers`` (compiled with
    ``numba.njit(**options)``) and of ``kernels`` (`parallel_and_serial(cache=True, **options)`)
    recompiled with ``namespace`` as its globals, where the format binds what the templates
    call (its dot, its decode), and the helpers bound there under their own names in order.

    Each copy is named ``<prefix>_<name>`` and belongs to ``module`` (the caller's
    ``__name__``): Numba's cache files follow the qualified name, so two formats' copies of
    one template never share them, and warm-up finds the kernels in the module that binds
    them. Returns {name: dispatcher} for the helpers, the kernels and the kernels'
    ``<name>_serial`` forms.
    """
    namespace = dict(namespace, __name__=module)

    def copy(function):
        name = f"{prefix}_{function.__name__}"
        clone = types.FunctionType(function.__code__, namespace, name, function.__defaults__, function.__closure__)
        clone.__qualname__ = name
        clone.__doc__ = function.__doc__
        clone.__kwdefaults__ = function.__kwdefaults__
        return clone

    made = {}
    for function in helpers:
        namespace[function.__name__] = made[function.__name__] = numba.njit(**options)(copy(function))
    for function in kernels:
        kernel = parallel_and_serial(cache=True, **options)(copy(function))
        made[function.__name__], made[function.__name__ + "_serial"] = kernel, kernel.serial
    return made
