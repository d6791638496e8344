"""Generate the HIP variants of the CUDA kernels: moeroute/gpu/kernels/<name>.cu -> <name>.hip.

    python tools/hipify_kernels.py           # write the .hip files
    python tools/hipify_kernels.py --check   # exit 1 if a committed .hip file is out of date

torch.utils.hipify maps CUDA API names, headers and math calls to their HIP spellings. What it
does not map (warp size, the 16-bit types, the sm_80 matrix instructions, which AMD builds leave
out) lives in kernels/compat.cuh, which both variants include, so the kernels need no hand edits.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent.parent / "moeroute" / "gpu" / "kernels"

BANNER = (
    "// Generated from {name}.cu by tools/hipify_kernels.py (torch.utils.hipify name mapping);\n"
    "// do not edit: change {name}.cu and rerun the script.\n"
)


def hipify_source(source: str, name: str) -> str:
    """The HIP variant of the CUDA source ``source`` of kernel file ``name`` (without suffix)."""
    from torch.utils.hipify import hipify_python

    def api_name(match):
        return hipify_python.PYTORCH_MAP[match.group(0)]

    hip = hipify_python.RE_PYTORCH_PREPROCESSOR.sub(api_name, source)
    hip = hipify_python.replace_math_functions(hip)
    # No hip_header_magic: compat.cuh includes hip_runtime.h where the compiler needs it
    # (hipcc) and leaves it out where it is implicit (hiprtc).
    return BANNER.format(name=name) + hip


def generated_files(kernel_dir: Path = KERNEL_DIR) -> dict[Path, str]:
    """Map of each .hip path to the text it should hold."""
    return {cu.with_suffix(".hip"): hipify_source(cu.read_text(), cu.stem) for cu in sorted(kernel_dir.glob("*.cu"))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale .hip files")
    args = parser.parse_args(argv)
    stale = []
    for path, text in generated_files().items():
        if path.exists() and path.read_text() == text:
            continue
        stale.append(path)
        if not args.check:
            path.write_text(text)
    for path in stale:
        print(("stale: " if args.check else "wrote: ") + str(path))
    return 1 if (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
