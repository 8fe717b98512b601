"""Where a restarted learner's time goes: SIGKILL a learner of a running cluster, restart it under
the same id, and time each phase until its first merged contribution.

    python -m ddloco.bench.rejoin --learners 4 --restarts 5 --step-time-floor-ms 50            # cold restarts
    python -m ddloco.bench.rejoin --learners 4 --restarts 5 --step-time-floor-ms 50 --standby  # hot spare

Real processes (embedded Redis, broker, syncers, learners: `ddloco` daemons) on the built-in gpt
task with the run's defaults. Phases are read from the restarted learner's own counters
(seconds from its process start): ``init`` (interpreter and imports), ``prepared`` (run config,
task, model, dry run), ``joined`` (every fragment fetched from the shards), ``first_answer``; and
``first_merge`` from the shards' record of its first merged contribution. With ``--standby`` the
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
from common.keys import Keys
from common.lifecycle import stop_processes
from common.redis_server import EmbeddedRedis, free_port

PHASES = ("init", "prepared", "joined", "first_answer", "first_merge")


def _wait(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m ddloco.bench.rejoin", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--learners", type=int, default=4)
    ap.add_argument("--syncers", type=int, default=2)
    ap.add_argument("--restarts", type=int, default=5)
    ap.add_argument("--step-time-floor-ms", type=float, default=50.0)
    ap.add_argument("--standby", action="store_true", help="replace the killed learner by a hot spare")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(list(argv))
    work = Path(tempfile.mkdtemp(prefix="ddloco-rejoin-"))
    procs: dict[str, subprocess.Popen] = {}
    rows: list[dict[str, float]] = []
    with EmbeddedRedis(log_dir=str(work)) as redis_srv:
        pub, sub = free_port(), free_port()
        net = ["--redis-url", redis_srv.url, "--broker-pub", f"tcp://127.0.0.1:{pub}",
               "--broker-sub", f"tcp://127.0.0.1:{sub}", "--run-id", "rejoin", "--log-format", "json"]
        from common.security import create_keys
        create_keys(work / "keys", shards=args.syncers, learners=[f"l{i}" for i in range(args.learners)])
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "DDLOCO_KEYS": str(work / "keys")}

        def start(name: str, *argv: str, stdin: bool = False) -> None:
            log = open(work / f"{name}.log", "ab")
            procs[name] = subprocess.Popen([sys.executable, "-m", "ddloco", *argv], stdout=log,
                                           stderr=subprocess.STDOUT, env=env,
                                           stdin=subprocess.PIPE if stdin else subprocess.DEVNULL)

        spares = [0]

        def start_spare() -> None:
            spares[0] += 1
            start(f"spare{spares[0]}", "learner", *net, "--standby", "--step-time-floor-ms",
                  str(args.step_time_floor_ms), stdin=True)

        def learner(i: int) -> None:
            if args.standby:
                spare = procs.pop(f"spare{spares[0]}")
                spare.stdin.write((json.dumps({"learner_id": f"l{i}", "data_shard": i}) + "\n").encode())
                spare.stdin.flush()
                procs[f"l{i}"] = spare
                return   # the next spare starts after this rejoin is measured (its boot takes CPU)
            start(f"l{i}", "learner", *net, "--learner-id", f"l{i}", "--data-shard", str(i),
                  "--step-time-floor-ms", str(args.step_time_floor_ms))
        r = control.connect(redis_srv.url)
        keys = Keys("rejoin")
        try:
            start("broker", "broker", "--xsub", f"tcp://127.0.0.1:{pub}", "--xpub", f"tcp://127.0.0.1:{sub}",
                  "--shards", str(args.syncers))
            for k in range(args.syncers):
                start(f"s{k}", "syncer", *net, "--shard", str(k), "--shards", str(args.syncers),
                      "--checkpoint-dir", str(work / "ck"))
            for i in range(args.learners):
                start(f"l{i}", "learner", *net, "--learner-id", f"l{i}", "--data-shard", str(i),
                      "--step-time-floor-ms", str(args.step_time_floor_ms))
            if args.standby:
                start_spare()
            _wait(lambda: all(int(r.hget(keys.learner(f"l{i}"), "merged_contributions") or 0) > 0
                              for i in range(args.learners)), 300, "every learner contributing")
            for n in range(args.restarts):
                i = n % args.learners
                lid = f"l{i}"
                if args.standby:
                    log = work / f"spare{spares[0]}.log"
                    _wait(lambda: "learner.standby_ready" in log.read_text(errors="replace"), 120, "spare ready")
                procs[lid].send_signal(signal.SIGKILL)
                procs[lid].wait()
                old = r.hget(keys.learner(lid), "incarnation")
                t_restart = time.time()
                learner(i)
                _wait(lambda: r.hget(keys.learner(lid), "incarnation") not in (None, old), 120, "new incarnation")
                merged_at = _wait(lambda: (lambda v: v if v and float(v) > t_restart else None)(
                    r.hget(keys.learner(lid), "last_merged_at")), 120, "first merged contribution")
                if args.standby:
                    time.sleep(2.0)   # the serving peer's next 20 steps, undisturbed by a booting spare
                    start_spare()
                _wait(lambda: "first_answer" in json.loads(r.hget(keys.learner(lid), "boot_phases") or "{}"), 10,
                      "the first answer in the counters (next heartbeat)")
                h = r.hgetall(keys.learner(lid))
                phases = json.loads(h.get("boot_phases") or "{}")
                start_gap = float(h["started_at"]) - t_restart   # Popen -> process start
                row = {k: round(start_gap + phases.get(k, float("nan")), 3) for k in PHASES[:-1]}
                row["first_merge"] = round(float(merged_at) - t_restart, 3)
                rows.append(row)
                print(f"restart {n + 1}: " + ", ".join(f"{k} {v:.2f}s" for k, v in row.items()), flush=True)
        finally:
            stop_processes(procs.values())
    medians = {k: round(statistics.median(row[k] for row in rows), 3) for k in PHASES}
    costs = []   # what serving a joiner cost the peer: its next 20 steps against its step time before
    for log in work.glob("*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if '"learner.bootstrap_serve_cost"' in line:
                e = json.loads(line)
                if e.get("slowdown") is not None:
                    costs.append(e["slowdown"])
    if costs:
        medians["peer_slowdown"] = round(statistics.median(costs), 4)
        medians["peer_slowdown_max"] = round(max(costs), 4)
    if args.json:
        print(json.dumps({"restarts": rows, "median_s": medians, "peer_slowdowns": costs}, indent=2))
    else:
        print("median seconds from restart: " + ", ".join(f"{k} {v:.2f}" for k, v in medians.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
