"""Run a worker function on a spawned gloo process group and collect each rank's result.

Process start-up (the torch import) dominates on a small machine, so a test spawns one group
that loops over many cases and returns plain records, then asserts on them.
"""

from __future__ import annotations

import datetime
import os
import pickle
import time
import traceback
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: Timeout of a group's collectives: generous for a loaded 2-core machine, yet a hang still
#: fails the test instead of stalling it.
PROCESS_GROUP_TIMEOUT_S = 60
#: Longest wait between two looks at the deadline; an exiting rank wakes the parent at once.
POLL_S = 1.0


def _entry(rank, world_size, init_file, worker, payload, result_dir, timeout_s):
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    result = {"ok": True}
    try:
        result["value"] = worker(rank, world_size, payload)
    except BaseException:
        result = {"ok": False, "traceback": traceback.format_exc()}
    with open(os.path.join(result_dir, f"rank{rank}.pkl"), "wb") as handle:
        pickle.dump(result, handle)
    # Skip the process-group teardown: after a dead-peer run it could block on the peer.
    os._exit(0)


def spawn_group(
    worker, world_size, tmp_dir, payload=None, *, timeout_s=PROCESS_GROUP_TIMEOUT_S, join_timeout_s=300, every_rank=True
):
    """Run ``worker(rank, world_size, payload)`` on ``world_size`` spawned gloo ranks.

    ``worker`` must be a module-level function (the spawned ranks import it by name).
    Returns the per-rank return values. Raises AssertionError carrying the tracebacks when a
    rank raised, when the group does not finish within ``join_timeout_s`` (after killing
    it), and, with ``every_rank``, when a rank exited without a result; without it such a
    rank's value is None (a test that kills a rank on purpose).
    """
    name = getattr(worker, "__name__", str(worker))
    tmp_dir = str(tmp_dir)
    os.makedirs(tmp_dir, exist_ok=True)
    init_file = os.path.join(tmp_dir, f"store_{name}_{world_size}_{time.monotonic_ns()}")
    result_dir = init_file + "_results"
    os.makedirs(result_dir)
    context = mp.start_processes(
        _entry,
        args=(world_size, init_file, worker, payload, result_dir, timeout_s),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + join_timeout_s
    try:
        # Poll the processes themselves: torch's context.join would terminate the survivors
        # as soon as one rank exits with an error (a dead-peer run kills one on purpose).
        while alive := [process for process in context.processes if process.is_alive()]:
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} on {world_size} ranks did not finish in {join_timeout_s} s")
            wait([process.sentinel for process in alive], timeout=POLL_S)
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    results, failures = [], []
    for rank, process in enumerate(context.processes):
        path = os.path.join(result_dir, f"rank{rank}.pkl")
        if not os.path.exists(path):
            if every_rank:
                failures.append((rank, f"exited with code {process.exitcode} and no result\n"))
            results.append(None)
            continue
        with open(path, "rb") as handle:
            result = pickle.load(handle)
        if not result["ok"]:
            failures.append((rank, result["traceback"]))
        results.append(result.get("value"))
    if failures:
        # A peer's failure shows up on the others as a CollectiveError: list the root first.
        failures.sort(key=lambda failure: "CollectiveError" in failure[1])
        raise AssertionError(
            "\n".join(f"{name}: rank {rank} of {world_size} raised:\n{text}" for rank, text in failures)
        )
    return results
