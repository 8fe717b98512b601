"""What a stopped `ddloco up` run leaves behind for ``up --resume``, and how it is found again.

At its end `up` writes ``state.json`` next to the shard checkpoints (``write_state``): the
learners' data positions, the token count and every learner's share of it, the eval curve.
``resolve_resume`` finds a stopped run by run id or directory; ``check_resume`` refuses a resume
with another shard count. Every function here runs on `up`'s main thread.
"""
from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path
from typing import Any, Callable

from common import tokens as run_count
from common.config import ConfigError
from common.files import write_atomic
from common.keys import Keys

STATE_FILE = "state.json"
"""Written into a run's work directory at the end of ``up``: what ``up --resume`` continues from."""


DEFAULT_RUN_ID_PREFIX = "demo"


def new_run_id(prefix: str = DEFAULT_RUN_ID_PREFIX) -> str:
    """A run id for a run given none (``demo-1f9a3c``): unique, so that every run's work
    directory, Redis keys and ``--resume`` name are its own, and short enough to type."""
    return f"{prefix}-{secrets.token_hex(3)}"


def _stopped_run(d: Path) -> tuple[dict[str, Any] | None, str]:
    """The state of the stopped run in work directory ``d``, or None and why ``--resume`` cannot
    continue it (no directory, no readable state file, no shard checkpoints of its run id)."""
    if not d.is_dir():
        return None, "no such directory"
    try:
        state = json.loads((d / STATE_FILE).read_text())
    except (OSError, ValueError):
        state = None
    run_id = state.get("run_id") if isinstance(state, dict) else None
    if not isinstance(run_id, str):
        return None, f"no readable {STATE_FILE}: not a stopped `ddloco up` run, or it ended before writing it"
    if not any((d / "checkpoints").glob(f"{run_id}-shard*of*.pt")):
        return None, f"no shard checkpoints of run {run_id!r} in {d / 'checkpoints'}"
    return state, ""


def _describe_stopped(d: Path, state: dict[str, Any]) -> str:
    stopped = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime((d / STATE_FILE).stat().st_mtime))
    return (f"--resume {d}   (stopped {stopped}, versions {state.get('versions_total', '?')}, "
            f"{int(state.get('tokens_total') or 0):,} tokens)")


def resolve_resume(arg: str, runs_dir: Path = Path("runs")) -> tuple[Path, dict[str, Any]]:
    """``--resume ARG``: the work directory of a stopped run and its state. ARG is a run id (the
    one directory under ``runs_dir`` whose state names it) or a work directory (a path, or a
    directory name under ``runs_dir``). ConfigError, before anything is created, when none or
    several match (listing them, and how to pick one)."""
    is_path = "/" in arg or os.sep in arg or Path(arg).is_dir()
    if is_path or (runs_dir / arg).is_dir():
        d = Path(arg) if is_path else runs_dir / arg
        state, why = _stopped_run(d)
        if state is None:
            raise ConfigError(f"--resume {arg}: {why}")
        return d, state
    found = [(d.parent, state) for d in runs_dir.glob(f"*/{STATE_FILE}")
             for state in [_stopped_run(d.parent)[0]] if state is not None and state["run_id"] == arg]
    found.sort(key=lambda ds: ((ds[0] / STATE_FILE).stat().st_mtime, ds[0].name))
    if not found:
        raise ConfigError(f"--resume {arg}: no stopped run {arg!r} with checkpoints under {runs_dir}/ "
                          f"(give its run id or its directory, {runs_dir}/<run-id>-<time>)")
    if len(found) > 1:
        raise ConfigError(f"--resume {arg}: {len(found)} stopped runs have run id {arg!r}; pick one by passing "
                          f"its directory:\n" + "\n".join(f"  {_describe_stopped(d, s)}" for d, s in found))
    return found[0]


def check_resume(previous: dict[str, Any], syncers: int) -> None:
    """A stopped run resumes only with its shard count (shard ownership is p % S)."""
    if previous.get("syncers") != syncers:
        raise ConfigError(f"--resume: the run had {previous.get('syncers')} syncers; shard ownership is "
                          f"p % S, so resume it with --syncers {previous.get('syncers')}")



def write_state(workdir: Path, report: dict[str, Any], monitor: Any, syncers: int,
                 previous: dict[str, Any], token_shares: dict[str, int]) -> None:
    """What a later ``up --resume`` needs: learners' data positions, tokens (the total and every
    learner process's share of the run's count, common/tokens.py), the eval curve."""
    positions = dict(previous.get("data_positions", {}))
    for lid, h in monitor.learners.items():
        if "data_position" in h:
            positions[lid] = int(float(h["data_position"]))
    versions = monitor.final_versions or {}
    state = {"run_id": report["run_id"], "syncers": syncers, "tokens_total": report["tokens_total"],
             "token_shares": token_shares, "data_positions": positions, "versions_total": sum(versions.values()),
             "eval_curve": previous.get("eval_curve", []) + report["eval_curve"]}
    write_atomic(workdir / STATE_FILE, json.dumps(state, indent=2))


def final_token_shares(r: Any, keys: Keys, previous: dict[str, Any]) -> dict[str, int]:
    """Every learner process's final share of the run's token count, earlier parts' included
    (read when all stopped; the earlier parts' alone if Redis cannot be read)."""
    import redis as redis_lib
    try:
        return run_count.merge_shares({}, r.hgetall(keys.token_shares))
    except redis_lib.RedisError:
        return run_count.merge_shares({}, previous.get("token_shares", {}))



def adopt_freshest_model(monitor: Any, checkpoint_dir: str, run_id: str, task: Any,
                          say: Callable[[str], None]) -> None:
    """Ctrl-C: the freshest complete global model becomes the run's final one (the report's last
    loss, model.safetensors, state.json): the shards' checkpoints, written as they stopped, unless
    the last live evaluation holds more merges (a shard that did not stop in time)."""
    from ddloco.export import ExportError, from_checkpoints
    monitor.wait_evaluation()
    live = sum(monitor.versions.values())
    try:
        model, versions = from_checkpoints(checkpoint_dir, run_id, task=task)
    except (ExportError, OSError, ValueError) as e:  # ValueError: TaskError, ConfigError
        model, versions = None, {}
        say(f"final      checkpoints unreadable ({e})")
    if model is not None and sum(versions.values()) >= live:
        monitor.adopt_final(model, versions)
    else:
        monitor.final_versions = dict(monitor.versions)
        say(f"final      the last live evaluation (fragment versions {live}) is the final model")



def read_resumed_model(checkpoint_dir: str, run_id: str, task: Any, say: Callable[[str], None]) -> Any:
    """The model the stopped run ended with, read before any daemon starts: the resumed run's
    first evaluation (learners forked from the factory may merge within seconds); None if unreadable."""
    from ddloco.export import ExportError, from_checkpoints
    try:
        return from_checkpoints(checkpoint_dir, run_id, task=task)
    except (ExportError, OSError, ValueError) as e:
        say(f"resume     checkpoints unreadable ({e}); the first evaluation asks the shards")
        return None
