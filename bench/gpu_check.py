"""One call on a GPU machine: staged, bounded, results written as they come, nothing installed.

    python3 bench/gpu_check.py [--out DIR]       # DIR defaults to $OUT, else bench/results/gpu_check
    python3 bench/gpu_check.py --dry-run         # no GPU needed: checks the plan itself

Stages, each in its own process group under its own time limit, so a stage that hangs or
crashes is killed and the next one still runs (the whole plan fits `BUDGET_S`):

0. environment  versions, nvidia-smi, a trivial Numba launch on a torch tensor and one NVRTC
                compile -> environment.json, rewritten after every probe. When Numba finds no
                libnvvm, the probe looks for one in the usual places and hands CUDA_HOME to
                the later stages.
1. warm         fills the on-disk caches in parallel: the Numba CPU kernels (the host
                references of the GPU tests), every shipped CuPy GEMM instantiation (float,
                FP8 w8a8 and w8a16, MXFP4, INT4) and the cubins of the select and route
                kernels the tests and benchmarks use.
2. tests        pytest -m gpu over an explicit file list (no whole-tree collection), JUnit XML
                written straight to DIR.
3. routing      bench/gpu_routing.py --quick -> DIR/gpu_routing.json as soon as it finishes
                (with the launch overhead of numba dispatch vs the cached launcher).
4. gemm         bench/gpu_gemm.py -> DIR/gpu_gemm.json (under `GEMM_SCRIPT_LIMIT_S`), then the
                MXFP4 w4a16 benchmark in the rest of the stage's time -> DIR/gpu_mxfp4.json:
                the gpt-oss-20b expert shape (H = I = 2880, 32 experts, top-4) at 1-64 tokens
                per expert through fused_experts(quant=mxfp4), packed weight bytes per second
                against the device's copy bandwidth (checked against a dequantized reference
                first). It shares the gemm stage because the plan's six stages are fixed.
5. summary      DIR/gpu_summary.md, a short table of all of the above, also printed.

Everything printed is also appended to DIR/gpu_check.log as it happens. The script never
installs anything: install the CUDA extra first (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ElementTree
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve()
DEFAULT_OUT = REPO / "bench" / "results" / "gpu_check"
ROUTING_SCRIPT = REPO / "bench" / "gpu_routing.py"
ROUTING_RESULTS = REPO / "bench" / "results" / "gpu_routing.json"
GEMM_SCRIPT = REPO / "bench" / "gpu_gemm.py"

#: Seconds the whole plan may take: one device call of at most ~8 minutes, with room for the
#: machine's own start and the file transfers inside the call's 10-minute command limit.
BUDGET_S = 480
#: The environment stage must answer within this, whatever else is broken.
ENVIRONMENT_LIMIT_S = 30
#: A device call returns at most this many files from its output folder.
MAX_RETURNED_FILES = 8
#: File names a device call returns: letters, digits, '.', '_' and '-'.
RETURNABLE_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
#: Parallel warm-up processes for the GEMM instantiations (NVRTC is single-threaded).
WARM_GEMM_PROCESSES = 6
GEMM_REPEATS = 10
#: Seconds a killed stage's process group gets to exit before the next stage starts.
KILL_GRACE_S = 5
#: Seconds one GPU test may take (with pytest-timeout, which the GPU image has).
PER_TEST_TIMEOUT_S = 60

#: Every test file that holds `gpu`-marked tests; the dry run checks that this list is
#: complete and that each file exists, so a new GPU test file cannot be silently skipped.
GPU_TEST_FILES = (
    "tests/gpu/test_gpu_device.py",
    "tests/gpu/test_gpu_graph.py",
    "tests/gpu/test_gpu_fp8_device.py",
    "tests/gpu/test_gpu_mxfp4_device.py",
    "tests/gpu/test_gpu_int4_device.py",
    "tests/routing/test_select_cuda.py",
    "tests/routing/test_dispatch_cuda.py",
    "tests/routing/test_frameworks.py",
    "tests/routing/test_launcher.py",
    "tests/routing/test_route.py",
    "tests/bindings/test_moe.py",
    "tests/bindings/test_ops.py",
    "tests/quant/test_quant_fp8.py",
)

ENVIRONMENT_JSON = "environment.json"
LOG = "gpu_check.log"
PYTEST_XML = "gpu_pytest.xml"
ROUTING_JSON = "gpu_routing.json"
GEMM_JSON = "gpu_gemm.json"
MXFP4_JSON = "gpu_mxfp4.json"
SUMMARY = "gpu_summary.md"
OUTPUT_FILES = (ENVIRONMENT_JSON, LOG, PYTEST_XML, ROUTING_JSON, GEMM_JSON, MXFP4_JSON, SUMMARY)

#: Seconds of the gemm stage given to bench/gpu_gemm.py; the MXFP4 benchmark has the rest.
GEMM_SCRIPT_LIMIT_S = 85
#: The MXFP4 benchmark: gpt-oss-20b's expert shape, tokens per expert, and its target.
MXFP4_SHAPE = {"hidden_size": 2880, "intermediate_size": 2880, "num_experts": 32, "top_k": 4}
MXFP4_TOKENS_PER_EXPERT = (1, 4, 16, 64)
MXFP4_TARGET_FRACTION = 0.5  # packed weight bytes per second over the device copy bandwidth
MXFP4_CHECK_TOLERANCE = 2e-2  # bfloat16 activations, intermediate and output
MXFP4_COPY_BYTES = 1 << 30  # buffer of the copy-bandwidth measurement
MXFP4_SAMPLES = 5


@dataclass(frozen=True)
class Stage:
    """One step of the plan: a name, a time limit, and the command it runs (None: in process)."""

    name: str
    timeout_s: int
    description: str


STAGES = (
    Stage("environment", ENVIRONMENT_LIMIT_S, "versions, nvidia-smi, Numba launch, NVRTC compile"),
    Stage("warm", 70, "Numba CPU kernels and CuPy GEMM instantiations, in parallel"),
    Stage("tests", 170, "pytest -m gpu over GPU_TEST_FILES"),
    Stage("routing", 60, "bench/gpu_routing.py --quick"),
    Stage("gemm", 115, f"bench/gpu_gemm.py --repeats {GEMM_REPEATS}, then the MXFP4 benchmark"),
    Stage("summary", 5, "gpu_summary.md"),
)


def stage_command(stage: Stage, out: Path) -> list[str] | None:
    """The argv of ``stage`` (run in the repository root), or None for the in-process summary."""
    python = sys.executable
    if stage.name in ("environment", "warm", "gemm"):
        return [python, str(SCRIPT), "--stage", stage.name, "--out", str(out)]
    if stage.name == "tests":
        per_test = []
        if importlib.util.find_spec("pytest_timeout") is not None:
            # A hung test fails alone; the stage goes on and still writes its JUnit XML.
            per_test = [f"--timeout={PER_TEST_TIMEOUT_S}", "--timeout-method=signal"]
        return [
            python,
            "-m",
            "pytest",
            "-m",
            "gpu",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            *per_test,
            f"--junitxml={out / PYTEST_XML}",
            *GPU_TEST_FILES,
        ]
    if stage.name == "routing":
        return [python, str(ROUTING_SCRIPT), "--quick"]
    if stage.name == "summary":
        return None
    raise ValueError(f"unknown stage {stage.name!r}")


# --------------------------------------------------------------------------- the plan check


def files_with_gpu_tests(root: Path = REPO) -> set[str]:
    """Test files under ``root``/tests that mark tests `gpu` (by text: nothing is imported)."""
    found = set()
    for path in (root / "tests").rglob("test_*.py"):
        if re.search(r"\bpytest\.mark\.gpu\b", path.read_text(errors="replace")):
            found.add(path.relative_to(root).as_posix())
    return found


def planned_seconds(stages=STAGES) -> int:
    """The plan's worst case: every timeout, plus the kill grace of each subprocess stage."""
    return sum(s.timeout_s + (KILL_GRACE_S if stage_command(s, Path("out")) else 0) for s in stages)


