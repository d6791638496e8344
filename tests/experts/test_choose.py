"""moeroute.experts.choose: the one table of (format, backend, CPU features) -> strategy, its
checks, and the constructor and forward checks that read it."""

import pytest
import torch

from moeroute.experts import choose as choose_module
from moeroute.experts.choose import (
    BF16_ROWS_MAX_MEAN_ROWS,
    FORMATS,
    FP8_WIDENED_MAX_MEAN_ROWS,
    INT4_BF16_ROWS_MAX_MEAN_ROWS,
    ROWS_MAX_MEAN_ROWS,
    STRATEGIES,
    check_strategy,
    choose,
    format_of,
    fp8_bf16_dot,
)
from moeroute.quant import QuantConfig

# (format, backend, counts, keyword arguments, expected): each row is one answer of the table.
TABLE = [
    # CPU, quantized: the row bound, lifted where the bfloat16-dot kernels serve the shapes.
    ("fp8", "cpu", [ROWS_MAX_MEAN_ROWS, 0, ROWS_MAX_MEAN_ROWS], {}, "rows"),
    ("fp8", "cpu", [ROWS_MAX_MEAN_ROWS + 1, 0, ROWS_MAX_MEAN_ROWS + 1], {}, "blocks"),
    ("fp8", "cpu", [40 * ROWS_MAX_MEAN_ROWS, 3], {"bf16_dot": True}, "rows"),
    ("fp8", "cpu", [], {}, "rows"),
    ("fp8", "cpu", [500, 500], {"strategy": "rows"}, "rows"),
    ("fp8", "cpu", [1, 1], {"strategy": "blocks"}, "blocks"),
    ("mxfp4", "cpu", [500, 500], {}, "rows"),
    ("mxfp4", "cpu", [1], {"strategy": "blocks"}, "blocks"),
    ("int4", "cpu", [ROWS_MAX_MEAN_ROWS, 0, ROWS_MAX_MEAN_ROWS], {}, "rows"),
    ("int4", "cpu", [ROWS_MAX_MEAN_ROWS + 1, 0, ROWS_MAX_MEAN_ROWS + 1], {}, "rows"),
    ("int4", "cpu", [500, 500], {}, "rows"),
    ("int4", "cpu", [], {}, "rows"),
    ("int4", "cpu", [500, 500], {"strategy": "rows"}, "rows"),
    ("int4", "cpu", [500, 500], {"bf16_dot": True}, "rows"),
    ("int4", "cpu", [1], {"strategy": "blocks"}, "blocks"),
    # CPU, float32: rows, padded over mostly-hit experts on torch.mm, else the loop.
    ("float", "cpu", [3, 0, 5, 1], {}, "rows"),
    ("float", "cpu", [ROWS_MAX_MEAN_ROWS + 4] * 4, {}, "padded"),
    ("float", "cpu", [ROWS_MAX_MEAN_ROWS + 4] * 4, {"onednn": True}, "loop"),
    ("float", "cpu", [0, 0], {}, "loop"),
    ("float", "cpu", [3, 0, 5, 1], {"strategy": "padded"}, "padded"),
    # CUDA: the CUDA kernels for every format; "blocks" stays a choice of the quantized ones,
    # and is what they take where the CUDA kernels cannot run the call.
    ("float", "cuda", [3], {}, "cuda"),
    ("float", "cuda", [3], {"strategy": "rows"}, "cuda"),
    ("fp8", "cuda", [3], {}, "cuda"),
    ("fp8", "cuda", [3], {"strategy": "rows"}, "cuda"),
    ("fp8", "cuda", [3], {"strategy": "blocks"}, "blocks"),
    ("fp8", "cuda", [3], {"cuda_kernels": False}, "blocks"),
    ("mxfp4", "cuda", [3], {}, "cuda"),
    ("mxfp4", "cuda", [3], {"strategy": "blocks"}, "blocks"),
    ("mxfp4", "cuda", [3], {"cuda_kernels": False}, "blocks"),
    ("int4", "cuda", [3], {}, "cuda"),
    ("int4", "cuda", [3], {"strategy": "rows"}, "cuda"),
    ("int4", "cuda", [3], {"strategy": "blocks"}, "blocks"),
    ("int4", "cuda", [3], {"cuda_kernels": False}, "blocks"),
]


