"""Where a restarted learner's time goes: SIGKILL a learner of a running cluster, restart it under
the same id, and time each phase until its first merged contribution.

    python -m ddloco.bench.rejoin --learners 4 --restarts 5 --step-time-floor-ms 50            # cold restarts
    python -m ddloco.bench.rejoin --learners 4 --restarts 5 --step-time-floor-ms 50 --standby  # hot spare

Real processes (embedded Redis, broker, syncers, learners: `ddloco` daemons) on the built-in gpt
task with the run's defaults. Phases are read from the restarted learner's own counters
(seconds from its process start): ``init`` (interpreter and imports), ``prepared`` (run config,
task, model, dry run), ``joined`` (every fragment fetched from a peer or the shards),
``first_answer``; and ``first_merge`` from the shards' record of its first merged contribution
(the first merge event naming it after that answer). ``PHASE_cpu`` is the process's CPU seconds
at each phase: on a busy host wall time is CPU time over the share of the cores it gets. The
baseline, measured first on the idle machine: a bare ``python -c "import torch"``
(``import_torch_idle``); ``first_merge_over_import_torch`` is the median first merge over it. With ``--standby`` the
killed learner is replaced by a hot spare (``ddloco learner --standby``: imports, run config and
model done ahead) as ``ddloco up --chaos`` does; the next kill waits until a new spare is ready.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from common import control
from common.exits import OK
from common.keys import Keys
from common.lifecycle import stop_processes
from common.redis_server import EmbeddedRedis, free_port
from ddloco.waiting import wait_for

PHASES = ("init", "prepared", "joined", "first_answer", "first_merge")


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m ddloco.bench.rejoin", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--learners", type=int, default=4)
    ap.add_argument("--syncers", type=int, default=2)
    ap.add_argument("--restarts", type=int, default=5)
    ap.add_argument("--step-time-floor-ms", type=float, default=50.0)
    ap.add_argument("--standby", action="store_true", help="replace the killed learner by a hot spare")
    ap.add_argument("--json", action="store_true")
    return ap.parse_args(list(argv))


class _Cluster:
    """The bench's cluster (one thread): its processes by name, the spares started so far."""

    def __init__(self, args: argparse.Namespace, work: Path, redis_url: str) -> None:
        self.args, self.work = args, work
        self.procs: dict[str, subprocess.Popen] = {}
        self.spares = 0
        self.pub, self.sub = free_port(), free_port()
        self.net = ["--redis-url", redis_url, "--broker-pub", f"tcp://127.0.0.1:{self.pub}",
                    "--broker-sub", f"tcp://127.0.0.1:{self.sub}", "--run-id", "rejoin", "--log-format", "json"]
        from common.security import create_keys
        create_keys(work / "keys", shards=args.syncers, learners=[f"l{i}" for i in range(args.learners)])
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "DDLOCO_KEYS": str(work / "keys")}
        self.r = control.connect(redis_url)
        self.keys = Keys("rejoin")

    def start(self, name: str, *argv: str, stdin: bool = False) -> None:
        log = open(self.work / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "ddloco", *argv], stdout=log,
                                            stderr=subprocess.STDOUT, env=self.env,
                                            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL)

    def start_spare(self) -> None:
        self.spares += 1
        self.start(f"spare{self.spares}", "learner", *self.net, "--standby", "--step-time-floor-ms",
                   str(self.args.step_time_floor_ms), stdin=True)

    def learner(self, i: int) -> None:
        if self.args.standby:
            spare = self.procs.pop(f"spare{self.spares}")
            spare.stdin.write((json.dumps({"learner_id": f"l{i}", "data_shard": i}) + "\n").encode())
            spare.stdin.flush()
            self.procs[f"l{i}"] = spare
            return   # the next spare starts after this rejoin is measured (its boot takes CPU)
        self.start(f"l{i}", "learner", *self.net, "--learner-id", f"l{i}", "--data-shard", str(i),
                   "--step-time-floor-ms", str(self.args.step_time_floor_ms))

    def _new_life_field(self, lid: str, old_incarnation: str | None, field: str) -> str | None:
        h = self.r.hmget(self.keys.learner(lid), ["incarnation", field])
        return h[1] if h[0] not in (None, old_incarnation) and h[1] else None

    def _merged_since(self, lid: str, since: float) -> float | None:
        """When the shards first merged a contribution of ``lid`` at or after ``since`` (the run's
        merge events name their contributors), None before."""
        for _id, e in self.r.xrange(self.keys.events, min=f"{int((since - 1.0) * 1000)}-0"):
            if e.get("kind") == "merge" and lid in json.loads(e.get("contributors") or "[]") \
                    and float(e["t"]) >= since:
                return float(e["t"])
        return None

    def start_all(self) -> None:
        """Broker, shards, learners (and a spare); returns once every learner contributed."""
        args, r, keys = self.args, self.r, self.keys
        self.start("broker", "broker", "--xsub", f"tcp://127.0.0.1:{self.pub}", "--xpub",
                   f"tcp://127.0.0.1:{self.sub}", "--shards", str(args.syncers))
        for k in range(args.syncers):
            self.start(f"s{k}", "syncer", *self.net, "--shard", str(k), "--shards", str(args.syncers),
                       "--checkpoint-dir", str(self.work / "ck"))
        for i in range(args.learners):
            self.start(f"l{i}", "learner", *self.net, "--learner-id", f"l{i}", "--data-shard", str(i),
                       "--step-time-floor-ms", str(args.step_time_floor_ms))
        if args.standby:
            self.start_spare()
        wait_for(lambda: all(int(r.hget(keys.learner(f"l{i}"), "merged_contributions") or 0) > 0
                          for i in range(args.learners)), 300, "every learner contributing")

    def restart(self, i: int) -> dict[str, float]:
        """SIGKILL learner i, start it again (or a spare as it), and time its phases."""
        r, keys, lid = self.r, self.keys, f"l{i}"
        if self.args.standby:
            log = self.work / f"spare{self.spares}.log"
            wait_for(lambda: "learner.standby_ready" in log.read_text(errors="replace"), 120, "spare ready")
        self.procs[lid].send_signal(signal.SIGKILL)
        self.procs[lid].wait()
        old = r.hget(keys.learner(lid), "incarnation")
        t_restart = time.time()
        self.learner(i)
        wait_for(lambda: r.hget(keys.learner(lid), "incarnation") not in (None, old), 120, "new incarnation")
        # this life's first answer (fragment:round:when, in its counters at the next heartbeat), then
        # the first merge naming it at or after that moment: an answer of the killed life still in
        # flight may be merged after the restart, never after the new life answered
        first = wait_for(lambda: self._new_life_field(lid, old, "first_answer"), 120, "the first answer")
        answered_at = float(first.split(":")[2])
        merged_at = wait_for(lambda: self._merged_since(lid, answered_at), 120, "first merged contribution")
        if self.args.standby:
            time.sleep(2.0)   # the serving peer's next 20 steps, undisturbed by a booting spare
            self.start_spare()
        h = r.hgetall(keys.learner(lid))
        phases = json.loads(h.get("boot_phases") or "{}")
        start_gap = float(h["started_at"]) - t_restart   # Popen -> process start
        row = {k: round(start_gap + phases.get(k, float("nan")), 3) for k in PHASES[:-1]}
        row["first_merge"] = round(merged_at - t_restart, 3)
        for k in PHASES[:-1] if not self.args.standby else ():   # CPU seconds at each phase (every thread)
            row[f"{k}_cpu"] = phases.get(f"{k}_cpu", float("nan"))
        return row


