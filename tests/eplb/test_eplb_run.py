"""``moeroute run --eplb``: spawned ranks rebalance live; the report's figures add up."""

from __future__ import annotations

import re

from moeroute.cli import main
from moeroute.config import get_preset


def test_run_eplb_rebalances_and_keeps_the_outputs(capsys):
    tokens, ep = 48, 2
    status = main(
        [
            "run",
            "--preset",
            "qwen3-30b-a3b",
            "--ep",
            str(ep),
            "--redundant",
            "2",
            "--tokens",
            str(tokens),
            "--hidden",
            "16",
            "--intermediate",
            "8",
            "--repeat",
            "2",
            "--eplb",
            "--skew",
            "1.5",
        ]
    )
    text = capsys.readouterr().out
    assert status == 0, text
    before, after = map(float, re.search(r"before ([\d.]+), after ([\d.]+)", text).groups())
    assert after > before
    rows = [line.split() for line in text.splitlines() if re.match(r"\s+\d+\s", line)]
    assert len(rows) == ep and all(row[-1] == "ok" for row in rows)
    top_k = get_preset("qwen3-30b-a3b").router.top_k
    # Every rank's routed (token, slot) pairs of the --repeat 2 forwards, counted once.
    for column in (1, 2):
        assert sum(int(row[column]) for row in rows) == 2 * ep * tokens * top_k
    assert max(int(row[2]) for row in rows) < max(int(row[1]) for row in rows)


def test_run_eplb_refuses_unequal_blocks_before_spawning(capsys):
    status = main(["run", "--preset", "qwen3-30b-a3b", "--ep", "3", "--tokens", "4", "--eplb"])
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--redundant 1" in err[0]
