"""The expert compute's feature matrix: every weight format x strategy x threads x activation
dtype, each call against a plain definition, on the instruction-set path of the process.

`run` computes the matrix and returns one row per case (its error and its bound); the tests
assert the bounds in this process (the CPU's own path) and in one process per lower path
(`MOEROUTE_CPU_ISA`), where only the Numba strategies are run: "blocks", "loop" and "padded"
are torch GEMMs, whose code does not depend on moeroute's path.

Errors are max |out - ref| / max |ref| in float64. The bounds are docs/quant.md's: float32
activations sum in a different order than the reference (1e-5; FP8 w8a8 5e-3, where a rounding
tie of the requantized intermediate may flip), bfloat16 activations keep a bfloat16 intermediate
and output (2e-2 against a float64 definition that does not round them; FP8 w8a8 5e-3 against a
definition that rounds the intermediate as the kernels do).
"""

from __future__ import annotations

import dataclasses

import torch

from helpers.reference import dense_experts, dequantize_mxfp4, randn, rel_error
from moeroute.experts import choose
from moeroute.quant import QuantConfig, quantize_mxfp4, reference
from moeroute.quant.fp8 import quantize_experts

H, I, E = 256, 256, 4
#: Token counts: a decode step (few rows per expert) and a prefill chunk (past the row bound).
TOKENS = (3, 80)
DTYPES = (torch.float32, torch.bfloat16)
THREADS = (1, 2)
#: Strategies whose code is moeroute's Numba kernels, compiled for the process's path.
NUMBA_STRATEGIES = ("auto", "rows")


def _bound(fmt: str, dtype: torch.dtype) -> float:
    if fmt == "fp8":
        return 5e-3
    return 1e-5 if dtype == torch.float32 else 2e-2


@dataclasses.dataclass(frozen=True)
class Case:
    format: str
    variant: str
    strategy: str
    threads: int
    dtype: str
    tokens: int
    error: float
    bound: float

    @property
    def name(self) -> str:
        return f"{self.format}/{self.variant} {self.strategy} threads={self.threads} {self.dtype} T={self.tokens}"


def _routing(tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E + 1, generator=gen)[:2] - 1 for _ in range(tokens)]).to(torch.int32)
    weights = torch.rand(tokens, 2, generator=gen).to(torch.float32)
    return ids, weights


def _float_cases(dtype):
    w_gate_up = randn(E, 2 * I, H, seed=11, scale=0.05).to(dtype)
    w_down = randn(E, H, I, seed=12, scale=0.05).to(dtype)
    from moeroute.experts.formats.unquantized import cpu_experts

    def call(x, ids, weights, strategy):
        return cpu_experts(x, weights, ids, w_gate_up, w_down, gemm=strategy)

    def ref(x, ids, weights):
        return dense_experts(x, weights, ids, w_gate_up.double(), w_down.double())

    yield "float", str(dtype).removeprefix("torch."), call, ref


def _fp8_cases(dtype):
    from moeroute.experts.formats.fp8 import fp8_experts_forward

    w_gate_up = randn(E, 2 * I, H, seed=21, scale=0.05)
    w_down = randn(E, H, I, seed=22, scale=0.05)
    configs = [("w8a8", QuantConfig("fp8_block")), ("w8a8 per-tensor", QuantConfig("fp8_tensor"))]
    try:
        configs.append(("w8a16", QuantConfig("fp8_block", activation="none")))
    except (TypeError, ValueError):
        pass
    for variant, config in configs:
        q_gu, s_gu, q_d, s_d = quantize_experts(w_gate_up, w_down, config)

        def call(x, ids, weights, strategy, config=config, q=(q_gu, s_gu, q_d, s_d)):
            return fp8_experts_forward(x, weights, ids, *q, config, strategy=strategy)

        def ref(x, ids, weights, q=(q_gu, s_gu, q_d, s_d), config=config, w8a8=variant != "w8a16"):
            return reference.moe_experts_reference(
                x.float(),
                weights,
                ids,
                *q,
                block_size=config.block_size,
                intermediate_dtype=x.dtype,
                quantize_activations=w8a8,
            )

        yield "fp8", variant, call, ref


def _mxfp4_cases(dtype):
    from moeroute.experts.formats.mxfp4 import mxfp4_experts_forward

    w_gate_up = randn(E, 2 * I, H, seed=31, scale=0.05)
    w_down = randn(E, H, I, seed=32, scale=0.05)
    (gu_b, gu_s), (d_b, d_s) = quantize_mxfp4(w_gate_up), quantize_mxfp4(w_down)

    def call(x, ids, weights, strategy):
        return mxfp4_experts_forward(x, weights, ids, gu_b, gu_s, d_b, d_s, strategy=strategy)

    def ref(x, ids, weights):
        return dense_experts(x, weights, ids, dequantize_mxfp4(gu_b, gu_s), dequantize_mxfp4(d_b, d_s))

    yield "mxfp4", "mxfp4", call, ref


def _int4_cases(dtype):
    from moeroute.experts.formats import int4 as int4_format
    from moeroute.quant import dequantize_int4, quantize_int4

    w_gate_up = randn(E, 2 * I, H, seed=41, scale=0.05)
    w_down = randn(E, H, I, seed=42, scale=0.05)
    for symmetric in (True, False):
        for group in (32, 128):
            gu = quantize_int4(w_gate_up, group_size=group, symmetric=symmetric)
            d = quantize_int4(w_down, group_size=group, symmetric=symmetric)
            dq_gu = dequantize_int4(*gu, group_size=group)
            dq_d = dequantize_int4(*d, group_size=group)

            def call(x, ids, weights, strategy, gu=gu, d=d, group=group):
                return int4_format.int4_experts_forward(x, weights, ids, gu, d, group, strategy=strategy)

            def ref(x, ids, weights, w=(dq_gu, dq_d)):
                return dense_experts(x, weights, ids, w[0].double(), w[1].double())

            kind = "sym" if symmetric else "asym"
            yield "int4", f"{kind} g{group}", call, ref


#: One builder per format of the strategy table: a format the table names and this file does
#: not is a failure of `test_every_format_of_the_table_has_a_row`.
BUILDERS = {"float": _float_cases, "fp8": _fp8_cases, "mxfp4": _mxfp4_cases, "int4": _int4_cases}


def run(strategies: tuple[str, ...] | None = None) -> list[Case]:
    """Every case of the matrix (``strategies``: only these, where the format offers them)."""
    cases = []
    previous = torch.get_num_threads()
    try:
        for fmt in choose.FORMATS:
            for dtype in DTYPES:
                for fmt_name, variant, call, ref in BUILDERS[fmt](dtype):
                    for tokens in TOKENS:
                        x = randn(tokens, H, seed=tokens).to(dtype)
                        ids, weights = _routing(tokens, seed=tokens + 1)
                        expected = ref(x, ids, weights)
                        for strategy in choose.STRATEGIES[fmt]:
                            if strategies is not None and strategy not in strategies:
                                continue
                            for threads in THREADS:
                                torch.set_num_threads(threads)
                                out = call(x, ids, weights, strategy)
                                assert out.dtype == dtype and out.shape == (tokens, H), (fmt, variant, strategy)
                                cases.append(
                                    Case(
                                        fmt_name,
                                        variant,
                                        strategy,
                                        threads,
                                        str(dtype).removeprefix("torch."),
                                        tokens,
                                        rel_error(out, expected),
                                        _bound(fmt, dtype),
                                    )
                                )
    finally:
        torch.set_num_threads(previous)
    return cases
