"""``make gpu-quality``'s results: the figures collected from the stages' compare runs, the
table (markdown and short), the plot of the ratio to DP against parameters with the published
points (standard library only at import; matplotlib inside ``plot``)."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Iterable, Sequence

from ddloco.bench.quality_plan import LEARNERS, PUBLISHED, SYSTEMS, SizePlan

# ------------------------------------------------------------------------------------ results
def collect(stage_dirs: Iterable[tuple[str, Path, int]]) -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
    """{size: {system: {seed: run}}} from the stages' ``runs/SYSTEM-sSEED.json``; a cluster run
    whose compare record is missing is read from its own report.json when it trained the whole
    budget (a failure after the report, e.g. a plot, loses nothing). ``stage_dirs``: (size,
    directory, the size's planned tokens)."""
    out: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    for size, d, tokens in stage_dirs:
        runs = d / "runs"
        if not runs.is_dir():
            continue
        for f in sorted(runs.glob("*-s*.json")):
            m = re.fullmatch(r"(.+)-s(\d+)\.json", f.name)
            try:
                r = json.loads(f.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            if m and _finite(r.get("eval_loss_final")) and r.get("tokens") == tokens:
                out.setdefault(size, {}).setdefault(m.group(1), {})[m.group(2)] = _slim(r)
        for rep in sorted(runs.glob("decoupled-s*/report.json")):
            seed = rep.parent.name.rsplit("-s", 1)[1]
            have = out.get(size, {}).get("decoupled", {}).get(seed)
            r = have if have is not None else _from_report(rep, tokens)
            if r is not None:
                r.update(cluster_health(rep))
                out.setdefault(size, {}).setdefault("decoupled", {})[seed] = r
    return out


BEHIND_LIMIT = 0.10
"""A cluster run with more of its merges behind schedule than this trained on stale global values
(its rounds could not keep up with its learners' steps): its ratio measures the harness, not the
algorithm, and the table says so."""
LATE_LIMIT = 0.10
"""Nor one with more of its answers late than this: uneven learners (several sharing one GPU)
whose slow ones miss the rounds the fast ones closed; their steps reach the model late or not at
all (an H200 run: 39 % late, 78 % of the learners' steps merged)."""


STALE_MIN_MERGES = 20
"""A cluster run with fewer merges is not judged (one start-up round behind of four is 25 %)."""


def cluster_health(report: Path) -> dict[str, Any]:
    """From a cluster's report.json: the fraction of merges behind schedule (a round opened later
    than its fragment's turn, ``rounds_behind`` ÷ merges) and of answers that came after their round
    merged (``late_answers`` ÷ all answers), summed over the shards; and the fragments it ran with.
    Empty when the report cannot be read."""
    try:
        rep = json.loads(report.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(rep, dict):
        return {}
    shards = [h for h in (_dict(rep.get("shard_stats")) or {}).values() if isinstance(h, dict)]

    def count(key: str) -> float | None:   # None when any shard's figure is unreadable
        total = 0.0
        for h in shards:
            try:
                v = float(h.get(key) or 0)
            except (TypeError, ValueError):
                return None
            if not math.isfinite(v) or v < 0:
                return None
            total += v
        return total
    merges, behind, late, answers = count("merges"), count("rounds_behind"), count("late_answers"), count("answers")
    out: dict[str, Any] = {
        "merges": int(merges) if merges is not None else None,
        "behind_fraction": round(behind / merges, 4) if merges and behind is not None else None,
        "late_fraction": round(late / (late + answers), 4)
        if late is not None and answers is not None and late + answers else None}
    fragments = (_dict(_dict(rep.get("config")).get("algo"))).get("fragments")
    if isinstance(fragments, int) and fragments >= 1:
        out["fragments"] = fragments
    steps, merged = _learner_steps(rep)
    if steps:
        out["merged_share"] = round(merged / steps, 4)
    return out


def _learner_steps(rep: dict[str, Any]) -> tuple[float, float]:
    """(steps the learners took, of them merged into the global model) summed over learners;
    (0, 0) when either is unreadable."""
    stats, merged = _dict(rep.get("learner_stats")), rep.get("merged_steps")
    if not isinstance(merged, dict) or not merged:      # a report of a version that did not record it
        return 0.0, 0.0
    try:
        steps = sum(float(_dict(h).get("steps") or 0) for h in stats.values())
        done = sum(float(v) for v in merged.values())
    except (TypeError, ValueError):
        return 0.0, 0.0
    if not (math.isfinite(steps) and math.isfinite(done)) or steps <= 0 or done < 0:
        return 0.0, 0.0
    return steps, min(done, steps)


def _dict(x: Any) -> dict[str, Any]:
    return x if isinstance(x, dict) else {}


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _slim(r: dict[str, Any]) -> dict[str, Any]:
    keep = ("eval_loss_final", "tokens", "steps", "wall_s", "bytes_per_token", "curve")
    out = {k: r[k] for k in keep if k in r}
    extra = r.get("extra", {})
    out.update({k: extra[k] for k in ("device", "merges", "goodput", "backend", "step_time_floor_ms") if k in extra})
    return out


def _from_report(path: Path, tokens: int) -> dict[str, Any] | None:
    try:
        rep = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not _finite(rep.get("eval_loss_final")) or rep.get("timed_out") or not rep.get("eval_curve"):
        return None
    if not int(rep["eval_curve"][-1]["tokens"]) == int(rep.get("tokens_total", -1)) == tokens:
        return None
    return {"eval_loss_final": float(rep["eval_loss_final"]), "tokens": int(rep["tokens_total"]),
            "wall_s": rep.get("wall_s"), "recovered_from": "report.json"}


def table_rows(results: dict[str, dict[str, dict[str, dict[str, Any]]]], plans: Sequence[SizePlan]
               ) -> list[dict[str, Any]]:
    """One row per planned size: mean eval loss per system, ratios to dp_emulated paired by
    seed (mean over the seeds both ran), seeds."""
    rows = []
    for p in plans:
        by = results.get(p.size, {})
        row: dict[str, Any] = {"size": p.size, "params": p.params, "tokens": p.tokens,
                               "tokens_per_param": p.tokens_per_param}
        for system in SYSTEMS:
            runs = by.get(system, {})
            row[system] = (sum(r["eval_loss_final"] for r in runs.values()) / len(runs)) if runs else None
            row[f"{system}_seeds"] = sorted(int(s) for s in runs)
        health = [r.get("behind_fraction") for r in by.get("decoupled", {}).values()
                  if (r.get("merges") or 0) >= STALE_MIN_MERGES]   # a few merges (a dry run's) say nothing
        row["decoupled_behind"] = max((h for h in health if h is not None), default=None)
        late = [r.get("late_fraction") for r in by.get("decoupled", {}).values()
                if (r.get("merges") or 0) >= STALE_MIN_MERGES]
        row["decoupled_late"] = max((x for x in late if x is not None), default=None)
        row["decoupled_fragments"] = sorted({r.get("fragments") for r in by.get("decoupled", {}).values()},
                                            key=lambda f: (f is None, f or 0))
        shares = [r.get("merged_share") for r in by.get("decoupled", {}).values()]
        row["decoupled_merged_share"] = min((x for x in shares if x is not None), default=None)
        row["decoupled_floor_ms"] = sorted({r.get("step_time_floor_ms") for r in by.get("decoupled", {}).values()},
                                           key=lambda f: (f is None, f or 0))
        dp = by.get("dp_emulated", {})
        for system in ("diloco_sync", "decoupled"):
            paired = [by[system][s]["eval_loss_final"] / dp[s]["eval_loss_final"]
                      for s in by.get(system, {}) if s in dp]
            row[f"{system}_ratio"] = sum(paired) / len(paired) if paired else None
            row[f"{system}_ratio_seeds"] = len(paired)
        rows.append(row)
    return rows


def _fmt(x: Any, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def markdown(rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"# Quality with scale: {meta.get('device_name') or meta.get('device')}, M = {LEARNERS}", "",
             f"Command: `{meta.get('command', '')}`", "",
             "| size | params | tokens | tokens/param | dp (emulated) | diloco_sync | decoupled | "
             "diloco_sync ÷ dp | decoupled ÷ dp | cluster: merges behind / answers late / steps merged | "
             "seeds (dp/sync/dec) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    stale = []
    for r in rows:
        seeds = "/".join(str(len(r[f"{s}_seeds"])) for s in SYSTEMS)
        behind = r.get("decoupled_behind")
        late = r.get("decoupled_late")
        mark = ""
        if (behind is not None and behind > BEHIND_LIMIT) or (late is not None and late > LATE_LIMIT):
            mark, stale = " (stale)", [*stale, r["size"]]
        health = "–" if behind is None else (f"{behind:.1%} / {_fmt(late, '.1%')} / "
                                               f"{_fmt(r.get('decoupled_merged_share'), '.1%')}")
        frags = r.get("decoupled_fragments") or []
        if frags:
            health += " · " + ",".join("?" if f is None else str(f) for f in frags) + " fragments"
        floors = [f for f in r.get("decoupled_floor_ms") or [] if f]
        if floors:
            health += " · steps ≥ " + ",".join(f"{f:g}" for f in floors) + " ms"
        lines.append(f"| {r['size']} | {r['params'] / 1e6:.2f} M | {r['tokens']:,} | {r['tokens_per_param']:.2f} | "
                     f"{_fmt(r['dp_emulated'], '.4f')} | {_fmt(r['diloco_sync'], '.4f')} | "
                     f"{_fmt(r['decoupled'], '.4f')} | {_fmt(r['diloco_sync_ratio'], '.4f')} | "
                     f"{_fmt(r['decoupled_ratio'], '.4f')}{mark} | {health} | {seeds} |")
    lines += ["", "Ratios: each system's final eval loss ÷ dp_emulated's at the same seed, mean over seeds. "
              "Published at 20 tokens/param, H = 30: DiLoCo M=4 1.020 (35 M), 1.015 (90 M); "
              "Streaming DiLoCo 1.026 (35 M), 1.019 (100 M)."]
    if stale:
        lines.append(f"- (stale) {', '.join(stale)}: more than {BEHIND_LIMIT:.0%} of the cluster's merges were behind "
                     f"schedule (its rounds did not keep up with its learners' steps; they trained on stale global "
                     f"values) or more than {LATE_LIMIT:.0%} of its answers late (learners stepping unevenly on a "
                     "shared device; their steps reached the model late or not at all): that ratio measures the "
                     "harness, not the algorithm. Fewer fragments (--cluster-fragments) or a step-time floor "
                     "(--cluster-step-floor-ms) keep the rounds up.")
    for note in meta.get("notes", []):
        lines.append(f"- {note}")
    return "\n".join(lines) + "\n"


def short_table(rows: Sequence[dict[str, Any]]) -> str:
    head = f"{'size':>8} {'params':>9} {'tok/par':>7} {'dp':>7} {'sync':>7} {'dec':>7} {'sync/dp':>8} {'dec/dp':>8}"
    body = [f"{r['size']:>8} {r['params'] / 1e6:>8.2f}M {r['tokens_per_param']:>7.2f} {_fmt(r['dp_emulated'], '7.4f')} "
            f"{_fmt(r['diloco_sync'], '7.4f')} {_fmt(r['decoupled'], '7.4f')} {_fmt(r['diloco_sync_ratio'], '8.4f')} "
            f"{_fmt(r['decoupled_ratio'], '8.4f')}" for r in rows]
    return "\n".join([head, *body])


def plot(path: Path, rows: Sequence[dict[str, Any]], title: str) -> bool:
    """Ratio to DP vs parameters (log x): ours per system, the published points. False: no matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False
    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for system, marker in (("diloco_sync", "s"), ("decoupled", "o")):
        pts = [(r["params"], r[f"{system}_ratio"]) for r in rows if r[f"{system}_ratio"] is not None]
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker=marker, label=f"ours: {system} ÷ dp")
    for r in rows:    # what each of our sizes trained on
        ys = [r[f"{s}_ratio"] for s in ("diloco_sync", "decoupled") if r[f"{s}_ratio"] is not None]
        if ys:
            ax.annotate(f"{r['tokens_per_param']:.2g} tok/param", (r["params"], max(ys)), fontsize=7,
                        textcoords="offset points", xytext=(4, 6))
    for label, marker in (("DiLoCo M=4 (Charles et al. 2025)", "^"), ("Streaming DiLoCo", "v")):
        pts = [(x, y) for x, y, lab in PUBLISHED if lab == label]
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker=marker, linestyle=":", color="grey"
                if marker == "^" else "black", label=f"published: {label}, 20 tok/param")
    ax.axhline(1.0, color="lightgrey", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("final eval loss ÷ data-parallel's")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True
