# Two commands on a fresh machine: `make demo` (plans a seed-thread model and prints the report) and
# `make test` (lint, types, tests). Both create the virtual environment on first use.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test lint bench clean

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

test: lint
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(PY) -m bench.fidelity

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
