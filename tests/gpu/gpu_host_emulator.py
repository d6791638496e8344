"""Build the CUDA kernels for the host (host_emulation.h, beside this file) and run launch plans on NumPy arrays.

The emulator compiles kernels/moe_gemm.cu with g++ into a shared library holding the requested
template instantiations and a cuLaunchKernel-style entry point; ``HostBackend`` runs the same
``KernelLaunch`` plans as the CuPy backend, so the Python launch logic is exercised too.
Arrays it allocates are poisoned (NaN) and fenced by guard elements checked after each launch.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from gpu_reference import to_storage
from moeroute.gpu import gemm_fp8
from moeroute.gpu import launch as L
from moeroute.gpu.align_fallback import align_block_size_array_api
from moeroute.gpu.loader import KERNEL_DIR

GUARD_ELEMENTS = 64  # elements of poison on each side of an emulated device buffer
POISON_BITS = {
    np.dtype(np.float32): np.uint32(0x7FC00000),
    np.dtype(np.float16): np.uint16(0x7E00),
    np.dtype(np.uint16): np.uint16(0x7FC0),
}  # quiet NaN of float32 / float16 / bfloat16
HOST_COMPILER = "g++"
SCHEDULES = {"round_robin": 0, "lowest_first": 1, "highest_first": 2}  # moeroute_emu::Schedule
ERROR_BUFFER_BYTES = 4096
HIPCC = shutil.which("hipcc")
HIP_ARCHS = ("gfx90a", "gfx940")
#: Holds host_emulation.h, which compat.cuh includes in the host build only (not part of the package).
EMULATION_DIR = Path(__file__).resolve().parent
EMULATION_HEADER = EMULATION_DIR / "host_emulation.h"


def nvrtc_available() -> bool:
    """Whether CuPy's NVRTC binding can compile here (no GPU needed)."""
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
        return True
    except Exception:  # CuPy or its NVRTC library missing
        return False


def compiler_available() -> bool:
    return shutil.which(HOST_COMPILER) is not None


def _translation_unit(names, kernel_file: str = L.KERNEL_FILE) -> str:
    entries = "\n".join(f'    {{"{name}", &launch<&{name}>}},' for name in names)
    return f"""#define MOEROUTE_HOST_EMULATION 1
#include "{kernel_file}.cu"
#include <cstdio>
#include <cstring>

namespace {{
using Launcher = std::string (*)(dim3, dim3, std::size_t, void**);
template <auto Kernel>
std::string launch(dim3 grid, dim3 block, std::size_t shared_bytes, void** params) {{
  return moeroute_emu::launch_kernel(Kernel, grid, block, shared_bytes, params);
}}
struct Entry {{
  const char* name;
  Launcher launcher;
}};
const Entry kEntries[] = {{
{entries}
}};
}}  // namespace

extern "C" int moeroute_emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                   unsigned by, unsigned bz, unsigned long shared_bytes, void** params,
                                   char* error, unsigned long error_bytes) {{
  for (const Entry& entry : kEntries) {{
    if (std::strcmp(entry.name, name) != 0) continue;
    const std::string message = entry.launcher(dim3(gx, gy, gz), dim3(bx, by, bz), shared_bytes, params);
    std::snprintf(error, error_bytes, "%s", message.c_str());
    return message.empty() ? 0 : 1;
  }}
  std::snprintf(error, error_bytes, "kernel %s was not built into the emulator", name);
  return 2;
}}

extern "C" void moeroute_emu_configure(int schedule, int eager_async_copies) {{
  moeroute_emu::schedule = schedule;
  moeroute_emu::eager_async_copies = eager_async_copies != 0;
}}
"""


