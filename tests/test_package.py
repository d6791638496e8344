"""The package as users install it: version, license, type marker, the kernels as package data."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import moeroute
from moeroute import cli

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_version_is_the_projects(capsys):
    assert moeroute.__version__ == _pyproject()["project"]["version"]
    try:
        cli.main(["--version"])
    except SystemExit as exit_:  # argparse's version action exits 0 after printing
        assert exit_.code == 0
    assert capsys.readouterr().out.strip() == f"moeroute {moeroute.__version__}"


def test_version_from_the_console_entry_point():
    done = subprocess.run([sys.executable, "-m", "moeroute", "--version"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"moeroute {moeroute.__version__}"


def test_license_and_type_marker():
    project = _pyproject()["project"]
    assert project["license"] == "Apache-2.0"
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
    assert (Path(moeroute.__file__).parent / "py.typed").is_file()
    package_data = _pyproject()["tool"]["setuptools"]["package-data"]
    assert "py.typed" in package_data["moeroute"]
    assert any(pattern.endswith(".cu") for pattern in package_data["moeroute.gpu"])


def test_cuda12_extra_mirrors_the_cuda13_one():
    extras = _pyproject()["project"]["optional-dependencies"]
    names = {extra: sorted(req.split("[")[0].split(">")[0] for req in extras[extra]) for extra in ("cuda", "cuda12")}
    assert names["cuda"] == ["cupy-cuda13x", "numba-cuda"]
    assert names["cuda12"] == ["cupy-cuda12x", "numba-cuda"]
    assert any("numba-cuda[cu12]" in req for req in extras["cuda12"])