def check_plan(
    stages=STAGES, test_files=GPU_TEST_FILES, budget_s=BUDGET_S, root: Path = REPO, output_files=OUTPUT_FILES
) -> list[str]:
    """Every problem of the plan, as sentences; empty when the plan is sound."""
    problems = []
    names = [s.name for s in stages]
    if len(set(names)) != len(names):
        problems.append(f"stage names repeat: {names}")
    if not stages or stages[0].name != "environment":
        problems.append("the first stage must be 'environment'")
    for stage in stages:
        if stage.timeout_s <= 0:
            problems.append(f"stage {stage.name!r} has timeout {stage.timeout_s} s; it must be > 0")
        try:
            stage_command(stage, Path("out"))
        except ValueError as error:
            problems.append(str(error))
    environment = [s for s in stages if s.name == "environment"]
    if environment and environment[0].timeout_s > ENVIRONMENT_LIMIT_S:
        problems.append(
            f"the environment stage takes up to {environment[0].timeout_s} s; "
            f"it must answer within {ENVIRONMENT_LIMIT_S} s"
        )
    total = planned_seconds(stages)
    if total > budget_s:
        problems.append(f"stage timeouts plus kill grace sum to {total} s, over the budget of {budget_s} s")
    for name in test_files:
        if not (root / name).is_file():
            problems.append(f"GPU test file {name} does not exist")
    missing = files_with_gpu_tests(root) - set(test_files)
    if missing:
        problems.append(f"files with gpu-marked tests missing from GPU_TEST_FILES: {sorted(missing)}")
    for script in (ROUTING_SCRIPT, GEMM_SCRIPT):
        if not (root / script.relative_to(REPO)).is_file():
            problems.append(f"benchmark script {script.relative_to(REPO)} does not exist")
    if len(output_files) > MAX_RETURNED_FILES:
        problems.append(f"{len(output_files)} output files; a device call returns at most {MAX_RETURNED_FILES}")
    for name in output_files:
        if not RETURNABLE_NAME.match(name):
            problems.append(f"output file name {name!r} would not come back from a device call")
    return problems


