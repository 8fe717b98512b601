"""``ddloco bench sync``: does the sync path keep up with the learners? (issue "Scale")

Runs the real daemons twice through ``ddloco up`` with a synthetic model of ``--params``
parameters (``ddloco.bench.synthetic``): once with the run's sync (rounds every H steps), once with
the same learner config and no rounds (H beyond the run's length), each for ``--minutes``.
Learners are stopped at the cap (no flush), so a learner's rate is its steps over the time
from joined to stopped. Reports:

- steps/s per learner with sync ÷ without (the sync path's cost to training);
- bytes up and down per learner step, and down ÷ up: all of it, and the broadcasts alone (the
  full values fetched at join and for repairs counted apart);
- merges/s per shard (over the learners' training window) vs required (every owned fragment
  once per H steps of the median learner), their ratio, and the merges counted behind schedule
  (the fragment's steps between merges, an EMA, above 1.2 × H) ÷ all merges;
- late answers (arrived after their round merged) ÷ answers received;
- join time (process start to joined) and peak RSS per role (learner, shard), with the model's
  fp32 bytes for scale, and the learners' peak RSS in the run without rounds (training alone);
- CPU: the cores the learners kept busy (every thread, joined to stopped) with and without rounds,
  their CPU seconds per step, the shards' CPU seconds per learner step, and from those the cores
  that the learners and shards together would need to step as fast with rounds as without
  (``cores_needed_for_ratio_1``), against the machine's cores: above them, a ratio of 1 cannot be
  reached here (the broker, Redis and ``up`` itself come on top);
- the learners' extra CPU per step (``learner_extra_cpu``: with ÷ without − 1, which also counts
  what the shards' memory traffic costs training on shared cores, and moves with the run without
  rounds), and the sync path's own CPU over the rest of the learners' CPU in the same run
  (``learner_sync_cpu_share``: the training thread's at step boundaries, the network thread's and
  libzmq's I/O threads'; ``learner_sync_cpu_share_own_threads`` leaves libzmq's out, as reports
  before 2026-11-27 did).

This machine runs everything on the same cores: the syncers' merges and the learners' network
threads compete with training, which a deployment (syncers on their own CPU boxes) does not.
``up``'s periodic evaluation of the global model (it fetches every fragment and runs the model)
is not part of the sync path: off by default here (``--eval-every-s``), in both runs alike.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

from common import exits

from common.config import AlgoConfig


def drop_checkpoints(run_id: str, runs: Path = Path("runs")) -> int:
    """Remove the shard checkpoints of ``up``'s work directories of ``run_id`` (runs/RUN_ID-<time>/
    checkpoints): a bench run's model is of no use once its report is read, and at 10^8 parameters
    each run leaves ~0.8 GB of them (two runs per ``bench sync``). Its logs and config stay.
    Returns how many directories were removed."""
    removed = 0
    for d in runs.glob(f"{run_id}-*"):
        if (d / "checkpoints").is_dir():
            shutil.rmtree(d / "checkpoints", ignore_errors=True)
            removed += 1
    return removed


def _up(tag: str, args: argparse.Namespace, out: Path, *, sync_every: int) -> dict[str, Any]:
    report = out / tag
    run_id = f"bsync-{tag}-{os.getpid()}"
    try:
        return _run_up(tag, run_id, args, report, sync_every=sync_every)
    finally:
        if not args.keep_checkpoints:
            drop_checkpoints(run_id)


def _run_up(tag: str, run_id: str, args: argparse.Namespace, report: Path, *, sync_every: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "ddloco", "up", "--insecure", "--quiet", "--run-id", run_id,
           *_task(args),
           "--learners", str(args.learners), "--syncers", str(args.syncers), "--steps", "0",
           "--minutes", str(args.minutes), "--step-time-floor-ms", str(args.step_time_floor_ms),
           "--sync-every", str(sync_every), "--fragments", str(args.fragments), "--tau", str(args.tau),
           "--report", str(report), "--device", args.device]
    if args.learner_threads:
        cmd += ["--learner-threads", str(args.learner_threads)]
    if args.eval_every_s > 0:
        cmd += ["--eval-every-s", str(args.eval_every_s)]
    else:
        cmd += ["--eval-every-s", "1e9"]    # the initial and final evaluations only
    print(f"[bench sync] {tag}: {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    # the synthetic task measures the sync path, not quality: a run whose regression target got
    # worse (up's exit 4, "did not train as it should") still measured its steps and bytes
    if proc.returncode not in (exits.OK, exits.DID_NOT_TRAIN) or not (report / "report.json").exists():
        raise RuntimeError(f"ddloco up ({tag}) exited {proc.returncode}: {proc.stderr[-2000:]}")
    print(f"[bench sync] {tag}: done in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    return json.loads((report / "report.json").read_text())


def _task(args: argparse.Namespace) -> list[str]:
    """The task flags of both runs: the synthetic model of ``--params``, or ``--task`` with its args."""
    if args.task is None:
        return ["--task", "ddloco.bench.synthetic:task", "--task-arg", f"params={int(args.params)}"]
    return ["--task", args.task, *(x for item in args.task_arg for x in ("--task-arg", item))]


def _params(args: argparse.Namespace) -> int:
    """The model's parameters: ``--params``, or those of ``--task``'s model."""
    if args.task is None:
        return int(args.params)
    from common.task import build_model, load_task, parse_task_args
    model = build_model(load_task(args.task, parse_task_args(args.task_arg)), 0)
    return sum(p.numel() for p in model.parameters())


def _f(h: dict[str, Any], key: str) -> float:
    try:
        return float(h.get(key) or 0.0)
    except (TypeError, ValueError):
        return 0.0


def _span(h: dict[str, Any]) -> float:
    """A learner's training window: joined to stopped, in seconds."""
    return _f(h, "stopped_at") - _f(h, "started_at") - _f(h, "boot_s")


