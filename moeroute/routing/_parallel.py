"""The one place that decides how moeroute's CPU kernels run in parallel.

Two OpenMP runtimes in one process (torch's bundled libgomp and the system one under
Numba's ``omp`` threading layer) each keep their own worker threads spinning after a
parallel region; on a machine with as many cores as torch uses, a moeroute call right after
a torch op competes with torch's spinning workers, and the next torch op with moeroute's.
So with ``MOEROUTE_CPU_TEAM=auto`` (or `set_team_mode("auto")`), when torch is loaded and
brings its own libgomp, the parallel kernels run inside torch's own OpenMP team: ``GOMP_parallel`` of torch's libgomp called with a Numba
``cfunc`` whose threads claim chunks of rows from a shared counter. The same workers then
serve torch and moeroute in turn, and moeroute uses ``torch.get_num_threads()`` of them.
Otherwise (the default, see `DEFAULT_TEAM_MODE`; or without torch, or with a torch built on
another OpenMP) the kernels use Numba's own ``prange`` parallelism and threading layer. bench/routing.py measures both, interleaved
call by call with torch, and bench/threads.py the other options.

The team kernels take one int64 descriptor array: slot 0 is the chunk counter (claimed
atomically), the other slots hold sizes, flags and the addresses of the arrays, which the
caller keeps alive for the duration of the call.
"""

from __future__ import annotations

import ctypes
import os
import sys

import numba
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from moeroute._validate import environ_choice

__all__ = ["DEFAULT_TEAM_MODE", "cpu_threads", "torch_team", "torch_team_available", "run_team", "TEAM_MODES", "set_team_mode", "team_mode"]

#: How parallel kernels run: "auto" (torch's OpenMP team when available, else Numba),
#: "torch" (torch's team, an error when unavailable) or "numba" (Numba's threading layer).
TEAM_MODES = ("auto", "torch", "numba")
#: The default stays Numba's threads until a quiet-machine run of bench/threads.py and
#: bench/routing.py --teams auto numba shows torch's team ahead: on a saturated machine
#: Qwen3.5 routing measured 7.7x and 6.1x interleaved with torch in the team against 9.5x
#: and 8.2x on Numba's threads (DeepSeek-V3: 11.7x, 8.9x against 11.0x, 11.0x).
DEFAULT_TEAM_MODE = "numba"
#: Environment variable naming the mode (one of `TEAM_MODES`), read on first use.
TEAM_ENV = "MOEROUTE_CPU_TEAM"
_mode: str | None = None  # None: not chosen yet, `team_mode` reads TEAM_ENV


def set_team_mode(mode: str) -> str:
    """Choose how parallel CPU kernels run (one of `TEAM_MODES`); returns the previous mode.

    Until it is called, the mode is read once from the ``MOEROUTE_CPU_TEAM`` environment
    variable (`team_mode`).

    Raises
    ------
    ValueError
        ``mode`` not one of `TEAM_MODES`.
    """
    global _mode
    if not isinstance(mode, str) or mode not in TEAM_MODES:
        raise ValueError(f"mode={mode!r} is not a CPU team mode; use one of {TEAM_MODES}")
    previous, _mode = team_mode(), mode
    return previous


def team_mode() -> str:
    """The current mode (one of `TEAM_MODES`): `set_team_mode`'s, else ``MOEROUTE_CPU_TEAM``
    (default `DEFAULT_TEAM_MODE`), read on first use.

    Raises
    ------
    ValueError
        ``MOEROUTE_CPU_TEAM`` set to anything but one of `TEAM_MODES`.
    """
    global _mode
    if _mode is None:
        _mode = environ_choice(TEAM_ENV, TEAM_MODES, DEFAULT_TEAM_MODE,
                               "how moeroute's parallel CPU kernels run")
    return _mode


_GOMP_LOOKUPS: dict = {}  # torch loaded (bool) -> GOMP_parallel or None: one lookup each


def _torch_gomp_parallel():
    """``GOMP_parallel`` of the libgomp that torch loaded, or None.

    Found by path in the process's memory map: a libgomp inside torch's installation
    (``torch/lib`` or the wheel's ``torch.libs``). Other platforms and OpenMP runtimes
    (LLVM's libomp, Intel's iomp) give None. Looked up again once torch gets imported.
    """
    torch = sys.modules.get("torch")
    key = torch is not None
    if key not in _GOMP_LOOKUPS:
        _GOMP_LOOKUPS[key] = _find_gomp_parallel(torch)
    return _GOMP_LOOKUPS[key]


def _find_gomp_parallel(torch):
    if torch is None or not sys.platform.startswith("linux"):
        return None
    torch_root = os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__)))
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line}
    except OSError:
        return None
    for path in sorted(paths):
        relative = os.path.relpath(path, torch_root)
        if relative.startswith("torch") and os.path.basename(path).startswith("libgomp"):
            function = ctypes.CDLL(path).GOMP_parallel
            function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
            function.restype = None
            return function
    return None


def torch_team_available() -> bool:
    """Whether torch is loaded with its own libgomp (whatever the mode)."""
    return _torch_gomp_parallel() is not None


def torch_team() -> bool:
    """Whether parallel kernels run in torch's OpenMP team now (see `TEAM_MODES`).

    Raises
    ------
    RuntimeError
        Mode "torch" while torch's libgomp is not loaded.
    """
    mode = team_mode()
    if mode == "numba":
        return False
    available = _torch_gomp_parallel() is not None
    if mode == "torch" and not available:
        raise RuntimeError("MOEROUTE_CPU_TEAM=torch, but torch with its own libgomp is not loaded")
    return available


def cpu_threads() -> int:
    """Threads a parallel kernel may use: torch's when torch is loaded, else Numba's."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    return numba.get_num_threads()


def run_team(body, descriptor, threads: int) -> None:
    """Run the cfunc ``body(descriptor)`` on ``threads`` threads of torch's OpenMP team.

    Each thread claims chunks through `claim_chunk` until none is left; the call returns
    when all are done. ``descriptor`` is a C-contiguous int64 array whose slot 0 is 0.
    """
    _torch_gomp_parallel()(body.address, descriptor.ctypes.data, threads, 0)


@intrinsic
def pointer_at(typingctx, address, dtype):
    """``address`` (int64) as a pointer to ``dtype`` elements, for ``numba.carray``."""
    pointer_type = types.CPointer(dtype.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(pointer_type))

    return pointer_type(types.int64, dtype), codegen


@intrinsic
def claim_chunk(typingctx, descriptor):
    """Atomically take the next chunk number from the descriptor's slot 0."""
    def codegen(context, builder, signature, args):
        counter = builder.bitcast(args[0], ir.IntType(64).as_pointer())
        return builder.atomic_rmw("add", counter, ir.Constant(ir.IntType(64), 1), "monotonic")

    return types.int64(types.voidptr), codegen


@intrinsic
def float32_from_bits(typingctx, bits):
    """The float32 whose bits are the low 32 bits of ``bits`` (int64)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.trunc(args[0], ir.IntType(32)), ir.FloatType())

    return types.float32(types.int64), codegen
