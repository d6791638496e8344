"""Shared helpers of the benchmarks: interleaved timing, copy bandwidth, JSON, tables.

Every speed figure of the project comes from here: a baseline and a candidate run on the
same inputs in one process, alternately call by call, and the figure is the median of the
per-pair time ratios, which stays put when the machine's other load comes and goes.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# Untimed calls before timing: compilation, caches, thread pools.
WARMUP_CALLS = 3
# Host copy buffer: far larger than any cache, small enough for a 2-core, 24 GiB machine.
COPY_BYTES = 256 << 20


def interleaved(baseline, candidate, repeats: int, warmup: int = WARMUP_CALLS) -> dict:
    """Time two zero-argument callables alternately.

    Returns
    -------
    dict
        ``baseline_us`` and ``candidate_us`` (medians), ``speedup`` (median over pairs of
        baseline_time / candidate_time) and ``repeats``.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    for _ in range(warmup):
        baseline()
        candidate()
    base_ns, cand_ns, ratios = [], [], []
    for i in range(repeats):
        # Alternate who goes first so neither always finds the caches warm.
        order = (0, 1) if i % 2 == 0 else (1, 0)
        pair = [0, 0]
        for which in order:
            start = time.perf_counter_ns()
            (baseline if which == 0 else candidate)()
            pair[which] = max(time.perf_counter_ns() - start, 1)
        base_ns.append(pair[0])
        cand_ns.append(pair[1])
        ratios.append(pair[0] / pair[1])
    return {
        "baseline_us": statistics.median(base_ns) / 1e3,
        "candidate_us": statistics.median(cand_ns) / 1e3,
        "speedup": statistics.median(ratios),
        "repeats": repeats,
    }


def host_copy_bandwidth(nbytes: int = COPY_BYTES, repeats: int = 5) -> float:
    """Host memory bandwidth in GB/s: bytes read plus bytes written by ``np.copyto`` of a
    buffer far larger than the caches, best of ``repeats``."""
    source = np.ones(nbytes // 4, np.float32)
    target = np.empty_like(source)
    np.copyto(target, source)  # fault the pages in before timing
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - start)
    return 2 * source.nbytes / best / 1e9


def machine_info() -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "numpy": np.__version__,
    }
    for name in ("numba", "torch", "cupy"):
        module = sys.modules.get(name)
        if module is not None:
            info[name] = getattr(module, "__version__", "?")
    numba = sys.modules.get("numba")
    if numba is not None:
        info["numba_threads"] = numba.get_num_threads()
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch_threads"] = torch.get_num_threads()
    return info


def write_results(name: str, payload: dict) -> Path:
    """Write ``payload`` plus machine info to bench/results/<name>.json; return the path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps({"machine": machine_info(), **payload}, indent=2) + "\n")
    return path


def print_table(headers, rows) -> None:
    """Print rows (sequences) under headers, right-aligned; floats with 2 decimals."""
    def cell(value):
        return f"{value:.2f}" if isinstance(value, float) else str(value)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in text)) if text else len(str(h))
              for i, h in enumerate(headers)]
    print("  ".join(str(h).rjust(w) for h, w in zip(headers, widths)))
    for row in text:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))