def dry_run() -> int:
    """Print the plan and its problems; 0 when there are none."""
    out = Path("$OUT")
    for stage in STAGES:
        command = stage_command(stage, out)
        shown = "(in process)"
        if command:
            shown = " ".join(command).replace(sys.executable, "python3").replace(f"{REPO}/", "")
        print(f"{stage.name:<12} {stage.timeout_s:>4} s  {shown}")
    print(
        f"worst case {planned_seconds()} s (timeouts plus {KILL_GRACE_S} s kill grace per process) "
        f"against a budget of {BUDGET_S} s"
    )
    problems = check_plan()
    for problem in problems:
        print(f"PROBLEM: {problem}")
    print("plan OK" if not problems else f"{len(problems)} problem(s)")
    return 0 if not problems else 1


# --------------------------------------------------------------------------- running stages


class Log:
    """Print and append to the log file, line by line, flushed (a killed call keeps it)."""

    def __init__(self, path: Path):
        self.file = path.open("a", buffering=1)
        self.lock = threading.Lock()

    def write(self, text: str) -> None:
        with self.lock:
            sys.stdout.write(text)
            sys.stdout.flush()
            self.file.write(text)


def run_stage(stage: Stage, command, out: Path, log: Log, env: dict) -> dict:
    """Run one stage; kill its whole process group at its time limit."""
    started = time.monotonic()
    log.write(f"== {stage.name} ({stage.timeout_s} s): {' '.join(command)}\n")
    process = subprocess.Popen(
        command,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    tail = []

    def pump():
        for line in process.stdout:
            log.write(line)
            tail.append(line)
            del tail[:-200]

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        status = process.wait(timeout=stage.timeout_s)
    except subprocess.TimeoutExpired:
        status = "timeout"
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=KILL_GRACE_S)
    reader.join(timeout=KILL_GRACE_S)
    seconds = time.monotonic() - started
    log.write(f"== {stage.name}: status {status} after {seconds:.0f} s\n")
    return {"name": stage.name, "status": status, "seconds": round(seconds, 1), "tail": "".join(tail)[-3000:]}


