"""The goodput simulator on a given failure schedule (``ddloco sim replay``): what each system's
goodput should be when rank i is killed at the schedule's times, from a handful of costs.

Model (ALGORITHM §9's accounting, per system):
- ``torchft``: the live replica groups go on at the slowest one's pace; a killed one is out for
  ``rejoin_s`` (a new process that recovers from a peer), every kill costs each group its failed step.
- ``dp_elastic`` / ``diloco_sync_elastic``: the group steps at
  the slowest rank's pace; a kill that finds the group training loses every step since the last
  checkpoint (a multiple of ``checkpoint_every``; of H too for sync DiLoCo) and stops the group
  for ``restart_s``; a kill while it restarts hits nothing.
- ``decoupled`` / ``decoupled_k1``: every learner on its own; a kill loses the steps since its
  last answer, (H − 1) / 2 on average over the staggered fragments, and takes that learner out
  for ``rejoin_s``; the others go on.
- ``decoupled_lockstep`` (K = M): every round waits for all M, and a learner answers only after a
  whole block of H steps (the barrier). A kill k steps into a block loses those k steps, and its
  replacement trains a whole block from ``rejoin_s`` after the kill while the others finish theirs
  (H − k steps) and wait: the group stops for ``rejoin_s`` + k steps, (H − 1) / 2 on average; it
  runs at the slowest learner's pace. (A first model charged ``rejoin_s`` + H steps: −6.6 and −6.5
  points on two seeds, docs/results/side_by_side.md.)

With ``noise`` a group that waits for every rank steps at the mean of the slowest noisy rank
(per step for DP and torchft, per H-step block for sync DiLoCo and lock-step).
Goodput = Σ_r kept steps_r × step_s_r ÷ Σ_r provisioned_r, a rank provisioned from the first step
to its own end (the elastic jobs' and lock-step ranks all end together; our learners each when
their budget is done). The costs are inputs (the elastic group's
cold start, a learner's rejoin), not fitted to the goodput being predicted.
"""
from __future__ import annotations

from typing import Any, Sequence


def _kills(faults: Sequence[Any], learners: int) -> list[list[float]]:
    out: list[list[float]] = [[] for _ in range(learners)]
    for f in faults:
        kind = f["kind"] if isinstance(f, dict) else f.kind
        if kind != "learner_kill":
            continue
        target = f["target"] if isinstance(f, dict) else f.target
        at = f.get("at_s", f.get("t")) if isinstance(f, dict) else f.at_s
        out[int(str(target).rsplit("-", 1)[-1])].append(float(at))
    return [sorted(x) for x in out]


def paced_step(step_r: Sequence[float], noise: float, block: int = 1, samples: int = 4096) -> float:
    """The mean time a group that waits for all its ranks takes per step when each rank's step is
    step_r × max(0.2, 1 + noise·N(0, 1)) and the group meets every ``block`` steps (a seeded Monte
    Carlo estimate; without noise, the slowest rank's step)."""
    if noise <= 0:
        return max(step_r)
    import numpy as np
    rng = np.random.default_rng(0)
    draws = np.maximum(0.2, 1.0 + noise * rng.standard_normal((samples, block, len(step_r))))
    per_block = (draws * np.asarray(step_r)).sum(axis=1)                 # [samples, ranks]
    return float(per_block.max(axis=1).mean() / block)