@pytest.mark.parametrize("format, backend, counts, kwargs, expected", TABLE)
def test_the_table(format, backend, counts, kwargs, expected):
    assert choose(format, backend, counts, **kwargs) == expected


def test_bfloat16_rows_bound_follows_the_cpu_features(monkeypatch):
    few = [BF16_ROWS_MAX_MEAN_ROWS] * 3
    many = [BF16_ROWS_MAX_MEAN_ROWS + 1] * 3
    for features, expected in (
        (frozenset({"avx512bf16", "amx-bf16"}), "loop"),
        (frozenset({"avx512bf16"}), "loop"),
        (frozenset({"avx2"}), "rows"),
        (frozenset(), "rows"),
    ):
        monkeypatch.setattr(choose_module.cpu_features, "FEATURES", features)
        choose_module.rows_bound.cache_clear()
        assert choose("float", "cpu", few, dtype=torch.bfloat16, onednn=True) == "rows"
        assert choose("float", "cpu", many, dtype=torch.bfloat16, onednn=True) == expected
        assert choose("float", "cpu", [40 * ROWS_MAX_MEAN_ROWS] * 3, dtype=torch.bfloat16, onednn=True) == expected
        assert choose("float", "cpu", many, dtype=torch.float32, onednn=True) == "rows"
        assert choose("float", "cpu", [ROWS_MAX_MEAN_ROWS + 1] * 3, dtype=torch.float32, onednn=True) == "loop"
    choose_module.rows_bound.cache_clear()


def test_int4_takes_blocks_past_its_bound_for_bfloat16_with_the_dot_instructions(monkeypatch):
    few = [INT4_BF16_ROWS_MAX_MEAN_ROWS, 0, INT4_BF16_ROWS_MAX_MEAN_ROWS]
    many = [INT4_BF16_ROWS_MAX_MEAN_ROWS + 1, 0, INT4_BF16_ROWS_MAX_MEAN_ROWS + 1]
    for features, expected in (
        (frozenset({"avx512bf16", "amx-bf16"}), "blocks"),
        (frozenset({"amx-bf16"}), "blocks"),
        (frozenset({"avx512bf16"}), "blocks"),
        (frozenset({"avx2"}), "rows"),
        (frozenset(), "rows"),
    ):
        monkeypatch.setattr(choose_module.cpu_features, "FEATURES", features)
        choose_module.int4_rows_bound.cache_clear()
        assert choose("int4", "cpu", few, dtype=torch.bfloat16) == "rows"
        assert choose("int4", "cpu", few, dtype=torch.bfloat16, bf16_dot=True) == "rows"
        assert choose("int4", "cpu", many, dtype=torch.bfloat16) == expected
        assert choose("int4", "cpu", many, dtype=torch.bfloat16, bf16_dot=True) == expected
        assert choose("int4", "cpu", [500, 500], dtype=torch.bfloat16) == expected
        assert choose("int4", "cpu", [], dtype=torch.bfloat16) == "rows"
        # float32 and float16 activations keep the row kernels at every count; a named strategy is kept
        assert choose("int4", "cpu", [500, 500], dtype=torch.float32) == "rows"
        assert choose("int4", "cpu", [500, 500], dtype=torch.float16) == "rows"
        assert choose("int4", "cpu", [500, 500], dtype=torch.bfloat16, strategy="rows") == "rows"
        assert choose("int4", "cpu", [1], dtype=torch.bfloat16, strategy="blocks") == "blocks"
        # on CUDA the bound plays no part
        assert choose("int4", "cuda", many, dtype=torch.bfloat16) == "cuda"
    choose_module.int4_rows_bound.cache_clear()


def test_half_precision_never_takes_the_padded_batch():
    assert choose("float", "cpu", [ROWS_MAX_MEAN_ROWS + 4] * 4, dtype=torch.float16) == "loop"


def test_every_format_has_auto_first():
    assert tuple(STRATEGIES) == FORMATS
    assert all(strategies[0] == "auto" for strategies in STRATEGIES.values())
    assert format_of(None) == "float"
    assert format_of(QuantConfig("fp8_block")) == format_of(QuantConfig("fp8_tensor")) == "fp8"
    assert format_of(QuantConfig("mxfp4")) == "mxfp4"
    assert format_of(QuantConfig("int4", group_size=64, symmetric=False)) == "int4"


