"""Numba's on-disk cache of the CPU kernels (moeroute/routing/_cache.py): every kernel's
cache entry (routing, quant, bindings, eplb) is stamped with all of the package's sources,
so an edit to a module it reads (and not to its own file) still recompiles it, and an
unchanged tree still loads from the cache."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from moeroute import runtime
from moeroute.routing import _cache

# Count one kernel's cache loads and compiles in a fresh process over a copied package.
PROBE = """
import json, numpy as np
from moeroute.routing import load
counts = load.expert_load(np.array([[0, 2], [2, -1]]), 4)
stats = load._count_cpu.stats
print(json.dumps([counts.tolist(), sum(stats.cache_hits.values()),
                  sum(stats.cache_misses.values())]))
"""
# split_blocks (experts/cpu/mxfp4.py) reads MXFP4_BLOCK from quant/mxfp4.py.
QUANT_PROBE = """
import json, numpy as np
from moeroute.experts.cpu import mxfp4 as cpu_mxfp4
x = np.arange(64, dtype=np.float32).reshape(1, 64)
out = np.empty_like(x)
cpu_mxfp4.split_blocks(x, out)
stats = cpu_mxfp4.split_blocks.stats
print(json.dumps([out[0, :4].tolist(), sum(stats.cache_hits.values()),
                  sum(stats.cache_misses.values())]))
"""


def _moeroute_dispatchers():
    """Every Numba CPU dispatcher of moeroute's modules (routing, quant, bindings, eplb, ...)."""
    import importlib
    import pkgutil

    from numba.core.registry import CPUDispatcher

    import moeroute

    found = {}
    for info in pkgutil.walk_packages(moeroute.__path__, prefix="moeroute."):
        if ".gpu" in info.name or info.name.startswith(("moeroute.compat.vllm_plugin", "moeroute.__main__")):
            continue  # device code, and the vLLM plugin's entry points (vLLM's venv)
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if isinstance(value, CPUDispatcher) and value.py_func.__module__ == module.__name__:
                found[id(value)] = value
    return list(found.values())


def test_every_cpu_kernel_is_stamped_with_all_its_sources():
    dispatchers = runtime.cpu_dispatchers()
    assert len(dispatchers) > 10
    for dispatcher in dispatchers:
        locator = dispatcher._cache._impl.locator
        assert type(locator).__name__.startswith("Moeroute"), dispatcher.py_func.__qualname__
        assert locator.get_source_stamp()[1] == _cache.sources_stamp()


def test_every_cached_kernel_of_the_package_is_stamped():
    # Not only routing's: the experts' tiles, their row forwards (which inline the tiles)
    # and the EPLB policy are cached too.
    cached = [d for d in _moeroute_dispatchers() if type(d._cache).__name__ != "NullCache"]
    modules = {d.py_func.__module__ for d in cached}
    assert {
        "moeroute.experts.cpu.fp8",
        "moeroute.experts.cpu.mxfp4_dot",
        "moeroute.experts.cpu.mxfp4",
        "moeroute.experts.cpu.rows",
        "moeroute.experts.cpu.quant_rows",
        "moeroute.eplb._policy",
    } <= modules
    for dispatcher in cached:
        locator = dispatcher._cache._impl.locator
        assert type(locator).__name__.startswith("Moeroute"), dispatcher.py_func.__qualname__
        assert locator.get_source_stamp()[1] == _cache.sources_stamp()


def test_the_stamp_covers_the_modules_kernels_read():
    names = {str(p.relative_to(_cache.PACKAGE_DIR)) for p in _cache.source_files()}
    assert {
        "routing/select/_simd.py",
        "routing/select/_common.py",
        "routing/select/_host.py",
        "routing/remap/_common.py",
        "layout/__init__.py",
        "layout/placement.py",
        "config/__init__.py",
        "config/configs.py",
        "experts/cpu/dot.py",
        "experts/cpu/fp8.py",
        "quant/mxfp4.py",
        "experts/cpu/rows.py",
        "experts/cpu/quant_rows.py",
    } <= names


