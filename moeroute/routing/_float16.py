"""16-bit floats in the CPU kernels: Numba has no host float16 or bfloat16 type, so the
kernels read 16-bit activations as their raw bits and decode them through a table."""

from __future__ import annotations

import numpy as np

__all__ = ["BF16_SHIFT", "decode_table"]

#: bfloat16 is the top half of a float32: its bits shifted up by this many are the float32's.
BF16_SHIFT = 16


def _table(bfloat16: bool) -> np.ndarray:
    patterns = np.arange(1 << 16, dtype=np.uint32)
    if bfloat16:
        return (patterns << BF16_SHIFT).view(np.float32)
    return patterns.astype(np.uint16).view(np.float16).astype(np.float32)


#: One table per kind, built once at import (256 KiB each) and shared by every kernel.
_TABLES = {False: _table(False), True: _table(True)}


def decode_table(bfloat16: bool) -> np.ndarray:
    """float32 [65536]: the value of every 16-bit pattern, bfloat16 (``bfloat16=True``: the
    pattern shifted into the top half, exact) or float16 (NumPy's own conversion).

    The same array for every caller: do not write to it.
    """
    return _TABLES[bool(bfloat16)]