def _learner_rates(rep: dict[str, Any]) -> dict[str, float]:
    out = {}
    for lid, h in rep["learner_stats"].items():
        span = _span(h)
        if span > 0 and _f(h, "steps") > 0:
            out[lid] = _f(h, "steps") / span
    return out


def _trained(rep: dict[str, Any]) -> Iterator[tuple[dict[str, Any], float, float]]:
    """(hash, CPU seconds since joined, seconds of training) of each learner that trained."""
    for h in rep.get("learner_stats", {}).values():
        span, used = _span(h), _f(h, "cpu_s") - _f(h, "cpu_s_at_joined")
        if span > 0 and used > 0:
            yield h, used, span


def _cpu(rep: dict[str, Any]) -> tuple[float, float, float]:
    """(the learners' CPU seconds while training, their steps, the cores they kept busy)."""
    cpu = steps = cores = 0.0
    for h, used, span in _trained(rep):
        cpu, steps, cores = cpu + used, steps + _f(h, "steps"), cores + used / span
    return cpu, steps, cores


def _sync_cpu_share(rep: dict[str, Any], *, io: bool = True) -> float | None:
    """The learners' sync path's CPU over the rest of their CPU since joined, from their own clocks
    in the same run (the training thread's at step boundaries, the network thread's, and with
    ``io`` libzmq's I/O threads': the bytes on the wire, CURVE): what the run without rounds cannot
    give as steadily (its CPU per step moves ±15 % from run to run). torch's worker threads where a
    learner has several, and the lock-step barrier's and the final flush's merges count as the
    rest. None: reports of a version that did not record it (with ``io``: no ``io_cpu_s``)."""
    hashes = rep.get("learner_stats", {}).values()
    if any("boundary_cpu_s" not in h or (io and "io_cpu_s" not in h) for h in hashes):
        return None
    sync = rest = 0.0
    for h, used, _ in _trained(rep):
        own = _f(h, "boundary_cpu_s") + _f(h, "net_cpu_s") - _f(h, "net_cpu_s_at_joined")
        if io:
            own += _f(h, "io_cpu_s") - _f(h, "io_cpu_s_at_joined")
        sync, rest = sync + own, rest + used - own
    return round(sync / rest, 4) if rest > 0 else None


