"""The dispatch primitives' CUDA kernels under the Numba CUDA simulator, against the CPU path.

Run by tests/routing/test_dispatch_cuda.py in a subprocess with NUMBA_ENABLE_CUDASIM=1
(the simulator must be chosen before numba is imported). The simulator runs every CUDA
thread as a Python thread (~2 ms each), so the shapes are small; the sort kernels are also
launched with tiny chunks and blocks so that several chunks, tiles and scan tiles occur.
"""

import numpy as np
import pytest
import torch

from moeroute.routing._arrays import simulator_enabled

if not simulator_enabled():
    pytest.skip("needs NUMBA_ENABLE_CUDASIM=1 before numba is imported", allow_module_level=True)

from numba import cuda  # noqa: E402

from moeroute.layout import ExpertLayout  # noqa: E402
from moeroute.routing import _sort  # noqa: E402
from moeroute.routing.align import align_block_size  # noqa: E402
from moeroute.routing.combine import combine  # noqa: E402
from moeroute.routing.permute import permute, sort_by_expert  # noqa: E402
from moeroute.routing.remap import logical_to_physical, remap_to_local  # noqa: E402
from moeroute.routing.shared_slots import append_shared_slots  # noqa: E402


def dev(array):
    return cuda.to_device(np.ascontiguousarray(array))


def host(array):
    return array.copy_to_host()


def bf16_bits(values):
    return torch.from_numpy(np.asarray(values, np.float32)).to(torch.bfloat16).view(torch.uint16).numpy()


# ------------------------------------------------------------------ align / sort


def test_align_spec_example():
    ids = np.array([[0, 1], [1, 2], [0, 2]], np.int32)
    sorted_ids, expert_ids, total = align_block_size(dev(ids), 4, 2)
    assert host(sorted_ids).tolist() == [0, 4, 1, 2, 3, 5, 6, 6, 6, 6]
    assert host(expert_ids).tolist() == [0, 1, 2, -1, -1]
    total = host(total)
    assert total.dtype == np.int32 and total.tolist() == [6]


@pytest.mark.parametrize("block_size", [1, 4])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_align_matches_cpu(block_size, dtype):
    rng = np.random.default_rng(block_size)
    ids = rng.integers(-2, 9, (9, 3)).astype(dtype)
    got = align_block_size(dev(ids), 7, block_size)
    want = align_block_size(ids, 7, block_size)
    np.testing.assert_array_equal(host(got[0]), want[0])
    np.testing.assert_array_equal(host(got[1]), want[1])
    assert int(host(got[2])[0]) == want[2]