def predict(system: str, faults: Sequence[Any], *, learners: int, steps: int, step_s: float,
            factors: Sequence[float], checkpoint_every: int, sync_every: int, restart_s: float,
            rejoin_s: float, cap_s: float = float("inf"), noise: float = 0.0) -> dict[str, float]:
    """{goodput, span_s, lost_steps} of ``system`` on the schedule (times after the first step);
    a system still short of ``steps`` at ``cap_s`` is counted up to there (the steps its model
    holds then)."""
    M = learners
    step_r = [step_s * f for f in factors]
    kills = _kills(faults, M)
    if system == "torchft":
        # the live replicas go on; a killed one is out for rejoin_s (a new process recovering from a
        # peer); each kill costs every replica the step that failed; the run ends at the global step
        T = paced_step(step_r, noise)
        n = sum(len(k) for k in kills)
        span = min(cap_s, (steps + n) * T)
        down = [sum(min(rejoin_s, max(0.0, span - tk)) for tk in ks if tk < span) for ks in kills]
        useful = sum(max(0.0, span - down[r] - n * T) / T * step_r[r] for r in range(M))
        return {"goodput": useful / (M * span), "span_s": span, "lost_steps": float(n * M)}
    if system in ("dp_elastic", "diloco_sync_elastic"):
        every = checkpoint_every
        if system == "diloco_sync_elastic" and every % sync_every:
            every = max(sync_every, every // sync_every * sync_every)
        T = paced_step(step_r, noise, sync_every if system == "diloco_sync_elastic" else 1)
        events = sorted(t for ks in kills for t in ks)
        t, step, lost = 0.0, 0, 0
        for tk in [*events, float("inf")]:
            if tk < t:
                continue                                # the group is restarting: nothing to kill
            until = min(tk, cap_s)
            k = steps - step if until == float("inf") else int((until - t) / T) if until > t else 0
            if step + k >= steps:
                t += (steps - step) * T
                step = steps
                break
            if tk >= cap_s:                             # still short of the budget at the cap
                step += k
                t = cap_s
                break
            step += k
            keep = step // every * every
            lost += (step - keep) * M
            step, t = keep, tk + restart_s
            if t >= cap_s:
                t = cap_s
                break
        useful = sum(step * s for s in step_r)
        return {"goodput": useful / (M * t), "span_s": t, "lost_steps": float(lost)}
    lost_per_kill = (sync_every - 1) / 2
    if system == "decoupled_lockstep":
        T = paced_step(step_r, noise, sync_every)
        stop_s = rejoin_s + lost_per_kill * T   # the others finish their block, then wait at the barrier
        end, hit = steps * T, 0
        for tk in sorted(t for ks in kills for t in ks):   # in time order: each hit pushes the end
            if tk >= min(end, cap_s):
                break
            end, hit = end + stop_s, hit + 1
        span = min(end, cap_s)
        done = min(float(steps), max(0.0, (span - hit * stop_s) / T))
        lost = hit * lost_per_kill
        return {"goodput": (done * sum(step_r) - lost * sum(step_r) / M) / (M * span), "span_s": span,
                "lost_steps": lost}
    ends, useful, lost = [], 0.0, 0.0
    for r in range(M):
        t, mine = steps * step_r[r], 0.0
        for tk in kills[r]:
            if tk < t:
                t += rejoin_s
                mine += lost_per_kill
        ends.append(t)
        useful += (steps - mine) * step_r[r]
        lost += mine
    # every learner is provisioned until its own budget is done (none waits for another)
    return {"goodput": useful / sum(ends), "span_s": max(ends), "lost_steps": lost}


def predict_run(res: dict[str, Any], meta: dict[str, Any]) -> dict[str, float]:
    """``predict`` for one run of `ddloco compare --chaos/--hetero` (its record ``res``: system,
    schedule, launch_s, rejoins; ``meta``: the comparison's setting). The costs come from outside
    the failures: the elastic group's cold start (launch to first step; also a torchft replica's
    rejoin) and our replacement learners' start to first step (median; 1 s when none)."""
    from statistics import median
    system = res["system"]
    restart_s = float(res.get("launch_s", 0.0))
    rejoin = [float(b - a) for a, b in res.get("extra", {}).get("rejoins", [])]
    if system == "torchft":
        rejoin = [restart_s]
    schedule = [{"at_s": a, "kind": k, "target": t} for a, k, t in res.get("schedule", [])]
    return predict(system, schedule, learners=int(meta["learners"]), steps=int(meta["steps_per_learner"]),
                   step_s=float(meta["step_time_floor_ms"]) / 1000.0, factors=meta["factors"],
                   checkpoint_every=int(meta["checkpoint_every"]), sync_every=int(meta["sync_every_steps"]),
                   restart_s=restart_s, rejoin_s=median(rejoin) if rejoin else 1.0,
                   cap_s=float(meta["cap_s"]), noise=float(meta.get("noise", 0.0)))


def replay_dir(report: str) -> list[dict[str, Any]]:
    """Predicted vs measured goodput of every run of a `ddloco compare --chaos/--hetero` report."""
    import json
    from pathlib import Path
    root = Path(report)
    meta = json.loads((root / "compare.json").read_text())["meta"]
    rows = []
    for path in sorted((root / "runs").glob("*-s*.json")):
        res = json.loads(path.read_text())
        if "system" not in res or "schedule" not in res:
            continue
        p = predict_run(res, meta)
        rows.append({"system": res["system"], "seed": res["seed"], "measured": res["goodput"],
                     "predicted": round(p["goodput"], 4), "span_s": res["span_s"],
                     "predicted_span_s": round(p["span_s"], 1)})
    return rows
