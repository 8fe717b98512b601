"""`ddloco slurm`: a run on a Slurm cluster (docs/deploy.md "Slurm").

    ddloco slurm submit --run-dir DIR --learners 4 [--scavengers 2] [--gpus-per-learner 8] ...
    ddloco slurm add    --run-dir DIR --learners 2 | --scavengers 2
    ddloco slurm report --run-dir DIR       the run as Slurm and the shards saw it
    ddloco slurm stop   --run-dir DIR       learners leave, then the shards checkpoint and stop

``submit`` makes the run directory (keys, a Redis password, the batch scripts: plan.py), then
submits the services job and, once it has started (``--dependency=after``), the learner array and
the scavenger array. Commands run on a login node; DIR must be on storage the nodes share.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from common.exits import FAILURE, OK, USAGE
from ddloco.slurm.plan import (LEARNER_PREFIX, SCAVENGER_PREFIX, SlurmPlan, learner_ids, learners_script,
                               scavengers_script, services_script)


class SlurmError(RuntimeError):
    """A Slurm command failed or is missing (the message says which and why)."""


def _slurm(*argv: str) -> str:
    if shutil.which(argv[0]) is None:
        raise SlurmError(f"{argv[0]} not found: run `ddloco slurm` on a Slurm login node (or add Slurm's bin to PATH)")
    p = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        raise SlurmError(f"{' '.join(argv)} failed ({p.returncode}): {(p.stderr or p.stdout).strip()}")
    return p.stdout.strip()


def _sbatch(script: Path, *flags: str) -> str:
    """Submit ``script``; returns the job id."""
    return _slurm("sbatch", "--parsable", *flags, str(script)).split(";")[0]


def _prepare(plan: SlurmPlan) -> None:
    """The run directory: folders, keys (0700, secrets 0600), the Redis password."""
    from common.security import create_keys
    root = plan.root
    os.chmod(root, 0o700)   # keys, logs and checkpoints: the submitting user's alone
    for sub in ("logs", "jobs", "checkpoints", "redis"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    ids = learner_ids(LEARNER_PREFIX, plan.learners) + learner_ids(SCAVENGER_PREFIX, plan.scavengers)
    create_keys(root / "keys", learners=ids, shards=plan.shards)
    os.chmod(root / "keys", 0o700)
    pw = root / "keys" / "secret" / "redis.password"
    if not pw.exists():
        with open(os.open(pw, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as fh:
            fh.write(secrets.token_urlsafe(24) + "\n")


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    os.chmod(path, 0o700)
    return path


def cmd_submit(args: argparse.Namespace) -> int:
    root = Path(args.run_dir).resolve()
    if any(c in str(root) for c in " %\t\n'\"$`\\"):
        print(f"error: --run-dir {str(root)!r}: use a path without spaces, quotes, %, $ or backslashes "
              "(it goes into #SBATCH lines)", file=sys.stderr)
        return USAGE
    if (root / "plan.json").exists() and SlurmPlan.load(root).job_ids:
        print(f"error: {root} holds a run already (plan.json): `ddloco slurm add` adds learners to it, "
              "or choose another --run-dir", file=sys.stderr)
        return USAGE
    plan = SlurmPlan(run_dir=str(root), run_id=args.run_id or f"slurm-{secrets.token_hex(3)}",
                     learners=args.learners, scavengers=args.scavengers, shards=args.shards, task=args.task,
                     task_args=args.task_arg or [], services_partition=args.services_partition,
                     services_nodelist=args.services_nodelist,
                     learner_partition=args.learner_partition, scavenge_partition=args.scavenge_partition,
                     scavenge_qos=args.scavenge_qos, services_cpus=args.services_cpus, learner_cpus=args.learner_cpus,
                     gpus_per_learner=args.gpus_per_learner, time_limit=args.time, account=args.account,
                     python=args.python or ("" if args.setup else sys.executable), setup=args.setup, redis_port=args.redis_port,
                     broker_port=args.broker_port, shard_port=args.shard_port, peer_port=args.peer_port,
                     learner_flags=args.learner_flag or [])
    root.mkdir(parents=True, exist_ok=True)
    _prepare(plan)
    jobs = root / "jobs"
    services = _write(jobs / "services.sbatch", services_script(plan))
    learners = _write(jobs / "learners.sbatch", learners_script(plan)) if plan.learners else None
    scavengers = _write(jobs / "scavengers.sbatch", scavengers_script(plan)) if plan.scavengers else None
    plan.save()
    if args.dry_run:
        print(f"dry run: scripts in {jobs} (nothing submitted)")
        return OK
    sid = _sbatch(services)
    plan.job_ids["services"] = [sid]
    plan.save()   # `stop` finds the services job even if a later sbatch fails
    after = f"--dependency=after:{sid}"
    if learners is not None:
        plan.job_ids["learners"] = [_sbatch(learners, after)]
    if scavengers is not None:
        plan.job_ids["scavengers"] = [_sbatch(scavengers, after)]
    plan.save()
    _say_submitted(plan)
    return OK


def _say_submitted(plan: SlurmPlan) -> None:
    print(f"run        {plan.run_id} in {plan.root}")
    for role, ids in plan.job_ids.items():
        print(f"{role:<10} job {', '.join(ids)}")
    print(f"watch      squeue -n ddloco-{plan.run_id}-learners; ddloco slurm report --run-dir {plan.root}")
    print(f"stop       ddloco slurm stop --run-dir {plan.root}")


def cmd_add(args: argparse.Namespace) -> int:
    """More learners or scavengers: keys for the next ids, one more array (the services job makes
    their Redis users within seconds)."""
    from common.security import create_keys
    plan = SlurmPlan.load(args.run_dir)
    role, prefix, count = (("learners", LEARNER_PREFIX, args.learners) if args.learners
                           else ("scavengers", SCAVENGER_PREFIX, args.scavengers))
    if not count:
        print("error: give --learners N or --scavengers N", file=sys.stderr)
        return USAGE
    start = plan.learners if role == "learners" else plan.scavengers
    create_keys(plan.root / "keys", learners=learner_ids(prefix, count, start), broker=False, monitors=())
    render = learners_script if role == "learners" else scavengers_script
    script = _write(plan.root / "jobs" / f"{role}-{start}.sbatch", render(plan, count=count, start=start))
    job = _sbatch(script)
    plan.job_ids.setdefault(role, []).append(job)
    if role == "learners":
        plan.learners += count
    else:
        plan.scavengers += count
    plan.save()
    print(f"{role:<10} job {job}: {prefix}{start}..{prefix}{start + count - 1}")
    return OK


def cmd_stop(args: argparse.Namespace) -> int:
    """Learners and scavengers first (SIGTERM: each leaves the run), then the services job (the
    shards checkpoint); the report is written while Redis still answers."""
    plan = SlurmPlan.load(args.run_dir)
    members = plan.job_ids.get("learners", []) + plan.job_ids.get("scavengers", [])
    if members:
        _scancel(members)
        _wait_gone(members, args.timeout_s)
    from ddloco.slurm.report import write_report
    try:
        write_report(plan)
    except Exception as e:  # noqa: BLE001  (the services may be gone already: the report says so)
        print(f"report     not written: {e}", file=sys.stderr)
    if plan.job_ids.get("services"):
        _scancel(plan.job_ids["services"])
        _wait_gone(plan.job_ids["services"], args.timeout_s)
    print(f"stopped    {plan.run_id}")
    return OK


def _scancel(job_ids: list[str]) -> None:
    try:
        _slurm("scancel", *job_ids)
    except SlurmError as e:   # a job Slurm no longer knows has ended: nothing to cancel
        if "Invalid job id" not in str(e):
            raise


def _wait_gone(job_ids: list[str], timeout_s: float) -> None:
    """Until no job of ``job_ids`` is in squeue (one Slurm has purged counts as gone); on timeout a
    warning, and the stop goes on."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = []
        for job in job_ids:
            try:
                left += _slurm("squeue", "-h", "-j", job, "-o", "%i").split()
            except SlurmError as e:
                if "Invalid job id" not in str(e):
                    raise
        if not left:
            return
        time.sleep(0.5)
    print(f"warning: jobs {', '.join(job_ids)} still in squeue after {timeout_s:.0f} s; going on", file=sys.stderr)


