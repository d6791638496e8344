"""The cached launcher of the routing kernels (routing/_launcher.py).

* The argument layout is checked against the ``.entry`` parameters numba emits (PTX for
  sm_90, no GPU needed) for every select_experts signature and a kernel of every scalar type.
* The packer's values are checked on numpy-backed stand-ins of the three array kinds
  (torch CPU tensors, CuPy-like and numba-like objects) against hand-written lists.
* Launcher selection: the simulator and a machine without a device fall back to numba.
* ``gpu``: select_experts through the cached launcher equals the numba-dispatched result.
"""

import numpy as np
import pytest

cuda = pytest.importorskip("numba.cuda")

import numba  # noqa: E402
from numba import types  # noqa: E402

from moeroute.config import PRESETS  # noqa: E402
from moeroute.routing import _launcher  # noqa: E402
from moeroute.routing import select as select_module  # noqa: E402
from moeroute.routing._arrays import simulator_enabled  # noqa: E402

SIMULATED = simulator_enabled()
no_sim = pytest.mark.skipif(SIMULATED, reason="compiles with the real numba.cuda, not the simulator")

SELECT_KINDS = ["float32", "float16", "bfloat16"]
# Every scalar type the packer marshals, around arrays of 1, 2 and 3 dimensions.
ALL_SCALARS = (
    types.float32[:, ::1],
    types.int64,
    types.int32,
    types.uint32,
    types.int16,
    types.uint16,
    types.int8,
    types.uint8,
    types.float64,
    types.float32,
    types.float16,
    types.boolean,
    types.int64[::1],
    types.uint64,
    types.int8[:, :, ::1],
)


def _every_scalar_kernel(a, i64, i32, u32, i16, u16, i8, u8, f64, f32, f16, flag, b, u64, c):
    a[0, 0] = i64 + i32 + u32 + i16 + u16 + i8 + u8 + f64 + f32 + f16 + (1 if flag else 0) + b[0] + u64 + c[0, 0, 0]


def select_ptx(kind):
    function = select_module._device_kernel_function(8, 1, "softmax", False, True, kind)
    ptx, _ = cuda.compile_ptx(function, select_module._device_signature(kind), cc=(9, 0))
    return ptx


@no_sim
@pytest.mark.slow
@pytest.mark.parametrize("kind", SELECT_KINDS)
def test_select_layout_matches_numba_ptx(kind):
    signature = select_module._device_signature(kind)
    _, found = _launcher.parse_entry(select_ptx(kind))
    expected = _launcher.parameter_types(signature)
    # logits [T, N] and the outputs: 9 fields each; bias 7; 3 int64 and one float32 scalar.
    assert len(expected) == 9 + 7 + 3 + 1 + 9 + 9
    assert found == expected


@no_sim
def test_every_scalar_type_matches_numba_ptx():
    ptx, _ = cuda.compile_ptx(_every_scalar_kernel, ALL_SCALARS, cc=(9, 0))
    _, found = _launcher.parse_entry(ptx)
    assert found == _launcher.parameter_types(ALL_SCALARS)
    packed = _launcher.make_packer(ALL_SCALARS)(
        (
            CupyLike(np.zeros((2, 3), np.float32)),
            1,
            2,
            3,
            4,
            5,
            6,
            7,
            8.0,
            9.0,
            10.0,
            True,
            CupyLike(np.zeros(4, np.int64)),
            11,
            CupyLike(np.zeros((1, 2, 3), np.int8)),
        )
    )
    assert len(packed) == len(found)
    # CuPy copies each value at its own width: ints and floats as 8 bytes, NumPy scalars
    # at their itemsize. Every parameter gets exactly its PTX width.
    widths = {"u64": 8, "f64": 8, "u32": 4, "f32": 4, "u16": 2, "u8": 1}
    for value, ptx_type in zip(packed, found):
        size = 8 if type(value) in (int, float) else np.asarray(value).itemsize
        assert size == widths[ptx_type], (value, ptx_type)


def test_unsupported_argument_type_is_refused():
    with pytest.raises(ValueError, match="argument 1 has type complex64"):
        _launcher.parameter_types((types.float32[::1], types.complex64))
    with pytest.raises(ValueError, match="complex64"):
        _launcher.make_packer((types.complex64,))


