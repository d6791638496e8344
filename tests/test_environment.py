"""The README's one table of environment variables lists every ``MOEROUTE_*`` variable the
package reads, and nothing else, each with its values, default and purpose."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE_HEADER = "| variable | values | default | what for |"
# A variable's name: the C macros of gpu/kernels (MOEROUTE_DEVICE, ...) live in .cu/.cuh files,
# which this does not read; "MOEROUTE_*" in prose ends in "_" and is not a name.
NAME = re.compile(r"\bMOEROUTE_[A-Z0-9]+(?:_[A-Z0-9]+)*\b(?!_)")


def names_in_package() -> set[str]:
    return {name for path in (ROOT / "moeroute").rglob("*.py") for name in NAME.findall(path.read_text())}


def table_rows(readme: str) -> dict[str, list[str]]:
    """Variable name -> [values, default, what for], from the table under TABLE_HEADER."""
    lines = readme.splitlines()
    assert lines.count(TABLE_HEADER) == 1, "the README has one table of environment variables"
    start = lines.index(TABLE_HEADER) + 2  # past the header and the --- row
    rows = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        rows[cells[0].strip("`")] = cells[1:]
    return rows


def test_the_scanner_finds_names_and_skips_prose():
    text = 'SWITCH = "MOEROUTE_VLLM"  # how a ``MOEROUTE_*`` variable is read; $MOEROUTE_CUBIN_CACHE'
    assert set(NAME.findall(text)) == {"MOEROUTE_VLLM", "MOEROUTE_CUBIN_CACHE"}


def test_every_variable_the_package_reads_is_in_the_readme_table():
    rows = table_rows((ROOT / "README.md").read_text())
    assert set(rows) == names_in_package()
    assert names_in_package() == {
        "MOEROUTE_CPU_ISA",
        "MOEROUTE_CUBIN_CACHE",
        "MOEROUTE_CUDA_LAUNCHER",
        "MOEROUTE_SIM_WARPS",
        "MOEROUTE_VLLM",
    }
    for name, cells in rows.items():
        assert len(cells) == 3 and all(cells), f"{name}: values, default and purpose must all be given"