def child_environment(out: Path) -> dict:
    """The environment of later stages: the repository importable, and CUDA_HOME when the
    environment stage found libnvvm only by searching."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    try:
        found = json.loads((out / ENVIRONMENT_JSON).read_text())
    except (OSError, ValueError):
        return env
    env.update(found.get("child_env", {}))
    return env


def run_plan(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out / LOG)
    log.write(f"# gpu_check {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M:%S} UTC, out={out}\n")
    records = []
    for stage in STAGES:
        command = stage_command(stage, out)
        if command is None:
            continue
        started = time.time()
        records.append(run_stage(stage, command, out, log, child_environment(out)))
        # gpu_routing.py writes into bench/results: take its JSON only if this run wrote it.
        if stage.name == "routing" and ROUTING_RESULTS.exists() and ROUTING_RESULTS.stat().st_mtime >= started:
            shutil.copy(ROUTING_RESULTS, out / ROUTING_JSON)
    summary = write_summary(out, records)
    log.write(summary)
    return 0 if all(r["status"] == 0 for r in records) else 1


# --------------------------------------------------------------------------- stage 0


def _probe(record: dict, path: Path, name: str, function) -> None:
    """Run one probe, store its answer or its error, rewrite the JSON."""
    started = time.monotonic()
    try:
        record[name] = function()
    except Exception as error:  # a probe reports, it never stops the stage
        record[name] = {"error": f"{type(error).__name__}: {error}"[:2000]}
    record.setdefault("seconds", {})[name] = round(time.monotonic() - started, 2)
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")


def _versions() -> dict:
    from importlib import metadata

    found = {"python": sys.version.split()[0], "platform": platform.platform()}
    for package in (
        "numpy",
        "numba",
        "numba-cuda",
        "cupy-cuda13x",
        "cupy-cuda12x",
        "torch",
        "cuda-python",
        "cuda-bindings",
        "nvidia-cuda-nvrtc",
        "pytest",
        "hypothesis",
        "transformers",
    ):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return found


def _nvidia_smi() -> dict:
    query = "name,driver_version,memory.total,compute_cap,clocks.max.sm"
    result = subprocess.run(
        ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
    )
    return {"query": query, "output": result.stdout.strip(), "returncode": result.returncode}


def _numba_launch_on_torch() -> dict:
    import torch
    from numba import cuda

    @cuda.jit
    def add_one(values):
        i = cuda.grid(1)
        if i < values.shape[0]:
            values[i] += 1

    tensor = torch.arange(64, dtype=torch.int32, device="cuda")
    add_one[1, 64](cuda.as_cuda_array(tensor, sync=False))
    torch.cuda.synchronize()
    ok = bool(torch.equal(tensor.cpu(), torch.arange(1, 65, dtype=torch.int32)))
    return {"ok": ok, "device": torch.cuda.get_device_name(), "torch_cuda": torch.version.cuda}


def _nvrtc_compile() -> dict:
    import cupy

    kernel = cupy.RawKernel(r'extern "C" __global__ void twice(float* x) { x[threadIdx.x] *= 2.0f; }', "twice")
    values = cupy.ones(32, dtype=cupy.float32)
    kernel((1,), (32,), (values,))
    return {
        "ok": bool((values == 2).all()),
        "nvrtc": cupy.cuda.nvrtc.getVersion(),
        "runtime": cupy.cuda.runtime.runtimeGetVersion(),
    }


#: Where a CUDA toolkit's libnvvm may live when Numba's own search misses it.
NVVM_SEARCH_ROOTS = ("/usr/local/cuda", "/usr/local", "/opt")


def find_libnvvm() -> str | None:
    """A toolkit root holding nvvm/lib64/libnvvm.so*, searched in site-packages and the usual
    places; None when there is none."""
    import site

    roots = [Path(p) for p in site.getsitepackages() + [site.getusersitepackages()]] + [
        Path(p) for p in NVVM_SEARCH_ROOTS
    ]
    for root in roots:
        if not root.is_dir():
            continue
        for pattern in (
            "nvvm/lib64/libnvvm.so*",
            "*/nvvm/lib64/libnvvm.so*",
            "nvidia/*/nvvm/lib64/libnvvm.so*",
            "nvidia/*/*/nvvm/lib64/libnvvm.so*",
        ):
            for library in root.glob(pattern):
                return str(library.parents[2])
    return None


def environment_stage(out: Path) -> int:
    path = out / ENVIRONMENT_JSON
    record: dict = {"utc": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M:%S}"}
    _probe(record, path, "versions", _versions)
    _probe(record, path, "nvidia_smi", _nvidia_smi)
    _probe(record, path, "nvrtc_compile", _nvrtc_compile)
    _probe(record, path, "numba_launch", _numba_launch_on_torch)
    if "error" in record["numba_launch"]:
        # Most often libnvvm not found: name a toolkit root for the later stages.
        root = find_libnvvm()
        record["libnvvm_search"] = root
        if root:
            record["child_env"] = {"CUDA_HOME": root}
        path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(json.dumps(record, indent=2, default=str))
    return 0 if all(record[k].get("ok") for k in ("nvrtc_compile", "numba_launch")) else 1


# --------------------------------------------------------------------------- stage 1

_WARM_CPU = """
import numpy as np
from moeroute import ExpertLayout, RouterConfig, align_block_size, append_shared_slots, select_experts
from moeroute.routing.combine import combine
from moeroute.routing.permute import permute
from moeroute.routing.remap import logical_to_physical, remap_to_local
rng = np.random.default_rng(0)
for dtype in (np.float32, np.float16):
    for scoring in ("softmax", "sigmoid"):
        logits = rng.standard_normal((4, 16)).astype(dtype)
        select_experts(logits, RouterConfig(16, 2, scoring=scoring), np.zeros(16, np.float32) if scoring == "sigmoid" else None)
