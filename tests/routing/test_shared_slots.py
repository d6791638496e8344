"""append_shared_slots on the CPU: every slot mode, gate form, home rank and error."""

import numpy as np
import pytest

from moeroute.layout import ExpertLayout
from moeroute.routing import reference
from moeroute.routing.shared_slots import append_shared_slots

# (label, layout arguments); all fuse the shared expert unless the label says otherwise.
LAYOUTS = [
    ("global S=1", dict(num_routed_experts=256, num_shared_experts=1)),
    ("global S=2", dict(num_routed_experts=60, num_shared_experts=2)),
    ("per_rank S=1 E=2", dict(num_routed_experts=8, num_shared_experts=1, ep_size=2, dispatch="all2all")),
    ("per_rank S=2 E=8", dict(num_routed_experts=512, num_shared_experts=2, ep_size=8, dispatch="all2all")),
    ("per_rank uneven E=3", dict(num_routed_experts=10, num_shared_experts=1, ep_size=3, dispatch="allgather")),
    (
        "global allgather",
        dict(num_routed_experts=16, num_shared_experts=2, ep_size=2, dispatch="allgather", shared_slots="global"),
    ),
    (
        "per_rank eplb",
        dict(num_routed_experts=12, num_shared_experts=1, ep_size=4, dispatch="all2all", num_redundant_experts=4),
    ),
    ("not fused", dict(num_routed_experts=32, num_shared_experts=1, ep_size=2, dispatch="all2all", shared="overlap")),
    ("no shared", dict(num_routed_experts=128)),
]
GATES = ["none", "scalar", "[T]", "[T,1]", "[T,S]"]
TOKENS = [0, 1, 7, 333]


def gate_for(kind, rng, tokens, slots):
    return {
        "none": None,
        "scalar": 0.75,
        "[T]": rng.random(tokens).astype(np.float32),
        "[T,1]": rng.random((tokens, 1)).astype(np.float32),
        "[T,S]": rng.random((tokens, max(slots, 1))).astype(np.float32),
    }[kind]


def routing(rng, tokens, layout, top_k=8):
    n = layout.num_routed_experts
    top_k = min(top_k, n)
    ids = np.argsort(rng.random((tokens, n)), axis=1)[:, :top_k].astype(np.int32)
    weights = rng.random((tokens, top_k)).astype(np.float32)
    return ids, weights


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("label,kwargs", LAYOUTS, ids=[label for label, _ in LAYOUTS])
def test_matches_reference_for_every_home_rank(label, kwargs, gate, tokens):
    layout = ExpertLayout(**kwargs)
    rng = np.random.default_rng(tokens * 13 + len(label))
    ids, weights = routing(rng, tokens, layout)
    shared_weights = gate_for(gate, rng, tokens, layout.num_shared_experts)
    slots = layout.num_shared_experts if layout.shared == "fused" else 0
    for home_rank in range(layout.ep_size):
        out_weights, out_ids = append_shared_slots(weights, ids, layout, home_rank, shared_weights)
        ref_weights, ref_ids = reference.append_shared_slots(weights, ids, layout, home_rank, shared_weights)
        assert out_ids.dtype == np.int32 and out_weights.dtype == np.float32
        assert out_ids.shape == (tokens, ids.shape[1] + slots)
        np.testing.assert_array_equal(out_ids, ref_ids)
        # Weights are copied, never computed: bit-exact.
        np.testing.assert_array_equal(out_weights, ref_weights)


def test_spec_worked_example():
    layout = ExpertLayout(8, 1, ep_size=2, dispatch="all2all")
    ids = np.array([[4, 7], [0, 3]], np.int32)
    weights = np.array([[0.5, 0.25], [0.125, 0.0625]], np.float32)
    out_weights, out_ids = append_shared_slots(weights, ids, layout, home_rank=1)
    assert out_ids.tolist() == [[5, 8, 9], [0, 3, 9]]
    assert out_weights.tolist() == [[0.5, 0.25, 1.0], [0.125, 0.0625, 1.0]]
    from_rank_0 = append_shared_slots(weights, ids, layout, home_rank=0)[1]
    assert from_rank_0[:, 2].tolist() == [4, 4]


@pytest.mark.parametrize("home_rank", range(8))
def test_512_routed_plus_shared_on_8_all2all_ranks(home_rank):
    layout = ExpertLayout(512, 1, ep_size=8, dispatch="all2all")
    rng = np.random.default_rng(home_rank)
    ids, weights = routing(rng, 64, layout)
    gate = rng.random(64).astype(np.float32)
    out_weights, out_ids = append_shared_slots(weights, ids, layout, home_rank, gate)
    owner = ids // 64
    routed = out_ids[:, :8]
    assert np.all((routed >= owner * 65) & (routed < owner * 65 + 64))
    np.testing.assert_array_equal(routed, ids + owner)
    # b_h + L_h with b_h = 65 h and L_h = 64.
    np.testing.assert_array_equal(out_ids[:, 8], np.full(64, 65 * home_rank + 64))
    np.testing.assert_array_equal(out_weights[:, 8], gate)
    # Each shared id is local slot 64 on the home rank and held by no other rank.
    for rank in range(8):
        local = layout.expert_map(rank)[out_ids[:, 8]]
        assert np.all(local == (64 if rank == home_rank else -1))