def cmd_report(args: argparse.Namespace) -> int:
    from ddloco.slurm.report import write_report
    plan = SlurmPlan.load(args.run_dir)
    if not (plan.root / "endpoints.env").exists():
        print(f"error: the services job of {plan.run_id} is not running (no {plan.root / 'endpoints.env'}): the run's "
              f"events live in its Redis; the last report written, by `ddloco slurm stop`, is "
              f"{plan.root / 'report.json'}", file=sys.stderr)
        return FAILURE
    rep = write_report(plan)
    if args.json:
        print(json.dumps(rep, indent=2))
    return OK


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ddloco slurm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="action", required=True, metavar="ACTION")
    s = sub.add_parser("submit", help="make the run directory and submit services, learners, scavengers")
    s.add_argument("--run-dir", required=True, help="the run's directory, on storage every node sees")
    s.add_argument("--run-id", default="", help="default: slurm-<6 hex digits>")
    s.add_argument("--learners", type=int, default=2, help="the learner array's size (default 2)")
    s.add_argument("--scavengers", type=int, default=0, help="the scavenger array's size (default 0)")
    s.add_argument("--shards", type=int, default=2, help="syncer shards in the services job (default 2)")
    s.add_argument("--task", default="gpt", help="built-in task or MODULE:ATTR importable on every node (default gpt)")
    s.add_argument("--task-arg", action="append", metavar="KEY=VALUE", help="the task's keyword argument, repeatable")
    s.add_argument("--services-partition", default="", help="CPU partition of the services job (default: Slurm's)")
    s.add_argument("--services-nodelist", default="",
                   help="pin the services job to these nodes (a requeued one comes back where learners look)")
    s.add_argument("--learner-partition", default="", help="partition of the learner array (default: Slurm's)")
    s.add_argument("--scavenge-partition", default="", help="low-priority partition whose jobs others preempt")
    s.add_argument("--scavenge-qos", default="", help="QOS of the scavenger array (QOS-based preemption)")
    s.add_argument("--services-cpus", type=int, default=2)
    s.add_argument("--learner-cpus", type=int, default=2, help="CPUs per learner task (torch threads: these over its ranks)")
    s.add_argument("--gpus-per-learner", type=int, default=0,
                   help="GPUs per learner (--gres=gpu:N); over 1, each learner is a torchrun group of N ranks")
    s.add_argument("--time", default="", help="every job's time limit (sbatch --time)")
    s.add_argument("--account", default="")
    s.add_argument("--python", default="", help="the interpreter jobs run (default: this one, by absolute path; "
                   "with --setup: the python3 on PATH after it)")
    s.add_argument("--setup", default="", help="shell lines each job runs first (module load ...; source ...)")
    s.add_argument("--redis-port", type=int, default=6379)
    s.add_argument("--broker-port", type=int, default=5555, help="publishers; subscribers on the next port")
    s.add_argument("--shard-port", type=int, default=7000, help="shard k's RPC on this port + k")
    s.add_argument("--peer-port", type=int, default=7100, help="learner i serves joining peers on this port + i")
    s.add_argument("--learner-flag", action="append", metavar="FLAG",
                   help="extra `ddloco learner` argument, repeatable (e.g. --learner-flag=--step-time-floor-ms=50)")
    s.add_argument("--dry-run", action="store_true", help="write the run directory and scripts, submit nothing")
    s.set_defaults(func=cmd_submit)
    a = sub.add_parser("add", help="more learners or scavengers for a submitted run")
    a.add_argument("--run-dir", required=True)
    a.add_argument("--learners", type=int, default=0)
    a.add_argument("--scavengers", type=int, default=0)
    a.set_defaults(func=cmd_add)
    r = sub.add_parser("report", help="the run's events as Slurm and the shards saw them (RUN_DIR/report.json)")
    r.add_argument("--run-dir", required=True)
    r.add_argument("--json", action="store_true")
    r.set_defaults(func=cmd_report)
    t = sub.add_parser("stop", help="learners leave, the report is written, the shards checkpoint and stop")
    t.add_argument("--run-dir", required=True)
    t.add_argument("--timeout-s", type=float, default=120.0)
    t.set_defaults(func=cmd_stop)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        return args.func(args)
    except SlurmError as e:
        print(f"error: {e}", file=sys.stderr)
        return FAILURE


if __name__ == "__main__":
    sys.exit(main())
