"""How many threads moeroute's parallel CPU kernels use.

The parallel kernels are Numba ``prange`` loops on Numba's threading layer. Next to torch
they take ``torch.get_num_threads()`` threads (at most Numba's pool), so moeroute and torch
share the cores the same way; without torch, Numba's own setting. bench/threads.py compares
Numba's threading layers and a pool of Python threads with torch's forward before and after.

Numba's ``omp`` threading layer and torch's CPU build share one libgomp, and starting
Numba's workers sets that runtime's thread count to Numba's pool size: a process that gave
torch one thread (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``, an engine's worker)
would find torch on all cores after moeroute's first parallel kernel. `start_threads` starts
the workers and puts torch's count back; `cpu_threads` calls it before any kernel asks how
many threads to use, and the torch bindings call it when they load.
"""

from __future__ import annotations

import sys

import numba

__all__ = ["cpu_threads", "start_threads"]

_started = False


def start_threads() -> None:
    """Start Numba's worker threads now, leaving torch's thread count as it was.

    Idempotent and cheap after the first call.
    """
    global _started
    if _started:
        return
    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else None
    from numba.np.ufunc.parallel import _launch_threads  # the pool Numba starts on first use

    _launch_threads()
    _started = True
    if torch is not None and torch.get_num_threads() != before:
        torch.set_num_threads(before)


def cpu_threads() -> int:
    """Threads a parallel kernel may use: torch's when torch is loaded, else Numba's."""
    start_threads()
    torch = sys.modules.get("torch")
    if torch is not None:
        return max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    return numba.get_num_threads()
