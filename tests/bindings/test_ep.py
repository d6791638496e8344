"""Expert-parallel dispatchers on gloo: spawned process groups against a dense reference.

Each module-scoped fixture spawns one process group that loops over many configurations
(process start-up dominates); the tests below assert on the records it returns. Every
configuration runs with debug=True, so the once-dispatched / once-combined count is
checked on every forward.
"""

from __future__ import annotations

import pytest

from _ep_workers import (
    SHORT_TIMEOUT_S,
    configs_worker,
    dispatcher_configs,
    peer_failure_worker,
    qwen35_worker,
)
from helpers.gloo import spawn_group

WORLD_SIZES = (2, 4)
#: Survivors of a dead or stalled peer must raise within this many seconds (gloo timeout
#: SHORT_TIMEOUT_S plus start-up noise on a loaded machine).
PEER_FAILURE_DEADLINE_S = 20


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels():
    """Compile the routing kernels once here, so the spawned ranks load them from Numba's
    cache instead of each compiling them at once on the same cores."""
    import torch

    from _ep_workers import _SharedMLP
    from moeroute.bindings.torch.moe import MoE
    from moeroute.config import RouterConfig

    torch.manual_seed(0)
    for shared, gate in (("fused", torch.nn.Linear(16, 1, bias=False)), ("fused", None), ("runner", None)):
        module = MoE(RouterConfig(8, 2), 16, 8, _SharedMLP(16, 8), gate, shared=shared)
        with torch.no_grad():
            for tokens in (0, 3):
                module(torch.randn(tokens, 16))


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    """World size -> per-rank results of the configuration loop (spawned once)."""
    cache = {}

    def get(world_size):
        if world_size not in cache:
            payload = {
                "invalid": world_size == 2,
                "faults": True,
                "moe": True,
                "from_hf": world_size == 2,
                "placement": world_size == 2,
                "agreement": True,
                "checkpoint": world_size == 2,
            }
            try:
                cache[world_size] = spawn_group(
                    configs_worker, world_size, tmp_path_factory.mktemp(f"ep{world_size}"), payload, join_timeout_s=240
                )
            except AssertionError as error:  # fail every dependent test without respawning
                cache[world_size] = error
        if isinstance(cache[world_size], AssertionError):
            raise cache[world_size]
        return cache[world_size]

    return get


def _module_records(results, key):
    """Per-rank records of the module cases; fails with the root error when a rank raised."""
    errors = [r.get(key + "_error") for r in results if r.get(key + "_error")]
    # A peer's failure shows up on the others as a CollectiveError: report the root first.
    errors.sort(key=lambda text: "CollectiveError" in text)
    assert not errors, errors[0]
    return [r[key] for r in results]


def _records(results, name):
    found = [next(r for r in rank_result["records"] if r["name"] == name) for rank_result in results]
    assert len(found) == len(results)
    return found


CONFIG_IDS = [(w, c["name"]) for w in WORLD_SIZES for c in dispatcher_configs(w)]


