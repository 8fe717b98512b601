"""The chaos harness: seeded failures injected into a running cluster, and what they cost.

    ddloco up --chaos "seed=7,learner_mtbf_s=60,stalls=3,stall_s=20,shard_kills=1,shard_wipes=1,broker_restarts=1,redis_restarts=1"
    ddloco chaos "seed=7,learner_mtbf_s=60" --redis-url redis://host:6379/0 --run-id demo --minutes 4

SPEC is comma-separated ``key=value`` (scripts depend on these names):

    seed             schedule seed (default 0)
    learner_mtbf_s   mean time between SIGKILLs of each learner (exponential; 0: none)
    stalls           learners frozen with SIGSTOP, resumed with SIGCONT after stall_s
    stall_s          length of a stall (default 20)
    shard_kills      syncer shards SIGKILLed and restarted (with their checkpoint)
    shard_wipes      syncer shards SIGKILLed, their checkpoint deleted, restarted
    broker_restarts  broker SIGKILLed and restarted on the same endpoints
    redis_restarts   Redis SIGKILLed and restarted empty on the same port

Every fault is drawn from ``seed`` over the run (learner kills by their MTBF, the others spread
between 15 % and 80 % of it) and what was killed is restarted at once by a supervisor. While it
runs, the harness watches Redis every 50 ms and measures, per fault: detection (a killed learner's
incarnation leaves membership, or its replacement is seen; a stalled learner's heartbeat expires),
rejoin (restart -> the first merge holding the replacement's first answer), and for shards the time
to their first merge after the restart. Versions that go back anywhere are counted.

The spec and the seeded schedule are ``ddloco/chaos_plan.py`` (pure). Threads: a ``ChaosRunner`` is
a thread of its own and owns its measurements (``_watch``, ``_stalled``, ``_frag_max``, the
counters); ``injected`` is shared with the caller's thread under ``lock``, ``results`` is read
after ``halt``. It kills and restarts only through its ``Targets``, holding their ``lock`` (a kill
and its restart are one step for whoever watches them: `up`'s supervisor).
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import redis

from common import control
from common import exits
from common.config import ConfigError
from common.keys import Keys
from common.lifecycle import pid_alive
from ddloco.chaos_plan import KINDS, ChaosSpec, Fault, parse_chaos, plan_faults  # noqa: F401 (importable here)

class Targets(Protocol):
    """What the harness can kill and restart (``ddloco up``'s own processes, or a running cluster's)."""

    lock: Any
    """Held from a kill to its restart."""

    def pid(self, target: str) -> int | None: ...
    def restart(self, target: str) -> None: ...
    def checkpoint_path(self, shard: int) -> Path | None: ...
    def restart_redis(self) -> None: ...


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


class ChaosRunner(threading.Thread):
    """Injects ``faults`` at their times (seconds after ``t0``, wall clock) and measures them."""

    def __init__(self, faults: list[Fault], targets: Targets, *, redis_url: str, keys: Keys, t0: float,
                 say: Callable[[str], None], stop: threading.Event, stall_s: float = 20.0) -> None:
        super().__init__(name="chaos", daemon=True)
        self.stall_s = stall_s
        self.report_t0 = 0.0
        """Where ``t0`` lies on the report's clock (seconds)."""
        self.halted = threading.Event()
        self.idle = threading.Event()
        self.faults = list(faults)
        self.targets = targets
        self.redis_url = redis_url
        self.keys = keys
        self.t0 = t0
        self.say = say
        self.stop_event = stop
        self.injected: list[dict[str, Any]] = []
        """One record per fault: t, kind, target, and what was measured."""
        self._watch: list[dict[str, Any]] = []
        self._frag_max: dict[int, int] = {}
        self.shard_versions_regressed = 0
        self.merges_lost = 0
        self._stalled: dict[str, tuple[int, float]] = {}
        self.lock = threading.Lock()
        self.error: str = ""

    # ------------------------------------------------------------------ loop
    def halt(self, timeout_s: float = 30.0) -> None:
        """Stop injecting and observing, and return once no injection is under way. The thread
        stays alive until ``stop``: processes it restarted get the parent-death signal when the
        thread that started them ends (Linux ``PR_SET_PDEATHSIG`` follows the thread)."""
        self.halted.set()
        self.idle.wait(timeout_s)

    def run(self) -> None:
        self.r = control.connect(self.redis_url)
        pending = list(self.faults)
        while not self.stop_event.is_set():
            if self.halted.is_set():
                break
            now = time.time()
            while pending and now - self.t0 >= pending[0].at_s:
                fault = pending.pop(0)
                try:
                    self._inject(fault, now)
                except Exception as e:  # a fault that cannot be injected is reported, the run goes on
                    self.error = f"{fault.kind} {fault.target}: {e!r}"
                    self.say(f"chaos      could not inject {fault.kind} on {fault.target}: {e!r}")
            for lid, (pid, until) in list(self._stalled.items()):
                if now >= until:
                    _signal(pid, signal.SIGCONT)
                    del self._stalled[lid]
                    self._mark(time.time(), "resume", lid)
            try:
                self._observe(time.time())
            except redis.RedisError:
                pass  # Redis is down (maybe by our hand): observe again when it is back
            self.stop_event.wait(0.05)
        for _lid, (pid, _) in self._stalled.items():  # never leave a process frozen
            _signal(pid, signal.SIGCONT)
        self._stalled.clear()
        self.idle.set()
        self.stop_event.wait()

    def _ts(self, t: float) -> str:
        return f"[{t - self.t0 + self.report_t0:6.1f}s]"

    def _mark(self, t: float, kind: str, target: str, **extra: Any) -> dict[str, Any]:
        rec = {"t": round(t - self.t0, 3), "kind": kind, "target": target, **extra}
        with self.lock:
            self.injected.append(rec)
        try:   # in the run's events too: the dashboard marks each fault on its learner's lane
            control.add_event(self.r, self.keys, "chaos", action=kind, target=target, reason="injected by the chaos harness")
        except (redis.RedisError, AttributeError):   # Redis restarting (a fault of its own), or not connected yet
            pass
        return rec

    def _inject(self, fault: Fault, now: float) -> None:
        # a kill and its restart are one step for whoever watches the targets (``up``'s loop)
        with self.targets.lock:
            self._inject_locked(fault, now)

    def _inject_locked(self, fault: Fault, now: float) -> None:
        tg = self.targets
        if fault.kind == "learner_kill":
            pid = tg.pid(fault.target)
            if pid is None:
                return
            inc = self._incarnation(fault.target)
            self._stalled.pop(fault.target, None)
            _signal(pid, signal.SIGKILL)
            killed_at = time.time()
            tg.restart(fault.target)
            restarted_at = time.time()
            rec = self._mark(killed_at, "learner_kill", fault.target, pid=pid)
            self.say(f"chaos      {self._ts(killed_at)} SIGKILL {fault.target} (pid {pid}); restarted")
            self._watch.append({"rec": rec, "what": "learner_kill", "lid": fault.target, "inc": inc,
                                "killed_at": killed_at, "restarted_at": restarted_at})
        elif fault.kind == "stall":
            pid = tg.pid(fault.target)
            if pid is None or fault.target in self._stalled:
                return
            spec_s = self.stall_s
            _signal(pid, signal.SIGSTOP)
            at = time.time()
            self._stalled[fault.target] = (pid, at + spec_s)
            rec = self._mark(at, "stall", fault.target, pid=pid, stall_s=spec_s)
            self.say(f"chaos      {self._ts(at)} SIGSTOP {fault.target} (pid {pid}) for {spec_s:g}s")
            self._watch.append({"rec": rec, "what": "stall", "lid": fault.target, "killed_at": at,
                                "inc": self._incarnation(fault.target), "resume_at": at + spec_s})
        elif fault.kind in ("shard_kill", "shard_wipe"):
            k = int(fault.target.removeprefix("shard"))
            pid = tg.pid(fault.target)
            if pid is None:
                return
            holder_before = self._lease_holder(k)
            _signal(pid, signal.SIGKILL)
            at = time.time()
            wiped = ""
            if fault.kind == "shard_wipe":
                path = tg.checkpoint_path(k)
                if path is not None and path.exists():
                    path.unlink()
                    wiped = str(path)
            tg.restart(fault.target)
            rec = self._mark(at, fault.kind, fault.target, pid=pid, **({"deleted": wiped} if wiped else {}))
            self.say(f"chaos      {self._ts(at)} SIGKILL {fault.target} (pid {pid})"
                     + (f", deleted {wiped}" if wiped else "") + "; restarted")
            self._watch.append({"rec": rec, "what": "shard", "shard": k, "killed_at": at, "holder": holder_before})
        elif fault.kind == "broker_restart":
            pid = tg.pid("broker")
            if pid is None:
                return
            _signal(pid, signal.SIGKILL)
            at = time.time()
            tg.restart("broker")
            self._mark(at, "broker_restart", "broker", pid=pid)
            self.say(f"chaos      {self._ts(at)} SIGKILL broker (pid {pid}); restarted")
        elif fault.kind == "redis_restart":
            at = time.time()
            tg.restart_redis()
            self._mark(at, "redis_restart", "redis", down_s=round(time.time() - at, 3))
            self.say(f"chaos      {self._ts(at)} Redis killed and restarted empty")
            self.r = control.connect(self.redis_url)

    # ------------------------------------------------------------------ observation
    def _incarnation(self, lid: str) -> str | None:
        try:
            return self.r.hget(self.keys.learner(lid), "incarnation")
        except redis.RedisError:
            return None

    def _lease_holder(self, k: int) -> str | None:
        try:
            return self.r.get(self.keys.shard_lease(k))
        except redis.RedisError:
            return None

    def _observe(self, now: float) -> None:
        n = int(self.r.hget(self.keys.config, "fragments") or 0) or len(self._frag_max)
        for p, v in control.fragment_versions(self.r, self.keys, range(n)).items():
            if v is None:
                continue  # Redis restarted: the shard writes it again
            top = self._frag_max.get(p, -1)
            if v < top:
                self.shard_versions_regressed += 1
                self.merges_lost += top - v
                self.say(f"chaos      fragment {p} went back from version {top} to {v}")
            self._frag_max[p] = max(top, v)
        if not self._watch:
            return
        # the stream once per pass (every 50 ms), from the oldest fault still watched
        merges = self._merges_since(min(w["killed_at"] for w in self._watch))
        live = None
        for w in list(self._watch):
            rec = w["rec"]
            if w["what"] in ("learner_kill", "stall"):
                lid = w["lid"]
                h = self.r.hgetall(self.keys.learner(lid))
                if "detect_s" not in rec:
                    if live is None:
                        live = control.live_learners(self.r, self.keys)
                    replaced = w["what"] == "learner_kill" and h.get("incarnation") not in (None, w["inc"])
                    if replaced or lid not in live:
                        rec["detect_s"] = round(now - w["killed_at"], 3)
                if w["what"] == "learner_kill" and "rejoin_s" not in rec:
                    t = self._first_merge_of_new_life(lid, h, w, merges)
                    if t is not None:
                        rec["rejoin_s"] = round(t - w["restarted_at"], 3)
                if w["what"] == "stall" and "rejoin_s" not in rec and now > w["resume_at"]:
                    merged = float(h.get("last_merged_at") or 0)
                    if merged > w["resume_at"]:
                        rec["rejoin_s"] = round(merged - w["resume_at"], 3)
                if "detect_s" in rec and "rejoin_s" in rec:
                    self._watch.remove(w)
            elif w["what"] == "shard":
                if "detect_s" not in rec and self._lease_holder(w["shard"]) not in (None, w["holder"]):
                    rec["detect_s"] = round(now - w["killed_at"], 3)  # the lease moved to the new life
                merged = [e for e in merges
                          if int(e.get("shard", -1)) == w["shard"] and float(e["t"]) >= w["killed_at"]]
                if merged and "back_s" not in rec:
                    rec["back_s"] = round(float(merged[0]["t"]) - w["killed_at"], 3)
                if "back_s" in rec and "detect_s" in rec:
                    self._watch.remove(w)

    def _merges_since(self, t: float) -> list[dict[str, Any]]:
        start = f"{int(t * 1000)}-0"
        return [e for _, e in self.r.xrange(self.keys.events, min=start) if e.get("kind") == "merge"]

    def _first_merge_of_new_life(self, lid: str, h: dict[str, str], w: dict[str, Any],
                                 merges: list[dict[str, Any]]) -> float | None:
        """When the replacement's first answer was merged: the merge of the round it first
        answered (an answer the killed process sent is never taken for the replacement's)."""
        if h.get("incarnation") in (None, w["inc"]) or not h.get("first_answer"):
            return None
        frag, rnd, at = h["first_answer"].split(":")
        for e in merges:
            if float(e["t"]) >= float(at) - 0.001 and lid in json.loads(e.get("contributors", "[]")):
                # that round; or, when that answer came too late, the next merge well after it
                if int(e["fragment"]) == int(frag) and int(e["round"]) == int(rnd) or float(e["t"]) > float(at) + 1.0:
                    return float(e["t"])
        return None

    # ------------------------------------------------------------------ results
    def results(self) -> dict[str, Any]:
        with self.lock:
            recs = [dict(r) for r in self.injected]
        faults = [r for r in recs if r["kind"] in KINDS]
        by_kind = {k: sum(1 for r in faults if r["kind"] == k) for k in KINDS}
        learner = [r for r in faults if r["kind"] in ("learner_kill", "stall")]
        kills = [r for r in faults if r["kind"] == "learner_kill"]
        shards = [r for r in faults if r["kind"] in ("shard_kill", "shard_wipe")]
        detect = [r["detect_s"] for r in learner if "detect_s" in r]
        rejoin = [r["rejoin_s"] for r in kills if "rejoin_s" in r]
        return {
            "failures_injected": {k: v for k, v in by_kind.items() if v},
            "failures_total": len(faults),
            "detect_s": detect, "detect_s_median": _median(detect),
            "detect_s_kills": [r["detect_s"] for r in kills if "detect_s" in r],
            "detect_s_stalls": [r["detect_s"] for r in learner if r["kind"] == "stall" and "detect_s" in r],
            "rejoin_s": rejoin, "rejoin_s_median": _median(rejoin),
            "rejoin_s_max": max(rejoin) if rejoin else None,
            "rejoin_unmeasured": len(kills) - len(rejoin),
            "stall_resume_s": [r["rejoin_s"] for r in learner if r["kind"] == "stall" and "rejoin_s" in r],
            "shard_back_s": [r.get("back_s") for r in shards],
            "shard_versions_regressed": self.shard_versions_regressed,
            "merges_lost": self.merges_lost,
            "chaos_events": recs,
            "chaos_error": self.error,
        }


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


