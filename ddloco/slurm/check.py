"""`make slurm-check`: a run through a live one-node Slurm, as a user would drive it.

    python -m ddloco.slurm.check [--work DIR] [--json]

Starts a local Slurm (local.py), then with `ddloco slurm`: submits the services job and a
3-learner array (gpt task, 100 ms emulated steps); once every learner's answers are merged, at
once ``scancel``s learner-2's array task, requeues learner-1's (``scontrol requeue``; its hold is
lifted at once, where Slurm would wait ~2 min) and adds a 1-task scavenger array on the
preemptible partition; once the scavenger contributes, submits another user's job on the
learners' partition that needs its CPUs (Slurm preempts and requeues it); then SIGKILLs a shard
and Redis inside the services job. Checked: merges go on through every event, learner-1 comes
back under its id (restart 1) and contributes again, the services job starts the killed daemons
again and the learners merge and write to Redis after each, the report (``ddloco slurm stop``
writes it) shows each event, and each shard wrote its final checkpoint at the stop. Exit 0 when
all holds; a missing Slurm is one line and exit 2 (skipped by the tests).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from common.exits import FAILURE, OK, USAGE
from ddloco.slurm.local import LocalSlurm, missing
from ddloco.waiting import wait_for

LEARNER_FLAGS = ["--learner-flag=--step-time-floor-ms=100"]


def _wait(what: str, predicate: Callable[[], Any], timeout_s: float = 180.0) -> Any:
    return wait_for(predicate, timeout_s, what, every_s=0.25)


class Check:
    """The scenario's steps against one local Slurm and one run directory."""

    def __init__(self, slurm: LocalSlurm, run_dir: Path) -> None:
        self.slurm, self.run_dir = slurm, run_dir
        self.t0 = time.monotonic()
        self.r: Any = None

    def say(self, msg: str) -> None:
        print(f"{time.monotonic() - self.t0:6.1f}s  {msg}", flush=True)

    def ddloco(self, *argv: str) -> str:
        p = subprocess.run([sys.executable, "-m", "ddloco", "slurm", *argv], env=self.slurm.env,
                           capture_output=True, text=True, timeout=300)
        if p.returncode != 0:
            raise RuntimeError(f"ddloco slurm {argv[0]} failed: {p.stderr.strip() or p.stdout.strip()}")
        return p.stdout

    def slurm_cmd(self, *argv: str) -> str:
        return subprocess.run(list(argv), env=self.slurm.env, capture_output=True, text=True, timeout=60,
                              check=True).stdout.strip()

    # ------------------------------------------------------------------ the run's state
    def plan(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "plan.json").read_text())

    def redis(self) -> Any:
        if self.r is None:
            from ddloco.slurm.plan import SlurmPlan
            from ddloco.slurm.report import _admin_url
            from common import control
            self.r = control.connect(_admin_url(SlurmPlan.load(self.run_dir)))
        return self.r

    def learner(self, lid: str) -> dict[str, str]:
        from common.keys import Keys
        return self.redis().hgetall(Keys(self.plan()["run_id"]).learner(lid))

    def merges(self) -> int:
        from common import control
        from common.keys import Keys
        return len(control.read_events(self.redis(), Keys(self.plan()["run_id"]), kind="merge"))

    def merged_by(self, lid: str) -> int:
        return int(self.learner(lid).get("merged_contributions") or 0)

    def left(self, lid: str, after: float) -> bool:
        from common import control
        from common.keys import Keys
        return any(e.get("learner") == lid and float(e["t"]) > after
                   for e in control.read_events(self.redis(), Keys(self.plan()["run_id"]), kind="leave"))

    def merges_go_on(self, what: str, n: int = 8) -> None:
        before = self.merges()
        _wait(f"{n} more merges after {what}", lambda: self.merges() >= before + n, 120)
        self.say(f"merges go on after {what}: {self.merges() - before} more")


