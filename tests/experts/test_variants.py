"""moeroute.experts.cpu.variants: a kernel's serial form generated from its parallel one, with
its own name and its own on-disk cache entries."""

import json
import os
import subprocess
import sys
import textwrap

import numba
import numpy as np
import pytest

from moeroute.experts.cpu.variants import parallel_and_serial

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KERNEL = textwrap.dedent(
    """
    import numba
    import numpy as np
    from moeroute.experts.cpu.variants import parallel_and_serial

    @parallel_and_serial(cache=True)
    def blocked_double(x, out, threaded=True):
        columns = 4 if threaded else max(1, x.shape[0])
        for b in numba.prange((x.shape[0] + columns - 1) // columns):
            for i in range(b * columns, min(x.shape[0], (b + 1) * columns)):
                out[i] = 2 * x[i] + (b if threaded else 0)

    blocked_double_serial = blocked_double.serial
    """
)

RUN = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    import kernel
    x = np.arange(10, dtype=np.float64)
    outs = []
    for f in (kernel.blocked_double, kernel.blocked_double_serial):
        out = np.zeros(10)
        f(x, out)
        outs.append(out.tolist())
    stats = [[sum(f.stats.cache_hits.values()), sum(f.stats.cache_misses.values())]
             for f in (kernel.blocked_double, kernel.blocked_double_serial)]
    print(json.dumps({"outs": outs, "stats": stats}))
    """
)


def test_the_serial_form_has_its_own_name_and_the_threaded_default_false():
    def kernel(x, out, threaded=True):
        """Doubles x."""
        for i in numba.prange(x.shape[0]):
            out[i] = 2 * x[i] + (1 if threaded else 0)

    parallel = parallel_and_serial()(kernel)
    serial = parallel.serial
    assert serial.py_func.__name__ == "kernel_serial"
    assert serial.py_func.__qualname__.endswith("kernel_serial")
    assert serial.py_func.__module__ == kernel.__module__
    assert serial.py_func.__code__ is kernel.__code__
    assert parallel.py_func.__defaults__ == (True,) and serial.py_func.__defaults__ == (False,)
    assert parallel.targetoptions["parallel"] is True and "parallel" not in serial.targetoptions
    x, a, b = np.arange(5.0), np.zeros(5), np.zeros(5)
    parallel(x, a)
    serial(x, b)
    np.testing.assert_array_equal(a, 2 * x + 1)
    np.testing.assert_array_equal(b, 2 * x)


def test_parallel_is_the_decorators_to_decide():
    with pytest.raises(ValueError, match="parallel_and_serial decides `parallel` itself; got parallel=False"):
        parallel_and_serial(parallel=False)


def test_both_forms_cache_apart_and_load_in_a_new_process(tmp_path):
    # Numba names a cache index after the function's qualified name and first line: the two
    # forms of one function must not share it, and each must load from it in a new process.
    (tmp_path / "kernel.py").write_text(KERNEL)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=ROOT)
    runs = [
        json.loads(
            subprocess.run(
                [sys.executable, "-c", RUN, str(tmp_path)], env=env, capture_output=True, text=True, check=True
            ).stdout
        )
        for _ in range(2)
    ]
    x = np.arange(10.0)
    blocks = np.arange(10) // 4
    for run in runs:
        np.testing.assert_array_equal(run["outs"][0], 2 * x + blocks)
        np.testing.assert_array_equal(run["outs"][1], 2 * x)
    assert runs[0]["stats"] == [[0, 1], [0, 1]]  # both compiled, neither found the other's entry
    assert runs[1]["stats"] == [[1, 0], [1, 0]]  # both loaded from the cache
    indexes = sorted(p.name.split("-")[0] for p in (tmp_path / "cache").rglob("*.nbi"))
    assert indexes == ["kernel.blocked_double", "kernel.blocked_double_serial"]


TEMPLATES = textwrap.dedent(
    """
    import numba
    from moeroute.experts.cpu.variants import specialize

    def value(x):  # bound per format
        raise NotImplementedError

    def _item(x, i):
        return value(x[i]) + 1.0

    def apply(x, out):
        for i in numba.prange(x.shape[0]):
            out[i] = _item(x, i)

    made = {
        prefix: specialize(__name__, prefix, dict(globals(), value=numba.njit(f)), helpers=(_item,), kernels=(apply,))
        for prefix, f in (("twice", lambda v: 2.0 * v), ("square", lambda v: v * v))
    }
    twice_apply, square_apply = made["twice"]["apply"], made["square"]["apply"]
    square_apply_serial = made["square"]["apply_serial"]
    """
)

RUN_TEMPLATES = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    import formats
    x = np.arange(4, dtype=np.float64)
    kernels = (formats.twice_apply, formats.square_apply, formats.square_apply_serial)
    outs = []
    for f in kernels:
        out = np.zeros(4)
        f(x, out)
        outs.append(out.tolist())
    stats = [[sum(f.stats.cache_hits.values()), sum(f.stats.cache_misses.values())] for f in kernels]
    names = [[f.py_func.__qualname__, f.py_func.__module__] for f in kernels]
    print(json.dumps({"outs": outs, "stats": stats, "names": names}))
    """
)


def test_specialized_copies_bind_their_own_functions_and_cache_apart(tmp_path):
    # Two formats' copies of one template: each calls its own bound function, is named after
    # its prefix (so Numba's cache indexes differ) and loads from the cache in a new process.
    (tmp_path / "formats.py").write_text(TEMPLATES)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=ROOT)
    runs = [
        json.loads(
            subprocess.run(
                [sys.executable, "-c", RUN_TEMPLATES, str(tmp_path)],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
        for _ in range(2)
    ]
    x = np.arange(4.0)
    for run in runs:
        np.testing.assert_array_equal(run["outs"][0], 2 * x + 1)
        np.testing.assert_array_equal(run["outs"][1], x * x + 1)
        np.testing.assert_array_equal(run["outs"][2], x * x + 1)
        assert run["names"] == [
            ["twice_apply", "formats"],
            ["square_apply", "formats"],
            ["square_apply_serial", "formats"],
        ]
    assert runs[0]["stats"] == [[0, 1]] * 3
    assert runs[1]["stats"] == [[1, 0]] * 3
    indexes = sorted(p.name.split("-")[0] for p in (tmp_path / "cache").rglob("*.nbi"))
    assert indexes == ["formats.square_apply", "formats.square_apply_serial", "formats.twice_apply"]
