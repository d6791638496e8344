"""The CPU instruction-set path of moeroute's Numba kernels, decided once per process.

Routing and the expert compute read the same answer (`cpu_isa`). The paths, lowest first:

* ``"generic"``: portable Numba code and LLVM's generic vector operations, no x86
  intrinsic; correct on any CPU Numba supports.
* ``"avx2"``: AVX2, FMA and F16C (the x86-64-v3 level): the MXFP4 block dot in vector code.
* ``"avx512"``: AVX-512 F, BW, CD, DQ and VL (x86-64-v4): routing's candidate compress in
  one instruction (``vpcompressd``).
* ``"avx512bf16"``: AVX-512 plus BF16 and VBMI: the bfloat16 dot-product kernels of the
  bfloat16, FP8 and MXFP4 experts (``vdpbf16ps``; ``vpermi2b`` decodes e4m3 bytes).

By default the highest path that both the host CPU and Numba's CPU target have. Numba
compiles for ``numba.config.CPU_NAME`` (the host's when unset) with ``CPU_FEATURES`` (the
host's whole feature list when unset, which then decides whatever the name); a path is
only taken when that target has its features, as an intrinsic the target lacks fails to
compile. ``MOEROUTE_CPU_ISA=generic|avx2|avx512|avx512bf16`` picks a path instead, so that
one machine runs every path it can (a value the CPU cannot run is refused, naming the
variable). A lower path than the CPU's also lowers Numba's own code generation to that
level (`NUMBA_CPU_NAMES`), so that nothing above the path is emitted anywhere; Numba's
cache keeps the kernels of each target apart (its index key holds the target CPU and
features).

This module must be imported before Numba's CPU target exists (the first ``@njit``
function of the process creates it); ``import moeroute`` does so first.
"""

from __future__ import annotations

import os

import numba
from llvmlite import binding as llvm_binding

__all__ = [
    "ENVIRONMENT_VARIABLE",
    "ISA_PATHS",
    "PATH_FEATURES",
    "NUMBA_CPU_NAMES",
    "cpu_isa",
    "supported_isas",
    "choose_isa",
    "host_features",
    "numba_target_features",
    "FEATURES",
    "BF16_DOT",
    "AVX2_SIMD",
    "VECTOR_COMPRESS",
    "BFLOAT16_INSTRUCTIONS",
]

#: The environment variable that picks a path.
ENVIRONMENT_VARIABLE = "MOEROUTE_CPU_ISA"
#: The instruction-set paths, lowest first; each needs the features of the ones below it.
ISA_PATHS = ("generic", "avx2", "avx512", "avx512bf16")

# The x86-64 psABI levels, in LLVM's feature names: what Numba may emit when it compiles
# for the level's CPU name, so a CPU must have all of it to be lowered to that level.
_X86_64_V3 = frozenset({"avx", "avx2", "bmi", "bmi2", "f16c", "fma", "lzcnt", "movbe"})
_X86_64_V4 = _X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}

#: The CPU features (LLVM's names) each path needs.
PATH_FEATURES = {
    "generic": frozenset(),
    "avx2": _X86_64_V3,
    "avx512": _X86_64_V4,
    "avx512bf16": _X86_64_V4 | {"avx512bf16", "avx512vbmi"},
}
#: Numba's target CPU (with an empty feature list) when the path is below the CPU's own:
#: LLVM's name of the level, so that Numba's code uses nothing above the path.
NUMBA_CPU_NAMES = {"generic": "generic", "avx2": "x86-64-v3", "avx512": "x86-64-v4"}
#: The features each of those names gives Numba's target.
_NAMED_CPU_FEATURES = {"generic": frozenset(), "x86-64-v3": _X86_64_V3, "x86-64-v4": _X86_64_V4}


def host_features() -> frozenset[str]:
    """The features (LLVM's names, e.g. ``"avx2"``) the host CPU has, as llvmlite reports them."""
    return frozenset(name for name, present in llvm_binding.get_host_cpu_features().items() if present)


def numba_target_features(host: frozenset[str], cpu_name: str | None, cpu_features: str | None) -> frozenset[str]:
    """The features of ``host`` that Numba's CPU target compiles with, given
    ``numba.config.CPU_NAME`` (``cpu_name``) and ``numba.config.CPU_FEATURES`` (``cpu_features``,
    LLVM's ``"+name,-name"`` list).

    Without a feature list Numba passes the host's whole list, which decides whatever the
    name. With one, it is added to what the name implies: the host's own for no name or
    ``"host"``, the level's for `NUMBA_CPU_NAMES`' names, nothing known for other names.
    """
    if cpu_features is None:
        return frozenset(host)
    enabled, disabled = set(), set()
    for entry in cpu_features.split(","):
        entry = entry.strip()
        if entry[:1] == "+":
            enabled.add(entry[1:])
        elif entry[:1] == "-":
            disabled.add(entry[1:])
    implied = host if cpu_name in (None, "host") else _NAMED_CPU_FEATURES.get(cpu_name, frozenset())
    return frozenset(((implied | enabled) - disabled) & host)