@pytest.mark.parametrize("block_size", [1, 3])
def test_counting_sort_over_many_chunks_tiles_and_scan_tiles(block_size):
    """chunk 10 / 4 threads: 4 chunks of 3 tiles; 40 experts over 8 scan threads: 5 tiles."""
    rng = np.random.default_rng(7)
    num_experts = 40
    ids = rng.integers(-1, num_experts + 1, (13, 3)).astype(np.int32)
    ids[:6] = rng.integers(0, 3, (6, 3))  # crowd a few experts so runs span chunks
    numel = ids.size
    capacity = _sort.padded_capacity(numel, num_experts, block_size)
    sorted_out = cuda.device_array(capacity, np.int32)
    starts = cuda.device_array(num_experts + 1, np.int32)
    expert_ids = cuda.device_array(capacity // block_size, np.int32)
    inverse = cuda.device_array(ids.shape, np.int32)
    _sort.counting_sort_device(
        dev(ids),
        num_experts,
        block_size,
        sorted_out,
        starts,
        expert_ids,
        inverse,
        cuda.default_stream(),
        chunk_size=10,
        threads_per_block=4,
    )
    want_sorted, want_experts, want_total = align_block_size(ids, num_experts, block_size)
    np.testing.assert_array_equal(host(sorted_out), want_sorted)
    np.testing.assert_array_equal(host(expert_ids), want_experts)
    assert host(starts)[-1] == want_total
    if block_size == 1:
        slots, offsets, inverse_index = sort_by_expert(ids, num_experts)
        np.testing.assert_array_equal(host(starts), offsets)
        np.testing.assert_array_equal(host(inverse), inverse_index)


def test_zero_tokens():
    ids = np.zeros((0, 4), np.int32)
    sorted_ids, expert_ids, total = align_block_size(dev(ids), 3, 4)
    want = align_block_size(ids, 3, 4)
    np.testing.assert_array_equal(host(sorted_ids), want[0])
    np.testing.assert_array_equal(host(expert_ids), want[1])
    assert host(total).tolist() == [0]
    slots, offsets, inverse = sort_by_expert(dev(ids), 3)
    assert host(slots).shape == (0,) and host(inverse).shape == (0, 4)
    np.testing.assert_array_equal(host(offsets), [0, 0, 0, 0])


def test_sort_by_expert_matches_cpu_with_an_explicit_stream():
    rng = np.random.default_rng(3)
    ids = rng.integers(-1, 6, (11, 3))
    slots, offsets, inverse = sort_by_expert(dev(ids), 5, stream=cuda.stream())
    want_slots, want_offsets, want_inverse = sort_by_expert(ids, 5)
    np.testing.assert_array_equal(host(offsets), want_offsets)
    np.testing.assert_array_equal(host(inverse), want_inverse)
    # Sized by the upper bound T*K: the sort, then the padding value T*K.
    kept = int(want_offsets[-1])
    assert kept < ids.size  # some -1 ids were dropped
    np.testing.assert_array_equal(host(slots), np.r_[want_slots, np.full(ids.size - kept, ids.size)])


@pytest.mark.parametrize("kind", ["float32", "bf16-bits"])
def test_permute_matches_cpu_bit_for_bit(kind):
    rng = np.random.default_rng(4)
    ids = rng.integers(-1, 5, (7, 2))
    values = rng.standard_normal((7, 3)).astype(np.float32)
    hidden = values if kind == "float32" else bf16_bits(values)
    got = permute(dev(hidden), dev(ids), 5)
    want = permute(hidden, ids, 5)
    kept = want[0].shape[0]
    assert kept < ids.size and host(got[0]).shape == (ids.size, 3)
    assert host(got[0])[:kept].tobytes() == want[0].tobytes()
    for g, w in zip(got[1:], want[1:]):
        np.testing.assert_array_equal(host(g), w)


def test_permute_and_combine_over_several_column_tiles():
    """H = 300 spans two column tiles of 256 threads (blockIdx.y = 0, 1)."""
    rng = np.random.default_rng(10)
    ids = np.array([[2, -1], [0, 2]], np.int32)
    hidden = rng.standard_normal((2, 300)).astype(np.float32)
    permuted, _, inverse = permute(dev(hidden), dev(ids), 3)
    want, _, want_inverse = permute(hidden, ids, 3)
    np.testing.assert_array_equal(host(permuted)[:3], want)
    weights = rng.random((2, 2)).astype(np.float32)
    got = host(combine(permuted, inverse, dev(weights)))
    assert got.tobytes() == combine(want, want_inverse, weights).tobytes()


# ------------------------------------------------------------------ combine


@pytest.mark.parametrize("kind", ["float32", "float16", "bf16-uint16", "bf16-int16"])
@pytest.mark.parametrize("weighted", [True, False])
def test_combine_matches_cpu(kind, weighted):
    rng = np.random.default_rng(5)
    inverse = rng.integers(-1, 8, (5, 3)).astype(np.int32)
    weights = rng.random((5, 3)).astype(np.float32) if weighted else None
    values = rng.standard_normal((8, 4)).astype(np.float32)
    raw = kind.startswith("bf16")
    expert_out = {
        "float32": values,
        "float16": values.astype(np.float16),
        "bf16-uint16": bf16_bits(values),
        "bf16-int16": bf16_bits(values).view(np.int16),
    }[kind]
    got = combine(dev(expert_out), dev(inverse), None if weights is None else dev(weights), raw_bf16=raw)
    want = combine(expert_out, inverse, weights, raw_bf16=raw)
    got = host(got)
    assert got.dtype == want.dtype
    # The simulator sums in the same order in float32: equal bits.
    assert got.tobytes() == want.tobytes()


def test_combine_bf16_rounding_matches_cpu():
    special = np.array([[1 + 2**-8], [1 + 3 * 2**-8], [3.4e38], [-1e-40], [np.inf], [-2.5]], np.float32)
    one = bf16_bits(np.ones((1, 1)))
    index = np.zeros((6, 1), np.int32)
    got = host(combine(dev(one), dev(index), dev(special), raw_bf16=True))
    np.testing.assert_array_equal(got, bf16_bits(special))


def test_combine_empty_and_type_errors():
    assert host(combine(dev(np.zeros((2, 3), np.float32)), dev(np.zeros((0, 2), np.int32)))).shape == (0, 3)
    with pytest.raises(TypeError, match="float32"):
        combine(dev(np.zeros((2, 3), np.float32)), dev(np.zeros((1, 2), np.int32)), dev(np.ones((1, 2), np.float64)))
    with pytest.raises(TypeError, match="all be device arrays"):
        combine(dev(np.zeros((2, 3), np.float32)), np.zeros((1, 2), np.int32))


# ------------------------------------------------------------------ ids


LAYOUT = ExpertLayout(6, 2, ep_size=2, dispatch="all2all", num_redundant_experts=4, replica_table=[0, 0, 0, 3])
# route's layout: the 8 experts of _graph_safety_cases' router, replicas, per-rank slots.
ROUTE_LAYOUT = ExpertLayout(8, 1, ep_size=2, dispatch="all2all", num_redundant_experts=2)


def test_logical_to_physical_matches_cpu():
    rng = np.random.default_rng(6)
    ids = rng.integers(-1, 8, (9, 3))
    np.testing.assert_array_equal(host(logical_to_physical(dev(ids), LAYOUT)), logical_to_physical(ids, LAYOUT))


@pytest.mark.parametrize("gate", ["none", "scalar", "[T]", "[T,S]"])
def test_append_shared_slots_matches_cpu(gate):
    rng = np.random.default_rng(8)
    ids = rng.integers(-1, 7, (4, 3)).astype(np.int32)
    weights = rng.random((4, 3)).astype(np.float32)
    shared = {
        "none": None,
        "scalar": 0.5,
        "[T]": rng.random(4).astype(np.float32),
        "[T,S]": rng.random((4, 2)).astype(np.float32),
    }[gate]
    device_shared = dev(shared) if isinstance(shared, np.ndarray) else shared
    got = append_shared_slots(dev(weights), dev(ids), LAYOUT, 1, device_shared)
    want = append_shared_slots(weights, ids, LAYOUT, 1, shared)
    np.testing.assert_array_equal(host(got[0]), want[0])
    np.testing.assert_array_equal(host(got[1]), want[1])


def test_append_shared_slots_not_fused_and_errors():
    layout = ExpertLayout(8, 1, ep_size=2, dispatch="all2all", shared="overlap")
    ids = np.array([[1, 6]], np.int32)
    weights = np.ones((1, 2), np.float32)
    got = append_shared_slots(dev(weights), dev(ids), layout, 0)
    np.testing.assert_array_equal(host(got[1]), append_shared_slots(weights, ids, layout, 0)[1])
    output_regime = ExpertLayout(8, 1, scaling_regime="output")
    with pytest.raises(ValueError, match="shared_slot_weight"):
        append_shared_slots(dev(weights), dev(ids), output_regime)
    with pytest.raises(ValueError, match="home_rank=2"):
        append_shared_slots(dev(weights), dev(ids), LAYOUT, 2)
    with pytest.raises(TypeError, match="host array"):
        append_shared_slots(dev(weights), dev(ids), LAYOUT, 0, np.ones(1, np.float32))
    with pytest.raises(TypeError, match="topk_ids must be an integer array"):
        append_shared_slots(dev(weights), dev(ids.astype(np.float32)), LAYOUT, 0)
    with pytest.raises(TypeError, match="weights come before ids since 0.2"):
        append_shared_slots(dev(ids), dev(weights), LAYOUT, 0)


@pytest.mark.parametrize("device_map", [True, False])
def test_remap_to_local_matches_cpu(device_map):
    expert_map = LAYOUT.expert_map(1)
    rng = np.random.default_rng(9)
    ids = rng.integers(-2, LAYOUT.num_physical_experts + 2, (5, 4)).astype(np.int32)
    table = dev(expert_map) if device_map else expert_map
    got = host(remap_to_local(dev(ids), table))
    assert got.shape == ids.shape
    np.testing.assert_array_equal(got, remap_to_local(ids, expert_map))


# ------------------------------------------------------------------ graph safety


class HostTraffic:
    """Counts what would stall or break a CUDA graph capture on a real device: copies to
    or from the host, host reads of device elements, synchronizations, and allocations
    that do not go through `moeroute.routing._arrays.device_empty` (the one gateway to the
    caller framework's allocator)."""

    def __init__(self):
        self.events = []
        self.launches = []  # kernel names, in launch order
        self.counting = False

    def note(self, what):
        if self.counting:
            self.events.append(what)


@pytest.fixture
def traffic(monkeypatch):
    import sys
    import threading

    from numba.cuda.simulator import api as sim_api
    from numba.cuda.simulator.cudadrv import devicearray as sim_arrays

    from moeroute.routing import _arrays

    record = HostTraffic()
    gateway = _arrays.device_empty.__code__

    def counted(name, function, allowed_from=None):
        def wrapper(*args, **kwargs):
            if allowed_from is None or sys._getframe(1).f_code is not allowed_from:
                record.note(name)
            return function(*args, **kwargs)

        return wrapper

    for name in ("device_array", "device_array_like", "pinned_array", "mapped_array", "managed_array"):
        if not hasattr(cuda, name):
            continue
        original = getattr(cuda, name)
        monkeypatch.setattr(cuda, name, counted(name, original, allowed_from=gateway))
    for name in ("to_device", "synchronize"):
        monkeypatch.setattr(cuda, name, counted(name, getattr(cuda, name)))
    monkeypatch.setattr(sim_api.stream, "synchronize", counted("stream.synchronize", sim_api.stream.synchronize))
    monkeypatch.setattr(sim_api.Event, "synchronize", counted("event.synchronize", sim_api.Event.synchronize))
    fake = sim_arrays.FakeCUDAArray
    for name in (
        "copy_to_host",
        "copy_to_device",
        "__array__",
        "__int__",
        "__float__",
        "__index__",
        "__bool__",
        "tolist",
        "item",
    ):
        if hasattr(fake, name):
            monkeypatch.setattr(fake, name, counted(f"FakeCUDAArray.{name}", getattr(fake, name)), raising=False)
    getitem = fake.__getitem__

    def host_getitem(self, index):
        value = getitem(self, index)
        # Kernel threads read elements all the time; the host thread reading one is a
        # device-to-host copy and a synchronization on a real device.
        if threading.current_thread() is threading.main_thread() and not isinstance(value, fake):
            record.note("host element read")
        return value

    monkeypatch.setattr(fake, "__getitem__", host_getitem)
    launch = __import__("numba.cuda.simulator.kernel", fromlist=["FakeCUDAKernel"]).FakeCUDAKernel
    call = launch.__call__

    def checked_call(self, *args):
        # A NumPy argument of a launch is copied to the device and back around it (device
        # functions, called on kernel threads, take the simulator's local arrays as NumPy).
        if threading.current_thread() is threading.main_thread():
            if record.counting:
                record.launches.append(self.fn.__name__)
            for arg in args:
                if isinstance(arg, np.ndarray) and arg.ndim > 0:
                    record.note("NumPy kernel argument")
        return call(self, *args)

    monkeypatch.setattr(launch, "__call__", checked_call)
    return record


def _graph_safety_cases():
    from moeroute.config import RouterConfig
    from moeroute.routing.route import route
    from moeroute.routing.select import select_experts

    rng = np.random.default_rng(11)
    ids = rng.integers(-1, 6, (5, 2)).astype(np.int32)
    weights = rng.random((5, 2)).astype(np.float32)
    hidden = rng.standard_normal((5, 3)).astype(np.float32)
    expert_map = LAYOUT.expert_map(1)
    num_local = LAYOUT.num_local_experts(1)
    inverse = sort_by_expert(ids, 6)[2]
    expert_out = rng.standard_normal((ids.size, 3)).astype(np.float32)
    logits = rng.standard_normal((3, 8)).astype(np.float32)
    config = RouterConfig(8, 2, scoring="sigmoid", renormalize=True)
    bias = rng.standard_normal(8).astype(np.float32)
    gate = rng.random(3).astype(np.float32)
    return {
        "select_experts": (
            lambda d: select_experts(d(logits), config, d(bias)),
            lambda: select_experts(logits, config, bias),
        ),
        "route": (
            lambda d: route(d(logits), config, ROUTE_LAYOUT, 1, d(bias), d(gate), 1),
            lambda: route(logits, config, ROUTE_LAYOUT, 1, bias, gate, 1),
        ),
        "align_block_size": (lambda d: align_block_size(d(ids), 6, 4), lambda: align_block_size(ids, 6, 4)),
        "align_block_size[host map]": (
            lambda d: align_block_size(d(ids), num_local, 4, expert_map),
            lambda: align_block_size(ids, num_local, 4, expert_map),
        ),
        "align_block_size[device map]": (
            lambda d: align_block_size(d(ids), num_local, 4, d(expert_map)),
            lambda: align_block_size(ids, num_local, 4, expert_map),
        ),
        "sort_by_expert": (lambda d: sort_by_expert(d(ids), 6), lambda: sort_by_expert(ids, 6)),
        "permute": (lambda d: permute(d(hidden), d(ids), 6), lambda: permute(hidden, ids, 6)),
        "combine": (
            lambda d: combine(d(expert_out), d(inverse), d(weights)),
            lambda: combine(expert_out, inverse, weights),
        ),
        "combine-unweighted": (lambda d: combine(d(expert_out), d(inverse)), lambda: combine(expert_out, inverse)),
        "logical_to_physical": (
            lambda d: logical_to_physical(d(ids), LAYOUT),
            lambda: logical_to_physical(ids, LAYOUT),
        ),
        "append_shared_slots": (
            lambda d: append_shared_slots(d(weights), d(ids), LAYOUT, 1),
            lambda: append_shared_slots(weights, ids, LAYOUT, 1),
        ),
        "remap_to_local[host map]": (
            lambda d: remap_to_local(d(ids), expert_map),
            lambda: remap_to_local(ids, expert_map),
        ),
        "remap_to_local[device map]": (
            lambda d: remap_to_local(d(ids), d(expert_map)),
            lambda: remap_to_local(ids, expert_map),
        ),
    }


GRAPH_SAFETY_OPS = [
    "select_experts",
    "route",
    "align_block_size",
    "align_block_size[host map]",
    "align_block_size[device map]",
    "sort_by_expert",
    "permute",
    "combine",
    "combine-unweighted",
    "logical_to_physical",
    "append_shared_slots",
    "remap_to_local[host map]",
    "remap_to_local[device map]",
]


def _as_tuple(result):
    return result if isinstance(result, tuple) else (result,)


@pytest.mark.parametrize("op", GRAPH_SAFETY_OPS)
def test_device_ops_copy_sync_and_allocate_nothing_outside_the_framework(op, traffic):
    """After a warm-up call (kernel compile, layout and map tables uploaded once), a call on
    device inputs neither copies to or from the host, nor synchronizes, nor allocates
    except through the caller framework's allocator; its values still match the CPU."""
    device_op, host_op = _graph_safety_cases()[op]
    device_op(dev)  # warm-up: compiles, caches tables
    inputs = {}

    def staged(array):  # inputs are uploaded before counting starts
        if id(array) not in inputs:
            inputs[id(array)] = dev(array)
        return inputs[id(array)]

    device_op(staged)
    traffic.counting = True
    got = device_op(staged)
    traffic.counting = False
    assert traffic.events == [], f"{op}: {sorted(set(traffic.events))}"
    want = _as_tuple(host_op())
    for g, w in zip(_as_tuple(got), want):
        g = host(g) if hasattr(g, "copy_to_host") else np.asarray(g)
        w = np.asarray(w)
        if op in ("sort_by_expert", "permute") and g.shape != w.shape:
            g = g[: w.shape[0]]  # device outputs are sized by the upper bound T*K
        if op == "align_block_size" and g.shape == (1,):
            g = g[0]
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=0)


