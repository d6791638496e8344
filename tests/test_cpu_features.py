"""moeroute.cpu_features: the instruction-set path, its override and what each path runs.

The override's parsing and refusals run on made-up feature sets. Every path below this
CPU's own runs in a fresh process with MOEROUTE_CPU_ISA set (the path is decided, and
Numba's target lowered, before the first kernel is defined): there it must report the
path, compile for its level, and route and run MXFP4 experts to the references' values.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moeroute
from moeroute import cpu_features
from moeroute.experts.choose import BF16_ROWS_MAX_MEAN_ROWS, ROWS_MAX_MEAN_ROWS, rows_bound
from moeroute.cpu_features import ENVIRONMENT_VARIABLE, ISA_PATHS, PATH_FEATURES, choose_isa, supported_isas
from moeroute.experts.cpu import mxfp4 as cpu_mxfp4
from moeroute.experts.cpu import dot as cpu_dot
from moeroute.routing.select import _simd

ROOT = Path(__file__).resolve().parents[1]

#: A CPU of each level, in LLVM's feature names.
SSE_ONLY = frozenset({"sse", "sse2", "sse3", "ssse3", "sse4.1", "sse4.2", "popcnt"})
HASWELL = SSE_ONLY | PATH_FEATURES["avx2"]
SKYLAKE_X = HASWELL | PATH_FEATURES["avx512"]
#: AVX512-BF16 without VBMI: its e4m3 decode (vpermi2b) would not compile.
COOPER_LAKE = SKYLAKE_X | {"avx512bf16", "avx512vnni"}
ZEN4 = SKYLAKE_X | PATH_FEATURES["avx512bf16"] | {"avx512vnni", "avx512vbmi2"}
NEOVERSE = frozenset({"neon", "fp-armv8", "crc", "sve"})


@pytest.mark.parametrize(
    "features, supported",
    [
        (NEOVERSE, ("generic",)),
        (SSE_ONLY, ("generic",)),
        (HASWELL - {"f16c"}, ("generic",)),
        (HASWELL, ("generic", "avx2")),
        (SKYLAKE_X, ("generic", "avx2", "avx512")),
        (COOPER_LAKE, ("generic", "avx2", "avx512")),
        (ZEN4, ISA_PATHS),
    ],
)
def test_supported_paths_and_default(features, supported):
    assert supported_isas(features) == supported
    assert choose_isa(None, features) == supported[-1]
    assert choose_isa("", features) == supported[-1]
    for path in supported:
        assert choose_isa(path, features) == path
        assert choose_isa(f" {path.upper()} ", features) == path


def test_a_path_the_cpu_cannot_run_is_refused_naming_the_variable_and_the_paths():
    with pytest.raises(ValueError) as error:
        choose_isa("avx512bf16", COOPER_LAKE)
    message = str(error.value)
    assert message.startswith(f"{ENVIRONMENT_VARIABLE}='avx512bf16' is a path this CPU cannot run")
    assert "lacks avx512vbmi)" in message and message.endswith("use one of generic, avx2, avx512")
    with pytest.raises(ValueError, match=r"MOEROUTE_CPU_ISA='avx2' .* lacks .*avx2.*use one of generic$"):
        choose_isa("avx2", NEOVERSE)


@pytest.mark.parametrize("value", ["avx512_bf16", "sse", "neon", "host", "1"])
def test_an_unknown_value_is_refused_naming_the_paths(value):
    with pytest.raises(ValueError) as error:
        choose_isa(value, HASWELL)
    assert str(error.value) == (
        f"MOEROUTE_CPU_ISA={value!r} is not an instruction-set path; use one of generic, "
        "avx2, avx512, avx512bf16 (this CPU runs generic, avx2), or leave it unset for "
        "the highest one"
    )


@pytest.mark.parametrize(
    "cpu_name, cpu_features_list, expected",
    [
        (None, None, ZEN4),
        ("host", None, ZEN4),
        ("znver2", None, ZEN4),  # without a feature list Numba passes the host's whole list
        (None, "-avx512bf16", ZEN4 - {"avx512bf16"}),
        ("host", "+amx-bf16,-avx512f", ZEN4 - {"avx512f"}),  # a feature the host lacks stays off
        ("generic", "", frozenset()),
        ("x86-64-v3", "", PATH_FEATURES["avx2"]),
        ("x86-64-v4", "+avx512bf16", PATH_FEATURES["avx512"] | {"avx512bf16"}),
        ("skylake", "", frozenset()),  # a name whose features are not known here: none assumed
    ],
)
def test_numba_target_features(cpu_name, cpu_features_list, expected):
    assert cpu_features.numba_target_features(ZEN4, cpu_name, cpu_features_list) == expected


def test_the_process_path_and_the_kernels_flags():
    path = moeroute.cpu_isa()
    assert "cpu_isa" in moeroute.__all__
    assert path in ISA_PATHS
    assert os.environ.get(ENVIRONMENT_VARIABLE, "").strip().lower() in ("", path)
    target = cpu_features.numba_target_features(cpu_features.host_features(), None, None)
    if (
        not os.environ.get(ENVIRONMENT_VARIABLE)
        and os.environ.get("NUMBA_CPU_NAME") is None
        and os.environ.get("NUMBA_CPU_FEATURES") is None
    ):
        assert path == supported_isas(target)[-1]
    assert cpu_dot.BF16_DOT is cpu_features.BF16_DOT is (path == "avx512bf16")
    assert cpu_mxfp4.SIMD is cpu_features.AVX2_SIMD is (path != "generic")
    assert _simd.VECTOR_COMPRESS is cpu_features.VECTOR_COMPRESS is (path in ("avx512", "avx512bf16"))
    bf16_units = bool({"avx512bf16", "amx-bf16"} & cpu_features.FEATURES)
    assert rows_bound(torch.bfloat16) == (BF16_ROWS_MAX_MEAN_ROWS if bf16_units else math.inf)
    assert rows_bound(torch.float32) == ROWS_MAX_MEAN_ROWS


def _python(code, **environment):
    """Run ``code`` in a fresh interpreter at the repository root with ``environment`` added
    (None removes a variable); its CompletedProcess."""
    env = dict(os.environ)
    for name, value in environment.items():
        env.pop(name, None)
        if value is not None:
            env[name] = value
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


FLAGS = (
    "import json, moeroute; from moeroute.experts.cpu import dot as cpu_dot, mxfp4 as cpu_mxfp4; from moeroute.routing.select "
    "import _simd; print(json.dumps([moeroute.cpu_isa(), cpu_dot.BF16_DOT, cpu_mxfp4.SIMD, "
    "_simd.VECTOR_COMPRESS]))"
)


def test_numba_compiling_for_a_generic_cpu_gives_routing_and_experts_the_generic_path():
    # Routing once asked the host alone and took AVX-512's compress under NUMBA_CPU_NAME=generic.
    result = _python(FLAGS, NUMBA_CPU_NAME="generic", NUMBA_CPU_FEATURES=None, MOEROUTE_CPU_ISA=None)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.splitlines()[-1]) == ["generic", False, False, False]
    result = _python("import moeroute", NUMBA_CPU_NAME="generic", NUMBA_CPU_FEATURES=None, MOEROUTE_CPU_ISA="avx2")
    assert result.returncode != 0
    assert (
        "ValueError: MOEROUTE_CPU_ISA='avx2' is a path this CPU cannot run (Numba's target, "
        "NUMBA_CPU_NAME='generic' with NUMBA_CPU_FEATURES='', lacks avx, avx2"
    ) in result.stderr


def test_a_lower_path_is_refused_once_numba_has_built_its_cpu_target():
    if len(supported_isas()) < 2:
        pytest.skip("this CPU runs the generic path only: there is nothing to lower")
    code = "import numba\n@numba.njit\ndef one():\n    return 1\nimport moeroute"
    result = _python(code, MOEROUTE_CPU_ISA="generic", NUMBA_CPU_NAME=None, NUMBA_CPU_FEATURES=None)
    assert result.returncode != 0
    assert (
        "RuntimeError: MOEROUTE_CPU_ISA='generic' needs Numba to compile for 'generic', but Numba's CPU "
        "target was created before moeroute was imported"
    ) in result.stderr


# One process on one path: what it reports, the level Numba compiles for, the registers of a
# small loop, select_experts against the reference, and MXFP4 experts against float64 on the
# dequantized weights (float32 and bfloat16 activations, one thread: the serial kernels).
PATH_CHECK = r"""
import json, sys
sys.path.insert(0, "tests")
import numba
import numpy as np
import torch
import moeroute
from helpers.reference import dense_experts, dequantize_mxfp4, randn, rel_error
from moeroute import cpu_features
from moeroute.experts.choose import rows_bound
from moeroute.experts.formats.mxfp4 import mxfp4_experts_forward
from moeroute.config import RouterConfig
from moeroute.quant import quantize_mxfp4
from moeroute.experts.cpu import mxfp4 as cpu_mxfp4
from moeroute.experts.cpu import dot as cpu_dot
from moeroute.experts.cpu import int4_dot
from moeroute.routing import reference
from moeroute.routing.select import _simd
from numba.core.registry import cpu_target

