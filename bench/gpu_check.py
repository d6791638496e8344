"""Everything a GPU session should run, in one call of about 8 minutes, installing nothing.

    python3 bench/gpu_check.py [--copy-to DIR]

1. the GPU tests of the whole repository (pytest -m gpu), JUnit XML in bench/results/;
2. bench/gpu_routing.py, when it exists, with a short repeat count;
3. bench/gpu_gemm.py with a short repeat count (bench/results/gpu_gemm.json);
4. bench/results/gpu_summary.md: a short table of all of the above.

Each step runs in its own process with a time limit, so one that hangs or crashes still leaves
the others' results. --copy-to (default: $OUT when set) copies the result files there.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
SUMMARY = RESULTS / "gpu_summary.md"
PYTEST_XML = RESULTS / "gpu_pytest.xml"
GEMM_JSON = RESULTS / "gpu_gemm.json"
ROUTING_SCRIPT = REPO / "bench" / "gpu_routing.py"
# Seconds per step: the tests compile every kernel once (NVRTC, a few seconds each), the
# benchmarks reuse CuPy's on-disk kernel cache.
TEST_TIMEOUT = 240
ROUTING_TIMEOUT = 75
GEMM_TIMEOUT = 135
GEMM_REPEATS = 10
ROUTING_REPEATS = 10


def run_step(name, command, timeout):
    """Run ``command`` in the repository root; return a record of what happened."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    started = time.monotonic()
    print(f"== {name}: {' '.join(command)}", flush=True)
    try:
        result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        status, output = result.returncode, result.stdout + result.stderr
    except subprocess.TimeoutExpired as expired:
        status = "timeout"
        output = (expired.stdout or b"").decode(errors="replace") if isinstance(expired.stdout, bytes) \
            else (expired.stdout or "")
    seconds = time.monotonic() - started
    print(output[-6000:], flush=True)
    print(f"== {name}: status {status} after {seconds:.0f} s", flush=True)
    return {"name": name, "status": status, "seconds": seconds, "tail": output[-3000:]}


def routing_command():
    """bench/gpu_routing.py with a short repeat count if it takes one."""
    command = [sys.executable, str(ROUTING_SCRIPT)]
    try:
        help_text = subprocess.run(command + ["--help"], cwd=REPO, capture_output=True, text=True, timeout=60).stdout
    except subprocess.TimeoutExpired:
        help_text = ""
    if "--quick" in help_text:
        command.append("--quick")
    elif "--repeats" in help_text:
        command += ["--repeats", str(ROUTING_REPEATS)]
    return command


def pytest_counts(path):
    if not path.exists():
        return None, []
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    failed = []
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname')}::{case.get('name')}")
    return counts, failed


def gemm_section():
    if not GEMM_JSON.exists():
        return ["bench/gpu_gemm.py wrote no results."]
    data = json.loads(GEMM_JSON.read_text())
    by_case = {}
    for row in data["results"]:
        by_case.setdefault((row["model"], row["tokens_per_expert"]), {})[row["impl"]] = row["tflops"]
    impls = ["moeroute_gemm", "moeroute_gemm_simt", "moeroute_fused_experts", "torch_loop", "torch_grouped_mm",
             "cublas_dense"]
    lines = [f"Device: {data['machine']['device']}, torch {data['machine']['torch']}, cupy {data['machine']['cupy']}; "
             f"bf16 TFLOP/s (median of {data['repeats']} interleaved samples).", "",
             "| model | tokens/expert | path | " + " | ".join(impls) + " | vs loop | of dense |",
             "|---" * (len(impls) + 5) + "|"]
    summaries = {(s["model"], s["tokens_per_expert"]): s for s in data["summary"]}
    for key, tflops in by_case.items():
        s = summaries[key]
        cells = [f"{tflops[i]:.1f}" if i in tflops else "-" for i in impls]
        vs_loop = s["speedup_vs_torch_loop"]
        of_dense = s["fraction_of_dense_cublas"]
        lines.append(f"| {key[0]} | {key[1]} | {s['gemm_path']} | " + " | ".join(cells)
                     + f" | {vs_loop:.2f}x | {of_dense:.0%} |")
    lines += ["", "Targets:"]
    for target in data["targets"]:
        lines.append(f"- {target['model']}: {target['target']}: {target['value']:.2f} "
                     f"({'met' if target['met'] else 'NOT met'})")
    return lines


def routing_section():
    found = sorted(p for p in RESULTS.glob("gpu_routing*.json"))
    if not found:
        return ["No bench/results/gpu_routing*.json."]
    lines = []
    for path in found:
        data = json.loads(path.read_text())
        rows = data.get("results", data) if isinstance(data, dict) else data
        lines.append(f"{path.name}:")
        for row in rows if isinstance(rows, list) else [rows]:
            lines.append(f"- {json.dumps(row, sort_keys=True)[:300]}")
    return lines


def write_summary(device, steps):
    counts, failed = pytest_counts(PYTEST_XML)
    lines = [f"# GPU check, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", "",
             f"Device: {device}", "", "| step | status | seconds |", "|---|---|---|"]
    lines += [f"| {s['name']} | {s['status']} | {s['seconds']:.0f} |" for s in steps]
    lines += ["", "## GPU tests (pytest -m gpu)", ""]
    if counts is None:
        lines.append("No JUnit report (the test step did not finish).")
    else:
        passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        lines.append(f"{passed} passed, {counts['failures']} failed, {counts['errors']} errors, "
                     f"{counts['skipped']} skipped.")
        lines += [f"- FAILED {name}" for name in failed[:40]]
    lines += ["", "## Expert GEMMs (bench/gpu_gemm.py)", ""] + gemm_section()
    lines += ["", "## Routing kernels (bench/gpu_routing.py)", ""] + routing_section()
    SUMMARY.write_text("\n".join(lines) + "\n")
    print(SUMMARY.read_text())


def device_name():
    try:
        result = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30)
        return result.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (no nvidia-smi)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copy-to", type=Path, default=os.environ.get("OUT"),
                        help="also copy the result files here (default: $OUT)")
    args = parser.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    device = device_name()
    steps = [run_step("pytest -m gpu", [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p",
                                        "no:cacheprovider", f"--junitxml={PYTEST_XML}"], TEST_TIMEOUT)]
    if ROUTING_SCRIPT.exists():
        steps.append(run_step("bench/gpu_routing.py", routing_command(), ROUTING_TIMEOUT))
    steps.append(run_step("bench/gpu_gemm.py", [sys.executable, "bench/gpu_gemm.py", "--repeats", str(GEMM_REPEATS)],
                          GEMM_TIMEOUT))
    write_summary(device, steps)
    if args.copy_to:
        args.copy_to.mkdir(parents=True, exist_ok=True)
        for path in [SUMMARY, PYTEST_XML, GEMM_JSON, *RESULTS.glob("gpu_routing*.json")]:
            if path.exists():
                shutil.copy(path, args.copy_to / path.name)
    return 0 if all(s["status"] == 0 for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
