"""The CUDA kernels of moe_gemm.cu run on the CPU (tests/gpu/host_emulation.h) against NumPy.

Each GEMM runs on ragged routing: experts with 0, 1, B-1, B and B+1 rows, plus slots of other
ranks (id -1 and an id >= E); H and I are not multiples of any tile. Outputs start as NaN and
sit between guard regions: rows that must be written are compared with the reference, rows that
must not be written (slots of other ranks) must still be NaN, and nothing outside may change.
"""

import numpy as np
import pytest

from gpu_reference import (
    TOLERANCE,
    assert_close,
    from_storage,
    ragged_routing,
    random_problem,
    reference_slots,
    round_to,
    to_storage,
)
from gpu_host_emulator import GuardedArrays, SCHEDULES
from moeroute.gpu import launch as L
from moeroute.routing import reference

TOP_K = 3
SIMT_SHAPE = (37, 23)  # (H, I): odd, not multiples of any tile
MMA_SHAPE = (72, 40)  # multiples of 8 (16-byte rows), not of the 32-wide k step or the column tiles
# gate_up on the mma path needs only H % 8 == 0: an odd I leaves a last column with no pair
# (scalar tail) and rows starting at odd elements (no aligned 4-byte pair store).
MMA_ODD_COLUMNS_SHAPE = (72, 37)
# Compute capabilities of the two mma tile tables (launch.MMA_TILES, launch.MMA_TILES_SM90).
MMA_ARCHS = [pytest.param(80, id="sm80"), pytest.param(90, id="sm90")]

SIMT_CASES = [
    ("float32", 16),
    ("float32", 32),
    ("float32", 64),
    ("float32", 128),
    ("float16", 16),
    ("float16", 64),
    ("bfloat16", 16),
    ("bfloat16", 128),
]
MMA_CASES = [("bfloat16", 16), ("bfloat16", 32), ("bfloat16", 64), ("bfloat16", 128), ("float16", 16), ("float16", 64)]


class Case:
    """Inputs, routing and aligned rows of one ragged problem, stored as the kernels read them."""

    def __init__(self, dtype, block_size, shape, seed=0, counts=None):
        H, I = shape
        rng = np.random.default_rng(seed + block_size)
        counts = counts or [0, 1, block_size - 1, block_size, block_size + 1]
        self.num_experts = len(counts)
        self.topk_ids, self.topk_weights = ragged_routing(counts, TOP_K, self.num_experts, rng)
        self.num_tokens = self.topk_ids.shape[0]
        self.numel = self.num_tokens * TOP_K
        x, w_gate_up, w_down = random_problem(rng, self.num_tokens, H, I, self.num_experts)
        self.dtype, self.block_size, self.H, self.I = dtype, block_size, H, I
        self.arrays = GuardedArrays()
        self.x = self.arrays.copy(to_storage(x, dtype))
        self.w_gate_up = self.arrays.copy(to_storage(w_gate_up, dtype))
        self.w_down = self.arrays.copy(to_storage(w_down, dtype))
        self.weights = self.arrays.copy(self.topk_weights.reshape(-1))
        sorted_ids, expert_ids, _ = reference.align_block_size(self.topk_ids, self.num_experts, block_size)
        self.sorted_token_ids = self.arrays.copy(sorted_ids)
        self.expert_ids = self.arrays.copy(expert_ids)
        self.valid = ((self.topk_ids >= 0) & (self.topk_ids < self.num_experts)).reshape(-1)

    def values(self, array):
        return from_storage(array, self.dtype)

    def empty(self, rows, cols):
        return self.arrays.empty((rows, cols), L.STORAGE_DTYPES[self.dtype])

    def gemm(self, path, gated, a, c, cc=L.MMA_MIN_COMPUTE_CAPABILITY, **options):
        b = self.w_gate_up if gated else self.w_down
        n, k = (self.I, self.H) if gated else (self.H, self.I)
        return L.plan_expert_gemm(
            path=path,
            dtype=self.dtype,
            gated=gated,
            block_size=self.block_size,
            a=a,
            b=b,
            c=c,
            sorted_token_ids=self.sorted_token_ids,
            expert_ids=self.expert_ids,
            topk_weights=self.weights,
            numel=self.numel,
            top_k=TOP_K if gated else 1,
            n=n,
            k=k,
            compute_capability=cc,
            **options,
        )