@pytest.mark.slow
@pytest.mark.parametrize("world_size,name", CONFIG_IDS, ids=[f"E{w}-{n}" for w, n in CONFIG_IDS])
def test_each_rank_matches_dense_reference(groups, world_size, name):
    for rank, record in enumerate(_records(groups(world_size), name)):
        assert record["shape"] == record["expected_shape"], (rank, record)
        assert record["error"] < record["tolerance"], (
            f"rank {rank}: relative error {record['error']:.3g} >= {record['tolerance']}"
        )


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_configuration_ran_on_every_rank(groups, world_size):
    expected = [c["name"] for c in dispatcher_configs(world_size)]
    for rank_result in groups(world_size):
        assert [r["name"] for r in rank_result["records"]] == expected


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_shared_owner_resolves_as_requested(groups, world_size):
    for config in dispatcher_configs(world_size):
        record = _records(groups(world_size), config["name"])[0]
        if config["S"] == 0:
            assert record["shared"] == "none"
        elif config["shared"] != "auto":
            assert record["shared"] == config["shared"]
        else:  # auto with a splittable shared MLP fuses it
            assert record["shared"] == "fused"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_bytes_sent_are_unique_token_rank_pairs(groups, world_size):
    """all2all: (unique (token, other rank) pairs) x (H x element size + 8 bytes per slot);
    combine: rows received from other ranks x H x element size."""
    checked_nonzero = 0
    for config in dispatcher_configs(world_size):
        for rank, record in enumerate(_records(groups(world_size), config["name"])):
            assert record["dispatch_bytes"] == record["expected_dispatch_bytes"], (rank, record)
            assert record["combine_bytes"] == record["expected_combine_bytes"], (rank, record)
            checked_nonzero += record["dispatch_bytes"] > 0
    assert checked_nonzero > 0


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_overlap_dispatch_is_in_flight_until_wait(groups, world_size):
    for config in dispatcher_configs(world_size):
        for record in _records(groups(world_size), config["name"]):
            assert record["in_flight"] == record["overlap"], record


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_redundant_experts_use_replicas(groups, world_size):
    for dispatch in ("all2all", "allgather"):
        records = _records(groups(world_size), f"{dispatch}-redundant-eplb")
        assert sum(r["replica_slots"] for r in records) > 0  # the replica rule was exercised


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_tokens_reach_the_forced_expert(groups, world_size):
    for dispatch in ("all2all", "allgather"):
        for k in (1, 3):
            for record in _records(groups(world_size), f"{dispatch}-all-to-one-expert-K{k}"):
                assert record["forced_expert_slots"] == record["expected_shape"][0]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_debug_check_catches_injected_faults(groups, world_size):
    for rank, rank_result in enumerate(groups(world_size)):
        faults = rank_result["faults"]
        kind, message = faults["all2all-dropped-slot"]
        assert kind == "DispatchCheckError" and "dispatched 0 time(s)" in message, (rank, message)
        kind, message = faults["all2all-wrong-local-id"]
        assert kind == "DispatchCheckError" and "as local id" in message, (rank, message)
        kind, message = faults["all2all-combined-twice"]
        assert kind == "DispatchCheckError" and "combined 2 time(s)" in message, (rank, message)
        kind, message = faults["allgather-unmasked-global-slot"]
        assert kind == "DispatchCheckError", (rank, message)
        assert f"dispatched (summed over ranks) {world_size} time(s)" in message
        assert faults["all2all-dropped-slot-nodebug"] == (None, None)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dispatch", ["all2all", "allgather"])
def test_checked_dispatcher_catches_faults_in_a_plain_dispatchers_output(groups, world_size, dispatch):
    """Every rank corrupts its received row 0 (rank 0's token row 0), slot ``rank``: only
    rank 0, the token's home, raises, naming the token, slot and receiving rank."""
    import numpy as np

    from moeroute.layout import ExpertLayout

    layout = ExpertLayout(8, 0, ep_size=world_size, dispatch=dispatch)
    maps = [layout.expert_map(d) for d in range(world_size)]
    physical_of = [{int(maps[d][p]): p for p in np.flatnonzero(maps[d] >= 0)} for d in range(world_size)]
    counted = "dispatched" if dispatch == "all2all" else "dispatched (summed over ranks)"
    expected = {
        # each rank drops the one slot it holds: every slot of token row 0 arrives nowhere
        "dropped": (
            f"rank 0: token row 0, slot 0 was {counted} 0 time(s); expected 1 "
            f"({world_size} (token, slot) entries wrong)"
        ),
        # each rank relabels slot d as its local expert 1; rank 0's own row is found first
        "wrong-id": (
            f"rank 0: token row 0, slot 0 (physical id {physical_of[0][0]}) was sent "
            f"to rank 0 as local id 1, which is physical id {physical_of[0][1]} there"
        ),
        "out-of-range": (
            f"rank 0: token row 0, slot 0 was sent to rank 0 as local id 8; rank 0 "
            f"holds local ids [0, {layout.num_local_experts(0)})"
        ),
    }
    for rank, rank_result in enumerate(groups(world_size)):
        faults = rank_result["faults"]
        for fault, message in expected.items():
            got = faults[f"output-{dispatch}-{fault}"]
            assert got == (("DispatchCheckError", message) if rank == 0 else (None, None)), (rank, fault, got)
            assert faults[f"output-{dispatch}-{fault}-nodebug"] == (None, None)


