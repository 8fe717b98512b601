"""Tasks: the ``Task`` contract (``tasks.contract``) and the built-in tasks (gpt, text, gpt-moe,
digits). Read ``tasks/contract.py`` to learn how to bring your own model and data."""
from tasks.contract import BUILTIN, Task, TaskError, build_model, count_tokens, evaluate, hash_data, load_task

__all__ = ["BUILTIN", "Task", "TaskError", "build_model", "count_tokens", "evaluate", "hash_data", "load_task"]
