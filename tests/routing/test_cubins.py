"""The cached launcher's on-disk cubin cache (moeroute/routing/_cubins.py), without a GPU:
what names a kernel, that a second process-level request reads the entry instead of
compiling, and that anything the code depends on changes the key."""

import numpy as np
import pytest

cuda = pytest.importorskip("numba.cuda")

from moeroute.routing import _cubins, _launcher  # noqa: E402
from moeroute.routing._arrays import simulator_enabled  # noqa: E402
from moeroute.routing.select import _cuda as select_cuda  # noqa: E402
from moeroute.routing.select import _device as select_device  # noqa: E402

no_sim = pytest.mark.skipif(simulator_enabled(), reason="compiles with the real numba.cuda")


def select_kernel(num_experts, scoring="softmax"):
    """A fresh dispatcher (not the lru-cached one) of select's kernel."""
    return cuda.jit(select_cuda.select_kernel_function(num_experts, 1, scoring, False, True, "float32"))


def test_a_kernel_is_named_by_its_constants_not_by_its_object():
    assert _cubins.describe(select_kernel(8)) == _cubins.describe(select_kernel(8))
    names = {_cubins.describe(select_kernel(n, s)) for n in (8, 16, 64) for s in ("softmax", "sigmoid")}
    assert len(names) == 6 and None not in names


def test_generated_code_is_part_of_the_name():
    namespace = {}
    for value in (1, 2):
        exec(f"def constant():\n    return {value}\n", namespace)
        namespace[value] = namespace["constant"]
    assert _cubins.describe(namespace[1]) != _cubins.describe(namespace[2])


def test_a_kernel_closing_over_an_array_is_not_kept():
    table = np.zeros(3)

    def reads_table(out):
        out[0] = table[0]

    assert _cubins.describe(reads_table) is None
    assert _cubins.cache_key(cuda.jit(reads_table), (), "sm_90") is None


class Compiles:
    """A stand-in for compile_image that counts its calls."""

    def __init__(self):
        self.calls = []

    def __call__(self, dispatcher, signature, arch):
        self.calls.append(arch)
        return f"cubin for {arch}".encode(), f"entry_{arch}", "ptx"


@pytest.fixture
def cache_env(monkeypatch, tmp_path):
    monkeypatch.setenv(_cubins.CACHE_ENV, str(tmp_path / "cubins"))
    return tmp_path / "cubins"


def test_second_request_reads_the_entry(cache_env):
    kernel, signature = select_kernel(8), select_device._device_signature("float32")
    compiles = Compiles()
    first = _cubins.load_or_compile(kernel, signature, "sm_90", compiles)
    assert first == (b"cubin for sm_90", "entry_sm_90") and compiles.calls == ["sm_90"]
    # Another dispatcher object of the same kernel (a new process): read, not compiled.
    assert _cubins.load_or_compile(select_kernel(8), signature, "sm_90", compiles) == first
    assert compiles.calls == ["sm_90"]
    assert _cubins.load_or_compile(kernel, signature, "sm_80", compiles)[1] == "entry_sm_80"
    other = select_device._device_signature("float16")
    _cubins.load_or_compile(kernel, other, "sm_90", compiles)
    _cubins.load_or_compile(select_kernel(16), signature, "sm_90", compiles)
    assert compiles.calls == ["sm_90", "sm_80", "sm_90", "sm_90"]
    assert len(list(cache_env.glob("*.cubin"))) == 4
    assert not list(cache_env.glob("*.tmp"))


def test_the_key_follows_the_sources(cache_env, monkeypatch):
    from moeroute.routing import _cache

    kernel, signature = select_kernel(8), select_device._device_signature("float32")
    before = _cubins.cache_key(kernel, signature, "sm_90")
    monkeypatch.setattr(_cache, "sources_stamp", lambda: "edited")
    assert _cubins.cache_key(kernel, signature, "sm_90") != before


def test_off_and_unwritable_caches_still_compile(monkeypatch, tmp_path):
    kernel, signature = select_kernel(8), select_device._device_signature("float32")
    compiles = Compiles()
    monkeypatch.setenv(_cubins.CACHE_ENV, "off")
    assert _cubins.cache_dir() is None
    _cubins.load_or_compile(kernel, signature, "sm_90", compiles)
    _cubins.load_or_compile(kernel, signature, "sm_90", compiles)
    assert compiles.calls == ["sm_90", "sm_90"]
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    monkeypatch.setenv(_cubins.CACHE_ENV, str(blocked / "cubins"))
    assert _cubins.load_or_compile(kernel, signature, "sm_90", compiles)[1] == "entry_sm_90"
    assert compiles.calls == ["sm_90"] * 3


