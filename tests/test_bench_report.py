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


def test_quant_int4_is_tabulated_for_one_shape_or_several(tmp_path):
    machine = {"date": "2030-01-02T00:00:00+00:00", "cpu_model": "X", "isa": "avx512bf16", "cpu_count": 2}
    entry = {"tokens": 8, "bfloat16_ms": 3.0, "int4_ms": 1.0, "bfloat16_over_int4": 3.0, "range": [2.5, 3.5]}
    shape = {"hidden": 2048, "inter": 768, "experts": 128, "top_k": 8}
    one = {"machine": machine, "int4": "QuantConfig('int4', group_size=128)", "activation_dtype": "bfloat16"}
    one.update(torch_threads=2, shape=shape, results=[entry])
    (tmp_path / "quant_int4.json").write_text(json.dumps(one))
    page = report.render(tmp_path)
    assert "### INT4 experts on the CPU" in page and "No table renderer" not in page
    label = "qwen3_30b_a3b (H = 2048, I = 768, N = 128, K = 8)"
    assert f"| {label} | 8 | 3.00 ms | 1.00 ms | 3.00x (2.50-3.50) |" in page
    assert "GB/s" not in page.split("### INT4 experts on the CPU")[1]
    kimi = {"hidden": 7168, "inter": 2048, "experts": 16, "top_k": 8}
    wide = dict(entry, int4_weight_gbs=12.5, int4_weight_share_of_copy_bandwidth=0.6)
    several = dict(one, shapes={"qwen3_30b_a3b": shape, "kimi_k2_experts": kimi}, host_copy_gbs=20.0)
    several["results"] = {"qwen3_30b_a3b": [entry], "kimi_k2_experts": [wide]}
    del several["shape"]
    (tmp_path / "quant_int4.json").write_text(json.dumps(several))
    page = report.render(tmp_path)
    assert "Host copy bandwidth 20.0 GB/s" in page
    assert f"| {label} | 8 | 3.00 ms | 1.00 ms | 3.00x (2.50-3.50) | - |" in page
    kimi_label = "kimi_k2_experts (H = 7168, I = 2048, N = 16, K = 8)"
    assert f"| {kimi_label} | 8 | 3.00 ms | 1.00 ms | 3.00x (2.50-3.50) | 12.5 (60%) |" in page


def test_kt_kernel_shapes_from_an_earlier_run_keep_their_own_load_average(tmp_path):
    machine = {"date": "2030-01-02T00:00:00+00:00", "cpu_model": "X", "isa": "avx512bf16", "cpu_count": 2}
    case = {"method": "FP8", "moeroute_us": 1000.0, "kt_us": 2000.0, "speedup": 2.0, "error": 0.05}
    entry = {"tokens": 1, "moeroute_error": 0.05, "kt": {"fp8_block": case}}
    shape = {"hidden": 64, "inter": 32, "experts": 4, "top_k": 2}
    data = {"machine": machine, "kt_kernel": {"version": "0.7.2"}, "threads": 2, "activation": "silu"}
    data.update(activation_dtype="bfloat16", shapes={"a": shape, "b": shape, "c": shape})
    data["results"] = {name: {"fp8_block": [entry]} for name in ("a", "b", "c")}
    # "a" measured now; "b" earlier with its own load average kept; "c" earlier, none kept
    data["loadavg_per_shape"] = {"a": [[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]], "b": [[1.0, 1.1, 1.2], [1.3, 1.4, 1.5]]}
    data["earlier_runs"] = {"b": "2030-01-01T00:00:00+00:00", "c": "2030-01-01T00:00:00+00:00"}
    data["earlier_loadavg"] = [[5.0, 5.0, 5.0], [6.0, 6.0, 6.0]]
    (tmp_path / "ktkernel.json").write_text(json.dumps(data))
    page = report.render(tmp_path)
    heading = "(H = 64, I = 32, N = 4, K = 2)"
    assert f"**a** {heading} (load average 0.1/0.2/0.3 before, 0.4/0.5/0.6 after):" in page
    assert f"**b** {heading}, from an earlier run (load average 1.0/1.1/1.2 before it, 1.3/1.4/1.5 after):" in page
    assert f"**c** {heading}, from an earlier run (load average 5.0/5.0/5.0 before it, 6.0/6.0/6.0 after):" in page
