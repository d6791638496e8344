"""One entry to every benchmark script in bench/.

    python -m bench --list                 # every benchmark and what it measures
    python -m bench routing --all-presets  # one benchmark; the arguments after the name are its own
    python -m bench cpu                    # the CPU set (`make bench`), one after the other

Each benchmark runs as its own script in a fresh interpreter (the scripts set up their own
threads and process groups), writes bench/results/<name>.json, and prints its table.
`python -m bench.report` then renders docs/performance.md from the JSON.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
#: Not benchmarks: this entry, the report renderer and the shared helpers.
NOT_BENCHMARKS = {"__init__", "__main__", "report"}
#: What `make bench` runs: the CPU benchmarks of the main environment, quickest first. threads
#: (minutes of fresh processes) and vllm (vLLM's own environment) run on request; the gpu_*
#: scripts need a CUDA device.
CPU_SET = ("routing", "align", "launch_overhead", "layer", "quant", "quant_mxfp4", "eplb", "ep")


def benchmarks() -> dict[str, str]:
    """Benchmark name -> the first line of its script's docstring, sorted by name."""
    found = {}
    for path in sorted(BENCH.glob("*.py")):
        if path.stem in NOT_BENCHMARKS or path.stem.startswith("_"):
            continue
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        found[path.stem] = doc.strip().splitlines()[0] if doc.strip() else ""
    return found


def run(name: str, args: list[str]) -> int:
    """Run bench/<name>.py with ``args`` in this interpreter's environment; its exit status."""
    return subprocess.call([sys.executable, str(BENCH / f"{name}.py"), *args])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    known = benchmarks()
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    if argv[0] == "--list":
        width = max(len(name) for name in known)
        for name, line in known.items():
            print(f"{name.ljust(width)}  {line}{'  [cpu set]' if name in CPU_SET else ''}")
        return 0
    name, args = argv[0], argv[1:]
    if name == "cpu":
        for each in CPU_SET:
            print(f"== python -m bench {each}", flush=True)
            status = run(each, args)
            if status:
                return status
        return 0
    if name not in known:
        print(f"python -m bench: unknown benchmark {name!r}; choose one of: cpu, {', '.join(known)}", file=sys.stderr)
        return 2
    return run(name, args)


if __name__ == "__main__":
    raise SystemExit(main())
