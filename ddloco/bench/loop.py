"""``ddloco bench loop``: what a ddloco learner costs against a plain PyTorch loop (the ``hf`` task).

    ddloco bench loop --task-arg model=llama --task-arg data=data/tok --task-arg seq_len=128 \
        --task-arg batch_size=8 --task-arg config.hidden_size=256 ... --minutes 1.5 --repeats 3

Each repeat runs, back to back on this machine:

- a learner of ``ddloco up --learners 1 --syncers 1`` with sync off (H beyond the run's length,
  so no round ever starts) for ``--minutes``; its rate is its steps over its ``train_s`` (the
  learner's own stat: the wall time of its loop's iterations, each from the step boundary through
  the batch, forward, backward and AdamW step; not its start-up, nor the stop at the time cap);
- ``ddloco/bench/plain_hf_loop.py`` for as many steps, timed from its first step to its last: a
  loop that imports no ddloco code, with the same model config
  (``from_config``, SDPA), batches of the same shape from the same token shards (by memory map),
  ``torch.optim.AdamW`` with the run's inner hyperparameters and kernel, the same torch threads.

It prints each repeat's ratio (learner steps/s ÷ plain steps/s) and their median, min and max.
The learner's extra work is its data stream (seeded windows), token counting, the learning-rate
schedule and its hooks; the broker, one idle shard, Redis and ``up`` share the machine with it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from common import exits
from common.config import AlgoConfig

PLAIN = Path(__file__).with_name("plain_hf_loop.py")


def _task_args(items: Sequence[str]) -> list[str]:
    out = []
    for item in items:
        out += ["--task-arg", item]
    return out


def _model_dir(task_args: Sequence[str], out: Path) -> tuple[Path, dict[str, Any]]:
    """The hf task's model config written to ``out/model`` (for the plain loop), and the task's config."""
    from common.task import build_model, load_task, parse_task_args
    task = load_task("hf", parse_task_args(task_args))
    model = build_model(task, 0)
    if not hasattr(model, "config") or not hasattr(model.config, "save_pretrained"):
        raise SystemExit("ddloco bench loop: the task's model is not a transformers model")
    target = out / "model"
    model.config.save_pretrained(target)
    given = parse_task_args(task_args)
    config = {k: task.config.get(k, given.get(k)) for k in ("seq_len", "batch_size")}
    return target, {**config, "data": given.get("data", "")}


def _learner_rate(args: argparse.Namespace, out: Path, tag: str) -> tuple[float, int]:
    report = out / tag
    cmd = [sys.executable, "-m", "ddloco", "up", "--insecure", "--quiet", "--run-id", f"bloop-{tag}-{os.getpid()}",
           "--task", "hf", *_task_args(args.task_arg), "--learners", "1", "--syncers", "1",
           "--steps", "0", "--minutes", str(args.minutes), "--sync-every", str(10**9), "--eval-every-s", "1e9",
           "--report", str(report)]
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode not in (exits.OK, exits.DID_NOT_TRAIN) or not (report / "report.json").exists():
        raise RuntimeError(f"ddloco up exited {proc.returncode}: {proc.stderr[-2000:]}")
    rep = json.loads((report / "report.json").read_text())
    (h,) = rep["learner_stats"].values()
    return float(h["steps"]) / float(h["train_s"]), int(h["steps"])


def _plain_rate(model_dir: Path, config: dict[str, Any], threads: int, steps: int) -> float:
    algo = AlgoConfig()
    cmd = [sys.executable, str(PLAIN), "--model-dir", str(model_dir), "--data", str(config["data"]),
           "--seq-len", str(config["seq_len"]), "--batch-size", str(config["batch_size"]),
           "--steps", str(steps), "--threads", str(threads), "--lr", str(algo.inner_lr),
           "--beta1", str(algo.inner_beta1), "--beta2", str(algo.inner_beta2),
           "--weight-decay", str(algo.inner_weight_decay), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""})
    if proc.returncode != 0:
        raise RuntimeError(f"the plain loop exited {proc.returncode}: {proc.stderr[-2000:]}")
    return float(json.loads(proc.stdout.strip().splitlines()[-1])["steps_per_s"])


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="ddloco bench loop", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="an arg of the hf task (repeat; data= must be a directory made by `ddloco data prepare`)")
    ap.add_argument("--minutes", type=float, default=1.5, help="length of each learner run (default 1.5: shorter "
                    "runs weigh the start-up, when `up` evaluates the initial model on the same cores); the plain "
                    "loop then takes as many steps as the learner did")
    ap.add_argument("--repeats", type=int, default=3, help="learner/plain pairs, back to back (default 3)")
    ap.add_argument("--report", help="keep the runs' reports and bench.json here (default: a temp dir)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args(list(argv))
    if args.minutes <= 0 or args.repeats < 1:
        ap.error("--minutes must be > 0 and --repeats >= 1")
    out = Path(args.report) if args.report else Path(tempfile.mkdtemp(prefix="bench-loop-"))
    out.mkdir(parents=True, exist_ok=True)
    model_dir, config = _model_dir(args.task_arg, out)
    if not (Path(str(config.get("data", ""))) / "index.json").exists():
        ap.error("data= must be a directory made by `ddloco data prepare` (the plain loop reads its shards)")
    threads = max(1, os.cpu_count() or 1)      # what `up` gives its one learner
    rows = []
    for i in range(args.repeats):
        t0 = time.monotonic()
        learner, steps = _learner_rate(args, out, f"learner-{i}")
        plain = _plain_rate(model_dir, config, threads, steps)
        rows.append({"steps": steps, "learner_steps_per_s": round(learner, 4), "plain_steps_per_s": round(plain, 4),
                     "ratio": round(learner / plain, 4)})
        print(f"[bench loop] repeat {i + 1}/{args.repeats}: learner {learner:.3f} steps/s, plain {plain:.3f} "
              f"steps/s, ratio {learner / plain:.3f} ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
    ratios = [r["ratio"] for r in rows]
    res = {"repeats": rows, "ratio_median": round(statistics.median(ratios), 4), "ratio_min": min(ratios),
           "ratio_max": max(ratios), "minutes": args.minutes, "threads": threads,
           "task": {k: v for k, v in config.items()}}
    (out / "bench.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2) if args.json else
          f"learner ÷ plain PyTorch loop: median {res['ratio_median']}, min {res['ratio_min']}, max {res['ratio_max']} "
          f"over {args.repeats} repeats (reports in {out})")
    return exits.OK


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
