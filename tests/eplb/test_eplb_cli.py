"""``moeroute eplb``: the report's figures against the plain reference, files, errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

import _eplb_reference as ref
from moeroute.cli import main
from moeroute.eplb import Placement, rebalance
from moeroute.eplb.cli import synthetic_load


def _run_json(capsys, *argv):
    assert main(["eplb", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_report_matches_the_reference_and_writes_the_plan(tmp_path, capsys):
    load = np.random.default_rng(0).integers(0, 500, size=(3, 16))
    np.save(tmp_path / "load.npy", load)
    out = tmp_path / "plan.json"
    report = _run_json(
        capsys,
        "--load",
        str(tmp_path / "load.npy"),
        "--ep",
        "4",
        "--redundant",
        "4",
        "--nodes",
        "2",
        "--groups",
        "4",
        "--out",
        str(out),
    )
    plan = Placement.from_dict(json.loads(out.read_text()))
    assert plan == rebalance(load, 20, 4, num_nodes=2, num_groups=4)
    linear = [p % 16 for p in range(20)]
    robin = [linear[q] for r in range(4) for q in range(r, 20, 4)]
    for layer, row in enumerate(report["layers"]):
        values = load[layer].tolist()
        assert row["balancedness_linear"] == pytest.approx(
            ref.balancedness(ref.rank_loads(values, linear, 4)), rel=1e-12
        )
        assert row["balancedness_round_robin"] == pytest.approx(
            ref.balancedness(ref.rank_loads(values, robin, 4)), rel=1e-12
        )
        after = ref.rank_loads(values, plan.layer(layer).tolist(), 4)
        assert row["balancedness_after"] == pytest.approx(ref.balancedness(after), rel=1e-12)
        assert row["heaviest_rank_tokens_before"] == pytest.approx(max(ref.rank_loads(values, linear, 4)))
        assert row["heaviest_rank_tokens_after"] == pytest.approx(max(after))
        assert row["experts_moved"] == sum(a != b for a, b in zip(plan.layer(layer).tolist(), linear))
    assert report["policy"] == "hierarchical" and report["moved_from"] == "linear"


def test_previous_file_and_npy_output(tmp_path, capsys):
    first = tmp_path / "first.npy"
    assert (
        main(
            [
                "eplb",
                "--synthetic",
                "zipf:1.2,layers:2,tokens:5000,experts:32,seed:1",
                "--ep",
                "4",
                "--redundant",
                "8",
                "--out",
                str(first),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "layer" in text and "round_robin" in text
    table = np.load(first)
    assert table.dtype == np.int32 and table.shape == (2, 40)
    report = _run_json(
        capsys,
        "--synthetic",
        "zipf:1.2,layers:2,tokens:5000,experts:32,seed:1",
        "--ep",
        "4",
        "--redundant",
        "8",
        "--previous",
        str(first),
    )
    assert report["moved_from"] == "previous"
    assert [row["experts_moved"] for row in report["layers"]] == [0, 0]


def test_synthetic_load_is_a_seeded_zipf_sample():
    load = synthetic_load("zipf:1.1,layers:3,tokens:1000,experts:16,seed:4")
    assert load.shape == (3, 16) and (load.sum(axis=1) == 1000).all()
    assert np.array_equal(load, synthetic_load("zipf:1.1,layers:3,tokens:1000,experts:16,seed:4"))
    rng = np.random.default_rng(4)
    popularity = 1.0 / np.arange(1, 17) ** 1.1
    popularity /= popularity.sum()
    first = rng.multinomial(1000, popularity[rng.permutation(16)])
    assert load[0].tolist() == first.tolist()


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--ep", "8"], ["--load", "--synthetic", "required"]),
        (["--synthetic", "zipf:1", "--ep", "abc"], ["--ep", "invalid int"]),
        (["--synthetic", "zipf:1", "--ep", "7", "--redundant", "32"], ["--ep=7", "{287, 294}"]),
        (["--synthetic", "zipf:1,experts:12", "--ep", "2", "--groups", "5"], ["--groups=5", "divide"]),
        (["--synthetic", "zipf:1", "--ep", "8", "--nodes", "3"], ["--nodes=3", "divide", "--ep=8"]),
        (["--synthetic", "zipf:x", "--ep", "8"], ["zipf", "not a number"]),
        (["--synthetic", "bad:1", "--ep", "8"], ["bad:1", "zipf, layers"]),
        (["--synthetic", "zipf:-1", "--ep", "8"], ["zipf", ">= 0"]),
        (["--load", "missing.npy", "--ep", "8"], ["missing.npy", "does not exist"]),
        (["--load", "load.txt", "--ep", "8"], ["load.txt", ".npy, .pt, .json"]),
        (["--synthetic", "zipf:1", "--ep", "8", "--redundant", "-8"], ["--redundant", ">= 0"]),
        (["--synthetic", "zipf:1", "--ep", "8", "--out", "plan.csv"], ["--out", ".npy, .json"]),
        (["--synthetic", "zipf:1", "--ep", "8", "--bogus", "3"], ["unrecognized", "--bogus 3"]),
        (["--synthetic", "zipf:1", "--ep"], ["--ep", "expected one argument"]),
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv, words, capsys):
    assert main(["eplb", *argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moeroute eplb: error:"), captured.err
    for word in words:
        assert word in lines[0]
    assert captured.out == ""


def test_bad_load_file_contents(tmp_path, capsys):
    (tmp_path / "neg.json").write_text(json.dumps([[1, -2, 3, 4]]))
    assert main(["eplb", "--load", str(tmp_path / "neg.json"), "--ep", "2"]) == 2
    assert "negative" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{not json")
    assert main(["eplb", "--load", str(tmp_path / "bad.json"), "--ep", "2"]) == 2
    assert "cannot be read" in capsys.readouterr().err
    (tmp_path / "prev.json").write_text(json.dumps([0, 1, 2]))
    (tmp_path / "load.json").write_text(json.dumps([1, 2, 3, 4]))
    assert (
        main(["eplb", "--load", str(tmp_path / "load.json"), "--ep", "2", "--previous", str(tmp_path / "prev.json")])
        == 2
    )
    assert capsys.readouterr().err.startswith("moeroute eplb: error: --previous")


def test_torch_load_file(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    load = torch.tensor([5.0, 1.0, 1.0, 1.0])
    torch.save(load, tmp_path / "load.pt")
    report = _run_json(capsys, "--load", str(tmp_path / "load.pt"), "--ep", "2", "--redundant", "2")
    plan = rebalance(load.numpy(), 6, 2)
    after = ref.rank_loads(load.tolist(), plan.layer(0).tolist(), 2)
    assert report["layers"][0]["balancedness_after"] == pytest.approx(ref.balancedness(after))


def test_bench_quick_run_matches_or_beats_the_greedy(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, MOEROUTE_BENCH_RESULTS=str(tmp_path), PYTHONPATH=str(root))
    subprocess.run(
        [sys.executable, str(root / "bench" / "eplb.py"), "--quick"],
        env=env,
        check=True,
        capture_output=True,
        timeout=300,
    )
    results = json.loads((tmp_path / "eplb_quick.json").read_text())
    for setting in results["settings"]:
        assert setting["layers_worse_than_greedy"] == 0
        assert setting["balancedness_moeroute"] >= setting["balancedness_greedy"] * (1 - 1e-9)
        assert setting["moved_with_previous_per_layer"] <= setting["moved_fresh_per_layer"]


# --------------------------------------------------------------------------- hostile input


def _one_line_exit_2(capsys, argv, *words):
    """Exit status 2, one line on stderr naming ``words``, nothing on stdout, no traceback."""
    assert main(["eplb", *argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moeroute eplb: error:"), captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def test_load_files_that_hold_no_load_exit_2_with_one_line(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    torch.save({"load": torch.ones(4)}, tmp_path / "dict.pt")
    (tmp_path / "garbage.pt").write_bytes(b"\x00 not a torch file \xff" * 8)
    (tmp_path / "garbage.npy").write_bytes(b"\x00 not a numpy file \xff" * 8)
    np.save(tmp_path / "empty.npy", np.zeros(0))
    np.save(tmp_path / "no_layers.npy", np.zeros((0, 4)))
    np.save(tmp_path / "overflow.npy", np.full(4, 1e308))
    cases = [
        ("dict.pt", ["holds a dict", "one tensor"]),
        ("garbage.pt", ["cannot be read", "not a torch.save file"]),
        ("garbage.npy", ["cannot be read", "not a .npy file"]),
        ("empty.npy", ["holds no loads", "(1, 0)"]),
        ("no_layers.npy", ["holds no loads", "(0, 4)"]),
        ("overflow.npy", ["layer 0 sums to inf"]),
    ]
    for name, words in cases:
        _one_line_exit_2(capsys, ["--load", str(tmp_path / name), "--ep", "2"], "--load", name, *words)
    # The same reader serves --previous.
    _one_line_exit_2(
        capsys,
        ["--synthetic", "experts:8", "--ep", "2", "--previous", str(tmp_path / "garbage.pt")],
        "--previous",
        "not a torch.save file",
    )


def test_out_into_a_missing_directory_is_refused_before_planning(tmp_path, capsys, monkeypatch):
    import moeroute.eplb.cli as eplb_cli

    def must_not_plan(*args, **kwargs):
        raise AssertionError("planned before checking --out")

    monkeypatch.setattr(eplb_cli, "rebalance", must_not_plan)
    monkeypatch.setattr(eplb_cli, "synthetic_load", must_not_plan)
    missing = tmp_path / "missing" / "plan.npy"
    _one_line_exit_2(
        capsys, ["--synthetic", "experts:8", "--ep", "2", "--out", str(missing)], "--out", "does not exist"
    )
    (tmp_path / "file").write_text("")
    _one_line_exit_2(
        capsys,
        ["--synthetic", "experts:8", "--ep", "2", "--out", str(tmp_path / "file" / "plan.json")],
        "--out",
        "does not exist",
    )
    (tmp_path / "dir.npy").mkdir()
    _one_line_exit_2(
        capsys, ["--synthetic", "experts:8", "--ep", "2", "--out", str(tmp_path / "dir.npy")], "--out", "is a directory"
    )
    assert not missing.parent.exists()


@pytest.mark.parametrize(
    "spec, words",
    [
        ("experts:1e16", ["experts:10000000000000000", "exceeds"]),
        ("experts:10000000000000000", ["exceeds", "MAX_PLAN_ENTRIES"]),
        ("layers:100000000000,experts:8", ["layers:100000000000", "exceeds"]),
        ("tokens:10000000000000000000,experts:8", ["tokens:10000000000000000000", "2**62"]),
        ("layers:1e400", ["layers", "not an integer"]),
        ("experts:2.5", ["experts", "not an integer"]),
    ],
)
def test_synthetic_sizes_beyond_memory_exit_2_with_one_line(spec, words, capsys):
    _one_line_exit_2(capsys, ["--synthetic", spec, "--ep", "2"], "--synthetic", *words)


def test_redundant_beyond_memory_exits_2_and_float_spelled_integers_work(capsys):
    _one_line_exit_2(
        capsys, ["--synthetic", "experts:8", "--ep", "2", "--redundant", "100000000000"], "--redundant", "exceeds"
    )
    assert (
        synthetic_load("experts:1e1,tokens:1e3,layers:1").tolist()
        == synthetic_load("experts:10,tokens:1000,layers:1").tolist()
    )


def test_memory_error_while_planning_exits_2_with_one_line(capsys, monkeypatch):
    import moeroute.eplb.cli as eplb_cli

    def out_of_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(eplb_cli, "rebalance", out_of_memory)
    _one_line_exit_2(capsys, ["--synthetic", "experts:8", "--ep", "2"], "not enough memory")


def test_hostile_input_in_a_subprocess_never_prints_a_traceback(tmp_path):
    import subprocess
    import sys

    (tmp_path / "garbage.pt").write_bytes(b"\x80\x02garbage")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "moeroute",
            "eplb",
            "--load",
            str(tmp_path / "garbage.pt"),
            "--ep",
            "2",
            "--out",
            str(tmp_path / "plan.npy"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
