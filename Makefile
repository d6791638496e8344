# Set-up and the two quick-start commands: `make demo` and `make test`.
# torch==2.13.0 is installed before anything that depends on torch: a bare torch requirement
# resolves to a multi-GB CUDA build, the pinned one is the CPU build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
PYTEST_ARGS ?= -n auto --maxprocesses=4

.PHONY: setup demo test wheel-check bench hip-toolchain clean

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
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The wheel as users get it: built, installed into a fresh venv outside the checkout, demo + routing.
wheel-check: setup
	PYTHON=$(abspath $(PY)) TORCH_PIN="$(TORCH_PIN)" bash tools/check_wheel.sh

bench: setup
	$(PY) bench/routing.py
	$(PY) bench/layer.py
	$(PY) bench/ep.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
	find . -name __pycache__ -prune -exec rm -rf {} +