def summarise(with_sync: dict[str, Any], without: dict[str, Any], *, params: int, sync_every: int,
              fragments: int, syncers: int) -> dict[str, Any]:
    """The figures of one ``bench sync`` run from the two reports (pure: unit-tested)."""
    rates, base = _learner_rates(with_sync), _learner_rates(without)
    learners = with_sync["learner_stats"]
    steps = sum(_f(h, "steps") for h in learners.values())
    up = sum(_f(h, "bytes_up") for h in learners.values())
    down = sum(_f(h, "bytes_down") for h in learners.values())
    fetched = sum(_f(h, "bytes_fetched") for h in learners.values())   # joins and repairs (full fp32 values)
    shards = with_sync["shard_stats"]
    wall = float(with_sync.get("wall_s") or 0.0)
    # merges are counted over the learners' training window (start-up and joins excluded)
    spans = [_span(h) for h in learners.values()]
    window = statistics.median(spans) if spans else 0.0
    median_rate = statistics.median(rates.values()) if rates else 0.0
    required = (fragments / syncers) * median_rate / sync_every                # merges/s one shard owes
    answers = sum(_f(h, "answers") for h in shards.values())
    late = sum(_f(h, "late_answers") for h in shards.values())
    return {
        "params": params,
        "model_fp32_mb": round(params * 4 / 2**20, 1),
        "steps_per_s_with_sync": round(sum(rates.values()), 4),
        "steps_per_s_without_sync": round(sum(base.values()), 4),
        "ratio": round(sum(rates.values()) / sum(base.values()), 4) if base and rates else None,
        "per_learner_with": {k: round(v, 4) for k, v in rates.items()},
        "per_learner_without": {k: round(v, 4) for k, v in base.items()},
        "bytes_up_per_step": round(up / steps, 1) if steps else None,
        "bytes_down_per_step": round(down / steps, 1) if steps else None,
        "bytes_down_broadcast_per_step": round((down - fetched) / steps, 1) if steps else None,
        "bytes_fetched": int(fetched),
        "down_over_up": round(down / up, 3) if up else None,
        "broadcast_down_over_up": round((down - fetched) / up, 3) if up else None,
        "merges_per_s_per_shard": {k: round(_f(h, "merges") / window, 4) for k, h in shards.items()} if window > 0 else {},
        "merges_per_s_required": round(required, 4),
        "merges_over_required": (round(statistics.mean(_f(h, "merges") / window for h in shards.values()) / required, 4)
                                 if window > 0 and required > 0 and shards else None),
        "rounds_behind": int(sum(_f(h, "rounds_behind") for h in shards.values())),
        "behind_fraction": round(sum(_f(h, "rounds_behind") for h in shards.values())
                                 / max(1.0, sum(_f(h, "merges") for h in shards.values())), 4),
        "late_answers": int(late),
        "late_fraction": round(late / (answers + late), 4) if answers + late else None,
        "merge_s_per_merge": round(sum(_f(h, "merge_s_sum") for h in shards.values())
                                   / max(1.0, sum(_f(h, "merges") for h in shards.values())), 4),
        "join_s": {k: _f(h, "boot_s") for k, h in learners.items()},
        "peak_rss_mb": {"learner": max((_f(h, "peak_rss_mb") for h in learners.values()), default=0.0),
                        "shard": max((_f(h, "peak_rss_mb") for h in shards.values()), default=0.0)},
        # the same learners training without rounds: what training alone holds (model, gradients,
        # AdamW's two moments), so the difference is what the sync path adds
        "peak_rss_mb_without_sync": {
            "learner": max((_f(h, "peak_rss_mb") for h in without.get("learner_stats", {}).values()), default=0.0)},
        "wall_s": {"with": wall, "without": float(without.get("wall_s") or 0.0)},
        **_cpu_figures(with_sync, without, shards, steps_per_s_without=sum(base.values())),
        **_gpu_figures(learners, params=params),
    }


