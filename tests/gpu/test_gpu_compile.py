"""Device compile checks without a device: every shipped instantiation of moe_gemm.cu through
NVRTC for sm_80 and sm_90 (no warnings, no spills, registers reported, the Hopper tiles within
the register bound of two resident blocks per SM), moe_gemm.hip through
Debian's hipcc for gfx90a and gfx940, the committed .hip files up to date, and the host
emulation build free of warnings."""

import functools
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from gpu_host_emulator import nvrtc_available
from moeroute.gpu import launch as L
from moeroute.gpu.loader import KERNEL_DIR, nvrtc_compile

REPO = Path(__file__).resolve().parents[2]
NVRTC_ARCHS = ("sm_80", "sm_90")
HIP_ARCHS = ("gfx90a", "gfx940")
HIPCC = shutil.which("hipcc")
# Hopper tiles: at least 2 blocks of up to 256 threads per SM, so at most 65536 / 512 registers
# per thread (the bound for every Hopper tile, whatever its thread count).
HOPPER_MIN_RESIDENT_BLOCKS = 2
HOPPER_MAX_REGISTERS = 128
# sm_90 multiprocessor (CUDA occupancy calculator): registers are allocated per warp in units of
# 256 (8 per thread), shared memory per block carries 1 KB reserved by the system.
SM90_REGISTERS = 65536
SM90_REGISTER_UNIT_PER_THREAD = 8
SM90_SHARED_MEMORY = 228 * 1024
SM90_RESERVED_SHARED_PER_BLOCK = 1024
SM90_MAX_WARPS = 64
SM90_MAX_BLOCKS = 32


def sm90_resident_blocks(tile, gated, registers):
    """Blocks of ``tile`` one sm_90 multiprocessor holds at once, from its registers per thread
    and its shared memory (dynamic stages + token_row + block_expert)."""
    warps = tile.threads // 32
    registers_per_warp = -(-registers // SM90_REGISTER_UNIT_PER_THREAD) * SM90_REGISTER_UNIT_PER_THREAD * 32
    by_registers = (SM90_REGISTERS // registers_per_warp) // warps
    shared = tile.shared_memory_bytes(gated) + 4 * tile.tile_m + 4 + SM90_RESERVED_SHARED_PER_BLOCK
    return min(by_registers, SM90_SHARED_MEMORY // shared, SM90_MAX_WARPS // warps, SM90_MAX_BLOCKS)


@functools.cache
def _compile(arch):
    return nvrtc_compile(L.KERNEL_FILE, L.shipped_name_expressions("cuda"), arch)


@pytest.mark.slow
@pytest.mark.skipif(not nvrtc_available(), reason="CuPy's NVRTC binding is not available")
@pytest.mark.parametrize("arch", NVRTC_ARCHS)
def test_nvrtc_compiles_every_instantiation(arch):
    names = L.shipped_name_expressions("cuda")
    result = _compile(arch)
    assert "warning" not in result.log.lower(), result.log
    assert result.cubin, "no cubin produced"
    assert set(result.resources) == set(names)
    report = "\n".join(
        f"{arch} {r.registers:4d} registers, {r.spill_store_bytes} B spill stores, "
        f"{r.spill_load_bytes} B spill loads  {name}"
        for name, r in sorted(result.resources.items())
    )
    print(report)
    spilling = {
        name: r
        for name, r in result.resources.items()
        if r.spill_store_bytes or r.spill_load_bytes or r.stack_frame_bytes
    }
    assert not spilling, f"kernels spilling to local memory on {arch}:\n{report}"
    # The Hopper tiles: registers low enough for their min_blocks (>= 2) resident blocks per SM.
    for dtype in ("float16", "bfloat16"):
        for (_, gated), tile in L.MMA_TILES_SM90.items():
            name = L.mma_name(dtype, tile, gated)
            assert tile.min_blocks >= HOPPER_MIN_RESIDENT_BLOCKS
            registers = result.resources[name].registers
            assert registers <= min(tile.max_registers, HOPPER_MAX_REGISTERS), report


@pytest.mark.slow
@pytest.mark.skipif(not nvrtc_available(), reason="CuPy's NVRTC binding is not available")
def test_hopper_tiles_keep_more_warps_resident():
    # From the sm_90 compile: each Hopper tile keeps at least 2 blocks per multiprocessor, at
    # least as many bytes of cp.async in flight per multiprocessor (blocks x (stages - 1) stages)
    # as the sm_80 tile would on sm_90, and its 64- and 128-row tiles keep more warps resident.
    resources = _compile("sm_90").resources
    lines = []
    for dtype in ("float16", "bfloat16"):
        for key, hopper in L.MMA_TILES_SM90.items():
            tile_m, gated = key
            ampere = L.MMA_TILES[key]
            blocks = {
                name: sm90_resident_blocks(tile, gated, resources[L.mma_name(dtype, tile, gated)].registers)
                for name, tile in (("sm90", hopper), ("sm80", ampere))
            }
            warps = {"sm90": blocks["sm90"] * hopper.threads // 32, "sm80": blocks["sm80"] * ampere.threads // 32}
            in_flight = {
                name: blocks[name] * (tile.stages - 1) * tile.shared_memory_bytes(gated) // tile.stages
                for name, tile in (("sm90", hopper), ("sm80", ampere))
            }
            lines.append(f"{dtype} {key}: blocks {blocks}, warps {warps}, bytes in flight {in_flight}")
            assert blocks["sm90"] >= hopper.min_blocks >= HOPPER_MIN_RESIDENT_BLOCKS, lines[-1]
            assert in_flight["sm90"] >= in_flight["sm80"], lines[-1]
            if tile_m >= 64:
                assert warps["sm90"] > warps["sm80"], lines[-1]
    print("\n".join(lines))


def _hip_translation_unit(names) -> str:
    # Taking each kernel's address instantiates it, as hiprtc's name expressions do.
    refs = ",\n".join(f"    reinterpret_cast<const void*>(&{name})" for name in names)
    return f'#include "{L.KERNEL_FILE}.hip"\nconst void* moeroute_shipped_kernels[] = {{\n{refs}\n}};\n'


@pytest.mark.skipif(HIPCC is None, reason="hipcc not found (apt-get install hipcc): HIP compile check skipped")
@pytest.mark.parametrize("arch", HIP_ARCHS)
def test_hipcc_compiles_every_instantiation(arch, tmp_path):
    source = tmp_path / "shipped.hip"
    source.write_text(_hip_translation_unit(L.shipped_name_expressions("hip")))
    output = tmp_path / f"shipped-{arch}.co"
    command = [
        HIPCC,
        "--genco",
        f"--offload-arch={arch}",
        "-std=c++17",
        "-Wall",
        f"-I{KERNEL_DIR}",
        str(source),
        "-o",
        str(output),
    ]
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


def test_the_host_emulation_header_is_not_in_the_package():
    # Device compiles (NVRTC, hiprtc, hipcc) see only KERNEL_DIR, so they cannot depend on it.
    assert not list(KERNEL_DIR.glob("*.h"))
    assert (Path(__file__).with_name("host_emulation.h")).is_file()