# ---------------------------------------------------------------------------- a running cluster
class ProcessTargets:
    """The processes of a cluster started by hand on this machine, found through Redis (learner
    and shard pids), the broker's endpoint and the Redis port. A killed process is started again
    with the command line, directory and environment it had (read from /proc before the kill)."""

    def __init__(self, r: redis.Redis, keys: Keys, *, redis_url: str, broker_pub: str, log_dir: Path) -> None:
        self.r = r
        self.keys = keys
        self.redis_url = redis_url
        self.broker_pub = broker_pub
        self.log_dir = log_dir
        self.started: list[subprocess.Popen] = []
        self.lock = threading.RLock()
        self._known: dict[str, tuple[list[str], str, dict[str, str]]] = {}

    def pid(self, target: str) -> int | None:
        if target == "broker":
            pid = self._find_broker()
        elif target.startswith("shard"):
            h = self.r.hgetall(self.keys.shard(int(target.removeprefix("shard"))))
            pid = int(h["pid"]) if h.get("pid") else None
        else:
            h = self.r.hgetall(self.keys.learner(target))
            pid = int(h["pid"]) if h.get("pid") and h.get("status") not in ("left", "stopped") else None
        if pid is not None and pid_alive(pid):
            self._known[target] = _process_recipe(pid)
            return pid
        return None

    def restart(self, target: str) -> None:
        argv, cwd, env = self._known[target]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"{target}.log", "ab") as log:
            self.started.append(subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                 start_new_session=True))

    def checkpoint_path(self, shard: int) -> Path | None:
        path = self.r.hget(self.keys.shard(shard), "checkpoint")
        return Path(path) if path else None

    def restart_redis(self) -> None:
        from common.redis_server import server_pid
        from urllib.parse import urlparse
        u = urlparse(self.redis_url)
        host, port = u.hostname or "127.0.0.1", u.port or 6379
        pid = server_pid(host, port)
        if pid is None:
            raise RuntimeError(f"no Redis answering at {host}:{port} on this machine")
        argv, cwd, env = _process_recipe(pid)
        os.kill(pid, signal.SIGKILL)
        _wait_gone(pid)
        with open(self.log_dir / "redis.log", "ab") as log:
            self.started.append(subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                 start_new_session=True))
        deadline = time.monotonic() + 10
        while server_pid(host, port) is None and time.monotonic() < deadline:
            time.sleep(0.05)

    def _find_broker(self) -> int | None:
        port = self.broker_pub.rsplit(":", 1)[-1]
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                argv = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            words = [a.decode(errors="replace") for a in argv]
            if "broker" in words and any(w.endswith(f":{port}") for w in words):
                return int(d.name)
        return None


