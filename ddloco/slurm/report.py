"""`ddloco slurm report`: a Slurm run's events as Slurm and the run saw them (RUN_DIR/report.json).

Slurm's side is RUN_DIR/slurm-events.jsonl (each learner job's start, SIGTERM and end, with its
array task and restart count: a requeued task starts again with restart > 0); the run's side is
its Redis event streams (each learner's join and leave, every merge), read through the services
job's Redis while it runs. Per learner id: its Slurm lives and its joins and leaves; for the run:
merges, the longest pause between two merges, and the merges during each learner's absence
(training went on without it).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common.files import read_env_file, write_atomic
from ddloco.slurm.plan import SlurmPlan


def slurm_events(root: Path) -> list[dict[str, Any]]:
    out = []
    path = root / "slurm-events.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue   # a line cut by a killed job
    return sorted(out, key=lambda e: e.get("t", 0.0))


def _admin_url(plan: SlurmPlan) -> str:
    env = read_env_file(plan.root / "endpoints.env")
    password = (plan.root / "keys" / "secret" / "redis.password").read_text().strip()
    return f"redis://:{password}@{env['DDLOCO_SERVICES_HOST']}:{plan.redis_port}/0"


def run_events(plan: SlurmPlan) -> list[dict[str, Any]]:
    from common import control
    from common.keys import Keys
    r = control.connect(_admin_url(plan))
    try:
        return control.read_events(r, Keys(plan.run_id))
    finally:
        r.close()


def summarize(slurm: list[dict[str, Any]], run: list[dict[str, Any]]) -> dict[str, Any]:
    """The report's content from both event lists (pure: tests feed it plain lists)."""
    merges = sorted(float(e["t"]) for e in run if e.get("kind") == "merge")
    gaps = [b - a for a, b in zip(merges, merges[1:])]
    learners: dict[str, dict[str, Any]] = {}
    for e in slurm:
        lid = e.get("learner", "?")
        learners.setdefault(lid, {"slurm": [], "run": []})["slurm"].append(
            {k: e.get(k) for k in ("t", "event", "job", "restart", "host", "rc")})
    for e in run:
        if e.get("kind") in ("join", "leave") and e.get("learner"):
            learners.setdefault(e["learner"], {"slurm": [], "run": []})["run"].append(
                {"t": float(e["t"]), "event": e["kind"], **({"reason": e["reason"]} if e.get("reason") else {})})
    for lid, rec in learners.items():
        rec["requeued"] = sum(1 for e in rec["slurm"] if e["event"] == "start" and (e.get("restart") or 0) > 0)
        rec["absences"] = _absences(rec["run"], merges)
    return {"merges": len(merges), "first_merge_t": merges[0] if merges else None,
            "last_merge_t": merges[-1] if merges else None,
            "longest_merge_pause_s": round(max(gaps), 3) if gaps else None,
            "learners": dict(sorted(learners.items()))}


def _absences(run: list[dict[str, Any]], merges: list[float]) -> list[dict[str, Any]]:
    """Each leave, the next join (if any) and how many merges the run made meanwhile."""
    out = []
    events = sorted(run, key=lambda e: e["t"])
    for i, e in enumerate(events):
        if e["event"] != "leave":
            continue
        back = next((x["t"] for x in events[i + 1:] if x["event"] == "join"), None)
        end = back if back is not None else float("inf")
        out.append({"left": e["t"], "back": back, "merges_meanwhile": sum(1 for t in merges if e["t"] <= t < end)})
    return out


def write_report(plan: SlurmPlan, say: Any = print) -> dict[str, Any]:
    rep = {"run_id": plan.run_id, "job_ids": plan.job_ids, **summarize(slurm_events(plan.root), run_events(plan))}
    write_atomic(plan.root / "report.json", json.dumps(rep, indent=2) + "\n")
    say(f"report     {plan.root / 'report.json'}: {rep['merges']} merges, longest pause between merges "
        f"{rep['longest_merge_pause_s']} s")
    for lid, rec in rep["learners"].items():
        lives = ", ".join(f"{e['event']}{'(restart ' + str(e['restart']) + ')' if e.get('restart') else ''}"
                          + (f" rc {e['rc']}" if e.get("rc") is not None else "") for e in rec["slurm"])
        away = "; ".join(f"left, {a['merges_meanwhile']} merges meanwhile, " + ("back" if a["back"] else "not back")
                         for a in rec["absences"])
        say(f"  {lid:<12} slurm: {lives or '-'} | run: {len(rec['run'])} join/leave" + (f" | {away}" if away else ""))
    return rep
