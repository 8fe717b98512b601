"""``ddloco up``'s temporary learners (``--extra``: ``step_extra``) and its ``--dashboard [PORT]``:
the run's live page inside ``up`` (``ddloco.dashboard``),
with the operator's actions carried out by ``up`` itself (``--dashboard-actions``): a killed or
stalled learner is one of up's, restarted as after any failure; added learners are up's
temporary ones (``SCAVENGERS`` ids provisioned with keys at the start), stopped after their time.

Threads: the page is served on its own thread (``serve_in_thread``); ``tick`` runs on up's
supervising thread, which owns the processes and the scavengers.
"""
from __future__ import annotations

import secrets
import threading
import time
from pathlib import Path
from typing import Any, Callable

from common import control
from common.keys import Keys
from ddloco.cluster import stop_children

SCAVENGERS = 4
"""Temporary learners the dashboard may add at once (their ids and keys are made at the start)."""


class UpDashboard:
    def __init__(self, port: int, *, actions: bool) -> None:
        self.port, self.actions = port, actions
        self.token = secrets.token_urlsafe(24) if actions else ""
        self.operator: Any = None
        self.view: Any = None
        self.url = ""
        self.scavengers: list[tuple[float, Any]] = []   # (stop at, Child)
        self.stop_asked = threading.Event()   # the page's "stop run": up ends as at its time cap

    def access_line(self) -> str:
        """What ``access.env`` gains: the operator token (``ddloco dashboard --access``)."""
        return f"DDLOCO_OPERATOR_TOKEN={self.token}\n" if self.token else ""

    def start_in(self, run: Any) -> None:
        """Serve the page of ``run`` (an ``up._UpRun`` whose processes and monitor are started)."""
        n = run.extra[0] if run.extra else 0
        self.start(redis_url=run.redis_url, run_id=run.cfg.endpoints.run_id, sup=run.sup, say=run.say,
                   start_learner=run._start_extra, scavenger_ids=run.plan.extra_ids[n:],
                   first_index=run.up.learners + n, stop=self.stop_asked.set)

    def start(self, *, redis_url: str, run_id: str, sup: Any, say: Callable[[str], None],
              start_learner: Callable[[str, int], Any], scavenger_ids: tuple[str, ...], first_index: int,
              stop: Callable[[], None]) -> None:
        from ddloco.dashboard.actions import UpOperator
        from ddloco.dashboard.cli import page_url
        from ddloco.dashboard.collect import RunView
        from ddloco.dashboard.server import Dashboard, serve_in_thread
        r, keys = control.connect(redis_url), Keys(run_id)
        self._sup, self._start_learner, self._ids, self._first = sup, start_learner, scavenger_ids, first_index
        if self.actions:
            self.operator = UpOperator(r, keys, learner_pid=self._learner_pid, shard_pids=self._shard_pids,
                                       add=self._add, stop=stop, restart=self._restart)
        self.view = RunView(r, keys)
        _, port = serve_in_thread(Dashboard(self.view, token=self.token, operator=self.operator), "127.0.0.1", self.port)
        self.url = page_url("127.0.0.1", port, self.token)
        say(f"dashboard  {self.url}" + ("" if self.actions else " (read-only; --dashboard-actions for the buttons)"))

    def _learner_pid(self, learner: str) -> int | None:
        for c in self._sup.learners() + [c for _, c in self.scavengers]:
            if c.name == learner and c.alive():
                return c.pid
        return None

    def _restart(self, learner: str) -> bool:
        if learner not in self._sup.slots:   # a temporary learner: killed for good
            return False
        self._sup.restart(learner)
        return True

    def _shard_pids(self) -> list[int]:
        return [c.pid for c in self._sup.daemons() if c.name.startswith("shard") and c.alive() and c.pid]

    def _add(self, n: int, seconds: float) -> str:
        busy = {c.name for _, c in self.scavengers}
        free = [lid for lid in self._ids if lid not in busy]
        if not free:
            return f"refused: all {len(self._ids)} temporary learner slots are in use"
        started = []
        for lid in free[:n]:
            index = self._first + self._ids.index(lid)
            self.scavengers.append((time.time() + seconds, self._start_learner(lid, index)))
            started.append(lid)
        more = "" if n <= len(started) else f" ({n - len(started)} more than the {len(self._ids)} slots: not started)"
        return f"{', '.join(started)} started for {seconds:g} s{more}"

    def tick(self, now: float, say: Callable[[str], None]) -> None:
        """up's thread, once a second: carry out queued actions, stop scavengers whose time is up."""
        if self.operator is not None:
            self.operator.drain(say)
        due = [c for t, c in self.scavengers if t <= now]
        if due:
            stop_children(due)
            self.scavengers = [(t, c) for t, c in self.scavengers if c not in due]
            say(f"dashboard  temporary learner(s) stopped: {', '.join(c.name for c in due)}")

    def close(self) -> None:
        if self.scavengers:
            stop_children([c for _, c in self.scavengers], timeout_s=5.0)
            self.scavengers = []


def step_extra(run: Any, now: float) -> None:
    """--extra N,AT,FOR of ``run`` (up's thread): N temporary learners from AT s after the start, for FOR s."""
    extra = run.extra
    if run.extra_state == "waiting" and now - run.t_start >= extra[1]:
        for j, lid in enumerate(run.plan.extra_ids[:extra[0]]):
            run.extras.append(run._start_extra(lid, run.up.learners + j))
        run.extra_state = "running"
        run.monitor.mark("extra_start", f"{extra[0]} learners")
        run.say(f"extra      {extra[0]} temporary learner(s) started for {extra[2]:g}s")
    elif run.extra_state == "running" and now - run.t_start >= extra[1] + extra[2]:
        stop_children(run.extras)
        run.extra_state = "done"
        run.monitor.mark("extra_stop", f"{extra[0]} learners")
        run.say("extra      temporary learner(s) stopped")


def page_snapshot(run: Any) -> dict[str, Any]:
    """The dashboard's views of ``run`` once its learners stopped, for ``report.html`` (with
    ``--dashboard``, its own view, lanes included; else one read of Redis)."""
    from ddloco.dashboard.collect import RunView
    view = getattr(run.dashboard, "view", None)
    if view is None:
        view = RunView(control.connect(run.redis_url), Keys(run.cfg.endpoints.run_id))
    return view.poll()


def write_report_html(path: Path, run: Any, report: dict[str, Any]) -> Path:
    """``report.html``: the page drawn once, offline, from ``run.page_snapshot`` and the report's
    eval curve (every evaluation, which the live page saw only from the time it was opened)."""
    from ddloco.dashboard.server import page_html
    snap = dict(run.page_snapshot)
    t0 = run.monitor.t0
    snap["loss"] = [(t0 + float(e["t"]), float(e["tokens"]), float(e["loss"])) for e in report["eval_curve"]
                    if e.get("loss") is not None]
    snap["actions"] = False
    path.write_text(page_html(snap), encoding="utf-8")
    return path
