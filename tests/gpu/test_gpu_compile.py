"""Device compile checks without a device: every shipped instantiation of moe_gemm.cu through
NVRTC for sm_80 and sm_90 (no warnings, no spills, registers reported), moe_gemm.hip through
Debian's hipcc for gfx90a and gfx940, the committed .hip files up to date, and the host
emulation build free of warnings."""

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from moeroute.gpu import launch as L
from moeroute.gpu.loader import KERNEL_DIR, nvrtc_compile

REPO = Path(__file__).resolve().parents[2]
NVRTC_ARCHS = ("sm_80", "sm_90")
HIP_ARCHS = ("gfx90a", "gfx940")
HIPCC = shutil.which("hipcc")


def _nvrtc_available() -> bool:
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
        return True
    except Exception:  # CuPy or its NVRTC library missing
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _nvrtc_available(), reason="CuPy's NVRTC binding is not available")
@pytest.mark.parametrize("arch", NVRTC_ARCHS)
def test_nvrtc_compiles_every_instantiation(arch):
    names = L.shipped_name_expressions("cuda")
    result = nvrtc_compile(L.KERNEL_FILE, names, arch)
    assert "warning" not in result.log.lower(), result.log
    assert result.cubin, "no cubin produced"
    assert set(result.resources) == set(names)
    report = "\n".join(f"{arch} {r.registers:4d} registers, {r.spill_store_bytes} B spill stores, "
                       f"{r.spill_load_bytes} B spill loads  {name}" for name, r in sorted(result.resources.items()))
    print(report)
    spilling = {name: r for name, r in result.resources.items()
                if r.spill_store_bytes or r.spill_load_bytes or r.stack_frame_bytes}
    assert not spilling, f"kernels spilling to local memory on {arch}:\n{report}"


def _hip_translation_unit(names) -> str:
    # Taking each kernel's address instantiates it, as hiprtc's name expressions do.
    refs = ",\n".join(f"    reinterpret_cast<const void*>(&{name})" for name in names)
    return (f'#include "{L.KERNEL_FILE}.hip"\n'
            f"const void* moeroute_shipped_kernels[] = {{\n{refs}\n}};\n")


@pytest.mark.skipif(HIPCC is None, reason="hipcc not found (apt-get install hipcc): HIP compile check skipped")
@pytest.mark.parametrize("arch", HIP_ARCHS)
def test_hipcc_compiles_every_instantiation(arch, tmp_path):
    source = tmp_path / "shipped.hip"
    source.write_text(_hip_translation_unit(L.shipped_name_expressions("hip")))
    output = tmp_path / f"shipped-{arch}.co"
    command = [HIPCC, "--genco", f"--offload-arch={arch}", "-std=c++17", "-Wall", f"-I{KERNEL_DIR}", str(source),
               "-o", str(output)]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HIP_PLATFORM": "amd"})
    assert result.returncode == 0, result.stderr
    assert "warning" not in result.stderr.lower(), result.stderr
    code_object = output.read_bytes()
    for name in ("moe_gemm_simt", "moe_sum_topk"):
        assert name.encode() in code_object
    assert b"moe_gemm_mma" not in code_object, "the mma.sync path must be compiled out on AMD"


def test_hip_variants_are_up_to_date():
    spec = importlib.util.spec_from_file_location("hipify_kernels", REPO / "tools" / "hipify_kernels.py")
    hipify = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hipify)
    expected = hipify.generated_files()
    assert {p.name for p in expected} == {p.name for p in KERNEL_DIR.glob("*.hip")}
    for path, text in expected.items():
        assert path.read_text() == text, f"{path.name} is stale: run python tools/hipify_kernels.py"


def test_host_emulation_builds_without_warnings(host_emulator):
    assert host_emulator.build_warnings == ""
