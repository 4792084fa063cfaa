# The two commands of README.md. Both create ./.venv and install this checkout into it (editable).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CORES ?= all

.PHONY: run test install install-test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# A GPU node (nvidia-smi lists a device) also gets the GPU engines' packages (pyproject's [gpu] extra);
# elsewhere those engines are left out of the run and named in the report.
GPUS := $(shell nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | grep -c .)
EXTRAS := $(if $(filter-out 0,$(GPUS)),[gpu])

install: $(BIN)/python
	$(BIN)/pip install -q -e '.$(EXTRAS)'

install-test: $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'

# Runs the pipeline on the built-in default config.yaml.
run: install
	$(BIN)/snakemake --cores $(CORES)

# Runs the test suite (fast tests; `make test PYTEST_ARGS="-m slow"` for the slow ones), a worker per core
# (pytest-xdist, at most 8; PYTEST_ARGS="-n 0" runs it in one process).
test: install-test
	$(BIN)/python -m pytest -n auto $(PYTEST_ARGS)