class HostEmulator:
    """A g++ build of the given kernel instantiations of kernels/<kernel_file>.cu, launched like
    cuLaunchKernel."""

    def __init__(self, names, build_dir=None, kernel_file: str = L.KERNEL_FILE):
        self.names = tuple(names)
        source = _translation_unit(self.names, kernel_file)
        kernel_text = "".join(p.read_text() for p in sorted(KERNEL_DIR.iterdir()) if p.suffix in (".cu", ".cuh"))
        kernel_text += EMULATION_HEADER.read_text()
        digest = hashlib.sha256((source + kernel_text).encode()).hexdigest()[:16]
        build_dir = Path(build_dir or tempfile.gettempdir()) / f"moeroute-host-emulation-{digest}"
        library = build_dir / "kernels.so"
        if not library.exists():
            build_dir.mkdir(parents=True, exist_ok=True)
            (build_dir / "kernels.cpp").write_text(source)
            partial = build_dir / f"kernels.{id(self)}.so"
            command = [
                HOST_COMPILER,
                "-std=c++20",
                "-O1",
                "-shared",
                "-fPIC",
                "-Wall",
                "-Wextra",
                "-Wno-unused-parameter",
                f"-I{KERNEL_DIR}",
                f"-I{EMULATION_DIR}",
                str(build_dir / "kernels.cpp"),
                "-o",
                str(partial),
            ]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"host build failed:\n{result.stderr}")
            self.build_warnings = result.stderr
            partial.replace(library)
        else:
            self.build_warnings = ""
        self._library = ctypes.CDLL(str(library))
        self._library.moeroute_emu_launch.restype = ctypes.c_int
        self._library.moeroute_emu_configure.restype = None

    def configure(self, schedule: str = "round_robin", eager_async_copies: bool = False) -> None:
        """How the emulated threads interleave (see host_emulation.h): ``schedule`` is one of
        SCHEDULES; ``eager_async_copies`` lands cp.async at issue instead of at the wait."""
        self._library.moeroute_emu_configure(SCHEDULES[schedule], int(eager_async_copies))

    def launch(self, plan: L.KernelLaunch) -> None:
        holders = []
        for arg in plan.args:
            if isinstance(arg, np.ndarray):
                if not arg.flags.c_contiguous:
                    raise ValueError("emulated kernels take C-contiguous arrays")
                holders.append(ctypes.c_void_p(arg.ctypes.data))
            elif isinstance(arg, np.int32):
                holders.append(ctypes.c_int32(int(arg)))
            else:
                raise TypeError(f"unsupported kernel argument {type(arg).__name__}")
        params = (ctypes.c_void_p * len(holders))(*[ctypes.cast(ctypes.pointer(h), ctypes.c_void_p) for h in holders])
        error = ctypes.create_string_buffer(ERROR_BUFFER_BYTES)
        status = self._library.moeroute_emu_launch(
            plan.name.encode(),
            *[ctypes.c_uint(v) for v in plan.grid],
            *[ctypes.c_uint(v) for v in plan.block],
            ctypes.c_ulong(plan.shared_memory),
            params,
            error,
            ctypes.c_ulong(ERROR_BUFFER_BYTES),
        )
        if status != 0:
            raise RuntimeError(f"{plan.name}: {error.value.decode()}")


class GuardedArrays:
    """Allocates NumPy arrays inside poisoned guard regions and checks the guards later."""

    def __init__(self):
        self._buffers = []

    def empty(self, shape, dtype):
        dtype = np.dtype(dtype)
        size = int(np.prod(shape))
        full = np.empty(size + 2 * GUARD_ELEMENTS, dtype=dtype)
        bits = POISON_BITS.get(dtype)
        if bits is not None:
            full.view(bits.dtype)[:] = bits
        else:
            full[:] = np.iinfo(dtype).min
        self._buffers.append((full, full.copy()))
        return full[GUARD_ELEMENTS : GUARD_ELEMENTS + size].reshape(shape)

    def copy(self, array):
        out = self.empty(array.shape, array.dtype)
        out[...] = array
        return out

    def check_guards(self) -> None:
        for full, snapshot in self._buffers:
            raw, before = full.view(np.uint8), snapshot.view(np.uint8)
            guard_bytes = GUARD_ELEMENTS * full.itemsize
            if not (
                np.array_equal(raw[:guard_bytes], before[:guard_bytes])
                and np.array_equal(raw[-guard_bytes:], before[-guard_bytes:])
            ):
                raise AssertionError("a kernel wrote outside an array")


class HostBackend:
    """The backend interface of moeroute.gpu.gemm.run_fused_experts, on NumPy arrays and the emulator."""

    is_hip = False
    compute_capability = 90

    def __init__(self, emulator: HostEmulator, arrays: GuardedArrays | None = None):
        self.emulator = emulator
        self.arrays = arrays or GuardedArrays()
        self.launched = []

    def empty(self, shape, dtype):
        # uint8: the quantized formats' scratch (FP8 activations)
        return self.arrays.empty(shape, np.uint8 if dtype == "uint8" else L.STORAGE_DTYPES[dtype])

    def pointer(self, array) -> int:
        return int(array.ctypes.data)

    def align_block_size(self, topk_ids, num_experts, block_size):
        sorted_token_ids, expert_ids, _ = align_block_size_array_api(topk_ids, num_experts, block_size, xp=np)
        return self.arrays.copy(sorted_token_ids), self.arrays.copy(expert_ids)

    def launch(self, plan: L.KernelLaunch) -> None:
        self.launched.append(plan.name)
        self.emulator.launch(plan)
        self.arrays.check_guards()


