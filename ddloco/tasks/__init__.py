"""Tasks: the ``Task`` contract (``common.task``) and the built-in tasks (gpt, text, gpt-moe,
digits). Read ``common/task.py`` to learn how to bring your own model and data."""
from common.task import BUILTIN, Task, TaskError, build_model, count_tokens, evaluate, hash_data, load_task

__all__ = ["BUILTIN", "Task", "TaskError", "build_model", "count_tokens", "evaluate", "hash_data", "load_task"]
