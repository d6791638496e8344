"""The feature matrix of the expert compute on this CPU's own instruction-set path: every
weight format of the strategy table x every strategy it offers x threads 1, 2 x float32 and
bfloat16 activations x a decode and a prefill token count, each against a plain definition
(tests/helpers/feature_matrix.py). The lower paths run the Numba strategies of the same matrix
in one process each (tests/test_cpu_features.py)."""

from __future__ import annotations

import pytest

from helpers import feature_matrix
from moeroute.experts import choose


def test_every_format_of_the_table_has_a_row():
    assert set(choose.FORMATS) <= set(feature_matrix.BUILDERS), "a format without a feature-matrix builder"


@pytest.fixture(scope="module")
def matrix():
    return feature_matrix.run()


@pytest.mark.slow
def test_every_strategy_threads_and_dtype_is_covered(matrix):
    seen = {(case.format, case.strategy, case.threads, case.dtype) for case in matrix}
    for fmt in choose.FORMATS:
        for strategy in choose.STRATEGIES[fmt]:
            for threads in feature_matrix.THREADS:
                for dtype in ("float32", "bfloat16"):
                    assert (fmt, strategy, threads, dtype) in seen


def test_every_case_is_within_its_bound(matrix):
    failures = [f"{case.name}: {case.error:.2e} > {case.bound:.0e}" for case in matrix if not case.error <= case.bound]
    assert not failures, "\n".join(failures)