def test_parse_entry_reads_name_and_parameters():
    ptx = ".visible .entry _Z1kPf(\n\t.param .u64 _Z1kPf_param_0,\n\t.param .f32 _Z1kPf_param_1\n)\n{\n\tret;\n}\n"
    assert _launcher.parse_entry(ptx) == ("_Z1kPf", ["u64", "f32"])
    with pytest.raises(ValueError, match="found 0"):
        _launcher.parse_entry(".version 8.0\n")


# ------------------------------------------------------------------ packing values


class CupyLike:
    """The attributes the launcher reads from a CuPy array, over NumPy memory."""

    class _Pointer:
        def __init__(self, ptr):
            self.ptr = ptr

    def __init__(self, array):
        self.array = array
        self.data = self._Pointer(array.ctypes.data)
        self.shape = array.shape
        self.strides = array.strides
        self.itemsize = array.itemsize


class NumbaLike:
    """The attributes the launcher reads from a numba device array, over NumPy memory."""

    def __init__(self, array):
        import ctypes

        self.array = array
        self.device_ctypes_pointer = ctypes.c_void_p(array.ctypes.data)
        self.shape = array.shape
        self.strides = array.strides
        self.dtype = array.dtype


def expected_select_parameters(logits, bias, out_w, out_ids, num_tokens, top_k, topk_group, rsf):
    """numba's ABI for select_experts' kernel, written out by hand from NumPy arrays."""

    def fields(a):
        return [0, 0, a.size, a.itemsize, a.ctypes.data, *a.shape, *a.strides]

    return (
        fields(logits)
        + fields(bias)
        + [num_tokens, top_k, topk_group, np.float32(rsf)]
        + fields(out_w)
        + fields(out_ids)
    )


def select_arrays(kind, num_tokens=5):
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((num_tokens, 8)).astype(
        {"float32": np.float32, "float16": np.float16, "bfloat16": np.int16}[kind]
    )
    bias = rng.standard_normal(8).astype(np.float32)
    return logits, bias, np.zeros((num_tokens, 2), np.float32), np.zeros((num_tokens, 2), np.int32)


def torch_wrap(array):
    torch = pytest.importorskip("torch")
    return torch.from_numpy(array)


@pytest.mark.parametrize("wrap", [CupyLike, NumbaLike, torch_wrap], ids=["cupy", "numba", "torch"])
@pytest.mark.parametrize("kind", SELECT_KINDS)
def test_packer_builds_numba_abi_values(kind, wrap):
    logits, bias, out_w, out_ids = select_arrays(kind)
    pack = _launcher.make_packer(select_module._device_signature(kind))
    packed = pack((wrap(logits), wrap(bias), 5, 2, 1, np.float32(2.5), wrap(out_w), wrap(out_ids)))
    expected = expected_select_parameters(logits, bias, out_w, out_ids, 5, 2, 1, 2.5)
    assert packed == expected
    assert [type(v) for v in packed] == [type(v) for v in expected]


def test_packer_refuses_wrong_arrays():
    kind = "float32"
    logits, bias, out_w, out_ids = select_arrays(kind)
    pack = _launcher.make_packer(select_module._device_signature(kind))

    def args(first):
        return (first, CupyLike(bias), 5, 2, 1, 1.0, CupyLike(out_w), CupyLike(out_ids))

    with pytest.raises(ValueError, match="argument 0 must be C-contiguous"):
        pack(args(CupyLike(np.zeros((8, 5), np.float32).T)))
    with pytest.raises(ValueError, match="argument 0 must be a 2-D array of 4-byte items"):
        pack(args(CupyLike(np.zeros(40, np.float32))))
    with pytest.raises(ValueError, match="2-D array of 4-byte items"):
        pack(args(CupyLike(logits.astype(np.float16))))
    with pytest.raises(TypeError, match="takes 8 arguments, got 7"):
        pack(args(CupyLike(logits))[:7])
    with pytest.raises(TypeError, match="got list"):
        pack(args([[1.0]]))
    # A column of one row is C-contiguous whatever its stride.
    column = CupyLike(np.zeros((5, 1), np.float32)[:, :1])
    column.strides = (4, 400)
    assert _launcher.make_packer((types.float32[:, ::1],))((column,))[-2:] == [4, 400]


# ------------------------------------------------------------------ selection


@pytest.fixture
def launcher_env(monkeypatch):
    def set_value(value):
        if value is None:
            monkeypatch.delenv(_launcher.LAUNCHER_ENV, raising=False)
        else:
            monkeypatch.setenv(_launcher.LAUNCHER_ENV, value)

    return set_value


