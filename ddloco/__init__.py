"""Decoupled DiLoCo. The public Python API (see ``ddloco.api`` for a whole run in one script):

    from ddloco import Task                       # bring your model and data (common/task.py)
    ddloco.hash_data(arrays...)                   # Task(data_digest=...): the run refuses other data
    ddloco.embedded_redis()                       # a private Redis for a local run
    ddloco.run_broker(endpoints=..., stop=...)    # the ZeroMQ forwarder
    ddloco.run_shard(task, endpoints=..., ...)    # one syncer shard
    ddloco.train(task, endpoints=..., ...)        # one learner
    ddloco.load_global_model(redis_url=..., run_id=...)   # or checkpoint_dir=...: the trained model
"""
from __future__ import annotations

import importlib
from typing import Any

# Imported on first use (PEP 562): `ddloco --help`, a bad flag or the broker (`python -m ddloco
# broker`) then start in a fraction of a second instead of paying torch's import (~2-3 s).
_EXPORTS = {
    "AlgoConfig": "common.config", "Endpoints": "common.config", "LearnerOptions": "common.config",
    "RunConfig": "common.config", "SyncerOptions": "common.config", "TaskConfig": "common.config",
    "embedded_redis": "ddloco.api", "run_broker": "ddloco.api", "run_shard": "ddloco.api", "train": "ddloco.api",
    "load_global_model": "ddloco.export", "save_state": "ddloco.export",
    "Task": "common.task", "TaskError": "common.task", "hash_data": "common.task",
    "load_task": "common.task", "allow_tasks": "common.task",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ddloco' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