def check_rows(case, actual, expected, what):
    """Valid slots match ``expected``; slots of other ranks were never written (still NaN)."""
    values = case.values(actual)
    assert_close(values[case.valid], expected[case.valid], case.dtype, what)
    assert np.isnan(values[~case.valid]).all(), f"{what}: rows of slots not on this device were written"
    case.arrays.check_guards()


def run_gate_up(emulator, case, path, activation="silu", cc=L.MMA_MIN_COMPUTE_CAPABILITY):
    intermediate = case.empty(case.numel, case.I)
    emulator.launch(case.gemm(path, True, case.x, intermediate, cc=cc, activation=activation))
    expected, _ = reference_slots(
        case.values(case.x),
        case.values(case.w_gate_up),
        case.values(case.w_down),
        case.topk_weights,
        case.topk_ids,
        activation=activation,
        dtype=case.dtype,
    )
    check_rows(case, intermediate, expected, f"intermediate ({path}, {activation})")
    return intermediate


def run_down(emulator, case, path, intermediate, apply_router_weight, cc=L.MMA_MIN_COMPUTE_CAPABILITY):
    expert_out = case.empty(case.numel, case.H)
    emulator.launch(case.gemm(path, False, intermediate, expert_out, cc=cc, apply_router_weight=apply_router_weight))
    # Reference from the kernel's own intermediate, so that only the down GEMM is under test.
    inter = case.values(intermediate)
    flat_ids = case.topk_ids.reshape(-1)
    w_down = case.values(case.w_down)
    expected = np.full((case.numel, case.H), np.nan)
    for j in np.nonzero(case.valid)[0]:
        y = w_down[flat_ids[j]] @ inter[j]
        expected[j] = round_to(y * case.topk_weights.reshape(-1)[j] if apply_router_weight else y, case.dtype)
    check_rows(case, expert_out, expected, f"expert_out ({path}, weights {'on' if apply_router_weight else 'off'})")
    return expert_out


@pytest.mark.parametrize("dtype, block_size", SIMT_CASES)
def test_simt_gemms(emulator, dtype, block_size):
    case = Case(dtype, block_size, SIMT_SHAPE)
    intermediate = run_gate_up(emulator, case, "simt")
    run_down(emulator, case, "simt", intermediate, apply_router_weight=True)


@pytest.mark.parametrize("cc", MMA_ARCHS)
@pytest.mark.parametrize("dtype, block_size", MMA_CASES)
def test_mma_gemms(emulator, dtype, block_size, cc):
    case = Case(dtype, block_size, MMA_SHAPE)
    intermediate = run_gate_up(emulator, case, "mma", cc=cc)
    run_down(emulator, case, "mma", intermediate, apply_router_weight=True, cc=cc)