def test_simulator_falls_back_to_numba(launcher_env):
    assert _launcher._resolve("auto", True) == "numba"
    assert "simulator" in _launcher._cached_unavailable_reason(True)
    launcher_env(None)
    assert _launcher.requested_launcher() == "auto"


def test_env_switch_selects_and_rejects(launcher_env):
    launcher_env("numba")
    assert _launcher.active_launcher() == "numba"
    launcher_env(" Cached ")
    assert _launcher.requested_launcher() == "cached"
    assert _launcher.active_launcher() == "cached"  # asked for explicitly: never silently numba
    launcher_env("ptx")
    with pytest.raises(ValueError, match=r"MOEROUTE_CUDA_LAUNCHER='ptx' is not one of"):
        _launcher.active_launcher()


def test_auto_follows_availability(launcher_env):
    launcher_env("auto")
    reason = _launcher.cached_unavailable_reason()
    assert _launcher.active_launcher() == ("numba" if reason else "cached")


def test_explicit_cached_without_device_says_why(launcher_env):
    reason = _launcher.cached_unavailable_reason()
    if reason is None:
        pytest.skip("the cached launcher can run here")
    launcher_env("cached")
    with pytest.raises(RuntimeError, match="cannot run: " + reason.split(" (")[0]):
        _launcher.launch(None, (), 1, 1, None, ())


@no_sim
@pytest.mark.slow
def test_compile_image_links_a_cubin_without_a_gpu():
    pytest.importorskip("cuda.core")
    kernel = select_module._device_kernel(8, 1, "softmax", False, True, "float32")
    cubin, name, ptx = _launcher.compile_image(kernel, select_module._device_signature("float32"), "sm_90")
    assert cubin[:4] == b"\x7fELF"
    assert name.encode() in cubin and _launcher.parse_entry(ptx)[0] == name
    assert ".target sm_90" in ptx


def test_kernels_with_linked_files_stay_on_numba():
    class Dispatcher:
        targetoptions = {"link": ("extra.cu",), "fastmath": False}

    with pytest.raises(RuntimeError, match="cannot reproduce the jit options {'link'"):
        _launcher.compile_image(Dispatcher(), (), "sm_90")


# ------------------------------------------------------------------ GPU

requires_gpu = pytest.mark.skipif(
    SIMULATED or _launcher.cached_unavailable_reason() is not None,
    reason=f"needs a CUDA GPU visible to CuPy: {_launcher.cached_unavailable_reason()}",
)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("framework", ["torch", "cupy"])
@pytest.mark.parametrize("preset_name", ["deepseek-v3", "qwen3.5-moe", "mixtral-8x7b"])
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 1000])
def test_gpu_cached_launch_equals_numba_dispatch(framework, preset_name, num_tokens, launcher_env):
    from moeroute.routing.select import select_experts

    preset = PRESETS[preset_name]
    config = preset.router
    rng = np.random.default_rng(num_tokens)
    host_logits = rng.standard_normal((num_tokens, config.num_experts)).astype(np.float32)
    host_bias = (0.1 * rng.standard_normal(config.num_experts)).astype(np.float32)
    if framework == "torch":
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("torch has no CUDA build here")
        to_device, to_host = (lambda a: torch.from_numpy(a).cuda()), (lambda t: t.cpu().numpy())
    else:
        import cupy

        to_device, to_host = cupy.asarray, cupy.asnumpy
    logits = to_device(host_logits)
    bias = to_device(host_bias) if preset.has_correction_bias else None
    results = {}
    for launcher in ("numba", "cached"):
        launcher_env(launcher)
        weights, ids = select_experts(logits, config, bias)
        assert type(weights) is type(logits)
        results[launcher] = to_host(weights), to_host(ids)
    np.testing.assert_array_equal(results["cached"][1], results["numba"][1])
    np.testing.assert_array_equal(results["cached"][0], results["numba"][0])


# ------------------------------------------------------------------ every op's launches


class CupyTyped(CupyLike):
    """CupyLike with the attributes the signature is read from (dtype, ndim, flags)."""

    class _Flags:
        def __init__(self, array):
            self.c_contiguous = array.flags.c_contiguous
            self.f_contiguous = array.flags.f_contiguous

    def __init__(self, array):
        super().__init__(array)
        self.dtype, self.ndim, self.flags = array.dtype, array.ndim, self._Flags(array)