def supported_isas(features: frozenset[str] | None = None) -> tuple[str, ...]:
    """The paths a CPU with ``features`` runs, lowest first (default: this process's CPU and
    Numba target, as found before any override)."""
    features = _TARGET_FEATURES if features is None else frozenset(features)
    return tuple(path for path in ISA_PATHS if PATH_FEATURES[path] <= features)


def choose_isa(requested: str | None, features: frozenset[str]) -> str:
    """The path to take on a CPU with ``features``: ``requested`` (the value of
    ``MOEROUTE_CPU_ISA``; None or empty: the highest path the CPU runs).

    ValueError naming the variable for a value that is not a path (with the paths) or a
    path the CPU cannot run (with its missing features and the paths it runs).
    """
    supported = supported_isas(features)
    if requested is None or not requested.strip():
        return supported[-1]
    path = requested.strip().lower()
    if path not in ISA_PATHS:
        raise ValueError(
            f"{ENVIRONMENT_VARIABLE}={requested!r} is not an instruction-set path; use one of "
            f"{', '.join(ISA_PATHS)} (this CPU runs {', '.join(supported)}), or leave it unset "
            "for the highest one"
        )
    if path not in supported:
        missing = ", ".join(sorted(PATH_FEATURES[path] - frozenset(features)))
        raise ValueError(
            f"{ENVIRONMENT_VARIABLE}={requested!r} is a path this CPU cannot run ({_lacking(missing)}); "
            f"use one of {', '.join(supported)}"
        )
    return path


def _lacking(missing: str) -> str:
    config = numba.config
    if config.CPU_NAME in (None, "host") and config.CPU_FEATURES is None:
        return f"it lacks {missing}"
    return (
        f"Numba's target, NUMBA_CPU_NAME={config.CPU_NAME!r} with NUMBA_CPU_FEATURES={config.CPU_FEATURES!r}, "
        f"lacks {missing}"
    )


def cpu_isa() -> str:
    """The instruction-set path moeroute's CPU kernels take in this process: one of
    `ISA_PATHS` ("generic", "avx2", "avx512" or "avx512bf16")."""
    return _ISA


def _lower_numba_target(path: str) -> None:
    """Make Numba compile for ``path``'s level: its CPU name with no further features (a name
    alone keeps the host's whole feature list)."""
    from numba.core.registry import cpu_target

    name = NUMBA_CPU_NAMES[path]
    # The CPU target context (created with the process's first @njit function) builds its
    # LLVM target machine from the config once; a later change would not reach it.
    if "_toplevel_target_context" in vars(cpu_target):
        raise RuntimeError(
            f"{ENVIRONMENT_VARIABLE}={path!r} needs Numba to compile for {name!r}, but Numba's CPU "
            "target was created before moeroute was imported (a @njit function was defined "
            f"first): import moeroute first, or set NUMBA_CPU_NAME={name} and "
            "NUMBA_CPU_FEATURES='' as well"
        )
    numba.config.CPU_NAME = name
    numba.config.CPU_FEATURES = ""
    cpu_target.target_context  # noqa: B018 -- built now, on this config, not at the first @njit


_HOST_FEATURES = host_features()
_TARGET_FEATURES = numba_target_features(_HOST_FEATURES, numba.config.CPU_NAME, numba.config.CPU_FEATURES)
_ISA = choose_isa(os.environ.get(ENVIRONMENT_VARIABLE), _TARGET_FEATURES)
if _ISA != supported_isas()[-1]:
    _lower_numba_target(_ISA)

#: The CPU features the kernels may use: Numba's target's on the CPU's own path, the path's
#: own on a lower one.
FEATURES = _TARGET_FEATURES if _ISA == supported_isas()[-1] else PATH_FEATURES[_ISA]
#: The bfloat16 dot-product kernels (``vdpbf16ps``) run.
BF16_DOT = _ISA == "avx512bf16"
#: The MXFP4 block dot runs as AVX2 vector code (else a portable loop).
AVX2_SIMD = _ISA != "generic"
#: Routing compresses candidates with AVX-512's vector compress (else a table of positions).
VECTOR_COMPRESS = _ISA in ("avx512", "avx512bf16")
#: The CPU multiplies bfloat16 natively (AVX512-BF16 or AMX), as oneDNN's GEMMs then do.
BFLOAT16_INSTRUCTIONS = bool(FEATURES & {"avx512bf16", "amx-bf16"})
