"""Compile the CUDA / HIP kernels once per (kernel file, instantiation, device) and cache them.

At run time CuPy compiles with NVRTC (hiprtc on ROCm builds of CuPy, which get the ``.hip``
variant) for the current device's architecture and keeps its own on-disk cache; this module adds
an in-process cache so that a kernel object is built once. ``nvrtc_compile`` is the same compile
done offline for a named architecture, with ptxas' register and spill report: the CI compile
checks and bench/gpu_check.py use it without a GPU.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
# Options shared by the run-time and the offline compile; CuPy adds the architecture.
COMPILE_OPTIONS = ("-std=c++17", f"-I{KERNEL_DIR}")


def is_hip() -> bool:
    """True when CuPy is a ROCm build (kernels come from the .hip files)."""
    import cupy

    return bool(cupy.cuda.runtime.is_hip)


def kernel_source(kernel_file: str, hip: bool = False) -> str:
    """Text of kernels/<kernel_file>.cu, or of the .hip variant."""
    return (KERNEL_DIR / f"{kernel_file}.{'hip' if hip else 'cu'}").read_text()


@functools.lru_cache(maxsize=None)
def _module(kernel_file: str, name_expression: str, device_id: int, hip: bool):
    import cupy

    return cupy.RawModule(
        code=kernel_source(kernel_file, hip), options=COMPILE_OPTIONS, name_expressions=(name_expression,)
    )


@functools.lru_cache(maxsize=None)
def _kernel(kernel_file: str, name_expression: str, device_id: int, hip: bool, shared_memory: int):
    kernel = _module(kernel_file, name_expression, device_id, hip).get_function(name_expression)
    if shared_memory > kernel.max_dynamic_shared_size_bytes:
        kernel.max_dynamic_shared_size_bytes = shared_memory
    return kernel


def get_kernel(kernel_file: str, name_expression: str, shared_memory: int = 0):
    """The compiled ``cupy.RawKernel`` of one template instantiation on the current device.

    ``shared_memory`` (bytes of dynamic shared memory per block) above the default limit is
    opted into once per kernel.
    """
    import cupy

    device_id = cupy.cuda.Device().id
    return _kernel(kernel_file, name_expression, device_id, is_hip(), int(shared_memory))


def compute_capability() -> int:
    """Compute capability of the current device as an int (90 for sm_90); 0 on ROCm."""
    import cupy

    if is_hip():
        return 0
    return int(cupy.cuda.Device().compute_capability)


@dataclass(frozen=True)
class KernelResources:
    """ptxas' report for one kernel."""

    registers: int
    stack_frame_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int


@dataclass(frozen=True)
class CompileResult:
    cubin: bytes
    log: str
    resources: dict  # name expression -> KernelResources


_ENTRY = re.compile(r"Compiling entry function '(\S+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")


def parse_ptxas_report(log: str) -> dict:
    """Mangled kernel name -> KernelResources from a ``ptxas -v`` log."""
    report, entry, frame = {}, None, None
    for line in log.splitlines():
        if match := _ENTRY.search(line):
            entry, frame = match.group(1), None
        elif match := _FRAME.search(line):
            frame = tuple(int(v) for v in match.groups())
        elif (match := _REGISTERS.search(line)) and entry is not None:
            stack, stores, loads = frame or (0, 0, 0)
            report[entry] = KernelResources(int(match.group(1)), stack, stores, loads)
    return report


def nvrtc_compile(kernel_file: str, name_expressions, arch: str) -> CompileResult:
    """Compile kernels/<kernel_file>.cu with NVRTC for ``arch`` (e.g. "sm_90"), no GPU needed.

    Raises
    ------
    RuntimeError
        when NVRTC reports an error; the message holds the compiler log.
    """
    from cupy.cuda import nvrtc

    program = nvrtc.createProgram(kernel_source(kernel_file), f"{kernel_file}.cu", [], [])
    try:
        for name in name_expressions:
            nvrtc.addNameExpression(program, name)
        options = list(COMPILE_OPTIONS) + [f"-arch={arch}", "--ptxas-options=-v"]
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as error:
            raise RuntimeError(f"NVRTC failed for {arch}:\n{nvrtc.getProgramLog(program)}") from error
        log = nvrtc.getProgramLog(program)
        by_mangled = parse_ptxas_report(log)
        resources = {name: by_mangled[nvrtc.getLoweredName(program, name)] for name in name_expressions}
        return CompileResult(nvrtc.getCUBIN(program), log, resources)
    finally:
        nvrtc.destroyProgram(program)
