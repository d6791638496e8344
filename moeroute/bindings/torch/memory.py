"""Expert weights on 2 MB pages: fewer TLB misses where decode streams them from memory.

At decode-sized batches the CPU experts read each hit expert's weights once per call, from
memory. On 4 KB pages that stream crosses a page every 4 KB, and each new page costs a TLB
walk and stops the hardware prefetchers, which do not cross pages. torch's CPU allocator
leaves large tensors on 4 KB pages when Linux's transparent huge pages are in "madvise"
mode (the common default). `back_with_huge_pages` asks Linux to move a tensor's memory onto
2 MB pages in place (``madvise(MADV_HUGEPAGE)``, then ``MADV_COLLAPSE``, Linux 6.1 or later):
the values, the addresses and the tensor are unchanged; only the page size under them is.
It is advice: where the kernel declines (older Linux, transparent huge pages off, memory a
file maps) nothing changes and nothing fails.
"""

from __future__ import annotations

import ctypes
import functools
import sys

import torch

__all__ = ["HUGE_PAGE_BYTES", "back_with_huge_pages"]

#: The size of an x86-64 / arm64 (4 KB base pages) transparent huge page.
HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25


@functools.cache
def _madvise():
    """libc's madvise, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def huge_page_span(tensor: torch.Tensor) -> tuple[int, int]:
    """(start, length) of the whole 2 MB pages inside a contiguous tensor's bytes; length 0
    when none fits."""
    first = tensor.data_ptr()
    last = first + tensor.numel() * tensor.element_size()
    start = -(-first // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    stop = last // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    return start, max(0, stop - start)


def back_with_huge_pages(*tensors: torch.Tensor) -> int:
    """Ask Linux to back the memory of ``tensors`` with 2 MB pages, in place.

    Only the whole 2 MB pages inside each contiguous CPU tensor are advised (memory the
    tensor shares a page with is never touched); other tensors (CUDA, non-contiguous, under
    2 MB) are left alone. Nothing about the tensors changes but the page size under them.

    Returns
    -------
    int
        Bytes now on 2 MB pages (0 where Linux declined, e.g. transparent huge pages set to
        "never", a kernel older than 6.1, file-backed memory, or not Linux).
    """
    madvise = _madvise()
    moved = 0
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"back_with_huge_pages takes torch tensors, got {type(tensor).__name__}")
        if madvise is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
            continue
        start, length = huge_page_span(tensor)
        if length == 0:
            continue
        # MADV_HUGEPAGE keeps the span eligible (later faults, khugepaged); MADV_COLLAPSE moves
        # its present pages now. Either may be refused: the memory then stays as it was.
        madvise(start, length, _MADV_HUGEPAGE)
        if madvise(start, length, _MADV_COLLAPSE) == 0:
            moved += length
    return moved
