"""Helpers shared by the test files: import them as ``helpers.<module>``.

``tests/`` is on ``sys.path`` because tests/conftest.py lives there (pytest's default
``prepend`` import mode), and spawned processes inherit the parent's ``sys.path``.

- gloo: spawn a gloo process group of workers and collect what each rank returns.
- reference: float64 dense references (activations, expert MLPs) and small generators.
- modules: small torch modules that tests build layers from (a counting shared MLP).
- isa: run a test's own function again on the AVX2 path, in a fresh process.
"""
