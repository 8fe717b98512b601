"""The learner's Python API: bring a model factory, a batch iterator and a loss.

    from learner.api import train
    summary = train(model_factory=lambda: MyNet(), data=my_batches(), loss_fn=my_loss,
                    endpoints=Endpoints(run_id="exp1", redis_url=..., broker_pub=..., broker_sub=...))

``data`` yields batches with a ``tokens`` attribute (tokens processed, used for merge weights);
``loss_fn(model, batch)`` returns a scalar loss. The model factory must build the same
architecture as the run's shards (the fragment layout is checked; a mismatch is refused).
"""
from __future__ import annotations

import threading
import zlib
from dataclasses import replace
from typing import Any, Callable, Collection, Iterable

import torch

from common import control
from common.config import Endpoints, LearnerOptions, RunConfig
from common.keys import Keys
from learner.core import Learner, LearnerSummary, resolve_learner_id


def train(*, model_factory: Callable[[], torch.nn.Module], data: Iterable[Any],
          loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], endpoints: Endpoints,
          options: LearnerOptions = LearnerOptions(), run: RunConfig | None = None,
          embedding_names: Collection[str] = (), stop: threading.Event | None = None) -> LearnerSummary:
    """Join the run, train until ``options.max_steps`` or ``stop``, leave. Returns counters."""
    return Learner(endpoints=endpoints, options=options, model_factory=model_factory, data=data, loss_fn=loss_fn,
                   embedding_names=embedding_names, run=run, stop=stop).run()


def train_builtin(*, endpoints: Endpoints, options: LearnerOptions = LearnerOptions(),
                  run: RunConfig | None = None, stop: threading.Event | None = None) -> LearnerSummary:
    """Train the run's built-in task (its config is read from Redis unless ``run`` is given)."""
    from common.tasks import make_task
    torch.set_num_threads(options.threads)
    if run is None:
        r = control.connect(endpoints.redis_url)
        run = control.fetch_run_config(r, Keys(endpoints.run_id), wait_s=options.join_timeout_s, stop=stop)
        r.close()
    task = make_task(run.task)
    model = task.build_model()
    learner_id = resolve_learner_id(options)
    options = replace(options, learner_id=learner_id)
    stream = options.data_shard
    if stream < 0:  # scaled replicas (compose --scale) get distinct streams from their unique ids
        stream = zlib.crc32(learner_id.encode()) % (2**31 - 1)
    position = previous_data_position(endpoints, learner_id)  # a restarted learner resumes its data
    data = task.train_batches(stream=stream, seed=run.task.seed, start_step=position)
    return Learner(endpoints=endpoints, options=options, model_factory=lambda: model, data=data, loss_fn=task.loss,
                   embedding_names=task.embedding_names(model), run=run, stop=stop, data_position=position).run()


def previous_data_position(endpoints: Endpoints, learner_id: str) -> int:
    """Batches this learner id consumed in earlier lives (0 if unknown: new id, or Redis lost it)."""
    r = control.connect(endpoints.redis_url)
    try:
        return int(float(r.hget(Keys(endpoints.run_id).learner(learner_id), "data_position") or 0))
    finally:
        r.close()