MOE_CASES = [
    f"moe-{dispatch}-{shared}-{variant}"
    for dispatch in ("all2all", "allgather")
    for shared in ("runner", "overlap", "fused")
    for variant in ("S1-router", "S2-output")
]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_moe_module_with_ep_group_matches_single_process(groups, world_size):
    """MoE(ep_group=pg) on each rank's tokens equals the one-rank MoE on all tokens."""
    for rank, records in enumerate(_module_records(groups(world_size), "moe")):
        assert [r["name"] for r in records] == MOE_CASES
        for record in records:
            assert record["shape"] == record["expected_shape"], (rank, record)
            assert record["error"] < 1e-5, (rank, record)
            assert record["shared"] == record["name"].split("-")[2], record
            # The module holds only this rank's experts (plus its fused shared slots).
            assert record["local_experts"] == record["expected_local_experts"], record


def test_from_hf_with_ep_group_matches_block_and_single_process(groups):
    expected_names = [f"from_hf-{d}-{s}" for d in ("all2all", "allgather") for s in ("auto", "overlap")]
    for rank, records in enumerate(_module_records(groups(2), "from_hf")):
        assert [r["name"] for r in records] == expected_names
        for record in records:
            assert record["shape"] == record["expected_shape"] and record["shape"][0] > 0
            assert record["error"] < 1e-5, (rank, record)
            assert record["error_vs_block"] < 1e-5, (rank, record)
            # Qwen3.5's gated shared expert is fused under auto (per-rank slots).
            assert record["shared"] == ("fused" if record["name"].endswith("auto") else "overlap")


def test_from_hf_under_ep_refuses_a_partial_transformers_checkpoint(groups):
    """Qwen3.5-MoE block on two ranks (fused per-rank shared slots): each rank refuses to
    save the block's checkpoint, loads its own experts from the full one, and saves them
    under moeroute's names (checkpoint_format = None)."""
    results = groups(2)
    errors = [r["checkpoint_error"] for r in results if r.get("checkpoint_error")]
    assert not errors, errors[0]
    for rank, result in enumerate(results):
        record = result["checkpoint"]
        assert record["refusal"] is not None and f"rank {rank}'s experts" in record["refusal"]
        assert "expert-parallel layer (2 ranks)" in record["refusal"]
        assert "checkpoint_format = None" in record["refusal"]
        assert record["missing"] == [] and record["unexpected"] == []
        assert record["ids"] == list(range(4 * rank, 4 * rank + 4)) and record["shared"] == "fused"
        assert "experts.w_gate_up" in record["keys"] and "router_weight" in record["keys"]
        assert record["routed_equal"] and record["slot_equal"] and record["router_equal"]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_round_robin_and_table_placements_hold_the_right_experts(groups, world_size):
    for dispatch in ("all2all", "allgather"):
        record = _records(groups(world_size), f"{dispatch}-round-robin")[0]
        # Rank r holds logical r, r+E, r+2E, ... (no redundant experts here).
        assert record["logical_experts"] == [list(range(r, 9, world_size)) for r in range(world_size)]
        table = [5, 4, 3, 2, 1, 0] + [0] * (world_size - 1)
        record = _records(groups(world_size), f"{dispatch}-physical-to-logical-table")[0]
        assert sum(record["logical_experts"], []) == table
        redundant = _records(groups(world_size), f"{dispatch}-round-robin-redundant")
        assert sum(r["replica_slots"] for r in redundant) > 0


