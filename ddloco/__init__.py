"""Decoupled DiLoCo. The public Python API:

    from ddloco import Task                  # the task contract (tasks.contract)
    ddloco.load_task(spec, args)             # a built-in or MODULE:ATTR task
"""
from tasks.contract import Task, TaskError, load_task

__all__ = ["Task", "TaskError", "load_task"]
