"""docs/performance.md is what `python -m bench.report` renders from bench/results/*.json, and
every table names its run (date, CPU model, ISA path) without inventing what a file lacks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import report  # noqa: E402


def test_performance_page_is_up_to_date_with_the_results():
    page = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    assert page == report.render(), "docs/performance.md is stale: run `python -m bench.report`"


def test_every_result_file_has_a_section_with_its_run():
    page = report.render()
    for path in sorted((ROOT / "bench" / "results").glob("*.json")):
        machine = json.loads(path.read_text(encoding="utf-8")).get("machine", {})
        line = f"`bench/results/{path.name}`. " + report.run_line(machine)
        assert line in page, path.name
        assert "run:" not in line and str(machine.get("date", "-"))[:10] not in page  # the date stays in the JSON


def test_run_line_says_not_recorded_instead_of_guessing():
    line = report.run_line({"date": "2030-01-02T03:04:05+00:00", "cpu_count": 4, "numpy": "2.0"})
    assert line == "*CPU: not recorded; ISA path: not recorded; 4 logical CPUs; numpy 2.0.*"
    line = report.run_line({"cpu_model": "Some CPU 9000", "isa": "avx512_bf16", "torch_threads": 1})
    assert line == ("*CPU: Some CPU 9000; ISA path: avx512_bf16; ? logical CPUs; threads: torch 1.*")


def test_a_new_file_is_listed_and_a_known_one_is_tabulated(tmp_path):
    machine = {"date": "2030-01-02T00:00:00+00:00", "cpu_model": "X", "isa": "generic", "cpu_count": 1}
    (tmp_path / "newbench.json").write_text(json.dumps({"machine": machine, "cases": []}))
    align = {
        "machine": machine,
        "results": [
            {
                "num_tokens": 8,
                "top_k": 2,
                "num_experts": 4,
                "block_size": 16,
                "moeroute_us": 10.0,
                "torch_us": 25.0,
                "speedup": 2.5,
                "speedup_range": [2.0, 3.0],
            }
        ],
    }
    (tmp_path / "align.json").write_text(json.dumps(align))
    page = report.render(tmp_path)
    assert page.index("bench/results/align.json") < page.index("bench/results/newbench.json")
    assert "| 8 | 2 | 4 | 16 | 10.0 us | 25.0 us | 2.50x (2.00-3.00) |" in page
    assert "No table renderer for this file yet" in page
    assert "*CPU: X; ISA path: generic; 1 logical CPUs.*" in page
    assert "2030" not in page  # the run's date stays in the JSON


def test_check_mode_fails_on_a_stale_page(tmp_path, capsys):
    out = tmp_path / "performance.md"
    out.write_text("old\n")
    assert report.main(["--out", str(out), "--check"]) == 1
    assert "stale" in capsys.readouterr().err
    assert report.main(["--out", str(out)]) == 0
    assert report.main(["--out", str(out), "--check"]) == 0
    assert out.read_text() == report.render()


def test_bench_entry_lists_every_script_and_refuses_an_unknown_name(capsys):
    from bench import __main__ as entry

    scripts = {p.stem for p in (ROOT / "bench").glob("*.py") if not p.stem.startswith("_") and p.stem != "report"}
    assert set(entry.benchmarks()) == scripts
    assert set(entry.CPU_SET) <= scripts
    assert entry.main(["--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert sorted(line.split()[0] for line in listed) == sorted(scripts)
    assert entry.main(["no-such-bench"]) == 2
    assert "unknown benchmark 'no-such-bench'" in capsys.readouterr().err
