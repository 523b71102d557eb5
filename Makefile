# Every target creates .venv at the repository root and installs what it needs.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: demo test lint bench gpu-check clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed-demo: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[demo]'
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@ $(VENV)/.installed-demo $(VENV)/.installed-bench

$(VENV)/.installed-bench: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	touch $@

## make demo: the main job — what precise statistics change, on scikit-learn's digits (CPU, no download)
demo: $(VENV)/.installed-demo
	$(BIN)/precisebn demo

## make test: lint, then every test (unit, property-based, doctests, multi-process, CLI)
test: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

## make bench: benchmarks against the floor, fvcore and torch (results in benchmarks/results/)
bench: $(VENV)/.installed-bench
	$(BIN)/python -m benchmarks.run

## make gpu-check: CUDA-only checks (SyncBatchNorm across processes, host syncs); needs a GPU
gpu-check: $(VENV)/.installed-dev
	$(BIN)/python benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis precisebn-demo
