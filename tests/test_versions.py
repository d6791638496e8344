"""The tested dependency ranges agree everywhere they are written: pyproject.toml's ranges
(each with an upper bound), the versions `make test-oldest` installs (each the lower bound's
release) and docs/versions.md's table."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Dependencies whose range is tested at both ends; name -> where pyproject lists it.
RANGED = {"numpy": "dependencies", "numba": "dependencies", "torch": "torch", "transformers": "hf"}


def _ranges() -> dict[str, tuple[str, str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = {}
    for name, where in RANGED.items():
        requirements = project["dependencies"] if where == "dependencies" else project["optional-dependencies"][where]
        (requirement,) = [r for r in requirements if re.match(rf"{name}\b", r)]
        match = re.fullmatch(rf"{name}>=([\d.]+),<([\d.]+)", requirement)
        assert match, f"{requirement!r}: a tested range is written {name}>=LOW,<HIGH"
        found[name] = match.groups()
    return found


def _oldest_pins() -> dict[str, str]:
    makefile = (ROOT / "Makefile").read_text()
    pins = re.search(r"^OLDEST_PINS \?= (.*)$", makefile, re.M).group(1).split()
    pins.append(re.search(r"^TORCH_PIN \?= (.*)$", makefile, re.M).group(1))
    return dict(pin.split("==") for pin in pins)


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.match(r"[\d.]+", version).group(0).rstrip(".").split("."))


def test_every_tested_range_is_closed_and_the_same_in_every_extra():
    ranges = _ranges()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for name in ("torch", "transformers"):
        low, high = ranges[name]
        for extra, requirements in project["optional-dependencies"].items():
            for requirement in requirements:
                if re.match(rf"{name}\b", requirement):
                    assert requirement == f"{name}>={low},<{high}", (extra, requirement)
    for low, high in ranges.values():
        assert _release(low) < _release(high)


def test_make_test_oldest_installs_each_lower_bound():
    pins = _oldest_pins()
    for name, (low, _) in _ranges().items():
        release, bound = _release(pins[name]), _release(low)
        assert release[: len(bound)] == bound, f"{name}=={pins[name]} is not the lower bound {name}>={low}"


def test_docs_versions_table_states_each_range():
    text = (ROOT / "docs" / "versions.md").read_text()
    pins = _oldest_pins()
    for name, (low, high) in _ranges().items():
        row = next(line for line in text.splitlines() if line.startswith(f"| {name} "))
        assert f"`>={low},<{high}`" in row and pins[name].split("+")[0] in row, row