def _peer_costs(work: Path) -> list[float]:
    """What serving a joiner cost the peer: its next 20 steps against its step time before."""
    costs = []
    for log in work.glob("*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if '"learner.bootstrap_serve_cost"' in line:
                e = json.loads(line)
                if e.get("slowdown") is not None:
                    costs.append(e["slowdown"])
    return costs


def _compile_sources() -> None:
    """Byte-code for this project's modules, as ``pip install`` writes it for an installed package
    (an editable checkout run with PYTHONDONTWRITEBYTECODE=1, as on this project's machines, would
    otherwise compile ~70 modules at every start: 0.1 s of CPU)."""
    import compileall
    root = Path(__file__).resolve().parents[2]
    for package in ("common", "learner", "syncer", "broker", "ddloco"):
        compileall.compile_dir(str(root / package), quiet=1)


def _import_torch_s(repeats: int = 5) -> float:
    """The physical baseline: median wall seconds from exec to the end of a bare `import torch` on
    this machine, idle, just before the cluster starts (host speed moves every figure here alike)."""
    times = []
    for _ in range(repeats):   # exec to the line printed after the import (not the interpreter's exit)
        t0 = time.perf_counter()
        p = subprocess.Popen([sys.executable, "-c", "import torch; print('imported', flush=True)"],
                             stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None and p.stdout.readline().strip() == "imported"
        times.append(time.perf_counter() - t0)
        p.wait()
    return round(statistics.median(times), 3)


def main(argv: Sequence[str]) -> int:
    args = _parse(argv)
    from common.log import configure_logging
    configure_logging(level="warning")    # the embedded Redis's lines on stderr: stdout is the result
    _compile_sources()
    baseline = _import_torch_s()
    work = Path(tempfile.mkdtemp(prefix="ddloco-rejoin-"))
    rows: list[dict[str, float]] = []
    with EmbeddedRedis(log_dir=str(work)) as redis_srv:
        cluster = _Cluster(args, work, redis_srv.url)
        try:
            cluster.start_all()
            for n in range(args.restarts):
                row = cluster.restart(n % args.learners)
                rows.append(row)
                print(f"restart {n + 1}: " + ", ".join(f"{k} {v:.2f}s" for k, v in row.items()), flush=True,
                      file=sys.stderr if args.json else sys.stdout)
        finally:
            stop_processes(cluster.procs.values())
    medians = {k: round(statistics.median(row[k] for row in rows), 3) for k in rows[0]}
    medians["import_torch_idle"] = baseline
    medians["first_merge_over_import_torch"] = round(medians["first_merge"] / baseline, 2)
    costs = _peer_costs(work)
    if costs:
        medians["peer_slowdown"] = round(statistics.median(costs), 4)
        medians["peer_slowdown_max"] = round(max(costs), 4)
    if args.json:
        print(json.dumps({"restarts": rows, "median_s": medians, "peer_slowdowns": costs}, indent=2))
    else:
        print("median seconds from restart: " + ", ".join(f"{k} {v:.2f}" for k, v in medians.items()))
    return OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