def _gpu_figures(learners: dict[str, Any], *, params: int) -> dict[str, Any]:
    """A CUDA learner's copies (learner/staging.py): GPU milliseconds per copy and per step each
    way, the training stream's waits on a copy, peak GPU memory; with the host RSS bound of the
    issue "Proven where our users train" (2.5 × the model's fp32 bytes + 400 MB). Empty on a CPU."""
    cuda = {k: h for k, h in learners.items() if _f(h, "gpu_peak_mb") > 0}
    if not cuda:
        return {}
    per = {}
    for k, h in cuda.items():
        steps = max(1.0, _f(h, "steps"))
        per[k] = {"d2h_ms_per_copy": round(_f(h, "d2h_ms") / max(1.0, _f(h, "d2h_copies")), 3),
                  "h2d_ms_per_copy": round(_f(h, "h2d_ms") / max(1.0, _f(h, "h2d_copies")), 3),
                  "d2h_ms_per_step": round(_f(h, "d2h_ms") / steps, 3),
                  "h2d_ms_per_step": round(_f(h, "h2d_ms") / steps, 3),
                  "copies": int(_f(h, "d2h_copies") + _f(h, "h2d_copies")),
                  "stream_waits": int(_f(h, "stream_waits")), "stream_wait_ms": _f(h, "stream_wait_ms"),
                  "gpu_peak_mb": _f(h, "gpu_peak_mb"), "peak_rss_mb": _f(h, "peak_rss_mb"),
                  # wall ms taking pinned memory per step (training thread; network thread), and the
                  # training thread's CPU ms per step at step boundaries (learner/staging.py)
                  "pin_ms_per_step": round(_f(h, "pin_ms") / steps, 3),
                  "pin_ms_net_per_step": round(_f(h, "pin_ms_net") / steps, 3),
                  "boundary_cpu_ms_per_step": round(_f(h, "boundary_cpu_s") * 1e3 / steps, 3)}
    rss_bound = 2.5 * params * 4 / 2**20 + 400
    return {"gpu": {"learners": per,
                    "stream_waits": sum(v["stream_waits"] for v in per.values()),
                    "gpu_peak_mb": max(v["gpu_peak_mb"] for v in per.values()),
                    "rss_bound_mb": round(rss_bound, 1),
                    "rss_within_bound": all(v["peak_rss_mb"] <= rss_bound for v in per.values())}}


