# One venv for everything: the launcher, the runtime, the tests.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: venv sglang-parser sglang-contract demo test lint typecheck fmt mutation

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: an unpinned torch pulls a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0

# reinstall only when the project's dependencies change. Everything: the launcher (the package itself),
# the job side (`runtime`), the test tools (`test`) and megatron-core (`gpu`: it imports on CPU, so its
# CPU tests over gloo run here too); a login node needs only `pip install miles-hpc`.
$(VENV)/.installed: pyproject.toml Makefile | $(BIN)/python
	$(BIN)/pip install -q -e '.[runtime,test,gpu]'
	touch $@

venv: $(VENV)/.installed

# SGLang's own argument parser and request types for tests/fast/engines/test_sglang_*.py (skipped without
# them), without SGLang's GPU stack: the wheel with --no-deps plus what importing sglang.srt.server_args
# needs (triton is imported, never run; torch stays the CPU build). GPU nodes use the `sglang` extra.
SGLANG_PARSER := sglang==0.5.23 pybase64==1.5.1 triton==3.9.0 pillow==13.0.0 msgspec==0.23.0 \
	pyzmq==27.3.0 ipython==9.18.1 traitlets==5.16.1

$(VENV)/.sglang-parser: Makefile | $(VENV)/.installed
	$(BIN)/pip install -q --no-deps $(SGLANG_PARSER)
	touch $@

sglang-parser: $(VENV)/.sglang-parser

# SGLang's HTTP contract (tools/sglang_contract.py): the routes, methods, body fields and query parameters
# our client and CPU engine use, read from SGLang's source and compared with the committed snapshot; exits
# 1 when something we use broke. SGLANG_VERSION=x.y.z reads that release's wheel (--no-deps, installed on
# the side, never into the venv); without it, the one `make sglang-parser` installed (pinned). Only source
# is read, so nothing else is installed. SGLANG_CONTRACT_ARGS=--write rewrites the snapshot from that
# SGLang and our code.
SGLANG_CONTRACT := tests/fast/engines/sglang_contract.json
SGLANG_CONTRACT_DIR = /tmp/sglang-contract-$(SGLANG_VERSION)
sglang-contract:
ifdef SGLANG_VERSION
	test -d $(SGLANG_CONTRACT_DIR)/sglang || \
		$(BIN)/pip install -q --no-deps --target $(SGLANG_CONTRACT_DIR) sglang==$(SGLANG_VERSION)
	$(BIN)/python tools/sglang_contract.py --sglang-root $(SGLANG_CONTRACT_DIR)/sglang \
		--compare $(SGLANG_CONTRACT) $(SGLANG_CONTRACT_ARGS)
else
	$(BIN)/python tools/sglang_contract.py --compare $(SGLANG_CONTRACT) $(SGLANG_CONTRACT_ARGS)
endif

demo: venv
	bash scripts/demo.sh

# Two lanes (pytest-xdist): the system tests in order on one worker, the other modules, each whole, on
# the other and then on both (tests/conftest.py: pytest_xdist_make_scheduler). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: venv
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS)

# ruff (pinned in pyproject.toml), then the package rules as import-linter contracts ([tool.importlinter]:
# layers from the driver down to miles.contract, the gateway only through the seam, the launcher only
# through the contract, no cycle)
lint: venv
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/lint-imports

# mypy ([tool.mypy]: the contract, the seam, the gateway, the driver, the job's node steps, the launcher)
typecheck: venv
	$(BIN)/mypy

fmt: venv
	$(BIN)/ruff check --fix . && $(BIN)/ruff format .

# Not in CI: mutants of one set of modules against their fast tests, on a clean export of HEAD (REV=...
# for another commit). SET=gateway (default: miles/gateway, miles/state; 30-40 min on 2 shared cores) or
# SET=planning (roles, catalog, elastic policy, bucketing). docs/testing.md has the scores.
mutation: venv
	$(BIN)/pip install -q -e '.[runtime,test,mutation]'
	SET=$(SET) scripts/mutation.sh $(REV)