def _wait_gone(pid: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid) and time.monotonic() < deadline:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.01)


def _process_recipe(pid: int) -> tuple[list[str], str, dict[str, str]]:
    proc = Path(f"/proc/{pid}")
    argv = [a.decode() for a in (proc / "cmdline").read_bytes().split(b"\0") if a]
    env = dict(kv.decode(errors="replace").split("=", 1) for kv in (proc / "environ").read_bytes().split(b"\0")
               if b"=" in kv)
    return argv, os.readlink(proc / "cwd"), env


def main(argv: Sequence[str]) -> int:
    """``ddloco chaos SPEC``: inject SPEC into a running cluster for --minutes, print the figures."""
    import argparse
    from common.config import load_config, override
    ap = argparse.ArgumentParser(prog="ddloco chaos", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec", help="comma-separated key=value (see above)")
    ap.add_argument("--config", metavar="FILE.toml", help="TOML config file (its endpoints: run id, Redis URL, broker)")
    ap.add_argument("--redis-url", default=os.environ.get("DDLOCO_REDIS_URL"), help="the running cluster's Redis "
                    "(env DDLOCO_REDIS_URL; default: the config's)")
    ap.add_argument("--run-id", help="the running cluster's run id (default: the config's)")
    ap.add_argument("--broker-pub", help="the broker's XSUB endpoint (finds the broker process by its port)")
    ap.add_argument("--minutes", type=float, default=4.0, help="length of the schedule (default 4)")
    ap.add_argument("--log-dir", default="runs/chaos-logs", help="logs of the processes the harness restarts")
    ap.add_argument("--json", metavar="FILE", help="write the figures to FILE")
    args = ap.parse_args(list(argv))
    try:
        spec = parse_chaos(args.spec)
        cfg = load_config(args.config)
    except ConfigError as e:
        print(f"ddloco chaos: {e}", file=sys.stderr)
        return exits.USAGE
    ep = override(cfg.endpoints, redis_url=args.redis_url, run_id=args.run_id, broker_pub=args.broker_pub)
    keys = Keys(ep.run_id)
    try:
        r = control.connect(ep.redis_url)
        learners = sorted(control.live_learners(r, keys))
        shards = int(r.hget(keys.config, "shards") or len(control.shard_table(r, keys)) or 1)
        if not learners:
            control.fetch_run_config(r, keys, redis_url=ep.redis_url)   # is the run there at all?
    except redis.RedisError as e:
        print(f"ddloco chaos: Redis at {control.redact(ep.redis_url)} failed: {e}", file=sys.stderr)
        return exits.FAILURE
    except control.RunConfigMissing as e:   # a run id that is not in this Redis: the user's input
        print(f"ddloco chaos: {e}", file=sys.stderr)
        return exits.USAGE
    if not learners:
        print(f"ddloco chaos: run {ep.run_id!r} at {control.redact(ep.redis_url)} has no live learner", file=sys.stderr)
        return exits.FAILURE
    faults = plan_faults(spec, duration_s=args.minutes * 60, learners=learners, shards=shards)
    print(f"chaos      {len(faults)} faults over {args.minutes:g} min on {len(learners)} learners, {shards} shards "
          f"({spec})", flush=True)
    targets = ProcessTargets(r, keys, redis_url=ep.redis_url, broker_pub=ep.broker_pub, log_dir=Path(args.log_dir))
    stop = threading.Event()
    runner = ChaosRunner(faults, targets, redis_url=ep.redis_url, keys=keys, t0=time.time(),
                         say=lambda m: print(m, flush=True), stop=stop, stall_s=spec.stall_s)
    runner.start()
    try:
        stop.wait(args.minutes * 60 + 10)
    except KeyboardInterrupt:
        pass
    runner.halt()
    stop.set()
    runner.join(timeout=10)
    res = runner.results()
    res["restarted_processes"] = [p.pid for p in targets.started]
    print(json.dumps({k: v for k, v in res.items() if k != "chaos_events"}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return exits.OK