ids = rng.integers(0, 8, (4, 2)).astype(np.int32)
weights = rng.random((4, 2)).astype(np.float32)
layout = ExpertLayout(8, 1, ep_size=2, dispatch="all2all")
append_shared_slots(weights, ids, layout, 1)
remap_to_local(logical_to_physical(ids, layout), layout.expert_map(0))
align_block_size(ids, 8, 4)
permuted, _, inverse = permute(rng.random((4, 8)).astype(np.float32), ids, 8)
combine(permuted, inverse, weights)
print("warm: CPU kernels compiled")
"""

_WARM_CUBINS = """
try:
    import cupy
    from moeroute.runtime import warmup_cuda
    arch = "sm_" + cupy.cuda.Device(0).compute_capability
    found = warmup_cuda(["deepseek-v3", "qwen3.5-moe", "mixtral-8x7b"], archs=[arch],
                        dtypes=["float32"], progress=False)
    print(f"warm: {found['compiled']} device routing kernels compiled for {arch}")
except Exception as error:  # the tests then compile on first use; not a failure
    print(f"warm: device routing kernels not compiled ({type(error).__name__}: {error})")
"""

_WARM_GEMM = """
import sys
from moeroute.gpu import loader
kernel_file, names = sys.argv[1], sys.argv[2:]
for name in names:
    loader.get_kernel(kernel_file, name)
print(f"warm: {len(names)} {kernel_file} instantiations compiled")
"""


def warm_stage(out: Path) -> int:
    from moeroute.gpu import gemm_fp8, gemm_int4, gemm_mxfp4, launch, loader

    capability = loader.compute_capability()
    kernels = {
        launch.KERNEL_FILE: launch.shipped_name_expressions("cuda"),
        gemm_fp8.KERNEL_FILE: gemm_fp8.shipped_name_expressions("cuda", capability),
        gemm_mxfp4.KERNEL_FILE: gemm_mxfp4.shipped_name_expressions("cuda", capability),
        gemm_int4.KERNEL_FILE: gemm_int4.shipped_name_expressions("cuda", capability),
    }
    commands = [[sys.executable, "-c", _WARM_CPU], [sys.executable, "-c", _WARM_CUBINS]] + [
        [sys.executable, "-c", _WARM_GEMM, kernel_file, *names[i::WARM_GEMM_PROCESSES]]
        for kernel_file, names in kernels.items()
        for i in range(WARM_GEMM_PROCESSES)
        if names[i::WARM_GEMM_PROCESSES]
    ]

    def run(command):
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        return result.returncode, (result.stdout + result.stderr)[-2000:]

    with ThreadPoolExecutor(len(commands)) as pool:
        results = list(pool.map(run, commands))
    for status, text in results:
        print(f"[{status}] {text.strip()}")
    return 0 if all(status == 0 for status, _ in results) else 1


# --------------------------------------------------------------------------- stage 4


def gemm_stage(out: Path) -> int:
    """bench/gpu_gemm.py under GEMM_SCRIPT_LIMIT_S (its process group killed past it), then the
    MXFP4 benchmark."""
    command = [sys.executable, str(GEMM_SCRIPT), "--repeats", str(GEMM_REPEATS), "--out", str(out / GEMM_JSON)]
    process = subprocess.Popen(command, cwd=REPO, start_new_session=True)
    try:
        status = process.wait(timeout=GEMM_SCRIPT_LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=KILL_GRACE_S)
        print(f"gpu_gemm.py killed after {GEMM_SCRIPT_LIMIT_S} s")
        status = 1
    try:
        mxfp4_status = mxfp4_benchmark(out / MXFP4_JSON)
    except Exception as error:  # reported in the log; the stage status says it failed
        print(f"MXFP4 benchmark failed: {type(error).__name__}: {error}")
        mxfp4_status = 1
    return 1 if (status or mxfp4_status) else 0


def _event_seconds(torch, fn, inner: int) -> float:
    """Seconds per call of ``fn``, ``inner`` back-to-back calls between two CUDA events."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(inner):
        fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / 1e3 / inner


