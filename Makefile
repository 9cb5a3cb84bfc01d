# One venv for everything: the launcher, the runtime, the tests.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: venv demo test lint fmt

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: an unpinned torch pulls a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0

venv: $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'

demo: venv
	bash scripts/demo.sh

test: venv
	$(BIN)/python -m pytest -q

lint:
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

fmt:
	$(BIN)/ruff check --fix . && $(BIN)/ruff format .
