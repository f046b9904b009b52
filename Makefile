# Two entry points that work on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP_SERVE := $(VENV)/.installed-serve
STAMP_DEV := $(VENV)/.installed-dev
DEMO_REPO ?= .kiln/demo-repository

.PHONY: serve test lint typecheck unit install-dev clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP_SERVE): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[server]'
	touch $@

# torch is pinned to a CPU build first: an open range would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

$(STAMP_DEV): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet '$(TORCH_SPEC)'
	$(BIN)/python -m pip install --quiet -e '.[dev,torch]'
	touch $@ $(STAMP_SERVE)

serve: $(STAMP_SERVE)
	$(BIN)/kiln serve

install-dev: $(STAMP_DEV)

lint: $(STAMP_DEV)
	$(BIN)/ruff check .

typecheck: $(STAMP_DEV)
	$(BIN)/mypy

unit: $(STAMP_DEV)
	$(BIN)/python -m pytest -m "not slow" -q

test: lint typecheck unit

clean:
	rm -rf $(VENV) .kiln .mypy_cache .pytest_cache .ruff_cache
