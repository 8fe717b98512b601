"""The figures of an `up` run from what its monitor collected (ddloco/monitor.py): goodput, uptime
(ALGORITHM §9), learner processes, and whether the run worked. Pure functions of their inputs
(no Redis, no clock but ``now``), called on `up`'s main thread.
"""
from __future__ import annotations

import json
import time
from typing import Any, Iterable


def as_float(h: dict[str, str], k: str, default: float = 0.0) -> float:
    """Field ``k`` of a Redis hash as a float (``default`` when missing or not a number)."""
    try:
        return float(h.get(k, default))
    except (TypeError, ValueError):
        return default


_f = as_float


def learner_time(slots: Iterable[list[dict[str, str]]], t0: float,
                 now: float | None = None) -> tuple[float, float, float]:
    """(provisioned, useful, flushing) learner seconds over the learner slots, each slot the
    counters of its processes. Goodput is useful / provisioned: a slot is provisioned from its
    first step (the first process joined) to its last process's end (``now`` for one still
    running), gaps between a killed process and its replacement and the replacement's boot
    included; useful is the time in inner steps of every process in it (a killed one: up to its
    last heartbeat; a step is counted at most 3x the learner's usual step time, so a frozen
    process earns nothing)."""
    now = time.time() if now is None else now
    provisioned = useful = flushing = 0.0
    for mine in slots:
        if not mine:
            continue
        start = min(_f(h, "started_at", t0) + _f(h, "boot_s") for h in mine)
        end = max(_f(h, "stopped_at", 0.0) or _f(h, "updated_at", now) for h in mine)
        provisioned += max(0.0, end - start)
        useful += sum(_f(h, "train_s") for h in mine)
        flushing += sum(_f(h, "flush_s") for h in mine)
    return provisioned, useful, flushing


def merged_steps(merges: list[dict[str, Any]], fragments: int) -> dict[str, float]:
    """Per learner: the inner steps its merged answers carried, averaged over the fragments (a
    step reaches the global model once per fragment; steps of answers that were never merged,
    such as a killed process's last ones, are absent). From the merge events' ``steps``."""
    out: dict[str, float] = {}
    for e in merges:
        try:
            steps = json.loads(e.get("steps", "[]")) if isinstance(e.get("steps"), str) else e.get("steps", [])
            pairs = list(zip(e["contributors"], (int(x) for x in steps)))
        except (TypeError, ValueError):
            continue
        for lid, n in pairs:
            out[lid] = out.get(lid, 0.0) + n / max(1, fragments)
    return {lid: round(v, 2) for lid, v in sorted(out.items())}


def life_spans(lives: Iterable[tuple[tuple[str, str], dict[str, str]]], t0: float) -> list[dict[str, Any]]:
    """Every learner process ((id, incarnation) → its counters): id, incarnation, started (process
    start), trains_from (its first step), ended (its stop, else its last heartbeat), steps;
    seconds after ``t0``."""
    out = []
    for (lid, inc), h in lives:
        start = _f(h, "started_at", t0)
        out.append({"learner": lid, "incarnation": inc,
                    "started": round(start - t0, 3), "trains_from": round(start + _f(h, "boot_s") - t0, 3),
                    "ended": round((_f(h, "stopped_at", 0.0) or _f(h, "updated_at", t0)) - t0, 3),
                    "steps": int(_f(h, "steps"))})
    return sorted(out, key=lambda x: (x["learner"], x["started"]))


def global_downtime(merge_times: list[float], learners: list[dict[str, str]], t0: float, *,
                    gap_s: float) -> tuple[float, float]:
    """(downtime, span) seconds of training (the first learner joined to the last one stopped):
    downtime is every gap between merges longer than ``gap_s``; uptime = 1 - downtime / span."""
    joined = [(_f(h, "started_at") + _f(h, "boot_s")) for h in learners if _f(h, "boot_s") > 0]
    train_start = min(joined) if joined else t0
    train_end = max([_f(h, "stopped_at", 0.0) for h in learners] + [train_start])
    points = [train_start] + sorted(t for t in merge_times if train_start <= t <= train_end) + [train_end]
    downtime = sum(b - a for a, b in zip(points, points[1:]) if b - a > gap_s)
    return downtime, max(1e-9, train_end - train_start)


def learner_processes(lives: dict[tuple[str, str], dict[str, str]], events: list[dict[str, Any]],
                      learners: dict[str, dict[str, str]]) -> int:
    """Learner processes of the run: each (learner id, incarnation) seen in its counters, a join
    event or the learners' table."""
    return len({(lid, h.get("incarnation")) for (lid, _), h in lives.items()}
               | {(e.get("learner"), e.get("incarnation")) for e in events
                  if e.get("kind") == "join" and e.get("incarnation")}
               | {(lid, h.get("incarnation")) for lid, h in learners.items() if h.get("incarnation")})


def problems(rep: dict[str, Any]) -> list[str]:
    """Why a run that ended without a failure still did not work (empty: it did): a fragment
    that never merged or stopped merging (its values stayed behind), or a final model no
    better than the initial one."""
    out = []
    if rep.get("fragments_never_merged"):
        out.append(f"fragment(s) {', '.join(map(str, rep['fragments_never_merged']))} never merged "
                   f"(their values are the initial model's)")
    out += [line for p, line in rep.get("fragments_lagging", {}).items()
            if int(p) not in rep.get("fragments_never_merged", [])]
    ini, fin = rep.get("eval_loss_initial"), rep.get("eval_loss_final")
    if ini is not None and fin is not None and not fin < ini and not rep.get("resumed_from"):
        out.append(f"the final model's eval loss {fin:.4f} is not below the initial {ini:.4f}")
    return out


def summary_line(rep: dict[str, Any]) -> str:
    """`up`'s closing line: the run's headline figures from its report."""
    ini, fin = rep["eval_loss_initial"], rep["eval_loss_final"]
    ratio = f" ({fin / ini:.2f}x)" if ini and fin else ""
    head = "interrupted" if rep.get("interrupted") else "done"
    return (f"{head:<10} run {rep['run_id']}: {rep['wall_s']:.0f}s wall, {rep['steps_total']} steps, "
            f"{rep['merges']} merges, "
            f"eval loss {ini if ini is None else round(ini, 3)} -> {fin if fin is None else round(fin, 3)}{ratio}, "
            f"goodput {rep['goodput']:.2f} (learner time spent training; {rep.get('flush_share', 0):.0%} went to "
            f"the final flush), uptime {rep['uptime']:.2f} (wall time the global model advanced), "
            f"every learner contributed: {rep['every_learner_contributed']}, "
            f"every fragment merged: {rep['every_fragment_merged']}, processes left: {len(rep['processes_left'])}")
