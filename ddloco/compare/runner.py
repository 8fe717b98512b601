"""`ddloco compare`: every system on the same task, data streams, inner AdamW and eval batches.

Systems (``--systems``, comma list; default: the five of the quality table):
- ``dp``: real data-parallel training, ``torch.distributed`` DDP launched by torchrun, M ranks
  (gloo on CPU, NCCL on CUDA), rank r reading stream r; one step = M batches.
- ``single``: one learner alone (stream 0) at equal steps (1/M of the tokens).
- ``diloco_sync``: synchronous DiLoCo [lineage], in one process (``systems.run_diloco_sync``).
- ``decoupled_lockstep``: our cluster (``ddloco up``) with lockstep and K = M.
- ``decoupled``: our cluster with the run's defaults (K = 1 + grace, int4, ...).
- extra: ``decoupled_fp32`` (the cluster with an fp32 uplink), ``decoupled_emulated`` and
  ``dp_emulated`` (fast deterministic in-process stand-ins, for sweeps).

Token budget N: every learner (or rank) takes N / (M · tokens per batch) steps; every system's
final number is its global model evaluated after exactly that budget (the cluster's learners
flush their last steps before the final evaluation). Intermediate points: in-process systems
and DP at exact step counts; the cluster at its periodic evaluations (tokens counted then).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Sequence

from common.config import ConfigError, ConfigFile, RunConfig, load_config, override
from common.exits import FAILURE as EXIT_FAILURE
from common.exits import OK as EXIT_OK
from common.exits import USAGE as EXIT_USAGE
from common.files import write_atomic
from ddloco.compare.settings import (apply_sets, cluster_bytes_per_token, parse_set, system_run,  # noqa: F401
                                     tokens_per_batch)
from ddloco.compare.summary import (_interp, _paired_ratio, _t95, mean_ci, summarise, write_markdown,  # noqa: F401
                                   write_plot)

DEFAULT_SYSTEMS = ("dp", "single", "diloco_sync", "decoupled_lockstep", "decoupled")
IN_PROCESS = ("single", "diloco_sync", "decoupled_emulated", "dp_emulated")
CLUSTER = ("decoupled", "decoupled_lockstep", "decoupled_fp32")
ALL_SYSTEMS = ("dp",) + IN_PROCESS + CLUSTER
EXIT_INTERRUPTED = 130
"""Ctrl-C: the finished runs are kept in DIR/runs (``--resume`` goes on from them)."""

# ------------------------------------------------------------------------------------ runners
def in_process_device(system: str, device: str) -> Any:
    """Where an in-process system trains: ``--device`` ("auto": CUDA when torch sees one);
    ``decoupled_emulated`` always on the CPU. Resolved in the worker process (the command's own
    process never initialises CUDA, so its pool may fork)."""
    import torch
    if system == "decoupled_emulated" or device == "cpu":
        return torch.device("cpu")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {device} asked for, but torch sees no CUDA device")
    return torch.device(device)


def _in_process(system: str, run_dict: dict[str, Any], learners: int, steps: int, seed: int,
                eval_points: int, delay_steps: int, device: str = "cpu") -> dict[str, Any]:
    """Worker-process entry: one in-process system at one seed."""
    from common.config import run_config_from_dict
    from ddloco.compare import systems
    from common.task import bind_task
    task, run = bind_task(run_config_from_dict(run_dict))
    kw: dict[str, Any] = dict(steps=steps, seed=seed, eval_points=eval_points, threads=1)
    dev = in_process_device(system, device)
    if system != "decoupled_emulated":
        kw["device"] = dev
    if system == "single":
        res = systems.run_single(task, run.algo, learners=learners, **kw)
    elif system == "diloco_sync":
        res = systems.run_diloco_sync(task, run.algo, learners=learners, **kw)
    elif system == "dp_emulated":
        res = systems.run_dp_emulated(task, run.algo, learners=learners, **kw)
    elif system == "decoupled_emulated":
        res = systems.run_decoupled_emulated(task, run.algo, learners=learners, delay_steps=delay_steps, **kw)
    else:
        raise ValueError(f"not an in-process system: {system}")
    out = res.to_dict()
    if dev.type != "cpu":
        out.setdefault("extra", {})["device"] = str(dev)
    return out


def run_dp(run: RunConfig, *, learners: int, steps: int, seed: int, eval_points: int, workdir: Path,
           device: str) -> dict[str, Any]:
    """Real DDP: torchrun with M ranks (``ddloco.compare.ddp_worker``)."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec = workdir / "spec.json"
    out = workdir / "result.json"
    threads = max(1, (os.cpu_count() or 1) // learners)
    spec.write_text(json.dumps({"run": run.to_dict(), "steps": steps, "seed": seed, "eval_points": eval_points,
                                "threads": threads, "device": device}))
    out.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={learners}",
            "-m", "ddloco.compare.ddp_worker", "--spec", str(spec), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    with open(workdir / "torchrun.log", "wb") as log:
        rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0 or not out.exists():
        tail = (workdir / "torchrun.log").read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(f"torchrun DDP failed with exit code {rc}:\n" + "\n".join(tail))
    return json.loads(out.read_text())


def run_cluster(system: str, cfg: ConfigFile, *, learners: int, steps: int, seed: int, workdir: Path,
                syncers: int, per_batch: int, insecure: bool = False,
                step_time_floor_ms: float | None = None) -> dict[str, Any]:
    """Our cluster through ``ddloco up`` (separate processes, real sockets and Redis); every
    learner's step takes at least ``step_time_floor_ms`` when given (``ddloco learner
    --step-time-floor-ms``: the pace of an accelerator, where several learners share one)."""
    from ddloco.up import run_up
    run = system_run(system, cfg.run, learners)
    up = override(cfg.up, learners=learners, syncers=syncers, steps=steps, report_dir=str(workdir),
                  minutes=max(cfg.up.minutes, 30.0))
    run_id = f"cmp-{system.replace('_', '-')}-s{seed}-{os.getpid()}"
    c = replace(cfg, run=run, up=up, endpoints=override(cfg.endpoints, run_id=run_id))
    rep_path = workdir / "report.json"
    rep_path.unlink(missing_ok=True)
    rc = run_up(c, external_redis=False, quiet=True, insecure=insecure, step_time_floor_ms=step_time_floor_ms)
    if rc == 130:
        raise KeyboardInterrupt
    if not rep_path.exists():
        raise RuntimeError(f"ddloco up for {system} seed {seed} wrote no report (exit {rc})")
    rep = json.loads(rep_path.read_text())
    if rc != 0 or rep.get("eval_loss_final") is None:
        raise RuntimeError(f"ddloco up for {system} seed {seed} failed (exit {rc}): {rep.get('failure')}")
    tokens = int(rep["tokens_total"])
    budget = steps * learners * per_batch
    last = rep["eval_curve"][-1]
    if rep.get("timed_out") or tokens != budget or int(last["tokens"]) != tokens:
        raise RuntimeError(f"ddloco up for {system} seed {seed} stopped short of the budget: {tokens:,} of "
                           f"{budget:,} tokens trained, final evaluation at {int(last['tokens']):,} "
                           f"(timed out: {rep.get('timed_out')})")
    curve = [(int(e["tokens"]), float(e["loss"])) for e in rep["eval_curve"]]
    curve[0] = (0, curve[0][1])
    unflushed = sum(int(float(h.get("unflushed", 0) or 0)) for h in rep["learner_stats"].values())
    if unflushed:
        print(f"warning    {system} seed {seed}: {unflushed} fragment(s) were not flushed in time; their last "
              f"steps are missing from the final model", file=sys.stderr, flush=True)
    return {"system": system, "seed": seed, "learners": learners, "steps": steps, "tokens": tokens,
            "wall_s": rep["wall_s"], "eval_loss_final": float(rep["eval_loss_final"]), "curve": curve,
            "bytes_per_token": cluster_bytes_per_token(rep),
            "extra": {"merges": rep["merges"], "goodput": rep["goodput"], "dropped": rep["dropped_messages"],
                      "unflushed_fragments": unflushed, "step_time_floor_ms": step_time_floor_ms,
                      "report": str(rep_path)}}


# ------------------------------------------------------------------------------------ summary
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ddloco compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="gpt", help="built-in task or MODULE:ATTR (default gpt)")
    ap.add_argument("--learners", type=int, default=4, help="M: learners / DP ranks (default 4)")
    ap.add_argument("--tokens", type=int, default=1_638_400, help="token budget N of every multi-learner "
                    "system (default 1,638,400 = 4 learners x 400 steps x 1,024 tokens)")
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..S-1 (model init and data; default 3)")
    ap.add_argument("--seed-list", default=None, help="explicit comma list of seeds instead of --seeds")
    ap.add_argument("--systems", default=None,
                    help=f"comma list from {', '.join(ALL_SYSTEMS)} (default: {','.join(DEFAULT_SYSTEMS)}; with "
                         f"--chaos/--hetero see below)")
    ap.add_argument("--report", metavar="DIR", required=True, help="write compare.json, compare.md, compare.png here")
    ap.add_argument("--config", metavar="FILE.toml", help="TOML config (task, algo, up sections) for every system")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a task or algo setting for every system, e.g. --set algo.outer_lr=1.0")
    ap.add_argument("--eval-points", type=int, default=8, help="evaluations along the budget (default 8)")
    ap.add_argument("--jobs", type=int, default=1, help="in-process systems run this many at a time (default 1)")
    ap.add_argument("--syncers", type=int, default=2, help="syncer shards of the cluster systems (default 2)")
    ap.add_argument("--delay-steps", type=int, default=2,
                    help="decoupled_emulated: steps between a round's answers and the merged value's arrival "
                         "(default 2)")
    ap.add_argument("--device", default="auto",
                    help="where dp, single, dp_emulated and diloco_sync train and the cluster's learners run: "
                         "auto (CUDA when available; dp: NCCL needs one GPU per rank, else gloo on the CPU), cpu, "
                         "cuda, cuda:N (decoupled_emulated and the shards always on the CPU)")
    ap.add_argument("--insecure", action="store_true",
                    help="the cluster systems run without CURVE keys on their sockets (`ddloco up --insecure`)")
    side = ap.add_argument_group("failures and mixed hardware side by side (ddloco.compare.failures)")
    side.add_argument("--chaos", metavar="SPEC", help="run the systems side by side through the same seeded "
                      "failures, e.g. seed=1,learner_mtbf_s=60 (kills of learner/rank i as a Poisson process; "
                      "stalls=N,stall_s=S for SIGSTOPs); systems then from dp_elastic, diloco_sync_elastic, "
                      "torchft, decoupled, decoupled_lockstep, decoupled_k1")
    side.add_argument("--hetero", metavar="SPEC", help="mixed hardware, e.g. slow=2,factor=1.2,noise=0.1: the last "
                      "`slow` learners (default half) that much slower, every step time x (1 + noise N(0,1))")
    side.add_argument("--step-time-floor-ms", type=float, default=None,
                      help="with --chaos/--hetero: the emulated accelerator step time of every system (default 200); "
                           "otherwise the cluster systems' learners' step floor (default none), e.g. where their "
                           "learners share one GPU and would step unevenly and faster than a real cluster's")
    side.add_argument("--checkpoint-every", type=int, default=50, metavar="STEPS",
                      help="the elastic baselines' checkpoint interval (default 50 steps)")
    side.add_argument("--wall-cap", type=float, default=3.0, metavar="X",
                      help="stop a system still short of the budget X failure-free durations after its first step; "
                           "its figures cover what it did until then (default 3)")
    side.add_argument("--target-loss", type=float, default=None,
                      help="wall_s_to_target's loss (default: DP's loss without failures at half the budget, per seed)")
    side.add_argument("--eval-every-s", type=float, default=10.0,
                      help="our cluster's evaluation interval in side-by-side runs (default 10 s)")
    ap.add_argument("--render-only", action="store_true",
                    help="run nothing: rebuild compare.json/md/png from the runs already in DIR/runs")
    ap.add_argument("--resume", action="store_true",
                    help="reuse the runs already in DIR/runs whose system, seed, learners, steps and run config "
                         "match (an interrupted compare goes on where it stopped)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _main(args, list(sys.argv[1:] if argv is None else argv))
    except ConfigError as e:
        print(f"ddloco compare: {e}", file=sys.stderr)
        return EXIT_USAGE


class _Comparison:
    """One `ddloco compare`: the command's checks, then its runs (reused, in process, or each on its
    own: a cluster or DDP) and their results; everything on the calling thread."""

    def __init__(self, args: argparse.Namespace, argv: list[str]) -> None:
        self.args, self.argv = args, argv
        self.systems = systems = [s.strip() for s in (args.systems or ",".join(DEFAULT_SYSTEMS)).split(",") if s.strip()]
        unknown = [s for s in systems if s not in ALL_SYSTEMS]
        if unknown or not systems:
            raise ConfigError(f"unknown system(s) {unknown}; choose from {', '.join(ALL_SYSTEMS)}")
        if args.learners < 1 or args.eval_points < 1 or args.jobs < 1:
            raise ConfigError("--learners, --eval-points and --jobs must be >= 1")
        self.seeds = seeds = ([int(x) for x in args.seed_list.split(",")] if args.seed_list else list(range(args.seeds)))
        if not seeds:
            raise ConfigError("--seeds must be >= 1")
        self.cfg = load_config(args.config)
        if args.device != "auto":   # the cluster's learners train where the in-process systems do
            self.cfg = replace(self.cfg, learner=override(self.cfg.learner, device=args.device))
        run = apply_sets(self.cfg.run, {"task": {"spec": args.task}, "algo": {}})
        self.run = run = apply_sets(run, parse_set(args.set))
        self.per_batch = per_batch = tokens_per_batch(run)
        self.steps = steps = args.tokens // (args.learners * per_batch)
        if steps < 1:
            raise ConfigError(f"--tokens {args.tokens} is less than one step of {args.learners} learners "
                              f"x {per_batch} tokens")
        clusters = any(s in CLUSTER for s in systems)
        if args.step_time_floor_ms is not None:
            if not (math.isfinite(args.step_time_floor_ms) and args.step_time_floor_ms > 0):
                raise ConfigError(f"--step-time-floor-ms must be a finite number > 0, got {args.step_time_floor_ms:g}")
            if not clusters:
                print(f"note: --step-time-floor-ms applies to the cluster systems ({', '.join(CLUSTER)}); none "
                      "runs here, so it is ignored", flush=True)
        self.cluster_floor_ms = args.step_time_floor_ms if clusters else None
        if steps * args.learners * per_batch != args.tokens:
            print(f"note: {args.tokens:,} tokens is not a whole number of steps; using {steps} steps "
                  f"= {steps * args.learners * per_batch:,} tokens", flush=True)
        self.report = report = Path(args.report)
        report.mkdir(parents=True, exist_ok=True)
        print(f"compare    {', '.join(systems)} | M={args.learners} | {steps} steps per learner "
              f"({steps * args.learners * per_batch:,} tokens) | seeds {seeds} | report {report}", flush=True)
        self.results: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
        self.failures: list[str] = []
        self.t_start = time.time()

    def identity(self, system: str, seed: int) -> dict[str, Any]:
        """What a finished run must share with this command to be reused by --resume."""
        args = self.args
        r = system_run(system, apply_sets(self.run, {"task": {"seed": seed}}), args.learners)
        ident: dict[str, Any] = {"run_digest": r.digest(), "learners": args.learners, "steps": self.steps,
                                 "eval_points": args.eval_points}
        if system == "decoupled_emulated":
            ident["delay_steps"] = args.delay_steps
        if system in CLUSTER:
            ident.update(syncers=args.syncers, learner=asdict(self.cfg.learner), syncer=asdict(self.cfg.syncer))
            if args.step_time_floor_ms is not None:
                ident["step_time_floor_ms"] = args.step_time_floor_ms
        if system == "dp" or (args.device != "auto" and system in IN_PROCESS + CLUSTER):
            ident["device"] = args.device
        return ident

    def reusable(self, system: str, seed: int) -> dict[str, Any] | None:
        path = self.report / "runs" / f"{system}-s{seed}.json"
        if self.args.render_only:
            if not path.exists():
                raise ConfigError(f"--render-only: {path} is missing")
            old = json.loads(path.read_text())
            cluster_report = Path(old.get("extra", {}).get("report", ""))
            if system in CLUSTER and cluster_report.is_file():  # figures re-derived from the raw report
                old["bytes_per_token"] = cluster_bytes_per_token(json.loads(cluster_report.read_text()))
            self.results[system].append(old)
            return old
        if not self.args.resume or not path.exists():
            return None
        try:
            old = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return None
        if old.get("identity") != self.identity(system, seed):
            return None
        print(f"reused     {system} seed {seed}: eval loss {old['eval_loss_final']:.4f} ({path})", flush=True)
        self.results[system].append(old)
        return old

    def done(self, system: str, seed: int, res: dict[str, Any]) -> None:
        res["identity"] = self.identity(system, seed)
        self.results[system].append(res)
        (self.report / "runs").mkdir(exist_ok=True)
        (self.report / "runs" / f"{system}-s{seed}.json").write_text(json.dumps(res, indent=1))
        print(f"[{time.time() - self.t_start:7.0f}s] {system:<20} seed {seed}: eval loss {res['eval_loss_final']:.4f} "
              f"at {res['tokens']:,} tokens ({res['wall_s']:.0f}s)", flush=True)

    def run_in_process(self) -> None:
        """The in-process systems, ``--jobs`` at a time; one failed run is reported, the others count."""
        args = self.args
        in_proc = [(s, seed) for s in self.systems if s in IN_PROCESS for seed in self.seeds
                   if self.reusable(s, seed) is None]
        if not in_proc:
            return
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            futures = {}
            for s, seed in in_proc:
                r = apply_sets(self.run, {"task": {"seed": seed}})
                futures[pool.submit(_in_process, s, r.to_dict(), args.learners, self.steps, seed, args.eval_points,
                                    args.delay_steps, args.device)] = (s, seed)
            for fut, (s, seed) in futures.items():
                try:
                    self.done(s, seed, fut.result())
                except Exception as e:  # one failed run is reported, the others still count
                    self.failures.append(f"{s} seed {seed}: {e!r}")
                    print(f"FAILED     {s} seed {seed}: {e!r}", file=sys.stderr, flush=True)

    def run_separately(self) -> bool:
        """DDP and the clusters, one at a time; False on Ctrl-C (the finished runs are kept)."""
        args = self.args
        for s in (s for s in self.systems if s not in IN_PROCESS):
            for seed in self.seeds:
                if self.reusable(s, seed) is not None:
                    continue
                r = apply_sets(self.run, {"task": {"seed": seed}})
                workdir = self.report / "runs" / f"{s}-s{seed}"
                try:
                    if s == "dp":
                        res = run_dp(r, learners=args.learners, steps=self.steps, seed=seed,
                                     eval_points=args.eval_points, workdir=workdir, device=args.device)
                    else:
                        res = run_cluster(s, replace(self.cfg, run=r), learners=args.learners, steps=self.steps,
                                          seed=seed, workdir=workdir, syncers=args.syncers, per_batch=self.per_batch,
                                          insecure=args.insecure, step_time_floor_ms=args.step_time_floor_ms)
                    self.done(s, seed, res)
                except KeyboardInterrupt:
                    print("interrupted: the finished runs are in DIR/runs (--resume goes on from them)",
                          file=sys.stderr, flush=True)
                    return False
                except Exception as e:
                    self.failures.append(f"{s} seed {seed}: {e}")
                    print(f"FAILED     {s} seed {seed}: {e}", file=sys.stderr, flush=True)
        return True

    def write(self) -> int:
        """compare.json, compare.md, compare.png; the exit status (1 if any run failed)."""
        args, run, report = self.args, self.run, self.report
        summary = summarise({s: sorted(v, key=lambda r: r["seed"]) for s, v in self.results.items()},
                            args.eval_points)
        meta = {"task": run.task.spec, "learners": args.learners,
                "tokens": self.steps * args.learners * self.per_batch,
                "steps_per_learner": self.steps, "seeds": self.seeds, "algo": asdict(run.algo),
                "cluster_step_time_floor_ms": self.cluster_floor_ms,
                "task_config": asdict(run.task),
                "command": "ddloco compare " + " ".join(a for a in self.argv if a not in ("--render-only", "--resume")),
                "wall_s": round(time.time() - self.t_start, 1),
                "failures": self.failures}
        doc = {"meta": meta, "systems": summary}
        write_atomic(report / "compare.json", json.dumps(doc, indent=1))
        write_markdown(report / "compare.md", summary, meta)
        if summary:
            write_plot(report / "compare.png", summary,
                       f"Eval loss vs tokens, M={args.learners}, {len(self.seeds)} seed(s)")
        print((report / "compare.md").read_text(), flush=True)
        return EXIT_FAILURE if self.failures else EXIT_OK


def _side_by_side(args: argparse.Namespace, argv: list[str]) -> int:
    from ddloco.compare.failures import SideBySide
    if args.learners < 1 or args.checkpoint_every < 1 or args.wall_cap < 1:
        raise ConfigError("--learners and --checkpoint-every must be >= 1, --wall-cap >= 1")
    seeds = [int(x) for x in args.seed_list.split(",")] if args.seed_list else list(range(args.seeds))
    if not seeds:
        raise ConfigError("--seeds must be >= 1")
    cfg = load_config(args.config)
    run = apply_sets(apply_sets(cfg.run, {"task": {"spec": args.task}, "algo": {}}), parse_set(args.set))
    per_batch = tokens_per_batch(run)
    steps = args.tokens // (args.learners * per_batch)
    if steps < 1:
        raise ConfigError(f"--tokens {args.tokens} is less than one step of {args.learners} learners x {per_batch} tokens")
    report = Path(args.report)
    report.mkdir(parents=True, exist_ok=True)
    side = SideBySide(args, argv, cfg, run, per_batch, steps, seeds, report)
    if not side.run_all():
        return EXIT_INTERRUPTED
    return side.write()


def _main(args: argparse.Namespace, argv: list[str]) -> int:
    if args.chaos or args.hetero:
        return _side_by_side(args, argv)
    comparison = _Comparison(args, argv)
    comparison.run_in_process()
    if not comparison.run_separately():
        return EXIT_INTERRUPTED
    return comparison.write()


def cli_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the command: library logs at warning level (progress lines go to stdout;
    every run keeps its own logs), then ``main``."""
    from common.log import configure_logging
    configure_logging(json_output=False, level="warning")
    return main(argv)


if __name__ == "__main__":
    sys.exit(cli_main())
