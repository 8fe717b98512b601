"""The goodput simulator on a given failure schedule (``ddloco sim replay``): what each system's
goodput should be when rank i is killed at the schedule's times, from a handful of costs.

Model (ALGORITHM §9's accounting, per system):
- ``dp_elastic`` / ``diloco_sync_elastic`` (and ``torchft`` read as elastic DP): the group steps at
  the slowest rank's pace; a kill that finds the group training loses every step since the last
  checkpoint (a multiple of ``checkpoint_every``; of H too for sync DiLoCo) and stops the group
  for ``restart_s``; a kill while it restarts hits nothing.
- ``decoupled`` / ``decoupled_k1``: every learner on its own; a kill loses the steps since its
  last answer, (H − 1) / 2 on average over the staggered fragments, and takes that learner out
  for ``rejoin_s``; the others go on.
- ``decoupled_lockstep`` (K = M): every round waits for all M, so a kill stops every learner for
  ``rejoin_s`` and the group runs at the slowest learner's pace.

Goodput = Σ_r kept steps_r × step_s_r ÷ (M × span). The costs are inputs (the elastic group's
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


def predict(system: str, faults: Sequence[Any], *, learners: int, steps: int, step_s: float,
            factors: Sequence[float], checkpoint_every: int, sync_every: int, restart_s: float,
            rejoin_s: float, cap_s: float = float("inf")) -> dict[str, float]:
    """{goodput, span_s, lost_steps} of ``system`` on the schedule (times after the first step);
    a system still short of ``steps`` at ``cap_s`` is counted up to there (the steps its model
    holds then)."""
    M = learners
    step_r = [step_s * f for f in factors]
    useful_full = sum(steps * s for s in step_r)
    kills = _kills(faults, M)
    if system in ("dp_elastic", "diloco_sync_elastic", "torchft"):
        every = checkpoint_every
        if system == "diloco_sync_elastic" and every % sync_every:
            every = max(sync_every, every // sync_every * sync_every)
        if system == "torchft":
            every = 1                                   # live recovery from a peer: nothing rolled back
        T = max(step_r)
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
        T = max(step_r)
        n = sum(len(k) for k in kills if k)
        span = steps * T + n * rejoin_s
        hit = sum(1 for ks in kills for tk in ks if tk < span)
        span = steps * T + hit * rejoin_s
        lost = hit * lost_per_kill
        return {"goodput": (useful_full - lost * sum(step_r) / M) / (M * span), "span_s": span, "lost_steps": lost}
    ends, lost = [], 0.0
    for r in range(M):
        t = steps * step_r[r]
        for tk in kills[r]:
            if tk < t:
                t += rejoin_s
                lost += lost_per_kill
        ends.append(t)
    span = max(ends)
    return {"goodput": (useful_full - lost * sum(step_r) / M) / (M * span), "span_s": span, "lost_steps": lost}
