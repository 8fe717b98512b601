"""The figures of the README's "Security, measured", reproduced by:

    python -m ddloco.bench.security fuzz  --count 1000000 --out reports/security   # `ddloco fuzz` at a live `ddloco up`
    python -m ddloco.bench.security curve --repeats 3 --out reports/security       # `ddloco up` with and without CURVE

``fuzz``: starts ``ddloco up`` (secure by default: CURVE keys, Redis password and ACL users) as a
separate process, waits until every learner trains, runs ``ddloco fuzz`` at it with the operator
access ``up`` writes (``runs/<run>/access.env``), then lets ``up`` finish and reports the fuzz
figures next to the run's eval curve (does the loss keep falling during and after the storm?).

``curve``: the same ``ddloco up`` run (4 learners, 2 shards, a fixed step budget) with and without
``--insecure``, alternated; per run its wall time, learner steps per second, and the bytes the
loopback interface carried (every ZeroMQ and Redis byte of the run, CURVE's framing included).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common.lifecycle import stop_processes
from ddloco.bench.broker import _lo_bytes


def _ddloco(*args: str) -> list[str]:
    return [sys.executable, "-m", "ddloco", *args]


def run_fuzz(count: int, seconds: float, out: Path, minutes: float) -> dict:
    work = out / "fuzz-run"
    work.mkdir(parents=True, exist_ok=True)
    up = subprocess.Popen(_ddloco("up", "--learners", "2", "--syncers", "2", "--minutes", str(minutes),
                                  "--step-time-floor-ms", "50", "--run-id", "fuzzed", "--report", str(out / "fuzz-up")),
                          cwd=work, stdout=open(work / "up.log", "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 180
        access = None
        while time.time() < deadline and access is None:
            found = list((work / "runs").glob("fuzzed-*/access.env")) if (work / "runs").exists() else []
            access = found[0] if found else None
            time.sleep(0.5)
        if access is None:
            raise RuntimeError(f"`ddloco up` wrote no access.env; its log: {(work / 'up.log').read_text()[-2000:]}")
        while time.time() < deadline and "steps" not in (work / "up.log").read_text():
            time.sleep(0.5)
        time.sleep(10)   # every learner training, a few merges before the storm
        env = dict(os.environ)
        for line in access.read_text().splitlines():
            k, _, v = line.partition("=")
            env[k] = v
        res = subprocess.run(_ddloco("fuzz", "--config", str(access.parent / "config.toml"), "--count", str(count),
                                     "--seconds", str(seconds), "--report", str(out / "fuzz")),
                             cwd=work, env=env, capture_output=True, text=True)
        print(res.stdout[-3000:], res.stderr[-2000:], sep="\n")
        up.wait(timeout=minutes * 60 + 300)
    finally:
        stop_processes([up], 60.0)
    fz = json.loads((out / "fuzz" / "fuzz.json").read_text())
    rep = json.loads((out / "fuzz-up" / "report.json").read_text())
    summary = {"fuzz": fz, "up_exit": up.returncode, "eval_curve": rep["eval_curve"],
               "eval_loss_initial": rep["eval_loss_initial"], "eval_loss_final": rep["eval_loss_final"],
               "auth_failures": rep.get("auth_failures"), "broker_refused": rep.get("broker_refused"),
               "rejections": rep.get("rejections"), "versions_regressed": rep.get("versions_regressed")}
    (out / "fuzz-summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def run_curve(repeats: int, steps: int, out: Path) -> dict:
    rows = []
    for i in range(repeats):
        for insecure in (False, True):
            work = out / f"curve-{'off' if insecure else 'on'}-{i}"
            work.mkdir(parents=True, exist_ok=True)
            argv = _ddloco("up", "--learners", "4", "--syncers", "2", "--steps", str(steps), "--quiet",
                           "--run-id", "curve", "--report", str(work / "report"))
            if insecure:
                argv.append("--insecure")
            lo0 = _lo_bytes()
            res = subprocess.run(argv, cwd=work, capture_output=True, text=True)
            lo = _lo_bytes() - lo0
            if res.returncode != 0:
                raise RuntimeError(res.stdout[-2000:] + res.stderr[-2000:])
            rep = json.loads((work / "report" / "report.json").read_text())
            step_s = [float(h["step_ema_s"]) for h in rep["learner_stats"].values() if h.get("step_ema_s")]
            row = {"curve": not insecure, "wall_s": rep["wall_s"], "steps_total": rep["steps_total"],
                   "steps_per_s": rep["steps_total"] / rep["wall_s"],
                   "learner_step_ms_mean": 1000 * statistics.fmean(step_s) if step_s else None,
                   "app_bytes_up": rep["bytes_up"], "app_bytes_down": rep["bytes_down"],
                   "loopback_bytes": lo, "loopback_bytes_per_step": lo / rep["steps_total"],
                   "eval_loss_final": rep["eval_loss_final"]}
            rows.append(row)
            print(json.dumps(row))
    summary: dict = {"rows": rows}
    for curve in (True, False):
        rs = [r for r in rows if r["curve"] == curve]
        summary["curve_on" if curve else "curve_off"] = {
            k: (statistics.median(r[k] for r in rs), min(r[k] for r in rs), max(r[k] for r in rs))
            for k in ("wall_s", "steps_per_s", "learner_step_ms_mean", "loopback_bytes_per_step")}
    (out / "curve-summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ddloco.bench.security", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["fuzz", "curve"])
    ap.add_argument("--count", type=int, default=1_000_000)
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--minutes", type=float, default=4.0, help="fuzz: length of the `ddloco up` run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200, help="curve: inner steps per learner")
    ap.add_argument("--out", default="reports/security")
    args = ap.parse_args(argv)
    out = Path(args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    if args.what == "fuzz":
        s = run_fuzz(args.count, args.seconds, out, args.minutes)
        f = s["fuzz"]
        print(f"fuzz: {f['total']:,} inputs in {f['seconds']}s, crashes {f['crashes']}, hangs {f['hangs']}, "
              f"training went on {f['training_went_on']}; eval {s['eval_loss_initial']:.3f} -> {s['eval_loss_final']:.3f}")
    else:
        s = run_curve(args.repeats, args.steps, out)
        print(json.dumps({k: v for k, v in s.items() if k != "rows"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
