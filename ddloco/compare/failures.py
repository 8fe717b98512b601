"""`ddloco compare --chaos SPEC` / `--hetero SPEC`: the systems a user would pick, each on its real
engine, through the same seeded failures and the same emulated accelerator, side by side.

Systems:
- ``dp_elastic``: PyTorch DDP under torchrun's elastic agent (c10d rendezvous, ``--max-restarts``),
  a checkpoint every ``--checkpoint-every`` steps, the whole group restarted from it when a rank dies
  (``ddloco.compare.elastic_worker``);
- ``diloco_sync_elastic``: synchronous DiLoCo as a torch.distributed job (all-reduce of the outer
  gradients every H steps, outer Nesterov) under the same elastic restarts;
- ``torchft``: needs the optional ``torchft`` package; listed as skipped, with the reason, when it
  is not run;
- ``decoupled`` (ours, defaults: K = 1 + grace), ``decoupled_lockstep`` (K = M), ``decoupled_k1``
  (K = 1, no grace window): ``ddloco up`` with the schedule given to its chaos harness.

The schedule (``plan_schedule``) is drawn once per seed: learner (rank) i is SIGKILLed as a
Poisson process of mean ``learner_mtbf_s``, and ``stalls`` SIGSTOPs of ``stall_s``; times are
seconds after the system's first training step, the same for every system. A fault that finds
its rank down (restarting) hits nothing and is reported as missed.

Figures per system and seed (``compare.json``): ``goodput`` = Σ_r useful steps_r × the rank's
emulated step time ÷ Σ_r its provisioned time (first step to the end of its last process) (useful: steps whose result reached the final model:
DP's kept steps, our merged answers' steps; ALGORITHM §9), ``global_downtime_s`` (every gap longer
than max(1 s, 5 emulated steps) between advances of the training: the elastic jobs' steps, our
merges), ``wall_s_to_target``, ``eval_loss_at_wall`` (at the shortest span of the seed's
systems), ``eval_loss_final`` (at the token budget), ``restarts``, ``tokens_lost`` (trained then
discarded), ``bytes_per_token``, ``goodput_predicted`` (``ddloco.sim.replay`` on the same schedule).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from common.config import ConfigError, ConfigFile, RunConfig
from ddloco.compare.side_runs import run_elastic, run_ours, run_torchft
from ddloco.compare.side_setting import (CHAOS_DEFAULT, ELASTIC, HETERO_DEFAULT, KEYS, SIDE_SYSTEMS,  # noqa: F401
                                         Setting, goodput_of, meta_of, parse_hetero, plan_schedule,
                                         with_targets)
from ddloco.chaos_plan import Fault

# ------------------------------------------------------------------------------ the command
def torchft_installed() -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec("torchft") is not None
    except (ImportError, ValueError):
        return False


class SideBySide:
    """One `ddloco compare --chaos/--hetero`: per seed, the schedule, the target loss, every system
    (reused with --resume), then compare.json / compare.md / the plots."""

    def __init__(self, args: Any, argv: list[str], cfg: ConfigFile, run: RunConfig, per_batch: int,
                 steps: int, seeds: list[int], report: Path) -> None:
        from ddloco.chaos_plan import parse_chaos
        self.args, self.argv, self.cfg, self.run, self.report = args, argv, cfg, run, report
        self.seeds = seeds
        chaos = parse_chaos(args.chaos) if args.chaos else None
        hetero = parse_hetero(args.hetero) if args.hetero else None
        default = CHAOS_DEFAULT if chaos else HETERO_DEFAULT
        systems = [s.strip() for s in args.systems.split(",") if s.strip()] if args.systems else list(default)
        bad = [s for s in systems if s not in SIDE_SYSTEMS]
        if bad or not systems:
            raise ConfigError(f"with --chaos/--hetero the systems are {', '.join(SIDE_SYSTEMS)}; got {bad or systems}")
        self.systems = systems
        floor = args.step_time_floor_ms if args.step_time_floor_ms is not None else 200.0
        if floor <= 0:
            raise ConfigError("--step-time-floor-ms must be > 0 with --chaos/--hetero (the emulated accelerator)")
        self.st = Setting(learners=args.learners, steps=steps, per_batch=per_batch, floor_ms=floor,
                          factors=hetero.factors(args.learners) if hetero else [1.0] * args.learners,
                          noise=hetero.noise if hetero else 0.0, chaos=chaos,
                          checkpoint_every=args.checkpoint_every, syncers=args.syncers, insecure=args.insecure,
                          wall_cap=args.wall_cap,
                          device=args.device if args.device != "auto" else "cpu", eval_every_s=args.eval_every_s,
                          stall_s=chaos.stall_s if chaos else 20.0, gap_s=max(1.0, 5 * floor / 1000.0))
        self.chaos, self.hetero = chaos, hetero
        self.skipped: dict[str, str] = {}
        self.missing: list[str] = []
        self.failures: list[str] = []
        self.results: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
        self.t_start = time.time()
        print(f"compare    side by side: {', '.join(systems)} | M={args.learners} | {steps} steps per learner at "
              f"{floor:g} ms (failure-free {self.st.nominal_s / 60:.1f} min) | chaos {chaos} | hetero "
              f"{hetero} | seeds {seeds} | report {report}", flush=True)

    def faults(self, seed: int) -> list[Fault]:
        if self.chaos is None:
            return []
        return plan_schedule(replace(self.chaos, seed=self.chaos.seed + seed), self.st.learners, self.st.nominal_s)

    def target(self, seed: int) -> float:
        """--target-loss, else DP's loss without failures at half the budget (in process, the same
        mathematics as DDP)."""
        if self.args.target_loss is not None:
            return float(self.args.target_loss)
        cached = self.report / "runs" / f"target-s{seed}.json"
        key = {"run_digest": self.run.digest(), "learners": self.st.learners, "steps": self.st.steps // 2}
        try:
            old = json.loads(cached.read_text())
            if old.get("key") == key:
                return float(old["target_loss"])
        except (OSError, ValueError, KeyError):
            pass
        loss = self._dp_half_budget(seed)
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps({"key": key, "target_loss": loss}))
        return loss

    def _dp_half_budget(self, seed: int) -> float:
        from common.task import bind_task
        from ddloco.compare import systems
        from ddloco.compare.settings import apply_sets
        task, run = bind_task(apply_sets(self.run, {"task": {"seed": seed}}))
        res = systems.run_dp_emulated(task, run.algo, learners=self.st.learners, steps=max(1, self.st.steps // 2),
                                      seed=seed, eval_points=1, threads=1)
        return float(res.eval_loss_final)

    def identity(self, system: str, seed: int) -> dict[str, Any]:
        from dataclasses import asdict
        st = asdict(self.st)
        st["chaos"] = str(self.chaos)
        return {"system": system, "seed": seed, "setting": st, "run_digest": self.run.digest()}

    def one(self, system: str, seed: int, faults: list[Fault]) -> dict[str, Any] | None:
        from ddloco.compare.settings import apply_sets
        path = self.report / "runs" / f"{system}-s{seed}.json"
        if self.args.render_only and not path.exists():
            self.missing.append(f"{system} seed {seed}")
            print(f"missing    {system} seed {seed}: not run (--render-only)", flush=True)
            return None
        if (self.args.resume or self.args.render_only) and path.exists():
            try:
                old = json.loads(path.read_text())
                if old.get("identity") == self.identity(system, seed):
                    print(f"reused     {system} seed {seed} ({path})", flush=True)
                    self.derive(old, apply_sets(self.run, {"task": {"seed": seed}}), faults)
                    path.write_text(json.dumps(old, indent=1))   # with the figures as derived now
                    return old
            except (OSError, ValueError):
                pass
        run = apply_sets(self.run, {"task": {"seed": seed}})
        workdir = self.report / "runs" / f"{system}-s{seed}"
        t0 = time.time()
        if system in ELASTIC:
            res = run_elastic(system, run, self.st, seed=seed, workdir=workdir, faults=faults)
        elif system == "torchft":
            res = run_torchft(run, self.st, seed=seed, workdir=workdir, faults=faults)
        else:
            res = run_ours(system, replace(self.cfg, run=run), self.st, seed=seed, workdir=workdir, faults=faults)
            rep = json.loads(Path(res["extra"]["report"]).read_text())
            firsts = {}
            for x in sorted(rep["lives"], key=lambda x: x["started"]):
                if x["learner"] in firsts:   # a replacement: its start to its first step
                    res["extra"].setdefault("rejoins", []).append([x["started"], x["trains_from"]])
                firsts.setdefault(x["learner"], x)
        self.derive(res, run, faults)
        res["identity"] = self.identity(system, seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=1))
        hits = sum(1 for f in res["faults"] if f["hit"])
        print(f"[{time.time() - self.t_start:7.0f}s] {system:<20} seed {seed}: goodput {res['goodput']:.3f} "
              f"(predicted {res['goodput_predicted']:.3f}), span {res['span_s']:.0f}s, {hits} fault(s) hit, "
              f"{res['restarts']} restart(s), eval loss " + (f"{res['eval_loss_final']:.4f}" if res["eval_loss_final"]
                                                        is not None else f"- (capped at {res['span_s']:.0f}s)")
              + f" ({time.time() - t0:.0f}s)",
              flush=True)
        return res

    def derive(self, res: dict[str, Any], run: RunConfig, faults: list[Fault]) -> None:
        """The figures computed from a run's stored record (again for a reused run)."""
        from ddloco.sim.replay import predict_run
        res["schedule"] = [[f.at_s, f.kind, f.target] for f in faults]
        res["goodput"] = goodput_of(res, self.st)
        res["goodput_predicted"] = round(predict_run(res, meta_of(self.st, run))["goodput"], 4)

    def run_all(self) -> bool:
        for seed in self.seeds:
            faults = self.faults(seed)
            kills = sum(1 for f in faults if f.kind == "learner_kill" and f.at_s < self.st.nominal_s)
            print(f"schedule   seed {seed}: {kills} kill(s) within the failure-free duration "
                  f"({len(faults)} planned up to 4x it)", flush=True)
            target = self.target(seed)
            runs = []
            for system in self.systems:
                if system == "torchft" and not torchft_installed():
                    self.skipped[system] = "the optional torchft package is not installed (pip install torchft-nightly)"
                    continue
                try:
                    res = self.one(system, seed, faults)
                except KeyboardInterrupt:
                    print("interrupted: the finished runs are in DIR/runs (--resume goes on from them)",
                          file=sys.stderr, flush=True)
                    return False
                except Exception as e:
                    self.failures.append(f"{system} seed {seed}: {e}")
                    print(f"FAILED     {system} seed {seed}: {e}", file=sys.stderr, flush=True)
                    continue
                if res is not None:
                    runs.append(res)
            if runs:
                with_targets(runs, target)
                for r in runs:
                    self.results[r["system"]].append(r)
        return True

    def write(self) -> int:
        from common.exits import FAILURE, OK
        from common.files import write_atomic
        from ddloco.compare.summary import mean_ci
        systems: dict[str, Any] = {}
        for s, runs in self.results.items():
            if not runs:
                continue
            entry: dict[str, Any] = {"seeds": [r["seed"] for r in runs]}
            for key in (*KEYS, "goodput_predicted", "span_s"):
                vals = [r.get(key) for r in runs]
                nums = [float(v) for v in vals if v is not None]
                m, lo, hi = mean_ci(nums) if nums else (None, None, None)
                entry[key] = {"mean": m, "ci95": [lo, hi], "values": vals}
            entry["faults_hit"] = [sum(1 for f in r["faults"] if f["hit"]) for r in runs]
            systems[s] = entry
        meta = {**meta_of(self.st, self.run),
                "tokens": self.st.steps * self.st.learners * self.st.per_batch,
                "chaos": str(self.chaos) if self.chaos else None,
                "hetero": str(self.hetero) if self.hetero else None,
                "seeds": self.seeds, "target_loss": {str(r["seed"]): r["target_loss"] for v in self.results.values()
                                                     for r in v},
                "skipped": self.skipped, "failures": self.failures, "not_run": self.missing,
                "command": "ddloco compare " + " ".join(a for a in self.argv if a not in ("--resume", "--render-only")),
                "wall_s": round(time.time() - self.t_start, 1)}
        write_atomic(self.report / "compare.json", json.dumps({"meta": meta, "systems": systems}, indent=1))
        md = _markdown(systems, meta)
        write_atomic(self.report / "compare.md", md)
        if systems:
            from ddloco.compare.failure_plots import write_plots
            write_plots(self.report, self.results, systems)
        print(md, flush=True)
        return FAILURE if self.failures else OK