def _free_span(n: int, also: tuple[int, ...] = ()) -> int:
    """A port p with p .. p+n-1 (and p + each of ``also``) free a moment ago (the run's daemons
    bind fixed ports)."""
    import socket
    from common.redis_server import free_port
    for _ in range(100):
        base, ok = free_port(), True
        for port in [*range(base, base + n), *(base + x for x in also)]:
            with socket.socket() as s:
                try:
                    s.bind(("0.0.0.0", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError(f"no {n} consecutive free ports")


def _ports() -> list[str]:
    peer = _free_span(3, also=(500,))   # learners at peer .. peer+2, scavenger 0 at peer+500
    return ["--redis-port", str(_free_span(1)), "--broker-port", str(_free_span(2)), "--shard-port", str(_free_span(2)),
            "--peer-port", str(peer)]


def _scenario(c: Check) -> dict[str, Any]:
    c.say("submit: services job + learners 0..2")
    c.ddloco("submit", "--run-dir", str(c.run_dir), "--learners", "3", "--shards", "2", "--services-partition",
             "services", "--learner-partition", "learners", "--scavenge-partition", "scavenge", *_ports(),
             *LEARNER_FLAGS)
    _wait("the services job's endpoints", lambda: (c.run_dir / "endpoints.env").exists(), 120)
    for lid in ("learner-0", "learner-1", "learner-2"):
        _wait(f"{lid}'s answers merged", lambda lid=lid: c.merged_by(lid) > 0, 180)
    c.say("every learner's answers are merged")
    # at once: learner-2 scancelled, learner-1 requeued, a scavenger array added (their boots overlap)
    array = c.plan()["job_ids"]["learners"][0]
    t = time.time()
    incarnation = c.learner("learner-1").get("incarnation")
    c.slurm_cmd("scancel", f"{array}_2")
    c.slurm_cmd("scontrol", "requeue", f"{array}_1")
    c.ddloco("add", "--run-dir", str(c.run_dir), "--scavengers", "1")
    _wait("learner-2 leaves", lambda: c.left("learner-2", t), 90)
    c.say("learner-2 cancelled (scancel): it left the run")
    _wait("learner-1 leaves", lambda: c.left("learner-1", t), 90)
    _wait("learner-1 pending", lambda: "PENDING" in c.slurm_cmd("squeue", "-h", "-j", f"{array}_1", "-o", "%T"), 60)
    c.slurm_cmd("scontrol", "update", f"JobId={array}_1", "StartTime=now")   # Slurm's requeue hold, lifted
    c.merges_go_on("the scancel and the requeue")
    _wait("learner-1 back (a new life)", lambda: c.learner("learner-1").get("incarnation") not in (None, incarnation))
    back = time.time()   # the old life ended long before: a merge from now on is the new life's
    _wait("learner-1's answers merged again", lambda: float(c.learner("learner-1").get("last_merged_at") or 0) > back,
          180)
    c.say("learner-1 requeued: it came back under its id and contributes")
    _wait("scav-0's answers merged", lambda: c.merged_by("scav-0") > 0, 180)
    c.say("scavenger scav-0 contributes")
    return _preempt(c)


def _preempt(c: Check) -> dict[str, Any]:
    t = time.time()
    other = c.slurm_cmd("sbatch", "--parsable", "-p", "learners", "-c", str(c.slurm.cpus - 2 - 2 * 2),
                        "-o", "/dev/null", "--wrap", "sleep 600").split(";")[0]
    _wait("scav-0 preempted", lambda: c.left("scav-0", t), 120)
    c.say(f"another user's job {other} preempted scav-0 (requeued by Slurm)")
    c.merges_go_on("the preemption")
    scavengers = c.plan()["job_ids"]["scavengers"][0]
    try:   # requeued: pending again once its processes ended (it leaves first, then COMPLETING)
        state = _wait("scav-0 requeued (pending)", lambda: (lambda s: s if "PENDING" in s else None)(
            c.slurm_cmd("squeue", "-h", "-j", scavengers, "-o", "%T")), 90)
    except TimeoutError:
        state = c.slurm_cmd("squeue", "-h", "-j", scavengers, "-o", "%T")
    c.slurm_cmd("scancel", other)
    _services_crashes(c)
    return {"scavenger_state_after_preemption": state}


def _services_crashes(c: Check) -> None:
    """SIGKILL a shard, then Redis, inside the services job: it starts each again (Redis from its
    append-only file, the learners' users with the same passwords) and the learners go on."""
    import os
    import signal
    plan = c.plan()
    for what, pattern in (("shard 1", f"syncer .*--shard 1 .*--run-id {plan['run_id']}"),
                          ("Redis", f"redis-server .*:{plan['redis_port']}$")):
        old = _pid(pattern, what)
        os.kill(old, signal.SIGKILL)
        c.r = None    # a new connection (Redis restarts)
        _wait(f"{what} started again by the services job", lambda: _pid(pattern, what, must=False) not in (None, old), 60)
        ids = ("learner-0", "learner-1")
        merged = {lid: _safe(lambda lid=lid: c.merged_by(lid)) or 0 for lid in ids}
        steps = {lid: _safe(lambda lid=lid: int(c.learner(lid).get("steps") or 0)) or 0 for lid in ids}
        _wait(f"learners merged again after {what}'s restart",   # the shards' record, and each learner's own
              lambda: _safe(lambda: all(c.merged_by(lid) > merged[lid] for lid in ids)
                            and all(int(c.learner(lid).get("steps") or 0) > steps[lid] for lid in ids)), 120)
        c.say(f"{what} SIGKILLed inside the services job: started again; learners 0 and 1 merged and reported "
              "to Redis again")


def _pid(pattern: str, what: str, must: bool = True) -> int | None:
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    if not found and must:
        ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
        raise RuntimeError(f"no process of {what} ({pattern!r}) in the services job:\n{ps}")
    return int(found[0]) if found else None


def _safe(f: Callable[[], Any]) -> Any:
    """f(), or None while Redis restarts."""
    import redis
    try:
        return f()
    except (redis.RedisError, OSError):
        return None


def _verify(c: Check, rep: dict[str, Any], extra: dict[str, Any]) -> list[str]:
    """What the report must show (each problem one line)."""
    problems = []
    lr = rep["learners"]
    if lr.get("learner-1", {}).get("requeued", 0) < 1:
        problems.append("learner-1's requeue is not in the report")
    for lid in ("learner-2", "scav-0"):
        if not any(e["event"] == "signalled" for e in lr.get(lid, {}).get("slurm", [])):
            problems.append(f"{lid}: no SIGTERM in its Slurm events")
        if not lr.get(lid, {}).get("absences"):
            problems.append(f"{lid}: its leave is not in the report")
    for lid in lr:
        for a in lr[lid]["absences"]:
            if a["merges_meanwhile"] == 0 and a["back"] is not None:
                problems.append(f"{lid}: no merge while it was away ({a})")
    for shard in sorted((c.run_dir / "logs").glob("shard*.log")):   # the stop's final checkpoint
        lines = [x for x in shard.read_text(errors="replace").splitlines() if '"syncer.checkpoint"' in x]
        if not any('"reason": "stop"' in x for x in lines):
            problems.append(f"{shard.name}: no final checkpoint at the stop")
    if "PENDING" not in extra["scavenger_state_after_preemption"]:
        problems.append(f"scav-0 not requeued after preemption: {extra['scavenger_state_after_preemption']!r}")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ddloco.slurm.check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="", help="work directory (default: a new temporary one)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON at the end")
    args = ap.parse_args(argv)
    reason = missing()
    if reason:
        print(f"slurm-check skipped: {reason}", file=sys.stderr)
        return USAGE
    work = Path(args.work or tempfile.mkdtemp(prefix="ddloco-slurm-")).resolve()
    slurm = LocalSlurm(work / "slurm").start()
    c = Check(slurm, work / "run")
    c.say(f"local Slurm up ({slurm.cpus} CPUs declared, partitions services, learners, scavenge) in {work}")
    try:
        extra = _scenario(c)
        c.ddloco("stop", "--run-dir", str(c.run_dir))
        rep = json.loads((c.run_dir / "report.json").read_text())
    finally:
        slurm.stop()
    problems = _verify(c, rep, extra)
    if args.json:
        print(json.dumps(rep, indent=2))
    c.say(f"report: {rep['merges']} merges, longest pause {rep['longest_merge_pause_s']} s; "
          + ("all checks hold" if not problems else "PROBLEMS: " + "; ".join(problems)))
    return OK if not problems else FAILURE


if __name__ == "__main__":
    sys.exit(main())