def mxfp4_benchmark(path: Path) -> int:
    """The MXFP4 experts of gpt-oss-20b on this GPU -> ``path`` (JSON with ``targets``).

    Every expert gets exactly m (token, slot) rows, so every packed weight byte is read:
    bytes per call = blocks + scales of both projections of all experts. The copy bandwidth is
    (read + written bytes) per second of a device-to-device copy of MXFP4_COPY_BYTES.
    """
    import statistics

    import torch

    from moeroute.gpu import fused_experts
    from moeroute.quant import QuantConfig
    from moeroute.quant.mxfp4 import dequantize_mxfp4

    H, I, E, K = (MXFP4_SHAPE[key] for key in ("hidden_size", "intermediate_size", "num_experts", "top_k"))
    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    gate_up = (
        torch.randint(0, 256, (E, 2 * I, H // 32, 16), generator=g, dtype=torch.uint8, device=device),
        torch.randint(120, 124, (E, 2 * I, H // 32), generator=g, dtype=torch.uint8, device=device),
    )
    down = (
        torch.randint(0, 256, (E, H, I // 32, 16), generator=g, dtype=torch.uint8, device=device),
        torch.randint(119, 123, (E, H, I // 32), generator=g, dtype=torch.uint8, device=device),
    )
    bias = (torch.randn(E, 2 * I, generator=g, device=device), torch.randn(E, H, generator=g, device=device))
    packed_bytes = sum(t.numel() for t in (*gate_up, *down))
    quant = QuantConfig(format="mxfp4")

    source = torch.empty(MXFP4_COPY_BYTES, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    copy_bandwidth = max(
        2 * MXFP4_COPY_BYTES / _event_seconds(torch, lambda: target.copy_(source), 10) for _ in range(MXFP4_SAMPLES)
    )
    del source, target

    rows, targets = [], []
    for m in MXFP4_TOKENS_PER_EXPERT:
        T = E * m // K
        topk_ids = (torch.arange(T * K, device=device, dtype=torch.int32) % E).reshape(T, K)
        topk_weights = torch.rand(T, K, generator=g, device=device)
        x = torch.randn(T, H, generator=g, device=device).to(torch.bfloat16)

        def call():
            return fused_experts(
                x,
                gate_up,
                down,
                topk_weights,
                topk_ids,
                activation="swigluoai",
                gate_up_bias=bias[0],
                down_bias=bias[1],
                quant=quant,
            )

        out = call().float()
        # Reference: each slot's expert on weights dequantized in float32 (one expert at a time).
        expected = torch.zeros(T, H, device=device)
        for e in range(E):
            token, slot = (topk_ids == e).nonzero(as_tuple=True)
            h = x[token].float() @ dequantize_mxfp4(*(t[e] for t in gate_up)).T + bias[0][e]
            gate, up = h[:, :I].clamp(max=7.0), h[:, I:].clamp(-7.0, 7.0)
            act = ((up + 1) * gate * torch.sigmoid(1.702 * gate)).to(torch.bfloat16).float()
            y = act @ dequantize_mxfp4(*(t[e] for t in down)).T + bias[1][e]
            expected.index_add_(0, token, y * topk_weights[token, slot][:, None])
        error = float((out - expected).abs().max() / expected.abs().max())
        seconds = statistics.median(_event_seconds(torch, call, 10) for _ in range(MXFP4_SAMPLES))
        fraction = packed_bytes / seconds / copy_bandwidth
        rows.append(
            {
                "tokens_per_expert": m,
                "num_tokens": T,
                "seconds": seconds,
                "relative_error": error,
                "packed_bytes": packed_bytes,
                "packed_bytes_per_s": packed_bytes / seconds,
                "fraction_of_copy_bandwidth": fraction,
            }
        )
        print(
            f"mxfp4 m={m:3d}: {seconds * 1e6:8.1f} us, {packed_bytes / seconds / 1e9:7.1f} GB/s packed "
            f"({fraction:.2f} of copy), relative error {error:.2e}"
        )
        targets.append(
            {
                "model": f"gpt-oss-20b mxfp4 m={m}",
                "target": f"packed bytes/s >= {MXFP4_TARGET_FRACTION} x copy bandwidth, error <= "
                f"{MXFP4_CHECK_TOLERANCE}",
                "value": fraction,
                "met": fraction >= MXFP4_TARGET_FRACTION and error <= MXFP4_CHECK_TOLERANCE,
            }
        )
    path.write_text(
        json.dumps(
            {
                "shape": MXFP4_SHAPE,
                "copy_bandwidth_bytes_per_s": copy_bandwidth,
                "device": torch.cuda.get_device_name(),
                "rows": rows,
                "targets": targets,
            },
            indent=2,
        )
        + "\n"
    )
    return 0 if all(row["relative_error"] <= MXFP4_CHECK_TOLERANCE for row in rows) else 1


# --------------------------------------------------------------------------- summary


def pytest_counts(path: Path):
    if not path.exists():
        return None, []
    try:
        root = ElementTree.parse(path).getroot()
    except ElementTree.ParseError:
        return None, []
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in root.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    return counts, failed


def _targets(path: Path) -> list[str]:
    if not path.exists():
        return [f"{path.name}: not written."]
    try:
        data = json.loads(path.read_text())
    except ValueError:
        return [f"{path.name}: unreadable."]
    return [
        f"- {t['model']}: {t['target']}: {t['value']:.2f} ({'met' if t['met'] else 'NOT met'})"
        for t in data.get("targets", [])
    ] or [f"{path.name}: no targets."]


def write_summary(out: Path, records: list[dict]) -> str:
    lines = [f"# GPU check, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", ""]
    try:
        environment = json.loads((out / ENVIRONMENT_JSON).read_text())
        smi = environment.get("nvidia_smi", {})
        lines.append(f"Device: {smi.get('output') or smi.get('error', '?')}")
    except (OSError, ValueError):
        lines.append("Device: unknown (no environment.json)")
    lines += ["", "| stage | status | seconds |", "|---|---|---|"]
    lines += [f"| {r['name']} | {r['status']} | {r['seconds']:.0f} |" for r in records]
    counts, failed = pytest_counts(out / PYTEST_XML)
    lines += ["", "## GPU tests", ""]
    if counts is None:
        lines.append("No JUnit report (the test stage did not finish).")
    else:
        passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        lines.append(
            f"{passed} passed, {counts['failures']} failed, {counts['errors']} errors, {counts['skipped']} skipped."
        )
        lines += [f"- FAILED {name}" for name in failed[:40]]
    lines += ["", "## Routing targets", ""] + _targets(out / ROUTING_JSON)
    lines += ["", "## GEMM targets", ""] + _targets(out / GEMM_JSON)
    lines += ["", "## MXFP4 targets", ""] + _targets(out / MXFP4_JSON)
    text = "\n".join(lines) + "\n"
    (out / SUMMARY).write_text(text)
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ.get("OUT") or DEFAULT_OUT),
        help="result folder (default: $OUT, else bench/results/gpu_check)",
    )
    parser.add_argument("--dry-run", action="store_true", help="check the plan without a GPU and exit")
    parser.add_argument("--stage", choices=("environment", "warm", "gemm"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.dry_run:
        return dry_run()
    if args.stage == "environment":
        return environment_stage(args.out)
    if args.stage == "warm":
        return warm_stage(args.out)
    if args.stage == "gemm":
        return gemm_stage(args.out)
    return run_plan(args.out)


if __name__ == "__main__":
    sys.exit(main())
