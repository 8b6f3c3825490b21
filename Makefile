# Two commands do all setup on a fresh machine: `make demo` and `make test` (see README.md).
SHELL := /bin/bash
VENV ?= .venv
ORACLE_VENV ?= .venv-oracle
PY := $(VENV)/bin/python
ORACLE_PY := $(ORACLE_VENV)/bin/python
DEMO_CONFIG ?= configs/tiny_cpu.yaml
PYTEST_ARGS ?=

.PHONY: demo test lint venv oracle report clean

$(VENV)/.installed: requirements.txt pyproject.toml
	@interp=$$(scripts/find_python.sh 12 13) || exit 1; \
	  echo "using $$interp"; \
	  [ -x $(PY) ] || $$interp -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

# The HF oracle: Python 3.11 + the CPU torch wheel, called by the parity tests as a subprocess.
$(ORACLE_VENV)/.installed: requirements-oracle.txt
	@interp=$$(scripts/find_python.sh 11 11) || exit 1; \
	  echo "oracle using $$interp"; \
	  [ -x $(ORACLE_PY) ] || $$interp -m venv $(ORACLE_VENV)
	$(ORACLE_PY) -m pip install -q --upgrade pip
	$(ORACLE_PY) -m pip install -q -r requirements-oracle.txt
	touch $@

venv: $(VENV)/.installed
oracle: $(ORACLE_VENV)/.installed

demo: venv
	$(PY) -m quads_jax.train --config $(DEMO_CONFIG)

report: venv
	$(PY) scripts/nvfp4_report.py

# The suite compiles its programs without LLVM's optimizations (tests/conftest.py: most of its
# time is compiling tiny programs); the bit-identity tests (marker `numerics`) run again at
# XLA's default level, the level `make demo` and the GPU runs use. Three workers on two cores:
# the interpret-mode kernel tests are bound by Python, so a third overlaps them with XLA's work
# (the whole suite in 13:29 against 14:41 with two, session 33).
test: venv oracle
	QUADS_ORACLE_PYTHON=$(abspath $(ORACLE_PY)) $(PY) -m pytest -q -n 3 --durations=15 $(PYTEST_ARGS) tests
	QUADS_TEST_XLA_OPT=default $(PY) -m pytest -q -n 3 -m numerics $(PYTEST_ARGS) tests

lint: venv
	$(PY) -m ruff check quads_jax pallas_kernels scripts tests

clean:
	rm -rf $(VENV) $(ORACLE_VENV) .pytest_cache .hypothesis