def _cpu_figures(with_sync: dict[str, Any], without: dict[str, Any], shards: dict[str, Any], *,
                 steps_per_s_without: float) -> dict[str, Any]:
    cpu_w, steps_w, cores_w = _cpu(with_sync)
    cpu_o, steps_o, cores_o = _cpu(without)
    if not (steps_w and steps_o) or not all(_f(h, "cpu_s") for h in shards.values()):
        return {}      # reports of a version that did not record CPU time
    per_step_w, per_step_o = cpu_w / steps_w, cpu_o / steps_o
    shard_cpu = sum(_f(h, "cpu_s") for h in shards.values())
    shard_per_step = shard_cpu / steps_w   # start-up included
    checkpoint = {}
    if all("checkpoint_cpu_s" in h for h in shards.values()):   # the writer thread's CPU, of the shards' own
        checkpoint = {"shard_checkpoint_cpu_share": round(sum(_f(h, "checkpoint_cpu_s") for h in shards.values())
                                                          / shard_cpu, 4),
                      "shard_checkpoints": int(sum(_f(h, "checkpoints") for h in shards.values())),
                      "shard_checkpoint_mb": round(sum(_f(h, "checkpoint_bytes") for h in shards.values()) / 1e6, 1)}
    return {"cpu": {
        "learner_cores_with": round(cores_w, 3), "learner_cores_without": round(cores_o, 3),
        "learner_cpu_s_per_step_with": round(per_step_w, 4), "learner_cpu_s_per_step_without": round(per_step_o, 4),
        "learner_extra_cpu": round(per_step_w / per_step_o - 1, 4),
        "learner_sync_cpu_share": _sync_cpu_share(with_sync),
        "learner_sync_cpu_share_own_threads": _sync_cpu_share(with_sync, io=False),
        "shard_cpu_s_per_learner_step": round(shard_per_step, 4),
        "cores_needed_for_ratio_1": round(steps_per_s_without * (per_step_w + shard_per_step), 3),
        "cores": os.cpu_count(), **checkpoint}}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ddloco bench sync", description=__doc__.split("\n\n")[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=1e7, help="model parameters (default 1e7)")
    ap.add_argument("--task", help="train this task instead of the synthetic model (a built-in name such as hf, "
                    "or MODULE:ATTR); --params is then ignored")
    ap.add_argument("--task-arg", action="append", default=[], metavar="KEY=VALUE", help="an arg of --task (repeat)")
    ap.add_argument("--learners", type=int, default=2, help="learners (default 2)")
    ap.add_argument("--syncers", type=int, default=2, help="syncer shards (default 2)")
    ap.add_argument("--device", default="cpu", help='where the learners train: "cpu" (default), "cuda", "auto"; '
                    "the shards always run on the CPU")
    ap.add_argument("--step-time-floor-ms", type=float, default=250.0, help="emulated accelerator step time (default 250)")
    ap.add_argument("--minutes", type=float, default=1.5, help="length of each of the two runs (default 1.5)")
    d = AlgoConfig()
    ap.add_argument("--sync-every", type=int, default=d.sync_every_steps,
                    help=f"H of the run with sync (default {d.sync_every_steps}, the run's default)")
    ap.add_argument("--fragments", type=int, default=d.fragments, help=f"P (default {d.fragments}, the run's default)")
    ap.add_argument("--tau", type=int, default=d.tau, help=f"τ: rounds in flight per shard (default {d.tau}, "
                    "the run's default)")
    ap.add_argument("--eval-every-s", type=float, default=0.0, help="up's periodic evaluation of the global "
                    "model, seconds (default 0: none, only the initial and final ones; it is not the sync path)")
    ap.add_argument("--learner-threads", type=int, default=0, metavar="N",
                    help="torch threads of each learner in both runs (default 0: up's, the cores shared among "
                         "the learners)")
    ap.add_argument("--report", help="keep both runs' reports and bench.json here (default: a temp dir)")
    ap.add_argument("--keep-checkpoints", action="store_true",
                    help="keep both runs' shard checkpoints under runs/ (default: removed once the run's report "
                         "is read; ~0.8 GB per run at 1e8 parameters)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    return ap


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    if args.params < 1 or args.learners < 1 or args.minutes <= 0:
        print("ddloco bench sync: --params, --learners and --minutes must be positive", file=sys.stderr)
        return exits.USAGE
    out = Path(args.report) if args.report else Path(tempfile.mkdtemp(prefix="bench-sync-"))
    out.mkdir(parents=True, exist_ok=True)
    with_sync = _up("sync", args, out, sync_every=args.sync_every)
    without = _up("nosync", args, out, sync_every=10**9)
    res = summarise(with_sync, without, params=_params(args), sync_every=args.sync_every,
                    fragments=args.fragments, syncers=args.syncers)
    res["config"] = {k: getattr(args, k) for k in ("task", "task_arg", "device", "learners", "syncers", "step_time_floor_ms", "minutes",
                                                    "sync_every", "fragments", "tau")}
    (out / "bench.json").write_text(json.dumps(res, indent=2))
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        for k, v in res.items():
            print(f"{k:28s} {v}")
        print(f"(reports in {out})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