def run_fp8_on_host(emulator: HostEmulator, dtype: str, x, topk_ids, topk_weights, quantized, **options):
    """`moeroute.gpu.gemm_fp8.run_fp8_experts` on the host: ``x`` (torch, values of ``dtype``),
    the routing (NumPy) and ``quantized`` (q_gate_up, gate_up_scale, q_down, down_scale: torch
    e4m3 and float32) copied into guarded arrays, ``options`` passed on (an ``input_scale``
    tensor copied too); the guards checked after. Returns (out in ``dtype``'s storage, the
    backend, whose ``launched`` names the kernels)."""
    arrays = GuardedArrays()
    backend = HostBackend(emulator, arrays)
    out = arrays.empty(tuple(x.shape), L.STORAGE_DTYPES[dtype])
    q_gate_up, gate_up_scale, q_down, down_scale = quantized
    if options.get("input_scale") is not None:
        options["input_scale"] = arrays.copy(options["input_scale"].numpy())
    gemm_fp8.run_fp8_experts(
        backend,
        dtype,
        arrays.copy(to_storage(x.float().numpy(), dtype)),
        arrays.copy(q_gate_up.view(torch.uint8).numpy()),
        arrays.copy(gate_up_scale.numpy()),
        arrays.copy(q_down.view(torch.uint8).numpy()),
        arrays.copy(down_scale.numpy()),
        arrays.copy(topk_weights),
        arrays.copy(topk_ids),
        out,
        **options,
    )
    arrays.check_guards()
    return out, backend


def format_emulator(kernel_file: str, names, tmp_path_factory) -> HostEmulator:
    """The host build of ``names`` from kernels/<kernel_file>.cu in its default interleaving (a
    module fixture of a weight format's tests); skips without g++."""
    if not compiler_available():
        pytest.skip("g++ not found: the host emulation of the kernels needs a C++20 compiler")
    emulator = HostEmulator(
        names, build_dir=tmp_path_factory.mktemp(f"{kernel_file}-emulator"), kernel_file=kernel_file
    )
    emulator.configure()
    return emulator


def assert_no_spills(result, arch: str) -> str:
    """Assert an NVRTC build (`moeroute.gpu.loader.nvrtc_compile`'s result) without warnings in
    which no kernel spills to local memory; returns (and prints) the per-kernel report."""
    assert "warning" not in result.log.lower(), result.log
    assert result.cubin
    report = "\n".join(
        f"{arch} {r.registers:4d} registers, {r.spill_store_bytes} B spill stores, "
        f"{r.spill_load_bytes} B spill loads, {r.stack_frame_bytes} B stack  {name}"
        for name, r in sorted(result.resources.items())
    )
    print(report)
    spilling = [
        name for name, r in result.resources.items() if r.spill_store_bytes or r.spill_load_bytes or r.stack_frame_bytes
    ]
    assert not spilling, f"kernels spilling to local memory on {arch}:\n{report}"
    return report


def hipcc_code_object(kernel_file: str, names, tmp_path, archs=HIP_ARCHS) -> bytes:
    """Compile ``names`` of kernels/<kernel_file>.hip for ``archs`` in one hipcc call (the source
    is parsed once); assert it builds without warnings and return the code object."""
    refs = ",\n".join(f"    reinterpret_cast<const void*>(&{name})" for name in names)
    source = tmp_path / f"check_{kernel_file}.hip"  # not the kernel's own name: #include "" looks here first
    source.write_text(f'#include "{kernel_file}.hip"\nconst void* moeroute_kernels[] = {{\n{refs}\n}};\n')
    output = tmp_path / f"{kernel_file}.co"
    arch_flags = [f"--offload-arch={arch}" for arch in archs]
    result = subprocess.run(
        [HIPCC, "--genco", *arch_flags, "-std=c++17", "-Wall", f"-I{KERNEL_DIR}", str(source), "-o", str(output)],
        capture_output=True,
        text=True,
        env={**os.environ, "HIP_PLATFORM": "amd"},
    )
    assert result.returncode == 0, result.stderr
    assert "warning" not in result.stderr.lower(), result.stderr
    code_object = output.read_bytes()
    for arch in archs:
        assert arch.encode() in code_object
    return code_object
