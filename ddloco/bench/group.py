"""``ddloco bench group``: what a torchrun learner costs per rank, replicated (DDP) or sharded (FSDP).

    ddloco bench group --params 2e7 --nproc 2 --steps 40 --sharding ddp,fsdp

For each sharding, real processes on this machine: an embedded Redis, the broker, one syncer and
one learner that is a group of ``--nproc`` ranks (``ddloco learner --nproc N --group-sharding
S``) on the synthetic task of ``--params`` parameters (``ddloco.bench.synthetic``: a stack of square
Linear layers, an ``nn.ModuleList``, so FSDP makes each layer a unit). The learner trains
``--steps`` steps, answering rounds and applying merges, then flushes and ends. Reported per
sharding, read from each rank's ``learner.group_trained`` record and the learner's Redis entry:

- each rank's RSS at the end of training (before a sharded group gathers the whole model for
  the flush) and its peak RSS (MB), with the model's fp32 size for scale (on CUDA also the
  device's peak allocated memory);
- rank 0's steps per second of training time, answers sent and merges applied.

On a CPU every rank's RSS includes what torch itself takes (~300 MB); rank 0 also keeps the
merged bases of every fragment (one fp32 copy of the model) to compute its deltas.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from common import control
from common.keys import Keys
from common.lifecycle import stop_processes
from common.redis_server import EmbeddedRedis, free_port


def log_events(text: str, name: str) -> list[dict[str, Any]]:
    """Flat JSON log records of event ``name`` (ranks share one pipe: lines can run together)."""
    return [json.loads(m) for m in re.findall(r'\{[^{}]*"event": "' + re.escape(name) + r'"[^{}]*\}', text)]


def _one(sharding: str, args: argparse.Namespace, redis_url: str, work: Path) -> dict[str, Any]:
    run = f"bgroup-{sharding}-{os.getpid()}"
    pub, sub = free_port(), free_port()
    net = ["--insecure", "--redis-url", redis_url, "--broker-pub", f"tcp://127.0.0.1:{pub}",
           "--broker-sub", f"tcp://127.0.0.1:{sub}", "--run-id", run, "--log-format", "json"]
    task = ["--task", "ddloco.bench.synthetic:task", "--task-arg", f"params={int(args.params)}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "DDLOCO_INSECURE": "1"}
    procs: list[subprocess.Popen] = []
    logs = work / sharding
    logs.mkdir(parents=True, exist_ok=True)

    def start(name: str, *argv: str) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-m", "ddloco", *argv], stdout=open(logs / f"{name}.log", "wb"),
                             stderr=subprocess.STDOUT, env=env)
        procs.append(p)
        return p
    try:
        start("broker", "broker", "--xsub", f"tcp://127.0.0.1:{pub}", "--xpub", f"tcp://127.0.0.1:{sub}")
        start("syncer", "syncer", *net, *task, "--fragments", str(args.fragments), "--sync-every",
              str(args.sync_every), "--checkpoint-dir", str(logs / "ck"))
        print(f"[bench group] {sharding}: {args.nproc} ranks, {int(args.params):,} parameters, {args.steps} steps",
              file=sys.stderr, flush=True)
        t0 = time.monotonic()
        learner = start("learner", "learner", "--nproc", str(args.nproc), "--group-sharding", sharding, *net, *task,
                        "--learner-id", "group", "--steps", str(args.steps),
                        "--step-time-floor-ms", str(args.step_time_floor_ms))
        try:
            learner.wait(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the {sharding} learner did not finish in {args.timeout_s:.0f} s "
                               f"(log: {logs / 'learner.log'})") from None
        wall = time.monotonic() - t0
        text = (logs / "learner.log").read_text(errors="replace")
        if learner.returncode != 0:
            raise RuntimeError(f"the {sharding} learner exited {learner.returncode}: {text[-2000:]}")
        ranks = {e["rank"]: e for e in log_events(text, "learner.group_trained")}
        held = {e["rank"]: e for e in log_events(text, "learner.group_sharded")}
        if set(ranks) != set(range(args.nproc)):
            raise RuntimeError(f"{sharding}: ranks {sorted(ranks)} reported, expected {args.nproc}: {text[-2000:]}")
        r = control.connect(redis_url)
        h = r.hgetall(Keys(run).learner("group"))
        r.close()
    finally:
        stop_processes(procs)
    r0 = ranks[0]
    return {
        "sharding": sharding, "ranks": args.nproc, "steps": r0["steps"], "wall_s": round(wall, 1),
        "steps_per_s": round(r0["steps"] / r0["train_s"], 3) if r0.get("train_s") else None,
        "answers": int(h.get("answers", 0)), "merges_applied": int(h.get("merges_applied", 0)),
        "peak_rss_mb": [ranks[k]["peak_rss_mb"] for k in sorted(ranks)],
        "trained_rss_mb": [ranks[k]["trained_rss_mb"] for k in sorted(ranks)],
        "peak_device_mb": [ranks[k].get("peak_device_mb") for k in sorted(ranks)],
        "holds": [held[k]["holds"] for k in sorted(held)] if held else None,
    }


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="ddloco bench group", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=2e7, help="synthetic model size (default 2e7)")
    ap.add_argument("--nproc", type=int, default=2, help="ranks of the learner (default 2)")
    ap.add_argument("--steps", type=int, default=40, help="inner steps (default 40)")
    ap.add_argument("--sharding", default="ddp,fsdp", help="comma-separated: ddp, fsdp (default both)")
    ap.add_argument("--fragments", type=int, default=24)
    ap.add_argument("--sync-every", type=int, default=12)
    ap.add_argument("--step-time-floor-ms", type=float, default=0.0)
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per learner (default 900)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ap.add_argument("--report", help="also write the rows to DIR/group.json")
    args = ap.parse_args(list(argv))
    shardings = [s.strip() for s in args.sharding.split(",") if s.strip()]
    bad = [s for s in shardings if s not in ("ddp", "fsdp")]
    if bad or not shardings:
        ap.error(f"--sharding takes ddp and/or fsdp, got {args.sharding!r}")
    if args.nproc < 2 or args.steps < 1 or args.params < 1:
        ap.error("--nproc must be >= 2, --steps and --params >= 1")
    work = Path(tempfile.mkdtemp(prefix="ddloco-bgroup-"))
    model_mb = round(4 * args.params / 2**20, 1)
    rows = []
    with EmbeddedRedis(log_dir=str(work)) as srv:
        for s in shardings:
            row = _one(s, args, srv.url, work)
            row["model_fp32_mb"] = model_mb
            rows.append(row)
    if args.report:
        Path(args.report).mkdir(parents=True, exist_ok=True)
        (Path(args.report) / "group.json").write_text(json.dumps({"rows": rows}, indent=2))
    if args.json:
        print(json.dumps({"rows": rows}, indent=2))
        return 0
    print(f"model: {int(args.params):,} parameters = {model_mb} MB fp32; {args.nproc} ranks; logs in {work}")
    print(f"{'sharding':9} {'RSS after training (MB)':>24} {'peak RSS (MB)':>16} {'steps/s':>8} {'answers':>8} "
          f"{'merges':>7} {'wall s':>7}")
    for row in rows:
        now = " / ".join(f"{v:.0f}" for v in row["trained_rss_mb"])
        peak = " / ".join(f"{v:.0f}" for v in row["peak_rss_mb"])
        print(f"{row['sharding']:9} {now:>24} {peak:>16} {row['steps_per_s'] or 0:>8.2f} {row['answers']:>8} "
              f"{row['merges_applied']:>7} {row['wall_s']:>7.0f}")
    return 0
