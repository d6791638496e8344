"""bench/gpu_check.py: the plan of the one-call GPU proof, checked without a GPU."""

import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_dry_run_passes_and_lists_every_stage():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    names = [line.split()[0] for line in result.stdout.splitlines()[:6]]
    assert names == ["environment", "warm", "tests", "routing", "gemm", "summary"]
    assert "plan OK" in result.stdout


def test_plan_fits_the_budget_and_names_existing_files(gpu_check):
    assert gpu_check.check_plan() == []
    worst_case = sum(s.timeout_s for s in gpu_check.STAGES) + gpu_check.KILL_GRACE_S * 5
    assert worst_case == gpu_check.planned_seconds() <= gpu_check.BUDGET_S
    assert gpu_check.STAGES[0].timeout_s <= 30
    for name in gpu_check.GPU_TEST_FILES:
        assert (REPO / name).is_file()
    tests = gpu_check.stage_command(gpu_check.STAGES[2], Path("/o"))
    # Explicit files, never the whole tree; JUnit straight into the output folder.
    assert tests[-len(gpu_check.GPU_TEST_FILES) :] == list(gpu_check.GPU_TEST_FILES)
    assert "--junitxml=/o/gpu_pytest.xml" in tests and "gpu" in tests


def test_every_gpu_marked_file_is_in_the_list(gpu_check):
    marked = {
        p.relative_to(REPO).as_posix()
        for p in (REPO / "tests").rglob("test_*.py")
        if "pytest.mark." + "gpu" in p.read_text()
    }  # split: this file marks nothing
    assert marked == set(gpu_check.GPU_TEST_FILES)


def test_plan_check_reports_each_kind_of_problem(gpu_check, tmp_path):
    stages = list(gpu_check.STAGES)
    slow = [dataclasses.replace(stages[0], timeout_s=31)] + [
        dataclasses.replace(s, timeout_s=s.timeout_s + 100) for s in stages[1:]
    ]
    problems = gpu_check.check_plan(stages=slow)
    assert any("within 30 s" in p for p in problems)
    assert any("over the budget of 480 s" in p for p in problems)
    problems = gpu_check.check_plan(test_files=gpu_check.GPU_TEST_FILES[1:] + ("tests/gpu/test_nowhere.py",))
    assert any("test_nowhere.py does not exist" in p for p in problems)
    assert any(gpu_check.GPU_TEST_FILES[0] in p and "missing from GPU_TEST_FILES" in p for p in problems)
    problems = gpu_check.check_plan(output_files=tuple(f"f{i}.json" for i in range(9)) + ("a b.md",))
    assert any("at most 8" in p for p in problems) and any("'a b.md'" in p for p in problems)
    problems = gpu_check.check_plan(stages=stages[1:] + stages[:1])
    assert "the first stage must be 'environment'" in problems


def test_summary_reads_junit_and_benchmark_targets(gpu_check, tmp_path):
    (tmp_path / gpu_check.PYTEST_XML).write_text(
        '<testsuites><testsuite tests="4" failures="1" errors="0" skipped="1">'
        '<testcase classname="a" name="ok"/><testcase classname="a" name="bad"><failure/></testcase>'
        '<testcase classname="a" name="skip"><skipped/></testcase><testcase classname="a" name="ok2"/>'
        "</testsuite></testsuites>"
    )
    (tmp_path / gpu_check.GEMM_JSON).write_text(
        '{"targets": [{"model": "m", "target": "t", "value": 0.61, "met": true}]}'
    )
    text = gpu_check.write_summary(tmp_path, [{"name": "tests", "status": 1, "seconds": 12.0}])
    assert "2 passed, 1 failed, 0 errors, 1 skipped." in text
    assert "- FAILED a::bad" in text
    assert "- m: t: 0.61 (met)" in text
    assert "gpu_routing.json: not written." in text
    assert (tmp_path / gpu_check.SUMMARY).read_text() == text