def test_placements_with_gpt_oss_experts_match_single_process(groups):
    expected_names = [f"placement-{d}-{p}" for d in ("all2all", "allgather") for p in ("round_robin", "table")]
    table = list(range(8))[::-1] + [3, 3]
    for rank, records in enumerate(_module_records(groups(2), "placement")):
        assert [r["name"] for r in records] == expected_names
        for record in records:
            assert record["shape"] == record["expected_shape"] and record["shape"][0] > 0
            assert record["error"] < 1e-5, (rank, record)
            if record["name"].endswith("round_robin"):
                assert record["logical_experts"] == list(range(rank, 8, 2))
            else:
                assert record["logical_experts"] == table[5 * rank : 5 * rank + 5]


INVALID_CASES = {
    # name: (exception type, substrings of the message)
    "layout-type": ("TypeError", ["layout", "ExpertLayout", "str"]),
    "dispatch-unknown": ("ValueError", ["dispatch='ring'", "all2all"]),
    "dispatch-mismatch": ("ValueError", ["dispatch='allgather'", "layout.dispatch='all2all'"]),
    "allgather-class-mismatch": ("ValueError", ["layout.dispatch='all2all'", "'allgather'"]),
    "group-size": ("ValueError", ["2 ranks", "layout.ep_size=3"]),
    "debug-type": ("TypeError", ["debug='yes'"]),
    "ids-dtype": ("ValueError", ["topk_ids", "int32", "int64"]),
    "weights-shape": ("ValueError", ["topk_weights", "(3, 1)"]),
    "hidden-not-tensor": ("TypeError", ["hidden_states", "ndarray"]),
    "hidden-rank": ("ValueError", ["hidden_states", "2-D"]),
    "async-type": ("TypeError", ["async_op=1"]),
    # ids before weights (the order before 0.2): refused by dtype before anything travels
    "old-order": ("TypeError", ["topk_weights must be a floating array", "int32", "weights come before ids"]),
    "old-order-debug": ("TypeError", ["topk_weights must be a floating array", "int32", "weights come before ids"]),
    "combine-foreign-handle": ("ValueError", ["handle", "this dispatcher"]),
    "combine-rows": ("ValueError", ["partial_out", "Tr="]),
    "combine-handle-type": ("TypeError", ["handle", "NoneType"]),
    "combine-twice": ("RuntimeError", ["already combined"]),
}


@pytest.mark.parametrize("case", sorted(INVALID_CASES))
def test_invalid_arguments_raise_at_the_boundary(groups, case):
    kind, fragments = INVALID_CASES[case]
    for rank_result in groups(2):
        got_kind, message = rank_result["invalid"][case]
        assert got_kind == kind, (case, got_kind, message)
        for fragment in fragments:
            assert fragment in message, (case, fragment, message)


def test_make_dispatcher_needs_a_process_group():
    from moeroute.bindings.ep import make_dispatcher
    from moeroute.bindings.torch.dispatch import LocalDispatcher
    from moeroute.layout import ExpertLayout

    with pytest.raises(ValueError, match="init_process_group"):
        make_dispatcher(ExpertLayout(8, 1, ep_size=2, dispatch="all2all"), None, "all2all")
    local = make_dispatcher(ExpertLayout(8, 1), None, "none")
    assert isinstance(local, LocalDispatcher)


def test_transfer_stats_add_and_report():
    from moeroute.bindings.ep import TransferStats

    a = TransferStats(rows_sent=2, hidden_bytes=64, metadata_bytes=32, count_bytes=8, combine_bytes=64)
    b = TransferStats(rows_sent=1, hidden_bytes=32, metadata_bytes=16, count_bytes=8, combine_bytes=32)
    total = a + b
    assert (total.rows_sent, total.dispatch_bytes, total.total_bytes) == (3, 144, 256)
    assert total.as_dict()["total_bytes"] == 256