def _fmt(entry: dict[str, Any], digits: int = 3) -> str:
    m, (lo, hi) = entry["mean"], entry["ci95"]
    if m is None:
        return "never (capped)" if entry.get("capped") else "never"
    missing = sum(1 for v in entry["values"] if v is None)
    text = f"{m:.{digits}f}" if lo == hi else f"{m:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"
    return text + (f" ({missing} of {len(entry['values'])} never)" if missing else "")


def _markdown(systems: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [f"# ddloco compare, side by side: M = {meta['learners']}, {meta['steps_per_learner']} steps per learner "
             f"at {meta['step_time_floor_ms']:g} ms, seeds {meta['seeds']}",
             "", f"chaos: {meta['chaos']}; hetero: {meta['hetero']} (factors {meta['factors']}); "
             f"checkpoint every {meta['checkpoint_every']} steps. Mean [95 % CI] over seeds.", "",
             "| system | goodput | predicted (sim) | global downtime s | wall s to target | eval loss at equal wall "
             "| eval loss at equal tokens | restarts | tokens lost | bytes/token | faults hit |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s, e in systems.items():
        lines.append(f"| {s} | {_fmt(e['goodput'])} | {_fmt(e['goodput_predicted'])} | {_fmt(e['global_downtime_s'], 1)} "
                     f"| {_fmt(e['wall_s_to_target'], 1)} | {_fmt(e['eval_loss_at_wall'], 4)} "
                     f"| {_fmt(e['eval_loss_final'], 4)} | {_fmt(e['restarts'], 1)} | {_fmt(e['tokens_lost'], 0)} "
                     f"| {_fmt(e['bytes_per_token'], 1)} | {e['faults_hit']} |")
    for s, why in meta["skipped"].items():
        lines.append(f"| {s} | skipped: {why} | | | | | | | | | |")
    if meta["failures"]:
        lines += ["", "Failed runs: " + "; ".join(meta["failures"])]
    if meta.get("not_run"):
        lines += ["", "Not run: " + "; ".join(meta["not_run"])]
    return "\n".join(lines) + "\n"
