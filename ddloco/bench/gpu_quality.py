"""``make gpu-quality OUT=DIR``: quality with scale (issue 34) on one GPU in a few minutes.

    python3 -m ddloco.bench.gpu_quality OUT [--dry] [--budget-s 300] [--sizes s,m,l] [--seeds 2]
                                            [--only inproc|cluster] [--tokens-per-param R]
                                            [--equal-tokens-per-param] [--cluster-step-floor-ms 60]

A size sweep of the built-in ``gpt`` task through ``ddloco compare``, M = 4 learners, three
systems at equal tokens: ``dp_emulated`` (data-parallel mathematics in one process: the M
streams' batches in one step), ``diloco_sync`` (synchronous DiLoCo in one process) and
``decoupled`` (the real cluster, ``ddloco up --insecure``: 4 learner processes sharing the GPU,
the shards on the CPU cores). Every size trains the same tokens per parameter R, the largest
that lets both lanes end inside the budget (at most 20, Chinchilla's); the plan says which.

Standard library only at import time: it first calls ``gpu_env.prepare`` (wheels, C kernels),
then runs every stage as a subprocess of ``sys.executable`` with that environment. The lanes run
side by side, sizes smallest first: the in-process systems (one ``ddloco compare`` per size,
every seed and system at once) and one lane per cluster seed (``cluster``, ``cluster2``: one
``ddloco compare --systems decoupled`` per size, the learners stepping no faster than a floor).
Each stage has its own timeout from the plan, capped by the budget's end; a stage that fails or
times out is recorded and the lane goes on. After every stage OUT gets (at most four
flat files): ``quality.json`` (every figure), ``quality.md`` (the table), ``quality.png``
(ratio to DP vs parameters with the published points) and ``quality_logs.tar.gz`` (the stages'
logs, the plan, env.json). ``--dry`` runs the same stages on the CPU at tiny sizes in seconds.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Sequence

# the pure parts (also what the tests read here)
from ddloco.bench.quality_plan import (CPU, DRY, FULL, GPU, MAX_TOKENS_PER_PARAM, PUBLISHED, Size, param_count,  # noqa: F401
                                       train_flops)
from ddloco.bench.quality_plan import (DRY_TOKENS_PER_PARAM, LEARNERS, LOG_FILE_LIMIT, NAMED_SIZES, lane_cost,  # noqa: F401
                                       Profile, QualityError, SizePlan, _size_plans, parse_size, parse_sizes, plan)
from ddloco.bench.quality_table import cluster_health, collect, markdown, plot, short_table, table_rows  # noqa: F401

# ------------------------------------------------------------------------------------ stages
REPO = Path(__file__).resolve().parents[2]
STOP_GRACE_S = 8.0
"""A timed-out stage gets Ctrl-C (its cluster stops cleanly), then SIGKILL after this long."""
END_RESERVE_S = STOP_GRACE_S + 3.0 + 4.0
"""Every stage ends this long before the budget does: a stage's stop (Ctrl-C, SIGKILL) and the
last outputs fit in it, so the whole command ends inside ``--budget-s``."""


@dataclass
class Stage:
    """One ``ddloco compare`` of one lane at one size."""

    name: str
    lane: str
    size: str
    argv: list[str]
    timeout_s: float
    report: Path
    seeds: tuple[int, ...] = ()
    """The seeds it runs (of every system of its lane)."""
    status: str = "pending"
    rc: int | None = None
    wall_s: float = 0.0

    def record(self) -> dict[str, Any]:
        return {"name": self.name, "lane": self.lane, "size": self.size, "status": self.status, "rc": self.rc,
                "wall_s": round(self.wall_s, 1), "timeout_s": round(self.timeout_s, 1),
                "command": " ".join(self.argv[1:])}



STAGE_SLACK_S = {False: 20.0, True: 60.0}
"""Seconds a stage may take beyond twice its estimate: a dry run's stages are estimated at a few
seconds, and on a loaded 2-core machine (the test suite's other workers) a cluster stage's start-up
alone took 21 s."""

def lane_seeds(p: SizePlan, lane: str, seed_start: int) -> tuple[int, ...]:
    """The seeds a lane runs at one size: ``inproc`` every seed of its systems, ``cluster`` (the
    first cluster lane) ``seed_start``, ``clusterK`` seed_start + K - 1."""
    if lane == "inproc":
        return tuple(seed_start + k for k in range(p.seeds))
    k = int(lane[len("cluster"):] or 1) - 1
    return (seed_start + k,)


def cluster_lanes(p: SizePlan) -> list[str]:
    """One lane per cluster seed (``cluster``, ``cluster2``, ...): they run side by side."""
    return ["cluster" + (str(k + 1) if k else "") for k in range(p.cluster_seeds)]


def compare_argv(p: SizePlan, lane: str, profile: Profile, *, device: str, config: Path, report: Path,
                 seed_start: int) -> list[str]:
    """The ``ddloco compare`` of one lane at one size."""
    seeds = lane_seeds(p, lane, seed_start)
    systems = "dp_emulated,diloco_sync" if lane == "inproc" else "decoupled"
    argv = [sys.executable, "-m", "ddloco", "compare", "--task", "gpt", "--learners", str(LEARNERS),
            "--tokens", str(p.tokens), "--seed-list", ",".join(map(str, seeds)),
            "--systems", systems, "--jobs", str(2 * len(seeds) if lane == "inproc" else 1),
            "--eval-points", str(profile.eval_points), "--device", device, "--insecure",
            "--config", str(config), "--report", str(report)]
    sets = [f"task.seq_len={profile.seq_len}", f"task.batch_size={profile.batch_size}",
            *Size(p.n_layer, p.n_embd, p.n_head).sets()]
    if lane != "inproc":
        sets.append(f"algo.fragments={profile.cluster_fragments}")
        if profile.cluster_step_floor_ms:   # repr: the float itself, which the runs record and --merge compares
            argv += ["--step-time-floor-ms", repr(float(profile.cluster_step_floor_ms))]
    for kv in sets:
        argv += ["--set", kv]
    return argv


CONFIG_TOML = """# gpu_quality: every system in fp32 (TF32 matmuls on a GPU), the cluster evaluated at its start and end
[learner]
autocast = "off"

[up]
eval_every_s = 100000.0
"""


def run_stage(stage: Stage, env: dict[str, str], deadline: float) -> None:
    """Run one stage under min(its timeout, the budget's end); the outcome goes into ``stage``."""
    left = deadline - time.monotonic()
    timeout = min(stage.timeout_s, left)
    if left < 5:
        stage.status = "skipped: no time left in the budget"
        return
    stage.report.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(stage.report / "stage.log", "wb") as log:
        proc = subprocess.Popen(stage.argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)
        try:
            stage.rc = proc.wait(timeout)
            stage.status = "ok" if stage.rc == 0 else f"failed (exit {stage.rc})"
        except subprocess.TimeoutExpired:
            stage.status = f"timed out after {timeout:.0f} s"
            stage.rc = _stop(proc)
    stage.wall_s = time.monotonic() - t0


def _stop(proc: subprocess.Popen) -> int | None:
    """Ctrl-C to the stage's process group (compare stops its cluster), SIGKILL if it lingers."""
    for sig, wait in ((signal.SIGINT, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            return proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue
    return proc.poll()


class Sweep:
    """The stages of one run and what they produced; lanes run on their own threads, the outputs
    are rewritten (under ``lock``) after every stage."""

    def __init__(self, out: Path, work: Path, plans: list[SizePlan], meta: dict[str, Any],
                 merged: dict[str, Any] | None) -> None:
        self.out, self.work, self.plans, self.meta = out, work, plans, meta
        self.merged = merged or {}
        self.stages: list[Stage] = []
        self.lock = threading.Lock()

    def run_lanes(self, env: dict[str, str], deadline: float) -> None:
        lanes = sorted({s.lane for s in self.stages})
        threads = [threading.Thread(target=self._lane, args=(lane, env, deadline), name=f"lane-{lane}")
                   for lane in lanes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _lane(self, lane: str, env: dict[str, str], deadline: float) -> None:
        for stage in (s for s in self.stages if s.lane == lane):
            print(f"[gpu quality] {stage.name}: start (timeout {min(stage.timeout_s, deadline - time.monotonic()):.0f} s)",
                  file=sys.stderr, flush=True)
            run_stage(stage, env, deadline)
            print(f"[gpu quality] {stage.name}: {stage.status} ({stage.wall_s:.1f} s)", file=sys.stderr, flush=True)
            self.write()

    def missing(self) -> list[str]:
        """The planned runs (size, system, seed) without a figure: empty when the sweep is whole,
        whatever a stage's exit status (a compare that fails after its runs, e.g. on a plot
        library the machine lacks, loses no figure)."""
        res, out = self.results(), []
        for p in self.plans:
            for stage in (s for s in self.stages if s.size == p.size):
                systems = ("dp_emulated", "diloco_sync") if stage.lane == "inproc" else ("decoupled",)
                for system in systems:
                    for seed in map(str, stage.seeds):
                        if seed not in res.get(p.size, {}).get(system, {}):
                            out.append(f"{p.size} {system} seed {seed}")
        return out

    def results(self) -> dict[str, Any]:
        tokens = {p.size: p.tokens for p in self.plans}
        res = collect((s.size, s.report, tokens[s.size]) for s in self.stages)
        prof = self.meta.get("profile", {})
        fragments, floor = prof.get("cluster_fragments"), prof.get("cluster_step_floor_ms")
        for systems in res.values():     # this run's settings, also on a run read from its report alone
            for r in systems.get("decoupled", {}).values():
                r.setdefault("step_time_floor_ms", floor)
        clusters = any(s.lane != "inproc" for s in self.stages)
        for size, systems in self.merged.items():   # an earlier run's seeds at the same size and tokens
            for system, seeds in systems.items():
                for seed, r in seeds.items():
                    if system == "decoupled" and clusters and (r.get("fragments") != fragments
                                                               or r.get("step_time_floor_ms") != floor):
                        continue   # another cluster setting (or one not recorded): not this sweep's system
                    res.setdefault(size, {}).setdefault(system, {}).setdefault(seed, r)
        return res

    def write(self) -> list[dict[str, Any]]:
        """quality.json, quality.md, quality.png, quality_logs.tar.gz from what has finished."""
        with self.lock:
            results = self.results()
            rows = table_rows(results, self.plans)
            meta = {**self.meta, "stages": [s.record() for s in self.stages]}
            title = f"Ratio to data-parallel vs size, M={LEARNERS}, {meta.get('device_name') or meta.get('device')}"
            try:
                meta["plot"] = "ok" if plot(self.out / "quality.png", rows, title) else "skipped: no matplotlib"
            except Exception as e:   # a figure never costs the figures
                meta["plot"] = f"failed: {e!r}"[:200]
            doc = {"meta": meta, "plan": [asdict(p) for p in self.plans], "rows": rows, "results": results}
            _write(self.out / "quality.json", json.dumps(doc, indent=1))
            _write(self.out / "quality.md", markdown(rows, meta))
            self._archive()
            return rows

    def _archive(self) -> None:
        tmp = self.out / "quality_logs.tar.gz.tmp"
        with tarfile.open(tmp, "w:gz") as tar:
            for f in sorted(self.work.rglob("*")):
                if f.is_file() and f.suffix in (".log", ".json", ".md", ".toml", ".txt") \
                        and f.stat().st_size <= LOG_FILE_LIMIT:
                    tar.add(f, arcname=str(f.relative_to(self.work)))
        os.replace(tmp, self.out / "quality_logs.tar.gz")


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------ CLI
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python3 -m ddloco.bench.gpu_quality", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", metavar="OUT", help="results directory (quality.json, .md, .png, quality_logs.tar.gz)")
    ap.add_argument("--dry", action="store_true", help="tiny sizes on the CPU, in seconds (the suite runs it)")
    ap.add_argument("--budget-s", type=float, default=None, help="wall seconds for everything, env set-up "
                    "included (default 300; --dry 150, a cap: it takes ~45-60 s)")
    ap.add_argument("--sizes", default=None, help="comma list of names (" + ", ".join(
        f"{k}={v}" for k, v in NAMED_SIZES.items()) + ") or LAYERSxWIDTH[hHEADS] (default s,m,l)")
    ap.add_argument("--seeds", type=int, default=None, help="seeds of dp_emulated and diloco_sync below the "
                    "largest size (default 2; the largest gets 1)")
    ap.add_argument("--cluster-seeds", type=int, default=None,
                    help="seeds of the decoupled cluster per size, each in a lane of its own, side by side (default 2)")
    ap.add_argument("--cluster-fragments", type=int, default=None,
                    help="fragments of the decoupled cluster (default 4: few rounds a second; the table marks a "
                         "cluster more than 10 %% behind schedule or with more than 10 %% of its answers late)")
    ap.add_argument("--cluster-step-floor-ms", type=float, default=None,
                    help="every cluster learner's step takes at least this long (default 60; --dry 20; 0: none): "
                         "four learners sharing one GPU otherwise step unevenly, 10-30 ms, and the slow ones' "
                         "answers miss rounds")
    ap.add_argument("--seed-start", type=int, default=0, help="first seed (a later run adds seeds 2, 3, ...)")
    ap.add_argument("--equal-tokens-per-param", action="store_true",
                    help="every size the same tokens per parameter, the most the budget fits (default: the "
                         "time shared 1 : 2 : 3 by size, the smaller sizes nearer the ceiling): the ratio's "
                         "trend with size at one training length")
    ap.add_argument("--tokens-per-param", type=float, default=None,
                    help="the ceiling of R, tokens per parameter (default 20; --dry 0.5); the plan takes the "
                         "largest R up to it that fits the budget")
    ap.add_argument("--only", choices=("inproc", "cluster"), default=None,
                    help="one kind of lane: inproc (dp_emulated, diloco_sync) or cluster (decoupled: every "
                         "cluster lane)")
    ap.add_argument("--device", default="auto", help="auto (cuda when torch sees one; --dry: cpu), cpu, cuda")
    ap.add_argument("--keep-work", action="store_true",
                    help="keep the stages' directories (cluster reports, checkpoints) in /tmp; their logs are "
                         "in quality_logs.tar.gz either way")
    ap.add_argument("--merge", metavar="QUALITY_JSON", default=None,
                    help="an earlier run's quality.json: this run takes its plan (sizes, tokens) and its "
                         "runs join the table (use --seed-start for new seeds)")
    return ap


def _profile(args: argparse.Namespace) -> Profile:
    prof = DRY if args.dry else FULL
    if args.sizes:
        prof = replace(prof, sizes=tuple(parse_sizes(args.sizes)))
    if args.seeds is not None:
        prof = replace(prof, seeds=args.seeds)
    if args.cluster_seeds is not None:
        prof = replace(prof, cluster_seeds=args.cluster_seeds)
    if args.cluster_fragments is not None:
        if args.cluster_fragments < 1:
            raise QualityError("--cluster-fragments must be >= 1")
        prof = replace(prof, cluster_fragments=args.cluster_fragments)
    if args.cluster_step_floor_ms is not None:
        if not (math.isfinite(args.cluster_step_floor_ms) and args.cluster_step_floor_ms >= 0):
            raise QualityError("--cluster-step-floor-ms must be a finite number >= 0 (0: no floor)")
        prof = replace(prof, cluster_step_floor_ms=args.cluster_step_floor_ms or None)
    if prof.seeds < 1 or prof.cluster_seeds < 1 or args.seed_start < 0:
        raise QualityError("--seeds and --cluster-seeds must be >= 1, --seed-start >= 0")
    return prof


def merged_plan(path: str, profile: Profile, machine: Any = GPU) -> tuple[list[SizePlan], dict[str, Any]]:
    """``--merge``: the earlier run's plan (its sizes and steps, this run's seeds and estimates: its
    step floor, its lanes) and results, so this run's seeds join them at equal tokens."""
    try:
        doc = json.loads(Path(path).read_text())
        plans = [SizePlan(**p) for p in doc["plan"]]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise QualityError(f"--merge {path}: not a quality.json of this tool ({e!r})") from None
    if not plans:
        raise QualityError(f"--merge {path}: its plan is empty")
    prof = replace(profile, sizes=tuple(parse_size(p.size) for p in plans))
    again = _size_plans(prof, machine, [p.steps for p in plans])
    if [p.tokens for p in again] != [p.tokens for p in plans]:
        raise QualityError(f"--merge {path}: its plan's tokens per step differ from this profile's")
    return again, doc.get("results", {})


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.monotonic()
    budget = args.budget_s if args.budget_s is not None else (150.0 if args.dry else 300.0)
    deadline = t0 + budget - END_RESERVE_S
    out = Path(args.out)
    try:
        profile = _profile(args)
        out.mkdir(parents=True, exist_ok=True)
    except (QualityError, OSError) as e:
        print(f"gpu quality: {e}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="ddloco-quality-"))
    from ddloco.bench.gpu_env import prepare
    env = prepare(work)
    facts = json.loads((work / "env.json").read_text())
    device = args.device if args.device != "auto" else (
        "cuda" if facts.get("cuda_available") and not args.dry else "cpu")
    machine = GPU if device.startswith("cuda") else CPU
    if machine is GPU:
        env["TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"] = "1"     # TF32 matmuls in every process, the learners' too
    left = deadline - time.monotonic()
    lane_s = left * 0.75 - 5.0
    tpp = args.tokens_per_param or (DRY_TOKENS_PER_PARAM if args.dry else MAX_TOKENS_PER_PARAM)
    merged: dict[str, Any] = {}
    if args.merge:
        try:
            plans, merged = merged_plan(args.merge, profile, machine)
        except QualityError as e:
            print(f"gpu quality: {e}", file=sys.stderr)
            return 2
        notes = [f"plan of {args.merge} (its sizes and tokens); its runs are merged"]
    else:
        plans, notes = plan(profile, machine, lane_s if not args.dry else 1e9, max_tpp=tpp,
                            equal=args.equal_tokens_per_param)
    (work / "config.toml").write_text(CONFIG_TOML)
    meta = {"device": device, "device_name": facts.get("gpu") or ("cpu" if device == "cpu" else device),
            "dry": args.dry, "budget_s": budget, "lane_s": round(lane_s, 1), "machine_model": asdict(machine),
            "profile": {"seq_len": profile.seq_len, "batch_size": profile.batch_size, "learners": LEARNERS,
                        "tokens_per_step": profile.tokens_per_step(), "eval_points": profile.eval_points,
                        "cluster_fragments": profile.cluster_fragments,
                        "cluster_step_floor_ms": profile.cluster_step_floor_ms},
            "env": facts, "notes": notes, "seed_start": args.seed_start,
            "command": "python3 -m ddloco.bench.gpu_quality " + " ".join(sys.argv[1:] if argv is None else argv)}
    sweep = Sweep(out, work, plans, meta, merged)
    for p in plans:
        for lane in ("inproc", *cluster_lanes(p)):
            if args.only and lane.rstrip("0123456789") != args.only:
                continue
            report = work / f"{lane}-{p.size}"
            est = p.est_s["inproc" if lane == "inproc" else "cluster"]
            sweep.stages.append(Stage(f"{lane}-{p.size}", lane, p.size,
                                      compare_argv(p, lane, profile, device=device, config=work / "config.toml",
                                                   report=report, seed_start=args.seed_start),
                                      timeout_s=2.0 * est + STAGE_SLACK_S[args.dry], report=report,
                                      seeds=lane_seeds(p, lane, args.seed_start)))
    print(f"[gpu quality] device {meta['device_name']}, {len(plans)} size(s), lane budget {lane_s:.0f} s; "
          + "; ".join(f"{p.size}: {p.params / 1e6:.2f} M params, {p.tokens:,} tokens ({p.tokens_per_param:.2f}/param),"
                      f" est {p.est_s['inproc']:.0f}/{p.est_s['cluster']:.0f} s" for p in plans), file=sys.stderr,
          flush=True)
    for n in notes:
        print(f"[gpu quality] {n}", file=sys.stderr, flush=True)
    sweep.run_lanes(env, deadline)
    rows = sweep.write()
    missing = sweep.missing()
    if missing:
        print(f"[gpu quality] missing: {', '.join(missing)}", file=sys.stderr, flush=True)
    if not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    print(f"[gpu quality] done in {time.monotonic() - t0:.1f} s; outputs in {out}"
          + (f" (stage directories: {work})" if args.keep_work else ""), file=sys.stderr, flush=True)
    print(short_table(rows), flush=True)
    return 0 if plans and not missing else 1


if __name__ == "__main__":
    sys.exit(main())