@pytest.mark.parametrize(
    "format, strategy, message",
    [
        ("float", "blocks", r"gemm='blocks' is not a GEMM strategy; use one of \('auto', 'loop', 'padded', 'rows'\)"),
        ("fp8", "loop", r"gemm='loop' is not an FP8 strategy; use one of \('auto', 'rows', 'blocks'\)"),
        ("mxfp4", "padded", r"gemm='padded' is not an MXFP4 strategy; use one of \('auto', 'rows', 'blocks'\)"),
        ("int4", "loop", r"gemm='loop' is not an INT4 strategy; use one of \('auto', 'rows', 'blocks'\)"),
    ],
)
def test_check_strategy_names_the_argument_and_the_allowed_values(format, strategy, message):
    with pytest.raises(ValueError, match=message):
        check_strategy("gemm", strategy, format)
    assert check_strategy("gemm", "auto", format) == "auto"


def test_bad_format_and_backend_are_refused():
    with pytest.raises(ValueError, match=r"format='int3' is not an experts format"):
        choose("int3", "cpu", [1])
    with pytest.raises(ValueError, match=r"backend='tpu' is not an experts backend"):
        choose("fp8", "tpu", [1])


@pytest.mark.parametrize(
    "quant, gemm", [(QuantConfig("fp8_block"), "loop"), (QuantConfig("mxfp4"), "padded"), (None, "blocks")]
)
def test_moe_refuses_a_strategy_its_format_lacks(quant, gemm):
    from moeroute.bindings.torch import MoE
    from moeroute.config import RouterConfig

    with pytest.raises(ValueError, match=rf"^gemm='{gemm}' is not an? "):
        MoE(RouterConfig(4, 2, "softmax"), 64, 64, quant=quant, gemm=gemm)


def test_fp8_bf16_dot_kernels_past_the_widened_bound():
    """FP8's kernel family within "rows": widened up to `FP8_WIDENED_MAX_MEAN_ROWS` mean rows
    per hit expert, the bfloat16-dot kernels past it, and never where they do not serve."""
    hit = 8
    at_bound = int(FP8_WIDENED_MAX_MEAN_ROWS * hit)
    assert not fp8_bf16_dot(True, hit, hit)  # a decode step: one row per expert
    assert not fp8_bf16_dot(True, at_bound, hit)
    assert fp8_bf16_dot(True, at_bound + 1, hit)
    assert not fp8_bf16_dot(False, 100 * hit, hit)


@pytest.mark.skipif(not choose_module.cpu_features.FEATURES & {"avx512bf16"}, reason="one FP8 kernel family here")
@pytest.mark.parametrize("tokens, family", [(1, "widened"), (4, "widened"), (16, "bf16_dot")])
def test_fp8_forward_runs_the_family_the_bound_names(monkeypatch, tokens, family):
    """The FP8 forward reads the bound per call: its output is, bit for bit, the output of the
    family `fp8_bf16_dot` names (that family forced by setting the bound to 0 or infinity)."""
    from moeroute.experts.formats.fp8 import fp8_experts_forward
    from moeroute.quant import quantize_experts

    quant = QuantConfig("fp8_block")
    generator = torch.Generator().manual_seed(tokens)
    weights = quantize_experts(
        torch.randn(8, 256, 128, generator=generator) * 0.05,
        torch.randn(8, 128, 128, generator=generator) * 0.05,
        quant,
    )
    ids = (torch.arange(tokens * 2) % 8).reshape(tokens, 2).int()  # tokens * 2 / min(8, 2 * tokens) rows each
    slot_weights = torch.rand(tokens, 2, generator=generator)
    x = torch.randn(tokens, 128, generator=generator)  # float32 out: the sums' order shows
    out = fp8_experts_forward(x, slot_weights, ids, *weights, quant, strategy="rows")
    monkeypatch.setattr(choose_module, "FP8_WIDENED_MAX_MEAN_ROWS", float("inf") if family == "widened" else 0.0)
    forced = fp8_experts_forward(x, slot_weights, ids, *weights, quant, strategy="rows")
    monkeypatch.setattr(choose_module, "FP8_WIDENED_MAX_MEAN_ROWS", 0.0 if family == "widened" else float("inf"))
    other = fp8_experts_forward(x, slot_weights, ids, *weights, quant, strategy="rows")
    assert torch.equal(out, forced)
    assert not torch.equal(out, other)  # the two families sum in different orders