@pytest.mark.parametrize("dispatch,failure", [("all2all", "exit"), ("allgather", "stall"), ("all2all", "build")])
def test_dead_or_stalled_peer_raises_within_timeout(tmp_path, dispatch, failure):
    payload = {"dispatch": dispatch, "failure": failure, "stall_s": SHORT_TIMEOUT_S + 2}
    results = spawn_group(
        peer_failure_worker, 3, tmp_path, payload, timeout_s=SHORT_TIMEOUT_S, join_timeout_s=90, every_rank=False
    )
    # The exiting rank leaves no result; the stalled one wakes after the others gave up.
    assert results[1] == ("stalled" if failure == "stall" else None)
    for rank in (0, 2):
        outcome = results[rank]
        assert outcome is not None and outcome["raised"] == "CollectiveError", (rank, outcome)
        assert f"rank {rank} of 3" in outcome["message"], outcome
        assert outcome["elapsed"] < PEER_FAILURE_DEADLINE_S, (rank, outcome)
        if failure == "stall":  # nothing closed a connection: the group's timeout fired
            assert outcome["elapsed"] > 0.8 * SHORT_TIMEOUT_S, (rank, outcome)


def test_qwen35_fused_per_rank_slots_on_eight_ranks(tmp_path):
    results = spawn_group(qwen35_worker, 8, tmp_path, join_timeout_s=180)
    for rank, records in enumerate(results):
        for record in records:
            assert record["shared"] == "fused" and record["slots"] == "per_rank"
            assert record["num_physical"] == 512 + 8
            # docs/semantics.md section 2: rank r's block starts at b_r = 64 r + r; its slot follows 64 routed.
            assert record["shared_ids"] == [65 * rank + 64] == record["expected_shared_ids"]
            assert record["error"] < 1e-5, (rank, record)


# --------------------------------------------------------------------------- moeroute run


def test_run_command_spawns_ranks_and_checks_them(capsys):
    from moeroute.bindings import ep_run

    status = ep_run.main(
        [
            "--preset",
            "qwen1.5-moe-a2.7b",
            "--ep",
            "2",
            "--dispatch",
            "all2all",
            "--shared",
            "auto",
            "--tokens",
            "6",
            "--hidden",
            "16",
            "--intermediate",
            "8",
            "--repeat",
            "1",
            "--debug",
        ]
    )
    out = capsys.readouterr().out
    assert status == 0, out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert [row[0] for row in rows] == ["0", "1"] and all(row[-1] == "ok" for row in rows), out
    assert all(int(row[1]) == 6 for row in rows)  # tokens per rank
    assert "shared expert: fused" in out and "every rank matches" in out


def test_run_command_gpt_oss_round_robin(capsys):
    from moeroute.bindings import ep_run

    status = ep_run.main(
        [
            "--preset",
            "gpt-oss-20b",
            "--ep",
            "2",
            "--placement",
            "round_robin",
            "--redundant",
            "2",
            "--tokens",
            "5",
            "--hidden",
            "16",
            "--intermediate",
            "8",
            "--repeat",
            "1",
            "--debug",
        ]
    )
    out = capsys.readouterr().out
    assert status == 0, out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert [row[0] for row in rows] == ["0", "1"] and all(row[-1] == "ok" for row in rows), out
    assert "every rank matches" in out


def test_run_command_refuses_an_impossible_layout_before_spawning(capsys):
    from moeroute.bindings import ep_run

    status = ep_run.main(["--preset", "mixtral-8x7b", "--ep", "16", "--tokens", "4"])
    assert status == ep_run.EXIT_USAGE
    assert "ep_size=16" in capsys.readouterr().err


def test_run_command_reports_a_mismatch():
    import argparse

    from moeroute.bindings import ep_run

    args = argparse.Namespace(
        preset="mixtral-8x7b", ep=2, dispatch="all2all", tokens=4, hidden=16, intermediate=8, dtype="float32"
    )
    report = dict(
        rank=0,
        tokens=4,
        received_rows=4,
        slots_computed=8,
        max_expert_load=3,
        local_experts=4,
        bytes=None,
        forward_ms=1.0,
        error=0.0,
        shared="none",
        shared_reason="no shared expert",
    )
    text, status = ep_run._format(args, [report, dict(report, rank=1, error=1e-3)])
    assert status == ep_run.EXIT_MISMATCH and "MISMATCH" in text
    assert ep_run._format(args, [report])[1] == 0