@pytest.mark.parametrize("cc", MMA_ARCHS)
@pytest.mark.parametrize("dtype, block_size", [("bfloat16", 16), ("bfloat16", 128), ("float16", 64)])
@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
def test_mma_gate_up_odd_columns(emulator, dtype, block_size, activation, cc):
    # Packed pair stores where a row's pair is 4-byte aligned, two scalar stores where it is
    # not (odd rows of an odd I), one scalar store for the last column: all exact.
    case = Case(dtype, block_size, MMA_ODD_COLUMNS_SHAPE, seed=19)
    # Gate/up products of a few units: swigluoai's clamps at +-7 are reached.
    case.w_gate_up[...] = to_storage(case.values(case.w_gate_up) * 8.0, dtype)
    intermediate = case.empty(case.numel, case.I)
    emulator.launch(case.gemm("mma", True, case.x, intermediate, cc=cc, activation=activation))
    x, w_gate_up, I = case.values(case.x), case.values(case.w_gate_up), case.I
    flat_ids = case.topk_ids.reshape(-1)
    expected = np.full((case.numel, I), np.nan)
    for j in np.nonzero(case.valid)[0]:
        e, row = flat_ids[j], x[j // TOP_K]
        expected[j] = round_to(act_float64(w_gate_up[e, :I] @ row, w_gate_up[e, I:] @ row, activation), dtype)
    check_rows(case, intermediate, expected, f"odd-column intermediate ({activation}, sm_{cc})")


@pytest.mark.parametrize(
    "path, dtype, shape, cc",
    [("simt", "float32", (150, 70), 80), ("mma", "bfloat16", (264, 136), 80), ("mma", "bfloat16", (264, 136), 90)],
)
def test_many_tiles(emulator, path, dtype, shape, cc):
    # Several column tiles (gate_up and down) and more row tiles than one group of the mma
    # kernel's grouped tile order (8), with used blocks in the partial last group; k = 264
    # and 136 are not multiples of the 32-wide k slice, so the pipelines end on a partial stage.
    case = Case(dtype, 16, shape, seed=5, counts=[100, 0, 60])
    used_blocks = np.count_nonzero(case.expert_ids >= 0)
    assert used_blocks == 11 and len(case.expert_ids) % 8 != 0
    run_down(emulator, case, path, run_gate_up(emulator, case, path, cc=cc), apply_router_weight=True, cc=cc)


@pytest.mark.parametrize("path, dtype, shape", [("simt", "float32", SIMT_SHAPE), ("mma", "bfloat16", MMA_SHAPE)])
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_activations(emulator, path, dtype, shape, activation):
    run_gate_up(emulator, Case(dtype, 16, shape, seed=7), path, activation)


@pytest.mark.parametrize("path, dtype, shape", [("simt", "float16", SIMT_SHAPE), ("mma", "float16", MMA_SHAPE)])
def test_down_without_router_weight(emulator, path, dtype, shape):
    case = Case(dtype, 16, shape, seed=3)
    run_down(emulator, case, path, run_gate_up(emulator, case, path), apply_router_weight=False)


@pytest.mark.parametrize("cc", MMA_ARCHS)
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("eager_async_copies", [False, True])
def test_interleavings(emulator, schedule, eager_async_copies, cc):
    # Warps running ahead of each other, cp.async landing early or late: same results.
    emulator.configure(schedule, eager_async_copies)
    case = Case("bfloat16", 64, MMA_SHAPE, seed=11)
    run_down(emulator, case, "mma", run_gate_up(emulator, case, "mma", cc=cc), apply_router_weight=True, cc=cc)
    simt = Case("float32", 16, SIMT_SHAPE, seed=11)
    run_gate_up(emulator, simt, "simt")


def test_blocks_of_no_expert_write_nothing(emulator):
    case = Case("bfloat16", 16, MMA_SHAPE)
    case.expert_ids[:] = -1
    for path in ("simt", "mma"):
        intermediate = case.empty(case.numel, case.I)
        emulator.launch(case.gemm(path, True, case.x, intermediate))
        assert np.isnan(case.values(intermediate)).all()
    case.arrays.check_guards()


@pytest.mark.parametrize("dtype", L.DTYPES)
def test_sum_topk(emulator, dtype):
    rng = np.random.default_rng(5)
    T, K, H, E = 9, 4, 300, 6  # H > the kernel's 256 threads: two column passes
    topk_ids = rng.integers(0, E, size=(T, K)).astype(np.int32)
    topk_ids[0, :] = -1  # a token with no slot here
    topk_ids[1, 1] = -1  # a slot of another rank
    topk_ids[2, 3] = E + 1  # an id past the local experts
    valid = (topk_ids >= 0) & (topk_ids < E)
    values = rng.standard_normal((T * K, H)).astype(np.float32)
    arrays = GuardedArrays()
    expert_out = arrays.copy(to_storage(values, dtype))
    stored = from_storage(expert_out, dtype)
    expert_out_view = expert_out.view(np.uint16) if dtype != "float32" else expert_out.view(np.uint32)
    # Rows of invalid slots hold NaN: reading one would poison the sum.
    nan_bits = {"float32": 0x7FC00000, "float16": 0x7E00, "bfloat16": 0x7FC0}[dtype]
    expert_out_view[~valid.reshape(-1)] = nan_bits
    ids = arrays.copy(topk_ids)
    out = arrays.empty((T, H), L.STORAGE_DTYPES[dtype])
    emulator.launch(
        L.plan_sum_topk(
            dtype=dtype,
            expert_out=expert_out,
            topk_ids=ids,
            out=out,
            num_tokens=T,
            top_k=K,
            hidden_size=H,
            num_experts=E,
        )
    )
    expected = np.where(valid.reshape(-1)[:, None], stored, 0.0).reshape(T, K, H).sum(axis=1)
    actual = from_storage(out, dtype)
    assert (actual[0] == 0).all()
    scale = np.abs(expected).max()
    tolerance = {"float32": 1e-6, "float16": TOLERANCE["float16"], "bfloat16": TOLERANCE["bfloat16"]}[dtype]
    assert np.abs(actual - round_to(expected, dtype)).max() <= tolerance * scale
    arrays.check_guards()


# ------------------------------------------------------------------ biases and swigluoai


def swigluoai(gate, up):
    """gpt-oss's activation in float64: gate clamped above at 7, up to [-7, 7]."""
    gate = np.minimum(gate, 7.0)
    up = np.clip(up, -7.0, 7.0)
    return (up + 1.0) * gate / (1.0 + np.exp(-1.702 * gate))


def act_float64(gate, up, activation):
    if activation == "swigluoai":
        return swigluoai(gate, up)
    silu = gate / (1.0 + np.exp(-gate))
    return silu * up


@pytest.mark.parametrize(
    "path, dtype, shape, block_size, cc",
    [
        ("simt", "float32", SIMT_SHAPE, 16, 80),
        ("simt", "bfloat16", SIMT_SHAPE, 16, 80),
        ("mma", "bfloat16", MMA_SHAPE, 16, 80),
        ("mma", "float16", MMA_SHAPE, 16, 80),
        ("mma", "bfloat16", MMA_SHAPE, 16, 90),
        ("mma", "float16", MMA_SHAPE, 128, 90),
        ("mma", "bfloat16", MMA_SHAPE, 64, 90),
    ],
)
@pytest.mark.parametrize("activation", ["swigluoai", "silu"])
def test_biased_gemms(emulator, path, dtype, shape, block_size, cc, activation):
    case = Case(dtype, block_size, shape, seed=13)
    rng = np.random.default_rng(17)
    E, H, I = case.num_experts, case.H, case.I
    # Gate/up products of a few units: scaled so that the clamps at +-7 are reached.
    case.w_gate_up[...] = to_storage(case.values(case.w_gate_up) * 8.0, dtype)
    gate_up_bias = case.arrays.copy(to_storage(rng.standard_normal((E, 2 * I)) * 2.0, dtype))
    down_bias = case.arrays.copy(to_storage(rng.standard_normal((E, H)), dtype))
    intermediate = case.empty(case.numel, I)
    emulator.launch(case.gemm(path, True, case.x, intermediate, cc=cc, activation=activation, bias=gate_up_bias))
    x, w_gate_up, w_down = case.values(case.x), case.values(case.w_gate_up), case.values(case.w_down)
    b_gate_up, b_down = case.values(gate_up_bias), case.values(down_bias)
    flat_ids = case.topk_ids.reshape(-1)
    expected = np.full((case.numel, I), np.nan)
    pre_activation = []
    for j in np.nonzero(case.valid)[0]:
        e, row = flat_ids[j], x[j // TOP_K]
        gate = w_gate_up[e, :I] @ row + b_gate_up[e, :I]
        up = w_gate_up[e, I:] @ row + b_gate_up[e, I:]
        pre_activation.append((gate, up))
        expected[j] = round_to(act_float64(gate, up, activation), dtype)
    gates = np.concatenate([g for g, _ in pre_activation])
    ups = np.concatenate([u for _, u in pre_activation])
    assert (gates > 7).any() and (np.abs(ups) > 7).any()
    check_rows(case, intermediate, expected, f"biased intermediate ({path}, {activation})")

    expert_out = case.empty(case.numel, H)
    emulator.launch(case.gemm(path, False, intermediate, expert_out, cc=cc, apply_router_weight=True, bias=down_bias))
    inter = case.values(intermediate)
    expected = np.full((case.numel, H), np.nan)
    weights = case.topk_weights.reshape(-1)
    for j in np.nonzero(case.valid)[0]:
        e = flat_ids[j]
        expected[j] = round_to((w_down[e] @ inter[j] + b_down[e]) * weights[j], dtype)
    check_rows(case, expert_out, expected, f"biased expert_out ({path})")