def test_per_rank_slots_with_two_shared_experts_and_per_slot_gates():
    layout = ExpertLayout(16, 2, ep_size=2, dispatch="all2all")
    rng = np.random.default_rng(1)
    ids, weights = routing(rng, 10, layout, top_k=4)
    gate = rng.random((10, 2)).astype(np.float32)
    out_weights, out_ids = append_shared_slots(weights, ids, layout, 1, gate)
    # Rank 1 block: routed 8..15 -> 10..17, shared 18, 19.
    assert np.all(out_ids[:, 4:] == [18, 19])
    np.testing.assert_array_equal(out_weights[:, 4:], gate)
    np.testing.assert_array_equal(out_ids[:, :4], ids + 2 * (ids >= 8))


def test_output_regime_needs_explicit_shared_weights():
    layout = ExpertLayout(16, 1, scaling_regime="output")
    rng = np.random.default_rng(2)
    ids, weights = routing(rng, 5, layout)
    advice = r"layout\.shared_slot_weight\(gate, routed_scaling_factor\)"
    with pytest.raises(ValueError, match=advice):
        append_shared_slots(weights, ids, layout)
    gate = rng.random(5).astype(np.float32)
    slot_weight = layout.shared_slot_weight(gate, 2.5)
    out_weights, _ = append_shared_slots(weights, ids, layout, 0, slot_weight)
    np.testing.assert_allclose(out_weights[:, -1], gate / 2.5, rtol=1e-6)


def test_output_regime_without_fusion_needs_nothing():
    layout = ExpertLayout(16, 1, shared="runner", scaling_regime="output")
    ids = np.zeros((3, 2), np.int32)
    out_weights, out_ids = append_shared_slots(np.ones((3, 2), np.float32), ids, layout)
    assert out_ids.shape == (3, 2) and out_weights.shape == (3, 2)


def test_out_of_range_logical_ids_become_minus_one():
    layout = ExpertLayout(8, 1, ep_size=2, dispatch="all2all")
    ids = np.array([[-1, 8], [3, 100]], np.int64)
    _, out_ids = append_shared_slots(np.ones((2, 2), np.float32), ids, layout, 0)
    assert out_ids.tolist() == [[-1, -1, 4], [3, -1, 4]]


def test_host_weights_are_converted_to_float32():
    layout = ExpertLayout(8, 1)
    ids = np.array([[1, 2]], np.int32)
    out = append_shared_slots(np.array([[0.5, 0.25]], np.float16), ids, layout, 0, np.array([0.5], np.float64))
    assert out[0].dtype == np.float32 and out[0].tolist() == [[0.5, 0.25, 0.5]]


LAYOUT = ExpertLayout(8, 2, ep_size=2, dispatch="all2all")


@pytest.mark.parametrize(
    "change,error,words",
    [
        (dict(home_rank=2), ValueError, r"home_rank=2 is outside \[0, 2\)"),
        (dict(home_rank=-1), ValueError, "home_rank=-1"),
        (dict(home_rank=1.0), TypeError, "home_rank=1.0"),
        (dict(home_rank=True), TypeError, "home_rank=True"),
        (dict(layout="layout"), TypeError, "ExpertLayout"),
        (dict(weights=np.ones((3, 3), np.float32)), ValueError, r"topk_weights has shape \(3, 3\)"),
        (dict(weights=np.ones((3, 2), np.int32)), TypeError, "topk_weights must be a floating array"),
        (dict(ids=np.ones((3, 2))), TypeError, "topk_ids must be an integer array"),
        (dict(ids=np.ones(6, np.int32), weights=np.ones(6, np.float32)), ValueError, "2-D"),
        (dict(shared=np.ones((3, 3), np.float32)), ValueError, r"shared_weights has shape \(3, 3\)"),
        (dict(shared=np.ones(4, np.float32)), ValueError, r"shared_weights has shape \(4,\)"),
        (dict(shared=np.array(["a"] * 3)), TypeError, "real numbers"),
    ],
)
def test_invalid_arguments(change, error, words):
    args = dict(
        ids=np.zeros((3, 2), np.int32), weights=np.ones((3, 2), np.float32), layout=LAYOUT, home_rank=0, shared=None
    )
    args.update(change)
    with pytest.raises(error, match=words):
        append_shared_slots(args["weights"], args["ids"], args["layout"], args["home_rank"], args["shared"])


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_ids_before_weights_the_order_before_0_2_is_refused(framework):
    # The old call append_shared_slots(ids, weights, ...) must not compute with ids read as
    # weights: both the kernel entry and the reference refuse it by dtype, naming the order.
    layout = ExpertLayout(8, 1, ep_size=2, dispatch="all2all")
    ids = np.array([[4, 7], [0, 3]], np.int32)
    weights = np.array([[0.5, 0.25], [0.125, 0.0625]], np.float32)
    if framework == "torch":
        torch = pytest.importorskip("torch")
        ids, weights = torch.from_numpy(ids), torch.from_numpy(weights)
    message = r"topk_weights must be a floating array, got dtype int32 \(weights come before ids since 0.2"
    with pytest.raises(TypeError, match=message):
        append_shared_slots(ids, weights, layout, 1)
    if framework == "numpy":
        with pytest.raises(TypeError, match=message):
            reference.append_shared_slots(ids, weights, layout, 1)
    # Float ids with float weights (no integer in the pair): the ids are named.
    with pytest.raises(TypeError, match=r"topk_ids must be an integer array, got dtype float32"):
        append_shared_slots(weights, weights, layout, 1)
