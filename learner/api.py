"""The learner's Python API: bring a ``Task`` (your model, data and loss) and join a run.

    from ddloco import Task
    from learner.api import train
    summary = train(task=my_task, endpoints=Endpoints(run_id="exp1", redis_url=..., broker_pub=...,
                                                      broker_sub=...))

The run's shards must train the same task (same ``Task.name`` and ``Task.config``, same model
state layout); a mismatch is refused naming what differs. With ``task=None`` the learner loads
the run's task from the spec in its config (``--task`` of whoever started the run).
"""
from __future__ import annotations

import threading

from common.config import Endpoints, LearnerOptions, RunConfig
from learner.core import Learner, LearnerSummary
from common.task import Task


def train(*, endpoints: Endpoints, task: Task | None = None, options: LearnerOptions = LearnerOptions(),
          run: RunConfig | None = None, stop: threading.Event | None = None) -> LearnerSummary:
    """Join the run, train until ``options.max_steps`` or ``stop``, flush, leave. Returns counters.

    ``run`` None joins with the run's config from Redis; a given ``run`` must equal it (or starts
    the run when there is none yet)."""
    return Learner(endpoints=endpoints, options=options, task=task, run=run, stop=stop).run()