def test_the_stamp_follows_contents_and_names(tmp_path):
    (tmp_path / "a.py").write_text("X = 1\n")
    (tmp_path / "b.py").write_text("Y = 2\n")
    files = [tmp_path / "a.py", tmp_path / "b.py"]
    before = _cache.stamp_of(files, tmp_path)
    assert _cache.stamp_of(files, tmp_path) == before
    (tmp_path / "b.py").write_text("Y = 3\n")
    assert _cache.stamp_of(files, tmp_path) != before
    (tmp_path / "b.py").write_text("Y = 2\n")
    assert _cache.stamp_of(files, tmp_path) == before
    (tmp_path / "b.py").rename(tmp_path / "c.py")
    assert _cache.stamp_of([tmp_path / "a.py", tmp_path / "c.py"], tmp_path) != before


@pytest.mark.parametrize(
    "probe_code, edited, expected",
    [
        pytest.param(PROBE, "routing/select/_common.py", [1, 0, 2, 0], id="routing"),
        pytest.param(QUANT_PROBE, "quant/mxfp4.py", [0.0, 2.0, 4.0, 6.0], id="quant"),
    ],
)
def test_an_edit_to_another_module_recompiles_and_an_unchanged_tree_loads(tmp_path, probe_code, edited, expected):
    """In a copy of the package (in-tree cache): compile, load, then edit only another
    module the kernel reads (not the kernel's own file) and see the kernel compiled again."""
    shutil.copytree(
        _cache.PACKAGE_DIR, tmp_path / "moeroute", ignore=shutil.ignore_patterns("__pycache__", "*.nbi", "*.nbc")
    )
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["PYTHONPATH"] = str(tmp_path)

    def probe():
        result = subprocess.run(
            [sys.executable, "-c", probe_code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, result.stderr[-2000:]
        values, hits, misses = json.loads(result.stdout.strip().splitlines()[-1])
        np.testing.assert_array_equal(values, expected)
        return hits, misses

    assert probe() == (0, 1)  # compiled and written
    assert probe() == (1, 0)  # loaded
    other = tmp_path / "moeroute" / edited
    other.write_text(other.read_text() + "\n# edited\n")
    assert probe() == (0, 1)  # another module changed: compiled again
    assert probe() == (1, 0)


# A damaged entry heals: recompiled, replaced, one warning naming the file.

HEAL_PROBE = """
import json, warnings, numpy as np
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from moeroute.routing import load
    counts = load.expert_load(np.array([[0, 2], [2, -1]]), 4)
stats = load._count_cpu.stats
print(json.dumps([counts.tolist(), sum(stats.cache_hits.values()),
                  sum(stats.cache_misses.values()),
                  [[type(w.message).__name__, str(w.message)] for w in caught
                   if "moeroute" in str(w.message)]]))
"""


def test_a_corrupted_or_truncated_cache_file_is_recompiled_with_one_warning(tmp_path):
    """Used to fail the call with UnpicklingError (garbage .nbc) or EOFError (truncated
    .nbi); now the kernel is compiled again, the entry replaced, and one warning names
    the file. Each run is a fresh process with NUMBA_CACHE_DIR in tmp_path."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))

    def probe():
        result = subprocess.run(
            [sys.executable, "-c", HEAL_PROBE], env=env, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, result.stderr[-2000:]
        counts, hits, misses, caught = json.loads(result.stdout.strip().splitlines()[-1])
        np.testing.assert_array_equal(counts, [1, 0, 2, 0])  # reference.expert_load
        return hits, misses, caught

    assert probe() == (0, 1, [])  # compiled and written
    index = next((tmp_path / "cache").rglob("*_count_cpu*.nbi"))
    data = next((tmp_path / "cache").rglob("*_count_cpu*.nbc"))
    for path, damage in ((data, b"not a pickle at all"), (index, index.read_bytes()[:7])):
        path.write_bytes(damage)
        hits, misses, caught = probe()
        assert (hits, misses) == (0, 1)
        assert len(caught) == 1 and caught[0][0] == "UnreadableCacheWarning", caught
        assert str(path) in caught[0][1] and "compiling it again" in caught[0][1]
        assert probe() == (1, 0, [])  # the entry was replaced: loaded, no warning