def test_the_instrumentation_sees_each_kind_of_traffic(traffic):
    """The counter is not blind: a sync, a read-back, a copy, a stray allocation, a host
    element read and a NumPy kernel argument each show up."""
    array = dev(np.arange(4, dtype=np.int32))
    traffic.counting = True
    cuda.default_stream().synchronize()
    array.copy_to_host()
    cuda.to_device(np.zeros(2))
    cuda.device_array(3, np.int32)
    int(array[1])
    remap_to_local(array, np.arange(4, dtype=np.int32))  # first upload of a host map
    permute_module = __import__("moeroute.routing.permute", fromlist=["_gather_kernel"])
    permute_module._gather_kernel()[(1, 1), 32](
        np.zeros((1, 1), np.float32), array, array[:1], 1, np.zeros((1, 1), np.float32)
    )
    traffic.counting = False
    names = set(traffic.events)
    assert {
        "stream.synchronize",
        "FakeCUDAArray.copy_to_host",
        "to_device",
        "device_array",
        "host element read",
        "NumPy kernel argument",
    } <= names, traffic.events


#: Kernel launches per op on device inputs: align in two (count, then scan + place + pad).
EXPECTED_LAUNCHES = {
    "select_experts": ["select_experts_kernel"],
    # select + replicas + shared slots + local ids: one launch.
    "route": ["route_kernel"],
    "align_block_size": ["_count_kernel", "_place_kernel"],
    # The map is read inside both kernels: no remap launch, no [T, K] buffer.
    "align_block_size[host map]": ["_count_kernel", "_place_kernel"],
    "align_block_size[device map]": ["_count_kernel", "_place_kernel"],
    "sort_by_expert": ["_count_kernel", "_place_kernel"],
    "permute": ["_count_kernel", "_place_kernel", "_gather_rows_kernel"],
    "combine": ["_combine_kernel"],
    "combine-unweighted": ["_combine_kernel"],
    "logical_to_physical": ["logical_to_physical_kernel"],
    "append_shared_slots": ["_append_kernel"],
    "remap_to_local[host map]": ["_remap_kernel"],
    "remap_to_local[device map]": ["_remap_kernel"],
}


