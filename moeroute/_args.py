"""Command-line argument types and checks shared by every command (``moeroute`` and the
EP runner it starts): kept below the commands so that a command's module never imports the
command line that loads it."""

from __future__ import annotations

import argparse
import os

__all__ = ["positive_int", "non_negative_int", "physical_memory_bytes", "check_fits_in_memory"]


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be an integer >= 1")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be an integer >= 0")
    return value


def physical_memory_bytes() -> int | None:
    """This machine's physical memory in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def check_fits_in_memory(what: str, nbytes: int) -> None:
    """ValueError when ``nbytes`` (the estimate of what a request allocates) exceeds the
    machine's physical memory: refused before anything is allocated."""
    total = physical_memory_bytes()
    if total is not None and nbytes > total:
        raise ValueError(
            f"{what} needs about {nbytes:.3g} bytes, more than this machine's "
            f"{total:.3g} bytes of memory; use a smaller size"
        )
