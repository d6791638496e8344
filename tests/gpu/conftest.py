"""Fixtures of the expert GEMM tests: the host emulator build and the GPU check."""

from __future__ import annotations

import pytest

from gpu_host_emulator import HostEmulator, compiler_available
from moeroute.gpu import launch as L


@pytest.fixture(scope="session")
def host_emulator(tmp_path_factory):
    """Every CUDA instantiation the launcher can ask for, built for the host with g++."""
    if not compiler_available():
        pytest.skip("g++ not found: the host emulation of the kernels needs a C++20 compiler")
    return HostEmulator(L.shipped_name_expressions("cuda"), build_dir=tmp_path_factory.mktemp("emulator"))


@pytest.fixture
def emulator(host_emulator):
    """The host emulator in its default interleaving; restored after tests that change it."""
    host_emulator.configure()
    yield host_emulator
    host_emulator.configure()
