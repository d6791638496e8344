"""Shared helpers of the benchmarks: timers, interleaved timing, copy bandwidth, JSON, tables.

Every script in bench/ times through here: `wall_clock` or `cuda_events` times one call,
`calls_per_sample` batches launch-bound calls into one sample, `median_time` takes a
median, `rotated` / `interleaved` run several callables in turn, and `print_table` /
`write_results` report.

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

#: Where write_results puts its JSON: bench/results, or MOEROUTE_BENCH_RESULTS when set (the
#: test suite runs benchmarks into a temporary directory).
RESULTS_DIR = Path(os.environ.get("MOEROUTE_BENCH_RESULTS") or Path(__file__).resolve().parent / "results")
# Untimed calls before timing: compilation, caches, thread pools.
WARMUP_CALLS = 3
# Host copy buffer: far larger than any cache, small enough for a 2-core, 24 GiB machine.
COPY_BYTES = 256 << 20


def wall_clock(fn) -> float:
    """Seconds one call of ``fn`` takes on the host clock (the default timer)."""
    start = time.perf_counter_ns()
    fn()
    return max(time.perf_counter_ns() - start, 1) / 1e9


def cuda_events(torch):
    """A timer measuring the device time of one call with a pair of CUDA events on torch's
    current stream (it waits for the call to finish)."""

    def timer(fn) -> float:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return max(start.elapsed_time(end), 1e-6) / 1e3  # ms -> s

    return timer


def calls_per_sample(fn, calls: int):
    """``fn`` run ``calls`` times as one timed sample (launch-bound GPU work): divide by
    ``calls`` for the time per call."""
    if calls < 1:
        raise ValueError(f"calls={calls} must be >= 1")

    def batch():
        for _ in range(calls):
            fn()

    return batch


def median_time(fn, repeats: int, warmup: int = WARMUP_CALLS, timer=wall_clock) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    for _ in range(warmup):
        fn()
    return statistics.median(timer(fn) for _ in range(repeats))


def rotated(callables: dict, repeats: int, warmup: int = WARMUP_CALLS, timer=wall_clock) -> dict:
    """Time several named zero-argument callables in turn, ``repeats`` rounds.

    Each round runs every callable once; the starting one rotates from round to round so
    that none always finds the caches warm (with two, they alternate). Returns
    ``{name: [seconds per round]}``, in the order of ``callables``.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    names = list(callables)
    for _ in range(warmup):
        for name in names:
            callables[name]()
    samples = {name: [] for name in names}
    for r in range(repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(timer(callables[name]))
    return samples


def median_ratio(numerators, denominators) -> float:
    """Median over rounds of numerator_time / denominator_time (two `rotated` lists)."""
    return statistics.median(n / d for n, d in zip(numerators, denominators))


def interleaved(baseline, candidate, repeats: int, warmup: int = WARMUP_CALLS, timer=wall_clock) -> dict:
    """Time two zero-argument callables alternately, call by call (`rotated` of the two).

    ``timer(fn) -> seconds`` times one call: `wall_clock` (default) or `cuda_events`.

    Returns
    -------
    dict
        ``baseline_us`` and ``candidate_us`` (medians), ``speedup`` (median over pairs of
        baseline_time / candidate_time), ``speedup_range`` ([min, max] of those ratios)
        and ``repeats``.
    """
    samples = rotated({"baseline": baseline, "candidate": candidate}, repeats, warmup, timer)
    base, cand = samples["baseline"], samples["candidate"]
    ratios = [b / c for b, c in zip(base, cand)]
    return {
        "baseline_us": statistics.median(base) * 1e6,
        "candidate_us": statistics.median(cand) * 1e6,
        "speedup": statistics.median(ratios),
        "speedup_range": [min(ratios), max(ratios)],
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


def cpu_model() -> str | None:
    """The CPU's model name as the OS reports it (``/proc/cpuinfo``), or None where unknown."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def cpu_isa() -> str | None:
    """The ISA path moeroute's CPU kernels take (``moeroute.cpu_isa()``), or None where the
    installed moeroute does not report one."""
    try:
        import moeroute
    except ImportError:
        return None
    answer = getattr(moeroute, "cpu_isa", None)
    return str(answer()) if callable(answer) else None


def machine_info() -> dict:
    """The run's machine: date, platform, CPU model, ISA path, versions and thread counts (the
    `machine` object of every result file; docs/performance.md describes the layout)."""
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "isa": cpu_isa(),
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


def isa_suffix() -> str:
    """The suffix "_<path>" when ``MOEROUTE_CPU_ISA`` holds the kernels to a lower instruction-set path than the
    CPU's own, else "": such a run is written beside the CPU's own (quant_avx2.json by quant.json)."""
    import moeroute

    return f"_{moeroute.cpu_isa()}" if os.environ.get("MOEROUTE_CPU_ISA") else ""


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
    widths = [max(len(str(h)), *(len(r[i]) for r in text)) if text else len(str(h)) for i, h in enumerate(headers)]
    print("  ".join(str(h).rjust(w) for h, w in zip(headers, widths)))
    for row in text:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))
