"""The dashboard's operator actions: stall or kill a learner, add temporary learners, write a
checkpoint, stop the run. Each is recorded in the run's events stream (kind ``action``) and so
shown on every page.

Two kinds of operator:
- ``UpOperator``: the dashboard runs inside ``ddloco up``; an action is queued and carried out on
  ``up``'s supervising thread (which owns the processes), at its next tick (at most a second);
  a killed learner is restarted by ``up`` as after any failure.
- ``ProcessOperator``: ``ddloco dashboard --actions`` beside a cluster started by hand on this
  machine; the processes are found through Redis (their pids, as ``ddloco chaos`` finds them);
  adding learners and stopping the run are ``up``'s and are refused here.

Threads: the page's request handlers call ``submit``; ``UpOperator.drain`` runs on up's thread.
"""
from __future__ import annotations

import os
import queue
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import redis

from common import control
from common.keys import Keys

ACTIONS = ("kill", "stall", "add", "checkpoint", "stop")
MAX_STALL_S = 600.0
MAX_ADD = 64
MAX_ADD_S = 24 * 3600.0


class ActionError(ValueError):
    """A request the operator cannot carry out (unknown action, bad argument, no such learner)."""


@dataclass(frozen=True)
class Action:
    kind: str
    learner: str = ""
    n: int = 0
    seconds: float = 0.0


def parse_action(body: dict[str, Any]) -> Action:
    """A checked ``Action`` from a request's JSON body; ``ActionError`` naming what is wrong."""
    kind = str(body.get("action", ""))
    if kind not in ACTIONS:
        raise ActionError(f"action must be one of {', '.join(ACTIONS)}, got {kind!r}")
    learner = str(body.get("learner", ""))
    if kind in ("kill", "stall") and not learner:
        raise ActionError(f"{kind} needs a learner")
    try:
        n, seconds = int(body.get("n", 0)), float(body.get("seconds", 0))
    except (TypeError, ValueError):
        raise ActionError("n must be an integer and seconds a number") from None
    if kind == "stall" and not 0 < seconds <= MAX_STALL_S:
        raise ActionError(f"stall needs 0 < seconds <= {MAX_STALL_S:g}")
    if kind == "add" and not (0 < n <= MAX_ADD and 0 < seconds <= MAX_ADD_S):
        raise ActionError(f"add needs 0 < n <= {MAX_ADD} and 0 < seconds <= {MAX_ADD_S:g}")
    return Action(kind, learner, n, seconds)


def record(r: redis.Redis, keys: Keys, action: Action, outcome: str) -> None:
    """The action in the run's events stream (what every page's timeline marks)."""
    control.add_event(r, keys, "action", action=action.kind, learner=action.learner, n=action.n,
                      seconds=action.seconds, reason=outcome)


def _signal_pid(pid: int | None, sig: int, what: str) -> None:
    if pid is None:
        raise ActionError(f"{what} is not running on this machine")
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        raise ActionError(f"{what} is not running (pid {pid})") from None


def stall(pid: int | None, what: str, seconds: float) -> None:
    """SIGSTOP now, SIGCONT after ``seconds`` (a timer thread; a process gone meanwhile is fine)."""
    _signal_pid(pid, signal.SIGSTOP, what)

    def resume() -> None:
        try:
            os.kill(pid, signal.SIGCONT)   # type: ignore[arg-type]
        except ProcessLookupError:
            pass
    t = threading.Timer(seconds, resume)
    t.daemon = True
    t.start()


class ProcessOperator:
    """Actions on a cluster on this machine started by hand (``ddloco dashboard --actions``)."""

    def __init__(self, r: redis.Redis, keys: Keys) -> None:
        from ddloco.chaos import ProcessTargets
        self.r, self.keys = r, keys
        self.targets = ProcessTargets(r, keys, redis_url="", broker_pub="", log_dir=Path("runs") / "dashboard")

    def submit(self, action: Action) -> str:
        if action.kind in ("add", "stop"):
            raise ActionError(f"{action.kind} is `ddloco up`'s: open the dashboard with `ddloco up --dashboard`")
        if action.kind == "checkpoint":
            shards = control.shard_table(self.r, self.keys)
            for k in shards:
                _signal_pid(self.targets.pid(f"shard{k}"), signal.SIGUSR1, f"shard {k}")
            outcome = f"checkpoint asked of {len(shards)} shard(s)"
        elif action.kind == "kill":
            _signal_pid(self.targets.pid(action.learner), signal.SIGKILL, f"learner {action.learner}")
            outcome = f"{action.learner} killed"
        else:
            stall(self.targets.pid(action.learner), f"learner {action.learner}", action.seconds)
            outcome = f"{action.learner} stalled for {action.seconds:g} s"
        record(self.r, self.keys, action, outcome)
        return outcome


class UpOperator:
    """Actions queued for ``ddloco up``'s supervising thread (``drain`` there, once a tick)."""

    def __init__(self, r: redis.Redis, keys: Keys, learner_pid: Callable[[str], int | None],
                 shard_pids: Callable[[], list[int]], add: Callable[[int, float], str], stop: Callable[[], None],
                 restart: Callable[[str], bool] | None = None) -> None:
        """``restart(learner)``: start a killed learner again (up's, as the chaos harness does); False
        when it is not one up restarts (a temporary learner)."""
        self.r, self.keys, self._restart = r, keys, restart
        self._learner_pid, self._shard_pids, self._add, self._stop = learner_pid, shard_pids, add, stop
        self._queue: queue.SimpleQueue[Action] = queue.SimpleQueue()

    def submit(self, action: Action) -> str:
        self._queue.put(action)
        return f"{action.kind} queued"

    def drain(self, say: Callable[[str], None] = print) -> None:
        """Carry out the queued actions (up's thread); each outcome, or why not, is recorded."""
        while True:
            try:
                action = self._queue.get_nowait()
            except queue.Empty:
                return
            try:
                outcome = self._carry_out(action)
            except ActionError as e:
                outcome = f"refused: {e}"
            say(f"dashboard  {action.kind} {action.learner}: {outcome}".rstrip())
            try:
                record(self.r, self.keys, action, outcome)
            except redis.RedisError:
                pass

    def _carry_out(self, action: Action) -> str:
        if action.kind == "kill":
            _signal_pid(self._learner_pid(action.learner), signal.SIGKILL, f"learner {action.learner}")
            if self._restart is not None and self._restart(action.learner):
                return f"{action.learner} killed; restarted"
            return f"{action.learner} killed"
        if action.kind == "stall":
            stall(self._learner_pid(action.learner), f"learner {action.learner}", action.seconds)
            return f"{action.learner} stalled for {action.seconds:g} s"
        if action.kind == "checkpoint":
            pids = self._shard_pids()
            for pid in pids:
                _signal_pid(pid, signal.SIGUSR1, "a shard")
            return f"checkpoint asked of {len(pids)} shard(s)"
        if action.kind == "add":
            return self._add(action.n, action.seconds)
        self._stop()
        return "stopping the run"
