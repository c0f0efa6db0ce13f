# Two commands on a fresh machine: `make demo` (plans a seed-thread model and prints the report) and
# `make test` (lint, types, tests; it installs Debian's postgresql where missing). Both create the virtual
# environment on first use.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test lint postgres bench gpu-check clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

demo: $(VENV)/.installed
	$(PY) -m planner.demo

lint: $(VENV)/.installed
	$(PY) -m ruff check planner tests api bench
	$(PY) -m mypy planner api

# The job-store tests start a real PostgreSQL server (tests/api/postgres_server.py).
postgres:
	bash tools/install-postgres.sh

test: lint postgres
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(PY) -m bench.fidelity

# The device-memory predictions against a real CUDA allocator (bench/gpu_check.py): with the machine's own
# CUDA build of torch where python3 has one (a lent GPU machine), else on the CPU through .venv.
gpu-check:
	@if python3 -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then \
		PYTHONPATH=. python3 -m bench.gpu_check $(GPU_CHECK_ARGS); \
	else \
		$(MAKE) $(VENV)/.installed && $(PY) -m bench.gpu_check $(GPU_CHECK_ARGS); \
	fi

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