ARRAY_CASES = {
    "2-D C": np.zeros((3, 4), np.float32),
    "2-D F": np.zeros((4, 3), np.int16).T,
    "2-D strided": np.zeros((4, 6), np.int32)[:, ::2],
    "1-D": np.zeros(5, np.int64),
    "1-D strided": np.zeros(6, np.float16)[::2],
    "3-D": np.zeros((2, 3, 4), np.uint8),
    "one row": np.zeros((1, 4), np.float32),
}


@pytest.mark.parametrize("case", ARRAY_CASES)
def test_array_types_are_numba_typeof_of_the_same_memory(case):
    torch = pytest.importorskip("torch")
    array = ARRAY_CASES[case]
    expected = numba.typeof(array)
    assert _launcher.argument_type(torch.from_numpy(array)) == expected
    assert _launcher.argument_type(CupyTyped(array)) == expected


def test_scalar_types_are_numba_typeof():
    values = [
        3,
        2.5,
        True,
        np.int32(1),
        np.int64(1),
        np.uint32(1),
        np.int8(1),
        np.float32(1),
        np.float64(1),
        np.bool_(True),
    ]
    assert _launcher.signature_of(values) == tuple(numba.typeof(v) for v in values)
    assert _launcher.signature_of(values)[:3] == (types.int64, types.float64, types.boolean)


def test_signatures_are_one_object_per_argument_types():
    """Launches with arguments of the same dtypes, ranks and layouts share one signature
    tuple (the launcher's identity key); a strided view or another dtype gets its own."""
    torch = pytest.importorskip("torch")
    first = (torch.zeros(3, 4), torch.zeros(5, dtype=torch.int32), 7, np.float32(1), True)
    again = (torch.ones(9, 2), torch.ones(1, dtype=torch.int32), 8, np.float32(2), False)
    assert _launcher.signature_of(first) is _launcher.signature_of(again)
    strided = (torch.zeros(4, 6)[:, ::2], *first[1:])
    transposed = (torch.zeros(4, 3).t(), *first[1:])
    assert _launcher.signature_of(strided)[0] == types.Array(types.float32, 2, "A")
    assert _launcher.signature_of(transposed)[0] == types.Array(types.float32, 2, "F")
    assert _launcher.signature_of((torch.zeros(3, 4, dtype=torch.float16), *first[1:]))[0] == types.float16[:, ::1]


def test_first_signature_of_a_numpy_scalar_is_the_one_later_launches_find(monkeypatch):
    """A NumPy scalar type seen for the first time keys its signature as later ones do
    (NumPy scalars carry ``flags`` like arrays; they must not be keyed as 0-d arrays)."""
    monkeypatch.setattr(_launcher, "_SCALAR_TYPES", {})
    monkeypatch.setattr(_launcher, "_SIGNATURES", {})
    first = _launcher.signature_of((np.float32(1), np.int16(2)))
    assert first == (types.float32, types.int16)
    assert _launcher.signature_of((np.float32(3), np.int16(4))) is first
    assert len(_launcher._SIGNATURES) == 1


def test_cached_kernels_are_found_by_value_and_by_identity():
    kernel = select_module._device_kernel(8, 1, "softmax", False, True, "float32")
    signature = select_module._device_signature("float32")
    found = _launcher.cached_kernel(kernel, signature)
    assert _launcher.cached_kernel(kernel, tuple(list(signature))) is found
    assert _launcher.cached_kernel(kernel, signature) is found
    other = _launcher.cached_kernel(kernel, select_module._device_signature("float32", "A"))
    assert other is not found and other.signature[1] == types.Array(types.float32, 1, "A")


