# One image for every daemon (broker, syncer, learner); the command picks the role.
FROM python:3.11-slim
WORKDIR /app
# CPU build of torch first, pinned, so nothing pulls the CUDA wheels.
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY common common
COPY learner learner
COPY syncer syncer
COPY broker broker
COPY ddloco ddloco
COPY sim sim
COPY bench bench
COPY tasks tasks
# your task module: put it next to examples/ (or mount it) and set DDLOCO_TASK=module:attr
COPY examples examples
RUN pip install --no-cache-dir .
ENV PYTHONUNBUFFERED=1
ENTRYPOINT ["ddloco"]