torch.set_num_threads(1)
facts = {"isa": moeroute.cpu_isa(), "supported": cpu_features.supported_isas(), "bf16_dot": cpu_dot.BF16_DOT,
         "simd": cpu_mxfp4.SIMD, "int4_fma_tile": int4_dot.FMA_TILE, "vector_compress": _simd.VECTOR_COMPRESS,
         "rows_bound_bf16": rows_bound(torch.bfloat16),
         "numba_target": list(cpu_target.target_context.codegen().magic_tuple()[1:])}

@numba.njit(fastmath=True)
def dot(x, y):
    total = np.float32(0)
    for i in range(x.shape[0]):
        total += x[i] * y[i]
    return total

ones = np.ones(4096, np.float32)
assert dot(ones, ones) == 4096
asm = "".join(dot.inspect_asm().values())
facts["registers"] = [name for name in ("xmm", "ymm", "zmm") if f"%{name}" in asm]

rng = np.random.default_rng(0)
router = RouterConfig(64, 6, "sigmoid", num_expert_group=8, topk_group=3, renormalize=True,
                      routed_scaling_factor=2.5)
logits = rng.standard_normal((5, 64)).astype(np.float32)
bias = rng.standard_normal(64).astype(np.float32) * np.float32(0.1)
topk_weights, topk_ids = moeroute.select_experts(logits, router, bias)
expected_weights, expected_ids = reference.select_experts(logits, router, bias)
facts["ids_equal"] = bool(np.array_equal(topk_ids, expected_ids))
facts["weights_error"] = float(np.abs(topk_weights - expected_weights).max())

