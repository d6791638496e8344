"""moeroute's layers import one way: every import in the package, module-level or inside a
function, goes down the layers of pyproject.toml's import-linter contract (or stays inside
its own layer), and no set of modules imports itself round in a cycle."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "moeroute"


def _layers() -> list[list[str]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["type"] == "layers"]
    return [[f"moeroute.{name.strip().strip('()')}" for name in line.split("|")] for line in contract["layers"]]


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return modules


def _imports(name: str, path: Path, modules) -> set[str]:
    """Every moeroute module ``name`` imports, lazy (function-level) imports included."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            # ``from package import module`` imports that module; ``from module import name``
            # the module (a package's __init__ runs first either way, as for any submodule).
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and target != "moeroute":
                found.add(target)
    return found


def _layer_of(module: str, layers) -> int | None:
    for index, line in enumerate(layers):
        if any(module == member or module.startswith(member + ".") for member in line):
            return index
    return None


def _member_of(module: str, layers) -> str | None:
    for line in layers:
        for member in line:
            if module == member or module.startswith(member + "."):
                return member
    return None


def test_every_import_goes_down_the_layers():
    layers, modules = _layers(), _modules()
    upward = []
    for name, path in sorted(modules.items()):
        mine = _layer_of(name, layers)
        for target in sorted(_imports(name, path, modules)):
            theirs = _layer_of(target, layers)
            if mine is None or theirs is None:
                continue
            if theirs < mine or (theirs == mine and _member_of(name, layers) != _member_of(target, layers)):
                upward.append(f"{name} -> {target}")
    assert upward == [], "imports running up (or across independent) layers: " + "; ".join(upward)


def test_every_module_has_a_layer():
    layers = _layers()
    unplaced = [
        name
        for name in _modules()
        if name not in ("moeroute", "moeroute.__main__", "moeroute.bindings") and _layer_of(name, layers) is None
    ]
    assert unplaced == []


def test_no_import_cycles():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    # Tarjan's strongly connected components, iteratively.
    index, low, on_stack, stack, cycles, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))
    assert cycles == []


def test_the_walker_sees_lazy_imports(tmp_path):
    """The walk finds an import inside a function, relative or absolute (so it can fail)."""
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from moeroute import cli\n    from . import layout\n")
    modules = {"moeroute.cli": None, "moeroute.layout": None, "moeroute.config": None}
    assert _imports("moeroute.config", source, modules) == {"moeroute.cli", "moeroute.layout"}


@pytest.mark.skipif(
    shutil.which("lint-imports", path=str(Path(sys.executable).parent)) is None,
    reason="import-linter is not installed (pip install import-linter)",
)
def test_lint_imports_keeps_the_contract():
    done = subprocess.run([str(Path(sys.executable).parent / "lint-imports")], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "1 kept, 0 broken" in done.stdout
