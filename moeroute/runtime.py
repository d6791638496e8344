"""The CPU runtime: where the compiled kernels are cached, and compiling them ahead of use.

The CPU kernels are Numba functions compiled on first use and cached on disk (``cache=True``),
so only the first process on a machine pays for compilation. `warmup` pays it up front, one
kernel family at a time (`warmup_families` lists them): the routing kernels per logits kind,
the dispatch kernels and the float experts per dtype, each on both sides of every
serial/parallel threshold, on small synthetic inputs, so that a later process loads them all
from the cache. The quantized experts' kernels (FP8, MXFP4, INT4) compile on their first use, or
ahead when asked for (``formats=``). The cache lives where Numba puts it: ``NUMBA_CACHE_DIR``
when that is set (read when Numba is imported), else ``__pycache__`` beside the package's
sources when writable, else a per-user directory (`cache_dir` says which). A cached kernel is
stamped with all the sources it can read, not only its own file (`moeroute.routing._cache`),
so an edit to any of them compiles it again.

Data flows one way: this module imports the routing kernels only inside `warmup`, and the
torch module only when torch is installed and asked for.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from moeroute.routing._cache import cache_dir

__all__ = [
    "warmup",
    "warmup_families",
    "warmup_cuda",
    "cache_dir",
    "cpu_dispatchers",
    "WARMUP_DTYPES",
    "DEFAULT_WARMUP_DTYPES",
    "WARMUP_FORMATS",
    "add_warmup_arguments",
    "run_warmup",
    "check_arch",
    "check_cuda_toolchain",
]

#: Activation and logits dtypes `warmup` can compile for: each is its own specialization.
WARMUP_DTYPES = ("float32", "float16", "bfloat16")
#: The dtype compiled by default: float32 (a model built from a config or loaded without a
#: torch_dtype, and DeepSeek's router, which computes its logits in float32 whatever the
#: model's dtype). Each further dtype costs about as much again (select_experts' kernel above
#: all), so bfloat16 and float16 compile on first use, or ahead when asked for.
DEFAULT_WARMUP_DTYPES = ("float32",)
#: Expert weight formats `warmup` can compile for: "float" by default; the quantized formats'
#: kernels compile on first use unless asked for here.
WARMUP_FORMATS = ("float", "fp8_block", "fp8_tensor", "mxfp4", "int4")
#: Rows of the small calls: the serial kernels (decode-sized batches).
SMALL_TOKENS = 3
#: Router and expert sizes of the torch module's warm-up layer: the kernels' compiled
#: code depends on dtypes and array layouts only, so a tiny layer compiles what a real
#: one runs.
MODULE_EXPERTS, MODULE_TOP_K, MODULE_HIDDEN, MODULE_INTERMEDIATE = 8, 2, 256, 32
#: Token counts of the warm-up layer: one row (decode), few rows per expert (the padded
#: batch) and enough rows per expert for the parallel accumulation (see
#: `moeroute.routing.combine.PARALLEL_ACCUMULATE_MIN_ELEMENTS`).
MODULE_TOKENS = (1, 16, 2048)
#: Intermediate size of the quantized warm-up layers: whole 128-blocks (fp8_block's default) and
#: 64-weight steps, so that the kernels compiled are those real layers run (the bfloat16-dot
#: row kernels need whole steps).
QUANT_INTERMEDIATE = 128


def _progress_printer(progress) -> Callable[[str], None]:
    if callable(progress):
        return progress
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be True, False or a callable taking one line (str), got {progress!r}")
    if not progress:
        return lambda line: None

    def emit(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    return emit


def _check_dtypes(dtypes) -> tuple[str, ...]:
    if isinstance(dtypes, str) or not isinstance(dtypes, Iterable):
        raise TypeError(f"dtypes must be a sequence of dtype names from {WARMUP_DTYPES}, got {dtypes!r}")
    dtypes = tuple(dtypes)
    unknown = [d for d in dtypes if d not in WARMUP_DTYPES]
    if unknown or not dtypes:
        raise ValueError(f"dtypes={dtypes!r}: each must be one of {WARMUP_DTYPES}, at least one")
    return dtypes


def _check_formats(formats) -> tuple[str, ...]:
    if isinstance(formats, str) or not isinstance(formats, Iterable):
        raise TypeError(f"formats must be a sequence of format names from {WARMUP_FORMATS}, got {formats!r}")
    formats = tuple(formats)
    unknown = [f for f in formats if f not in WARMUP_FORMATS]
    if unknown:
        raise ValueError(f"formats={formats!r}: {unknown[0]!r} is not a format; each must be one of {WARMUP_FORMATS}")
    return formats


def _check_presets(presets) -> list:
    from moeroute.config import PRESETS

    if presets is None:
        return list(PRESETS.values())
    if isinstance(presets, str) or not isinstance(presets, Iterable):
        raise TypeError(f"presets must be a sequence of preset names, got {presets!r}")
    names = list(presets)
    unknown = [name for name in names if name not in PRESETS]
    if unknown or not names:
        raise ValueError(f"presets={names!r}: each must be one of {sorted(PRESETS)}, at least one")
    return [PRESETS[name] for name in names]


def _host_bits(values: np.ndarray, dtype: str) -> tuple[np.ndarray, bool]:
    """float32 values as the host kernels take ``dtype``: (array, raw_bf16)."""
    if dtype == "bfloat16":
        bits = (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return bits, True
    return values.astype(dtype), False


#: Logits kinds of the routing kernels: float16 and bfloat16 logits both reach select_experts'
#: kernel as 16-bit patterns (one specialization), float32 as themselves.
_LOGITS_KINDS = {"float32": "float32", "float16": "float16/bfloat16", "bfloat16": "float16/bfloat16"}


def _routing_steps(presets, dtypes) -> list[tuple[str, Callable[[], None]]]:
    """One family per logits kind: select_experts on each preset's shapes, below and above its
    serial/parallel threshold, then the id kernels (shared slots, remap, align, sort, load);
    one per dtype: the dispatch kernels (permute, combine, accumulate_rows), serial and
    parallel."""
    from moeroute.layout import ExpertLayout
    from moeroute.routing import (
        align_block_size,
        append_shared_slots,
        expert_load,
        logical_to_physical,
        remap_to_local,
        select_experts,
        sort_by_expert,
    )
    from moeroute.routing.select import PARALLEL_MIN_ELEMENTS

    rng = np.random.default_rng(0)

    def routing(logits_dtype):
        for preset in presets:
            router = preset.router
            num_experts = router.num_experts
            bias = np.zeros(num_experts, np.float32) if preset.has_correction_bias else None
            parallel_tokens = math.ceil(PARALLEL_MIN_ELEMENTS / num_experts) + 1
            logits = rng.standard_normal((SMALL_TOKENS, num_experts)).astype(logits_dtype)
            weights, ids = select_experts(logits, router, bias)
            logits = rng.standard_normal((parallel_tokens, num_experts)).astype(logits_dtype)
            select_experts(logits, router, bias)  # the parallel kernel
            layout = ExpertLayout(num_experts, preset.num_shared_experts)
            gates = np.ones((ids.shape[0], max(1, preset.num_shared_experts)), np.float32)
            for shared_weights in (None, gates[:, 0], gates):
                _, slot_ids = append_shared_slots(weights, ids, layout, 0, shared_weights)
            logical_to_physical(ids, layout)
            expert_map = layout.expert_map(0)
            remap_to_local(slot_ids, expert_map)
            experts = layout.num_physical_experts
            for id_dtype in (np.int32, np.int64):
                typed = slot_ids.astype(id_dtype)
                align_block_size(typed, experts, 64)
                align_block_size(typed, expert_map.shape[0], 64, expert_map)
                sort_by_expert(typed, experts)
                expert_load(typed, experts)

    kinds = {}
    for dtype in dtypes:  # NumPy has no bfloat16: float16 logits compile the 16-bit kernel
        kinds.setdefault(_LOGITS_KINDS[dtype], "float32" if dtype == "float32" else "float16")
    steps = [
        (f"routing kernels, {kind} logits", lambda d=logits_dtype: routing(d)) for kind, logits_dtype in kinds.items()
    ]
    steps += [(f"dispatch kernels, {dtype}", lambda d=dtype: _dispatch_kernels(d)) for dtype in dtypes]
    return steps


def _dispatch_kernels(dtype) -> None:
    """permute, combine (with and without weights) and accumulate_rows for ``dtype``, on a
    small input (their serial kernels) and above each parallel threshold."""
    from moeroute.routing import combine, permute
    from moeroute.routing.combine import (
        PARALLEL_ACCUMULATE_MIN_ELEMENTS,
        PARALLEL_COMBINE_MIN_ELEMENTS,
        accumulate_rows,
    )
    from moeroute.routing.permute import PARALLEL_GATHER_MIN_BYTES

    experts, top_k, width = MODULE_EXPERTS, MODULE_TOP_K, 2 if dtype != "float32" else 4
    for tokens, hidden in ((SMALL_TOKENS, 16), (None, 1024)):
        if tokens is None:
            tokens = (
                max(
                    math.ceil(PARALLEL_GATHER_MIN_BYTES / (top_k * hidden * width)),
                    math.ceil(PARALLEL_COMBINE_MIN_ELEMENTS / hidden),
                )
                + 1
            )
        ids = (np.arange(tokens * top_k, dtype=np.int32) % experts).reshape(tokens, top_k)
        weights = np.full((tokens, top_k), 0.5, np.float32)
        states, raw = _host_bits(np.ones((tokens, hidden), np.float32), dtype)
        permuted, _, inverse = permute(states, ids, experts)
        combine(permuted, inverse, weights, raw_bf16=raw)
        combine(permuted, inverse, None, raw_bf16=raw)
        rows = min(tokens, math.ceil(PARALLEL_ACCUMULATE_MIN_ELEMENTS / hidden) + 1)
        out = np.zeros((rows, hidden), np.float32)
        accumulate_rows(out, states[:rows], np.arange(rows), weights[:rows, 0], raw_bf16=raw)


def _module_steps(dtypes, formats) -> list[tuple[str, Callable[[], None]]]:
    """The torch MoE module's CPU forward: per format and dtype, every GEMM strategy and
    shared mode, on both sides of the serial/parallel thresholds (torch's thread count)."""
    import torch

    from moeroute.bindings.torch import GatedMLP, MoE
    from moeroute.experts.formats.unquantized import ROWS_DTYPES
    from moeroute.config import RouterConfig
    from moeroute.quant import QuantConfig

    hidden, inter = MODULE_HIDDEN, MODULE_INTERMEDIATE
    routers = {
        "softmax": (RouterConfig(MODULE_EXPERTS, MODULE_TOP_K), False),
        "sigmoid + bias, groups": (
            RouterConfig(
                MODULE_EXPERTS,
                MODULE_TOP_K,
                scoring="sigmoid",
                num_expert_group=2,
                topk_group=1,
                routed_scaling_factor=2.5,
            ),
            True,
        ),
    }

    def run(moe, dtype, token_counts, generator):
        # The row kernels depend on the dtype only: their serial forms (one torch thread) and
        # their parallel ones (torch's count).
        threads = torch.get_num_threads()
        try:
            for count in sorted({1, threads}):
                torch.set_num_threads(count)
                for tokens in token_counts:
                    moe(torch.randn(tokens, hidden, generator=generator).to(dtype))
        finally:
            torch.set_num_threads(threads)

    def float_forward(dtype_name):
        dtype = getattr(torch, dtype_name)
        generator = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            for router, bias in routers.values():
                for shared in ("fused", "runner"):
                    for gemm in ("loop", "padded"):
                        moe = MoE(
                            router,
                            hidden,
                            inter,
                            shared_experts=GatedMLP(hidden, inter).to(dtype),
                            shared=shared,
                            correction_bias=bias,
                            gemm=gemm,
                            dtype=dtype,
                        )
                        for tokens in MODULE_TOKENS:
                            moe(torch.randn(tokens, hidden, generator=generator).to(dtype))
            if dtype in ROWS_DTYPES:
                for gemm in ("rows", "auto"):
                    run(
                        MoE(routers["softmax"][0], hidden, inter, gemm=gemm, dtype=dtype),
                        dtype,
                        MODULE_TOKENS[:2],
                        generator,
                    )

    def quantized_forward(quant_format, dtype_name):
        dtype = getattr(torch, dtype_name)
        generator = torch.Generator().manual_seed(0)
        inter_q = QUANT_INTERMEDIATE
        quant = QuantConfig(quant_format)
        # gpt-oss's MXFP4 layers carry expert biases and swigluoai; the FP8 and INT4 ones neither.
        extra = dict(activation="swigluoai", expert_bias=True) if quant_format == "mxfp4" else {}
        with torch.inference_mode():
            for router, bias in routers.values():
                moe = MoE(router, hidden, inter_q, correction_bias=bias, dtype=dtype, quant=quant, **extra)
                run(moe, dtype, MODULE_TOKENS, generator)

    steps = []
    for quant_format in formats:
        for name in dtypes:
            if quant_format == "float":
                steps.append((f"float experts, {name}", lambda n=name: float_forward(n)))
            else:
                steps.append(
                    (f"{quant_format} experts, {name}", lambda f=quant_format, n=name: quantized_forward(f, n))
                )
    return steps


def _steps(presets, dtypes, formats, torch_module) -> list[tuple[str, Callable[[], None]]]:
    steps = _routing_steps(presets, dtypes)
    if torch_module:
        steps += _module_steps(dtypes, formats)
    return steps


def _resolve_torch_module(torch_module, formats) -> bool:
    quantized = any(f != "float" for f in formats)
    if quantized and torch_module is False:
        raise ValueError(
            f"formats={formats!r} asks for the quantized experts' forward, which needs the torch "
            "module: leave torch_module None or True"
        )
    if torch_module is False:
        return False
    # Imported first, as in a model's process (the parallel kernels take torch's thread count).
    try:
        import torch  # noqa: F401
    except ImportError:
        if torch_module or quantized:
            raise
        return False
    return True


def warmup_families(
    presets: Sequence[str] | None = None,
    *,
    dtypes: Sequence[str] = DEFAULT_WARMUP_DTYPES,
    formats: Sequence[str] = ("float",),
    torch_module: bool | None = None,
) -> list[str]:
    """The kernel families `warmup` compiles with these arguments, in its order (one progress
    line each). Arguments and errors as `warmup`'s; nothing is compiled."""
    chosen, dtypes, formats = _check_presets(presets), _check_dtypes(dtypes), _check_formats(formats)
    return [name for name, _ in _steps(chosen, dtypes, formats, _resolve_torch_module(torch_module, formats))]


def warmup(
    presets: Sequence[str] | None = None,
    *,
    dtypes: Sequence[str] = DEFAULT_WARMUP_DTYPES,
    formats: Sequence[str] = ("float",),
    torch_module: bool | None = None,
    progress: bool | Callable[[str], None] = True,
) -> dict:
    """Compile the CPU kernels the presets' forwards use into Numba's on-disk cache.

    One kernel family at a time (`warmup_families` lists them): the routing and dispatch
    kernels, and with torch the `MoE` module's CPU forward, on small preset-shaped inputs,
    so that a first forward of a preset-shaped model in one of ``dtypes`` and ``formats``
    compiles nothing. Cached kernels are loaded, not compiled. What each family covers and
    where the cache lives (``NUMBA_CACHE_DIR``): docs/guide.md, "Cold start and the kernel
    cache".

    Parameters
    ----------
    presets : sequence of str, optional
        Preset names (``moeroute.PRESETS``); default: all of them.
    dtypes : sequence of str
        Among ``WARMUP_DTYPES`` ("float32", "float16", "bfloat16"): the logits and activation
        dtypes to compile for; default ``DEFAULT_WARMUP_DTYPES`` (float32; a bfloat16 model
        wants ``dtypes=("float32", "bfloat16")``: its experts and, unless its router computes
        in float32 as DeepSeek's does, its routing).
    formats : sequence of str
        Among ``WARMUP_FORMATS`` ("float", "fp8_block", "fp8_tensor", "mxfp4", "int4"; int4
        as ``QuantConfig("int4")``: symmetric, groups of 128): the expert formats whose
        forward to compile; default the float experts only. The routing and dispatch kernels
        are compiled whatever the formats (every format routes). Needs torch.
    torch_module : bool, optional
        Also run the torch module's forward (the expert families); default: when torch is
        importable.
    progress : bool or callable
        True (default): one line per family, with its seconds and the functions it compiled,
        and a summary line, printed to stderr as they finish (a cold family takes seconds to
        minutes). A callable is called with each line (a str) instead, e.g. ``logging.info``;
        False: silent.

    Returns
    -------
    dict
        ``compiled`` (moeroute functions compiled now), ``loaded`` (functions loaded from the
        cache), ``seconds``, ``steps`` (the number of families), ``families`` (one dict per
        family: ``name``, ``seconds``, ``compiled``) and ``cache_dir``.

    Raises
    ------
    ValueError
        An unknown preset, dtype or format (naming the allowed ones), an empty list of presets
        or dtypes, or a quantized format with ``torch_module=False``.
    TypeError
        ``presets``, ``dtypes`` or ``formats`` not a sequence of names (a bare string is
        refused); ``progress`` neither a bool nor a callable.
    """
    from numba.core import event

    chosen = _check_presets(presets)
    dtypes = _check_dtypes(dtypes)
    formats = _check_formats(formats)
    emit = _progress_printer(progress)
    steps = _steps(chosen, dtypes, formats, _resolve_torch_module(torch_module, formats))

    compiled = 0

    class _CountCompiles(event.Listener):
        def on_start(self, _event):
            pass

        def on_end(self, event_):
            nonlocal compiled
            # Numba's own helpers (e.g. carray for the cfuncs) are not moeroute's kernels.
            compiled += event_.data["dispatcher"].py_func.__module__.startswith("moeroute")

    before = _cache_hits()
    listener = _CountCompiles()
    families = []
    start = time.perf_counter()
    with event.install_listener("numba:compile", listener):
        for index, (name, step) in enumerate(steps, 1):
            step_start, compiled_before = time.perf_counter(), compiled
            step()
            family = {"name": name, "seconds": time.perf_counter() - step_start, "compiled": compiled - compiled_before}
            families.append(family)
            emit(
                f"warmup [{index}/{len(steps)}] {name}: {family['seconds']:.1f} s, "
                f"{family['compiled']} functions compiled"
            )
    seconds = time.perf_counter() - start
    result = {
        "compiled": compiled,
        "loaded": _cache_hits() - before,
        "seconds": seconds,
        "steps": len(steps),
        "families": families,
        "cache_dir": cache_dir(),
    }
    emit(
        f"warmup done in {seconds:.1f} s: {result['compiled']} functions compiled, "
        f"{result['loaded']} loaded from {result['cache_dir']}"
    )
    return result


def warmup_cuda(
    presets: Sequence[str] | None = None,
    *,
    archs: Sequence[str] = ("sm_90",),
    dtypes: Sequence[str] = WARMUP_DTYPES,
    progress: bool = True,
) -> dict:
    """Compile the device routing kernels of the presets into the cubin cache, no GPU needed.

    select_experts' and the fused route's kernels (the slow ones to compile: seconds each)
    for each preset, logits dtype and architecture, as the cached launcher will ask for them
    (`moeroute.routing._cubins`): a later process on a GPU of that architecture loads them
    instead of compiling. Already cached kernels are loaded, not compiled. The other ops'
    kernels compile in a fraction of a second on first use and are cached then.

    Parameters
    ----------
    presets : sequence of str, optional
        Preset names; default: all of them.
    archs : sequence of str
        Target architectures, "sm_XY" (e.g. "sm_90" for H100/H200, "sm_80" for A100).
    dtypes : sequence of str
        Logits dtypes among ``WARMUP_DTYPES``.
    progress : bool
        Print one line per preset and architecture to stderr.

    Returns
    -------
    dict
        ``compiled``, ``loaded`` (kernels), ``seconds``, ``cache_dir`` (None when the cubin
        cache is off: then nothing is kept and this only checks that the kernels compile).

    Raises
    ------
    ValueError
        An unknown preset or dtype, an architecture not of the form "sm_XY".
    RuntimeError
        numba-cuda or cuda.core (nvJitLink) is not installed.
    """
    chosen = _check_presets(presets)
    dtypes = _check_dtypes(dtypes)
    if isinstance(archs, str) or not archs:
        raise ValueError(f"archs must be a non-empty sequence like ['sm_90'], got {archs!r}")
    for arch in archs:
        check_arch(arch)
    check_cuda_toolchain()
    from moeroute.routing import _cubins, _launcher
    from moeroute.routing.route import _route_kernel, _route_signature
    from moeroute.routing.select import _device

    emit = _progress_printer(progress)
    compiled = 0

    def compile_counted(dispatcher, signature, arch):
        nonlocal compiled
        compiled += 1
        return _launcher.compile_image(dispatcher, signature, arch)

    total = 0
    start = time.perf_counter()
    for arch in archs:
        for preset in chosen:
            step_start = time.perf_counter()
            router = preset.router
            constants = (
                router.num_experts,
                router.num_expert_group,
                router.scoring,
                preset.has_correction_bias,
                router.renormalize,
            )
            for kind in dtypes:
                for kernel, signature in (
                    (_device._device_kernel(*constants, kind), _device._device_signature(kind)),
                    (_route_kernel(*constants, kind), _route_signature(kind, "C", "C")),
                ):
                    _cubins.load_or_compile(kernel, signature, arch, compile_counted)
                    total += 1
            emit(f"warmup_cuda {arch} {preset.name}: {time.perf_counter() - step_start:.1f} s")
    directory = _cubins.cache_dir()
    result = {
        "compiled": compiled,
        "loaded": total - compiled,
        "seconds": time.perf_counter() - start,
        "cache_dir": None if directory is None else str(directory),
    }
    emit(
        f"warmup_cuda done in {result['seconds']:.1f} s: {compiled} kernels compiled, "
        f"{result['loaded']} loaded from {result['cache_dir']}"
    )
    return result


def check_arch(arch) -> str:
    """``arch`` when it names a CUDA architecture as "sm_XY" (or "sm_XYZ"), e.g. "sm_90";
    ValueError otherwise (``sm90``, ``90`` and ``sm9`` are refused, not guessed at)."""
    import re

    if not isinstance(arch, str) or not re.fullmatch(r"sm_\d{2,3}", arch):
        raise ValueError(f"arch {arch!r} is not of the form 'sm_XY' (e.g. 'sm_90' for H100/H200, 'sm_80' for A100)")
    return arch


def check_cuda_toolchain() -> None:
    """RuntimeError naming what is missing when the device kernels cannot be compiled here
    (numba-cuda and cuda.core's nvJitLink; no GPU needed)."""
    try:
        import cuda.core  # noqa: F401
        from numba import cuda  # noqa: F401
    except ImportError as error:
        raise RuntimeError(
            f"compiling the device kernels needs numba-cuda and cuda.core (pip install 'moeroute[cuda]'): {error}"
        ) from error


def _cache_hits() -> int:
    """Cache loads so far of moeroute's CPU kernels (their dispatchers' own counters)."""
    return sum(sum(dispatcher.stats.cache_hits.values()) for dispatcher in cpu_dispatchers())


def cpu_dispatchers() -> list:
    """Every Numba CPU dispatcher defined in moeroute's routing modules and their
    subpackages (imports them)."""
    import importlib
    import pkgutil

    from numba.core.registry import CPUDispatcher

    import moeroute.routing as routing

    found = {}
    for info in pkgutil.walk_packages(routing.__path__, prefix="moeroute.routing."):
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if isinstance(value, CPUDispatcher) and value.py_func.__module__ == module.__name__:
                found[id(value)] = value
    return list(found.values())


def add_warmup_arguments(parser) -> None:
    """Arguments of ``moeroute warmup``."""
    from moeroute.config import PRESETS

    parser.add_argument(
        "--presets", nargs="+", choices=sorted(PRESETS), metavar="PRESET", help="presets to compile for (default: all)"
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        choices=WARMUP_DTYPES,
        default=list(DEFAULT_WARMUP_DTYPES),
        help=f"logits and activation dtypes (default: {' '.join(DEFAULT_WARMUP_DTYPES)})",
    )
    parser.add_argument(
        "--formats",
        nargs="+",
        choices=WARMUP_FORMATS,
        default=["float"],
        metavar="FORMAT",
        help=f"expert formats to compile, among {', '.join(WARMUP_FORMATS)} (default: float; "
        "the quantized ones otherwise compile on first use)",
    )
    parser.add_argument(
        "--no-torch", action="store_true", help="skip the torch module's forward (routing kernels only)"
    )
    parser.add_argument(
        "--cuda-arch",
        nargs="+",
        metavar="ARCH",
        default=None,
        type=_arch_argument,
        help="also compile the device routing kernels for these architectures "
        "(e.g. sm_90) into the cubin cache; no GPU needed",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines (one per kernel family, on stderr)")


def _arch_argument(text: str) -> str:
    import argparse

    try:
        return check_arch(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def run_warmup(args) -> int:
    """``moeroute warmup``: compile, then print what was compiled and where it is cached.
    Everything asked for is checked before any work (exit status 2 and one line)."""
    if args.cuda_arch:
        try:
            check_cuda_toolchain()
        except RuntimeError as error:
            print(f"moeroute warmup: error: {error}", file=sys.stderr)
            return 2
    if args.no_torch and set(args.formats) - {"float"}:
        print(
            "moeroute warmup: error: --formats with a quantized format needs the torch module's forward; "
            "drop --no-torch",
            file=sys.stderr,
        )
        return 2
    result = warmup(
        args.presets,
        dtypes=args.dtypes,
        formats=args.formats,
        torch_module=False if args.no_torch else None,
        progress=not args.quiet,
    )
    print(
        f"{result['compiled']} functions compiled, {result['loaded']} loaded from the cache, "
        f"in {result['seconds']:.1f} s; cache: {result['cache_dir']}"
    )
    if args.cuda_arch:
        result = warmup_cuda(args.presets, archs=args.cuda_arch, dtypes=args.dtypes, progress=not args.quiet)
        print(
            f"{result['compiled']} device kernels compiled, {result['loaded']} loaded, in "
            f"{result['seconds']:.1f} s; cubin cache: {result['cache_dir']}"
        )
    return 0
