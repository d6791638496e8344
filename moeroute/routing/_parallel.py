"""How many threads moeroute's parallel CPU kernels use.

The parallel kernels are Numba ``prange`` loops on Numba's threading layer. Next to torch
they take ``torch.get_num_threads()`` threads (at most Numba's pool), so moeroute and torch
share the cores the same way; without torch, Numba's own setting. bench/threads.py compares
Numba's threading layers and a pool of Python threads with torch's forward before and after.
"""

from __future__ import annotations

import sys

import numba

__all__ = ["cpu_threads"]


def cpu_threads() -> int:
    """Threads a parallel kernel may use: torch's when torch is loaded, else Numba's."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    return numba.get_num_threads()