@pytest.mark.parametrize("op", GRAPH_SAFETY_OPS)
def test_launches_per_op(op, traffic):
    device_op, _ = _graph_safety_cases()[op]
    device_op(dev)
    traffic.counting = True
    device_op(dev)
    traffic.counting = False
    assert traffic.launches == EXPECTED_LAUNCHES[op]


@pytest.mark.parametrize("op", GRAPH_SAFETY_OPS)
def test_every_launch_goes_through_the_launcher_with_numba_typeof_signatures(op, traffic, monkeypatch):
    """Each kernel launch of each op is a `_launcher.launch` (so the cached launcher takes
    it on a GPU), and the signature the cached launcher compiles, `signature_of` the
    launch's arguments, is what numba's dispatcher types the same arguments as."""
    import numba

    from moeroute.routing import _launcher

    device_op, _ = _graph_safety_cases()[op]
    device_op(dev)
    seen = []
    launch = _launcher.launch

    def recorded(dispatcher, signature, griddim, blockdim, stream, args, launcher=None):
        derived = _launcher.signature_of(args)
        seen.append((dispatcher.fn.__name__, derived, tuple(numba.typeof(a) for a in args)))
        if signature is not None:
            assert tuple(signature) == derived
        return launch(dispatcher, signature, griddim, blockdim, stream, args, launcher)

    monkeypatch.setattr(_launcher, "launch", recorded)
    traffic.counting = True
    device_op(dev)
    traffic.counting = False
    assert [name for name, _, _ in seen] == traffic.launches == EXPECTED_LAUNCHES[op]
    for name, derived, typed in seen:
        assert derived == typed, name


def test_device_tables_are_uploaded_once_and_the_oldest_dropped():
    from moeroute.routing import remap as remap_module

    remap_module._device_maps.clear()
    maps = [np.full(4, i, np.int32) for i in range(remap_module._DEVICE_TABLE_CACHE_SIZE + 1)]
    first = remap_module.expert_map_device_table(maps[0])
    assert remap_module.expert_map_device_table(maps[0].copy()) is first  # by content
    np.testing.assert_array_equal(host(first), maps[0])
    for table in maps[1:]:
        remap_module.expert_map_device_table(table)
    assert len(remap_module._device_maps) == remap_module._DEVICE_TABLE_CACHE_SIZE
    assert remap_module.expert_map_device_table(maps[0]) is not first  # dropped, uploaded again
    assert remap_module.expert_map_device_table(maps[-1]) is remap_module.expert_map_device_table(maps[-1])
    tables = remap_module.layout_device_tables(LAYOUT)
    assert remap_module.layout_device_tables(LAYOUT) is tables
    for got, want in zip(tables, (LAYOUT.replica_offsets, LAYOUT.replica_ids, LAYOUT.routed_id_map)):
        np.testing.assert_array_equal(host(got), want)