def test_untyped_arguments_are_refused():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="bfloat16 tensors have no numba type"):
        _launcher.argument_type(torch.zeros(2, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="cannot type kernel argument of type str"):
        _launcher.signature_of((np.float32(1), "text"))


def op_kernel_launches():
    """(dispatcher, arguments) of each device op's kernel, with NumPy arrays of the dtypes
    and ranks the op passes (the simulator suite checks the ops' own launches are typed as
    `signature_of` types them)."""
    import importlib

    from moeroute.layout import ExpertLayout

    _sort, combine, load, permute, remap, route, shared_slots = (
        importlib.import_module(f"moeroute.routing.{name}")
        for name in ("_sort", "combine", "load", "permute", "remap", "route", "shared_slots")
    )

    layout = ExpertLayout(6, 1, ep_size=2, dispatch="all2all", num_redundant_experts=2)
    offsets, replicas, routed = (
        np.ascontiguousarray(a) for a in (layout.replica_offsets, layout.replica_ids, layout.routed_id_map)
    )
    ids = np.zeros((3, 2), np.int32)
    weights = np.zeros((3, 2), np.float32)
    table = np.zeros(7, np.int32)
    scratch = np.zeros((2, 6), np.int32)
    return {
        "load.zero": (load._kernel("zero"), (np.zeros(6, np.int64),)),
        "load.count": (load._kernel("count"), (ids.reshape(-1), np.zeros(6, np.int64))),
        "remap.l2p": (remap._kernel("l2p"), (ids, 6, offsets, replicas, routed, ids.copy())),
        "remap.remap": (remap._kernel("remap"), (ids.reshape(-1), table, ids.reshape(-1).copy())),
        "shared_slots.append": (
            shared_slots._kernel(),
            (
                ids,
                weights,
                6,
                offsets,
                replicas,
                routed,
                6,
                np.zeros((3, 1), np.float32),
                1,
                0,
                np.float32(1),
                True,
                np.zeros((3, 3), np.int32),
                np.zeros((3, 3), np.float32),
            ),
        ),
        "sort.count": (_sort.kernel("count"), (ids, table[:1], False, 6, 4, scratch)),
        "sort.place": (
            _sort.kernel("place"),
            (
                ids.astype(np.int64),
                table,
                True,
                6,
                4,
                2,
                4,
                scratch,
                scratch,
                np.zeros((2, 7), np.int32),
                scratch,
                np.zeros(7, np.int32),
                np.zeros(32, np.int32),
                ids.copy(),
                True,
                np.zeros(8, np.int32),
            ),
        ),
        "permute.gather": (
            permute._gather_kernel(),
            (
                np.zeros((3, 4), np.float16),
                np.zeros(6, np.int32),
                np.zeros(1, np.int32),
                2,
                np.zeros((6, 4), np.float16),
            ),
        ),
        "combine": (
            combine._kernel(False),
            (np.zeros((6, 4), np.float32), ids, weights, True, np.zeros((3, 4), np.float32)),
        ),
        "combine.bf16": (
            combine._kernel(True),
            (np.zeros((6, 4), np.uint16), ids, weights, False, np.zeros((3, 4), np.uint16)),
        ),
        "route": (
            route._route_kernel(6, 1, "sigmoid", True, True, "float32"),
            (
                np.zeros((3, 6), np.float32),
                np.zeros(6, np.float32),
                3,
                2,
                1,
                np.float32(1),
                6,
                offsets,
                replicas,
                routed,
                6,
                1,
                np.zeros((3, 1), np.float32),
                1,
                0,
                np.float32(0),
                True,
                table,
                np.zeros((3, 3), np.float32),
                np.zeros((3, 3), np.int32),
            ),
        ),
    }


@no_sim
@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "load.zero",
        "load.count",
        "remap.l2p",
        "remap.remap",
        "shared_slots.append",
        "sort.count",
        "sort.place",
        "permute.gather",
        "combine",
        "combine.bf16",
        "route",
    ],
)
def test_every_op_kernel_links_for_the_cached_launcher(name):
    """Each op's kernel compiles (PTX, sm_90) and links (nvJitLink) at the signature of its
    launch, and the packer's layout is the ``.entry`` numba emits for it."""
    pytest.importorskip("cuda.core")
    dispatcher, arguments = op_kernel_launches()[name]
    signature = tuple(numba.typeof(a) for a in arguments)
    cubin, entry, ptx = _launcher.compile_image(dispatcher, signature, "sm_90")
    assert cubin[:4] == b"\x7fELF" and entry.encode() in cubin
    assert _launcher.parse_entry(ptx)[1] == _launcher.parameter_types(signature)
    packed = _launcher.make_packer(signature)([CupyTyped(a) if isinstance(a, np.ndarray) else a for a in arguments])
    assert len(packed) == len(_launcher.parameter_types(signature))


