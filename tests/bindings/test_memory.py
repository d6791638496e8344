"""Expert weights on 2 MB pages (`moeroute.bindings.torch.memory`): the advised span, the values
kept, and the pages Linux reports afterwards."""

from __future__ import annotations

import os
import platform
import re

import pytest
import torch

from moeroute.bindings.torch.memory import HUGE_PAGE_BYTES, back_with_huge_pages, huge_page_span

MB = 1 << 20


class _At:
    """A stand-in with a tensor's address arithmetic (data_ptr, numel, element_size)."""

    def __init__(self, address, nbytes):
        self.address, self.nbytes = address, nbytes

    def data_ptr(self):
        return self.address

    def numel(self):
        return self.nbytes

    def element_size(self):
        return 1


@pytest.mark.parametrize(
    "address,nbytes,expected",
    [
        (0, 4 * MB, (0, 4 * MB)),  # aligned both ends
        (4096, 4 * MB, (2 * MB, 2 * MB)),  # ragged both ends: one whole page inside
        (2 * MB - 1, 2 * MB + 1, (2 * MB, 2 * MB)),  # ends exactly on a page
        (4096, 2 * MB, (2 * MB, 0)),  # straddles one boundary: no whole page
        (6 * MB, 2 * MB - 1, (6 * MB, 0)),  # under a page
    ],
)
def test_span_is_the_whole_pages_inside(address, nbytes, expected):
    start, length = huge_page_span(_At(address, nbytes))
    assert (start, length) == expected
    if length:
        assert start % HUGE_PAGE_BYTES == 0 and length % HUGE_PAGE_BYTES == 0
        assert address <= start and start + length <= address + nbytes


def _kernel_collapses() -> bool:
    """Linux 6.1+ (MADV_COLLAPSE) with transparent huge pages not off."""
    if platform.system() != "Linux":
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = re.search(r"\[(\w+)\]", f.read()).group(1)
    except (OSError, AttributeError):
        return False
    major, minor = (int(part) for part in re.match(r"(\d+)\.(\d+)", platform.release()).groups())
    return mode != "never" and (major, minor) >= (6, 1)


def _anon_huge_bytes(start: int, length: int) -> int:
    """AnonHugePages of this process's mappings that overlap [start, start + length)."""
    total, overlaps = 0, False
    with open(f"/proc/{os.getpid()}/smaps") as f:
        for line in f:
            head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if head:
                low, high = int(head.group(1), 16), int(head.group(2), 16)
                overlaps = low < start + length and start < high
            elif overlaps and line.startswith("AnonHugePages:"):
                total += int(line.split()[1]) * 1024
    return total


def test_weights_keep_their_values_and_address():
    generator = torch.Generator().manual_seed(0)
    weights = (torch.randn(24, 128, 1024, generator=generator) * 0.02).to(torch.bfloat16)  # 6 MB
    before, address = weights.clone(), weights.data_ptr()
    moved = back_with_huge_pages(weights)
    assert weights.data_ptr() == address and torch.equal(weights, before)
    start, length = huge_page_span(weights)
    assert length >= 2 * HUGE_PAGE_BYTES
    if _kernel_collapses():
        # A collapse may be refused for a moment (no free 2 MB page until compaction): asked
        # again, as a caller may; the span must end up moved.
        for _ in range(3):
            if moved == length:
                break
            moved = back_with_huge_pages(weights)
        assert moved == length
        assert _anon_huge_bytes(start, length) >= length
    else:
        assert moved in (0, length)


def test_other_tensors_are_left_alone():
    small = torch.ones(1000)
    strided = torch.ones(2048, 1024)[:, ::2]  # 8 MB underneath, not contiguous
    assert back_with_huge_pages(small, strided) == 0
    assert torch.equal(small, torch.ones(1000)) and bool((strided == 1).all())
    assert back_with_huge_pages() == 0
    with pytest.raises(TypeError, match="torch tensors"):
        back_with_huge_pages(small.numpy())
