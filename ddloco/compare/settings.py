"""The settings every `ddloco compare` run shares: ``--set`` overrides, the task's tokens per
batch, and the bytes our cluster's learners moved per token (from an `up` report).
"""
from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Sequence

from common.config import ConfigError, RunConfig, run_config_from_dict


def parse_set(items: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``--set algo.outer_lr=1.0`` → {"algo": {"outer_lr": 1.0}} (values parsed as JSON, else str)."""
    out: dict[str, dict[str, Any]] = {"task": {}, "algo": {}}
    for item in items:
        key, sep, raw = item.partition("=")
        section, dot, name = key.partition(".")
        if not sep or not dot or section not in out:
            raise ConfigError(f"--set wants task.KEY=VALUE or algo.KEY=VALUE, got {item!r}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out[section][name] = value
    return out


def apply_sets(run: RunConfig, sets: dict[str, dict[str, Any]]) -> RunConfig:
    """``run`` with the ``parse_set`` overrides applied (validated like a TOML file); ``task.KEY``
    other than spec and seed is a task arg."""
    d = run.to_dict()
    task_sets = dict(sets.get("task", {}))
    task = {**d["task"], **{k: task_sets.pop(k) for k in ("spec", "seed") if k in task_sets}}
    task["args"] = {**task["args"], **task_sets}
    task["name"], task["config"] = "", {}  # re-bound by every process from spec and args
    return run_config_from_dict({"task": task, "algo": {**d["algo"], **sets.get("algo", {})}})


def tokens_per_batch(run: RunConfig) -> int:
    from common.task import bind_task, count_tokens
    task, run = bind_task(run)
    return count_tokens(task, next(iter(task.batches(0, run.task.seed, 0))))


def cluster_bytes_per_token(rep: dict[str, Any]) -> float:
    """Bytes every learner sent and received per token (a broadcast counts once per receiving
    learner, like the DP and sync-DiLoCo figures; not the shards' once-per-broadcast count)."""
    moved = sum(float(h.get("bytes_up", 0) or 0) + float(h.get("bytes_down", 0) or 0)
                for h in rep["learner_stats"].values())
    return moved / max(1, int(rep["tokens_total"]))


def system_run(system: str, run: RunConfig, learners: int) -> RunConfig:
    """The run config a system trains with (the lock-step and fp32 variants change one knob)."""
    if system == "decoupled_fp32":
        return replace(run, algo=replace(run.algo, uplink_codec="fp32"))
    if system == "decoupled_lockstep":
        return replace(run, algo=replace(run.algo, lockstep=True, quorum=learners))
    return run