H, I, E, T = 64, 64, 4, 3
w_gate_up, w_down = randn(E, 2 * I, H, seed=1, scale=0.1), randn(E, H, I, seed=2, scale=0.1)
(gu_blocks, gu_scales), (d_blocks, d_scales) = quantize_mxfp4(w_gate_up), quantize_mxfp4(w_down)
ids = torch.tensor([[0, 2], [3, 1], [2, 3]], dtype=torch.int32)
weights = torch.tensor([[0.75, 0.25], [0.5, 0.5], [0.125, 0.875]])
for dtype in (torch.float32, torch.bfloat16):
    x = randn(T, H, seed=3).to(dtype)
    out = mxfp4_experts_forward(x, weights, ids, gu_blocks, gu_scales, d_blocks, d_scales, strategy="rows")
    expected = dense_experts(x, weights, ids, dequantize_mxfp4(gu_blocks, gu_scales),
                             dequantize_mxfp4(d_blocks, d_scales))
    facts[f"mxfp4_{str(dtype).removeprefix('torch.')}_error"] = rel_error(out, expected)

from moeroute.experts.formats.fp8 import fp8_experts_forward
from moeroute.quant import QuantConfig, quantize_experts
from moeroute.quant.reference import moe_experts_reference
w8a16 = QuantConfig("fp8_block", block_size=(64, 64), activation="none")
fp8_tensors = quantize_experts(w_gate_up, w_down, w8a16)
for dtype in (torch.float32, torch.bfloat16):
    x = randn(T, H, seed=3).to(dtype)
    out = fp8_experts_forward(x, weights, ids, *fp8_tensors, w8a16, strategy="rows")
    expected = moe_experts_reference(x, weights, ids.long(), *fp8_tensors, (64, 64), intermediate_dtype=dtype,
                                     quantize_activations=False)
    facts[f"w8a16_{str(dtype).removeprefix('torch.')}_error"] = rel_error(out, expected)

