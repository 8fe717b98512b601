# Two commands do all set-up on a fresh machine:
#   make demo   -> venv, torch 2.13.0 (CPU) first, the rest, redis-server, then `ddloco up`
#   make test   -> the same set-up, then the whole test suite
PY ?= python3
# Extra pip flags for the torch pin. On this project's machines the pin resolves to a local CPU
# wheel; elsewhere use the CPU index so no CUDA build (several GB) is pulled:
#   make test TORCH_PIP_FLAGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_PIP_FLAGS ?=
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_FLAGS ?= --report reports/demo

.PHONY: demo test setup clean compose-check multihost

$(STAMP): pyproject.toml setup.py common/_qkernels.c
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0 $(TORCH_PIP_FLAGS)
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/python -m common.redis_server --check
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/ddloco up $(DEMO_FLAGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

# Not part of `make test` (needs a container engine or root, and minutes): see the README.
#   make compose-check -> builds the image, runs compose.yaml, trains, scales 2 -> 4 -> 1, stops
#   make multihost     -> learners in network namespaces behind rate-limited links (root)
compose-check: $(STAMP)
	$(BIN)/python docker/compose_check.py

multihost: $(STAMP)
	$(BIN)/python -m bench.multihost --json reports/multihost.json

clean:
	rm -rf $(VENV) reports runs *.egg-info
