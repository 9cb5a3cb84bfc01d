# One venv for everything: the launcher, the runtime, the tests.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: venv demo test lint fmt mutation

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: an unpinned torch pulls a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0

# reinstall only when the project's dependencies change
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed

demo: venv
	bash scripts/demo.sh

test: venv
	$(BIN)/python -m pytest -q

lint: venv
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

fmt: venv
	$(BIN)/ruff check --fix . && $(BIN)/ruff format .

# Not in CI: mutants of miles/gateway and miles/state against their fast tests, on a clean export of
# HEAD (REV=... for another commit); about 30 min on 2 cores. docs/testing.md has the scores.
mutation: venv
	$(BIN)/pip install -q -e '.[test,mutation]'
	scripts/mutation.sh $(REV)