def gpu_op_cases(to_device):
    """name -> call of each device op on ``to_device``'d inputs (the GPU comparison below)."""
    from moeroute import routing
    from moeroute.config import RouterConfig
    from moeroute.layout import ExpertLayout

    rng = np.random.default_rng(3)
    layout = ExpertLayout(16, 1, ep_size=2, dispatch="all2all", num_redundant_experts=2)
    config = RouterConfig(16, 4, scoring="sigmoid", renormalize=True)
    logits = to_device(rng.standard_normal((300, 16)).astype(np.float32))
    bias = to_device(rng.standard_normal(16).astype(np.float32))
    gate = to_device(rng.random(300).astype(np.float32))
    ids = to_device(rng.integers(-1, 16, (300, 4)).astype(np.int32))
    weights = to_device(rng.random((300, 4)).astype(np.float32))
    hidden = to_device(rng.standard_normal((300, 96)).astype(np.float16))
    expert_map = layout.expert_map(1)
    inverse = routing.sort_by_expert(ids, 16)[2]
    expert_out = to_device(rng.standard_normal((1200, 96)).astype(np.float32))
    return {
        "route": lambda: routing.route(logits, config, layout, 1, bias, gate, 1),
        "align_block_size": lambda: routing.align_block_size(ids, 9, 16, expert_map),
        "sort_by_expert": lambda: routing.sort_by_expert(ids, 16),
        "permute": lambda: routing.permute(hidden, ids, 16),
        "combine": lambda: routing.combine(expert_out, inverse, weights),
        "logical_to_physical": lambda: routing.logical_to_physical(ids, layout),
        "append_shared_slots": lambda: routing.append_shared_slots(weights, ids, layout, 1),
        "remap_to_local": lambda: routing.remap_to_local(ids, expert_map),
        "expert_load": lambda: routing.expert_load(ids, 16),
    }


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize(
    "op",
    [
        "route",
        "align_block_size",
        "sort_by_expert",
        "permute",
        "combine",
        "logical_to_physical",
        "append_shared_slots",
        "remap_to_local",
        "expert_load",
    ],
)
def test_gpu_every_op_cached_launch_equals_numba_dispatch(op, launcher_env):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA build here")
    call = gpu_op_cases(lambda a: torch.from_numpy(a).cuda())[op]
    results = {}
    for launcher in ("numba", "cached"):
        launcher_env(launcher)
        got = call()
        results[launcher] = [g.cpu().numpy() for g in (got if isinstance(got, tuple) else (got,))]
    for cached, numba_result in zip(results["cached"], results["numba"]):
        np.testing.assert_array_equal(cached, numba_result)


@no_sim
def test_launch_overhead_bench_runs_without_a_gpu(tmp_path):
    """bench/launch_overhead.py (the host-side figure of the cached launcher) runs here:
    every kernel, token count and array kind gets a row, and its own checks pass (the
    arguments are typed as numba types them, each packs to the kernel's parameter count)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, str(repo / "bench" / "launch_overhead.py"), "--repeats", "3", "--calls", "20"],
        env=dict(os.environ, MOEROUTE_BENCH_RESULTS=str(tmp_path)),
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = json.loads((tmp_path / "launch_overhead.json").read_text())["results"]
    assert {(r["kernel"], r["num_tokens"], r["arrays"]) for r in rows} == {
        (kernel, tokens, arrays)
        for kernel in ("select_experts", "route", "route, signature_of")
        for tokens in (1, 8, 64)
        for arrays in ("torch", "cupy-like")
    }
    assert {r["arguments"] for r in rows if r["kernel"] != "select_experts"} == {20}
    assert all(r["cached_pack_us_per_call"] > 0 and r["numba_typing_us_per_call"] > 0 for r in rows)


def test_strided_arguments_of_any_shape_share_one_signature():
    """Keys are per dtype, rank and layout letter: strided tensors of ever new shapes (a
    server's varying batch) reuse one signature and one cached kernel entry."""
    torch = pytest.importorskip("torch")
    signatures = {id(_launcher.signature_of((torch.zeros(rows, 6)[:, ::2], 1))) for rows in range(2, 40)}
    assert len(signatures) == 1
    kernel = select_module._device_kernel(8, 1, "softmax", False, True, "float32")
    entries = len(_launcher._BY_IDENTITY)
    for rows in range(2, 40):
        _launcher.cached_kernel(kernel, _launcher.signature_of((torch.zeros(rows, 6)[:, ::2],)))
    assert len(_launcher._BY_IDENTITY) <= entries + 1