from moeroute.experts.formats.int4 import int4_experts_forward
from moeroute.quant import quantize_int4
from moeroute.quant.reference import int4_moe_experts_reference
int4_weights = [quantize_int4(w, group_size=64, symmetric=False) for w in (w_gate_up, w_down)]
x = randn(T, H, seed=3)
out = int4_experts_forward(x, weights, ids, *int4_weights, 64, strategy="rows")
expected = int4_moe_experts_reference(x, weights, ids.long(), *int4_weights, 64)
facts["int4_float32_error"] = rel_error(out, expected)
# The feature matrix's Numba strategies on this path (tests/helpers/feature_matrix.py).
from helpers import feature_matrix
cases = feature_matrix.run(strategies=feature_matrix.NUMBA_STRATEGIES)
facts["matrix_cases"] = len(cases)
facts["matrix_failures"] = [f"{c.name}: {c.error:.2e} > {c.bound:.0e}" for c in cases if not c.error <= c.bound]
print(json.dumps(facts))
"""

#: MXFP4 experts' tolerance (max abs diff / max abs reference) by activation dtype, as
#: tests/quant/test_mxfp4_moe.py: float32 sums, and bfloat16 activations and intermediate.
MXFP4_RTOL = {"float32": 1e-4, "bfloat16": 2e-2}


@pytest.mark.slow
@pytest.mark.parametrize("path", ISA_PATHS[:-1])
def test_a_lower_path_runs_on_its_own_level(path):
    if path not in supported_isas() or path == supported_isas()[-1]:
        pytest.skip(f"this CPU runs {', '.join(supported_isas())}; {path!r} is not below its own path")
    result = _python(PATH_CHECK, MOEROUTE_CPU_ISA=path)
    assert result.returncode == 0, result.stderr[-3000:]
    facts = json.loads(result.stdout.splitlines()[-1])
    assert facts["isa"] == path
    assert tuple(facts["supported"]) == supported_isas()
    assert facts["bf16_dot"] is False
    assert facts["simd"] is (path != "generic")
    # INT4's FMA tile, which the feature matrix's bfloat16 decode rows run on this path
    assert facts["int4_fma_tile"] is (path != "generic")
    assert facts["vector_compress"] is (path == "avx512")
    assert facts["rows_bound_bf16"] == math.inf  # the path has no bfloat16 dot instructions
    assert facts["numba_target"] == [cpu_features.NUMBA_CPU_NAMES[path], ""]
    allowed = {"generic": {"xmm"}, "avx2": {"xmm", "ymm"}, "avx512": {"xmm", "ymm", "zmm"}}[path]
    assert set(facts["registers"]) <= allowed
    assert facts["ids_equal"]
    assert facts["weights_error"] <= 1e-6
    for dtype, tolerance in MXFP4_RTOL.items():
        assert facts[f"mxfp4_{dtype}_error"] < tolerance, dtype
    for dtype in ("float32", "bfloat16"):  # FP8 w8a16 on the path's float32 row kernels
        assert facts[f"w8a16_{dtype}_error"] < 5e-3, dtype
    assert facts["int4_float32_error"] < 1e-5  # INT4 on the MXFP4 rows kernels, this path's decode
    # every format x Numba strategy x threads x dtype of the feature matrix, on this path
    assert facts["matrix_cases"] >= 8 * len(moeroute.experts.choose.FORMATS), facts["matrix_cases"]
    assert facts["matrix_failures"] == [], "\n".join(facts["matrix_failures"])