def test_run_json_matches_the_text_and_the_layout(capsys, monkeypatch):
    import json

    from moeroute.bindings import ep_run
    from moeroute.cli import main

    spawned = []
    spawn = ep_run.spawn_reports

    def kept(args, steps=ep_run.RUN_STEPS):  # one spawn of the two ranks; reports kept for the text path
        spawned.append((args, spawn(args, steps)))
        return spawned[-1][1]

    monkeypatch.setattr(ep_run, "spawn_reports", kept)
    from moeroute.config import get_preset

    argv = [
        "run",
        "--preset",
        "mixtral-8x7b",
        "--ep",
        "2",
        "--dispatch",
        "all2all",
        "--tokens",
        "6",
        "--hidden",
        "16",
        "--intermediate",
        "8",
        "--repeat",
        "1",
    ]
    status = main(argv + ["--json"])
    out = capsys.readouterr().out
    assert status == 0 and len(out.splitlines()) == 1, out
    result = json.loads(out)
    assert (
        result["preset"],
        result["ep_size"],
        result["dispatch"],
        result["tokens"],
        result["hidden"],
        result["intermediate"],
        result["dtype"],
        result["quant"],
        result["dispatch_dtype"],
    ) == ("mixtral-8x7b", 2, "all2all", 6, 16, 8, "float32", None, "auto")
    assert result["shared"] == "none" and result["reference"] is None and result["matches"] is True
    ranks = result["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["ok"] for r in ranks)
    # No shared expert: every (token, slot) of both ranks is computed once, on its expert's rank.
    top_k = get_preset("mixtral-8x7b").router.top_k
    assert sum(r["slots_computed"] for r in ranks) == 2 * 6 * top_k
    assert [r["local_experts"] for r in ranks] == [4, 4]  # 8 experts in equal blocks
    assert result["total_bytes"] == sum(r["bytes"]["total_bytes"] for r in ranks) > 0
    assert all(r["relative_error"] < result["tolerance"] for r in ranks)
    # The text path reports the same figures: the table `moeroute run` prints from the same reports.
    text, status = ep_run.RUN_STEPS.format(*spawned[0])
    assert status == 0
    rows = [line.split() for line in text.splitlines() if line.split()[:1] in (["0"], ["1"])]
    for row, r in zip(rows, ranks):
        b = r["bytes"]
        assert [int(v) for v in row[:9]] == [
            r["rank"],
            r["tokens"],
            r["received_rows"],
            r["slots_computed"],
            r["local_experts"],
            r["max_expert_load"],
            b["hidden_bytes"],
            b["metadata_bytes"],
            b["combine_bytes"],
        ]
    assert f"combine): {result['total_bytes']}" in text


def test_run_json_reports_a_mismatch_and_the_w8a8_check():
    import argparse

    from moeroute.bindings import ep_run

    args = argparse.Namespace(
        preset="deepseek-v3",
        ep=2,
        dispatch="all2all",
        tokens=4,
        hidden=16,
        intermediate=8,
        dtype="float32",
        quant="fp8_block",
        dispatch_dtype="fp8",
    )
    report = dict(
        rank=0,
        tokens=4,
        received_rows=4,
        slots_computed=8,
        max_expert_load=3,
        local_experts=4,
        bytes={"scale_bytes": 32, "total_bytes": 100},
        forward_ms=1.0,
        error=0.0,
        reference_error=1e-3,
        shared="fused",
        shared_reason="fusable",
    )
    reports = [report, dict(report, rank=1, error=1e-3, reference_error=0.5)]
    result = ep_run._json(args, reports)
    assert [r["ok"] for r in result["ranks"]] == [True, False] and result["matches"] is False
    assert result["reference"] == {
        "max_relative_error": 0.5,
        "tolerance": ep_run.QUANT_TOLERANCE["float32"],
        "passed": False,
        "scale_bytes": 64,
    }
    assert result["total_bytes"] == 200
    assert ep_run._format(args, reports)[1] == ep_run.EXIT_MISMATCH


def test_run_json_is_refused_with_eplb(capsys):
    from moeroute.cli import main

    status = main(["run", "--preset", "qwen3-30b-a3b", "--ep", "2", "--tokens", "4", "--eplb", "--json"])
    out, err = capsys.readouterr()
    assert status == 2 and out == "" and "--json" in err and len(err.strip().splitlines()) == 1


def test_run_command_joins_a_torchrun_group(tmp_path):
    """Two processes with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    processes = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            CUDA_VISIBLE_DEVICES="",
        )
        processes.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "moeroute.bindings.ep_run",
                    "--preset",
                    "glm-4.5",
                    "--dispatch",
                    "allgather",
                    "--tokens",
                    "5",
                    "--hidden",
                    "16",
                    "--intermediate",
                    "8",
                    "--repeat",
                    "1",
                    "--timeout",
                    "60",
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outputs = [process.communicate(timeout=120) for process in processes]
    assert [p.returncode for p in processes] == [0, 0], outputs
    assert "every rank matches" in outputs[0][0]
    assert outputs[1][0] == ""  # only rank 0 prints the table


# --------------------------------------------------------------------------- rank agreement

from _ep_workers import _moe_mismatch_cases  # noqa: E402

MOE_MISMATCH_NAMES = [case[0] for case in _moe_mismatch_cases(2)]
DISPATCH_MISMATCH_FIELDS = [
    "hidden_states.shape[1]",
    "hidden_states.dtype",
    "topk_ids.shape[1]",
    "debug",
    "layout.num_routed_experts",
]


def _assert_same_error_on_every_rank(outcomes, fields, world_size):
    """outcomes[rank] = (kind, message, reported fields); fields = {name: (base, last rank's)}."""
    messages = set()
    for rank, (kind, message, reported) in enumerate(outcomes):
        assert kind == "RankMismatchError", (rank, kind, message)
        for field, (base, odd) in fields.items():
            assert reported[field] == [base] * (world_size - 1) + [odd], (rank, field, reported)
            assert field in message and f"rank {world_size - 1}={odd!r}" in message, message
            assert f"rank 0={base!r}" in message, message
        messages.add(message)
    assert len(messages) == 1, messages  # the same error on every rank


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", MOE_MISMATCH_NAMES)
def test_moe_ranks_that_disagree_raise_the_same_error_at_construction(groups, world_size, name):
    per_rank = _module_records(groups(world_size), "agreement")
    fields = per_rank[0][f"moe:{name}"][0]
    _assert_same_error_on_every_rank([records[f"moe:{name}"][1] for records in per_rank], fields, world_size)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dispatch", ["all2all", "allgather"])
@pytest.mark.parametrize("field", DISPATCH_MISMATCH_FIELDS)
def test_dispatch_sizes_that_disagree_raise_instead_of_aborting(groups, world_size, dispatch, field):
    per_rank = _module_records(groups(world_size), "agreement")
    name, values, _ = per_rank[0][f"{dispatch}:{field}"]
    assert name == field
    _assert_same_error_on_every_rank(
        [records[f"{dispatch}:{field}"][2] for records in per_rank], {field: values}, world_size
    )
    # The group survives: a matching dispatch afterwards is exact.
    for records in per_rank:
        assert records[f"{dispatch}:after"] < 1e-6


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_layer_converted_on_one_rank_raises_in_forward(groups, world_size):
    per_rank = _module_records(groups(world_size), "agreement")
    field, values, _ = per_rank[0]["forward:dtype"]
    _assert_same_error_on_every_rank([records["forward:dtype"][2] for records in per_rank], {field: values}, world_size)


@pytest.mark.parametrize("ep_group", ["world", 0, object()])
def test_ep_group_must_be_a_process_group(ep_group):
    from moeroute.bindings.torch.moe import MoE
    from moeroute.config import RouterConfig

    with pytest.raises(TypeError, match=r"ep_group=.*ProcessGroup"):
        MoE(RouterConfig(8, 2), 16, 8, ep_group=ep_group)