@no_sim
@pytest.mark.slow
def test_a_real_cubin_round_trips(cache_env):
    pytest.importorskip("cuda.core")
    load = __import__("moeroute.routing.load", fromlist=["_kernel"])
    kernel = load._kernel("count")
    from numba import types

    signature = (types.int32[::1], types.int64[::1])
    compiled = _cubins.load_or_compile(kernel, signature, "sm_90", _launcher.compile_image)
    assert compiled[0][:4] == b"\x7fELF"

    def refuse(*args):
        raise AssertionError("compiled again")

    assert _cubins.load_or_compile(kernel, signature, "sm_90", refuse) == compiled


@no_sim
@pytest.mark.slow
def test_warmup_cuda_fills_the_cache_a_launch_then_reads(cache_env, capsys):
    """`moeroute.runtime.warmup_cuda` compiles select's and route's kernels for a preset
    without a GPU; a second warm-up and the launcher's own lookup read them."""
    pytest.importorskip("cuda.core")
    from moeroute import runtime
    from moeroute.config import PRESETS

    first = runtime.warmup_cuda(["mixtral-8x7b"], archs=["sm_90"], dtypes=["float32"])
    assert (first["compiled"], first["loaded"]) == (2, 0)
    assert first["cache_dir"] == str(cache_env) and len(list(cache_env.glob("*.cubin"))) == 2
    again = runtime.warmup_cuda(["mixtral-8x7b"], archs=["sm_90"], dtypes=["float32"], progress=False)
    assert (again["compiled"], again["loaded"]) == (0, 2)
    assert "warmup_cuda sm_90 mixtral-8x7b" in capsys.readouterr().err

    router = PRESETS["mixtral-8x7b"].router
    kernel = select_device._device_kernel(
        router.num_experts, router.num_expert_group, router.scoring, False, router.renormalize, "float32"
    )

    def refuse(*args):
        raise AssertionError("compiled again")

    cubin, name = _cubins.load_or_compile(kernel, select_device._device_signature("float32"), "sm_90", refuse)
    assert cubin[:4] == b"\x7fELF" and name.encode() in cubin


def test_warmup_cuda_refuses_bad_arguments():
    from moeroute import runtime

    with pytest.raises(ValueError, match="arch 'sm90' is not of the form 'sm_XY'"):
        runtime.warmup_cuda(["mixtral-8x7b"], archs=["sm90"])
    with pytest.raises(ValueError, match="archs must be a non-empty sequence"):
        runtime.warmup_cuda(["mixtral-8x7b"], archs="sm_90")
    with pytest.raises(ValueError, match="each must be one of"):
        runtime.warmup_cuda(["no-such-model"])


def test_a_cache_variable_naming_a_file_is_refused(monkeypatch, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    monkeypatch.setenv(_cubins.CACHE_ENV, str(blocked))
    with pytest.raises(ValueError, match=r"MOEROUTE_CUBIN_CACHE='.*file' is not a directory"):
        _cubins.cache_dir()
    monkeypatch.setenv(_cubins.CACHE_ENV, " OFF ")
    assert _cubins.cache_dir() is None


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data[:5],  # truncated
        lambda data: b"X" + data[1:],  # one byte overwritten
        lambda data: b"",  # emptied
    ],
    ids=["truncated", "overwritten", "empty"],
)
def test_a_damaged_cubin_is_compiled_again_and_replaced(cache_env, damage):
    """A damaged .cubin entry used to be handed back as it was; now its digest does not
    match, one warning names it, and the fresh compile replaces it."""
    from moeroute.routing._cache import UnreadableCacheWarning

    kernel, signature = select_kernel(8), select_device._device_signature("float32")
    compiles = Compiles()
    first = _cubins.load_or_compile(kernel, signature, "sm_90", compiles)
    (entry,) = cache_env.glob("*.cubin")
    entry.write_bytes(damage(entry.read_bytes()))
    with pytest.warns(UnreadableCacheWarning) as caught:
        again = _cubins.load_or_compile(kernel, signature, "sm_90", compiles)
    assert len(caught) == 1 and str(entry) in str(caught[0].message)
    assert again == first == (b"cubin for sm_90", "entry_sm_90")
    assert compiles.calls == ["sm_90", "sm_90"]
    assert entry.read_bytes() == b"cubin for sm_90"  # replaced
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _cubins.load_or_compile(kernel, signature, "sm_90", compiles) == first
    assert compiles.calls == ["sm_90", "sm_90"]  # read, not compiled
