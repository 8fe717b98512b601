"""Decoupled DiLoCo. The public Python API (see ``ddloco.api`` for a whole run in one script):

    from ddloco import Task                       # bring your model and data (tasks/contract.py)
    ddloco.hash_data(arrays...)                   # Task(data_digest=...): the run refuses other data
    ddloco.embedded_redis()                       # a private Redis for a local run
    ddloco.run_broker(endpoints=..., stop=...)    # the ZeroMQ forwarder
    ddloco.run_shard(task, endpoints=..., ...)    # one syncer shard
    ddloco.train(task, endpoints=..., ...)        # one learner
    ddloco.load_global_model(redis_url=..., run_id=...)   # or checkpoint_dir=...: the trained model
"""
from common.config import AlgoConfig, Endpoints, LearnerOptions, RunConfig, SyncerOptions, TaskConfig
from ddloco.api import embedded_redis, run_broker, run_shard, train
from ddloco.export import load_global_model, save_state
from tasks.contract import Task, TaskError, hash_data, load_task

__all__ = ["AlgoConfig", "Endpoints", "LearnerOptions", "RunConfig", "SyncerOptions", "Task", "TaskConfig",
           "TaskError", "embedded_redis", "hash_data", "load_global_model", "load_task", "run_broker", "run_shard",
           "save_state", "train"]
